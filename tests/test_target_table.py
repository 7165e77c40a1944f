"""The one table of targets (sparsegen/targets.py): every name has its backend's chip facts,
and a backend's chips are held to the table's names."""

import pytest

from sparsegen.backends import chip_of
from sparsegen.gpu.targets import GPU_TARGETS, GpuTarget
from sparsegen.targets import BACKEND_OF, DEFAULT_TARGET, backend_of, chips_for, is_gpu, names_of
from sparsegen.tpu.targets import TARGETS, Target


def test_every_target_has_its_backends_chip():
    assert sorted(TARGETS) == names_of("tpu") and sorted(GPU_TARGETS) == names_of("gpu")
    for name, backend in BACKEND_OF.items():
        chip = chip_of(name)
        assert chip.name == name
        assert isinstance(chip, {"tpu": Target, "gpu": GpuTarget}[backend])
        assert is_gpu(name) == (backend == "gpu") == (backend_of(name) == "gpu")
    assert backend_of(DEFAULT_TARGET) == "tpu"


def test_unknown_target():
    assert not is_gpu("a100")
    with pytest.raises(KeyError):
        backend_of("a100")
    with pytest.raises(KeyError):
        chip_of("a100")


def test_chips_are_held_to_the_table():
    h100, h200 = GPU_TARGETS["h100"], GPU_TARGETS["h200"]
    assert chips_for("gpu", (h100, h200)) == GPU_TARGETS
    with pytest.raises(AssertionError, match="not the table's"):
        chips_for("gpu", (h100,))  # a target without its chip
    with pytest.raises(AssertionError, match="not the table's"):
        chips_for("tpu", (*TARGETS.values(), h100))  # a chip the table gives another backend

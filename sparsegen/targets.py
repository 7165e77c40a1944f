"""Every target sparsegen builds for, by name, with the backend that owns it: the one table
that says whether a target is a TPU or a GPU (the driver's lowering table, the CLI, the JAX
window a module states). A target's chip facts stay with its backend (`tpu/targets.py`
`TARGETS`, `gpu/targets.py` `GPU_TARGETS`, found through `backends.chip_of`); each backend
builds its chips through `chips_for`, which holds them to this table's names.
"""

from __future__ import annotations

from collections.abc import Iterable

# Target name -> backend ("tpu": Pallas Mosaic TPU; "gpu": Mosaic GPU).
BACKEND_OF: dict[str, str] = {
    "v4": "tpu",
    "v5e": "tpu",
    "v5p": "tpu",
    "v6e": "tpu",
    "h100": "gpu",
    "h200": "gpu",
}

DEFAULT_TARGET = "v5e"


def backend_of(target: str) -> str:
    """"tpu" or "gpu"; a KeyError for a name that is no target."""
    return BACKEND_OF[target]


def is_gpu(target: str) -> bool:
    """A GPU target (False for a name that is no target)."""
    return BACKEND_OF.get(target) == "gpu"


def names_of(backend: str) -> list[str]:
    """The targets of a backend, sorted."""
    return sorted(name for name, owner in BACKEND_OF.items() if owner == backend)


def chips_for(backend: str, chips: Iterable):
    """A backend's chip facts by name, held to the table: every chip is a target of
    `backend` and every target of `backend` has its chip."""
    found = {chip.name: chip for chip in chips}
    if sorted(found) != names_of(backend):
        raise AssertionError(f"{backend} chips {sorted(found)} are not the table's {names_of(backend)} (sparsegen/targets.py)")
    return found

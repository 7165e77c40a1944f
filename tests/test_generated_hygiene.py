"""Generated modules read like hand-written Pallas: pyflakes finds nothing in them.

No local assigned and never read, no unused import, no redefinition, no undefined name (an
index map's or kernel's parameter `del`-ed and then read would show as one). Checked on
every checked-in module, on the examples built for the GPU, and on the spec texts the
tests use widely (the language features, the hostile names, the attention variants, the
end-factor walks) and on random einsums of every sparse kind, for TPU and GPU; and on the
GPU's attention and decode modules (a decode's condition reads the key positions only: its
row positions made global were once a local never read, in no checked-in spec's module).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import GENERATED, SPECS, build, spec_text
from einsum_specs import SPARSE, einsum_specs
from hygiene_specs import MASKED_SDD, NASTY, NASTY_MASK, TRANSPOSED, TWO_OFFSETS, XMASK, XMASK_SDD
from hypothesis import HealthCheck, Phase, assume, given, settings
from pyflakes import api as flakes_api
from test_attention import BIASED, HOSTILE, HOSTILE_WALK, WITH_MAX
from test_einsum import SPECS as FEATURES
from test_end_factors import SPECS as END_FACTORS
from test_end_factors import spec as end_factor_spec
from test_gpu_attention_ragged import BSHD
from test_gpu import HOSTILE_EINSUM
from test_gpu_decode import DECODE
from test_gpu_rowwalk_split import STATS, TRAINED

from sparsegen.source import SpecError


class _Collect:
    """A pyflakes reporter that keeps every message."""

    def __init__(self):
        self.messages: list[str] = []

    def unexpectedError(self, filename, msg):
        self.messages.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.messages.append(f"{filename}:{lineno}:{offset}: {msg}")

    def flake(self, message):
        self.messages.append(str(message))


def flakes(code: str, filename: str) -> list[str]:
    reporter = _Collect()
    flakes_api.check(code, filename, reporter)
    return reporter.messages


def assert_clean(path: str | Path):
    path = Path(path)
    messages = flakes(path.read_text(), str(path))
    assert not messages, "\n".join(messages)


def built(text: str, target: str = "v5e") -> Path:
    """The module conftest.build writes for `text` (TPU: before black, the same code)."""
    _, mod = build(text, target, formatted=target == "h200")
    return Path(mod.__file__)


@pytest.mark.parametrize("path", sorted(GENERATED.glob("*.py")), ids=lambda p: p.stem)
def test_checked_in_modules_are_pyflakes_clean(path):
    assert_clean(path)


TEXTS = {
    **{name: text for name, (text, _) in FEATURES.items()},
    **{f"end_factor_{walk}": end_factor_spec(xs, outs) for walk, (xs, outs, _) in END_FACTORS.items()},
    "nasty": NASTY,
    "nasty_mask": NASTY_MASK,
    "transposed": TRANSPOSED,
    "xmask": XMASK,
    "two_offsets": TWO_OFFSETS,
    "masked_sdd": MASKED_SDD,
    "xmask_sdd": XMASK_SDD,
    "with_max": WITH_MAX,
    "biased": BIASED,
    "hostile": HOSTILE,
    "hostile_walk": HOSTILE_WALK,
}


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_modules_of_test_specs_are_pyflakes_clean(name):
    assert_clean(built(TEXTS[name]))


@pytest.mark.parametrize("name", sorted(p.stem for p in SPECS.glob("*.spk")))
def test_examples_built_for_the_gpu_are_pyflakes_clean(name):
    text = spec_text(name)
    for block in ["kernel " + b for b in text.split("kernel ")[1:]]:
        try:
            path = built(block, "h200")
        except SpecError:
            continue  # not lowered for GPUs (a walk or tiles the GPU refuses: said at the spec)
        assert_clean(path)


@pytest.mark.parametrize("name", sorted(FEATURES))
def test_language_features_built_for_the_gpu_are_pyflakes_clean(name):
    try:
        path = built(FEATURES[name][0], "h200")
    except SpecError as exc:
        # Not lowered for GPUs (the README lists what is not): refused at the spec, saying so.
        (first,) = [line for line in exc.render().splitlines() if ": error: " in line][:1]
        assert "GPU" in first and first.startswith("test.spk:"), first
        return
    assert_clean(path)


GPU_ATTENTION = {
    "decode": DECODE,  # `j < lens[b]`: the key positions global, the rows' local
    "decode_stats": STATS,
    "decode_trained": TRAINED,
    "ragged_bshd": BSHD,
    "with_max": WITH_MAX,
    "biased": BIASED,
    "hostile": HOSTILE,
    "hostile_walk": HOSTILE_WALK,
    "hostile_einsum": HOSTILE_EINSUM,  # indices named `mi`, `ni` (its comments name them; its code must not bind them)
}


@pytest.mark.parametrize("name", sorted(GPU_ATTENTION))
def test_attention_and_decode_built_for_the_gpu_are_pyflakes_clean(name):
    assert_clean(built(GPU_ATTENTION[name], "h200"))


COMMON = dict(deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


# The GPU refuses the random coo outputs these draw (nearly all): drawing them is no test.
@pytest.mark.parametrize("sparse,target", [(s, "v5e") for s in SPARSE] + [(s, "h200") for s in SPARSE if s not in ("coo_out", "coo_join")])
def test_random_einsums_are_pyflakes_clean(sparse, target):
    @settings(max_examples=6, **COMMON)
    @given(einsum_specs(sparse))
    def run(spec):
        try:
            path = built(spec[0], target)
        except SpecError:
            assume(False)  # refused by the target: nothing generated
        assert_clean(path)

    run()

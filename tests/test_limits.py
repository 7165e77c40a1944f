"""Long and deep specs: a documented limit on expression depth instead of an invalid module
or a traceback (issue 22, item 4), and generation whose cost grows linearly with the
spec (item 12: structural checks, no timings; bench/bench_long_specs.py times it)."""

from __future__ import annotations

import cProfile
import pstats
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, assert_matches, build

from sparsegen import formatting
from sparsegen.check import check
from sparsegen.compiler import compile_source
from sparsegen.source import SourceFile, SpecError
from sparsegen.syntax import MAX_DEPTH, parse


def attention(value: str, condition: str = "i >= j") -> str:
    """A causal attention whose score passes through `t[i, j] = VALUE where CONDITION`."""
    return f"""kernel deep {{
    in  q: f32[S, D]
    in  k: f32[S, D]
    in  v: f32[S, D]
    out o: f32[S, D]

    s[i, j] = q[i, d] * k[j, d]
    t[i, j] = {value} where {condition}
    o[i, e] = softmax(t[i, j], j) * v[j, e]

    tile i = 128, j = 128, d = 128, e = 128
}}
"""


def long_sum(operators: int) -> str:
    return "s[i, j]" + " + 0.001" * operators


def nested_tanh(levels: int) -> str:
    return "tanh(" * levels + "s[i, j]" + ")" * levels


def right_nested(levels: int) -> str:
    """`0.5 - (0.5 - (... - s[i, j]))`: one bracket per level in the generated code too."""
    return "0.5 - (" * (levels - 1) + "0.5 - s[i, j]" + ")" * (levels - 1)


def deep_condition(levels: int) -> str:
    return "not " * (levels - 1) + "i >= j"


@pytest.mark.parametrize("size", [MAX_DEPTH + 1, 250, 400, 600, 5000])
@pytest.mark.parametrize("form", ["sum", "tanh"])
def test_past_the_limit_is_an_error_at_the_spec(form, size):
    if form == "sum":
        text, col = attention(long_sum(size)), 15
    else:
        text, col = attention(nested_tanh(size)), 15 + len("tanh(") * MAX_DEPTH
    with pytest.raises(SpecError) as info:
        compile_source(SourceFile("deep.spk", text))
    head = info.value.render().splitlines()[0]
    assert head.startswith(f"deep.spk:8:{col}: error: expression nested more than {MAX_DEPTH} levels deep"), head


def test_a_deep_condition_is_refused_too():
    with pytest.raises(SpecError, match=f"more than {MAX_DEPTH} levels"):
        compile_source(SourceFile("deep.spk", attention("s[i, j]", deep_condition(MAX_DEPTH + 1))))


@pytest.mark.parametrize("value,condition", [
    (long_sum(MAX_DEPTH), "i >= j"),
    (nested_tanh(MAX_DEPTH), "i >= j"),
    (right_nested(MAX_DEPTH), "i >= j"),
    ("s[i, j]", deep_condition(MAX_DEPTH)),
], ids=["sum", "tanh", "right_nested", "condition"])
def test_at_the_limit_the_module_imports(value, condition):
    """Python refuses 200 nested brackets and black recurses per level: at the limit the
    module is still valid, black-formatted and importable (conftest.build imports it)."""
    kernel, mod = build(attention(value, condition), formatted=True)
    assert callable(mod.deep) and callable(mod.reference)


@pytest.mark.parametrize("value,condition", [(long_sum(MAX_DEPTH), "i >= j"), (right_nested(MAX_DEPTH), "i >= j"),
                                             ("s[i, j]", deep_condition(MAX_DEPTH))], ids=["sum", "right_nested", "condition"])
def test_at_the_limit_kernel_matches_reference(value, condition):
    kernel, mod = build(attention(value, condition), formatted=True)  # the module above
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((256, 128), dtype=np.float32) for _ in range(3))
    assert_matches(kernel, mod.deep(q, k, v, interpret=True), mod.reference(q, k, v))


@pytest.mark.parametrize("form,size", [("sum", 600), ("tanh", 600), ("sum", 5000)])
def test_cli_reports_the_limit_without_a_traceback(tmp_path, form, size):
    spec = tmp_path / "deep.spk"
    spec.write_text(attention(long_sum(size) if form == "sum" else nested_tanh(size)))
    result = subprocess.run([sys.executable, "-m", "sparsegen", "build", str(spec), "-o", str(tmp_path / "out")],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert f"{spec}:8:" in result.stderr and "error: expression nested more than" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "deep.py").exists()


# ----------------------------------------------------------------- linear cost


def chain(n: int) -> str:
    """One kernel whose score passes through n elementwise locals."""
    lines = [f"    t{m}[i, j] = t{m - 1}[i, j] * 0.5 + 1.0" for m in range(1, n)]
    return attention("s[i, j] * 0.5", "i >= j").replace("    t[i, j]", "    t0[i, j]").replace(
        "    o[i, e] = softmax(t[i, j], j)", "\n".join(lines) + f"\n    o[i, e] = softmax(t{n - 1}[i, j], j)")


def calls(fn) -> int:
    profile = cProfile.Profile()
    profile.runcall(fn)
    return pstats.Stats(profile).total_calls


def test_parsing_and_checking_grow_linearly():
    """The work (function calls, deterministic) of parse + check per added statement does not
    grow with the spec: a quadratic pass (as 'local never read' looking through every
    statement per local was) makes the second increment about 4 times the first, not 2."""
    texts = {n: chain(n) for n in (100, 200, 400, 800)}
    work = {n: calls(lambda t=t: check(parse(SourceFile("c.spk", t)))) for n, t in texts.items()}
    first, second = work[400] - work[200], work[800] - work[400]
    assert second < 2.5 * first, work


def test_black_formats_a_fixed_amount_whatever_the_chain_length(monkeypatch):
    """The chain's lines (in the kernel, its backward and `reference`) are left out of what
    black formats: black's input does not grow with the number of locals."""
    formatted: list[int] = []
    real = formatting.black.format_str

    def counting(text, **kw):
        formatted.append(text.count("\n") + 1)
        return real(text, **kw)

    monkeypatch.setattr(formatting.black, "format_str", counting)
    lines = {}
    for n in (30, 90):
        for cached in (formatting._black, formatting._format_chunk, formatting._placeholders, formatting._features,
                       formatting._left_alone, formatting._stand_ins_are_statements):
            cached.cache_clear()
        formatted.clear()
        (module,) = compile_source(SourceFile("c.spk", chain(n)))
        compile(module.code, "c.py", "exec")  # a module that builds is valid Python
        assert module.code.count(f"t{n - 1} = ") >= 3  # kernel, backward and reference each run the chain
        lines[n] = sum(formatted)
    assert lines[90] <= lines[30] + 10, lines

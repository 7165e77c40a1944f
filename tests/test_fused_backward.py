"""The fused attention backward (issue 23): one walk over key blocks computes dk, dv and dq,
dq of a group summed in VMEM and written once at the group's last step. The rule that
chooses it (`lower.backward_walk`) and its reasons in `plan`; its gradients against
`reference` in the CPU interpreter and the TPU simulator (which fills memory no step wrote
with NaN and raises on an output block revisited out of turn), the two-pass fallback in the
same module; the calls it makes; the AOT compile on v5e and v6e."""

from __future__ import annotations

import ast
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SWEEP, build, spec_text
from test_attention import BIASED, assert_gradients_match, example, gradients, rand

from sparsegen.compiler import lower_source
from sparsegen.source import SourceFile

# The names of the backward's kernels in a module's pallas_calls.
FUSED, DQ, DKV = "_attention_fused_backward_kernel", "_attention_dq_kernel", "_attention_dkv_kernel"


def walk_of(text: str, target: str = "v5e"):
    (m,) = lower_source(SourceFile("test.spk", text), target)
    return m.backward_walk


def backward_kernels(mod, fn, args) -> list[str]:
    """The kernels of the backward's pallas_calls, recorded on the host (nothing runs)."""
    from sparsegen.tpu.cycles import _name, capture

    _, backward = capture(fn, args, {}, True, mod.pl)
    return [_name(c) for c in backward]


# The query index's size literal (H symbolic: `reference` of a spec with every size literal
# reads the sizes it deletes, a bug outside this file).
LITERAL = """kernel literal_attention {
    in  q: f32[H, 384, 128]
    in  k: f32[H, 384, 128]
    in  v: f32[H, 384, 128]
    out o: f32[H, 384, 128]

    s[h, i, j] = q[h, i, d] * k[h, j, d] * 0.125 where i >= j
    o[h, i, e] = softmax(s[h, i, j], j) * v[h, j, e]

    tile h = 1, i = 128, j = 128, d = 128, e = 128
}
"""


PER_ROW = BIASED.replace(" + bias[h, i, j] - slope[h] * abs(i - j)", "").replace("    in  bias: f32[H, S, S]\n    in  slope: f32[H]\n", "")
PER_KEY = PER_ROW.replace("qb[b, h, i] * ", "").replace("    in  qb: f32[B, H, S]\n", "")


# ------------------------------------------------------------------- the rule


def test_the_rule_fuses_attention_and_bounds_the_rows_held():
    bw = walk_of(spec_text("causal_attention"))
    assert bw.fused and bw.max_rows is not None and bw.max_rows % 512 == 0
    # dq of a head: an f32 sum and two buffers of its bf16 output block, 128 lanes a row.
    assert bw.row_bytes == 128 * 4 + 2 * 128 * 2
    # Within three quarters of the target's VMEM with the walk's blocks (the module asks the
    # compiler for it: test_the_module_asks_the_limit_the_rule_computes).
    assert sum(i.bytes for i in bw.vmem) + bw.max_rows * bw.row_bytes <= 96 << 20
    assert bw.static_bytes > sum(i.bytes for i in bw.vmem)  # Mosaic's scratch on top
    assert 512 <= walk_of(spec_text("causal_attention"), "v4").max_rows < bw.max_rows  # v4's VMEM is an eighth of v5e's
    assert "S padded to 512 is at most" in bw.why


def test_the_rule_keeps_two_passes_where_fusing_does_not_apply():
    # A per-row and a per-block float operand: their gradients are summed over the row walk.
    bw = walk_of(BIASED)
    assert not bw.fused and "'bias' per block" in bw.why
    assert "'slope' per walk" in walk_of(BIASED.replace(" + bias[h, i, j]", "").replace("    in  bias: f32[H, S, S]\n", "")).why
    assert "'qb' per row" in walk_of(PER_ROW).why
    assert walk_of(PER_KEY).fused  # a per-key operand's gradient is summed over the key walk
    # A literal size too large for VMEM: decided when the spec is lowered.
    huge = LITERAL.replace("384", "262144")
    bw = walk_of(huge)
    assert not bw.fused and "262144 rows" in bw.why
    # A literal size that fits: fused, no call-time test.
    bw = walk_of(LITERAL)
    assert bw.fused and bw.max_rows is None


def test_plan_gives_the_walk_and_why(tmp_path, capsys):
    from sparsegen.cli import main

    for name, text in (("causal", spec_text("causal_attention")), ("biased", BIASED)):
        path = tmp_path / f"{name}.spk"
        path.write_text(text)
        assert main(["plan", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "fused: one walk over key blocks computes dk, the values' gradients and dq" in out
    assert "beyond that, two passes" in out
    assert "two passes: the chain reads 'bias' per block" in out


# ------------------------------------------------------------------ the kernels


def test_one_call_while_the_rows_fit_and_two_beyond():
    """The fused walk is one pallas_call; past `_FUSED_MAX_ROWS` the same module takes two."""
    kernel, mod = build(spec_text("causal_attention"))
    args, _ = example("causal_attention", 700, np.random.default_rng(0))
    assert backward_kernels(mod, mod.causal_attention, args) == [FUSED]
    _, small = build(spec_text("causal_attention") + "\n")  # a module of its own
    small._FUSED_MAX_ROWS = 512  # S = 700 pads to 1024 rows
    assert backward_kernels(small, small.causal_attention, args) == [DQ, DKV]
    _, lit = build(LITERAL)
    assert DQ not in lit.__dict__ and not hasattr(lit, "_FUSED_MAX_ROWS")  # decided when built


CASES = ["causal_attention", "document_attention", "local_gqa_attention", "masked_attention"]
LENGTHS = {"causal_attention": 700, "document_attention": 600, "local_gqa_attention": 700, "masked_attention": 384}


def test_every_example_walks_its_backward_fused():
    """Every attention example's backward is the one fused walk (recorded: nothing runs)."""
    for name in CASES:
        _, mod = build(spec_text(name))
        args, _ = example(name, LENGTHS[name], np.random.default_rng(11))
        assert backward_kernels(mod, getattr(mod, name), args) == [FUSED], name


# causal_attention (S = 700) in both modes, document_attention (a traced walk) in the
# simulator; the others are tests/test_attention.py's test_example_gradients (the same
# arguments and lengths, the same fused walk: document_attention's, local_gqa_attention's
# and masked_attention's in the CPU interpreter, the last two in the simulator), here under
# SPARSEGEN_SWEEP=1.
FUSED_RUNS = [(name, mode) for mode in ("cpu", "sim") for name in CASES
              if SWEEP or name == "causal_attention" or (name, mode) == ("document_attention", "sim")]


@pytest.mark.parametrize("name,interpret", FUSED_RUNS, ids=[f"{m}-{n}" for n, m in FUSED_RUNS], indirect=["interpret"])
def test_fused_gradients_match_reference(name, interpret):
    """Ragged lengths, a traced walk (documents), grouped heads with a window and soft-capping,
    a mask whose first row block sees nothing (f32): each through the fused walk, against
    JAX's gradient of `reference`; and the two-pass walk of the same module agrees."""
    _, mod = build(spec_text(name))
    args, _ = example(name, LENGTHS[name], np.random.default_rng(11))
    fn = getattr(mod, name)
    assert backward_kernels(mod, fn, args) == [FUSED]
    got = gradients(lambda *a: fn(*a, interpret=interpret), args, 3)
    want = gradients(mod.reference, args, 3)
    assert_gradients_match(got, want, bf16=name != "masked_attention")


@pytest.mark.parametrize("name", ["causal_attention", "masked_attention"])
def test_two_pass_fallback_matches(name, interpret):
    _, mod = build(spec_text(name) + "\n")
    mod._FUSED_MAX_ROWS = 0
    args, _ = example(name, LENGTHS[name], np.random.default_rng(11))
    fn = getattr(mod, name)
    assert backward_kernels(mod, fn, args) == [DQ, DKV]
    got = gradients(lambda *a: fn(*a, interpret=interpret), args, 3)
    assert_gradients_match(got, gradients(mod.reference, args, 3), bf16=name != "masked_attention")


def test_a_per_key_operand_gets_its_gradient_in_the_fused_walk(interpret):
    kernel, mod = build(PER_KEY)
    assert "qb" not in PER_KEY and "kpad" in PER_KEY
    rng = np.random.default_rng(15)
    B, H, S = 2, 2, 300
    args = [rand(rng, (B, H, S, 128), jnp.float32) for _ in range(3)] + [rand(rng, (B, S), jnp.float32)]
    assert backward_kernels(mod, mod.biased, args) == [FUSED]
    # The backward returns each gradient once (kpad's came back twice: the key walk's output
    # and the float operand's entry).
    returns = [node for node in ast.walk(ast.parse(inspect.getsource(mod._backward))) if isinstance(node, ast.Return)]
    names = [[e.id for e in r.value.elts] for r in returns]
    assert names and all(len(set(n)) == len(n) == 4 for n in names), names  # dq, dk, dv, dkpad
    got = gradients(lambda *a: mod.biased(*a, interpret=interpret), args, len(args))
    assert_gradients_match(got, gradients(mod.reference, args, len(args)), bf16=False)


def test_literal_sizes_fused(interpret):
    kernel, mod = build(LITERAL)
    rng = np.random.default_rng(3)
    args = [rand(rng, (2, 384, 128), jnp.float32) for _ in range(3)]
    assert backward_kernels(mod, mod.literal_attention, args) == [FUSED]
    got = gradients(lambda *a: mod.literal_attention(*a, interpret=interpret), args, 3)
    assert_gradients_match(got, gradients(mod.reference, args, 3), bf16=False)


def test_the_module_asks_the_limit_the_rule_computes():
    """`_fused_vmem_limit` in the module is `vmem.vmem_limit` of the rule's estimate."""
    from sparsegen.tpu.targets import TARGETS
    from sparsegen.tpu.vmem import vmem_limit

    for target in ("v5e", "v4"):
        bw = walk_of(spec_text("causal_attention"), target)
        _, mod = build(spec_text("causal_attention"), target)
        for rows in (512, 4096, bw.max_rows):
            want = vmem_limit(bw.static_bytes + rows * bw.row_bytes, TARGETS[target]) or TARGETS[target].scoped_vmem_bytes
            assert mod._fused_vmem_limit(rows) == want, (target, rows)


@pytest.mark.parametrize("target", ["v4", "v5e"])
def test_the_fused_walk_compiles_at_the_most_rows_it_holds(target):
    """The rule's bound holds: at S = max_rows (v4: 16 MiB of VMEM; v5e: 128) the forward and
    the fused backward compile through libtpu, one head."""
    from aot import compile_for

    bw = walk_of(spec_text("causal_attention"), target)
    _, mod = build(spec_text("causal_attention"), target)
    args = [np.broadcast_to(np.zeros((), jnp.bfloat16), (1, 1, bw.max_rows, 128))] * 3
    fn = lambda *a: gradients(mod.causal_attention, list(a), 3)  # noqa: E731
    assert compile_for(fn, args, TOPOLOGIES[target]).as_text().count("tpu_custom_call") == 2
    assert backward_kernels(mod, mod.causal_attention, args) == [FUSED]


TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v6e": "v6e:2x2"}


# v5e under SPARSEGEN_SWEEP=1: tests/test_attention.py's test_example_backward_compiles_for_tpu
# compiles the same (local_gqa_attention's forward and fused backward, S = 1024) for v5e.
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"] if SWEEP else ["v6e:2x2"])
def test_fused_backward_compiles_for_tpu(topology):
    """Forward and fused backward through libtpu (two pallas_calls), GQA with a window and
    soft-capping at S = 1024 (the kernels of any longer S)."""
    from aot import compile_for

    _, mod = build(spec_text("local_gqa_attention"))
    args = [np.zeros((1, 4, 1024, 128), jnp.bfloat16)] + [np.zeros((1, 1, 1024, 128), jnp.bfloat16)] * 2
    fn = lambda *a: gradients(mod.local_gqa_attention, list(a), 3)  # noqa: E731
    assert compile_for(fn, args, topology).as_text().count("tpu_custom_call") == 2  # the forward and the fused backward
    assert backward_kernels(mod, mod.local_gqa_attention, args) == [FUSED]


SMALL = """kernel small_causal {
    in  q: f32[B, H, S, D]
    in  k: f32[B, H, S, D]
    in  v: f32[B, H, S, D]
    out o: f32[B, H, S, D]

    s[b, h, i, j] = q[b, h, i, d] * k[b, h, j, d] * 0.125 where i >= j
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, h, j, e]

    tile b = 1, h = 1, i = 128, j = 128, d = 128, e = 128
}
"""


def test_no_race_in_the_fused_walk(tmp_path):
    """The simulator's race detector with two cores (a megacore splits the parallel batch and
    head axes between them): none in the fused backward, whose dq block is its head's alone.
    Positive control: with dq's block mapped to head 0 for every head, the two cores write
    one block, and a race is reported."""
    import importlib.util
    import sys

    import jax
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
    from jax.experimental.pallas import tpu as pltpu

    _, mod = build(SMALL, formatted=True)  # its text is edited below
    rng = np.random.default_rng(5)
    args = [rand(rng, (1, 2, 384, 128), jnp.float32) for _ in range(3)]
    assert backward_kernels(mod, mod.small_causal, args) == [FUSED]

    def races(m):
        params = pltpu.InterpretParams(detect_races=True, on_race="warn", num_cores_or_threads=2, random_seed=7)
        try:
            got = gradients(lambda *a: m.small_causal(*a, interpret=params), args, 3)
            jax.block_until_ready(got)
            state = interpret_pallas_call.races
            assert state is not None, "the simulator ran without its race detector"
            return got, state.races_found
        finally:
            jax.effects_barrier()
            pltpu.reset_tpu_interpret_mode_state()

    got, found = races(mod)
    assert not found
    assert_gradients_match(got, gradients(mod.reference, args, 3), bf16=False)
    code = open(mod.__file__).read()
    honest = "def _dq_group_map_by_key(b, h, *_):\n    # the gradient of q: the group's rows, written at its last step\n    return (\n        b,\n        h,"
    assert honest in code
    path = tmp_path / "small_causal_racy.py"
    path.write_text(code.replace(honest, honest.replace("        h,", "        0 * h,")))
    spec = importlib.util.spec_from_file_location("small_causal_racy", path)
    racy = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = racy
    spec.loader.exec_module(racy)
    _, found = races(racy)
    assert found

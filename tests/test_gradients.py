"""Every generated kernel is differentiable (language v1, section 6): `jax.grad` and
`jax.vjp` through the kernel equal JAX's gradient of `reference`, for every float input,
in the CPU interpreter and the TPU simulator; the backward kernels compile ahead of time;
padding entries get zero gradients; the backward skips what the forward skips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from aot import across_targets, compile_for
from conftest import SPECS, SWEEP, assert_matches, build, cpu_unless_sweep, in_both_modes, spec_text  # noqa: F401
from test_einsum import SPECS as FEATURES

from sparsegen.callconv import convention
from sparsegen.names import ModuleNames
from sparsegen.source import SpecError
from sparsegen.tpu.lower import lower
from sparsegen.tpu.targets import TARGETS
from sparsegen.testing import example_args, resolve_sizes, tolerance

EXAMPLES = {
    "dsd_matmul": dict(M=384, K=256, N=256),
    "dds_matmul": dict(M=256, K=384, N=256),
    "sdd_matmul": dict(M=256, K=512, N=256),
    "masked_matmul": dict(M=512, K=1024, N=512),
    "batched_dsd": dict(B=2, M=1024, K=512, N=512),
    "masked_matmul_dx": dict(M=512, N=512, K=512),
    "masked_matmul_dy": dict(M=512, N=512, K=512),
}


def kernel_text(name: str) -> str:
    """One kernel of an example spec (masked_backward.spk holds two)."""
    for spec in SPECS.glob("*.spk"):
        for chunk in ("\n" + spec.read_text()).split("\nkernel ")[1:]:
            if chunk.startswith(f"{name} "):
                return "kernel " + chunk[: chunk.index("\n}") + 2]
    raise KeyError(name)


TEXTS = {name: (kernel_text(name), sizes) for name, sizes in EXAMPLES.items()}
# The v1 features whose gradients are derived (grouped heads and chained statements are not yet).
TEXTS.update({name: FEATURES[name] for name in ("batched_mm", "batched_coo", "two_sums", "row_sum", "three_factors", "left_offsets",
                                               "coo_join", "coo_outer_sum", "coo_outside_sum", "sampled_product", "ragged_coo", "ragged_mask", "ragged_sdd")})


def differentiable(kernel):
    conv = convention(kernel, ModuleNames(kernel))
    return [n for n, p in enumerate(conv.params)
            if p.kind in ("dense", "blocks") and kernel.operand(p.operand).dtype.is_float and kernel.operand(p.operand).sparsity != "mask"]


def _tuple_of(out):
    return out if isinstance(out, tuple) else (out,)


def loss_of(fn, keywords, weights):
    def loss(*args):
        out = fn(*args, **keywords)
        outs = out if isinstance(out, tuple) else (out,)
        return sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(outs, weights))

    return loss


def gradient_tolerance(kernel, env):
    """The forward's tolerance, or the backward kernel's where its sums are longer (the
    gradient of a factor sums over every index it lacks)."""
    tol = max(tolerance(kernel, o.name, env)[1] for o in kernel.outputs)
    backward = lower(kernel, TARGETS["v5e"]).backward
    if backward is not None and backward.kernel is not None:
        tol = max(tol, *(tolerance(backward.kernel, st.target.operand, env)[1] for st in backward.kernel.statements))
    return tol


def assert_gradients_match(kernel, got, want, env):
    """Two bf16 roundings apart at most (each is within one of the exact gradient), plus the
    sum's accumulation error."""
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape and not np.isnan(a).any()
        rtol = 4 * 2.0**-8 if any(op.dtype.name == "bf16" for op in kernel.operands) else 1e-5
        atol = gradient_tolerance(kernel, env) * max(1.0, float(np.sqrt(np.mean(b**2)))) if b.size else 0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def setup(name, pattern="random"):
    text, sizes = TEXTS[name]
    kernel, mod = build(text)
    args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(len(name)))
    out = mod.reference(*args, **keywords)
    outs = out if isinstance(out, tuple) else (out,)
    rng = np.random.default_rng(7)
    weights = [jnp.asarray(rng.standard_normal(o.shape), jnp.float32) for o in outs]
    return kernel, mod, args, keywords, weights, resolve_sizes(kernel, sizes)


# Every example and feature with random blocks in the CPU interpreter, with padding entries
# among them for a coo input (dsd_matmul), a coo output (sdd_matmul) and both (coo_join)
# (every case under SPARSEGEN_SWEEP=1; without a coo operand "padded" draws the same kind of
# blocks as "random"); in the simulator one of each walk: a dense batch, a coo input (padded: its
# random blocks and padding entries), a coo output, a coo input and output, a mask, the masked
# example's backward kernel (every case under SPARSEGEN_SWEEP=1).
PADDED = ("dsd_matmul", "sdd_matmul", "coo_join")
GRAD_CASES = [(n, p) for n in sorted(TEXTS) for p in ("random", "padded")
              if p == "random" or SWEEP or n in PADDED]
# A coo operand's "padded" draws its random blocks and padding entries among them: in the CPU
# interpreter those three run "padded" alone (both under SPARSEGEN_SWEEP=1).
GRAD_INTERPRETED = lambda case: case[0] not in PADDED or case[1] == "padded"  # noqa: E731
GRAD_SIMULATED = [("batched_mm", "random"), ("dsd_matmul", "padded"), ("sdd_matmul", "padded"),
                  ("coo_join", "padded"), ("masked_matmul", "random"), ("masked_matmul_dx", "random")]


@pytest.mark.parametrize(*in_both_modes(GRAD_CASES, GRAD_SIMULATED, "name,pattern", GRAD_INTERPRETED), indirect=["interpret"])
def test_grad_equals_the_gradient_of_reference(name, pattern, interpret):
    kernel, mod, args, keywords, weights, env = setup(name, pattern)
    argnums = tuple(differentiable(kernel))
    want = jax.grad(loss_of(mod.reference, keywords, weights), argnums=argnums)(*args)
    got = jax.grad(loss_of(getattr(mod, name.split("-")[0] if name in FEATURES else kernel.name), {**keywords, "interpret": interpret}, weights), argnums=argnums)(*args)
    assert_gradients_match(kernel, got, want, env)


@pytest.mark.parametrize("name", ["dsd_matmul", "sdd_matmul", "masked_matmul_dx"])
def test_vjp_under_jit_gives_every_argument_a_cotangent(name):
    """jax.vjp under jit with traced coordinates: float inputs get their gradients, integer
    ones float0 (what JAX requires)."""
    kernel, mod, args, keywords, weights, env = setup(name)
    fn = getattr(mod, kernel.name)
    out, vjp = jax.jit(lambda *a: jax.vjp(lambda *b: fn(*b, **keywords, interpret=True), *a))(*args)
    _, ref_vjp = jax.vjp(lambda *b: mod.reference(*b, **keywords), *args)
    cot = jax.tree.map(lambda o: jnp.ones_like(o), out)
    got, want = vjp(cot), ref_vjp(cot)
    for n, (a, b, arg) in enumerate(zip(got, want, args)):
        if n in differentiable(kernel):
            assert_gradients_match(kernel, [a], [b], env)
        elif np.issubdtype(np.asarray(arg).dtype, np.integer):
            assert a.dtype == jax.dtypes.float0


def test_padding_entries_of_a_bucketed_coo_input_get_zero_gradients():
    from sparsegen.formats import BlockCOO

    kernel, mod = build(spec_text("dsd_matmul").replace("512", "128"))
    rng = np.random.default_rng(3)
    dense = rng.standard_normal((384, 256)).astype(np.float32)
    dense[:128, :128] = 0  # five stored blocks, padded to a bucket of eight
    x = BlockCOO.from_dense(dense.astype(jnp.bfloat16), (128, 128)).bucketed()
    y = rng.standard_normal((256, 128)).astype(jnp.bfloat16)
    blocks, rows, cols = x.args()
    assert (rows < 0).any(), "the bucket adds padding entries"
    grad = jax.jit(jax.grad(lambda b, r, c, yy: jnp.sum(mod.dsd_matmul(b, r, c, yy, M=384, interpret=True).astype(jnp.float32)),
                            argnums=0))(blocks, rows, cols, y)
    assert np.all(np.asarray(grad)[np.asarray(rows) < 0] == 0)
    assert np.any(np.asarray(grad)[np.asarray(rows) >= 0] != 0)


def test_backward_of_a_causal_masked_matmul_does_the_forward_block_products():
    """The simulator counts the backward's computing steps: dx and dy skip the blocks the
    forward skips, so each does exactly the forward's block products."""
    from sparsegen.compiler import plans
    from sparsegen.tpu.simulate import load_module, pattern_args, simulate

    (plan,) = plans(SPECS / "masked_matmul.spk")
    env = dict(M=4096, K=4096, N=4096)
    module = load_module(plan, backward=True)
    forward = simulate(plan, module, pattern_args(plan, env, "tril")[0], env)
    backward = plan.backward_module
    for tp in backward.passes:
        one = type(backward)(**{**backward.__dict__, "passes": (tp,)})
        sim = simulate(one, module, pattern_args(one, env, "tril")[0], env)
        assert sim.block_products == forward.block_products, tp.p.statement.text
    assert forward.block_products == 144  # of the 256 cells of the dense grid (8, 8, 4)


# Each v1 feature on one target, the three in turn, and the features v4 refuses at build on
# v4; the examples under SPARSEGEN_SWEEP=1 (every pair then): tests/test_verify.py's
# test_every_example_compiles_for_v5e_v6e_v4 compiles every example's backward (jax.grad
# through the kernel; one example of each walk for all three targets), and a compile takes
# seconds.
TOPOLOGIES = ["v5e:2x2", "v6e:2x2", "v4:2x2x1"]
V4_REFUSED = ["coo_outside_sum", "row_sum"]
BACKWARD_AOT = (across_targets(sorted(EXAMPLES), TOPOLOGIES) if SWEEP else []) + sorted(
    set(across_targets(sorted(set(TEXTS) - set(EXAMPLES)), TOPOLOGIES)) | {(n, "v4:2x2x1") for n in V4_REFUSED})


@pytest.mark.parametrize("name,topology", BACKWARD_AOT, ids=[f"{n}-{t}" for n, t in BACKWARD_AOT])
def test_backward_kernels_compile_ahead_of_time(name, topology):
    """Every example's and v1 feature's backward kernels, built for the topology's target."""
    target = topology.split(":")[0]
    text, sizes = TEXTS[name]
    try:
        kernel, mod = build(text, target)
    except SpecError as exc:
        # What v4 refuses at build (its rules), it refuses for the forward too: said at the spec.
        assert target == "v4" and "v4 cannot" in str(exc), str(exc)
        return
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(len(name)))
    weights = [jnp.asarray(np.random.default_rng(7).standard_normal(np.shape(o)), jnp.float32)
               for o in _tuple_of(mod.reference(*args, **keywords))]
    argnums = tuple(differentiable(kernel))
    backward_error = lower(kernel, TARGETS[target]).backward_error
    if backward_error:
        # A backward the target cannot hold is refused when the gradient is asked for, saying why.
        assert "does not fit" in backward_error, backward_error
        with pytest.raises(NotImplementedError, match="does not fit"):
            jax.grad(loss_of(getattr(mod, kernel.name), keywords, weights), argnums=argnums)(*args)
        return
    grad = jax.grad(loss_of(getattr(mod, kernel.name), keywords, weights), argnums=argnums)
    hlo = compile_for(grad, args, topology).as_text()
    # A backward pass per gradient (the forward's value is unused by a linear loss: XLA drops it).
    assert hlo.count("tpu_custom_call") >= len(argnums)


def derivable(kernel, target="v5e"):
    """The differentiable arguments whose every gradient is derived (what a loss on every
    output may differentiate)."""
    refused = {r.operand for r in lower(kernel, TARGETS[target]).refused}
    conv = convention(kernel, ModuleNames(kernel))
    return [n for n in differentiable(kernel) if conv.params[n].operand not in refused]


# A frozen dequantisation scale: the gradients of x and y are plain two-factor sums; sc's
# would sum three groups of factors (a local tensor), so it alone is not derived.
SCALED = """kernel scaled_bmm {
    in  x: f32[B, M, K]
    in  y: f32[B, K, N]
    in  sc: f32[B, N]
    out o: f32[B, M, N]

    o[b, m, n] = x[b, m, k] * y[b, k, n] * sc[b, n]

    tile b = 1, m = 128, n = 128, k = 128
}
"""


def scaled_setup():
    kernel, mod = build(SCALED)
    rng = np.random.default_rng(5)
    x, y = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 200, 256), (2, 256, 130)))
    sc = jnp.asarray(rng.standard_normal((2, 130)), jnp.float32)
    weights = [jnp.asarray(rng.standard_normal((2, 200, 130)), jnp.float32)]
    return kernel, mod, (x, y, sc), weights


@cpu_unless_sweep
def test_an_underivable_gradient_blocks_no_other(interpret):
    """jax.grad of x and y through the scaled product equals JAX's gradient of `reference`:
    sc, not differentiated or behind stop_gradient, is never asked for its gradient."""
    kernel, mod, args, weights = scaled_setup()
    env = dict(B=2, M=200, K=256, N=130)
    want = jax.grad(loss_of(mod.reference, {}, weights), argnums=(0, 1))(*args)
    got = jax.grad(loss_of(mod.scaled_bmm, {"interpret": interpret}, weights), argnums=(0, 1))(*args)
    assert_gradients_match(kernel, got, want, env)
    frozen = loss_of(lambda x, y, sc, **kw: mod.scaled_bmm(x, y, lax.stop_gradient(sc), **kw), {"interpret": interpret}, weights)
    got = jax.grad(frozen, argnums=(0, 1, 2))(*args)
    assert_gradients_match(kernel, got[:2], want, env)
    assert not np.asarray(got[2]).any()


def test_an_underivable_gradient_raises_where_it_is_asked_for():
    kernel, mod, args, weights = scaled_setup()
    loss = loss_of(mod.scaled_bmm, {"interpret": True}, weights)
    with pytest.raises(NotImplementedError, match=r"scaled_bmm: the gradient of 'sc' through 'o' multiplies three groups of factors in "
                                                   r"one sum, which needs a local tensor \(not supported yet\); asked for because 'sc' "
                                                   r"is differentiated and the cotangent of 'o' is not zero"):
        jax.grad(loss, argnums=(0, 2))(*args)
    assert jax.jit(jax.grad(loss, argnums=1))(*args).shape == args[1].shape  # and under jit, without sc


@cpu_unless_sweep
def test_an_unused_output_needs_no_gradient_through_it(interpret):
    """Two outputs: z's gradient through t is not derived; a loss on o alone (t's cotangent
    a symbolic zero) differentiates x, y and z (z's is zero), a loss on t differentiates x
    and y, and a loss on both asking for z raises, naming z and t."""
    text = """kernel two_outputs {
    in  x: f32[M, K]
    in  y: f32[K, N]
    in  z: f32[N]
    out o: f32[M, N]
    out t: f32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    t[m, n] = x[m, k] * y[k, n] * z[n]
    tile m = 128, n = 128, k = 128
}"""
    kernel, mod = build(text)
    rng = np.random.default_rng(9)
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((256, 384), (384, 128), (128,))]
    env = dict(M=256, K=384, N=128)
    w = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)

    def on(which, fn):
        return lambda *a: jnp.sum(fn(*a)[which] * w)

    kernel_fn = lambda *a: mod.two_outputs(*a, interpret=interpret)  # noqa: E731
    got = jax.grad(on(0, kernel_fn), argnums=(0, 1, 2))(*args)
    want = jax.grad(on(0, mod.reference), argnums=(0, 1, 2))(*args)
    assert_gradients_match(kernel, got, want, env)
    assert not np.asarray(got[2]).any()
    got = jax.grad(on(1, kernel_fn), argnums=(0, 1))(*args)
    want = jax.grad(on(1, mod.reference), argnums=(0, 1))(*args)
    assert_gradients_match(kernel, got, want, env)
    with pytest.raises(NotImplementedError, match="the gradient of 'z' through 't' .*the cotangent of 't' is not zero"):
        jax.grad(lambda *a: on(0, kernel_fn)(*a) + on(1, kernel_fn)(*a), argnums=(0, 2))(*args)


def test_plan_lists_the_gradients_per_input(tmp_path, capsys):
    from sparsegen.cli import main

    spec = tmp_path / "scaled.spk"
    spec.write_text(SCALED)
    assert main(["plan", str(spec)]) == 0
    out = capsys.readouterr().out
    assert "not available" not in out
    assert "backward (jax.grad): 2 passes" in out
    lines = out[out.index("gradients (jax.grad), per float input:"):].splitlines()
    assert lines[1] == "  x: through o" and lines[2] == "  y: through o"
    assert lines[3].startswith("  sc: not derived through o: the gradient of 'sc' through 'o' multiplies three groups")
    assert "raised only where needed: sc differentiated and the cotangent of o not zero" in lines[3]


def test_what_is_not_derived_yet_says_why():
    """Grouped heads: k's gradient (read through h // 4) is not derived; q's is."""
    text, sizes = FEATURES["grouped_heads"]
    kernel, mod = build(text)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(0))
    with pytest.raises(NotImplementedError, match="the gradient of 'k', read as k\\[b, h // 4, j, d\\], is not supported yet"):
        jax.grad(lambda k: jnp.sum(mod.grouped_heads(args[0], k, **keywords, interpret=True)))(args[1])
    got = jax.grad(lambda q: jnp.sum(mod.grouped_heads(q, args[1], **keywords, interpret=True)))(args[0])
    want = jax.grad(lambda q: jnp.sum(mod.reference(q, args[1], **keywords)))(args[0])
    assert_gradients_match(kernel, [got], [want], resolve_sizes(kernel, sizes))


def test_forward_mode_is_refused_clearly():
    kernel, mod, args, keywords, weights, env = setup("dsd_matmul")
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda y: mod.dsd_matmul(args[0], args[1], args[2], y, **keywords, interpret=True), (args[3],), (args[3],))


@pytest.mark.parametrize("name", ["dsd_matmul", "sdd_matmul", "masked_matmul", "batched_coo"])
def test_grad_under_vmap(name):
    """jax.vmap over a batch of one float input (the sparsity shared): each batch element's
    gradient equals that of `reference`, and the forward values are stacked."""
    kernel, mod, args, keywords, weights, env = setup(name)
    fn = getattr(mod, name if name in FEATURES else kernel.name)
    n = differentiable(kernel)[-1]
    batch = jnp.stack([args[n], (2 * args[n]).astype(args[n].dtype)])

    def grad_of(f):
        def loss(x):
            out = f(*args[:n], x, *args[n + 1 :], **keywords)
            return jnp.sum(out.astype(jnp.float32) * weights[0])

        return jax.vmap(jax.grad(loss))(batch)

    got = grad_of(lambda *a, **k: fn(*a, **k, interpret=True))
    want = grad_of(mod.reference)
    assert got.shape == batch.shape
    for g, w in zip(got, want):
        assert_gradients_match(kernel, [g], [w], env)
    out = jax.vmap(lambda x: fn(*args[:n], x, *args[n + 1 :], **keywords, interpret=True))(batch)
    ref = jax.vmap(lambda x: mod.reference(*args[:n], x, *args[n + 1 :], **keywords))(batch)
    for o, r in zip(out, ref):
        assert_matches(kernel, o, r, env)


def test_verify_compiles_the_derived_gradients(tmp_path):
    """`verify` compiles the backward of the gradients that are derived (x's and y's), not
    refusing the kernel for sc's."""
    from sparsegen.verify import verify_file

    spec = tmp_path / "scaled.spk"
    spec.write_text(SCALED)
    _, (result,) = verify_file(spec, ["v5e"], probe=False)
    assert result.compiled and result.backward == "compiles", result.backward


def test_a_gradient_that_sums_every_index_of_its_block_compiles():
    """d_x2[d] sums g_o * x0 (one group) against x1 over every index in the block: Mosaic's
    dot yields no scalar, so the body multiplies and sums (found by the property test)."""
    text = """kernel sums_all {
    in  x0: bf16[C, B, A] coo
    in  x1: bf16[C, E]
    in  x2: bf16[D]
    out o: bf16[A, B, C]
    o[a, b, c] = x0[c, b, a] * x1[c, e] * x2[d] * 2
    tile a = 128, b = 16, c = 128, d = 128, e = 128
}"""
    kernel, mod = build(text)
    sizes = dict(A=381, B=48, C=381, D=384, E=128)
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(0))
    loss = loss_of(mod.sums_all, keywords, [1.0])
    assert "tpu_custom_call" in compile_for(jax.grad(loss, argnums=5), args, "v5e:2x2").as_text()
    got = jax.grad(loss_of(mod.sums_all, {**keywords, "interpret": True}, [1.0]), argnums=5)(*args)
    want = jax.grad(loss_of(mod.reference, keywords, [1.0]), argnums=5)(*args)
    assert_gradients_match(kernel, [got], [want], resolve_sizes(kernel, sizes))

"""`sharded(mesh, ...)` compiled ahead of time for multi-chip TPU topologies (issue 20):
a mesh over the devices of a compile-only libtpu topology (v5e 2x4, v6e 2x2; no TPU
needed), each example's forward and backward (jax.vjp) lowered with arguments laid out by
NamedShardings and compiled, and the collectives of the compiled HLO (after XLA's SPMD
partitioning) asserted: exactly the expected ones, over the expected mesh axes; each
device's Pallas kernel (a tpu_custom_call) sees its slices, not the whole arrays; an
attention's keys and values are never all-gathered whole.

What is expected, and why (per index's rule, sparsegen/mesh.py):
- a "split" index that no statement sums (batch, heads, rows, output columns): no
  collective in the forward; in the backward, an argument's gradient that sums over it
  (a weight the split rows all read) is added across its axis (all-reduce);
- a "sum" index (an einsum's k, grouped_matmul's experts g): the forward adds the partial
  sums (psum: all-reduce over its axis); the backward needs none for it (each device's
  slice of the inputs gets its own slice of the gradient);
- a coo input read by split indices: every device deals the stored blocks itself (no
  collective in the forward); in the backward, each device's bucket's gradient goes back
  to the caller's order, added across the mesh axes that dealt them (all-reduce);
- an attention's key index split alone: no key moves; the rows' partial results merge
  across its axis (all-reduces of their logsumexp and outputs), and in the backward the
  rows' gradient (dq) is added across it.

The numbers (that the split kernels equal the unsplit ones, values and gradients) are
tests/test_sharded.py's, on 8 host CPU devices; here only what the TPU compile makes of it.
A case is one line of CASES: the kernel, sizes, axes and the expected collectives (see
RING there for context parallelism); `check_on_topology` does the rest.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SWEEP, build, spec_text, with_tiles
from test_sharded import BATCHED

from sparsegen.testing import example_args

# Module target -> (libtpu topology, mesh shape over its chips): 8 and 4 chips, two axes.
TOPOLOGIES = {"v5e": ("v5e:2x4", (2, 4)), "v6e": ("v6e:2x2", (2, 2))}
AXES = ("data", "model")
COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "reduce-scatter", "all-to-all",
               "ragged-all-to-all", "collective-broadcast")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%[\w.\-]+ = (?P<type>.*?) (?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")


@functools.cache
def topology_mesh(target: str) -> jax.sharding.Mesh:
    """A mesh (data, model) over every chip of the target's compile-only topology."""
    from jax.experimental import topologies

    name, shape = TOPOLOGIES[target]
    devices = topologies.get_topology_desc(name, "tpu").devices
    assert len(devices) == np.prod(shape), (name, len(devices))
    return jax.sharding.Mesh(np.array(devices).reshape(shape), AXES)


def collectives(hlo: str, mesh: jax.sharding.Mesh) -> list[tuple[str, tuple[str, ...], list[tuple[int, ...]]]]:
    """Every collective of compiled HLO text: (op, the mesh axes it communicates over, the
    shapes of its result). An async pair counts once (its -start). Axes: from the replica
    groups, which XLA names by mesh axis (`replica_groups=mesh['data'=2,'model'=4] {'model'}`),
    or for a permute from its (source, target) device pairs: the axes along which they differ
    (logical device n is the mesh's n-th device, row-major). The XLA of jax 0.11 lists some
    groups by device instead (`replica_groups={{0,1,2,3},{4,5,6,7}}`), or over a mesh of its
    own (`mesh['axis_0'=8,'axis_1'=1] {'axis_0'}`): the axes a group's devices differ along."""
    out = []
    for line in hlo.splitlines():
        m = _OP.match(line)
        if m is None:
            continue
        groups = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
        pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
        listed = re.search(r"replica_groups=\{((?:\{[\d,]+\},?)*)\}", line)
        if groups:
            over = [a.strip("' ") for a in groups.group(2).split(",")]
            sizes = {n.strip("' "): int(k) for n, k in (a.split("=") for a in groups.group(1).split(","))}
            if set(sizes) <= set(mesh.axis_names):
                axes = tuple(sorted(over))
            else:  # XLA's own mesh: its groups by device, each the devices along its axes `over`
                ids = np.moveaxis(np.arange(mesh.size).reshape(tuple(sizes.values())), [list(sizes).index(a) for a in over],
                                  range(-len(over), 0))
                axes = _differ_along(ids.reshape(-1, int(np.prod([sizes[a] for a in over]))), mesh)
        elif listed:
            axes = _differ_along([[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", listed.group(1))], mesh)
        elif pairs:
            axes = _differ_along([[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))], mesh)
        else:
            raise AssertionError(f"a collective whose mesh axes are not recognised: {line[:300]}")
        # A -start's result is (operands, results, context): its shapes, as written.
        shapes = [tuple(int(d) for d in dims.split(",") if d) for _, dims in _SHAPE.findall(m.group("type"))]
        out.append((m.group("op"), axes, shapes))
    return out


def _differ_along(groups, mesh) -> tuple[str, ...]:
    """The mesh axes along which the logical devices of some group differ."""
    moved = set()
    for group in groups:
        coords = [np.unravel_index(int(d), mesh.devices.shape) for d in group]
        moved |= {mesh.axis_names[d] for d in range(mesh.devices.ndim) if len({c[d] for c in coords}) > 1}
    return tuple(sorted(moved))


def kernel_results(hlo: str) -> list[tuple[int, ...]]:
    """The result shapes of every Pallas kernel call (tpu_custom_call) of compiled HLO text."""
    shapes = []
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            head = line.split(" custom-call(")[0].split(" = ", 1)[1]
            shapes += [tuple(int(d) for d in dims.split(",") if d) for _, dims in _SHAPE.findall(head)]
    return shapes


def local(shape, dims, axes, mesh, whole=()) -> tuple[int, ...]:
    """An array's shape on one device: each dimension read by a split index divided by its
    mesh axis's size (except the indices in `whole`)."""
    return tuple(s // mesh.shape[axes[i]] if axes.get(i) and i not in whole else s for s, i in zip(shape, dims))


@functools.cache
def compile_on_topology(text: str, target: str, sizes: tuple, axes: tuple, pattern: str):
    """`sharded(mesh, **axes)` of the kernel in `text` (built for `target`), compiled for the
    target's topology with its arguments laid out as `axes` says: forward, and backward
    (jax.vjp of every floating argument, the cotangents laid out as the outputs).
    Returns (module, arguments, output shapes, forward HLO, backward HLO); cached, so that
    several tests may assert on one compile."""
    mesh = topology_mesh(target)
    kernel, mod = build(text, target=target, formatted=False)
    args, keywords = example_args(kernel, dict(sizes), pattern, np.random.default_rng(0))
    placed = dict(axes)
    spec = lambda dims: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*(placed.get(i) for i in dims)))
    structs = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=spec(dims)) for a, dims in zip(args, mod._MESH_ARGS)]
    fn = mod.sharded(mesh, **placed)
    call = lambda *a: fn(*a, **keywords)
    outs = jax.eval_shape(call, *structs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    floats = [n for n, a in enumerate(args) if jnp.issubdtype(np.asarray(a).dtype, jnp.floating)]
    cotangents = [jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=spec(dims)) for o, dims in zip(outs, mod._MESH_OUTPUTS)]

    def backward(*inputs):
        primal, cts = list(inputs[:len(args)]), inputs[len(args):]

        def of(*diff):
            full = list(primal)
            for n, a in zip(floats, diff):
                full[n] = a
            return call(*full)

        _, pullback = jax.vjp(of, *(primal[n] for n in floats))
        return pullback(tuple(cts) if len(cts) > 1 else cts[0])

    # Some Mosaic lowerings ask which TPU they target: the default device tells them.
    with jax.default_device(mesh.devices.flat[0]):
        fwd = jax.jit(call).lower(*structs).compile().as_text()
        bwd = jax.jit(backward).lower(*structs, *cotangents).compile().as_text()
    return mod, args, outs, fwd, bwd


def check_on_topology(text: str, target: str, sizes: dict, axes: dict, forward, backward,
                      key: str | None = None, pattern: str = "random", chunks: dict | None = None):
    """Compile `sharded(mesh, **axes)` for the target's topology, forward and backward
    (`compile_on_topology`), and assert what its HLO holds:

    - `forward`, `backward`: the collectives each holds, exactly (a list or set of (op,
      mesh axes), counted): ("all-reduce", "model") for a psum over model,
      ("all-reduce", "data,model") over both, ("collective-permute", "model") for a ring
      step along it;
    - every Pallas kernel runs on slices: the forward's kernel results include each
      split output's one-device shape (at least one output must be split);
    - `key` (an attention's key index): no all-gather, forward or backward, whose result is
      as large as a key/value argument's one-device slice with that index whole (the whole
      sequence gathered onto every device, which context parallelism exists to avoid);
    - `chunks`: index -> the pieces each device's kernels cut it in (the rows of a key
      index split alone, run in chunks of the keys' length)."""
    mesh = topology_mesh(target)
    mod, args, outs, fwd, bwd = compile_on_topology(text, target, tuple(sizes.items()), tuple(axes.items()), pattern)
    found = {"forward": collectives(fwd, mesh), "backward": collectives(bwd, mesh)}
    for name, hlo, expected in (("forward", fwd, forward), ("backward", bwd, backward)):
        assert "tpu_custom_call" in hlo, f"{name}: no Pallas kernel in the compiled HLO"
        got = sorted((op, ",".join(a)) for op, a, _ in found[name])
        assert got == sorted(expected), f"{name}: collectives {got}, expected {sorted(expected)}: {found[name]}"
        if key is not None:
            for p, (a, dims) in enumerate(zip(args, mod._MESH_ARGS)):
                if key not in dims:
                    continue
                whole = int(np.prod(local(np.shape(a), dims, axes, mesh, whole=(key,))))
                for op, ax, shapes in found[name]:
                    assert not (op == "all-gather" and any(np.prod(s) >= whole for s in shapes)), (
                        f"{name}: an all-gather over {ax} of argument {p}'s whole sequence ({key}): {shapes}")
    split = [local(o.shape, dims, axes, mesh) for o, dims in zip(outs, mod._MESH_OUTPUTS)]
    split = [tuple(n // (chunks or {}).get(i, 1) for n, i in zip(s, dims)) for s, o, dims in zip(split, outs, mod._MESH_OUTPUTS)
             if s != o.shape]
    assert split, "no output is split: the kernels' shapes would prove nothing"
    # A kernel may return an output with a unit dimension more (lse as [b, h, 1, s]).
    squeeze = lambda shape: tuple(d for d in shape if d != 1)
    results = kernel_results(fwd)
    for shape in split:
        assert squeeze(shape) in map(squeeze, results), f"no kernel computes a one-device slice {shape} of an output: {results}"


# ----------------------------------------------------------------------- the cases

GQA = spec_text("local_gqa_attention")
CAUSAL = spec_text("causal_attention")
GROUPED = spec_text("grouped_matmul")
DSD = spec_text("dsd_matmul")
TARGETS = sorted(TOPOLOGIES)
AR = "all-reduce"
CP = "collective-permute"

# NOTHING REDUNDANT: compiled, `_on_mesh` runs shard_map with check_vma=True and types each
# pallas_call's outputs by the mesh axes its operands vary over (`_typed`), a gradient by
# its argument's (`_typed_gradients` adds a share up where the argument is whole). Untyped
# (check_vma=False, as the CPU interpreter still runs), the backward all-reduced (1) the
# cotangent of every output whose statement sums a split index (psum's transpose) and (2)
# every argument's gradient over each mesh axis that splits none of the kernel's indices:
# einsum-b-k, grouped-m-g and dsd-n each held one to two all-reduces more than below.

# (id, spec text, sizes, axes, forward, backward, keyword arguments of check_on_topology)
CASES = [
    # k summed: each device's partial product added over model in the forward; the
    # backward's gradients are sliced as their inputs (dx and dy over b, k): none needed.
    ("einsum-b-k", BATCHED, dict(B=2, M=128, K=512, N=128), dict(b="data", k="model"),
     [(AR, "model")], [], {}),
    # m, n split, k whole: no forward collective; dy sums over the rows m (split over
    # data) and dx over the columns n (split over model): each added over its axis.
    ("einsum-m-n", BATCHED, dict(B=2, M=256, K=128, N=512), dict(m="data", n="model"),
     [], [(AR, "data"), (AR, "model")], {}),
    # Expert parallelism: the experts' partial products added over model; in the backward
    # dx sums over the experts (model) and dw over the rows (data).
    ("grouped-m-g", GROUPED, dict(M=1024, K=512, N=512, E=4), dict(m="data", g="model"),
     [(AR, "model")], [(AR, "data"), (AR, "model")], {}),
    # Attention over batch and heads: every device attends its own; nothing moves, and
    # no key/value sequence is gathered.
    ("causal-b-h", CAUSAL, dict(B=2, H=4, S=1024, D=128), dict(b="data", h="model"), [], [], dict(key="j")),
    # H = 16: the 4 key/value heads split with their query heads (h // 4) over model.
    ("gqa-b-h", GQA, dict(B=2, H=16, S=512, D=128), dict(b="data", h="model"), [], [], dict(key="j")),
    # x (coo) whole on every device: its stored blocks' gradient sums over the columns n,
    # each device's added over model; the mesh's data axis splits nothing.
    ("dsd-n", DSD, dict(M=512, K=1024, N=2048), dict(n="model"), [], [(AR, "model")], {}),
    # A coo input dealt by its stored blocks' coordinates along both its dimensions (rows m
    # over data, k over model: 8 buckets, counted under jit as every stored block), k's
    # partial products added over model. The backward: dy sums over the rows (data); the
    # stored blocks' gradients, each device's own bucket's, come home to the caller's
    # order (a scatter: added over both axes).
    ("dsd-m-k", with_tiles(DSD, m=128, n=128, k=128), dict(M=512, K=512, N=512), dict(m="data", k="model"),
     [(AR, "model")], [(AR, "data"), (AR, "data,model")], {}),
    # RING (context parallelism): the sequence split over data (2 devices), i and j
    # together, heads over model. Causal: only device 0's keys and values travel (to device
    # 1), one permute each; the backward sends them again and the key side's gradients
    # home. Never a whole sequence gathered.
    ("causal-ring", CAUSAL, dict(B=1, H=4, S=2048, D=128), dict(h="model", i="data", j="data"),
     [(CP, "data")] * 2, [(CP, "data")] * 4, dict(key="j")),
    # The key index alone over data (heads over model): no key moves; each device runs
    # its rows in 2 chunks against its keys, and the partial results merge across data:
    # the rows' logsumexp (pmax, then psum of the shares) and the weighted outputs (psum).
    # The backward recomputes the forward (those 3) and adds dq across data (shard_map:
    # q is whole on each device); the outputs' cotangents are made whole with no exchange.
    ("causal-j-alone", CAUSAL, dict(B=1, H=4, S=2048, D=128), dict(h="model", j="data"),
     [(AR, "data")] * 3, [(AR, "data")] * 4, dict(key="j", chunks={"i": 2})),
]
# Each case for one topology by default, in turn (the collectives expected are the same on
# both: only the mesh's shape differs), the first and the ring for both; every case for both
# under SPARSEGEN_SWEEP=1.
BOTH = ("einsum-b-k", "causal-ring")
RUNS = [pytest.param(case, target, id=f"{target}-{case[0]}") for n, case in enumerate(CASES) for target in TARGETS
        if SWEEP or case[0] in BOTH or target == TARGETS[n % len(TARGETS)]]


@pytest.mark.parametrize("case,target", RUNS)
def test_sharded_compiles_with_the_expected_collectives(case, target):
    _, text, sizes, axes, forward, backward, more = case
    check_on_topology(text, target, sizes, axes, forward, backward, **more)


def test_collectives_parser_reads_axes_and_permutes():
    """`collectives` on a hand-written shard_map: a psum over model, an all-gather over
    data, a ring step along model (device pairs), a psum over both."""
    from jax import lax

    mesh = topology_mesh("v5e")
    P = jax.sharding.PartitionSpec

    def f(x):
        ring = lax.ppermute(x, "model", [(i, (i + 1) % 4) for i in range(4)])
        return ring, lax.all_gather(x, "data", tiled=True), lax.psum(x, "model"), lax.psum(x, ("data", "model"))

    g = jax.shard_map(f, mesh=mesh, in_specs=P("data", "model"), out_specs=(P("data", "model"), P(None, "model"),
                      P("data", None), P()), check_vma=False)
    x = jax.ShapeDtypeStruct((16, 512), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P("data", "model")))
    with jax.default_device(mesh.devices.flat[0]):
        hlo = jax.jit(g).lower(x).compile().as_text()
    found = collectives(hlo, mesh)
    assert sorted((op, ",".join(a)) for op, a, _ in found) == [
        ("all-gather", "data"), (AR, "data,model"), (AR, "model"), ("collective-permute", "model")]
    assert [s for op, _, s in found if op == "all-gather"] == [[(16, 128)]]  # 8 rows of each of 2 devices


def test_a_paged_decode_split_over_batch_and_heads_compiles_with_no_collective():
    """paged_decode (forward only: a paged walk derives no gradient) with its batch over data
    and its heads over model, compiled for v5e 2x4: the page table and lengths are cut with
    the batch, the cache with its key heads (h // 8) and whole along its pages (the table's
    entries address them). Nothing moves between devices, and the kernel computes one
    device's slice of o."""
    mesh = topology_mesh("v5e")
    kernel, mod = build(spec_text("paged_decode"), target="v5e", formatted=False)
    axes = dict(b="data", h="model")
    args, keywords = example_args(kernel, dict(B=4, H=32, D=128, T=16, NP=8), "random", np.random.default_rng(0))
    spec = lambda dims: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*(axes.get(i) for i in dims)))  # noqa: E731
    structs = [jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=spec(dims)) for a, dims in zip(args, mod._MESH_ARGS)]
    fn = mod.sharded(mesh, **axes)
    with jax.default_device(mesh.devices.flat[0]):
        hlo = jax.jit(lambda *a: fn(*a, **keywords)).lower(*structs).compile().as_text()
    assert "tpu_custom_call" in hlo
    assert collectives(hlo, mesh) == []
    (dims,) = mod._MESH_OUTPUTS
    assert (2, 8, 128) == local((4, 32, 128), dims, axes, mesh)
    assert (2, 8, 128) in kernel_results(hlo), kernel_results(hlo)

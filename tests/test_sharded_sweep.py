"""Every example kernel split over each index it allows (issue 20), derived from the rule.

For every kernel of every spec in specs/ (built fresh from its text), the indices that
`sparsegen/mesh.py`'s `mesh_plan` allows to split (the rule `sharded` enforces through the
module's `_MESH_RULES`): each one split alone over a mesh axis of N devices (a "split"
index, a "sum" index added with psum), and where the rule has a ring, the key index alone
and (where its keys can travel) with the query index on one axis, in order and in zigzag
order. On 8 host CPU devices, in the CPU interpreter, in the
module's one `tests/mesh_runner.py` process (`tests/mesh_jobs.py`): values and `jax.grad`
(of every argument whose gradient the module derives: a paged walk's none yet, issue 19)
equal the kernel unsplit and `reference` (`assert_case`), each output laid out as the split
says. Every index the rule refuses: `sharded` raises the ValueError naming it (here, on a
one-device mesh).

Shapes are small: each spec's tiles capped at SMALL_TILE (the rule is asserted to be the
same as at the spec's own tiles), one block along every size no split divides, N blocks
(2N for a zigzag ring) along those one does. By default a representative part runs
(`representative`: per kind of split, the case of all the examples' that exercises the most
machinery; and a case of every kind of walk, grid, row and paged); SPARSEGEN_SWEEP=1 runs
every case. (The whole sweep: 55 cases, about 300 CPU-seconds; the default part: 6, about 42.)

Also here: a coo input's stored blocks dealt by their coordinates (`_on_mesh_coo`,
`_coo_deal`), values and gradients, in the TPU simulator on the same mesh runner.
"""

from __future__ import annotations

import math
import os
import re

import pytest
from conftest import SPECS, build, with_tiles
from mesh_jobs import MeshJobs, assert_case, differentiable, one_device_mesh

from sparsegen.compiler import lower_source
from sparsegen.mesh import mesh_plan
from sparsegen.shapes import page_sizes
from sparsegen.source import SourceFile

SWEEP = os.environ.get("SPARSEGEN_SWEEP") == "1"
N = 2  # devices along the mesh axis each case splits over
AXIS = "x"
SMALL_TILE = 128  # the TPU's lane width: a tile of at least this keeps every block layout-legal
KINDS = ("split", "sum", "ring", "zigzag", "alone")  # `cases_of`'s kinds of split


def example_kernels() -> list[tuple[str, str]]:
    """(spec name, one kernel's text) for every kernel of every example spec."""
    out = []
    for path in sorted(SPECS.glob("*.spk")):
        text = path.read_text()
        chunks = [c for c in re.split(r"(?m)^(?=kernel\s)", text) if c.startswith("kernel")]
        names = [plan.name for plan in lower_source(SourceFile(path.name, text), "v5e")]
        assert [re.match(r"kernel\s+(\w+)", c).group(1) for c in chunks] == names, path.name
        out += [(path.stem, c) for c in chunks]
    return out


def small(text: str) -> str:
    """The kernel with every tile above SMALL_TILE capped to it."""
    return re.sub(r"(?m)^(\s*tile .*)$", lambda m: re.sub(r"= (\d+)", lambda t: f"= {min(int(t.group(1)), SMALL_TILE)}",
                                                           m.group(1)), text, count=1)


def walk_of(text: str) -> str:
    """How the v5e module walks the kernel: "paged" (a paged walk), "row" (a row walk:
    attention-like), "grid" (a grid kernel)."""
    from sparsegen.tpu.attention.lower import AttentionModule
    from sparsegen.tpu.paged.lower import PagedModule

    (plan,) = lower_source(SourceFile("sweep.spk", text), "v5e")
    return "paged" if isinstance(plan, PagedModule) else "row" if isinstance(plan, AttentionModule) else "grid"


def rule_of(text: str):
    """The kernel's mesh plan as sparsegen/mesh.py decides it for the v5e module, given what
    its emitter gives it (sparsegen/tpu/*/emit.py): a row walk's kernels take the first
    positions of their arrays, so a ring may be asked for, where every argument reaches
    them; a paged walk's do not; a grid kernel's blocks may have to span a dimension."""
    (plan,) = lower_source(SourceFile("sweep.spk", text), "v5e")
    walk = walk_of(text)
    if walk == "paged":
        return mesh_plan(plan.kernel, plan.conv)
    if walk == "row":
        return mesh_plan(plan.kernel, plan.conv, ring=len(plan.conv.impl_args) == len(plan.conv.params))
    return mesh_plan(plan.kernel, plan.conv, plan.spans)


def cases_of(kernel, mod) -> list[tuple[str, str, dict]]:
    """(kind, label, axes) for every split the module allows, one index (or a ring's pair)
    alone: read from the tables `sharded` enforces (`_MESH_RULES`, `_RING_*`)."""
    cases = [(how, index, {index: AXIS}) for index, (how, _) in mod._MESH_RULES.items() if how in ("split", "sum")]
    query, key = getattr(mod, "_RING_QUERY", None), getattr(mod, "_RING_KEY", None)
    if key is not None:
        if mod._RING_TRAVEL is None:
            cases.append(("ring", f"{query}+{key}", {query: AXIS, key: AXIS}))
            cases.append(("zigzag", f"{query}+{key}", {query: [AXIS, "zigzag"], key: AXIS}))
        cases.append(("alone", key, {key: AXIS}))
    return cases


def weight(kernel, mod, index: str) -> int:
    """How much of `sharded`'s machinery splitting `index` exercises: the sizes it divides,
    the coo inputs it deals, the integer inputs it shifts."""
    coo = sum(index in indices for _, _, indices, _ in getattr(mod, "_MESH_COO", ()))
    shifts = sum(i == index for _, i in mod._MESH_SHIFTS)
    return len(mod._MESH_RULES[index][1]) + 2 * coo + 2 * shifts


def representative(kernels) -> set[tuple[str, int]]:
    """The default part, (kernel, case): per kind of split, the case of all the examples'
    that exercises the most machinery (`weight`; the first of equals in spec order; a ring,
    in order or zigzag, the first kernel's); then per kind of walk (grid, row, paged) that
    none of those is in, its first kernel's first case."""
    best: dict[str, tuple[int, str, int]] = {}
    walks = {kernel.name: walk_of(small(text)) for _, text, kernel, _, _ in kernels}
    for _, _, kernel, mod, cases in kernels:
        for n, (kind, label, _) in enumerate(cases):
            w = weight(kernel, mod, label) if kind in ("split", "sum") else 0
            if kind not in best or w > best[kind][0]:
                best[kind] = (w, kernel.name, n)
    chosen = {(name, n) for _, name, n in best.values()}
    for _, _, kernel, _, cases in kernels:
        if cases and walks[kernel.name] not in {walks[name] for name, _ in chosen}:
            chosen.add((kernel.name, 0))
    return chosen


def sizes_for(kernel, mod, cases) -> dict[str, int]:
    """One block along every size, N blocks along each a case divides (2N for a zigzag
    ring: two chunks a device); a `h // n` relation's smaller size divisible by N too; an
    index read through a page table, one block of pages of `page_sizes`' size (the number
    of pages in a cache: `resolve_sizes`' default)."""
    divided: dict[str, int] = {}
    for kind, label, axes in cases:
        for index in axes:
            for symbol in mod._MESH_RULES[index][1]:
                divided[symbol] = max(divided.get(symbol, 1), 2 * N if kind == "zigzag" else N)
    sizes = {}
    for index in kernel.indices:
        symbol = index.size.symbol
        if symbol is not None and index.size.literal is None and not index.size.product:
            sizes[symbol] = math.lcm(sizes.get(symbol, 1), index.tile * divided.get(symbol, 1))
    for index in kernel.indices:  # read through a page table (`j // T`, `j % T`): pages of one block
        if index.size.product:
            page = next(f for f in index.size.product if f in page_divisors(kernel))
            sizes.update({f: page_sizes(kernel)[page] if f == page else index.tile // page_sizes(kernel)[page]
                          for f in index.size.product if isinstance(f, str)})
    for rel in kernel.relations:  # `h // n`: the smaller size follows, divided as the larger one
        big = kernel.index(rel.index).size.symbol
        sizes[big] = math.lcm(sizes[big], rel.divisor * divided.get(rel.dim.symbol, 1))
        sizes.pop(rel.dim.symbol, None)
    return sizes


def page_divisors(kernel) -> set[str]:
    """The size symbols a read divides an index by (`pages[b, j // T]`: T, a page's size)."""
    found: set[str] = set()

    def visit(read) -> None:
        for sub in read.subs:
            if isinstance(sub.divisor, str):
                found.add(sub.divisor)
            if sub.table is not None:
                visit(sub.table)

    for st in kernel.statements:
        for r in (st.target, *st.reads):
            visit(r)
    return found


def output_specs(mod, axes) -> list[str]:
    """Each output's PartitionSpec as jax prints it: its dimensions' axes, trailing Nones dropped."""
    from jax.sharding import PartitionSpec

    out = []
    for dims in mod._MESH_OUTPUTS:
        spec = [AXIS if i in axes else None for i in dims]
        while spec and spec[-1] is None:
            spec.pop()
        out.append(str(PartitionSpec(*spec)))
    return out


def parts(kind: str) -> int:
    """The partial results added (or merged) per output element: N for a sum or a ring,
    2N chunks for a zigzag ring."""
    return {"split": 1, "sum": N, "ring": N, "alone": N, "zigzag": 2 * N}[kind]


# Built at collection: every kernel and its cases; those that run here (`chosen`), its job.
MESH_JOBS = MeshJobs("sharded_sweep")
KERNELS = []
for spec, text in example_kernels():
    kernel, mod = build(small(text), formatted=False)
    KERNELS.append((spec, text, kernel, mod, cases_of(kernel, mod)))
DEFAULT = representative(KERNELS)
for n, (spec, text, kernel, mod, cases) in enumerate(KERNELS):
    chosen = [c for c in range(len(cases)) if SWEEP or (kernel.name, c) in DEFAULT]
    KERNELS[n] += (chosen,)
    if chosen:
        MESH_JOBS.add(f"sweep-{kernel.name}", (small(text), sizes_for(kernel, mod, cases),
                                         [{"mesh": [N], "names": [AXIS], "axes": cases[n][2]} for n in chosen]))
RUNS = [(kernel.name, n, cases[c]) for _, _, kernel, mod, cases, chosen in KERNELS for n, c in enumerate(chosen)]
BY_NAME = {k[2].name: k for k in KERNELS}


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory, worker_id):
    return MESH_JOBS.run(tmp_path_factory, worker_id)


@pytest.mark.parametrize("name,n,case", RUNS, ids=[f"{name}-{kind}-{label}" for name, _, (kind, label, _) in RUNS])
def test_split_alone_equals_unsplit_and_reference(mesh_results, name, n, case):
    (kernel, env, res), = mesh_results[f"sweep-{name}"]
    kind, label, axes = case
    mod = BY_NAME[name][3]
    # Every gradient the module derives (a paged walk's none yet: values only, issue 19).
    grads = assert_case(kernel, env, res, n, output_specs(mod, axes), parts=parts(kind))
    assert grads == len(differentiable(kernel, mod))


def test_the_sweep_covers_what_the_rule_allows():
    """The cases are every split the rule allows (counted here from `mesh_plan` itself, not
    from the module's tables they were read from); the module's tables are that rule; the
    capped tiles leave it as at the spec's own; the default part has a case of every kind
    of split and of every kind of walk there is."""
    expected = total = 0
    for spec, text, kernel, mod, cases, chosen in KERNELS:
        plan = rule_of(small(text))
        assert {r.index: (r.how, r.sizes if r.how else r.why) for r in plan.rules} == mod._MESH_RULES, kernel.name
        assert {r.index: r.how for r in rule_of(text).rules} == \
            {r.index: r.how for r in plan.rules}, f"{kernel.name}: capping its tiles changed its rule"
        count = sum(r.how in ("split", "sum") for r in plan.rules)
        if plan.ring is not None:
            assert (mod._RING_QUERY, mod._RING_KEY, mod._RING_TRAVEL) == (plan.ring.query, plan.ring.key, plan.ring.travel or None)
            count += 1 + (0 if plan.ring.travel else 2)  # the key index alone; a ring in order and in zigzag order
        assert len(cases) == count, (kernel.name, cases)
        expected += count
        total += len(cases)
    assert total == expected and len(KERNELS) == sum(len(lower_source(SourceFile(p.name, p.read_text()), "v5e"))
                                                     for p in SPECS.glob("*.spk"))
    kinds = {kind for *_, cases, _ in KERNELS for kind, _, _ in cases}
    assert set(KINDS) == kinds, kinds
    assert {case[0] for *_, case in RUNS} == kinds, RUNS
    walks = {walk_of(small(text)) for _, text, _, _, cases, _ in KERNELS if cases}
    assert {walk_of(small(text)) for _, text, kernel, *_ in KERNELS if any(name == kernel.name for name, _, _ in RUNS)} == walks
    assert len(RUNS) == (total if SWEEP else len(DEFAULT)) and len(DEFAULT) <= len(kinds) + len(walks)


REFUSED = [(kernel.name, index) for _, _, kernel, mod, _, _ in KERNELS for index, (how, _) in mod._MESH_RULES.items() if how is None]


@pytest.mark.parametrize("name,index", REFUSED, ids=[f"{n}-{i}" for n, i in REFUSED])
def test_refused_index_raises_naming_it(name, index):
    """`sharded` raises the rule's reason (`mesh_plan`'s), naming the index."""
    _, text, kernel, mod, _, _ = BY_NAME[name]
    why = next(r.why for r in rule_of(small(text)).rules if r.index == index)
    with pytest.raises(ValueError) as info:
        mod.sharded(one_device_mesh(), **{index: "data"})
    assert str(info.value) == f"{name}: sharded: index {index} cannot be split: {why}"


RINGS = [(kernel.name, mod) for _, _, kernel, mod, _, _ in KERNELS if getattr(mod, "_RING_KEY", None)]


@pytest.mark.parametrize("name,mod", RINGS, ids=[n for n, _ in RINGS])
def test_ring_index_alone_or_apart_raises_naming_both(name, mod):
    """A ring's query index without its key index (where it has no split of its own), the
    two on different axes, or on one where the keys cannot travel, is refused with both
    named; the key index alone is taken."""
    query, key = mod._RING_QUERY, mod._RING_KEY
    ring = "" if mod._RING_TRAVEL else f"map both to one (a ring: sharded(mesh, {query}=AXIS, {key}=AXIS)) or "
    mesh = one_device_mesh()
    attempts = [({query: "data", key: "model"}, f"the key index {key} and the query index {query} are split over two mesh "
                                                  f"axes: {ring}split the key index alone (sharded(mesh, {key}=AXIS))")]
    if mod._MESH_RULES[query][0] == "ring":
        attempts.append(({query: "data"}, f"the key index {key} is split with the query index {query}, as a ring: map both "
                                          f"to one mesh axis (sharded(mesh, {query}=AXIS, {key}=AXIS))"))
    if mod._RING_TRAVEL:
        attempts.append(({query: "data", key: "data"}, f"the key index {key} cannot travel with the query index {query} as "
                                                       f"a ring: {mod._RING_TRAVEL}; it may be split alone (sharded(mesh, {key}=AXIS))"))
    assert callable(mod.sharded(mesh, **{key: "data"}))
    for axes, message in attempts:
        with pytest.raises(ValueError) as info:
            mod.sharded(mesh, **axes)
        assert str(info.value) == f"{name}: sharded: {message}", axes


# ------------------------------------------------- a coo input's deal in the TPU simulator

# dsd_matmul's x dealt by its stored blocks' row coordinates over 2 devices, its padding
# entries (coordinates -1) among them, in the simulator: memory no step writes is NaN, an
# out-of-bounds read raises (a bucket's padding must reach no block).
COO_SIMULATED = with_tiles(BY_NAME["dsd_matmul"][1], m=128, n=128, k=128)
MESH_JOBS.add("coo-simulator", (COO_SIMULATED, dict(M=256, K=256, N=128),
                          [{"mesh": [N], "names": [AXIS], "axes": {"m": AXIS}, "interpret": "simulator"}], "padded"))


def test_coo_input_split_in_the_tpu_simulator(mesh_results):
    """Values and the gradients of x's stored blocks and of y, as the kernel's unsplit (in
    the CPU interpreter) and `reference`'s."""
    (kernel, env, res), = mesh_results["coo-simulator"]
    assert assert_case(kernel, env, res, 0, [f"P('{AXIS}',)"]) == 2

"""How a kernel runs on a device mesh (language v2, section 4): which of its indices may be
split over a mesh axis, and how, decided once from the IR for every target.

`sharded(mesh, b="data", h="model")` in a generated module runs the kernel under
`jax.shard_map`. Per index of the spec, one rule:

- "split": no statement sums it (batch, heads, rows, an einsum's output columns). Every
  operand dimension it reads is cut into the mesh axis's slices, each device runs the
  kernel on its own, with no communication.
- "sum": a product sums it (an einsum's `k`). Each device sums its slice; the outputs of
  the statements that sum it are added across the axis with `psum`.
- "ring": the key index of an attention-like kernel (`Ring`), split alone (each device
  attends over its keys, the partial results merged by their logsumexp across the axis) or
  with its query index on one axis (a ring, where the keys can travel); that query index
  where it has no split of its own.
- refused, with the reason (`MeshPlan.rules[index].why`): summed under a nonlinear step,
  the key index of an attention-like kernel that the ring's code cannot take, read by a `coo`
  output, or by a `coo` input other than alone and plain, read at an offset, shifted, divided
  by a size or with a modulus, a size fixed by the spec or shared with an index that is not split with it, a
  position or size a condition reads (each shard's offset is not passed to the kernels
  yet), a summed result a later statement reads.

A dimension addressed through a table (`kc[h // 8, pages[b, j // T], j % T, d]`'s second) is
whole on every device: the table's entries address it. The table is split like any other
operand by the indices of its own read (`pages[b, ..]` by b), so a batch split of a paged
decode cuts `pages`, `lens`, `q` and `o` and leaves the cache whole.

A `coo` input's dimension read by a split (or summed) index alone, plainly (`x[m, k]`), is
split by its stored blocks' coordinates: each device gets the blocks whose coordinate falls
in its slice, that coordinate made local, padded to one bucket (`MeshPlan.coo`; the module
deals them, `templates/helpers.py.j2`'s `_on_mesh_coo`).

What the plan cannot know before the call (the mesh's axes and their sizes, the array
sizes) the module checks when it is called: an unknown index or mesh axis, one mesh axis
for two indices, a size not divisible by its axis's size.

The plan is backend-neutral: `wrapper.Wrapper.module` renders it into every module
(`templates/module.py.j2`, the `sharded` function and its tables).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .callconv import Convention
from .ir import Einsum, Elementwise, Kernel, Reduction, SoftmaxProduct


@dataclass(frozen=True)
class Rule:
    """What `sharded` does with one index: `how` is "split", "sum" or None (refused, `why`)."""

    index: str
    how: str | None
    why: str  # a refusal's reason (ends without a full stop); what it does otherwise
    sizes: tuple[str, ...] = ()  # the size symbols a split divides (its own, `h // n` dimensions')
    shifted: tuple[str, ...] = ()  # integer operands compared with its position: given less each shard's offset
    coo: tuple[str, ...] = ()  # coo inputs it reads: their stored blocks dealt by their coordinates along it


@dataclass(frozen=True)
class Ring:
    """The key index of an attention-like kernel split over a mesh axis (context
    parallelism). With the query index on that axis, a ring: each device keeps its rows and
    the key-side arguments travel round the axis. Alone: each device attends over its keys
    (every row, in chunks of the keys' length where the two share a size), the partial
    results merged across the axis by their logsumexp."""

    query: str
    key: str
    # per positional argument: "q" (read with the rows), "k" (travels), "both" (an integer
    # read along both: the rows keep theirs, a copy travels as the key side), "qk" (read
    # along the rows in one dimension and the keys in another: a mask; alone only), None
    roles: tuple[str | None, ...]
    dims: tuple[int | None, ...]  # per positional argument: its dimension along the ring's index ("qk": the rows')
    merges: tuple[str, ...]  # per output: "softmax" (weighted by the rows' logsumexp) or "logsumexp"
    travel: str = ""  # why the keys cannot travel as a ring (split alone only); "" where they can


@dataclass(frozen=True)
class MeshPlan:
    rules: tuple[Rule, ...]  # one per index, in the kernel's order
    args: tuple[tuple[str | None, ...], ...]  # per positional argument: the index of each dimension (None: never split)
    outputs: tuple[tuple[str | None, ...], ...]  # per output: the index of each dimension (() for a coo output: whole)
    sums: tuple[tuple[str, ...], ...]  # per output: the indices its statement sums (psum where split)
    shifts: tuple[tuple[int, str], ...] = ()  # (positional argument, index): less the index's offset on each shard
    ring: Ring | None = None  # where the key index may be split with the query index
    coo: tuple["CooSplit", ...] = ()  # the coo inputs a split may deal by their coordinates


@dataclass(frozen=True)
class CooSplit:
    """A coo input some split index reads: the positional arguments of its blocks and
    coordinates, and per dimension the index reading it (None: never split) and its tile
    (a stored block's extent along it, tile-1 dimensions included)."""

    blocks: int
    coords: tuple[int, ...]
    indices: tuple[str | None, ...]
    tiles: tuple[int, ...]

    def rule(self, index: str) -> Rule:
        return next(r for r in self.rules if r.index == index)


def _terms(kernel: Kernel):
    """(statement, term) for every condition and expression of the kernel."""
    for st in kernel.statements:
        for t in (getattr(st, "condition", None), st.value if isinstance(st, Elementwise) else None):
            if t is not None:
                yield st, t


def _reads(kernel: Kernel):
    """Every access of an operand or local: targets, factors, conditions' and expressions' reads,
    and the reads of tables inside subscripts (`pages[b, j // T]` in `kc[.., pages[b, j // T], ..]`)."""

    def with_tables(r):
        yield r
        for sub in r.subs:
            if sub.table is not None:
                yield from with_tables(sub.table)

    for st in kernel.statements:
        for r in (st.target, *_reads_of(st)):
            yield from with_tables(r)


def _statement(st) -> str:
    return f"`{st.text}`"


def mesh_plan(kernel: Kernel, conv: Convention, spans=(), ring: bool | str = False) -> MeshPlan:
    """The split rule of every index, and where each index sits in the arguments and outputs.
    `spans`: the target's (operand, dim, tile) whose tile must span a symbolic dimension (a
    block breaking the TPU's layout rule), which a slice would make smaller than its tile.
    `ring`: the target's kernels take the first positions of the arrays they are given
    (`_impl(..., origin=)`), so an attention-like kernel's key index may travel as a ring;
    a string: why this module's cannot (its key index's refusal says so)."""
    from .schedule.attention import whole_sizes

    k = kernel
    whole = dict(whole_sizes(k))  # a row kernel's blocks that span their dimension
    for operand, d, tile in spans:
        dim = k.operand(operand).dims[d]
        if dim.symbol is not None:
            whole.setdefault(dim.symbol, tile)
    local_names = {loc.name for loc in k.locals}
    operands = {op.name: op for op in k.operands}
    read_later: dict[str, str] = {}  # output -> the first later statement reading it
    readers: dict[str, list[int]] = {}  # name -> the statements reading it, in order (one pass: linear)
    for n, st in enumerate(k.statements):
        for name in dict.fromkeys(r.operand for r in _reads_of(st)):
            readers.setdefault(name, []).append(n)
    for n, st in enumerate(k.statements):
        name = st.target.operand
        later = readers.get(name, ())
        first = bisect.bisect_right(later, n)
        if first < len(later) and name not in read_later:
            read_later[name] = _statement(k.statements[later[first]])

    # Each operand dimension: the indices that read it (one, where the spec is splittable).
    dim_reads: dict[tuple[str, int], list[str]] = {}
    for r in _reads(k):
        if r.operand in operands:
            for d, sub in enumerate(r.subs):
                if sub.table is not None:
                    continue  # a dimension addressed through a table is whole: the table's own read is split
                for i in sub.indices:
                    if i not in dim_reads.setdefault((r.operand, d), []):
                        dim_reads[(r.operand, d)].append(i)

    rules = []
    for index in k.indices:
        rules.append(_rule(k, index, local_names, operands, read_later, dim_reads, whole))
    the_ring = None
    if isinstance(ring, str):
        rules = [Rule(r.index, None, f"it is the key index of an attention-like kernel: splitting it (a ring) {ring}")
                 if r.why.startswith("it is the key index") else r for r in rules]
    elif ring:
        found = _ring(k, conv, dim_reads, whole)
        if isinstance(found, Ring):
            the_ring = found
            alone = ("each device attends over its keys (every row; in chunks of the keys' length where the rows "
                     "share their size) and the partial results merge across the axis by their logsumexp")
            if found.travel:
                why = f"split alone: {alone}; not with {found.query} as a ring: {found.travel}"
            else:
                why = (f"split with {found.query} over one mesh axis, as a ring: each device keeps its rows, the key-side "
                       "arguments travel round the axis (ppermute) and the partial results merge by their logsumexp; "
                       f"alone, {alone}")
            for n, r in enumerate(rules):
                if r.index == found.key or (r.index == found.query and r.how is None and not found.travel):
                    rules[n] = Rule(r.index, "ring", why if r.index == found.key else
                                    f"split with {found.key} over one mesh axis, as a ring (alone: {r.why})",
                                    (k.index(r.index).size.symbol,))
        else:
            rules = [Rule(r.index, None, found) if r.why.startswith("it is the key index") else r for r in rules]

    def dims(op_name: str) -> tuple[str | None, ...]:
        op = operands[op_name]
        return tuple(dim_reads.get((op.name, d), [None])[0] for d in range(op.rank))

    args = []
    for p in conv.params:
        if p.kind in ("dense", "mask", "table"):
            args.append(dims(p.operand))
        else:  # a coo operand's blocks and coordinates (a coo input's dealt where `coo` says), offsets: whole
            args.append(())
    outputs, sums = [], []
    for out in k.outputs:
        outputs.append(dims(out.name) if out.sparsity != "coo" else ())
        st = k.statement_of(out.name)
        sums.append(tuple(st.summed) if isinstance(st, Einsum) else ())
    shifts = tuple((n, r.index) for r in rules for operand in r.shifted
                   for n, p in enumerate(conv.params) if p.operand == operand and p.kind == "dense")
    coo = []
    splittable = {r.index for r in rules if r.how in ("split", "sum")}
    for op in k.inputs:
        if op.sparsity != "coo" or not splittable & set(dims(op.name)):
            continue
        positions = {(p.kind, p.dim): n for n, p in enumerate(conv.params) if p.operand == op.name}
        indices = tuple(i if i in splittable else None for i in dims(op.name))
        tiles = tuple(k.index(i).tile if i is not None else 1 for i in dims(op.name))
        coo.append(CooSplit(positions[("blocks", None)], tuple(positions[("coords", d)] for d in range(op.rank)), indices, tiles))
    return MeshPlan(tuple(rules), tuple(args), tuple(outputs), tuple(sums), shifts, the_ring, tuple(coo))


def _ring(k: Kernel, conv: Convention, dim_reads, whole) -> Ring | str:
    """The ring of an attention-like kernel, or why its key index cannot travel as one."""
    from .schedule.attention import row_plan
    from .schedule.build import ScheduleError

    try:
        plan = row_plan(k)
    except ScheduleError:
        return "it is the key index of a kernel the row walk does not take: it cannot be split"
    i, j = plan.query, plan.key
    lead = f"it is the key index of an attention-like kernel: splitting it (a ring, with {i})"
    merges = []
    for out in k.outputs:
        c = next((c for c in plan.consumers if c.output == out.name), None)
        if c is None or c.kind not in ("softmax_product", "logsumexp"):
            return f"{lead} merges softmax products and logsumexps only, and {out.name} is neither"
        merges.append("softmax" if c.kind == "softmax_product" else "logsumexp")
        indices = k.statement_of(out.name).target.indices
        if indices[:len(plan.lead) + 1] != (*plan.lead, i):
            return f"{lead} needs each output laid out as its rows ({', '.join((*plan.lead, i))}, ...), and {out.name} is not"
    if len(plan.points) != 1:
        return f"{lead} merges the results of one score, and this kernel has {len(plan.points)}"
    for index in (i, j):
        size = k.index(index).size
        if size.product or size.symbol is None or size.literal is not None:
            return f"{lead} needs sizes a shard can have, and {index}'s is fixed by the spec ({size.describe()})"
        if size.symbol in whole:
            return f"{lead} is not possible: its blocks span {size.symbol} whole (a tile of {whole[size.symbol]})"
        for st, term in _terms(k):
            if any(t.op == "size" and t.name == size.symbol for t in term.walk()):
                return f"{lead} is not possible: {_statement(st)} reads the size {size.symbol}, which a shard's would change"
    for (operand, d), indices in dim_reads.items():
        integer = not k.operand(operand).dtype.is_float
        if {i, j} & set(indices) and len(indices) > 1 and not (integer and set(indices) == {i, j}):
            return (f"{lead} is not supported yet: {operand} dim {d} is read as {' and as '.join(indices)}, "
                    "and only arguments read along one of them (or integers read along both) travel or stay")
    for r in _reads(k):
        for sub in r.subs:
            if {i, j} & set(sub.indices) and (sub.offset is not None or sub.shift or sub.modulus is not None or sub.table is not None):
                return f"{lead} is not possible: {r.text} reads it at an offset or through a table"
    roles, dims, travel = [], [], ""
    for p in conv.params:
        if p.kind not in ("dense", "mask"):
            return f"{lead} is not supported yet for the {p.kind} argument {p.public}"
        op = k.operand(p.operand)
        found = [(d, dim_reads.get((op.name, d), [None])[0]) for d in range(op.rank)]
        at = [(d, x) for d, x in found if x in (i, j)]
        both = [d for d in range(op.rank) if set(dim_reads.get((op.name, d), ())) == {i, j}]
        if both and len(at) > 1 or len(at) > 2:
            return f"{lead} is not supported yet: {op.name} is read along both {i} and {j}, so it can neither travel nor stay"
        if both:  # segment ids: the rows keep theirs, the key side's travel with the keys
            roles.append("both")
            dims.append(both[0])
            continue
        if len({x for _, x in at}) > 1:
            # A mask over (rows, keys): split with the keys and cut with the rows, it cannot travel.
            travel = travel or f"{op.name} is read along both {i} and {j}, so it can neither travel nor stay"
            roles.append("qk")
            dims.append(next(d for d, x in at if x == i))
            continue
        roles.append(None if not at else "q" if at[0][1] == i else "k")
        dims.append(at[0][0] if at else None)
    return Ring(i, j, tuple(roles), tuple(dims), tuple(merges), travel)


def _reads_of(st):
    """What a statement reads (operands and locals)."""
    out = list(st.reads)
    if isinstance(st, Elementwise):
        out += st.value.locals
    if isinstance(st, Reduction):
        out.append(st.arg)
    if isinstance(st, SoftmaxProduct):
        out += [st.scores, st.value]
    return out


def _rule(k: Kernel, index, local_names, operands, read_later, dim_reads, whole) -> Rule:
    name = index.name

    def refuse(why: str) -> Rule:
        return Rule(name, None, why)

    # Sums.
    summed_by = []
    for st in k.statements:
        if isinstance(st, SoftmaxProduct) and st.index == name or isinstance(st, Reduction) and st.index == name:
            fn = "softmax" if isinstance(st, SoftmaxProduct) else st.fn
            return refuse(f"it is the key index of an attention-like kernel ({fn} over it in {_statement(st)}): "
                          "splitting it (context parallelism, a ring) is not supported yet")
        if isinstance(st, Einsum) and name in st.summed:
            target = st.target.operand
            if target in local_names:
                return refuse(f"it is summed into the local {target} ({_statement(st)}), which a nonlinear step reads "
                              "(softmax, an elementwise function): partial sums cannot be added after it")
            if target in read_later:
                return refuse(f"it is summed into {target} ({_statement(st)}), which {read_later[target]} reads: "
                              "its partial sums would meet the next statement before they are added")
            summed_by.append(target)
    # Every read of it: plain, or `name // n`; a coo input's plain only, a coo output's refused.
    coo: list[str] = []
    for r in _reads(k):
        for d, sub in enumerate(r.subs):
            if name not in sub.indices:
                continue
            op = operands.get(r.operand)
            if op is not None and op.sparsity == "coo" and op.direction != "in":
                return refuse(f"the sparse coo output {op.name} is indexed by it ({r.text}): splitting a coo output's "
                              "requested blocks is not supported yet (a coo input's stored blocks are split by their coordinates)")
            if op is not None and op.sparsity == "coo":
                if sub.divisor != 1:
                    return refuse(f"the sparse coo input {op.name} reads it divided ({r.text}): its stored blocks are split "
                                  "by coordinates read plainly only")
                if op.name not in coo:
                    coo.append(op.name)
            if sub.table is not None:
                # The dimension is addressed by the table's entries (`kc[.., pages[b, j // T], ..]`): it
                # stays whole on every device, and the table's own read (visited as one) is what a split cuts.
                continue
            form = ("at an offset" if sub.offset is not None else "shifted" if sub.shift else
                    "with a modulus" if sub.modulus is not None else "divided by a size" if isinstance(sub.divisor, str) else None)
            if form:
                return refuse(f"{r.text} reads it {form} ({sub.text}), which a slice would move")
            if op is not None:
                others = [i for i in dim_reads.get((op.name, d), []) if i != name]
                if others:
                    return refuse(f"{op.name} dim {d} is read both as {name} and as {others[0]}")
    size = index.size
    if size.product or size.symbol is None or size.literal is not None:
        return refuse(f"its size is fixed by the spec ({size.describe()}), so a shard's slice cannot have it")
    # Every dimension a split divides: its size's, and those read as `name // n`.
    divided = [size.symbol]
    for rel in k.relations:
        if rel.index == name:
            if rel.dim.symbol is None or rel.dim.literal is not None:
                return refuse(f"{rel.what}, read as {name} // {rel.divisor}, has a size fixed by the spec ({rel.dim.describe()})")
            if rel.dim.symbol not in divided:
                divided.append(rel.dim.symbol)
    for symbol in divided:
        if symbol in whole:
            return refuse(f"its blocks span {symbol} whole (a tile of {whole[symbol]}), so a slice would be smaller than its tile")
    for other in k.indices:
        if other.name != name and other.size.symbol in divided:
            return refuse(f"its size {other.size.symbol} is also the size of index {other.name}, "
                          f"which a split of {name} would leave whole (each shard's kernel would see two sizes of {other.size.symbol})")
    for rel in k.relations:
        if rel.index != name and rel.dim.symbol in divided:
            return refuse(f"its size {rel.dim.symbol} is also that of {rel.what}, read as {rel.index} // {rel.divisor}")
    # Positions and sizes a condition or an expression reads stay global.
    for st, term in _terms(k):
        for t in term.walk():
            if t.op == "size" and t.name in divided:
                return refuse(f"{_statement(st)} reads its size {t.name}, which a split would change")
    shifted = _shifted(k, name, operands)
    if isinstance(shifted, str):
        return refuse(shifted)
    if summed_by:
        return Rule(name, "sum", f"split; the partial sums of {', '.join(summed_by)} are added (psum)", tuple(divided), shifted,
                    tuple(coo))
    return Rule(name, "split", "split: each device runs the kernel on its slice", tuple(divided), shifted, tuple(coo))


def _shifted(k: Kernel, name: str, operands) -> tuple[str, ...] | str:
    """The integer operands to give each shard less its offset, so that the conditions that
    read the position of `name` compare global positions: every read of its position is
    compared with a read of a signed integer input (`gid[m] == g`, `lo[g] <= m < hi[g]`),
    which is read nowhere but beside that position (so subtracting the offset from its
    values is the same as adding it to the position). Otherwise why not (a message)."""
    shifted: list[str] = []
    seen = False
    for st, term in _terms(k):
        positions = [t for t in term.walk() if t.op == "index" and t.name == name]
        if not positions:
            continue
        seen = True
        beside = []
        for t in term.walk():
            if t.op != "cmp":
                continue
            for n, a in enumerate(t.args):
                if a.op == "index" and a.name == name:
                    beside += [t.args[m] for m in (n - 1, n + 1) if 0 <= m < len(t.args)]
        counted = sum(1 for t in term.walk() if t.op == "cmp" for a in t.args if a.op == "index" and a.name == name)
        if counted != len(positions) or not all(b.op == "read" and _integer_input(operands.get(b.read.operand)) for b in beside):
            return (f"{_statement(st)} reads its position other than compared with an integer input's values, and "
                    "adding each shard's offset to a position is not supported yet")
        unsigned = next((operands[b.read.operand] for b in beside if not _signed_input(operands[b.read.operand])), None)
        if unsigned is not None:
            return (f"{_statement(st)} compares its position with {unsigned.name}, an unsigned input "
                    f"({unsigned.dtype.name}): each shard is given it less the shard's offset, which would wrap "
                    f"below zero (declare it i32 or index)")
        for b in beside:
            if b.read.operand not in shifted:
                shifted.append(b.read.operand)
    if not seen:
        return ()
    for operand in shifted:
        # Every read of it is one of those comparisons: counted among all its reads.
        total = beside_only = 0
        for st in k.statements:
            if isinstance(st, Einsum):
                total += sum(r.operand == operand for r in st.factors)
            if isinstance(st, (Reduction, SoftmaxProduct)):
                total += sum(r.operand == operand for r in ((st.arg,) if isinstance(st, Reduction) else (st.scores, st.value)))
        for st, term in _terms(k):
            total += sum(t.read is not None and t.read.operand == operand for t in term.walk())
            for t in term.walk():
                if t.op != "cmp":
                    continue
                for n, a in enumerate(t.args):
                    if a.op == "read" and a.read.operand == operand:
                        beside = [t.args[m] for m in (n - 1, n + 1) if 0 <= m < len(t.args)]
                        beside_only += all(b.op == "index" and b.name == name for b in beside)
        if beside_only != total:
            return (f"{operand} is compared with the position of {name} and also read otherwise, so a shard cannot be "
                    "given it less its offset; adding each shard's offset to a position is not supported yet")
    return tuple(shifted)


def _integer_input(op) -> bool:
    return op is not None and op.direction == "in" and op.sparsity == "dense" and op.dtype.kind in ("int", "uint", "index")


def _signed_input(op) -> bool:
    return _integer_input(op) and op.dtype.kind != "uint"

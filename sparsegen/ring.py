"""What every attention-like module takes for `sharded`'s ring (context parallelism), the
same on every target: the emitters' shared part (a mixin of the TPU and GPU attention
emitters; the ring itself is `templates/ring.py.j2`, which both templates include).

A ring runs the module's `_impl` and `_run_backward` on a pair of a device's rows and some
device's keys, passing two keywords:

- `origin=`: an int32[2] of the first global positions of the rows and keys given, where a
  condition or the chain compares positions (the classification and the kernels add them);
- `keys=`: the key side of the integer arguments read along both indices (segment ids):
  the rows keep theirs, the keys' travel with the keys; every read along the key index
  takes the key side (`keyed`).
"""

from __future__ import annotations

from .expr import Var
from .ir import Read
from .pytext import py_tuple
from .schedule.classify import Classifier


class RingSides:
    """The emitter's `p` (a RowPlan), `k`, `m.conv`, `n`, `tile` and `ragged` are read."""

    def shard_sides(self, supported: bool) -> None:
        """`positions` (a condition or the chain compares positions), `origins` (the kernels'
        name for the first positions), `key_side` (operand -> its key-side variable) and
        `shard_keywords` (what `_impl` and the classification take); none where the
        target's walk takes no first positions (`supported`)."""
        self.positions = supported and self.uses_positions()
        self.origins = self.n.local("origins")
        # Integer arguments read along both the query and the key index (segment ids): the
        # key side's values may come from another array (`_impl(..., keys=...)`: the ring's
        # travelling shard, while the rows keep theirs).
        self.key_side = {}
        if supported:
            self.key_side = {name: self.n.local(f"{self.m.conv.param(name).internal}_keys") for name in self.both_sides()}
        self.shard_keywords = tuple(w for w, on in (("origin", self.positions), ("keys", bool(self.key_side))) if on)

    # -------------------------------------------------------- classification
    # The target's kernels evaluate only the part of a condition that may fail (`Classification.parts`).
    split_conjuncts = False
    conjunct_parts = None

    def split_keyword(self) -> list[str]:
        """The classification's `split=True` where its kinds are split (the walk's, not `block_kinds`')."""
        return ["split=True"] if self.conjunct_parts else []

    def classify(self) -> tuple[str, list[str], list[str]]:
        """The block-kind function: its name, parameters and lines."""
        p = self.p
        scope = self.n.scope()
        origins = {}
        if self.positions:
            origins = {i: Var(scope.local(f"{i}_origin")) for i in (p.query, p.key)}
        cl = Classifier(p, self.m.conv, scope.local, lambda i: self.tile[i], lambda i: self.m.conv.size(self.k.index(i).size), origins,
                        self.keyed)
        lines = cl.kinds([i for i in (p.query, p.key) if self.ragged(i)], self.split_conjuncts)
        self.conjunct_parts = cl.split  # per conjunct of the condition, its part (None: kinds not split)
        if origins:
            first = ", ".join(v.name for v in origins.values())
            lines = [f"{first} = (0, 0) if origin is None else (origin[0], origin[1])"] + lines
        lines = self.key_side_lines() + lines
        reads = []
        for r in (r for cond in p.conditions for r in cond.reads):
            param = self.m.conv.param(r.operand).internal
            if param not in reads:
                reads.append(param)
        return self.n.function("_classify_blocks"), reads, lines

    def kinds_call(self, kinds_var: str, classify_fn: str, classify_reads: list[str], xp: str, data: bool) -> list[str]:
        """`_impl`'s and `_backward`'s classification: the key sides, the block kinds (under
        jit where traced first positions are given) and the first positions as the kernels
        read them."""
        if self.positions:
            lines = [f"{kinds_var} = {classify_fn}({xp if data else 'np if origin is None else jnp'}, "
                     f"{', '.join(classify_reads + ['sizes', 'origin'] + (['keys'] if self.key_side else []) + self.split_keyword())})",
                     f"{self.origins} = jnp.asarray((0, 0) if origin is None else origin, jnp.int32)"]
        else:
            lines = [f"{kinds_var} = {classify_fn}({xp}, {', '.join(classify_reads + ['sizes'] + (['keys=keys'] if self.key_side else []) + self.split_keyword())})"]
        return self.key_side_lines() + lines

    # ------------------------------------------------------------- key sides
    def both_sides(self) -> list[str]:
        """Integer inputs read along the query index and, elsewhere, along the key index."""
        p, out = self.p, []
        for name in dict.fromkeys(r.operand for r in p.reads):
            op = self.k.operand(name)
            reads = [r for r in p.reads if r.operand == name]
            if (not op.dtype.is_float and any(p.query in r.indices and p.key not in r.indices for r in reads)
                    and any(p.key in r.indices and p.query not in r.indices for r in reads)):
                out.append(name)
        return out

    def key_side_lines(self) -> list[str]:
        """The key-side arrays: given (`keys`), or the arguments' own."""
        return [f"{var} = {self.m.conv.param(name).internal} if keys is None else keys[{n}]"
                for n, (name, var) in enumerate(self.key_side.items())]

    def keyed(self, r: Read) -> str | None:
        """The key-side array variable a read uses instead of its operand's (None: its own)."""
        return self.key_side.get(r.operand) if self.p.key in r.indices else None

    # ------------------------------------------------------------- positions
    def _reads_positions(self, terms) -> bool:
        return any(t.op == "index" and t.name in (self.p.query, self.p.key) for term in terms for t in term.walk())

    def uses_positions(self) -> bool:
        """Does a condition or the chain read the query or key position?"""
        return self._reads_positions([term for _, term in self.p.chain] + list(self.p.conditions))

    def chain_uses_positions(self) -> bool:
        return self._reads_positions(term for _, term in self.p.chain)

    # ------------------------------------------------------------------ ring
    def ring_tables(self, glue, ring, statics: str, consumers=None, lockstep: tuple[str, str] | None = None) -> dict:
        """`sharded`'s ring (where mesh.py allows one): how each of `_impl`'s results merges,
        its rows' dimension, which are the outputs and which the rows' logsumexp (the last);
        `statics`: the static arguments `_impl` and `_run_backward` take after the arrays, for
        a pair; `consumers`: those of `_impl`'s results before the logsumexp (default: the
        plan's, in order); `lockstep`: (a test of `interpret`, what it is) where the target's
        interpreter runs a kernel on every device together, so that no device may skip one."""
        if ring is None:
            return {}
        p = self.p
        consumers = p.consumers if consumers is None else consumers
        rows = [self.k.statement_of(c.output).target.indices.index(p.query) for c in consumers] + [len(p.lead)]
        quoted = lambda xs: py_tuple("None" if x is None else repr(x) for x in xs)  # noqa: E731
        return {
            "roles": quoted(ring.roles),
            "dims": quoted(ring.dims),
            "merges": quoted(["softmax" if c.kind == "softmax_product" else "logsumexp" for c in consumers] + ["logsumexp"]),
            "rows": py_tuple(str(r) for r in rows),
            "declared": py_tuple(str(glue.kept.index(d)) for d in glue.declared),
            "lse": str(len(glue.kept) - 1),
            "lengths": quoted([self.k.index(i).size.symbol for i in (p.query, p.key)]),
            # the classification's operands among a pair's arguments
            "classify_args": "".join(f"args[{self.m.conv.impl_args.index(a)}], " for a in self.classify_reads),
            "statics": statics,
            "lockstep": lockstep[0] if lockstep else "",
            "lockstep_why": lockstep[1] if lockstep else "",
            # why the keys cannot travel (the key index split alone only), or None
            "travel": repr(ring.travel or None),
        }

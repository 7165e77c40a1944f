"""The row walk's emitter state and host side, the same on every target: the names, tiles and
wrapper of a module, the shard's first positions (`sharded`'s ring), sizes as the host
writes them, `_prepare`'s lines and the gradient tables. The TPU row and paged emitters and
the GPU paged emitter stand on it; each target writes its kernels."""

from __future__ import annotations

from ..expr import render
from ..ir import Read
from ..ring import RingSides
from ..wrapper import Wrapper, vjp_tables
from .reference import ReferenceWriter


class RowHost(RingSides, ReferenceWriter):
    """A row or paged walk's module (`m`: a lowered module with kernel, plan, names, conv,
    walk, operands, refused), up to its kernels."""

    origin_supported = True  # `_impl` takes the arrays' first positions (not the paged walk's)

    def __init__(self, m):
        self.m = m
        self.k = m.kernel
        self.p = m.plan
        self.n = m.names
        self.tile = {i.name: i.tile for i in self.k.indices}
        self.wrapper = Wrapper(m.kernel, m.conv, (), m.names.local("size"), m.names)
        self.sizes = [s.internal for s in m.conv.sizes]
        self.acc = self.k.accumulate
        # Module-level names shared by the calls.
        self.w = m.walk
        self.tables = [t.var for t in self.w.tables]
        self.walk_tables = list(self.tables)
        # A condition (or the chain) comparing query or key positions compares global ones:
        # `_impl(..., origin=...)` gives the first position of the arrays passed (a shard on a
        # mesh, `sharded`'s ring), in scalar memory after the walk's tables; integers read
        # along both indices take their key side from `keys=` (sparsegen/ring.py).
        self.shard_sides(self.origin_supported)
        if self.positions:
            self.tables.append(self.origins)
        self.steps = self.w.step.static
        # A walk classified under jit (operands read by the condition, or a shard's traced
        # first positions) runs a traced number of steps: the most any group needs, with
        # tables of the bound's length (the dense count by default).
        self.dynamic = bool(self.p.data_dependent or self.positions)
        self.n_run = self.n.local("n_run") if self.dynamic else self.steps
        maps = self.n.scope()  # the index maps' parameters
        self.grid_vars = [maps.local(i) for i in self.p.lead]
        self.t = maps.local("t")
        # The TPU backward's per-row arrays and gradients (the GPU paged emitter takes these names
        # too, unused, as when it stood on the TPU emitter: its modules keep their bytes).
        self.row_hosts = {"row_lse": self.n.local("row_lse_rows"), "delta": self.n.local("delta_rows")}
        self.col_hosts = {"row_lse": self.n.local("row_lse_cols"), "delta": self.n.local("delta_cols")}
        if any(c.kind == "sum" for c in self.p.consumers):
            self.row_hosts["dsum"] = self.n.local("dsum_rows")
            self.col_hosts["dsum"] = self.n.local("dsum_cols")
        self._fns: dict[object, str] = {}
        self.float_grads: list = []  # (read, variable in _backward, the indices it is laid out over)
        self.grad_vars: dict[str, str] = {}  # `grad_var`: a gradient's variable, shared by the two backward walks

    def fn(self, preferred: str, key: object = None) -> str:
        """A module-level function name, the same for the same `key` (default: the preferred
        name, for the walk's fixed maps). A name derived from a spec name is keyed by what it
        maps: an output named `row_lse_rows` prefers the name of the row statistics' map, and
        must not be given it."""
        key = preferred if key is None else key
        if key not in self._fns:
            self._fns[key] = self.n.function(preferred)
        return self._fns[key]

    def size_of(self, index: str) -> str:
        size = self.k.index(index).size
        if size.product and size.literal is None:  # `j // T`, `j % T`: NP * T
            return f"({render(self.m.conv.size(size), 'host')})"
        return str(size.literal) if size.literal is not None else self.m.conv.size_var(size.symbol)

    def ragged(self, index: str) -> bool:
        idx = self.k.index(index)
        return idx.size.literal is None or idx.size.literal % idx.tile != 0

    def dim_size(self, read: Read, d: int) -> str:
        dim = self.k.operand(read.operand).dims[d]
        return str(dim.literal) if dim.literal is not None else self.m.conv.size_var(dim.symbol)

    def e_of(self, c) -> str:
        return next(i for i in self.k.statement_of(c.output).target.indices if i not in self.p.lead and i != self.p.query)

    # ------------------------------------------------------------- the wrapper
    def prepare_lines(self) -> list[str]:
        lines = self.wrapper.prepare_lines([])
        checks = self.wrapper.whole_checks([o.read for o in self.m.operands], self.p.inner, self.tile)
        return lines[:-1] + checks + lines[-1:]

    def gradient_tables(self, backward: dict, derived: list[str]) -> str:
        """`_PARTIALS` (every gradient the backward computes: argument, output) and `_REFUSED`
        (those not derived, raised only where needed), as in the einsum modules."""
        args = list(self.m.conv.impl_args)
        outputs = [o.name for o in self.k.outputs]
        arg = {p_.operand: args.index(p_.internal) for p_ in self.m.conv.params if p_.internal in args}
        table = [f"({arg[op]}, {outputs.index(o)})" for op in backward.get("grads", ()) for o in derived]
        return vjp_tables(["# The gradients the backward computes: (argument, output whose cotangent carries it)."], table,
                          self.m.refused, arg.__getitem__, outputs)

"""Check: turn a parsed spec into checked kernels, or report every problem found.

Each rule of the language page is one method below; each diagnostic points at the
token that breaks the rule. Checks that would only repeat an earlier error stop early.
"""

from __future__ import annotations

import keyword

from . import syntax as ast
from .dtypes import DATA_DTYPES, DTYPES
from .layout import layout_problem
from .names import HELPERS, MODULE_NAMES
from .model import Index, Kernel, Operand, OffsetRef, Size, Term
from .source import Diagnostic, Span, SpecError

# Module-level names of a generated module: a kernel may not take one of them as its name.
RESERVED_KERNEL_NAMES = MODULE_NAMES | {"numpy"}
SPARSITIES = ("coo", "mask")
ACCUMULATE_DTYPES = ("f32", "i32")


class _Stop(Exception):
    """Later checks of this kernel would only restate the errors already found."""


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


class _KernelChecker:
    def __init__(self, kernel: ast.Kernel, source_name: str, digest: str):
        self.k = kernel
        self.source_name = source_name
        self.digest = digest
        self.errors: list[Diagnostic] = []

    def error(self, span: Span | None, message: str, *notes: str) -> None:
        self.errors.append(Diagnostic(span, message, tuple(notes)))

    def stop_if_errors(self) -> None:
        if self.errors:
            raise _Stop

    # ------------------------------------------------------------------ names
    def check_identifier(self, name: ast.Name, what: str) -> None:
        if keyword.iskeyword(name.text):
            self.error(name.span, f"{what} '{name.text}' is a Python keyword; choose another name")

    def check_names(self) -> None:
        k = self.k
        self.check_identifier(k.name, "kernel name")
        if k.name.text in RESERVED_KERNEL_NAMES:
            self.error(
                k.name.span,
                f"kernel name '{k.name.text}' is taken by the generated module itself; choose another name",
                "a generated module defines `reference`, helpers named `_...`, and imports jax, jnp, np, lax, pl, pltpu and functools",
            )
        seen: dict[str, ast.Operand] = {}
        for op in k.operands:
            self.check_identifier(op.name, "operand name")
            if op.name.text in seen:
                self.error(op.name.span, f"operand '{op.name.text}' is declared twice (first at {seen[op.name.text].name.span})")
            else:
                seen[op.name.text] = op
            for dim in op.dims:
                if isinstance(dim.value, str):
                    self.check_identifier(ast.Name(dim.value, dim.span), "size")
                    if dim.value == "interpret" or dim.value in HELPERS:
                        self.error(dim.span, f"size '{dim.value}' would clash with a name of the generated module; rename it")
        self.operands = seen

    # --------------------------------------------------------------- operands
    def check_operands(self) -> None:
        outs = [op for op in self.k.operands if op.direction == "out"]
        if not outs:
            self.error(self.k.name.span, f"kernel '{self.k.name.text}' declares no output; add a line `out NAME: DTYPE[...]`")
        for extra in outs[1:]:
            self.error(extra.name.span, f"kernel '{self.k.name.text}' declares a second output; v0 kernels have exactly one")
        for op in self.k.operands:
            dtype = op.dtype.text
            if dtype not in DTYPES:
                self.error(op.dtype.span, f"unknown dtype '{dtype}'; expected one of {', '.join(DTYPES)}")
                continue
            if op.direction == "out" and dtype == "index":
                self.error(op.dtype.span, "an output cannot have dtype 'index' (index operands are read-only scalars)")
            if op.sparsity is not None:
                s = op.sparsity.text
                if s not in SPARSITIES:
                    self.error(op.sparsity.span, f"unknown sparsity '{s}'; expected 'coo' or 'mask'")
                elif dtype == "index":
                    self.error(op.sparsity.span, f"an index operand cannot be {s}: it is a small array of scalars")
                elif op.direction == "out" and s == "mask":
                    self.error(op.sparsity.span, "an output cannot be 'mask' sparse; a sparse output is 'coo' (only given blocks are computed)")
            if dtype == "index":
                if len(op.dims) != 1:
                    self.error(op.span, f"index operand '{op.name.text}' must have one dimension (a vector of offsets)")
                elif not isinstance(op.dims[0].value, int):
                    self.error(op.dims[0].span, f"index operand '{op.name.text}' needs a literal length")
            for dim in op.dims:
                if isinstance(dim.value, int) and dim.value <= 0:
                    self.error(dim.span, f"dimension size must be positive, got {dim.value}")
        sparse = [op for op in self.k.operands if op.direction == "in" and op.sparsity is not None and op.sparsity.text in SPARSITIES]
        for extra in sparse[1:]:
            self.error(
                extra.sparsity.span,
                f"'{extra.name.text}' is a second sparse input; v0 allows one (here '{sparse[0].name.text}' at {sparse[0].sparsity.span})",
            )
        self.stop_if_errors()
        self.output = outs[0]

    # --------------------------------------------------------------- statement
    def check_statement(self) -> None:
        k = self.k
        if not k.statements:
            self.error(k.name.span, f"kernel '{k.name.text}' has no statement; add one like `o[i, j] = x[i, k] * y[k, j]`")
            raise _Stop
        for extra in k.statements[1:]:
            self.error(extra.span, "a kernel has one statement; split this into another kernel")
        st = k.statements[0]
        self.statement = st
        target = st.target
        if target.operand.text not in self.operands:
            self.error(target.operand.span, f"'{target.operand.text}' is not declared")
        elif target.operand.text != self.output.name.text:
            self.error(target.operand.span, f"the statement must assign the output '{self.output.name.text}', not '{target.operand.text}'")
        used: dict[str, ast.Access] = {}
        for acc in st.factors:
            name = acc.operand.text
            op = self.operands.get(name)
            if op is None:
                self.error(acc.operand.span, f"'{name}' is not declared")
                continue
            if op.direction == "out":
                self.error(acc.operand.span, f"the output '{name}' cannot be read on the right-hand side")
                continue
            if op.dtype.text == "index":
                self.error(acc.operand.span, f"'{name}' is an index operand: it can only offset a subscript, as in `x[{name}[0] + i]`")
                continue
            if name in used:
                self.error(acc.operand.span, f"'{name}' appears twice in the statement; v0 reads each input once")
                continue
            used[name] = acc
        self.stop_if_errors()
        # Every access: rank, offsets, repeated indices.
        offsets_used: set[str] = set()
        for acc in (target, *st.factors):
            op = self.operands[acc.operand.text]
            if len(acc.subscripts) != len(op.dims):
                self.error(
                    acc.span,
                    f"'{op.name.text}' has {len(op.dims)} dimension{'s' if len(op.dims) != 1 else ''} but is accessed with {len(acc.subscripts)} subscript{'s' if len(acc.subscripts) != 1 else ''}",
                )
                continue
            seen: dict[str, ast.Subscript] = {}
            for sub in acc.subscripts:
                self.check_identifier(sub.index, "index name")
                if sub.index.text in seen:
                    self.error(sub.index.span, f"index '{sub.index.text}' is used twice in one access (a diagonal); v0 does not support that")
                seen[sub.index.text] = sub
                if sub.offset is None:
                    continue
                off = sub.offset
                offsets_used.add(off.operand.text)  # used, even where the use itself is wrong
                if acc is target:
                    self.error(off.span, "the output is written at its own blocks: no offsets on the left-hand side")
                    continue
                if op.sparsity is not None:
                    self.error(off.span, f"'{op.name.text}' is sparse; offsets apply to dense operands only")
                    continue
                ref = self.operands.get(off.operand.text)
                if ref is None:
                    self.error(off.operand.span, f"'{off.operand.text}' is not declared")
                    continue
                if ref.dtype.text != "index":
                    self.error(off.operand.span, f"an offset is read from an 'index' operand; '{ref.name.text}' has dtype {ref.dtype.text}")
                    continue
                if ref.direction != "in":
                    continue
                length = ref.dims[0].value
                if isinstance(length, int) and not 0 <= off.position < length:
                    self.error(off.position_span, f"'{ref.name.text}' has {length} entr{'y' if length == 1 else 'ies'}; position {off.position} is out of range")
        for op in self.k.operands:
            if op.direction != "in":
                continue
            if op.dtype.text == "index":
                if op.name.text not in offsets_used:
                    self.error(op.name.span, f"index operand '{op.name.text}' is never used; read it in a subscript, as in `x[{op.name.text}[0] + i]`")
            elif op.name.text not in used:
                self.error(op.name.span, f"input '{op.name.text}' is not used in the statement")
        self.stop_if_errors()
        target_indices = [s.index.text for s in target.subscripts]
        factor_indices = {s.index.text for acc in st.factors for s in acc.subscripts}
        for sub in target.subscripts:
            if sub.index.text not in factor_indices:
                self.error(sub.index.span, f"index '{sub.index.text}' of the output appears in no factor")
        self.stop_if_errors()
        self.target_indices = target_indices
        self.summed = []
        for acc in st.factors:
            for s in acc.subscripts:
                if s.index.text not in target_indices and s.index.text not in self.summed:
                    self.summed.append(s.index.text)

    # ------------------------------------------------------------ contraction
    def check_contraction(self) -> None:
        st = self.statement
        self.contraction = None
        self.end_factors = tuple(a.operand.text for a in st.factors if not set(self.summed) & {s.index.text for s in a.subscripts})
        if not self.summed:
            return
        if len(self.summed) > 1:
            second = next(s for a in st.factors for s in a.subscripts if s.index.text == self.summed[1])
            self.error(second.index.span, f"v0 sums over one index; this statement also sums over '{self.summed[1]}' (after '{self.summed[0]}')")
            raise _Stop
        k = self.summed[0]
        summed_factors = [a for a in st.factors if k in {s.index.text for s in a.subscripts}]
        shape_note = "v0 sums only in a matrix product: o[i, j] = x[i, k] * y[k, j], with either factor's subscripts in any order"
        if len(summed_factors) != 2:
            span = summed_factors[0].span if len(summed_factors) == 1 else summed_factors[2].span
            self.error(span, f"the sum over '{k}' must be a product of exactly two factors (found {len(summed_factors)})", shape_note)
            raise _Stop
        if len(st.target.subscripts) != 2:
            self.error(st.target.span, f"a sum over '{k}' needs a 2-D output (a matrix product)", shape_note)
            raise _Stop
        free = []
        for acc in summed_factors:
            if len(acc.subscripts) != 2:
                self.error(acc.span, f"'{acc.operand.text}' takes part in the sum over '{k}' and must be 2-D", shape_note)
                continue
            other = [s.index.text for s in acc.subscripts if s.index.text != k]
            free.append(other[0])
        self.stop_if_errors()
        if free[0] == free[1]:
            self.error(summed_factors[1].span, f"both factors of the sum over '{k}' share '{free[0]}'; a matrix product needs one output index from each", shape_note)
            raise _Stop
        # lhs is the factor whose free index comes first in the output, so the
        # matmul result needs no transpose.
        a, b = summed_factors
        if self.target_indices.index(free[0]) > self.target_indices.index(free[1]):
            a, b = b, a
        self.contraction = (a.operand.text, b.operand.text)

    # ------------------------------------------------------------- sparsity
    def check_sparsity(self) -> None:
        sparse = next((op for op in self.k.operands if op.direction == "in" and op.sparsity is not None), None)
        if self.output.sparsity is not None and sparse is not None and sparse.sparsity.text == "coo":
            self.error(
                sparse.sparsity.span,
                f"a coo input with a coo output is not supported yet ('{sparse.name.text}' and '{self.output.name.text}' are both coo)",
                "declare the input 'mask' (a dense array whose zero blocks are skipped), or make the output dense",
            )
        if sparse is not None and sparse.sparsity.text == "coo" and self.summed and self.contraction and sparse.name.text not in self.contraction:
            self.error(
                sparse.sparsity.span,
                f"a coo input drives the grid, so it must take part in the sum over '{self.summed[0]}'",
                "to skip work by a sparse factor applied at the end, declare it 'mask' instead",
            )
        self.stop_if_errors()

    # ----------------------------------------------------------------- sizes
    def check_sizes(self) -> None:
        """Bind every index to one size; fix symbols bound to literals."""
        bindings: dict[str, tuple[Size, Span]] = {}
        fixed: dict[str, tuple[int, Span]] = {}
        st = self.statement

        def size_of(dim: ast.Dim) -> Size:
            return Size(dim.value, None) if isinstance(dim.value, str) else Size(None, dim.value)

        for acc in (st.target, *st.factors):
            op = self.operands[acc.operand.text]
            for sub, dim in zip(acc.subscripts, op.dims):
                if sub.offset is not None:
                    continue
                size = size_of(dim)
                name = sub.index.text
                if name not in bindings:
                    bindings[name] = (size, sub.index.span)
                    continue
                prev, prev_span = bindings[name]
                if prev == size:
                    continue
                if prev.symbol is not None and size.symbol is not None:
                    self.error(
                        sub.index.span,
                        f"index '{name}' has size {size.symbol} here but {prev.symbol} at {prev_span}",
                        "an index ranges over one size; write a transposed operand as y[n, k] instead of declaring swapped sizes",
                    )
                elif prev.literal is not None and size.literal is not None:
                    self.error(sub.index.span, f"index '{name}' has size {size.literal} here but {prev.literal} at {prev_span}")
                else:
                    sym = prev.symbol or size.symbol
                    lit = prev.literal if prev.literal is not None else size.literal
                    if sym in fixed and fixed[sym][0] != lit:
                        self.error(sub.index.span, f"size {sym} is fixed to {fixed[sym][0]} at {fixed[sym][1]} but to {lit} here")
                    fixed.setdefault(sym, (lit, sub.index.span))
                    bindings[name] = (Size(None, lit), prev_span)
        for name in self.target_indices + self.summed:
            if name not in bindings:
                span = next(s.index.span for a in st.factors for s in a.subscripts if s.index.text == name)
                self.error(span, f"index '{name}' has no size: every use of it carries an offset; use it plainly once")
        self.stop_if_errors()
        self.fixed = {sym: v for sym, (v, _) in fixed.items()}
        self.bindings = {}
        for name, (size, _) in bindings.items():
            if size.symbol is not None and size.symbol in self.fixed:
                size = Size(size.symbol, self.fixed[size.symbol])
            self.bindings[name] = size

    def resolve(self, dim: ast.Dim) -> Size:
        if isinstance(dim.value, int):
            return Size(None, dim.value)
        return Size(dim.value, self.fixed.get(dim.value))

    # ----------------------------------------------------------------- tiles
    def check_tiles(self) -> None:
        k = self.k
        tiles: dict[str, ast.Tile] = {}
        declared: set[str] = set()
        indices = self.target_indices + self.summed
        for line in k.tile_lines:
            for tile in line.tiles:
                name = tile.index.text
                declared.add(name)
                if name in tiles:
                    self.error(tile.index.span, f"index '{name}' already has a tile (at {tiles[name].span})")
                    continue
                if name not in indices:
                    self.error(tile.index.span, f"'{name}' is not an index of the statement (its indices: {', '.join(indices)})")
                    continue
                if tile.size <= 0:
                    self.error(tile.size_span, f"tile {name} = {tile.size}: a tile must be positive")
                    continue
                tiles[name] = tile
        missing = [n for n in indices if n not in declared]
        if missing:
            span = k.tile_lines[0].span if k.tile_lines else self.statement.span
            line = ", ".join(f"{n} = ..." for n in missing)
            self.error(span, f"no tile for index{'es' if len(missing) > 1 else ''} {', '.join(repr(n) for n in missing)}", f"add `tile {line}`")
        self.stop_if_errors()
        self.tiles = tiles
        for name in indices:
            size = self.bindings[name]
            tile = tiles[name]
            if size.literal is not None and size.literal % tile.size:
                self.error(tile.size_span, f"tile {name} = {tile.size} does not divide its size {size.describe()}")
        # Offset accesses address the operand in blocks of the index's tile.
        for acc in self.statement.factors:
            op = self.operands[acc.operand.text]
            for sub, dim in zip(acc.subscripts, op.dims):
                if sub.offset is None or not isinstance(dim.value, int):
                    continue
                name, tile = sub.index.text, tiles[sub.index.text].size
                if dim.value % tile:
                    self.error(tiles[name].size_span, f"tile {name} = {tile} does not divide {op.name.text}'s dimension of {dim.value}, which is read at an offset")
                extent = self.bindings[name].literal
                if extent is not None and extent > dim.value:
                    self.error(sub.span, f"'{op.name.text}' has {dim.value} here, fewer than the {extent} that index '{name}' ranges over")
        self.stop_if_errors()

    # ---------------------------------------------------------------- layout
    def check_layout(self) -> None:
        reported: set[str] = set()  # one report per tile, naming the first block it breaks
        for acc in (self.statement.target, *self.statement.factors):
            op = self.operands[acc.operand.text]
            if op.sparsity is not None and op.sparsity.text == "coo":
                continue  # stored blocks are whole arrays of the tile's shape
            block = tuple(self.tiles[s.index.text].size for s in acc.subscripts)
            dims = tuple(self.resolve(d).literal for d in op.dims)
            problem = layout_problem(block, dims, DTYPES[op.dtype.text])
            if problem is None:
                continue
            axis, reason = problem
            index = acc.subscripts[axis].index.text
            if index in reported:
                continue
            reported.add(index)
            tile = self.tiles[index]
            self.error(
                tile.size_span,
                f"tile {index} = {tile.size} breaks the TPU layout rule for '{op.name.text}' ({op.dtype.text}): its block dim {axis} {reason}",
            )

    # ------------------------------------------------------------ accumulate
    def check_accumulate(self) -> None:
        k = self.k
        data = [op for op in k.operands if op.dtype.text in DATA_DTYPES]
        floats = any(DTYPES[op.dtype.text].is_float for op in data)
        self.accumulate = DTYPES["f32" if floats else "i32"]
        for extra in k.accumulates[1:]:
            self.error(extra.span, "accumulate is given twice")
        if not k.accumulates:
            return
        acc = k.accumulates[0].dtype
        if acc.text not in DTYPES or acc.text == "index":
            self.error(acc.span, f"unknown accumulate dtype '{acc.text}'; expected f32 or i32")
        elif acc.text not in ACCUMULATE_DTYPES:
            self.error(acc.span, f"accumulate {acc.text}: the TPU accumulates in 32 bits; use f32 or i32")
        elif floats and acc.text == "i32":
            self.error(acc.span, "accumulate i32 cannot hold a sum of float operands; use f32")
        else:
            self.accumulate = DTYPES[acc.text]

    # ---------------------------------------------------------------- result
    def build(self) -> Kernel:
        k = self.k
        st = self.statement
        terms_of: dict[str, tuple[Term, ...]] = {}
        for acc in (st.target, *st.factors):
            terms_of[acc.operand.text] = tuple(
                Term(s.index.text, OffsetRef(s.offset.operand.text, s.offset.position) if s.offset else None) for s in acc.subscripts
            )
        operands = []
        for op in k.operands:
            dtype = DTYPES[op.dtype.text]
            sparsity = "index" if dtype.kind == "index" else (op.sparsity.text if op.sparsity else "dense")
            operands.append(
                Operand(
                    op.name.text,
                    op.direction,
                    dtype,
                    tuple(self.resolve(d) for d in op.dims),
                    sparsity,
                    terms_of.get(op.name.text, ()),
                    op.span,
                    op.dtype.span,
                )
            )
        indices = tuple(
            Index(n, self.bindings[n], self.tiles[n].size, n in self.summed, self.tiles[n].span)
            for n in self.target_indices + self.summed
        )
        symbols: dict[str, int | None] = {}
        for op in operands:
            for d in op.dims:
                if d.symbol is not None:
                    symbols.setdefault(d.symbol, d.literal)
        return Kernel(
            name=k.name.text,
            source_name=self.source_name,
            digest=self.digest,
            text=k.text,
            operands=tuple(operands),
            indices=indices,
            contraction=self.contraction,
            end_factors=self.end_factors,
            accumulate=self.accumulate,
            name_span=k.name.span,
            tile_span=k.tile_lines[0].span,
            symbols=tuple(symbols.items()),
        )

    def run(self) -> Kernel | None:
        try:
            self.check_names()
            self.check_operands()
            self.check_statement()
            self.check_contraction()
            self.check_sparsity()
            self.check_sizes()
            self.check_tiles()
            self.check_layout()
            self.check_accumulate()
            self.stop_if_errors()
        except _Stop:
            return None
        return self.build()



def check(spec: ast.Spec) -> list[Kernel]:
    """Check every kernel of a spec; raise SpecError listing all problems found."""
    errors: list[Diagnostic] = []
    kernels: list[Kernel] = []
    seen: dict[str, ast.Kernel] = {}
    if not spec.kernels:
        errors.append(Diagnostic(Span(1, 1, 1, 2), "no kernel in this file; a spec declares `kernel NAME { ... }`"))
    for k in spec.kernels:
        if k.name.text in seen:
            errors.append(Diagnostic(k.name.span, f"kernel '{k.name.text}' is declared twice (first at {seen[k.name.text].name.span})"))
            continue
        seen[k.name.text] = k
        checker = _KernelChecker(k, spec.source.name, spec.source.digest)
        kernel = checker.run()
        errors.extend(checker.errors)
        if kernel is not None:
            kernels.append(kernel)
    if errors:
        raise SpecError(sorted(errors, key=lambda d: (d.span or Span(0, 0, 0, 0))), spec.source)
    return kernels

"""Check: turn a parsed spec into checked kernels (the IR), or report every problem found.

Each rule of the language page is one method below; each diagnostic points at the
token that breaks the rule. Checks that would only repeat an earlier error stop early.
Only the language's rules live here: what a chip can or cannot do is its target's
business (`sparsegen.tpu.rules`).
"""

from __future__ import annotations

import keyword
import math
import sys

from . import syntax as ast
from .allocation import no_cycle_collection
from .dtypes import ACCUMULATE_DTYPES, DATA_DTYPES, DTYPES
from .flow import flow_statement
from .ir import Einsum, Group, Index, Kernel, Local, Number, OffsetRef, Operand, Read, Relation, Size, Sub, group_factors, summed_indices
from .names import HELPERS, MODULE_NAMES, PYTHON_NAMES
from .source import Diagnostic, Span, SpecError

# Module-level names of a generated module: a kernel may not take one of them as its name.
RESERVED_KERNEL_NAMES = MODULE_NAMES | {"numpy"}
# A module named like these would shadow them for anything run beside it (`import jax.numpy` dies).
SHADOWED_MODULES = frozenset(sys.stdlib_module_names) | {
    "jax", "jaxlib", "numpy", "ml_dtypes", "opt_einsum", "scipy", "libtpu", "sparsegen", "generated", "__init__", "__main__",
}  # fmt: skip
SPARSITIES = ("coo", "mask")
# Sizes and tiles index arrays with int32 (grid coordinates, prefetch tables, offsets).
INT32_MAX = 2**31 - 1
LATER = "conditions, expressions, reductions and local tensors (language v1, sections 3-5) arrive with the attention kernels"


class _Stop(Exception):
    """Later checks of this kernel would only restate the errors already found."""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


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

    def check_size_name(self, name: ast.Name) -> None:
        """A size is a keyword of the generated function: not a Python keyword, nor one of its
        own keywords or helpers."""
        self.check_identifier(name, "size")
        if name.text in ("interpret", "max_steps") or name.text in HELPERS:
            self.error(name.span, f"size '{name.text}' would clash with a name of the generated module; rename it")

    def check_names(self) -> None:
        k = self.k
        self.check_identifier(k.name, "kernel name")
        if k.name.text in RESERVED_KERNEL_NAMES:
            self.error(
                k.name.span,
                f"kernel name '{k.name.text}' is taken by the generated module itself; choose another name",
                "a generated module defines `reference`, helpers named `_...`, and imports jax, jnp, np, lax, pl, pltpu (plgpu on GPUs) and functools",
            )
        elif k.name.text in PYTHON_NAMES:
            self.error(
                k.name.span,
                f"kernel name '{k.name.text}' is a Python builtin, which the generated module itself calls; choose another name",
            )
        elif k.name.text in SHADOWED_MODULES:
            self.error(
                k.name.span,
                f"kernel name '{k.name.text}' would write {k.name.text}.py, which shadows the module '{k.name.text}' for code run beside it",
                "the standard library, jax and its dependencies, and sparsegen's own package names are refused; choose another name",
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
                    self.check_size_name(ast.Name(dim.value, dim.span))
        self.operands = seen

    # --------------------------------------------------------------- operands
    def check_operands(self) -> None:
        outs = [op for op in self.k.operands if op.direction == "out"]
        self.offset_operands: set[str] = set()
        self.read_operands: set[str] = set()
        for st in self.k.statements:
            for e in (st.target, st.value, st.condition):
                for acc in _accesses_in(e):
                    self.read_operands.add(acc.operand.text)
                    self.offset_operands.update(sub.offset.operand.text for sub in acc.subscripts if sub.offset is not None)
        if not outs:
            self.error(self.k.name.span, f"kernel '{self.k.name.text}' declares no output; add a line `out NAME: DTYPE[...]`")
        for op in self.k.operands:
            dtype = op.dtype.text
            if dtype not in DTYPES:
                self.error(op.dtype.span, f"unknown dtype '{dtype}'; expected one of {', '.join(DTYPES)}")
                continue
            if op.direction == "out" and dtype == "index":
                self.error(op.dtype.span, "an output cannot have dtype 'index' (index operands are read-only scalars)")
            if op.direction == "out" and dtype == "bool":
                self.error(op.dtype.span, "an output cannot have dtype 'bool' (bool holds an input's 0 or 1, a mask's say)")
            if op.sparsity is not None:
                s = op.sparsity.text
                if s not in SPARSITIES:
                    self.error(op.sparsity.span, f"unknown sparsity '{s}'; expected 'coo' or 'mask'")
                elif dtype == "index":
                    self.error(op.sparsity.span, f"an index operand cannot be {s}: it is a small array of scalars")
                elif dtype == "bool" and s == "coo":
                    self.error(op.sparsity.span, "a bool operand is dense or a mask, not coo (its stored blocks would be data)")
                elif op.direction == "out" and s == "mask":
                    self.error(op.sparsity.span, "an output cannot be 'mask' sparse; a sparse output is 'coo' (only given blocks are computed)")
            if dtype == "index" and op.name.text in self.offset_operands:
                # An index operand that offsets subscripts (`s[0] + i`) is a vector of offsets;
                # one read as a table or in a condition (language v2) may have any shape. One
                # read nowhere is "never used" (a misspelt read, in a `where` say, is the
                # error to report, not this operand's shape).
                if len(op.dims) != 1:
                    self.error(op.span, f"index operand '{op.name.text}' must have one dimension (a vector of offsets)")
                elif not isinstance(op.dims[0].value, int):
                    self.error(op.dims[0].span, f"index operand '{op.name.text}' needs a literal length")
            for dim in op.dims:
                if isinstance(dim.value, int) and dim.value <= 0:
                    self.error(dim.span, f"dimension size must be positive, got {dim.value}")
                elif isinstance(dim.value, int) and dim.value > INT32_MAX:
                    self.error(dim.span, f"dimension size {dim.value} is larger than an int32 index can address ({INT32_MAX})")
        sparse = [op for op in self.k.operands if op.direction == "in" and op.sparsity is not None and op.sparsity.text in SPARSITIES]
        for extra in sparse[1:]:
            self.error(
                extra.sparsity.span,
                f"'{extra.name.text}' is a second sparse input; a kernel has at most one (here '{sparse[0].name.text}' at {sparse[0].sparsity.span})",
            )
        self.stop_if_errors()
        self.outputs = outs

    # -------------------------------------------------------------- statements
    def check_statements(self) -> None:
        k = self.k
        if not k.statements:
            self.error(k.name.span, f"kernel '{k.name.text}' has no statement; add one like `o[i, j] = x[i, k] * y[k, j]`")
            raise _Stop
        assigned: dict[str, ast.Statement] = {}
        self.parsed: list[tuple[ast.Statement, list[ast.Access], list[ast.Number]]] = []
        used: set[str] = set()
        offsets_used: set[str] = set()
        self.locals: dict[str, ast.Access] = {}
        self.free_sizes: dict[str, ast.Name] = {}  # sizes only expressions name (flow.py), first use
        self.flow: dict[int, object] = {}  # id(statement) -> its checked v1 form (flow.py)
        self.cond_accesses: set[int] = set()  # id(access) of the reads in conditions (flow.py)
        for st in k.statements:
            target = st.target
            name = target.operand.text
            op = self.operands.get(name)
            if name in assigned:
                what = "output" if op is not None else "local tensor"
                self.error(target.operand.span, f"{what} '{name}' is assigned twice (first at {assigned[name].span}); each is assigned once")
                continue
            if op is not None and op.direction != "out":
                self.error(target.operand.span, f"a statement assigns an output or a local tensor; '{name}' is an input")
                continue
            reads_local = any(isinstance(f, ast.Access) and f.operand.text in self.locals for f in ast.factors(st.value))
            if op is None or st.condition is not None or not ast.is_product(st.value) or reads_local:
                # Language v1, sections 3-5: local tensors, conditions, expressions, reductions.
                result = flow_statement(self, st, assigned)
                if result is None and op is None:
                    # Its error is reported: later reads of the local are not also "not declared".
                    self.locals[name] = target
                    assigned[name] = st
                if result is not None:
                    accesses, form = result
                    if op is None:
                        self.locals[name] = target
                    assigned[name] = st
                    used.update(a.operand.text for a in accesses)
                    self.flow[id(st)] = form
                    self.parsed.append((st, accesses, []))
                continue
            factors, numbers = self.product(st.value)
            if factors is None:
                continue
            seen: dict[str, ast.Access] = {}
            for acc in factors:
                fname = acc.operand.text
                fop = self.operands.get(fname)
                if fop is None:
                    if fname in self.locals:
                        self.error(acc.operand.span, f"'{fname}' is a local tensor; a product of operands reads operands only (not supported yet)")
                    else:
                        self.error(acc.operand.span, f"'{fname}' is not declared")
                    continue
                if fop.direction == "out":
                    if fname not in assigned:
                        self.error(acc.operand.span, f"'{fname}' is read before it is assigned; statements come in dependency order")
                        continue
                    if fop.sparsity is not None:
                        self.error(acc.operand.span, f"'{fname}' is a coo output; reading it in a later statement is not supported yet")
                        continue
                if fop.dtype.text == "index":
                    self.error(acc.operand.span, f"'{fname}' is an index operand: it can only offset a subscript, as in `x[{fname}[0] + i]`")
                    continue
                if fname in seen:
                    self.error(acc.operand.span, f"'{fname}' appears twice in the statement; reading an operand twice is not supported yet")
                    continue
                seen[fname] = acc
                used.add(fname)
            assigned[name] = st
            for acc in (target, *factors):
                for sub in acc.subscripts:
                    if sub.offset is not None:
                        offsets_used.add(sub.offset.operand.text)
            self.parsed.append((st, factors, numbers))
        read_locals = set().union(*(form.reads_locals for form in self.flow.values()))
        for name, acc in self.locals.items():
            if self.errors:
                break  # a statement that failed may be the one reading it
            if name not in read_locals:
                self.error(acc.operand.span, f"local tensor '{name}' is never read; an output is declared with `out`")
        for op in self.outputs:
            if op.name.text not in assigned and not self.errors:  # else a misspelt target is the cause
                self.error(op.name.span, f"output '{op.name.text}' is never assigned; add a statement `{op.name.text}[...] = ...`")
        self.stop_if_errors()
        # Tables (language v2, section 2) and condition reads of index operands are uses too.
        tables = {t.operand.text for st, accesses, _ in self.parsed for a in (st.target, *accesses) for t in _nested(a)[1:]}
        self.addressing = offsets_used | self.offset_operands | tables  # index operands read as offsets or tables
        self.check_local_names()
        self.size_symbols = {d.value for op in self.k.operands for d in op.dims if isinstance(d.value, str)}
        self.index_names = set(self.all_indices())
        for st, factors, _ in self.parsed:
            self.check_accesses(st, factors)
        self.stop_if_errors()  # a misspelt read makes the operand it meant look unused: that is the error
        for op in self.k.operands:
            if op.direction != "in":
                continue
            if op.dtype.text == "index":
                if op.name.text not in offsets_used | self.offset_operands | tables | used:
                    self.error(op.name.span, f"index operand '{op.name.text}' is never used; read it in a subscript, as in `x[{op.name.text}[0] + i]`")
            elif op.name.text not in used | tables:  # a non-index table is refused where it is read
                self.error(op.name.span, f"input '{op.name.text}' is not used in any statement")
        self.stop_if_errors()

    def check_local_names(self) -> None:
        """A size only expressions name is a size's name (a keyword of the call), not another
        statement's index. A local tensor's name is taken from the namespace indices and
        operands share (as an output's is), and is not a size's: `S[i, j]` beside `S` the
        size reads as one thing."""
        indices = set(self.all_indices())
        sizes = {d.value for op in self.k.operands for d in op.dims if isinstance(d.value, str)}
        for name, use in self.free_sizes.items():
            if name in indices:
                self.check_identifier(use, "size")
                self.error(use.span, f"'{name}' is an index of another statement, not of this left side, nor a size")
            else:
                self.check_size_name(use)
        for name, target in self.locals.items():
            if name in indices:
                self.error(target.operand.span, f"local tensor '{name}' is named like an index; index, operand and local names share one namespace")
            elif name in sizes:
                self.error(target.operand.span, f"local tensor '{name}' is named like the size {name}; choose another name")

    def product(self, value: ast.Expr) -> tuple[list[ast.Access] | None, list[ast.Number]]:
        """The factors of a right side: operand reads and numeric literals multiplied together."""
        accesses, numbers, ok = [], [], True
        for f in ast.factors(value):
            if isinstance(f, ast.Access):
                accesses.append(f)
            elif ast.literal(f) is not None:
                numbers.append(ast.literal(f))
            else:
                ok = False
                self.error(f.span, f"not supported yet: {_describe(f)}; a right side is a product of operand reads and numbers", LATER)
        if ok and not accesses:
            self.error(value.span, "a statement reads at least one operand")
            ok = False
        return (accesses if ok else None), numbers

    def check_accesses(self, st: ast.Statement, factors: list[ast.Access]) -> None:
        """Ranks, offsets, divided subscripts and repeated indices of every access."""
        target = st.target
        for acc in (target, *factors):
            op = self.operands.get(acc.operand.text)
            if op is None:  # a local tensor's target: its subscripts are its shape
                continue
            if len(acc.subscripts) != len(op.dims):
                self.error(
                    acc.span,
                    f"'{op.name.text}' has {_plural(len(op.dims), 'dimension')} but is accessed with {_plural(len(acc.subscripts), 'subscript')}",
                )
                continue
            self.check_subscripts(acc, op, acc is target)
        if id(st) in self.flow:
            return  # flow.py checks where a v1 statement's indices come from
        factor_indices = {n.text for acc in factors for s in acc.subscripts for n in s.indices}
        for sub in target.subscripts:
            if sub.plain and sub.index.text not in factor_indices:  # else check_subscripts refused it
                self.error(sub.index.span, f"index '{sub.index.text}' of the output appears in no factor")

    def check_subscripts(self, acc: ast.Access, op: ast.Operand, is_target: bool) -> None:
        """Every subscript of one operand access (a table read inside one too)."""
        in_condition = id(acc) in self.cond_accesses
        uses: dict[str, list[tuple[ast.Name, str]]] = {}  # index -> (token, form) of each use (a table's are its own)
        for sub in acc.subscripts:
            if sub.table is not None:
                if in_condition:
                    continue  # flow.py says a condition reads plain indices
                self.check_table(acc, op, sub, is_target)
                continue
            uses.setdefault(sub.index.text, []).append((sub.index, _form(sub)))
            self.check_identifier(sub.index, "index name")
            if sub.index.text in self.operands:
                self.error(sub.index.span, f"'{sub.index.text}' names an operand; index, operand and local names share one namespace")
            if sub.shift is not None:
                if not in_condition:
                    self.error(sub.span, f"`{sub.index.text} {'+' if sub.shift > 0 else '-'} {abs(sub.shift)}` reads an integer operand in a condition only (`lo[g + 1]`)")
                elif sub.shift < 0:
                    self.error(sub.span, "not supported yet: a read at an index minus an integer; shift the operand instead (`lo[g + 1]`)")
            if (sub.divisor is not None or sub.divisor_size is not None or sub.modulus is not None) and not (in_condition and not sub.plain):
                self.check_arithmetic(op, sub, is_target)
            if sub.offset is None:
                continue
            off = sub.offset
            if op.sparsity is not None:
                what = "output" if is_target else "operand"
                self.error(off.span, f"'{op.name.text}' is {op.sparsity.text}; offsets apply to a dense {what} only")
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
                entries = "1 entry" if length == 1 else f"{length} entries"
                self.error(off.position_span, f"'{ref.name.text}' has {entries}; position {off.position} is out of range")
        self.check_diagonal(uses)

    def check_diagonal(self, uses: dict[str, list[tuple[ast.Name, str]]]) -> None:
        """An index is used once per access (`x[i, i]` is a diagonal), except that `j // c` and
        `j % c` may both appear (language v2, section 2: `x[i // 4, i % 4]`). A table is an
        access of its own: `kc[pages[b, j // T], j % T, d]` uses j once in each."""
        for name, found in uses.items():
            forms = [form for _, form in found]
            pair = all(f != "plain" for f in forms) and any(f.startswith("%") for f in forms) and len(set(forms)) == len(forms)
            if len(found) > 1 and not pair:
                self.error(found[1][0].span, f"index '{name}' is used twice in one access (a diagonal), which is not supported")

    def check_arithmetic(self, op: ast.Operand, sub: ast.Subscript, is_target: bool, table: bool = False) -> None:
        """`h // 4`, `j // T`, `j % T`: what divides is a positive literal or a size."""
        modulus = sub.modulus is not None
        sign = "%" if modulus else "//"
        if is_target:
            if modulus:
                self.error(sub.span, "a subscript `j % c` reads an input; the left side uses plain indices")
            else:
                self.error(sub.span, "a divided subscript (`h // 4`) reads an input; the left side uses plain indices")
            return
        if op.sparsity is not None and not table:
            if modulus:
                self.error(sub.span, f"'{op.name.text}' is {op.sparsity.text}; a subscript `j % c` reads a dense operand")
            else:
                self.error(sub.span, f"'{op.name.text}' is {op.sparsity.text}; a divided subscript reads a dense operand")
            return
        by = sub.modulus if modulus else (sub.divisor_size if sub.divisor_size is not None else sub.divisor)
        if isinstance(by, ast.Name):
            if by.text not in self.size_symbols:
                what = "an index" if by.text in self.index_names else ("an operand" if by.text in self.operands else "not a size")
                self.error(by.span, f"'{by.text}' is {what}; `{sub.index.text} {sign} ...` takes a positive integer or a size (a symbol of a declared dimension)")
        elif by < 1:
            if modulus:
                what = "by zero" if by == 0 else f"by {by}"
                self.error(sub.by_span, f"`{sub.index.text} % {by}`: a subscript is taken modulo a positive integer or a size, not {what}")
            else:
                self.error(sub.span, f"a subscript is divided by a positive integer, not {by}")

    def check_table(self, acc: ast.Access, op: ast.Operand, sub: ast.Subscript, is_target: bool) -> None:
        """A read through a table (language v2, section 2): `kc[h // 8, pages[b, j // T], j % T, d]`."""
        t = sub.table
        if is_target:
            self.error(t.span, f"a read through a table (`{sub.text}`) is on the right side only; the left side uses plain indices")
            return
        if op.sparsity is not None:
            self.error(t.span, f"'{op.name.text}' is {op.sparsity.text}; a read through a table reads a dense operand")
            return
        ref = self.operands.get(t.operand.text)
        if ref is None:
            what = "a local tensor" if t.operand.text in self.locals else "not declared"
            self.error(t.operand.span, f"'{t.operand.text}' is {what}; a table is an 'index' operand (`in pages: index[B, NP]`)")
            return
        if ref.dtype.text != "index":
            self.error(t.operand.span, f"a table is an 'index' operand; '{ref.name.text}' has dtype {ref.dtype.text}", "declare it `in " + f"{ref.name.text}: index[...]`: its entries are coordinates, read from scalar memory")
            return
        if len(t.subscripts) != len(ref.dims):
            self.error(t.span, f"'{ref.name.text}' has {_plural(len(ref.dims), 'dimension')} but is accessed with {_plural(len(t.subscripts), 'subscript')}")
            return
        uses: dict[str, list[tuple[ast.Name, str]]] = {}
        for inner, dim in zip(t.subscripts, ref.dims):
            if inner.table is None and inner.literal is None:
                uses.setdefault(inner.index.text, []).append((inner.index, _form(inner)))
            if inner.table is not None:
                self.error(inner.table.span, f"a table inside a table (`{inner.text}` in `{sub.text}`) is not allowed; a table's subscripts are indices, integer literals, `i // c` and `i % c`")
                continue
            if inner.offset is not None or inner.shift is not None:
                self.error(inner.span, f"`{inner.text}` in a table: a table's subscripts are indices, integer literals, `i // c` and `i % c`")
                continue
            if inner.literal is not None:
                if isinstance(dim.value, int) and inner.literal >= dim.value:
                    self.error(inner.span, f"'{ref.name.text}' has {dim.value} entries along this dimension; position {inner.literal} is out of range")
                continue
            self.check_identifier(inner.index, "index name")
            if inner.index.text in self.operands:
                self.error(inner.index.span, f"'{inner.index.text}' names an operand; index, operand and local names share one namespace")
            if not inner.plain or inner.divisor is not None:
                self.check_arithmetic(ref, inner, False, table=True)
        self.check_diagonal(uses)

    # ------------------------------------------------------------- einsums
    def build_einsums(self) -> None:
        """Classify indices and group the factors."""
        self.einsums: list[Einsum] = []
        for st, factors, numbers in self.parsed:
            if id(st) in self.flow:
                self.einsums.append(self.flow[id(st)].build(self))
                continue
            reads = tuple(self.read(a) for a in factors)
            target = self.read(st.target)
            summed = summed_indices(target, reads)
            groups = self.group(reads, set(summed), factors)
            if groups is None:
                continue
            summed_groups, end_groups = groups
            e = Einsum(target, reads, tuple(Number(n.value) for n in numbers), tuple(summed), summed_groups, end_groups, st.span)
            if e.scale is not None and not math.isfinite(e.scale):
                self.error(numbers[0].span, f"the statement's numbers multiply to {e.scale}, which is not a finite number")
            self.einsums.append(e)
        self.stop_if_errors()

    def read(self, acc: ast.Access) -> Read:
        return Read(acc.operand.text, tuple(self.sub(s) for s in acc.subscripts), acc.span)

    def sub(self, s: ast.Subscript) -> Sub:
        if s.table is not None:
            return Sub("", table=self.read(s.table), span=s.table.span)
        if s.literal is not None:
            return Sub("", literal=s.literal, span=s.span)
        if s.modulus is not None:
            modulus = s.modulus.text if isinstance(s.modulus, ast.Name) else s.modulus
            return Sub(s.index.text, modulus=modulus, span=s.span)
        if s.divisor_size is not None:
            return Sub(s.index.text, divisor=s.divisor_size.text, span=s.span)
        offset = OffsetRef(s.offset.operand.text, s.offset.position) if s.offset else None
        return Sub(s.index.text, offset, s.divisor or 1, s.shift or 0, span=s.span)

    def group(self, reads, summed: set[str], accesses) -> tuple[tuple[Group, ...], tuple[Group, ...]] | None:
        """Factors with a summed index whose indices another such factor covers are multiplied
        into it before the sum; at most two groups may remain."""
        masks = {r.operand for r in reads if self.operands[r.operand].sparsity is not None and self.operands[r.operand].sparsity.text == "mask"}
        summed_groups, end_groups = group_factors(reads, summed, masks)
        if len(summed_groups) > 2:
            mains = [g.main for g in summed_groups]
            names = ", ".join(f"'{reads[m].operand}'" for m in mains)
            self.error(
                accesses[mains[2]].span,
                f"a sum multiplies at most two factors after covered ones are multiplied in; here {len(mains)} hold a summed index ({names})",
                "a factor whose indices another factor has is multiplied into it first; a longer chain needs a local tensor (not supported yet)",
            )
            return None
        return summed_groups, end_groups

    # ----------------------------------------------------------------- sizes
    def check_sizes(self) -> None:
        """Bind every index to one size; fix symbols bound to literals; collect `h // n` relations.

        Language v2, section 2: `j % c` on a dimension makes its size c; an index used only
        as `j // c` on a dimension of size D and as `j % c` ranges over D * c."""
        bindings: dict[str, tuple[Size, Span]] = {}
        fixed: dict[str, tuple[int, Span]] = {}
        divided: list[tuple[ast.Subscript, ast.Dim, str]] = []
        moduli: list[tuple[ast.Subscript, ast.Dim, str]] = []

        def size_of(dim: ast.Dim) -> Size:
            return Size(dim.value, None) if isinstance(dim.value, str) else Size(None, dim.value)

        # A dimension read at an index plus an integer anywhere (`lo[g + 1]`) binds no index:
        # it has a size of its own, and the call checks every read lies inside it.
        shifted = {(acc.operand.text, d) for st, factors, _ in self.parsed for acc in factors
                   for d, sub in enumerate(acc.subscripts) if sub.shift is not None}
        for st, factors, _ in self.parsed:
            for acc in (a for top in (st.target, *factors) for a in _nested(top)):
                op = self.operands.get(acc.operand.text)
                if op is None:
                    continue
                for d, (sub, dim) in enumerate(zip(acc.subscripts, op.dims)):
                    if (acc.operand.text, d) in shifted:
                        continue
                    if sub.table is not None or sub.literal is not None:
                        continue  # a coordinate read from a table binds nothing (checked at call time)
                    if sub.modulus is not None:
                        moduli.append((sub, dim, f"{op.name.text} dim {d}"))
                        continue
                    if sub.divisor is not None or sub.divisor_size is not None:
                        divided.append((sub, dim, f"{op.name.text} dim {d}"))
                        continue
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
                        self.fix(fixed, sym, lit, sub.index.span)
                        bindings[name] = (Size(None, lit), prev_span)
        # `j // c` with `j % c` beside it: j ranges over the divided dimension's size times c.
        products: dict[str, ast.Subscript] = {}
        for sub, dim, what in divided:
            name, by = sub.index.text, _by(sub)
            if name in bindings or not any(m.index.text == name and _by(m) == by for m, _, _ in moduli):
                continue
            lit = dim.value if isinstance(dim.value, int) and isinstance(by, int) else None
            bindings[name] = (Size(None, dim.value * by) if lit is not None else Size(None, None, (dim.value, by)), sub.index.span)
            products[name] = sub
        indices = self.all_indices()
        for name in indices:
            if name not in bindings:
                span = next(n.span for st, fs, _ in self.parsed for a in (st.target, *fs) for s in a.subscripts for n in s.indices if n.text == name)
                divided_only = any(sub.index.text == name for sub, _, _ in divided)
                notes = [f"or read it as `{name} // c` and `{name} % c` too: {name} then ranges over the divided dimension's size times c (language v2)"] if divided_only else []
                self.error(span, f"index '{name}' has no size: every use of it is offset or divided; use it plainly once", *notes)
        self.stop_if_errors()
        # j % c: the dimension's size is c.
        for sub, dim, what in moduli:
            by = _by(sub)
            if dim.value == by:
                continue
            if isinstance(by, int) and isinstance(dim.value, int):
                self.error(sub.span, f"{what} has size {dim.value}, but {sub.index.text} % {by} ranges over {by}")
            elif isinstance(by, int) or isinstance(dim.value, int):
                sym, lit = (dim.value, by) if isinstance(by, int) else (by, dim.value)
                self.fix(fixed, sym, lit, sub.span)
            else:
                self.error(sub.span, f"{what} has size {dim.value}, but {sub.index.text} % {by} ranges over {by}",
                           f"declare that dimension with the size {by}")
        # h // n: the dimension's size is size(h) / n. Literals on either side fix the other.
        relations = []
        for sub, dim, what in divided:
            n = _by(sub)
            name = sub.index.text
            if name in products:
                first = products[name]
                if sub is first:
                    continue
                first_dim = next(d for s, d, _ in divided if s is first)
                if _by(first) == n and first_dim.value == dim.value:
                    continue
                self.error(sub.span, f"index '{name}' ranges over {bindings[name][0].text} (from `{first.text}` at {first.span}); "
                           f"`{sub.text}` on a dimension of size {dim.value} would need another size")
                continue
            if isinstance(n, str):
                if n not in fixed:
                    relations.append((sub, dim, what))  # a size divides: checked at call time
                    continue
                n = fixed[n][0]
            index_size = bindings[name][0]
            lit_index = index_size.literal if index_size.literal is not None else fixed.get(index_size.symbol, (None,))[0]
            lit_dim = dim.value if isinstance(dim.value, int) else fixed.get(dim.value, (None,))[0]
            if lit_index is not None and lit_index % n:
                self.error(sub.span, f"index '{name}' has size {lit_index}, which {n} does not divide")
                continue
            if lit_index is not None and lit_dim is not None:
                if lit_dim * n != lit_index:
                    self.error(sub.span, f"{what} has size {lit_dim}, but {name} // {n} ranges over {lit_index // n}")
                continue
            if lit_index is not None:
                self.fix(fixed, dim.value, lit_index // n, sub.span)
            elif lit_dim is not None and index_size.symbol is not None:
                self.fix(fixed, index_size.symbol, lit_dim * n, sub.span)
            relations.append((sub, dim, what))
        self.stop_if_errors()
        self.fixed = {sym: v for sym, (v, _) in fixed.items()}
        self.bindings = {}
        for name, (size, _) in bindings.items():
            if size.symbol is not None and size.symbol in self.fixed:
                size = Size(size.symbol, self.fixed[size.symbol])
            if size.product:
                known = [f if isinstance(f, int) else self.fixed.get(f) for f in size.product]
                if all(k is not None for k in known):
                    size = Size(None, math.prod(known), size.product)
            self.bindings[name] = size
        self.relations = tuple(
            Relation(self.resolve(dim), sub.index.text, _by(sub), what)
            for sub, dim, what in relations
            if self.resolve(dim).literal is None or self.bindings[sub.index.text].literal is None
            or (isinstance(_by(sub), str) and _by(sub) not in self.fixed)
        )

    def fix(self, fixed, symbol: str, value: int, span: Span) -> None:
        if symbol in fixed and fixed[symbol][0] != value:
            self.error(span, f"size {symbol} is fixed to {fixed[symbol][0]} at {fixed[symbol][1]} but to {value} here")
        fixed.setdefault(symbol, (value, span))

    def all_indices(self) -> list[str]:
        out: list[str] = []
        for st, factors, _ in self.parsed:
            for acc in (st.target, *factors):
                for s in acc.subscripts:
                    for n in s.indices:
                        if n.text not in out:
                            out.append(n.text)
        return out

    def resolve(self, dim: ast.Dim) -> Size:
        if isinstance(dim.value, int):
            return Size(None, dim.value)
        return Size(dim.value, self.fixed.get(dim.value))

    # ----------------------------------------------------------------- tiles
    def check_tiles(self) -> None:
        k = self.k
        tiles: dict[str, ast.Tile] = {}
        declared: set[str] = set()
        indices = self.all_indices()
        for line in k.tile_lines:
            for tile in line.tiles:
                name = tile.index.text
                declared.add(name)
                if name in tiles:
                    self.error(tile.index.span, f"index '{name}' already has a tile (at {tiles[name].span})")
                    continue
                if name not in indices:
                    self.error(tile.index.span, f"'{name}' is not an index of any statement (the indices: {', '.join(indices)})")
                    continue
                if tile.size <= 0:
                    self.error(tile.size_span, f"tile {name} = {tile.size}: a tile must be positive")
                    continue
                if tile.size > INT32_MAX:
                    self.error(tile.size_span, f"tile {name} = {tile.size} is larger than an int32 index can address")
                    continue
                tiles[name] = tile
        missing = [n for n in indices if n not in declared]
        if missing:
            span = k.tile_lines[0].span if k.tile_lines else self.parsed[0][0].span
            line = ", ".join(f"{n} = ..." for n in missing)
            self.error(span, f"no tile for index{'es' if len(missing) > 1 else ''} {', '.join(repr(n) for n in missing)}", f"add `tile {line}`")
        self.stop_if_errors()
        self.tiles = tiles
        for name in indices:
            size, tile = self.bindings[name], tiles[name]
            # A symbolic size may be ragged (its last block partial); a literal one is divided.
            if size.literal is not None and size.literal % tile.size:
                self.error(tile.size_span, f"tile {name} = {tile.size} does not divide its size {size.describe()}")
        # Offset accesses address the operand in blocks of the index's tile.
        for st, factors, _ in self.parsed:
            for acc in (st.target, *factors):
                op = self.operands.get(acc.operand.text)
                if op is None:
                    continue
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

    # ------------------------------------------------------------ accumulate
    def check_accumulate(self) -> None:
        k = self.k
        data = [op for op in k.operands if op.dtype.text in DATA_DTYPES]
        floats = any(DTYPES[op.dtype.text].is_float for op in data)
        fractions = [n for _, _, numbers in self.parsed for n in numbers if isinstance(n.value, float)]
        fractions += [n for st, _, _ in self.parsed if id(st) in self.flow for n in self.flow[id(st)].floats]
        floats = floats or any(self.flow[id(st)].needs_float for st, _, _ in self.parsed if id(st) in self.flow)
        self.accumulate = DTYPES["f32" if floats or fractions else "i32"]
        for extra in k.accumulates[1:]:
            self.error(extra.span, "accumulate is given twice")
        if not k.accumulates:
            return
        acc = k.accumulates[0].dtype
        if acc.text not in ACCUMULATE_DTYPES:
            self.error(acc.span, f"unknown accumulate dtype '{acc.text}'; expected one of {', '.join(ACCUMULATE_DTYPES)}")
        elif not DTYPES[acc.text].is_float and (summed_floats := self.floats_in_sums()):
            self.error(acc.span, f"accumulate {acc.text} cannot hold a sum of float operands ({summed_floats}); use f32",
                       "a float factor without a summed index (a scale) multiplies the sum after it, and may stay")
        elif fractions and not DTYPES[acc.text].is_float:
            self.error(fractions[0].span, f"the number {fractions[0].text} is not an integer, but this kernel accumulates in {acc.text}")
        else:
            self.accumulate = DTYPES[acc.text]

    def floats_in_sums(self) -> str:
        """The float operands an integer accumulator would have to sum (language v3, section 1:
        a factor holding none of a sum's indices multiplies the sum, after it), named; "" if
        none. Statements without a sum, with a condition or a sparse operand (not yet), and
        elementwise chains count whole: their float operands would meet the integer tiles."""
        names: list[str] = []
        if any(f.needs_float for f in self.flow.values()):
            return "a function or reduction's float values"
        for e in self.einsums:
            sparse = any(r.operand in self.operands and self.operands[r.operand].sparsity is not None for r in e.reads)
            if isinstance(e, Einsum) and e.summed and e.condition is None and not sparse:
                reads = [e.factors[m] for g in e.summed_groups for m in g.members]  # a condition selects, sums nothing
            else:
                reads = list(e.reads)
            ops = [self.operands[r.operand] for r in reads if r.operand in self.operands]
            names += [op.name.text for op in ops if op.dtype.text in DATA_DTYPES and DTYPES[op.dtype.text].is_float and op.name.text not in names]
        return ", ".join(f"'{n}'" for n in names)

    # ---------------------------------------------------------------- result
    def build(self) -> Kernel:
        k = self.k
        operands = []
        for op in k.operands:
            dtype = DTYPES[op.dtype.text]
            # An index operand only a condition reads (`j < lens[b]`) is an integer array, as an
            # i32 one is; read as offsets or a table it addresses other operands ("index").
            index = dtype.kind == "index" and (op.name.text in self.addressing or op.direction != "in")
            sparsity = "index" if index else (op.sparsity.text if op.sparsity else "dense")
            operands.append(Operand(op.name.text, op.direction, dtype, tuple(self.resolve(d) for d in op.dims), sparsity, op.span, op.dtype.span))
        indices = tuple(Index(n, self.bindings[n], self.tiles[n].size, self.tiles[n].size_span) for n in self.all_indices())
        symbols: dict[str, int | None] = {}
        for op in operands:
            for d in op.dims:
                if d.symbol is not None:
                    symbols.setdefault(d.symbol, d.literal)
        for name in self.free_sizes:  # named only in expressions: a keyword of the call
            symbols.setdefault(name, None)
        return Kernel(
            name=k.name.text,
            source_name=self.source_name,
            digest=self.digest,
            operands=tuple(operands),
            indices=indices,
            statements=tuple(self.einsums),
            accumulate=self.accumulate,
            name_span=k.name.span,
            tile_span=k.tile_lines[0].span,
            symbols=tuple(symbols.items()),
            relations=self.relations,
            accumulate_span=k.accumulates[0].dtype.span if k.accumulates else None,
            locals=tuple(Local(n, tuple(s.index.text for s in acc.subscripts), acc.span) for n, acc in self.locals.items()),
        )

    def run(self) -> Kernel | None:
        try:
            self.check_names()
            self.check_operands()
            self.check_statements()
            self.build_einsums()
            self.check_sizes()
            self.check_tiles()
            self.check_accumulate()
            self.stop_if_errors()
        except _Stop:
            return None
        return self.build()


def _nested(acc: ast.Access) -> list[ast.Access]:
    """An access, then every table read inside its subscripts (language v2, section 2)."""
    out = [acc]
    for sub in acc.subscripts:
        if sub.table is not None:
            out += _nested(sub.table)
    return out


def _accesses_in(e) -> list[ast.Access]:
    """Every access in an expression (tables inside subscripts included)."""
    out: list[ast.Access] = []
    stack = [e]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if isinstance(node, ast.Access):
            out += _nested(node)
        elif isinstance(node, ast.Call):
            stack += node.args
        elif isinstance(node, ast.Binary):
            stack += [node.a, node.b]
        elif isinstance(node, (ast.Neg, ast.Not)):
            stack.append(node.a)
        elif isinstance(node, ast.Compare):
            stack += [node.first, *(x for _, x in node.rest)]
        elif isinstance(node, ast.Logic):
            stack += node.values
    return out


def _by(sub: ast.Subscript) -> int | str:
    """What divides a subscript or takes it modulo: an integer or a size symbol."""
    by = sub.modulus if sub.modulus is not None else (sub.divisor_size if sub.divisor_size is not None else sub.divisor)
    return by.text if isinstance(by, ast.Name) else by


def _form(sub: ast.Subscript) -> str:
    """How a subscript uses its index, for the diagonal rule: "plain", "//c" or "%c"."""
    if sub.modulus is not None:
        return "%" + (sub.modulus.text if isinstance(sub.modulus, ast.Name) else str(sub.modulus))
    if sub.divisor_size is not None:
        return "//" + sub.divisor_size.text
    if sub.divisor is not None:
        return "//" + str(sub.divisor)
    return "plain"


def _describe(e: ast.Expr) -> str:
    if isinstance(e, ast.Call):
        return f"the function '{e.fn.text}'"
    if isinstance(e, ast.Binary):
        return f"the operator '{e.op}'"
    if isinstance(e, ast.Value):
        return f"'{e.name.text}' as a value"
    if isinstance(e, ast.Neg):
        return "unary minus"
    if isinstance(e, (ast.Compare, ast.Logic, ast.Not)):
        return "a comparison outside `where`"
    return "this expression"


@no_cycle_collection()
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

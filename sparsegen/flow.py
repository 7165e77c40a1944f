"""Checking the statements of language v1, sections 3-5: local tensors, `where` conditions,
elementwise expressions and functions, and the reductions sum, max, logsumexp and softmax.

The checker (check.py) hands every statement that is not a plain product of operands
here; what comes back is the operand accesses (for binding sizes and tiles) and a form
that builds the IR statement once sizes are known. Each rule points at its token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import syntax as ast
from .ir import Einsum, Elementwise, Number, Reduction, SoftmaxProduct, Term, group_factors, summed_indices

FUNCTIONS = {"exp": 1, "log": 1, "sqrt": 1, "tanh": 1, "abs": 1, "maximum": 2, "minimum": 2}
REDUCTIONS = ("sum", "max", "logsumexp", "softmax")
_FLOAT_OPS = {"+", "-", "*", "/"}
_INT_OPS = {"+", "-", "*", "//", "%"}


@dataclass
class Form:
    """A checked v1 statement, waiting for sizes to become IR."""

    kind: str  # "einsum" | "elementwise" | "reduction" | "softmax_product"
    st: ast.Statement
    value: Term | None = None
    condition: Term | None = None
    factors: list = field(default_factory=list)  # einsum: accesses; softmax product: [value access]
    numbers: list = field(default_factory=list)
    fn: str | None = None
    arg: ast.Access | None = None
    index: str | None = None
    index_span: object = None  # the reduced index's token
    reads_locals: set = field(default_factory=set)
    floats: list = field(default_factory=list)  # float literals, for the accumulate rule
    needs_float: bool = False  # functions and reductions compute in a float dtype

    def build(self, checker):
        read = checker.read
        target = read(self.st.target)
        if self.kind == "einsum":
            reads = tuple(read(a) for a in self.factors)
            summed = summed_indices(target, reads)
            masks = {r.operand for r in reads if checker.operands[r.operand].sparsity is not None}
            sg, eg = group_factors(reads, set(summed), masks)
            numbers = tuple(Number(n.value) for n in self.numbers)
            return Einsum(target, reads, numbers, tuple(summed), sg, eg, self.st.span, self.condition)
        if self.kind == "elementwise":
            return Elementwise(target, self.value, self.condition, self.st.span)
        if self.kind == "reduction":
            return Reduction(target, self.fn, read(self.arg), self.index, self.condition, self.st.span, self.index_span)
        numbers = tuple(Number(n.value) for n in self.numbers)
        return SoftmaxProduct(target, read(self.arg), self.index, read(self.factors[0]), numbers, self.st.span, self.condition, self.index_span)


def flow_statement(c, st: ast.Statement, assigned: dict) -> tuple[list[ast.Access], Form] | None:
    """Check one v1 statement; None (with errors recorded) if it is malformed."""
    f = _Flow(c, st, assigned)
    form = f.run()
    if form is None or f.failed:
        return None
    return f.accesses, form


class _Flow:
    def __init__(self, c, st: ast.Statement, assigned: dict):
        self.c, self.st, self.assigned = c, st, assigned
        self.accesses: list[ast.Access] = []
        self.failed = False
        self.left = [s.index.text for s in st.target.subscripts]
        # The indices a condition may use: the left side's, and for a product its summed
        # ones too (language v2, section 1: a condition selects terms).
        self.cond_indices = list(self.left)
        self.form = Form("elementwise", st)

    def error(self, span, message, *notes):
        self.failed = True
        self.c.error(span, message, *notes)

    def run(self) -> Form | None:
        st = self.st
        for sub in st.target.subscripts:
            if sub.offset is not None or sub.divisor is not None or not sub.plain:
                self.error(sub.span, "the left side of a statement with a condition, a local tensor or an expression uses plain indices")
                return None
        value = st.value
        parts = ast.factors(value)
        calls = [p for p in parts if isinstance(p, ast.Call) and p.fn.text in REDUCTIONS]
        if isinstance(value, ast.Call) and value.fn.text in REDUCTIONS:
            self.reduction(value)
        elif calls and calls[0].fn.text == "softmax" and len(calls) == 1 and len(parts) > 1:
            self.softmax_product(parts, calls[0])
        elif ast.is_product(value) and all(p.operand.text in self.c.operands for p in parts if isinstance(p, ast.Access)) \
                and any(isinstance(p, ast.Access) for p in parts):
            self.einsum(parts)
        else:
            self.form.value = self.expr(value)
            self.form.needs_float = True
            used = {t.name for t in self.form.value.walk() if t.op == "index"}
            used |= {i for t in self.form.value.walk() if t.read is not None for i in t.read.indices}
            for sub in st.target.subscripts:
                if not self.failed and sub.index.text not in used:
                    self.error(sub.index.span, f"index '{sub.index.text}' of the left side appears nowhere on the right")
        if st.condition is not None:
            if self.form.kind == "einsum":
                on_right = dict.fromkeys(n.text for p in self.form.factors for s in p.subscripts for n in s.indices)
                self.cond_indices += [i for i in on_right if i not in self.cond_indices]
            self.in_condition = True
            self.form.condition = self.condition(st.condition, top=True)
            self.in_condition = False
        return self.form

    # --------------------------------------------------------------- forms
    def einsum(self, parts):
        self.form.kind = "einsum"
        for p in parts:
            if isinstance(p, ast.Access):
                self.operand_read(p)
                self.form.factors.append(p)
            else:
                self.number(ast.literal(p))
        on_right = {n.text for p in self.form.factors for s in p.subscripts for n in s.indices}
        for sub in self.st.target.subscripts:
            if sub.index.text not in on_right:
                self.error(sub.index.span, f"index '{sub.index.text}' of the left side appears in no factor on the right")

    def number(self, n: ast.Number):
        self.form.numbers.append(n)
        if isinstance(n.value, float):
            self.form.floats.append(n)

    def reduction(self, call: ast.Call):
        self.form.kind = "reduction"
        self.form.needs_float = True
        fn = call.fn.text
        if len(call.args) != 2 or not isinstance(call.args[1], ast.Value):
            self.error(call.span, f"{fn} takes a tensor and the index it reduces over: `{fn}(s[i, j], j)`")
            return
        arg, index = call.args
        if not isinstance(arg, ast.Access):
            self.error(arg.span, f"{fn} reduces a tensor read (`{fn}(s[i, j], j)`); assign the expression to a local tensor first")
            return
        self.tensor_read(arg)
        j = index.name.text
        arg_indices = list(dict.fromkeys(n.text for s in arg.subscripts for n in s.indices))
        if j not in arg_indices:
            self.error(index.span, f"{fn} reduces over '{j}', which '{arg.operand.text}' is not read with")
            return
        want = arg_indices if fn == "softmax" else [i for i in arg_indices if i != j]
        if sorted(self.left) != sorted(want):
            self.error(self.st.target.span, f"{fn}(..., {j}) gives the indices {', '.join(want)}; the left side has {', '.join(self.left)}")
        self.form.fn, self.form.arg, self.form.index, self.form.index_span = fn, arg, j, index.span

    def softmax_product(self, parts, call: ast.Call):
        self.form.kind = "softmax_product"
        self.form.needs_float = True
        if len(call.args) != 2 or not isinstance(call.args[1], ast.Value) or not isinstance(call.args[0], ast.Access):
            self.error(call.span, "softmax takes a tensor read and the index it normalises over: `softmax(s[i, j], j)`")
            return
        arg, index = call.args
        self.tensor_read(arg)
        j = index.name.text
        others = [p for p in parts if p is not call]
        accesses = [p for p in others if isinstance(p, ast.Access)]
        for p in others:
            if ast.literal(p) is not None:
                self.number(ast.literal(p))
            elif not isinstance(p, ast.Access):
                self.error(p.span, "a softmax product multiplies the softmax by one operand and numbers")
        if len(accesses) != 1:
            self.error(call.span, "a softmax product multiplies the softmax by exactly one operand: `softmax(s[i, j], j) * v[j, e]`")
            return
        (v,) = accesses
        self.operand_read(v)
        if j not in [n.text for s in v.subscripts for n in s.indices]:
            self.error(v.span, f"'{v.operand.text}' is not read with '{j}': the softmax product sums over it")
        if j in self.left:
            self.error(self.st.target.span, f"the softmax product sums over '{j}'; the left side cannot keep it")
        self.form.arg, self.form.index, self.form.factors, self.form.index_span = arg, j, [v], index.span

    # ------------------------------------------------------------- reads
    def tensor_read(self, acc: ast.Access):
        """A reduction's argument: a local tensor, or a float operand."""
        name = acc.operand.text
        if name in self.c.locals:
            self.local_read(acc)
        else:
            self.operand_read(acc)

    def local_read(self, acc: ast.Access):
        name = acc.operand.text
        assigned = self.c.locals[name]
        want = [s.index.text for s in assigned.subscripts]
        got = [s.index.text for s in acc.subscripts]
        if got != want or any(s.offset is not None or s.divisor is not None or not s.plain for s in acc.subscripts):
            self.error(acc.span, f"local tensor '{name}' is read as {name}[{', '.join(want)}], as it was assigned")
        self.form.reads_locals.add(name)

    def operand_read(self, acc: ast.Access, integer: bool = False):
        """An operand read; `integer`: a condition's integer read, which may be an index operand
        (language v2, section 1: `j < lens[b]`)."""
        name = acc.operand.text
        op = self.c.operands.get(name)
        if op is None:
            if name in self.c.locals:
                self.error(acc.operand.span, f"'{name}' is a local tensor; here an operand is read")
            elif name in self.assigned:
                self.error(acc.operand.span, f"'{name}' is read before it is assigned; statements come in dependency order")
            else:
                self.error(acc.operand.span, f"'{name}' is not declared")
            return
        if op.direction == "out":
            self.error(acc.operand.span, f"'{name}' is an output; reading an output in a later statement of this kind is not supported yet")
            return
        if op.dtype.text == "index" and not integer:
            self.error(acc.operand.span, f"'{name}' is an index operand: it can only offset a subscript, be read as a table inside one (`x[{name}[...]]`) or be compared in a condition")
            return
        if op.sparsity is not None and op.sparsity.text == "coo":
            self.error(acc.operand.span, f"'{name}' is coo; with conditions, expressions and reductions a sparse operand is a mask in a `where`")
            return
        for s in acc.subscripts:
            if s.offset is not None:
                self.error(s.span, "offsets are not supported with conditions, expressions and reductions yet")
        self.accesses.append(acc)

    # ------------------------------------------------------------- terms
    def expr(self, e: ast.Expr) -> Term:
        """An elementwise float expression over the left side's indices."""
        if isinstance(e, ast.Number):
            if isinstance(e.value, float):
                self.form.floats.append(e)
            return Term("num", value=e.value)
        if isinstance(e, ast.Value):
            return self.value(e)
        if isinstance(e, ast.Access):
            name = e.operand.text
            if name in self.c.locals:
                self.local_read(e)
                return Term("local", read=self.c.read(e))
            self.operand_read(e)
            op = self.c.operands.get(name)
            if op is not None and op.sparsity is not None and op.sparsity.text == "mask":
                self.error(e.span, f"'{name}' is a mask: it is read in a `where` condition (`where {name}[...]`), not as a value here")
            for n in (n for s in e.subscripts for n in s.indices):
                if n.text not in self.left:
                    self.error(n.span, f"index '{n.text}' is not on the left side; an elementwise expression sums nothing (use a product or a reduction)")
            return Term("read", read=self.c.read(e))
        if isinstance(e, ast.Call):
            fn = e.fn.text
            if fn in REDUCTIONS:
                self.error(e.span, f"{fn}(...) is a whole right side (`t[i] = {fn}(s[i, j], j)`), or a softmax a factor of a product")
                return Term("num", value=0)
            if fn not in FUNCTIONS:
                self.error(e.fn.span, f"unknown function '{fn}'; expected one of {', '.join([*FUNCTIONS, *REDUCTIONS])}")
                return Term("num", value=0)
            if len(e.args) != FUNCTIONS[fn]:
                self.error(e.span, f"{fn} takes {FUNCTIONS[fn]} argument{'s' if FUNCTIONS[fn] > 1 else ''}, got {len(e.args)}")
                return Term("num", value=0)
            return Term(fn, tuple(self.expr(a) for a in e.args))
        if isinstance(e, ast.Binary):
            if e.op not in _FLOAT_OPS:
                self.error(e.span, f"'{e.op}' is integer arithmetic, for conditions; a value uses + - * /")
            return Term(e.op, (self.expr(e.a), self.expr(e.b)))
        if isinstance(e, ast.Neg):
            return Term("neg", (self.expr(e.a),))
        self.error(e.span, "a comparison belongs in a `where` condition")
        return Term("num", value=0)

    in_condition = False

    def value(self, e: ast.Value) -> Term:
        name = e.name.text
        if name in (self.cond_indices if self.in_condition else self.left):
            return Term("index", name=name)
        if any(name == s for s, _ in _symbols(self.c)):
            return Term("size", name=name)
        if name in self.c.operands or name in self.c.locals or name in self.assigned:
            where = "an index of the statement" if self.in_condition and self.form.kind == "einsum" else "an index of the left side"
            self.error(e.span, f"'{name}' is neither {where} nor a size")
            return Term("num", value=0)
        # A size no operand has (a prefix length): passed as a keyword, like `M=`.
        self.c.free_sizes.setdefault(name, e.name)
        return Term("size", name=name)

    def condition(self, e: ast.Expr, top: bool = False) -> Term:
        """A truth value: comparisons of integer terms, and/or/not, a mask read."""
        if isinstance(e, ast.Logic):
            return Term(e.op, tuple(self.condition(v) for v in e.values))
        if isinstance(e, ast.Not):
            return Term("not", (self.condition(e.a),))
        if isinstance(e, ast.Compare):
            terms = (self.integer(e.first), *(self.integer(x) for _, x in e.rest))
            return Term("cmp", terms, ops=tuple(op for op, _ in e.rest))
        if isinstance(e, ast.Access):
            op = self.c.operands.get(e.operand.text)
            if op is not None and op.sparsity is not None and op.sparsity.text == "mask":
                self.cond_read(e)
                return Term("truth", read=self.c.read(e))
        self.error(e.span, "a condition is a comparison (`i >= j`), `and`/`or`/`not` of conditions, or a mask read (`keep[i, j]`)")
        return Term("cmp", (Term("num", value=0), Term("num", value=0)), ops=("==",))

    def cond_read(self, e: ast.Access, integer: bool = False):
        self.c.cond_accesses.add(id(e))
        self.operand_read(e, integer)
        for s in e.subscripts:
            if s.table is not None:
                self.error(s.table.span, f"a read through a table (`{s.text}`) is not allowed in a condition: a condition reads an operand at plain indices (read a table itself: `j < lens[b]`)")
                continue
            if s.divisor is not None or not s.plain:
                self.error(s.span, "an operand in a condition is read with plain indices")
                if not s.plain:
                    continue
            if s.index.text not in self.cond_indices:
                if self.form.kind == "einsum":
                    self.error(s.index.span, f"index '{s.index.text}' is not an index of the statement; a condition uses the statement's indices")
                else:
                    self.error(s.index.span, f"index '{s.index.text}' is not on the left side; a condition uses the left side's indices")

    def integer(self, e: ast.Expr) -> Term:
        if isinstance(e, ast.Number):
            if not isinstance(e.value, int):
                self.error(e.span, f"a condition computes with integers; {e.text} is not one")
            return Term("num", value=int(e.value))
        if isinstance(e, ast.Value):
            return self.value(e)
        if isinstance(e, ast.Access):
            op = self.c.operands.get(e.operand.text)
            if op is None or op.dtype.text not in ("i8", "i16", "i32", "u8", "u16", "u32", "bool", "index"):
                what = "not declared" if op is None and e.operand.text not in self.c.locals else "not an integer operand"
                self.error(e.span, f"'{e.operand.text}' is {what}; a condition reads integer operands (segment ids) or a mask")
                return Term("num", value=0)
            self.cond_read(e, integer=True)
            return Term("read", read=self.c.read(e))
        if isinstance(e, ast.Binary):
            if e.op not in _INT_OPS:
                self.error(e.span, f"'{e.op}' in a condition: conditions compute with integers (+ - * // %)")
            elif e.op in ("//", "%") and isinstance(e.b, ast.Number) and e.b.value == 0:
                self.error(e.b.span, f"'{e.op}' by zero")
            return Term(e.op, (self.integer(e.a), self.integer(e.b)))
        if isinstance(e, ast.Neg):
            return Term("neg", (self.integer(e.a),))
        self.error(e.span, "a condition compares integer terms: indices, sizes, integer literals and integer operand reads")
        return Term("num", value=0)


def _symbols(c) -> list[tuple[str, None]]:
    out = []
    for op in c.k.operands:
        for d in op.dims:
            if isinstance(d.value, str):
                out.append((d.value, None))
    return out

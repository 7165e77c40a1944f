"""A numpy oracle for attention-like kernels, in float64, straight from the IR's meaning
(language v1, sections 3-5): scores, the elementwise chain, the condition (absent
elements), and each output. Independent of the code generator: it never reads the
generated module, only the checked statements."""

from __future__ import annotations

import numpy as np

from sparsegen.ir import Einsum, Elementwise, Reduction, Term

FUNCS = {"exp": np.exp, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh, "abs": np.abs, "maximum": np.maximum, "minimum": np.minimum}


def _as_f64(x):
    return np.asarray(x).astype(np.float64)


def run(kernel, args: list, sizes: dict[str, int]):
    """The kernel's outputs (a tuple in declaration order) for dense arguments."""
    inputs = {op.name: np.asarray(a) for op, a in zip(kernel.inputs, args)}
    size = {i.name: sizes.get(i.size.symbol, i.size.literal) if i.size.symbol else i.size.literal for i in kernel.indices}
    values: dict[str, tuple[np.ndarray, tuple[str, ...]]] = {}  # name -> (array, indices)
    present: dict[str, np.ndarray] = {}
    outs = {}

    def operand(read, dtype=np.float64):
        x = inputs[read.operand]
        for d, s in enumerate(read.subs):
            if s.divisor != 1:
                x = np.repeat(x, s.divisor, axis=d)
        return x.astype(dtype)

    def expand(x, src, dst):
        order = [src.index(i) for i in dst if i in src]
        x = np.transpose(x, order)
        return x.reshape([x.shape[[i for i in dst if i in src].index(i)] if i in src else 1 for i in dst])

    def term(t: Term, dst, integer: bool):
        if t.op == "num":
            return t.value
        if t.op == "index":
            shape = [-1 if i == t.name else 1 for i in dst]
            return np.arange(size[t.name]).reshape(shape).astype(np.int64 if integer else np.float64)
        if t.op == "size":
            return sizes[t.name]
        if t.op == "local":
            arr, idx = values[t.read.operand]
            return expand(arr, idx, dst)
        if t.op == "read":
            return expand(operand(t.read, np.int64 if integer else np.float64), t.read.indices, dst)
        if t.op == "truth":
            return expand(operand(t.read, np.float64) != 0, t.read.indices, dst)
        a = [term(x, dst, integer) for x in t.args]
        if t.op == "+":
            return a[0] + a[1]
        if t.op == "-":
            return a[0] - a[1]
        if t.op == "*":
            return a[0] * a[1]
        if t.op == "/":
            return a[0] / a[1]
        if t.op == "//":
            return np.floor_divide(a[0], a[1])
        if t.op == "%":
            return np.mod(a[0], a[1])
        if t.op == "neg":
            return -a[0]
        if t.op == "not":
            return ~a[0]
        if t.op == "and":
            out = a[0]
            for x in a[1:]:
                out = out & x
            return out
        if t.op == "or":
            out = a[0]
            for x in a[1:]:
                out = out | x
            return out
        if t.op == "cmp":
            out = True
            for n, op in enumerate(t.ops):
                x, y = a[n], a[n + 1]
                out = out & {"==": x == y, "!=": x != y, "<": x < y, "<=": x <= y, ">": x > y, ">=": x >= y}[op]
            return out
        return FUNCS[t.op](*a)

    def argument(read):
        """A reduction's argument: a tensor assigned above, or an input read directly (all present)."""
        if read.operand in values:
            return values[read.operand][0], values[read.operand][1], present[read.operand]
        arr = operand(read)
        return arr, read.indices, np.ones(arr.shape, bool)

    for st in kernel.statements:
        dst = st.target.indices
        shape = [size[i] for i in dst]
        if isinstance(st, Einsum):
            letters = {i: chr(97 + n) for n, i in enumerate(st.indices)}
            spec = ",".join("".join(letters[i] for i in f.indices) for f in st.factors) + "->" + "".join(letters[i] for i in dst)
            val = np.einsum(spec, *(operand(f) for f in st.factors))
            if st.scale is not None:
                val = val * st.scale
            here = np.ones(shape, bool)
        elif isinstance(st, Elementwise):
            val = np.broadcast_to(term(st.value, dst, False), shape).astype(np.float64)
            here = np.ones(shape, bool)
            for loc in st.value.locals:
                here = here & expand(present[loc.operand], loc.indices, dst)
        elif isinstance(st, Reduction):
            arr, idx, here_arg = argument(st.arg)
            axis = idx.index(st.index)
            masked = np.where(here_arg, arr, -np.inf)
            if st.fn == "softmax":
                m = masked.max(axis=axis, keepdims=True)
                m = np.where(np.isneginf(m), 0.0, m)
                e = np.where(here_arg, np.exp(arr - m), 0.0)
                total = e.sum(axis=axis, keepdims=True)
                val = expand(e / np.where(total == 0, 1.0, total), idx, dst)
                here = np.ones(shape, bool)
            elif st.fn in ("max", "logsumexp"):
                m = masked.max(axis=axis)
                if st.fn == "logsumexp":
                    safe = np.where(np.isneginf(m), 0.0, m)
                    total = np.where(here_arg, np.exp(arr - np.expand_dims(safe, axis)), 0.0).sum(axis=axis)
                    m = np.where(total == 0, -np.inf, safe + np.log(np.where(total == 0, 1.0, total)))
                val = m
            else:
                val = np.where(here_arg, arr, 0.0).sum(axis=axis)
            if st.fn != "softmax":
                val = expand(val, tuple(i for i in idx if i != st.index), dst)
                here = np.ones(shape, bool)
        else:  # SoftmaxProduct
            arr, idx, here_arg = argument(st.scores)
            axis = idx.index(st.index)
            m = np.where(here_arg, arr, -np.inf).max(axis=axis, keepdims=True)
            m = np.where(np.isneginf(m), 0.0, m)
            p = np.where(here_arg, np.exp(arr - m), 0.0)
            total = p.sum(axis=axis, keepdims=True)
            p = p / np.where(total == 0, 1.0, total)
            letters = {i: chr(97 + n) for n, i in enumerate(dict.fromkeys(idx + st.value.indices + dst))}
            spec = "".join(letters[i] for i in idx) + "," + "".join(letters[i] for i in st.value.indices) + "->" + "".join(letters[i] for i in dst)
            val = np.einsum(spec, p, operand(st.value))
            for n in st.numbers:
                val = val * n.value
            here = np.ones(shape, bool)
        cond = getattr(st, "condition", None)
        if cond is not None:
            here = here & np.broadcast_to(term(cond, dst, True), shape)
        values[st.target.operand] = (val, dst)
        present[st.target.operand] = here
        if st.target.operand in {o.name for o in kernel.outputs}:
            outs[st.target.operand] = np.where(here, val, 0.0)
    return tuple(outs[o.name] for o in kernel.outputs)


def brute_kinds(kernel, plan, args, sizes):
    """Block kinds (0 empty, 1 partial, 2 full) over the plan's class axes, element by element."""
    inputs = {op.name: np.asarray(a) for op, a in zip(kernel.inputs, args)}
    size = {i.name: sizes.get(i.size.symbol, i.size.literal) if i.size.symbol else i.size.literal for i in kernel.indices}
    axes = plan.class_axes
    # Evaluate the condition over the class axes only (it reads nothing else).
    dst = axes

    def operand(read):
        return inputs[read.operand].astype(np.int64)

    def expand(x, src):
        order = [src.index(i) for i in dst if i in src]
        x = np.transpose(x, order)
        return x.reshape([x.shape[[i for i in dst if i in src].index(i)] if i in src else 1 for i in dst])

    def term(t):
        if t.op == "num":
            return t.value
        if t.op == "index":
            return np.arange(size[t.name]).reshape([-1 if i == t.name else 1 for i in dst])
        if t.op == "size":
            return sizes[t.name]
        if t.op == "read":
            return expand(operand(t.read), t.read.indices)
        if t.op == "truth":
            return expand(operand(t.read) != 0, t.read.indices)
        a = [term(x) for x in t.args]
        ops = {"+": np.add, "-": np.subtract, "*": np.multiply, "//": np.floor_divide, "%": np.mod}
        if t.op in ops:
            return ops[t.op](a[0], a[1])
        if t.op == "neg":
            return -a[0]
        if t.op == "not":
            return ~a[0]
        if t.op in ("and", "or"):
            out = a[0]
            for x in a[1:]:
                out = (out & x) if t.op == "and" else (out | x)
            return out
        out = True
        for n, op in enumerate(t.ops):
            x, y = a[n], a[n + 1]
            out = out & {"==": x == y, "!=": x != y, "<": x < y, "<=": x <= y, ">": x > y, ">=": x >= y}[op]
        return out

    shape = [size[i] for i in axes]
    cond = np.ones(shape, bool) if plan.condition is None else np.broadcast_to(term(plan.condition), shape)
    tiles = [kernel.index(i).tile for i in axes]
    grid = [-(-n // t) for n, t in zip(shape, tiles)]
    kinds = np.zeros(grid, np.int32)
    key_tile, query_tile = kernel.index(plan.key).tile, kernel.index(plan.query).tile
    for cell in np.ndindex(*grid):
        block = cond[tuple(slice(c * t, (c + 1) * t) for c, t in zip(cell, tiles))]
        # A block past the end of either index is partial (its tail is masked).
        ragged = (cell[-1] + 1) * key_tile > size[plan.key] or (cell[-2] + 1) * query_tile > size[plan.query]
        kinds[cell] = 0 if not block.any() else (2 if block.all() and not ragged else 1)
    return kinds

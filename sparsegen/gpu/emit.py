"""Emit a GPU module: the lowered passes through `templates/gpu/module.py.j2`, formatted by black.

The wrapper (argument checks, `reference`, the docstring's calling convention) is the
TPU modules' own (`sparsegen.wrapper`): a spec has one calling convention on every target.
"""

from __future__ import annotations

from ..expr import Call, Const, Expr, Var, render
from ..formatting import format_module
from ..pytext import needed as _needed, parameters, py_tuple, words
from ..wrapper import Glue, Wrapper, _widen, einsum_glue
from .describe import describe, persistent_ctas
from .plan import ElementwisePass, GpuModule, GpuPass, ds
from .rules import MEMORY_REGISTERS


# The CTA's coordinates, bound at the top of a kernel where its body reads them.
_HEAD = (("cell", 'lax.axis_index("cell")', "the output block"),
         ("mi", 'lax.axis_index("m")', "this CTA's row tile inside it"),
         ("ni", 'lax.axis_index("n")', "this CTA's column tile inside it"))
# A product kernel is persistent: its CTA runs chunks of the work list (`_deal`), each
# chunk binding these at the top of the loop's body.
_PERSISTENT_HEAD = (("cta", 'lax.axis_index("cta")', "this CTA: a run of chunks of the work list"),) + _HEAD[1:] + (
    ("wg", 'lax.axis_index("wg")', "this warpgroup: the consumers first, the producer last"),)
_CHUNK = (("cell", "chunk_cell[chunk]", "the output block"),
          ("first", "chunk_first[chunk]", "the chunk's first step in the block's walk"),
          ("count", "chunk_count[chunk]", "its steps"),
          ("slot", "chunk_slot[chunk]", "-1: the whole block; else its piece's slot"))
# The work list's tables the kernel reads (the wrapper's names; `_deal` returns them).
_WORK_TABLES = ("cta_first", "chunk_cell", "chunk_first", "chunk_count", "chunk_slot")
# A pass's fields that are not the kernel's body (host code, names, docs).
_NOT_BODY = frozenset({"form", "fn", "params", "n_tables", "statics", "about", "lets", "call_fn", "call_args", "call_about",
                       "guard", "host", "raw", "raw_shape", "kernel", "grid", "kernel_args", "finish", "out_var",
                       "steps", "steps_lets", "ctas", "ctas_about", "cells", "bm", "bn", "sub_grid", "wgs", "epi",
                       "epi_tiles", "memory_registers"})


def _code(value):
    """A pass's field as the code it renders, its comments left out (they name the spec's
    indices, which may be the kernel's own locals: `mi`, `ni`)."""
    if isinstance(value, dict):
        return [_code(v) for k, v in value.items() if k != "about"]
    if isinstance(value, (list, tuple)):
        return [_code(v) for v in value]
    if isinstance(value, str):
        return "" if value.lstrip().startswith("#") else value.split("  # ")[0]
    return value


def _trimmed(d: dict) -> dict:
    """The pass with its kernel's head cut to what the body reads: the CTA coordinates and
    lets nothing reads are not bound, and the tables nothing reads are `del`-ed. A product
    kernel's lets are bound per chunk, inside its loop (`chunk_lets`)."""
    body = repr(_code([v for key, v in d.items() if key not in _NOT_BODY]))
    head = _HEAD
    lets = list(d["lets"])
    if d["form"] == "product":
        body += " cta_first cta first count slot" + (" wg" if d["wgs"] > 1 else "")  # the loop, the maps, the pipeline's grid, the store (template text)
        head = _PERSISTENT_HEAD
        lets = [(name, value) for name, value, _ in _CHUNK] + lets
    lets = _needed([(name, value) for name, value, _ in head] + lets, body)
    notes = {name: note for name, _, note in (*head, *(_CHUNK if d["form"] == "product" else ()))}
    used = words(body) | set().union(*(words(value) for _, value in lets))
    tables, refs = d["params"][: d["n_tables"]], d["params"][d["n_tables"]:]
    signature, deleted = parameters(tables + refs, used | set(refs), d["statics"], collapse=False)
    lets = [(name, value + (f"  # {notes[name]}" if name in notes else "")) for name, value in lets]
    # Elementwise: every let at the top; a product's per chunk, but the CTA's coordinates.
    top = {name for name, _, _ in head} if d["form"] == "product" else {name for name, _ in lets}
    return dict(d, lets=[x for x in lets if x[0] in top], chunk_lets=[x for x in lets if x[0] not in top],
                signature=signature, deleted=deleted)


def _ds(index: Expr, tile: int) -> str:
    """The slice of tile `index` (in tiles) of a dimension."""
    return render(ds(index, tile), "py")


def _py(index) -> list[str]:
    """Kernel code of each expression."""
    return [render(e, "py") for e in index]


def _number(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Emitter:
    def __init__(self, m: GpuModule):
        self.m = m
        self.k = m.kernel
        self.outputs = dict(m.outputs)
        self.wrapper = Wrapper(m.kernel, m.conv, (), m.names.local("size"), m.names)

    def elementwise_dict(self, p: ElementwisePass, mod: GpuModule) -> dict:
        tables = [name for name, _ in p.tables]
        out_ref = p.names.local(f"{p.output}_gmem")
        scoped = [f"out_smem=plgpu.SMEM(({p.tm}, {p.tn}), {p.out_dtype.jnp})"]
        scoped_names = ["out_smem"]
        for f in p.factors:
            scoped += [f"{f['smem']}=plgpu.SMEM(({p.tm}, {p.tn}), {f['dtype'].jnp})", f"{f['barrier']}=plgpu.Barrier()"]
            scoped_names += [f["smem"], f["barrier"]]
        # In the accumulate dtype, as `reference` computes, rounded once to the output's.
        acc = mod.kernel.accumulate
        value = " * ".join(f"{f['smem']}[...]" + (f".astype({acc.jnp})" if f["dtype"].name != acc.name else "") for f in p.factors)
        if p.scale is not None:
            value = f"{value} * jnp.full(({p.tm}, {p.tn}), {_number(p.scale)}, {acc.jnp})"
        if acc.name != p.out_dtype.name:
            value = f"({value}).astype({p.out_dtype.jnp})"
        statics = list(p.statics)
        kernel = p.fn if not statics else f"functools.partial({p.fn}, " + ", ".join(f"{v}={v}" for v in statics) + ")"
        at = lambda index: f"{_ds(index[0], p.tm)}, {_ds(index[1], p.tn)}"  # noqa: E731
        return _trimmed({
            "form": "elementwise",
            "fn": p.fn,
            "params": tables + [f["ref"] for f in p.factors] + [out_ref],
            "n_tables": len(tables),
            "statics": statics,
            "about": f"{p.statement.text}: one CTA per {p.tm}x{p.tn} tile of each output block; "
                     + ("tiles outside the window the statement writes are zeros." if p.inside else "its factors' tiles, multiplied."),
            "lets": p.lets,
            "inside": p.inside,
            "factors": [dict(f, at=at(f["index"])) for f in p.factors],
            "value": value,
            "scoped": ", ".join(scoped),
            "scoped_names": ", ".join(scoped_names),
            "tile": f"({p.tm}, {p.tn})",
            "out_dtype": p.out_dtype.jnp,
            "out_ref": out_ref,
            "out_at": at(p.out_index),
            "call_fn": p.call_fn,
            "call_args": list(dict.fromkeys(list(mod.conv.impl_args) + [dict(mod.outputs)[o] for o in self.reads(p, mod)])),
            "call_about": f"The kernel that computes {p.output}: {p.statement.text}",
            "guard": [],
            "host": p.host,
            "raw": p.raw,
            "raw_shape": py_tuple([render(p.raw_shape[0], "host"), render(p.raw_shape[1], "host")]),
            "kernel": kernel,
            "grid": py_tuple([render(p.cells, "host"), str(p.bm // p.tm), str(p.bn // p.tn)]),
            "kernel_args": tables + [f["array"] for f in p.factors],
            "finish": p.finish,
            "out_var": p.out_var,
        })

    def pass_dict(self, p: GpuPass, mod: GpuModule | None = None) -> dict:
        mod = mod or self.m
        if isinstance(p, ElementwisePass):
            return self.elementwise_dict(p, mod)
        k, t = mod.kernel, p.tiles
        names = p.names
        a_ref, b_ref = names.local(f"{p.a.operand}_gmem"), names.local(f"{p.b.operand}_gmem")
        end_ref = names.local(f"{p.end.operand}_gmem") if p.end else None
        out_ref = names.local(f"{p.output}_gmem")
        a_smem, b_smem = names.local(f"{p.a.operand}_smem"), names.local(f"{p.b.operand}_smem")
        tables = [*_WORK_TABLES, *(name for name, _ in p.tables)]
        sel = p.selection
        held = sel.held if sel is not None else []
        # Factors after the sum along the rows or columns alone: each CTA (consumer) copies its
        # tile's vector into shared memory and multiplies the accumulator by it, broadcast.
        vectors = [{"ref": names.local(f"{v.operand}_gmem"), "smem": names.local(f"{v.operand}_smem"),
                    "barrier": names.local(f"{v.operand}_barrier"), "array": v.array, "dtype": v.dtype.jnp,
                    "at": _ds(v.index, v.length), "dim": 0 if v.axis == "rows" else 1, "length": v.length,
                    "about": f"{v.operand} along the tile's {'rows' if v.axis == 'rows' else 'columns'}"} for v in p.vectors]
        params = (tables + [a_ref, b_ref] + ([end_ref] if end_ref else []) + [v["ref"] for v in vectors] + [h[0] for h in held]
                  + [out_ref, "pieces_gmem"])
        # A matrix's coordinates kept as leading dimensions are squeezed: one value a copy.
        a_block = ("pl.Squeezed()",) * (len(p.a_index) - 2) + ((t.tk, t.tm) if p.a.transposed else (t.tm, t.tk))
        b_block = ("pl.Squeezed()",) * (len(p.b_index) - 2) + ((t.cta_n, t.tk) if p.b.transposed else (t.tk, t.cta_n))
        maps = []
        for mat, index, fn in ((p.a, p.a_index, names.local(f"{p.a.operand}_tile")), (p.b, p.b_index, names.local(f"{p.b.operand}_tile"))):
            text = py_tuple(_py(index))
            what = "its stored block" if mat.stored else "its block"
            about = f"Step s reads this tile of {mat.operand} ({what}, then the {p.a.col} tile inside it)"
            if mat.transposed:
                about += f"; {mat.operand} is stored ({mat.col}, {mat.row}): WGMMA reads the tile MN-major"
            maps.append({"fn": fn, "index": text, "lets": _needed(p.step_lets, text), "about": about + "."})
        ws = t.wgs > 1
        epi = t.epi if ws else t.tn

        def at(index):
            """The tile `index` (in tiles of tm x tn); warp-specialized, its epilogue tile `e` (of epi columns)."""
            cols = _ds(index[1], t.tn)
            if ws and epi != t.tn:
                cols = render(Call("pl.ds", (index[1] * t.tn + Var("e") * epi, Const(epi))), "py")
            return f"{_ds(index[0], t.tm)}, {cols}"

        if ws:
            # Each consumer's epilogue tiles, side by side (indexed by `wg`), beside the pipeline's buffers.
            scoped = [f"out_smem=plgpu.SMEM(({t.wgs}, {t.tm}, {epi}), {p.out_dtype.jnp})",
                      f"piece_smem=plgpu.SMEM(({t.wgs}, {t.tm}, {epi}), {p.after_dtype.jnp})"]
            scoped_names = ["out_smem", "piece_smem"]
            if p.end is not None:
                scoped += [f"end_smem=plgpu.SMEM(({t.wgs}, {t.tm}, {epi}), {k.operand(p.end.operand).dtype.jnp})",
                           f"barrier=plgpu.Barrier(num_barriers={t.wgs})"]
                scoped_names += ["end_smem", "barrier"]
            for v in vectors:
                scoped += [f"{v['smem']}=plgpu.SMEM(({t.wgs}, {v['length']}), {v['dtype']})",
                           f"{v['barrier']}=plgpu.Barrier(num_barriers={t.wgs})"]
                scoped_names += [v["smem"], v["barrier"]]
            # Tiles a partial step copies, each consumer's.
            for h in held:
                scoped.append(h[3])
                scoped_names += list(h[2])
        else:
            scoped = [f"out_smem=plgpu.SMEM(({t.tm}, {t.tn}), {p.out_dtype.jnp})"]
            scoped_names = ["out_smem"]
            if p.end is not None:
                scoped += [f"end_smem=plgpu.SMEM(({t.tm}, {t.tn}), {k.operand(p.end.operand).dtype.jnp})", "barrier=plgpu.Barrier()"]
                scoped_names += ["end_smem", "barrier"]
        statics = list(p.statics)
        kernel = p.fn if not statics else f"functools.partial({p.fn}, " + ", ".join(f"{v}={v}" for v in statics) + ")"
        if p.walk == "coo output":
            raw_shape = py_tuple([render(p.cells * t.bm, "host"), str(t.bn)])
        else:
            raw_shape = py_tuple(p.raw_shape)
        call_args = list(mod.conv.impl_args) + [dict(mod.outputs)[o] for o in self.reads(p, mod)]
        # The persistent grid: as many CTAs as the chip runs at once (describe.persistent_ctas),
        # never more than the steps there can be.
        rows_in, cols_in = t.bm // t.tm, t.bn // t.cta_n
        sub = rows_in * cols_in
        cap = persistent_ctas(p, mod.target)
        bound = (p.block_products * t.ksub).cdiv(t.stages)  # runs of a pipeline's depth (`_deal`)
        ctas = str(min(cap, bound.value)) if isinstance(bound, Const) else f"min({cap}, {render(bound, 'host')})"
        # The piece's tile in its slot: the CTA's row tile, and its (consumer's) column tile.
        col_in = (Var("ni") * t.wgs + Var("wg") if cols_in > 1 else Var("wg")) if ws else (Var("ni") if cols_in > 1 else Const(0))
        piece_at = (Var("slot") * rows_in + Var("mi") if rows_in > 1 else Var("slot"), col_in)
        select, acc_lines, step_select = [], [], None
        head = ["# The chunk's step s is step first + s of the block's walk.", "(s,) = idx", "s = first + s"]
        if sel is not None and sel.on == "out":
            acc_lines = ["# The condition reads the output's indices alone: absent elements are zeros."] + sel.lines
        elif sel is not None and sel.on == "step":
            lets = [f"{name} = {value}" for name, value in _needed(sel.step_lets, repr([sel.kind] + sel.lines))]
            step_select = {"head": head + lets, "kind": sel.kind, "lines": sel.lines}
        elif sel is not None:
            # The tile a partial step rewrites: A's, or B's (warp-specialized, the consumer's columns).
            cols = _ds(Var("wg"), t.tn)
            b_tile = (f"{b_smem}.at[{cols}]" if p.b.transposed else f"{b_smem}.at[:, {cols}]") if ws else b_smem
            lines = [line.replace("@A@", a_smem).replace("@B@", b_tile) for line in sel.lines]
            what = p.a.operand if sel.on == "a" else p.b.operand
            about = sel.about or f"Some terms absent: the condition selects them out of {what}'s tile before the WGMMA."
            select = (head + [f"{name} = {value}" for name, value in _needed(sel.step_lets, repr([sel.kind] + lines))]
                      + ["", f"@pl.when({sel.kind})", "def _select():", f"    # {about}"]
                      + ["    " + line for line in lines])
        guard = list(p.guard)
        if guard:
            guard.append(f"    return {self.zeros(p, mod)}")
        return _trimmed({
            "form": "product",
            "fn": p.fn,
            "params": params,
            "n_tables": len(tables),
            "statics": statics,
            "about": self.kernel_about(p),
            "lets": p.kernel_lets,
            "maps": maps,
            "a_smem": a_smem,
            "b_smem": b_smem,
            "a_operand": f"{a_smem}.transpose((1, 0))" if p.a.transposed else a_smem,
            "b_operand": self.b_operand(b_smem, p.b.transposed, t),
            "a_block": py_tuple(map(str, a_block)),
            "b_block": py_tuple(map(str, b_block)),
            "a_ref": a_ref,
            "b_ref": b_ref,
            "stages": t.stages,
            "any_maps": ", ".join("any_tile" if len(i) == 2 else f"lambda s: (s,) * {len(i)}" for i in (p.a_index, p.b_index)),
            "tile": f"({t.tm}, {t.tn})",
            "acc": p.acc_dtype.jnp,  # WGMMA's accumulator: f32, or s32 for s8 products
            "after": p.after_dtype.jnp,  # the sum times the factors after it: s32 meeting a float scale is f32
            "scale": _number(p.scale) if p.scale is not None else None,
            "out_index": ", ".join(_py(p.out_index[-2:])),
            "scoped": ", ".join(scoped),
            "scoped_names": ", ".join(scoped_names),
            "end": p.end.operand if p.end else None,
            "end_mask": p.end_mask,
            "kind": f"{p.kind_table}[cell]" if p.kind_table else None,
            "end_ref": end_ref,
            "end_at": ", ".join([*_py(p.end_index[:-2]), at(p.end_index[-2:])]) if p.end_index else None,  # coordinates leading, where they are
            "out_ref": out_ref,
            "out_at": ", ".join([*_py(p.out_index[:-2]), at((Var("row"), Var("col")))]),  # the coordinates, where leading dimensions
            "out_dtype": p.out_dtype.jnp,
            "call_fn": p.call_fn,
            "call_args": list(dict.fromkeys(call_args)),
            "call_about": f"The kernel that computes {p.output}: {p.statement.text}",
            "guard": guard,
            "host": p.host,
            "raw": p.raw,
            "raw_shape": raw_shape,
            "kernel": kernel,
            "grid": py_tuple([render(p.cells, "host"), str(t.bm // t.tm), str(t.bn // t.tn)]),
            "kernel_args": tables + [p.a.array, p.b.array] + ([p.end.array] if p.end else []) + [v["array"] for v in vectors]
            + [h[1] for h in held],
            "vectors": vectors,
            "tile_rows": t.tm,
            "vector_scoped": ", ".join(f"{v['smem']}=plgpu.SMEM(({v['length']},), {v['dtype']}), {v['barrier']}=plgpu.Barrier()"
                                       for v in vectors),
            "vector_names": ", ".join(f"{v['smem']}, {v['barrier']}" for v in vectors),
            "select": select,
            "acc_lines": acc_lines,
            "step_select": step_select,
            "held_scoped": [h[3] for h in held] if not ws else [],
            "held_names": [name for h in held for name in h[2]],
            "finish": p.finish + (self.present_check(p, mod) if p.exposed else []),
            "out_var": p.out_var,
            "end_dtype": k.operand(p.end.operand).dtype.jnp if p.end else None,
            "piece_at": at(piece_at),
            "steps": p.steps if "cell" in words(p.steps) or _needed(p.kernel_lets, p.steps)
            else f"jnp.full(cell.shape, {p.steps}, jnp.int32)",  # the dense walk: every block's the same
            "steps_lets": _needed(p.kernel_lets, p.steps),
            "ctas": ctas,
            "ctas_about": f"{mod.target.sms} SMs on {mod.target.name}" + (f", {sub} tiles a block" if sub > 1 else ""),
            "cells": render(p.cells, "host"),
            "bm": t.bm,
            "bn": t.bn,
            "sub_grid": f"{rows_in}, {cols_in}",
            "wgs": t.wgs,
            "epi": epi,
            "epi_tiles": t.tn // epi,
            "memory_registers": MEMORY_REGISTERS,
        })

    @staticmethod
    def b_operand(b_smem: str, transposed: bool, t) -> str:
        """B's shared-memory tile as WGMMA reads it; warp-specialized, the consumer's columns of the CTA's tile."""
        if t.wgs > 1:
            cols = _ds(Var("wg"), t.tn)
            return f"{b_smem}.at[{cols}].transpose((1, 0))" if transposed else f"{b_smem}.at[:, {cols}]"
        return f"{b_smem}.transpose((1, 0))" if transposed else b_smem

    def reads(self, p: GpuPass, mod: GpuModule) -> list[str]:
        """Outputs of earlier statements this pass reads."""
        return [r.operand for r in p.statement.factors if mod.kernel.operand(r.operand).direction == "out"]

    def zeros(self, p: GpuPass, mod: GpuModule) -> str:
        k = mod.kernel
        op = k.operand(p.output)
        if p.walk == "coo output":
            read = p.statement.target
            tiles = [str(k.index(i).tile) for i in read.indices if k.index(i).tile != 1]
            return f"jnp.zeros({py_tuple(['0'] + tiles)}, {op.dtype.jnp})"
        return f"jnp.zeros({py_tuple(render(mod.conv.size(d), 'host') for d in op.dims)}, {op.dtype.jnp})"

    def kernel_about(self, p: GpuPass) -> str:
        t = p.tiles
        walk = {
            "dense": f"every block along {p.a.col}",
            "rows": f"the blocks of {p.sparse} in its row of output blocks",
            "cols": f"the blocks of {p.sparse} in its column of output blocks",
            "coo output": f"every block along {p.a.col}, for each requested block of {p.output}",
            "output mask": f"every block along {p.a.col}, where the {p.sparse} block is not empty",
            "condition": f"the blocks the condition `{p.statement.condition.text if p.statement.condition else ''}` leaves "
                         + ("(a partial step selects out of its own product)" if p.selection and p.selection.on == "step" else
                            f"(a partial step masks its tile of {p.a.operand if p.selection and p.selection.on == 'a' else p.b.operand})"),
            "condition output": f"every block along {p.a.col} where the condition leaves any element (the accumulator masked by it)",
        }[p.walk]
        return (f"{p.statement.text}: persistent; each CTA runs its chunks of the work list, a chunk a run of the "
                f"steps of a {t.tm}x{t.tn} tile of an output block, which walks {walk}, one WGMMA per {p.a.col} tile "
                f"of {t.tk}.")

    def present_check(self, p, mod: GpuModule) -> list[str]:
        """Wrapper lines after a pass whose condition leaves a factor exposed (`exposed`: its
        absent terms selected out of one factor's tiles, the other lacking an index they span,
        `k <= m`'s y[k, n]): where the result is not finite, the statement over its present
        terms alone (`reference`'s lines, language v3 section 0: a NaN or Inf an absent term's
        factor holds never reaches it); finite data pay one check of the result."""
        st, k = p.statement, mod.kernel
        writer = Wrapper(k, mod.conv, (), self.wrapper.size, mod.names)
        writer.scope = p.names
        var = p.names.local(f"{p.output}_present")
        fn = p.names.local(f"_{p.output}_present")
        acc = k.accumulate
        letters = {i: "abcdefghijklmnopqrstuvwxyz"[n] for n, i in enumerate(st.indices)}
        body: list[str] = []
        views = [_widen(writer.view(st, n, body, {}), k.operand(r.operand).dtype, acc) for n, r in enumerate(st.factors)]
        specs = ["".join(letters[i] for i in f.indices) for f in st.factors]
        body += writer.conditioned(st, var, views, specs, letters, ", precision=lax.Precision.HIGHEST")
        if st.scale is not None:
            body.append(f"{var} = {var} * {_number(st.scale)}")
        body.append(f"return {var}.astype({p.out_dtype.jnp})")
        out = p.out_var
        return ["", f"def {fn}():",
                "    # A NaN or Inf met an absent term (or a present one): the sum of the present terms.",
                *("    " + line for line in body), "",
                f"{out} = lax.cond(jnp.all(jnp.isfinite({out})), lambda: {out}, {fn})"]

    def gradient(self) -> tuple[Glue, list[dict]]:
        """The custom_vjp glue (residuals: the inputs), and the backward's passes."""
        m = self.m
        bm = m.backward_module
        pass_outputs = {p.output: dict(bm.outputs)[p.output] for p in bm.passes} if bm is not None else {}
        glue = einsum_glue(self.k, m.conv, m.names, m.backward, m.refused, pass_outputs, bm.conv.impl_args if bm is not None else ())
        return glue, [self.pass_dict(p, bm) for p in bm.passes] if bm is not None else []

    def module(self, source_name: str) -> str:
        m, k = self.m, self.k
        doc, call_doc = self.wrapper.docstrings(
            "a Pallas Mosaic GPU kernel (Hopper: TMA, WGMMA)",
            ["    interpret: False compiles for the GPU; True runs the Mosaic GPU interpreter",
             "        on the CPU (or pass plgpu.InterpretGPUParams(...))."],
            "Bad shapes, dtypes, and concrete coordinates out of range raise a ValueError\n"
            "naming the argument and dimension; under jax.jit, traced coordinates are clamped.",
            describe(m), m.target.name,
        )
        passes = [self.pass_dict(p) for p in m.passes]
        prepare_lines = self.wrapper.prepare_lines([])
        reference_lines = self.wrapper.reference_lines(self.outputs)
        glue, backward_passes = self.gradient()
        return self.wrapper.module(
            "gpu/module.py.j2", source_name, m.target.name, doc, call_doc, glue, prepare_lines, reference_lines,
            kinds=any(p.classifies for p in (*m.passes, *(m.backward_module.passes if m.backward_module else ()))),
            passes=passes,
            backward_passes=backward_passes,
            results=[self.outputs[o.name] for o in k.outputs],
        )


def emit_gpu(m: GpuModule, source_name: str) -> str:
    """The generated module's source, formatted by black."""
    return format_module(_Emitter(m).module(source_name), names=(m.name,))

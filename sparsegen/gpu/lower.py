"""GPU lowering: a kernel's statements as Mosaic GPU passes, and the backward kernel's too.

A statement with a sum becomes a block-sparse matrix product (`product.py`), one without an
elementwise tile copy (`elementwise.py`); either runs the walk the schedule chooses for it
(`schedule.choose_walk`: the TPU's decision too), said in GPU terms, and refuses at the
statement the walks it has no strategy for; a `where` condition's (the schedule's condition
walk) is a product whose partial steps mask a factor's tile, or whose accumulator is masked. The plan's vocabulary is
`plan.py`, the rules on tiles and shared memory `rules.py`. Attention-like kernels are
lowered by `attention/` (the row walk).
"""

from __future__ import annotations

import dataclasses

from ..callconv import Convention, convention
from ..expr import Expr
from ..dtypes import DType
from ..ir import Einsum, Kernel, Read
from ..names import ModuleNames
from ..schedule.build import operand_array
from ..schedule.choice import choose_walk
from .elementwise import ElementwiseLowering
from .plan import ElementwisePass, GpuError, GpuModule, ProductPass
from .product import ProductLowering
from .targets import GpuTarget

# The GPU kernels' fixed local names (templates/gpu/module.py.j2): per CTA, per pipeline step,
# the epilogue. Spec names never take them.
FIXED = frozenset({
    "cell", "mi", "ni", "start", "count", "s", "kk", "step", "stored", "acc", "acc_ref", "multiply", "product",
    "out_smem", "end_smem", "barrier", "kind", "row", "col", "_store", "_masked", "_whole", "_inside", "_outside",
    # the persistent grid: the work list (`_deal`), a chunk's values, the pieces of shared blocks
    "cta", "chunk", "run_chunk", "first", "slot", "store", "value", "_piece", "_write", "_unmasked", "_read_end", "times_end", "times_vectors", "_empty", "_full",
    "piece_smem", "pieces_gmem", "pieces", "steps_of", "ctas", "cta_first", "chunk_cell", "chunk_first", "chunk_count",
    "chunk_slot", "slot_cell",
    # warp-specialized products: the warpgroup, the pipeline's helper, its buffers, the consumers' epilogue
    "wg", "pipeline", "any_tile", "buffers", "_walk", "consumer", "_sum", "e", "body", "maps", "context",
    # a condition walk: a partial step's selection (the pipeline's indices, the condition's
    # value), the wrapper's classification (`xp`: numpy or jax.numpy)
    "idx", "_select", "_held", "present", "xp",
    # a condition selecting each step's product: its accumulator apart
    "_step", "step_ref",
})  # fmt: skip


class _Lowering:
    """What every statement's lowering reads: the kernel, its names and calling convention,
    and the wrapper variables of the outputs lowered so far."""

    def __init__(self, kernel: Kernel, target: GpuTarget, names: ModuleNames | None = None, conv: Convention | None = None,
                 casts: dict[str, DType] | None = None):
        self.k = kernel
        self.casts = casts or {}  # operands the wrapper hands the kernels in another dtype (`_cotangents_as_partners`)
        self.target = target
        if names is None:
            names = ModuleNames(kernel)
            names.internal.used |= FIXED
        self.names = names
        self.conv = conv or convention(kernel, self.names)
        self.tile = {i.name: i.tile for i in kernel.indices}
        self.outputs: dict[str, str] = {}

    def size(self, index: str) -> Expr:
        return self.conv.size(self.k.index(index).size)

    def blocks(self, index: str) -> Expr:
        return self.size(index).cdiv(self.tile[index])

    def source(self, read: Read) -> str:
        """The wrapper variable an operand is read from: an argument, or an earlier output."""
        array = operand_array(self.k, self.conv, self.outputs, read)
        cast = self.casts.get(read.operand)
        return f"{array}.astype({cast.jnp})" if cast is not None else array

    def statement(self, st: Einsum) -> ProductPass | ElementwisePass:
        """The statement's pass, on the walk the schedule chooses for it (schedule.choose_walk)."""
        walk = choose_walk(self.k, st)
        return (ProductLowering if st.summed else ElementwiseLowering)(self, st, walk).lower()

    def lower(self) -> GpuModule:
        passes, errors = [], []
        for st in self.k.statements:
            try:
                p = self.statement(st)
            except GpuError as exc:
                errors += exc.diagnostics
                continue
            passes.append(p)
            self.outputs[st.target.operand] = p.out_var
        if errors:
            raise GpuError(errors)
        return GpuModule(self.k, self.target, self.conv, self.names, tuple(passes), tuple(self.outputs.items()))


def lower_gpu(kernel: Kernel, target: GpuTarget, backward: bool = True) -> GpuModule:
    """A kernel as Mosaic GPU passes (GpuError with spec-located diagnostics if it cannot be),
    with the backward kernel its gradients need (autodiff), lowered the same way."""
    from ..autodiff import derive

    m = _Lowering(kernel, target).lower()
    if not backward:
        return m
    b = derive(m.kernel, m.conv, m.names, densify="which is not lowered for GPUs yet")
    if b.error or b.kernel is None:
        return dataclasses.replace(m, backward=b, backward_error=b.error)
    kernel, casts = _cotangents_as_partners(b)
    try:
        bm = _Lowering(kernel, target, m.names, b.conv, casts).lower()
    except GpuError as exc:
        return dataclasses.replace(m, backward=b, backward_error=f"the backward kernel has no GPU lowering: {exc.diagnostics[0].message}")
    return dataclasses.replace(m, backward=b, backward_module=bm)


def _cotangents_as_partners(b) -> tuple[Kernel, dict[str, DType]]:
    """The backward kernel as the GPU reads it. WGMMA multiplies two factors of one dtype, so
    a float cotangent wider than every factor it meets in the backward's statements, those
    all of one 16-bit dtype (an f32 output of bf16 inputs: `g_o * y`, `x * g_o`), is read in
    that dtype: the wrapper casts it before the kernels. The gradients of 16-bit inputs are
    rounded to that dtype anyway (and FlashAttention reads dO so); the TPU's kernels take the
    cotangent as it is."""
    k = b.kernel
    arrays = {array for _, array in b.cotangents}
    casts = {}
    for name in sorted({p.operand for p in b.conv.params if p.internal in arrays}):
        op = k.operand(name)
        partners = {k.operand(f.operand).dtype for st in k.statements if any(f.operand == name for f in st.factors)
                    for f in st.factors if f.operand != name}
        if op.dtype.is_float and op.dtype.itemsize > 2 and len(partners) == 1:
            (d,) = partners
            if d.is_float and d.itemsize == 2:
                casts[name] = d
    if not casts:
        return k, {}
    operands = tuple(dataclasses.replace(o, dtype=casts[o.name]) if o.name in casts else o for o in k.operands)
    return dataclasses.replace(k, operands=operands), casts

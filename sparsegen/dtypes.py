"""The spec's dtypes and what the TPU makes of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # as written in a spec
    numpy: str  # jnp/np attribute name
    bits: int
    kind: str  # "float" | "int" | "uint" | "index" | "bool"

    @property
    def jnp(self) -> str:
        return f"jnp.{self.numpy}"

    @property
    def itemsize(self) -> int:
        return self.bits // 8

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def np_dtype(self):
        """The numpy dtype of this data as the caller passes it (bfloat16 from ml_dtypes, which
        comes with jax; a `bool` operand as numpy's bool)."""
        if self.kind == "bool":
            import numpy as np

            return np.dtype(np.bool_)
        if self.numpy == "bfloat16":
            import ml_dtypes

            return ml_dtypes.bfloat16
        import numpy as np

        return np.dtype(self.numpy)

    @property
    def sublanes(self) -> int:
        """Rows of one native (sublane x 128) VMEM tile: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
        return 8 * 32 // self.bits


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("f32", "float32", 32, "float"),
        DType("bf16", "bfloat16", 16, "float"),
        DType("i8", "int8", 8, "int"),
        DType("i16", "int16", 16, "int"),
        DType("i32", "int32", 32, "int"),
        DType("u8", "uint8", 8, "uint"),
        DType("u16", "uint16", 16, "uint"),
        DType("u32", "uint32", 32, "uint"),
        DType("index", "int32", 32, "index"),
        # 0 or 1: passed as a bool array, held as int8 inside the kernels (`numpy` names the
        # kernels' dtype; `np_dtype` the caller's).
        DType("bool", "int8", 8, "bool"),
    )
}

DATA_DTYPES = tuple(n for n in DTYPES if n != "index")
# What `accumulate` may name (a sum is never kept in bool).
ACCUMULATE_DTYPES = tuple(n for n in DATA_DTYPES if n != "bool")


# ------------------------------------------------------------ the covered product's dtype

# The integers bf16 holds exactly, all of them: |x| <= 2^8 (8 significant bits).
_BF16_EXACT = 2**8


def value_range(d: DType) -> tuple[int, int] | None:
    """The values `d` holds (None for a float: any)."""
    if d.is_float:
        return None
    if d.kind == "bool":
        return 0, 1
    if d.kind == "uint":
        return 0, 2**d.bits - 1
    return -(2 ** (d.bits - 1)), 2 ** (d.bits - 1) - 1


def covered_dtype(main: DType, covered: tuple[DType, ...]) -> tuple[DType, str | None]:
    """The dtype in which a factor (`main`) times the factors it covers (`covered`, multiplied
    into it elementwise before the sum) is handed to the matrix unit, and why when that is not
    `main`'s dtype or says it stays (None for a float factor or nothing covered). The one rule every stage follows (kernels, plan, docs).

    A float factor keeps its dtype (the product is rounded to it, as a kernel of that dtype
    would). An integer factor keeps its dtype where the product cannot leave it (an `i8`
    factor times a `bool` mask); else the product is formed wider, as the math (`reference`)
    multiplies: bf16 where every value it can take is an integer bf16 holds exactly (|x| <=
    256), f32 otherwise. The reason is given for every integer factor that covers another."""
    if main.is_float or not covered:
        return main, None
    lo, hi = value_range(main)
    for d in covered:
        r = value_range(d)
        if r is None:
            lo = hi = None
            break
        corners = [lo * r[0], lo * r[1], hi * r[0], hi * r[1]]
        lo, hi = min(corners), max(corners)
    own = value_range(main)
    names = " times ".join(d.name for d in (main, *covered))
    if lo is not None and own[0] <= lo and hi <= own[1]:
        return main, f"{names} stays within {main.name}: formed in {main.name}"
    if lo is None:
        return DTYPES["f32"], f"{names} is not an integer: formed in f32"
    reach = f"{names} reaches {lo}..{hi}, past {main.name}"
    if max(-lo, hi) <= _BF16_EXACT:
        return DTYPES["bf16"], f"{reach}: formed in bf16 (exact for integers up to {_BF16_EXACT})"
    return DTYPES["f32"], f"{reach} and bf16's exact integers (up to {_BF16_EXACT}): formed in f32"


def matrix_dtype(fed: tuple[DType, ...], acc: DType) -> DType:
    """The dtype both sides of a matrix product are handed in, given each side's (`fed`, from
    `covered_dtype`): the one they share; an integer sum meeting a covered product formed wider
    takes bf16 where every side's values are integers bf16 holds exactly, f32 otherwise (the
    step's sum then in f32, exact below 2^24, added to the integer accumulator); else `acc`."""
    if len(set(fed)) == 1:
        return fed[0]
    if acc.is_float or not any(d.is_float for d in fed):
        return acc
    exact = all(d.name == "bf16" or (value_range(d) is not None and max(-value_range(d)[0], value_range(d)[1]) <= _BF16_EXACT)
                for d in fed)
    return DTYPES["bf16" if exact else "f32"]


def after_sum_dtype(acc: DType, factors: tuple[DType, ...]) -> DType:
    """The dtype a finished sum meets the factors after it in (language v3, section 1: a factor
    holding none of the summed indices multiplies the sum, not its terms): the accumulator's,
    unless an integer sum (`accumulate i32` over int8 tiles) meets a float factor (a
    quantisation scale): then f32, the exact i32 sum converted once. One rule for every
    target and for `reference`."""
    if acc.is_float or not any(d.is_float for d in factors):
        return acc
    return DTYPES["f32"]

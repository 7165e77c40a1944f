"""The spec's dtypes and what the TPU makes of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # as written in a spec
    numpy: str  # jnp/np attribute name
    bits: int
    kind: str  # "float" | "int" | "uint" | "index"

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
        """The numpy dtype of this data (bfloat16 from ml_dtypes, which comes with jax)."""
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
    )
}

DATA_DTYPES = tuple(n for n in DTYPES if n != "index")

"""Specs whose names collide with what generated code uses, shared by several tests."""

# Operands, indices and sizes named after things the generated module uses itself.
NASTY = """
kernel nasty {
    in  jnp: bf16[np, len] coo
    in  _kernel: bf16[len, pl]
    out interpret: bf16[np, pl]
    interpret[k, step] = jnp[k, lax] * _kernel[lax, step]
    tile k = 128, step = 128, lax = 128
}
"""

NASTY_MASK = """
kernel mask {
    in  sizes: f32[M, K]
    in  acc_ref: f32[K, N]
    in  mask: i32[M, N] mask
    out kind: f32[M, N]
    kind[cell, nxt] = mask[cell, nxt] * sizes[cell, live] * acc_ref[live, nxt]
    tile cell = 128, nxt = 128, live = 128
}
"""

TRANSPOSED = """
kernel at {
    in  a: f32[K, M]
    in  b: f32[N, K]
    in  s: f32[N] mask
    out o: f32[M, N]
    o[i, j] = s[j] * a[k, i] * b[j, k]
    tile i = 128, j = 128, k = 128
}
"""

# A mask on a factor of the sum: its zero blocks skip single block products.
XMASK = """
kernel xmask {
    in  x: bf16[M, K] mask
    in  y: bf16[K, N]
    out o: f32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
"""

# One offset read by two operands of different extents: each is clamped to its own.
TWO_OFFSETS = """
kernel window {
    in  x: f32[512, 256]
    in  w: f32[1024, 256]
    in  at: index[1]
    out o: f32[128, 256]
    o[i, j] = x[at[0] + i, j] * w[at[0] + i, j]
    tile i = 128, j = 256
}
"""

# A mask input with a coo output: sampled and masked (the attention-score pattern).
MASKED_SDD = """
kernel masked_sdd {
    in  q: bf16[S, D]
    in  kt: bf16[D, T]
    in  causal: i32[S, T] mask
    out scores: f32[S, T] coo
    scores[s, t] = causal[s, t] * q[s, d] * kt[d, t]
    tile s = 128, t = 128, d = 128
}
"""

# A coo output whose summed factor is mask-sparse.
XMASK_SDD = """
kernel xmask_sdd {
    in  x: f32[M, K] mask
    in  y: f32[K, N]
    out o: f32[M, N] coo
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
"""

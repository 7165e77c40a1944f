"""The Pallas block-sparse tutorial's `sparsify_mask`, as published (JAX documentation,
Apache License 2.0), kept verbatim as the baseline for bench/bench_sparsify_mask.py.

Its bugs are kept on purpose: blocks are deduplicated by `str(block)`, which numpy
truncates for blocks over 1000 elements, and it walks one block past each edge.
"""

import jax
import jax.numpy as jnp


def tutorial_sparsify_mask(mask: jax.Array, block_shape: tuple[int, int]):
    M, N = mask.shape
    bm, bn = block_shape

    block_mask = jnp.zeros((M // bm, N // bn), dtype=mask.dtype)
    mask_types_finder = []
    mask_data = []
    next_mask_type_idx = 0
    prefetch_mask = jnp.zeros_like(block_mask)
    next_i = (M // bm) - 1
    next_j = (N // bn) - 1
    prefetch_i = jnp.zeros_like(block_mask)
    prefetch_j = jnp.zeros_like(block_mask)
    for i in range(M // bm, -1, -1):
        for j in range(N // bn, -1, -1):
            mask_block = mask[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            is_nonzero = jnp.any(mask_block)
            if is_nonzero:
                try:
                    type_index = mask_types_finder.index(str(mask_block))
                except ValueError:
                    type_index = len(mask_types_finder)
                    mask_types_finder.append(str(mask_block))
                    mask_data.append(mask_block)
                next_mask_type_idx = type_index
                next_i = i
                next_j = j
            else:
                type_index = -1
            block_mask = block_mask.at[i, j].set(is_nonzero)
            prefetch_mask = prefetch_mask.at[i, j].set(next_mask_type_idx)
            prefetch_i = prefetch_i.at[i, j].set(next_i)
            prefetch_j = prefetch_j.at[i, j].set(next_j)
    return block_mask, prefetch_mask, prefetch_i, prefetch_j, jnp.stack(mask_data)

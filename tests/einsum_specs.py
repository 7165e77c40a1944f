"""Random einsum specs for the property tests: index sets, batch indices, transposed reads,
three factors, literal factors, one sparse operand of each kind, ragged sizes."""

from __future__ import annotations

from hypothesis import strategies as st

# What the sparse operand is: none, a coo input, a mask input, a coo output, or a coo output
# together with a mask or a coo input (a join).
SPARSE = ("dense", "coo_in", "mask", "coo_out", "coo_out_mask", "coo_join")
LETTERS = "abcdefgh"


@st.composite
def einsum_specs(draw, sparse: str):
    """(spec text, sizes) for one random statement whose sparse operand is `sparse`."""
    n_out = draw(st.integers(1, 3))
    n_sum = draw(st.integers(0 if sparse in ("dense", "mask", "coo_out") else 1, 2))
    out = list(LETTERS[:n_out])
    summed = list(LETTERS[n_out : n_out + n_sum])
    indices = out + summed
    dtype = draw(st.sampled_from(["f32", "bf16"]))
    # Factors: random subsets of the indices, in random orders (transposed reads).
    n_factors = draw(st.integers(1, 3))
    factors = []
    for _ in range(n_factors):
        chosen = draw(st.lists(st.sampled_from(indices), min_size=1, max_size=min(3, len(indices)), unique=True))
        factors.append(chosen)
    # Every index appears in some factor.
    for i in indices:
        if not any(i in f for f in factors):
            target = draw(st.integers(0, len(factors) - 1))
            if len(factors[target]) < 3:
                factors[target].append(i)
            else:
                factors.append([i])
    # The sparse operand: which factor, and its kind.
    coo_in = mask = None
    with_sum = [n for n, f in enumerate(factors) if set(f) & set(summed)]
    if sparse in ("coo_in", "coo_join"):
        # A coo input walks its stored blocks: mostly it holds every summed index; sometimes it
        # lies outside the sum (it samples the sum at its stored blocks).
        if draw(st.integers(0, 3)) == 0:
            coo_in = draw(st.integers(0, len(factors) - 1))
        else:
            candidates = [n for n in with_sum if set(summed) <= set(factors[n])] or with_sum
            coo_in = draw(st.sampled_from(candidates))
            for i in summed:
                if i not in factors[coo_in] and len(factors[coo_in]) < 3:
                    factors[coo_in].append(i)
    elif sparse in ("mask", "coo_out_mask"):
        mask = draw(st.integers(0, len(factors) - 1))
    out_coo = sparse.startswith("coo_out") or sparse == "coo_join"
    # Tiles by the position an index takes in any array: lanes (last) 128; sublanes (second
    # to last) 1 (squeezed), 8/16 or twice that; leading dimensions 1 or 2. Small blocks keep
    # the TPU simulator fast.
    arrays = factors + ([out] if not out_coo else [])
    last = {f[-1] for f in arrays}
    second = {f[-2] for f in arrays if len(f) >= 2}
    sub = 16 if dtype == "bf16" else 8
    tiles = {}
    for i in indices:
        if i in last:
            tiles[i] = 128
        elif i in second:
            tiles[i] = draw(st.sampled_from([1, sub, 2 * sub]))
        else:
            tiles[i] = draw(st.sampled_from([1, 2]))
    blocks = {i: draw(st.integers(1, 3)) for i in indices}
    ragged = {i: draw(st.sampled_from([0, 0, tiles[i] // 2, 3])) if tiles[i] >= 8 else 0 for i in indices}
    sizes = {i.upper(): max(1, tiles[i] * blocks[i] - ragged[i]) for i in indices}
    scale = draw(st.sampled_from(["", " * 0.5", " * 2"]))
    names = [f"x{n}" for n in range(len(factors))]
    lines = [f"kernel prop_{sparse} {{"]
    for n, f in enumerate(factors):
        kind = " coo" if n == coo_in else " mask" if n == mask else ""
        fdtype = draw(st.sampled_from(["i8", "f32", dtype])) if n == mask else dtype
        lines.append(f"    in  {names[n]}: {fdtype}[{', '.join(i.upper() for i in f)}]{kind}")
    lines.append(f"    out o: {dtype}[{', '.join(i.upper() for i in out)}]{' coo' if out_coo else ''}")
    rhs = " * ".join(f"{names[n]}[{', '.join(f)}]" for n, f in enumerate(factors))
    lines.append(f"    o[{', '.join(out)}] = {rhs}{scale}")
    lines.append("    tile " + ", ".join(f"{i} = {tiles[i]}" for i in indices))
    lines.append("}")
    return "\n".join(lines) + "\n", sizes

"""Planted bugs: does the suite catch a realistic mistake in the compiler? (issue 44)

    python scripts/mutants.py                 # every mutant, one at a time
    python scripts/mutants.py --list          # the list, and whether each still applies
    python scripts/mutants.py NAME ...        # some of them
    python scripts/mutants.py --fresh         # the second list, planted after the first was caught in full

Each mutant is one small edit (a bound off by one, indices swapped, a sub-tile offset
dropped, a check removed, a flush at the wrong step) of one file. For each, the tree is
copied to a temporary folder (the working tree as it is, uncommitted edits included), the
edit made there, and the tests that own that code run against the copy (`pytest -x`, one
run per entry of its `tests`, in their order, until one fails):
*caught* if a test fails, *escaped* if they all pass, *stale* if the text to edit is no
longer in the file exactly once (the list needs updating). Not run in CI: a full run takes
about an hour on two cores. `docs/testing.md` holds the last table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("sparsegen", "templates", "grammars", "tests", "specs", "generated", "examples", "pyproject.toml")


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # files or node ids (file::test, file::test[id]); no -k: it filters every file
    about: str


T_COND = ("tests/test_condition_boundaries.py", "tests/test_sum_conditions.py")
T_GROUPED = ("tests/test_grouped_walk.py", "tests/test_sum_conditions.py", "tests/test_condition_boundaries.py")
ATTENTION = ("causal_attention", "document_attention", "local_gqa_attention", "masked_attention")
T_ATT = tuple(f"tests/test_shipped_tiles.py::test_tpu_example_at_its_tiles[sim-{n}]" for n in ATTENTION) + (
    "tests/test_shipped_tiles.py::test_tpu_gradient_at_its_tiles[sim-causal_attention]", "tests/test_attention.py")
T_GPU_ATT = tuple(f"tests/test_shipped_tiles.py::test_gpu_example_at_its_tiles[{n}-default]" for n in ATTENTION) + (
    "tests/test_shipped_tiles.py::test_gpu_gradient_at_its_tiles[causal_attention-default]", "tests/test_gpu_attention.py")
T_MESH = ("tests/test_sharded.py", "tests/test_ring_boundaries.py")
T_CHECKS = ("tests/test_runtime_checks.py", "tests/test_calls.py")

MUTANTS: list[Mutant] = [
    Mutant("classify-last-row-short", "sparsegen/schedule/classify.py",
           "Min(lo + t, self.size_of(i)) - 1)", "Min(lo + t, self.size_of(i)) - 2)", T_COND,
           "a block's last position one short: a term on the last row of a block is classified absent"),
    Mutant("classify-strict-as-loose", "sparsegen/schedule/classify.py",
           'if op == "<":\n            return key, None, rest.shifted(-1)', 'if op == "<":\n            return key, None, rest', T_COND,
           "`<` classified as `<=`: a block whose first term fails is called full"),
    Mutant("walk-flags-swapped", "templates/helpers.py.j2",
           "flags = first.astype(xp.int32) + 2 * last.astype(xp.int32)",
           "flags = last.astype(xp.int32) + 2 * first.astype(xp.int32)", T_COND,
           "init and flush swapped: an output block is written at its first step, zeroed at its last"),
    Mutant("next-live-past-end", "templates/helpers.py.j2",
           "return jnp.where(ahead < n, ahead, jnp.maximum(behind, 0)).astype(jnp.int32)",
           "return jnp.where(ahead < n, ahead, 0).astype(jnp.int32)", ("tests/test_plan_rules.py", "tests/test_kernels.py"),
           "past the last live step, prefetch block 0 rather than the last one: a copy no step uses"),
    Mutant("tail-mask-one-past", "templates/helpers.py.j2",
           "inside = lax.broadcasted_iota(jnp.int32, value.shape, axis) < limit",
           "inside = lax.broadcasted_iota(jnp.int32, value.shape, axis) <= limit",
           ("tests/test_condition_boundaries.py::test_triangle_and_band_one_row_off_a_whole_block", "tests/test_kernels.py",
            "tests/test_condition_sizes.py", "tests/test_shipped_tiles.py::test_tpu_example_at_its_tiles",
            "tests/test_shipped_tiles.py::test_tpu_gradient_at_its_tiles"),
           "a ragged tail keeps one element past the end (NaN in the simulator)"),
    Mutant("ring-key-origin-rows", "templates/ring.py.j2",
           "origin = jnp.stack([qc * lengths[0], kc * lengths[1]]).astype(jnp.int32)",
           "origin = jnp.stack([qc * lengths[0], kc * lengths[0]]).astype(jnp.int32)", T_MESH,
           "a ring's key origin computed from the query chunk's length (equal when S == T)"),
    Mutant("gpu-subtile-offset", "sparsegen/gpu/product.py",
           "return Var(self.var_of[i]) * t.bm + self.sub(\"mi\", t.bm // t.tm) * t.tm",
           "return Var(self.var_of[i]) * t.bm", ("tests/test_shipped_tiles.py::test_gpu_example_at_its_tiles",
                                                   "tests/test_condition_boundaries.py", "tests/test_gpu_conditions.py",
                                                   "tests/test_gpu_condition_steps.py"),
           "a GPU condition's rows without their sub-tile offset (right with one sub-tile only)"),
    Mutant("gpu-attention-row-block", "sparsegen/gpu/attention/emit.py",
           'row_block = f"{row_tile} // {rsub}" if rsub != 1 else row_tile', "row_block = row_tile", T_GPU_ATT,
           "a GPU attention CTA's row block taken as its row tile (right with one sub-tile only)"),
    Mutant("paged-negative-page", "templates/common/paged.py.j2",
           "bad = reached & ((entries < 0) | (entries >= {{ check.size }}))",
           "bad = reached & (entries >= {{ check.size }})", T_CHECKS,
           "the page-table check misses a reached negative entry (read as page 0)"),
    Mutant("lse-merge-no-max", "templates/helpers.py.j2",
           "    top = jnp.where(jnp.isneginf(top), 0.0, top)\n    total = sum_of(jnp.exp(lse - top))",
           "    top = jnp.zeros_like(top)\n    total = sum_of(jnp.exp(lse - top))",
           ("tests/test_gpu_decode_split.py::test_parts_with_logits_past_the_exponents_range_merge",) + T_MESH,
           "merging partial softmaxes without subtracting the maximum (overflows for large logits)"),
    Mutant("route-drop-counts", "sparsegen/formats.py",
           "sizes = xp.bincount(key, length=num_experts + 1)[:num_experts].astype(xp.int32)",
           "sizes = xp.bincount(xp.clip(key, 0, num_experts - 1), length=num_experts + 1)[:num_experts].astype(xp.int32)",
           ("tests/test_formats.py",), "a dropped choice counted for the last expert under jit"),
    Mutant("from-dense-positive", "sparsegen/formats.py",
           "nonzero = np.any(view != 0, axis=inner)", "nonzero = np.any(view > 0, axis=inner)", ("tests/test_formats.py",),
           "BlockCOO.from_dense keeps blocks with a positive entry only (a block of negatives dropped)"),
    Mutant("select-flush-with-a-scalar-sum", "sparsegen/schedule/condition.py",
           "if not any(i in st.summed for i in used):", "if not any(i in st.summed and tile[i] > 1 for i in used):",
           ("tests/test_absent_terms.py",),
           "a condition reading a summed index walked one value at a time selected once at the flush (issue 37, item 1)"),
    Mutant("nonfinite-check-dropped", "sparsegen/schedule/condition.py",
           "exposed = next((g for g in range(len(st.summed_groups)) if g != group), None)", "exposed = None",
           ("tests/test_absent_terms.py",), "the other group's NaN meeting an absent term's 0 goes unchecked (0 * NaN)"),
    Mutant("presence-last-block-full", "templates/helpers.py.j2",
           "rows = jnp.minimum(tile, n - tile * jnp.arange(blocks))", "rows = jnp.full((blocks,), tile)", T_GROUPED,
           "a ragged last row block of one group never called full (its rows counted as a whole tile)"),
    Mutant("presence-shift-dropped", "templates/helpers.py.j2",
           "at = jnp.where(inside, ids + shift, groups)", "at = jnp.where(inside, ids, groups)",
           ("tests/test_grouped_walk.py::test_ids_compared_with_a_shifted_group",) + T_GROUPED,
           "ids compared with a group plus a literal (`gid[m] == g + 1`) classified without it"),
    Mutant("coords-at-limit-accepted", "templates/helpers.py.j2",
           "bad = np.flatnonzero((host < -1) | (host >= limit))", "bad = np.flatnonzero((host < -1) | (host > limit))", T_CHECKS,
           "a coo coordinate equal to the block count accepted (then clamped: a wrong block)"),
    Mutant("size-zero-accepted", "templates/helpers.py.j2",
           "    if value <= 0:", "    if value < 0:", T_CHECKS, "a size of 0 accepted"),
    Mutant("mesh-sum-not-added", "templates/helpers.py.j2",
           "return tuple(lax.psum(o, s) if s else o for o, s in zip(outs, sums))", "return tuple(outs)", T_MESH,
           "an output whose statement sums a split index not added across the mesh axis"),
]

# Planted after the list above was caught in full, by someone who had not read the tests.
T_EINSUM = ("tests/test_einsum.py::test_feature_matches_reference_and_oracle",)
# The classification's own tests first: the boundaries' GPU cases take minutes.
T_SUM_COND = ("tests/test_sum_conditions.py", "tests/test_condition_boundaries.py")
FRESH: list[Mutant] = [
    Mutant("classify-not-swapped", "sparsegen/schedule/classify.py",
           "return negation(must), negation(can)", "return negation(can), negation(must)", T_SUM_COND,
           "`not c` classified as not-can/not-must (can and must swapped): a block where c is partial called empty"),
    Mutant("classify-negative-coefficient", "sparsegen/schedule/classify.py",
           "a, b = (a, b) if c > 0 else (b, a)", "a, b = (a, b)", T_SUM_COND,
           "an atom with a negative coefficient (the j of i - j) ranged from its least to its greatest, not reversed"),
    Mutant("steps-flush-first-inner", "sparsegen/schedule/steps.py",
           "value = value & Var(a.var).eq(Var(a.static) - 1)", "value = value & Var(a.var).eq(0)",
           ("tests/test_sum_conditions.py", "tests/test_condition_sizes.py", "tests/test_condition_boundaries.py"),
           "a condition walk's flush at the first block of an inner sum (one the condition does not use), not the last"),
    Mutant("coo-init-current-step", "sparsegen/schedule/coo_input.py",
           "(Load(kind, Max(step - 1, 0)) & Var(\"_FLUSH\")).ne(0)", "(Load(kind, step) & Var(\"_FLUSH\")).ne(0)",
           T_EINSUM + ("tests/test_kernels.py",),
           "the coo walk's init keyed to this step's kind, not the step before: a run's last block zeroes the run"),
    Mutant("body-select-no-tile", "sparsegen/tpu/body.py",
           "= {coord} * {tile} + lax.broadcasted_iota(", "= {coord} + lax.broadcasted_iota(", T_SUM_COND,
           "a condition's element positions from the block coordinate without times the tile"),
    Mutant("body-tail-limit-no-tile", "sparsegen/tpu/body.py",
           "render(Var(t.size) - t.coord * t.tile, \"py\")", "render(Var(t.size) - t.coord, \"py\")",
           T_EINSUM + ("tests/test_kernels.py", "tests/test_condition_sizes.py"),
           "a ragged tail's limit from the block coordinate without times the tile (the tail is never masked)"),
    Mutant("body-flush-scale-dropped", "sparsegen/tpu/body.py",
           "            parts.append(self.p.scale.text)", "            pass", T_EINSUM,
           "a statement's literal factor (`* 0.5`) dropped at the flush"),
    Mutant("body-accumulate-in-input-dtype", "sparsegen/tpu/body.py",
           "pref = f\"preferred_element_type={acc.jnp}\"", "pref = f\"preferred_element_type={vals[0].dtype.jnp}\"",
           T_EINSUM + ("tests/test_kernels.py",),
           "a step's matrix product accumulated in the factors' dtype (bf16), not the accumulate dtype"),
    Mutant("grad-scale-dropped", "sparsegen/autodiff.py",
           "e = Einsum(target, factors, st.numbers,", "e = Einsum(target, factors, (),", ("tests/test_gradients.py",),
           "a derived gradient without the statement's literal factors (d(0.5 x y)/dx = y)"),
    Mutant("grad-cotangent-transposed", "sparsegen/autodiff.py",
           "g = Read(gname, st.target.subs, st.target.span)", "g = Read(gname, st.target.subs[::-1], st.target.span)",
           ("tests/test_gradients.py",), "a derived gradient reads the cotangent transposed"),
    Mutant("shifted-read-check-loose", "sparsegen/wrapper.py",
           "last = host(conv.size(k.index(sub.index).size) + sub.shift)",
           "last = host(conv.size(k.index(sub.index).size) + sub.shift - 1)",
           T_CHECKS + ("tests/test_sum_conditions.py::test_group_offsets_walk_is_bounded_and_reads_are_checked",),
           "`lo[g + 1]`'s length check one short: offsets of G entries (G + 1 needed) accepted, lo[G] read past the end"),
    Mutant("reference-offset-no-tile", "sparsegen/wrapper.py",
           "starts.append(f\"{conv.offsets}[{slot}] * {k.index(s.index).tile}\")\n                    sizes.append(",
           "starts.append(f\"{conv.offsets}[{slot}]\")\n                    sizes.append(",
           ("tests/test_fresh_reference.py", "tests/test_window.py") + T_EINSUM,
           "`reference` reads a factor at an offset in elements, not blocks (offset not times the tile)"),
    Mutant("reference-cut-one-past", "templates/helpers.py.j2",
           "inside = inside & (start + lax.broadcasted_iota(jnp.int32, blocks.shape, d + 1) < s)",
           "inside = inside & (start + lax.broadcasted_iota(jnp.int32, blocks.shape, d + 1) <= s)",
           ("tests/test_fresh_reference.py",) + T_EINSUM + ("tests/test_kernels.py",),
           "`reference` keeps one element past the end of a ragged stored block"),
    Mutant("window-one-block-more", "templates/helpers.py.j2",
           "(at >= start) & (at < start + count)", "(at >= start) & (at <= start + count)",
           ("tests/test_window.py",) + T_EINSUM,
           "a statement with offsets on the left writes one block past its window"),
    Mutant("group-ids-left", "sparsegen/formats.py",
           "xp.searchsorted(ends, xp.arange(num_rows), side=\"right\")", "xp.searchsorted(ends, xp.arange(num_rows), side=\"left\")",
           ("tests/test_formats.py", "tests/test_condition_boundaries.py"),
           "group_ids: a group's first row counted in the group before"),
    Mutant("check-offset-position", "sparsegen/check.py",
           "not 0 <= off.position < length", "not 0 <= off.position <= length", ("tests/test_diagnostics.py",),
           "a spec's offset read at position N of an index operand of N entries accepted"),
    Mutant("mesh-shift-without-size", "templates/helpers.py.j2",
           "start = lax.axis_index(axis[index]) * dict(keywords)[_MESH_RULES[index][1][0]]",
           "start = lax.axis_index(axis[index])", T_MESH,
           "integers compared with a split index made local by the device number, not its slice's start"),
    Mutant("mesh-coo-coords-global", "templates/helpers.py.j2",
           "c = jnp.clip(c, 0, per[d][0] * per[d][1] - 1) % per[d][1]", "c = jnp.clip(c, 0, per[d][0] * per[d][1] - 1)",
           ("tests/test_sharded.py",), "a coo input dealt to devices keeps global block coordinates (clamped: wrong blocks)"),
    Mutant("mesh-zigzag-divisor", "templates/helpers.py.j2",
           "need = 2 * n  # zigzag", "need = n  # zigzag", T_CHECKS + ("tests/test_ring_boundaries.py",),
           "a zigzag ring's size checked divisible by the devices, not twice that (two chunks a device)"),
]


def copy_tree(dest: Path) -> None:
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc"))
        elif src.exists():
            shutil.copy2(src, dest / name)
    for venv in (".venv-gpu",):  # ptxas for the GPU's third stage, where it exists
        if (ROOT / venv).exists():
            os.symlink(ROOT / venv, dest / venv)


def applies(m: Mutant, root: Path = ROOT) -> bool:
    return (root / m.file).read_text().count(m.old) == 1


def run_one(m: Mutant, timeout: int) -> tuple[str, float, str]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        dest = Path(tmp)
        copy_tree(dest)
        path = dest / m.file
        text = path.read_text()
        if text.count(m.old) != 1:
            return "stale", 0.0, f"the text to edit occurs {text.count(m.old)} times in {m.file}"
        path.write_text(text.replace(m.old, m.new))
        env = dict(os.environ, PYTHONPATH=str(dest), TPU_SKIP_MDS_QUERY="1", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        env.pop("SPARSEGEN_SWEEP", None)
        # One pytest a `tests` entry, in their order, until one fails: within one run
        # conftest puts the long mesh modules first, ahead of a faster catcher.
        start, tails = time.perf_counter(), []
        for entry in m.tests:
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", entry]
            left = timeout - (time.perf_counter() - start)
            try:
                done = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=max(left, 1))
            except subprocess.TimeoutExpired:
                return "timeout", time.perf_counter() - start, f"in {entry}"
            tail = (done.stdout + done.stderr).strip().splitlines()
            tails.append(tail[-1] if tail else "")
            if done.returncode in (1, 2, 3):
                failed = next((line for line in tail if line.startswith("FAILED") or line.startswith("ERROR")), tails[-1])
                return "caught", time.perf_counter() - start, failed
            if done.returncode != 0:
                return f"error (exit {done.returncode})", time.perf_counter() - start, f"{entry}: {tails[-1]}"
        return "escaped", time.perf_counter() - start, "; ".join(tails)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: the list)")
    parser.add_argument("--list", action="store_true", help="print the list and whether each still applies")
    parser.add_argument("--fresh", action="store_true", help="the second list instead of the first")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per mutant (default 1200)")
    args = parser.parse_args()
    chosen = FRESH if args.fresh else MUTANTS
    known = {m.name: m for m in MUTANTS + FRESH}
    if args.names:
        unknown = [n for n in args.names if n not in known]
        if unknown:
            parser.error(f"no mutant {', '.join(unknown)} (known: {', '.join(known)})")
        chosen = [known[n] for n in args.names]
    if args.list:
        for m in chosen:
            print(f"{m.name:28} {'applies' if applies(m) else 'STALE  '} {m.file}: {m.about}")
        return 0
    rows = []
    print("| mutant | file | what it plants | result | seconds | first failure |\n|---|---|---|---|---|---|", flush=True)
    for m in chosen:
        result, seconds, detail = run_one(m, args.timeout)
        rows.append(result)
        detail = detail.replace("|", "\\|")[:110]
        print(f"| {m.name} | {m.file} | {m.about} | {result} | {seconds:.0f} | {detail} |", flush=True)
    caught = rows.count("caught")
    print(f"\n{caught} caught, {rows.count('escaped')} escaped, {len(rows) - caught - rows.count('escaped')} other, of {len(rows)}")
    return 0 if caught == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())

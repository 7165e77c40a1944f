"""Planted bugs: does the suite catch a realistic mistake in the compiler? (issue 44)

    python scripts/mutants.py                 # every mutant, one at a time
    python scripts/mutants.py --list          # the list, and whether each still applies
    python scripts/mutants.py NAME ...        # some of them
    python scripts/mutants.py --fresh         # the second list, planted after the first was caught in full

Each mutant is one small edit (a bound off by one, indices swapped, a sub-tile offset
dropped, a check removed, a flush at the wrong step) of one file. For each, the tree is
copied to a temporary folder (the working tree as it is, uncommitted edits included), the
edit made there, and the tests that own that code run against the copy (`pytest -x`):
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
    tests: tuple[str, ...]  # pytest arguments: files, or file::test, -k expressions as "-k", "expr"
    about: str


T_COND = ("tests/test_condition_boundaries.py", "tests/test_sum_conditions.py")
T_GROUPED = ("tests/test_grouped_walk.py", "tests/test_sum_conditions.py", "tests/test_condition_boundaries.py")
T_ATT = ("tests/test_shipped_tiles.py", "-k", "causal or document or local or masked", "tests/test_attention.py")
T_GPU_ATT = ("tests/test_shipped_tiles.py", "-k", "gpu and (causal or document or local or masked)", "tests/test_gpu_attention.py")
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
           "return jnp.where(ahead < n, ahead, 0).astype(jnp.int32)", ("tests/test_kernels.py", "tests/test_sum_conditions.py"),
           "past the last live step, prefetch block 0 rather than the last one: a copy no step uses"),
    Mutant("tail-mask-one-past", "templates/helpers.py.j2",
           "inside = lax.broadcasted_iota(jnp.int32, value.shape, axis) < limit",
           "inside = lax.broadcasted_iota(jnp.int32, value.shape, axis) <= limit",
           ("tests/test_kernels.py", "tests/test_condition_sizes.py", "tests/test_shipped_tiles.py", "-k", "not gpu"),
           "a ragged tail keeps one element past the end (NaN in the simulator)"),
    Mutant("ring-key-origin-rows", "templates/ring.py.j2",
           "origin = jnp.stack([qc * lengths[0], kc * lengths[1]]).astype(jnp.int32)",
           "origin = jnp.stack([qc * lengths[0], kc * lengths[0]]).astype(jnp.int32)", T_MESH,
           "a ring's key origin computed from the query chunk's length (equal when S == T)"),
    Mutant("gpu-subtile-offset", "sparsegen/gpu/product.py",
           "return Var(self.var_of[i]) * t.bm + self.sub(\"mi\", t.bm // t.tm) * t.tm",
           "return Var(self.var_of[i]) * t.bm", ("tests/test_condition_boundaries.py", "tests/test_gpu_conditions.py",
                                                   "tests/test_gpu_condition_steps.py"),
           "a GPU condition's rows without their sub-tile offset (right with one sub-tile only)"),
    Mutant("gpu-attention-row-block", "sparsegen/gpu/attention/emit.py",
           'row_block = f"{row_tile} // {rsub}" if rsub != 1 else row_tile', "row_block = row_tile", T_GPU_ATT,
           "a GPU attention CTA's row block taken as its row tile (right with one sub-tile only)"),
    Mutant("paged-negative-page", "templates/tpu/paged.py.j2",
           "bad = reached & ((entries < 0) | (entries >= {{ check.size }}))",
           "bad = reached & (entries >= {{ check.size }})", T_CHECKS,
           "the page-table check misses a reached negative entry (read as page 0)"),
    Mutant("lse-merge-no-max", "templates/helpers.py.j2",
           "    top = jnp.where(jnp.isneginf(top), 0.0, top)\n    total = sum_of(jnp.exp(lse - top))",
           "    top = jnp.zeros_like(top)\n    total = sum_of(jnp.exp(lse - top))", T_MESH + ("tests/test_gpu_decode_split.py",),
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
           "at = jnp.where(inside, ids + shift, groups)", "at = jnp.where(inside, ids, groups)", T_GROUPED + T_MESH,
           "group ids compared without a shard's offset"),
    Mutant("coords-at-limit-accepted", "templates/helpers.py.j2",
           "bad = np.flatnonzero((host < -1) | (host >= limit))", "bad = np.flatnonzero((host < -1) | (host > limit))", T_CHECKS,
           "a coo coordinate equal to the block count accepted (then clamped: a wrong block)"),
    Mutant("size-zero-accepted", "templates/helpers.py.j2",
           "    if value <= 0:", "    if value < 0:", T_CHECKS, "a size of 0 accepted"),
    Mutant("mesh-sum-not-added", "templates/helpers.py.j2",
           "return tuple(lax.psum(o, s) if s else o for o, s in zip(outs, sums))", "return tuple(outs)", T_MESH,
           "an output whose statement sums a split index not added across the mesh axis"),
    Mutant("attention-absent-gradient", "sparsegen/tpu/attention/kernels.py",
           "lines.append(f\"    {nm['draw']} = jnp.where(jnp.isneginf({nm['s']}), 0.0, {nm['draw']})  # absent: no gradient\")",
           "pass", ("tests/test_gradients.py", "tests/test_fused_backward.py", "tests/test_attention_numerics.py"),
           "an absent score's raw gradient not zeroed in the fused backward"),
]

# Planted after the list above was caught in full, by someone who had not read the tests.
FRESH: list[Mutant] = []


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
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *m.tests]
        start = time.perf_counter()
        try:
            done = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", time.perf_counter() - start, ""
        seconds = time.perf_counter() - start
        tail = (done.stdout + done.stderr).strip().splitlines()
        failed = next((line for line in tail if line.startswith("FAILED") or line.startswith("ERROR")), tail[-1] if tail else "")
        if done.returncode == 0:
            return "escaped", seconds, tail[-1] if tail else ""
        if done.returncode in (1, 2, 3):
            return "caught", seconds, failed
        return f"error (exit {done.returncode})", seconds, tail[-1] if tail else ""


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
    print(f"| mutant | file | what it plants | result | seconds | first failure |\n|---|---|---|---|---|---|", flush=True)
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

"""sparsegen's attention kernels side by side with Splash Attention, in one run.

    .venv/bin/python bench/bench_attention.py [--quick] [--json FILE]

1. Classification: the block kinds of causal, local (window 1024), chunked (2048) and
   document masks at S = 32768, blocks of 512 — sparsegen's `block_kinds` plus the walk's
   tables (numpy at trace time for sizes-only conditions; jax.numpy under jit for segment
   ids), against building Splash's MaskInfo (its cache cleared), as ratios.
2. The walk: grid steps, computing steps (block products) and K/V block copies (a copy
   whenever a step's block index differs from the previous step's: the Pallas pipeline
   rule) at H = 8, against Splash's grid, from both sides' tables.
3. Ahead-of-time compiles for v5e and v6e at H = 8, D = 128 (S = 4096; 8192 for the
   window), forward and forward+backward, and the scoped VMEM each compiled kernel uses
   (from the compiled HLO), against Splash at the same block sizes. Each kernel is named by
   what it computes (fwd, dq, dk/dv, or dq+dk/dv for the fused backward walk), told apart by
   its name (Splash) or its outputs in the HLO (sparsegen's backward: one array, two, three).
   `--backward-walk`: the generated module as built (`fused`: its one backward walk while
   S's padded rows fit `_FUSED_MAX_ROWS`), with `_FUSED_MAX_ROWS = 0` set on this script's
   own fresh copy of the module (`two-passes`: the backward it keeps beyond that bound, dq
   then dk/dv; the package is untouched), or `both`, beside one Splash compile.

    .venv/bin/python bench/bench_attention.py --aot-only [--backward-walk fused|two-passes|both]
        [--aot-masks causal,local,document] [--aot-chips v5e,v6e] [--aot-S 1024,2048]

   runs section 3 alone (`--aot-S`: these sequence lengths for every mask instead).
4. On a TPU (none here): wall time of both, forward and forward+backward.

    .venv/bin/python bench/bench_attention.py --cycles [--forward-only] [--cycles-chips v5e,v6e] [--no-bundles]

5. (`--cycles` runs this alone) libtpu's static cycle estimate of the generated kernels, JAX's
   Splash and tokamax's Splash at H = 8, S = 4096 (`--cycles-S`; profiled compiles are slow,
   in proportion to the grid), D = 128, blocks 512, causal, local and document masks: the
   forward, and (unless --forward-only) the backward passes and the forward with residuals a
   training step runs, printed last as forward and forward+backward side by side per mask and
   chip: bench/attention_cycles.py records each side's
   pallas_calls and weights them with sparsegen/tpu/cycles.py's pass_cycles, the
   `verify --cycles` machinery (every `pl.when` region walked as the real tables take it).
   tokamax runs from an interpreter that imports it: this one, else the benchmark-only venv
   `.bench-venv` (`python -m venv .bench-venv && .bench-venv/bin/pip install -e '.[tpu]'
   tokamax`); without either it is printed as unavailable, saying why.
6. The forward kernels' final bundles per `pl.when` region (bench/attention_bundles.py, from
   libtpu's `--xla_jf_dump_to` LLO dumps): bundles, MXU / XLU / VALU slot uses, spill stores
   and fills of one run of each region. Sections 5 and 6 go to bench/results/attention_cycles.json.

Splash's side is bench/splash_side.py. No timed assertion anywhere: this prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import splash_side as splash  # noqa: E402

from sparsegen.compiler import compile_source  # noqa: E402
from sparsegen.source import SourceFile  # noqa: E402

BLOCK = 512
WINDOW, CHUNK = 1024, 2048

CONDITIONS = {
    "causal": "i >= j",
    "local": f"i >= j and i - j < {WINDOW}",
    "chunked": f"i // {CHUNK} == j // {CHUNK} and i >= j",
    "document": "seg[b, i] == seg[b, j] and i >= j",
}


def spec(kind: str, block: int = BLOCK) -> str:
    seg = "\n    in  seg: i32[B, S]" if kind == "document" else ""
    return f"""kernel {kind}_bench {{
    in  q: bf16[B, H, S, D]
    in  k: bf16[B, H, S, D]
    in  v: bf16[B, H, S, D]{seg}
    out o: bf16[B, H, S, D]

    s[b, h, i, j] = q[b, h, i, d] * k[b, h, j, d] * 0.08838834764831845 where {CONDITIONS[kind]}
    o[b, h, i, e] = softmax(s[b, h, i, j], j) * v[b, h, j, e]

    tile b = 1, h = 1, i = {block}, j = {block}, d = 128, e = 128
}}
"""


_modules: dict = {}
WALKS = ("fused", "two-passes")


def module(kind: str, block: int = BLOCK, walk: str = "fused"):
    """The generated module, built from `spec` and imported fresh (its own copy per walk).
    `walk="two-passes"` sets `_FUSED_MAX_ROWS = 0` on that copy only: its backward then takes
    the two passes (dq, then dk/dv) it keeps for S past the bound; "fused" is the module as
    built, which fuses while S's padded rows fit `_FUSED_MAX_ROWS`."""
    key = (kind, block, walk)
    if key not in _modules:
        (m,) = compile_source(SourceFile(f"{kind}.spk", spec(kind, block)))
        path = Path(tempfile.mkdtemp()) / f"{m.kernel}.py"
        path.write_text(m.code)
        imp = importlib.util.spec_from_file_location(m.kernel, path)
        mod = importlib.util.module_from_spec(imp)
        imp.loader.exec_module(mod)
        if walk == "two-passes":
            mod._FUSED_MAX_ROWS = 0  # read when the backward is traced: this copy's backward takes two passes
        elif walk != "fused":
            raise ValueError(f"walk {walk!r}: one of {', '.join(WALKS)}")
        _modules[key] = mod
    return _modules[key]


def structs(kind: str, H: int, S: int, D: int = 128, B: int = 1):
    shapes = [jax.ShapeDtypeStruct((B, H, S, D), jnp.bfloat16)] * 3
    if kind == "document":
        shapes.append(jax.ShapeDtypeStruct((B, S), jnp.int32))
    return shapes


def args_of(kind: str, H: int, S: int, D: int = 128):
    """Zero-size-cost arguments for classification: only shapes (and segment ids) matter."""
    q = np.zeros((1, H, S, D), jnp.bfloat16)
    out = [q, q, q]
    if kind == "document":
        out.append(splash.document_ids(S)[None].astype(np.int32))
    return out


def best(fn, repeats=3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# ------------------------------------------------------------ 1. classification


def ours_setup(kind: str, S: int, H: int = 8):
    """The host (or jit) work before the kernel runs: block kinds and the walk's tables."""
    mod = module(kind)
    args = args_of(kind, H, S)
    if kind == "document":
        seg = jnp.asarray(args[3])

        @jax.jit
        def setup(seg):
            kinds = mod.block_kinds(*args[:3], seg)
            kinds = kinds.reshape((-1,) + kinds.shape[1:])
            return mod._row_walk(jnp, kinds)[0]

        jax.block_until_ready(setup(seg))  # compile once: what a training step pays per call is a run
        return lambda: jax.block_until_ready(setup(seg))

    def setup():
        kinds = mod.block_kinds(*args)
        return mod._row_walk(np, kinds.reshape((-1,) + kinds.shape))

    return setup


def splash_setup(kind: str, S: int, H: int = 8):
    masks = splash.splash_masks(S, BLOCK, kind, H=H)
    return lambda: splash.mask_info(masks.mask, BLOCK, BLOCK)


def classification(S: int, repeats: int) -> list[dict]:
    rows = []
    for kind in CONDITIONS:
        ours = best(ours_setup(kind, S), repeats)
        masks = splash.splash_masks(S, BLOCK, kind)
        theirs = splash.time_mask_info(masks.mask, BLOCK, BLOCK, repeats=max(1, repeats - 1))
        rows.append({"mask": kind, "S": S, "sparsegen_s": ours, "splash_s": theirs, "ratio": theirs / ours})
    return rows


# -------------------------------------------------------------------- 2. walk


def our_walk(kind: str, S: int, H: int = 8) -> dict:
    """Steps, computing steps, partial steps and K/V copies of the grid (1, H, steps): with one
    batch row every head walks the same tables. Segment ids are traced under jit: the grid's
    step axis is then a traced extent, these steps, over tables of the dense count
    (`max_steps` shrinks the tables, not the grid)."""
    mod = module(kind)
    args = args_of(kind, H, S)
    kinds = np.asarray(mod.block_kinds(*args))
    kinds = kinds.reshape((-1,) + kinds.shape[-2:])
    assert kinds.shape[0] == 1  # one batch row: one table group
    (rows, cols, read_rows, step_kinds, flags), steps, _ = mod._row_walk(np, kinds)
    copies = 1 + int((cols[1:] != cols[:-1]).sum())  # per head: a K/V copy when the block index changes
    out = {"grid": f"(1, {H}, {steps})", "steps": H * steps, "computed": H * int((step_kinds != 0).sum()),
           "partial": H * int((step_kinds == 1).sum()), "kv_copies": H * copies}
    if kind == "document":
        out["table_steps"] = H * kinds.shape[1] * kinds.shape[2]  # the tables' length without max_steps
    return out


def walks(S: int) -> list[dict]:
    rows = []
    for kind in CONDITIONS:
        ours = our_walk(kind, S)
        masks = splash.splash_masks(S, BLOCK, kind)
        info = splash.mask_info(masks.mask, BLOCK, BLOCK)
        theirs = splash.splash_grid_steps(info, 8)
        rows.append({"mask": kind, "sparsegen": ours, "splash": {k: theirs[k] for k in ("grid", "steps", "computed", "streamed_copies", "partial")}})
    return rows


# --------------------------------------------------------------------- 3. AOT


def _outputs(hlo: str, name: str) -> int:
    """How many arrays the custom call `name` returns in the compiled HLO (a tuple's members)."""
    head = hlo[hlo.index(f"%{name} = ") + len(name) + 4:]
    if not head.startswith("("):
        return 1
    depth, count = 0, 1
    for ch in head:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0:
            return count
        count += ch == "," and depth == 1
    raise ValueError(f"unbalanced result shape of %{name}")


def _our_kernels(report) -> list[list]:
    """[what, bytes] per generated kernel: the backward's by its outputs (dq; dk, dv; all three)."""
    hlo = report.compiled.as_text()
    what = {1: "dq", 2: "dk/dv", 3: "dq+dk/dv"}
    return [["fwd" if not name.startswith("transpose") else what.get(_outputs(hlo, name), name), v]
            for name, v in report.kernel_vmem.items()]


def _splash_kernels(report) -> list[list]:
    """[what, bytes] per Splash kernel, by name, in the order forward, dq, dk/dv."""
    order = {"fwd": 0, "dq": 1, "dk/dv": 2}
    named = [["fwd" if "_fwd" in n else "dq" if "_dq_" in n else "dk/dv" if "_dkv_" in n else n, v]
             for n, v in report.kernel_vmem.items()]
    return sorted(named, key=lambda kv: order.get(kv[0], 3))


def our_aot(kind: str, S: int, chip: str, backward: bool, walk: str = "fused") -> dict:
    mod = module(kind, walk=walk)
    fn = getattr(mod, f"{kind}_bench")
    shapes = structs(kind, 8, S)

    def forward(*a):
        return fn(*a)

    def both(*a):
        def loss(q, k, v):
            return jnp.sum(fn(q, k, v, *a[3:]).astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(*a[:3])

    report = splash.aot_compile(both if backward else forward, shapes, chip)
    return {"compile_s": report.compile_s, "vmem": report.kernel_vmem, "kernels": _our_kernels(report),
            "fused_max_rows": mod._FUSED_MAX_ROWS}


def splash_aot(kind: str, S: int, chip: str, backward: bool) -> dict:
    fn = splash.splash_kernel(8, S, 128, BLOCK, kind)
    shapes = splash.splash_arg_shapes(8, S, 128, kind)
    report = splash.aot_compile(splash.fwd_bwd(fn) if backward else fn, shapes, chip)
    return {"compile_s": report.compile_s, "vmem": report.kernel_vmem, "kernels": _splash_kernels(report)}


def aot(chips, kinds, walks=("fused",), sizes=None) -> list[dict]:
    """Forward, then forward+backward per walk beside one Splash compile of each; `sizes`: these
    S for every mask, else 4096 (8192 for the window)."""
    rows = []
    for kind in kinds:
        for S in sizes or [8192 if kind == "local" else 4096]:
            for chip in chips:
                for backward in (False, True):
                    theirs = splash_aot(kind, S, chip, backward)
                    for walk in walks if backward else ("fused",):
                        ours = our_aot(kind, S, chip, backward, walk)
                        rows.append({"mask": kind, "S": S, "chip": chip, "backward": backward,
                                     "walk": walk if backward else None, "sparsegen": ours, "splash": theirs,
                                     "max_vmem_ratio": max(ours["vmem"].values()) / max(theirs["vmem"].values())})
    return rows


def print_aot(rows: list[dict]) -> None:
    print("3. Ahead-of-time compiles (scoped VMEM per kernel, MiB; sparsegen's backward as `--backward-walk` says)")
    mib = lambda ks: ", ".join(f"{w} {v / 2**20:.2f}" for w, v in ks)  # noqa: E731
    for r in rows:
        what = f"fwd+bwd {r['walk']:10s}" if r["backward"] else f"{'fwd':18s}"
        print(f"   {r['mask']:9s} S={r['S']:5d} {r['chip']} {what}  sparsegen [{mib(r['sparsegen']['kernels'])}]"
              f"  Splash [{mib(r['splash']['kernels'])}]  max ratio {r['max_vmem_ratio']:.2f}", flush=True)


# ------------------------------------------------------------ 5. static cycle estimates

CYCLE_KINDS = ("causal", "local", "document")


def generated_cycles_via_verify(kinds, S: int, chips, backward: bool, H: int = 8, D: int = 128) -> dict:
    """`sparsegen verify --cycles` on the bench's specs (sparsegen/cycles.py: one helper process,
    every pass's `pl.when` regions weighted by the walk's real tables). The document kernel's
    pattern is Splash's segment ids (splash_side.document_ids), saved as a .npy file."""
    from sparsegen import cycles

    tmp = Path(tempfile.mkdtemp(prefix="bench-attention-"))
    ids = tmp / "document_ids.npy"
    np.save(ids, splash.document_ids(S).astype(np.int32))
    jobs, keys = [], []
    for kind in kinds:
        for chip in chips:
            jobs.append({"spec": f"{kind}.spk", "text": spec(kind), "kernel": f"{kind}_bench", "target": chip,
                         "shapes": {"B": 1, "H": H, "S": S, "D": D}, "pattern": str(ids) if kind == "document" else "tril",
                         "seed": 0, "backward": backward})
            keys.append((kind, chip))
    start = time.perf_counter()
    out = {}
    for key, k in zip(keys, cycles.measure(jobs)):
        j = k.to_json()
        out[key] = {"forward_cycles": j["forward"]["estimated_cycles"],
                    "backward_cycles": (j["backward"] or {}).get("estimated_cycles") if backward else None,
                    "forward": j["forward"]["passes"], "backward": (j["backward"] or {}).get("passes", []), "error": j["error"]}
        print(f"   cycles {'sparsegen':8s} {key[0]:9s} {key[1]} {'fwd+bwd' if backward else 'fwd'}: "
              f"{out[key]['forward_cycles'] or out[key]['error']} / {out[key]['backward_cycles']}", flush=True)
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def _earlier_cases(paths: list[str], base: dict, tokamax_variant: str) -> dict:
    """Splash's and tokamax's figures per (mask, chip) from earlier runs of section 5, checked
    to be for these shapes, this tokamax variant and this jax."""
    import jax

    out = {}
    for path in paths:
        run = json.loads(Path(path).read_text())
        if run.get("jax") != jax.__version__ or run.get("tokamax_variant") != tokamax_variant:
            raise SystemExit(f"{path}: jax {run.get('jax')}, tokamax variant {run.get('tokamax_variant')}: not this run's")
        for case in run["cases"]:
            # A forward-only run takes the forward figures of a run with the backward too.
            if all(case.get(k) == v for k, v in base.items() if k != "backward") and (case.get("backward") or not base["backward"]):
                if not base["backward"]:
                    case = {**case, "backward": False, **{side: {k: v for k, v in case[side].items() if not k.startswith(("backward", "training"))}
                                                          for side in ("splash", "tokamax") if isinstance(case.get(side), dict)}}
                out[(case["mask"], case["chip"])] = case
        out["python"], out["why"] = run.get("tokamax_python"), run.get("tokamax_unavailable")
    return out


def _steps(passes: list[dict]) -> dict:
    """Grid steps and steps that run a block product, summed over passes."""
    return {"steps": sum(p.get("steps") or 0 for p in passes), "computing": sum(p.get("computing_steps") or 0 for p in passes)}


def static_cycles(kinds, S: int, chips, backward: bool, tokamax_variant: str, H: int = 8, D: int = 128,
                  reuse: list[str] = ()) -> dict:
    """libtpu's static estimate of the three sides, weighted alike (bench/attention_cycles.py:
    sparsegen/tpu/cycles.py's pass_cycles on each recorded pallas_call; for the generated kernels
    the same figures as `sparsegen verify --cycles`, whose job this is, with Splash's document ids
    as the pattern). A pass libtpu's profiler aborts on is tried again with its partial block
    steps counted as full ones (marked), else reported as not estimated. `reuse`: earlier
    runs' JSON files (this script's, the same jax and libtpu): Splash's and tokamax's figures
    are taken from them (their kernels have not changed), only sparsegen's are measured."""
    import attention_cycles as ac

    start = time.perf_counter()
    base = {"H": H, "S": S, "D": D, "block": BLOCK, "backward": backward}
    n = len(kinds) * len(chips)
    python, why = ac.tokamax_python()
    tk_jobs = [{"impl": "tokamax", "kind": k, "chip": c, "variant": tokamax_variant, **base} for k in kinds for c in chips]
    if reuse:
        earlier = _earlier_cases(reuse, base, tokamax_variant)
        ours = ac.run_jobs([{"impl": "sparsegen", "kind": k, "chip": c, **base} for k in kinds for c in chips],
                           log=lambda m: print(m, flush=True))
        theirs = [earlier[(k, c)]["splash"] for k in kinds for c in chips]
        tk = [earlier[(k, c)]["tokamax"] for k in kinds for c in chips]
    else:
        here = [{"impl": i, "kind": k, "chip": c, **base} for i in ("sparsegen", "splash") for k in kinds for c in chips]
        found = ac.run_jobs(here, log=lambda m: print(m, flush=True))
        ours, theirs = found[:n], found[n:]
    if reuse:
        python, why = earlier["python"], earlier["why"]
    elif python is None:
        print(f"   tokamax: unavailable: {why}", flush=True)
        tk = [{"unavailable": why}] * len(tk_jobs)
    else:
        tk = ac.run_jobs(tk_jobs, python=python, log=lambda m: print(m, flush=True))
    ours = {(k, c): r for (k, c), r in zip(((k, c) for k in kinds for c in chips), ours)}
    cases = []
    for n, (kind, chip) in enumerate((k, c) for k in kinds for c in chips):
        row = {"mask": kind, "chip": chip, **base, "sparsegen": ours[(kind, chip)], "splash": theirs[n], "tokamax": tk[n]}
        for side in ("sparsegen", "splash", "tokamax"):
            r = row[side]
            if r.get("forward"):
                r["forward_steps"] = _steps(r["forward"])
            if r.get("backward"):
                r["backward_steps"] = _steps(r["backward"])
        for side in ("sparsegen", "splash", "tokamax"):
            r = row[side]
            fwd = r.get("forward_residuals_cycles") or r.get("forward_cycles")
            r["training_cycles"] = fwd + r["backward_cycles"] if fwd and r.get("backward_cycles") else None
        for against in ("splash", "tokamax"):
            for d in ("forward", "backward", "training"):
                a, b = row["sparsegen"].get(f"{d}_cycles"), row[against].get(f"{d}_cycles")
                row[f"{d}_ratio_{against}"] = round(a / b, 3) if a and b else None
        cases.append(row)
    return {"cases": cases, "tokamax_variant": tokamax_variant, "tokamax_python": python, "tokamax_unavailable": why,
            "splash_tokamax_from": list(reuse) or "this run", "seconds": round(time.perf_counter() - start, 1)}


def bundles(kinds, S: int, chip: str, tokamax_variant: str, H: int = 8, D: int = 128) -> list[dict]:
    """Each side's forward kernel as final bundles, per `pl.when` region (bench/attention_bundles.py):
    bundle count and slot uses (MXU, XLU, VALU, EUP, spill stores and fills) of one run of the region."""
    import attention_bundles as ab
    import attention_cycles as ac

    base = {"H": H, "S": S, "D": D, "block": BLOCK, "chip": chip}
    jobs = [{"impl": i, "kind": k, **base} for k in kinds for i in ("sparsegen", "splash")]
    found = ab.run(jobs)
    python, _ = ac.tokamax_python()
    if python is not None:
        tk_jobs = [{"impl": "tokamax", "kind": k, "variant": tokamax_variant, **base} for k in kinds]
        jobs, found = jobs + tk_jobs, found + ab.run(tk_jobs, python=python)
    return [{**j, **r} for j, r in zip(jobs, found)]


def print_bundles(rows: list[dict]) -> None:
    print("6. Final bundles of the forward kernels, per region (one run): bundles, XLU / VALU / MXU slot uses, spill stores / fills")
    for r in rows:
        if r.get("error"):
            print(f"   {r['impl']:9s} {r['kind']:9s} {r['error']}")
            continue
        regs = "  ".join(f"{g['name']} {g['bundles']} ({g['XLU']}/{g['VALU']}/{g['MXU']}, {g['VSTORE:SPILL']}/{g['VLOAD:FILL']})"
                         for g in r["kernel_regions"])
        print(f"   {r['impl']:9s} {r['kind']:9s} {r['chip']} total {r['bundles']:5d}: {regs}")


def print_side_by_side(c: dict) -> None:
    """One line per mask and chip: each side's forward and forward+backward (a training step:
    the forward with residuals where that is another kernel, plus the backward kernels)."""
    sides = ("sparsegen", "splash", "tokamax")

    def fmt(r, d):
        v = r.get(f"{d}_cycles")
        return f"{v:>10,}" if v else f"{'-':>10}"

    def ratio(r, d, a):
        v = r.get(f"{d}_ratio_{a}")
        return f"{v:5.2f}" if v else f"{'-':>5}"

    print(f"   side by side, cycles: forward [{' / '.join(sides)}]   forward+backward [{' / '.join(sides)}]"
          "   sparsegen / Splash, / tokamax: fwd, fwd+bwd")
    for r in c["cases"]:
        fwd = " ".join(fmt(r[s], "forward") for s in sides)
        both = " ".join(fmt(r[s], "training") for s in sides)
        ratios = "  ".join(f"{ratio(r, 'forward', a)} {ratio(r, 'training', a)}" for a in sides[1:])
        print(f"   {r['mask']:9s} {r['chip']}  {fwd}   {both}   {ratios}")


def print_cycles(c: dict) -> None:
    print(f"5. libtpu's static cycle estimate, H = {c['cases'][0]['H']}, S = {c['cases'][0]['S']}, blocks {BLOCK} "
          f"(regions weighted by the real tables; tokamax: {c['tokamax_variant'] or 'defaults'})")
    if c["tokamax_unavailable"]:
        print(f"   tokamax unavailable: {c['tokamax_unavailable']}")

    def fmt(r, d):
        v = r.get(f"{d}_cycles")
        return f"{v:>10,}" if v else f"{'-':>10}"

    for r in c["cases"]:
        for d in ("forward", "backward", "training") if r["backward"] else ("forward",):
            ratios = "  ".join(f"/{a} {r[f'{d}_ratio_{a}']:.2f}" for a in ("splash", "tokamax") if r.get(f"{d}_ratio_{a}"))
            errs = "; ".join(f"{s}: {r[s].get('error') or r[s].get('unavailable')}" for s in ("sparsegen", "splash", "tokamax")
                             if r[s].get("error") or (r[s].get("unavailable") and d == "forward"))
            print(f"   {r['mask']:9s} {r['chip']} {d[:3]}  sparsegen {fmt(r['sparsegen'], d)}  Splash {fmt(r['splash'], d)}"
                  f"  tokamax {fmt(r['tokamax'], d)}  {ratios}{'  (' + errs + ')' if errs else ''}")
    if c["cases"] and c["cases"][0]["backward"]:
        print_side_by_side(c)


# ------------------------------------------------------------------ 4. on a TPU


def timings() -> list[dict] | None:
    if not splash.tpu_present():
        return None
    rows = []
    for kind in CONDITIONS:
        S = 8192
        mod = module(kind)
        fn = getattr(mod, f"{kind}_bench")
        args = [jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, S, 128)), jnp.bfloat16) for _ in range(3)]
        if kind == "document":
            args.append(jnp.asarray(splash.document_ids(S)[None]))
        ours = splash.splash_time(fn, args)
        sfn = splash.splash_kernel(8, S, 128, BLOCK, kind)
        theirs = splash.splash_time(sfn, splash.splash_inputs(8, S, 128, kind))
        rows.append({"mask": kind, "S": S, "sparsegen_s": ours, "splash_s": theirs, "speedup": theirs / ours})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="S = 8192 for classification, fewer compiles")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--cycles", action="store_true", help="only section 5: static cycle estimates (slow: profiled compiles)")
    parser.add_argument("--cycles-chips", default="v5e", help="chips for section 5 (comma-separated: v5e,v6e)")
    parser.add_argument("--cycles-masks", default=",".join(CYCLE_KINDS))
    parser.add_argument("--cycles-S", type=int, default=4096)
    parser.add_argument("--forward-only", action="store_true",
                        help="section 5 without the backward passes (by default: forward and forward+backward side by side)")
    parser.add_argument("--no-bundles", action="store_true", help="section 5 without section 6 (the forward kernels' bundles)")
    parser.add_argument("--tokamax-variant", default="prescaled",
                        help="tokamax config changes ('+'-joined; bench/attention_cycles.py TOKAMAX_VARIANTS; '' for none)")
    parser.add_argument("--cycles-reuse", metavar="FILES", default="",
                        help="section 5: Splash's and tokamax's figures from earlier runs' JSON (comma-separated); only sparsegen is measured")
    parser.add_argument("--cycles-json", metavar="FILE", default=str(ROOT / "bench" / "results" / "attention_cycles.json"))
    parser.add_argument("--aot-only", action="store_true", help="only section 3: AOT compiles, scoped VMEM per kernel")
    parser.add_argument("--backward-walk", choices=(*WALKS, "both"), default="fused",
                        help="section 3: the generated backward as built (fused while S fits _FUSED_MAX_ROWS), "
                             "its two passes (_FUSED_MAX_ROWS = 0 on this script's copy of the module), or both")
    parser.add_argument("--aot-masks", default="", help="section 3's masks (comma-separated; default causal,local,document, "
                                                        "--quick causal,local)")
    parser.add_argument("--aot-chips", default="", help="section 3's chips (default v5e,v6e, --quick v5e)")
    parser.add_argument("--aot-S", default="", help="section 3 at these S for every mask (comma-separated; "
                                                    "default 4096, 8192 for the window)")
    a = parser.parse_args()
    aot_chips = a.aot_chips.split(",") if a.aot_chips else ["v5e"] if a.quick else ["v5e", "v6e"]
    aot_kinds = a.aot_masks.split(",") if a.aot_masks else ["causal", "local"] if a.quick else ["causal", "local", "document"]
    unknown = [k for k in aot_kinds if k not in CONDITIONS]
    if unknown:
        parser.error(f"--aot-masks: {', '.join(unknown)}: not one of {', '.join(CONDITIONS)}")
    try:
        aot_sizes = [int(x) for x in a.aot_S.split(",")] if a.aot_S else None
    except ValueError:
        parser.error(f"--aot-S {a.aot_S!r}: comma-separated integers")
    aot_walks = WALKS if a.backward_walk == "both" else (a.backward_walk,)
    if a.aot_only:
        rows = aot(aot_chips, aot_kinds, aot_walks, aot_sizes)
        print_aot(rows)
        if a.json:
            Path(a.json).write_text(json.dumps({"aot": rows}, indent=1, default=str))
        return 0
    if a.cycles:
        c = static_cycles(a.cycles_masks.split(","), a.cycles_S, a.cycles_chips.split(","), not a.forward_only, a.tokamax_variant,
                          reuse=[x for x in a.cycles_reuse.split(",") if x])
        print_cycles(c)
        if not a.no_bundles:
            c["bundles"] = bundles(a.cycles_masks.split(","), a.cycles_S, a.cycles_chips.split(",")[0], a.tokamax_variant)
            print_bundles(c["bundles"])
        c["jax"] = jax.__version__
        Path(a.cycles_json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.cycles_json).write_text(json.dumps(c, indent=1, default=str) + "\n")
        print(f"written {a.cycles_json} ({c['seconds']} s)")
        return 0
    S = 8192 if a.quick else 32768
    result = {"classification": classification(S, 2 if a.quick else 3), "walk": walks(S),
              "aot": aot(aot_chips, aot_kinds, aot_walks, aot_sizes), "tpu": timings()}
    print(f"1. Classification at S = {S}, blocks of {BLOCK} (sparsegen: kinds + walk tables; Splash: MaskInfo)")
    for r in result["classification"]:
        print(f"   {r['mask']:9s} sparsegen {r['sparsegen_s'] * 1e3:8.2f} ms   Splash {r['splash_s']:7.2f} s   ratio {r['ratio']:8.0f}x")
    print(f"2. The walk at H = 8, S = {S}")
    for r in result["walk"]:
        o, t = r["sparsegen"], r["splash"]
        note = f"  (a traced grid extent; tables of {o['table_steps']} steps)" if "table_steps" in o else ""
        print(f"   {r['mask']:9s} steps {o['steps']:6d} vs {t['steps']:6d}   computed {o['computed']:6d} vs {t['computed']:6d}"
              f"   K/V copies {o['kv_copies']:6d} vs {t['streamed_copies']:6d}{note}")
    print_aot(result["aot"])
    print("4. On a TPU: " + ("no TPU on this machine (run this script on one)" if result["tpu"] is None else ""))
    for r in result["tpu"] or []:
        print(f"   {r['mask']:9s} sparsegen {r['sparsegen_s'] * 1e3:.3f} ms  Splash {r['splash_s'] * 1e3:.3f} ms  speedup {r['speedup']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""sparsegen's paged decode (specs/paged_decode.spk) side by side with JAX's `paged_attention`
(jax.experimental.pallas.ops.tpu.paged_attention), in one run, with no TPU:

    python -m bench.bench_paged_decode [--quick] [--no-aot] [--no-probe] [--no-cycles] [--chips v5e,v6e]
                                       [--variants] [--json FILE]

Shapes (issue 19): B = 64 sequences, H = 32 query heads, G = 4 key/value heads (the spec
reads kc[h // 8, ...]: 8 query heads per kv head, so G = H / 8; the issue's text says G = 8,
which the spec's `h // 8` does not allow at H = 32), D = 128, bf16, NP = 2048 pages per
sequence, pages of T = 16 and 64 tokens, P = B * ceil(8192 / T) + 1 cache pages, lengths
uniform in [1, 8192] (seeded), page tables random without repeats over the pages a sequence
can reach (entries past ceil(8192 / T) random, never read). Key blocks of 512 tokens on both
sides (the spec's tile j = 512; paged_attention's pages_per_compute_block = 512 / T).
paged_attention runs as its default (inline_seq_dim=True, a loop over key blocks inside a
grid step (1, B, G)), megacore_mode=None (v5e and v6e have one TensorCore a chip);
"paged_attention grid" is inline_seq_dim=False (grid (1, B, G, NP / ppb), the key blocks a
grid axis, steps past the length skipped by pl.when).

1. HBM bytes, from each side's own tables on the concrete lengths: sparsegen, pages copied
   per (b, row block) = end - first of the generated module's `_page_bounds(_classify_pages)`
   (the kernel issues one DMA per page inside [first, end), for kc and vc), times T*D*2 bytes;
   paged_attention, whole compute blocks: ceil(len / (ppb*T)) * ppb pages per (b, kv head).
   Ideal: only the pages below each length, once per kv head group: sum_b ceil(len_b / T)
   * G pages. All three add q and o (paged_attention also writes its m and l outputs, B*H*4
   bytes each); the page table both prefetch into SMEM (B*NP*4 bytes) is listed apart.
2. Ahead-of-time compiles for v5e and v6e (get_topology_desc; no execution): compile time,
   scoped VMEM of the Mosaic kernel from the compiled HLO (used_scoped_memory_configs,
   bench/splash_side.py's kernel_vmem), and a probe: sparsegen's `verify` (the smallest
   vmem_limit_bytes the kernel compiles with) for ours, splash_side.probe_vmem (the smallest
   xla_tpu_scoped_vmem_limit_kib) for paged_attention.
3. libtpu's static cycle estimate (--xla_jf_dump_static_llo_profile_to, in a helper
   process: libtpu reads the flag when it loads). The estimator reads scalar-prefetch (SMEM)
   values as 0 and does not evaluate a dynamic loop trip count (tried: bounds computed from
   program_id give 0 iterations as well), so both kernels' key-block loops (ours: between
   the page bounds; paged_attention: up to the length) count 0 iterations as compiled.
   What is measured instead: each kernel compiled with its loop's trip count a constant N,
   everything else as generated, at a small grid (B = 4, and B = 8 once to separate the
   kernel's fixed cost):
     - ours: a scratch copy of the generated module's text where `first, last` (the key
       blocks of the loop) are the constants 0, N and the page bounds `lo, hi` are
       min(b, 0) and min(b, 0) + N * 512 / T (still values the compiler does not know, so
       each page's `pl.when` guard is compiled as generated; the estimator evaluates them
       from program_id: every page copied);
     - paged_attention: its kernel with `lengths_ref` reading N * 512 everywhere (the loop
       bound, the mask, the next-block logic); the page table is still read as zeros (DMA
       addresses do not change the estimate).
   Only the Mosaic kernel's own estimate is kept (the custom call's estimated_cycles).
   total(B, N) = fixed + B * G * per_row(N); fixed from B = 4 vs 8 at N = 3. per_row(N) is
   linear from N = 3 on (per key block = slope, per (b, head group) = intercept; the fit's
   largest residual is printed); N = 1 and 2 are measured too: N = 2 falls within 100
   cycles of the line, N = 1 does not for ours (600 to 1300 cycles a row above it;
   presumably a loop of one iteration known at compile time is compiled differently, and
   the real loop's trip count is dynamic), so the real-length estimate applies the line to
   every N: fixed + sum over (b, head group) of (intercept + slope * key blocks), key
   blocks = ceil(len_b / 512) on both sides (ours: from its page bounds);
   `estimated_cycles_small_n_measured` takes the measured rows for N = 1 and 2 instead
   (the difference is a fraction of a percent here). Also given: HBM cycles of
   the bytes in 1. (bytes / HBM bandwidth x clock): the estimator's DMA model is
   optimistic, so where they exceed the estimate the kernel is memory-bound there.
   A negative intercept is no negative overhead: the slope is the cost of a block that
   also issues the next block's copies, and the last block of a row issues none.
   Also, for ours, the estimate of the XLA ops around the kernel (_classify_pages and
   _page_bounds over (B, H/8, NP), the table clip), from the whole program compiled at
   B = 4 and 8 and extended to B = 64 on that line (at B = 64 libtpu's static profiler
   aborts: "Unsupported DMA direction: 10 on VL/VLP"). paged_attention has no op of its
   own around its kernel at these shapes (q is bf16 and 8 heads a group: no reshape, no
   cast); its whole program is not profiled (the same abort, at any B: its unused m and l
   outputs are then placed in VMEM).

--variants adds, to 3., two scratch variants of the generated kernel (not sparsegen's output;
see _variant_text): its page copies without their per-page pl.when, and with one wait per
block and operand; they say where ours' per-key-block cycles go at T = 16
(bench/results/paged_decode_variants.json; run with --no-aot --chips v5e).

No timed assertion anywhere: this prints tables and writes bench/results/paged_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention  # noqa: E402

SPEC = ROOT / "specs" / "paged_decode.spk"
B, H, G, D, NP = 64, 32, 4, 128, 2048
MAX_LEN = 8192
KEY_BLOCK = 512  # the spec's tile j; paged_attention's pages_per_compute_block * T
PAGE_SIZES = (16, 64)
SEED = 0
BF16 = jnp.bfloat16
IMPLS = ("sparsegen", "paged_attention", "paged_attention_grid")
CYCLE_NS = (1, 2, 3, 4, 8, 16)  # key blocks per row block, compiled as constants
CYCLE_B = 4  # the cycle compiles' batch (grid B x G row blocks)
LINE_FROM = 3  # per_row(N) is fitted on N >= this


def n_cache_pages(T: int) -> int:
    return B * -(-MAX_LEN // T) + 1


def lengths(seed: int = SEED) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, MAX_LEN + 1, size=B).astype(np.int32)


def page_table(T: int, seed: int = SEED) -> np.ndarray:
    """int32[B, NP]: the first ceil(8192 / T) entries of each row distinct pages (no page
    shared), the rest random (never read: past every length)."""
    rng = np.random.default_rng(seed + T)
    need, P = -(-MAX_LEN // T), n_cache_pages(T)
    table = rng.integers(0, P, size=(B, NP)).astype(np.int32)
    table[:, :need] = rng.permutation(P)[: B * need].reshape(B, need)
    return table


# ------------------------------------------------------------------ the generated module


_MODULES: dict[str, object] = {}


def generated_text(chip: str) -> tuple[object, object, str]:
    """The spec lowered for `chip`: (plan, source, module text), as `sparsegen build` writes it."""
    from sparsegen.backends import emit_module
    from sparsegen.compiler import lower_source
    from sparsegen.source import SourceFile

    source = SourceFile.read(str(SPEC))
    (plan,) = [p for p in lower_source(source, chip) if p.name == "paged_decode"]
    return plan, source, emit_module(plan, source.name)


def generated(chip: str):
    if chip not in _MODULES:
        from sparsegen.shapes import _load

        _MODULES[chip] = _load(generated_text(chip)[2], f"paged_decode_{chip}")
    return _MODULES[chip]


# ------------------------------------------------------------------ 1. HBM bytes


def hbm_bytes(T: int, lens: np.ndarray) -> dict:
    gen = generated("v5e")
    P = n_cache_pages(T)
    sizes = (B, H, D, G, P, T, NP)
    kinds = np.asarray(gen._classify_pages(np, lens, sizes))
    first, end = (np.asarray(x) for x in gen._page_bounds(kinds))  # (B, H/8) each
    page = T * D * 2  # one page of one operand, bf16
    q_o = 2 * B * H * D * 2
    table = B * NP * 4
    need = -(-lens.astype(np.int64) // T)  # pages below each length
    ppb = KEY_BLOCK // T
    # ours: the loop's key blocks, and the pages copied inside them (those in [first, end))
    copied = (end - first).astype(np.int64)  # per (b, row block)
    blocks = -(-end // ppb) - first // ppb
    past = np.maximum(end - need[:, None], 0)
    ours_kv = int(copied.sum()) * page * 2
    ideal_kv = int(need.sum()) * G * page * 2
    # paged_attention: whole compute blocks per (b, kv head)
    pa_blocks = -(-lens.astype(np.int64) // (ppb * T))
    pa_pages = pa_blocks * ppb
    pa_kv = int(pa_pages.sum()) * G * page * 2
    m_l = 2 * B * H * 4
    out = {
        "T": T, "P": P, "pages_per_key_block": ppb, "page_bytes": page, "q_and_o_bytes": q_o,
        "page_table_smem_bytes": table, "bounds_smem_bytes": 2 * first.size * 4,
        "ideal": {"pages": int(need.sum()) * G, "bytes": ideal_kv + q_o},
        "sparsegen": {"pages": int(copied.sum()), "bytes": ours_kv + q_o, "key_blocks": int(blocks.sum()),
                      "pages_past_length": int(past.sum()), "first_page_min": int(first.min()),
                      "bounds_equal_ceil_len_over_T": bool((first == 0).all() and (end == need[:, None]).all())},
        "paged_attention": {"pages": int(pa_pages.sum()) * G, "bytes": pa_kv + q_o + m_l, "key_blocks": int(pa_blocks.sum()) * G,
                            "pages_past_length": int((pa_pages - need).sum()) * G, "m_l_bytes": m_l},
    }
    for impl in ("sparsegen", "paged_attention"):
        out[impl]["ratio_to_ideal"] = round(out[impl]["bytes"] / out["ideal"]["bytes"], 5)
        out[impl]["within_5_percent"] = out[impl]["bytes"] <= 1.05 * out["ideal"]["bytes"]
    # key blocks per (b, head group), the same count on both sides (cycles, section 3)
    out["key_blocks_per_row"] = blocks[:, 0].tolist()
    assert (blocks == pa_blocks[:, None]).all(), "the two walks' key-block counts differ"
    return out


# ------------------------------------------------------------------ 2. AOT


def _device(chip: str):
    from sparsegen.tpu.targets import TARGETS
    from sparsegen.tpu.verify import _device as device

    return device(TARGETS[chip].topology)


def structs(T: int, device, batch: int = B):
    from jax.sharding import SingleDeviceSharding

    sh = SingleDeviceSharding(device)
    P = n_cache_pages(T)
    s = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)  # noqa: E731
    return [s((batch, H, D), BF16), s((G, P, T, D), BF16), s((G, P, T, D), BF16), s((batch, NP), jnp.int32), s((batch,), jnp.int32)]


def program(impl: str, chip: str, T: int):
    """(q, kc, vc, pages, lens) -> o for one side."""
    if impl == "sparsegen":
        gen = generated(chip)
        return lambda q, kc, vc, pages, lens: gen.paged_decode(q, kc, vc, pages, lens)
    inline = impl == "paged_attention"
    return lambda q, kc, vc, pages, lens: paged_attention(q, kc, vc, lens, pages, pages_per_compute_block=KEY_BLOCK // T,
                                                          megacore_mode=None, inline_seq_dim=inline)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def aot(chip: str, T: int, probe: bool) -> dict:
    import splash_side as splash

    device = _device(chip)
    row = {"chip": chip, "T": T}
    for impl in IMPLS:
        r: dict = {}
        try:
            with jax.default_device(device):
                lowered = jax.jit(program(impl, chip, T)).trace(*structs(T, device)).lower()
                t0 = time.perf_counter()
                compiled = lowered.compile()
                r["compile_s"] = round(time.perf_counter() - t0, 2)
                r["compiled"] = True
                r["kernel_vmem"] = splash.kernel_vmem(compiled.as_text())
                mem = compiled.memory_analysis()
                r["hbm_temp_bytes"] = mem.temp_size_in_bytes
                if probe and impl != "sparsegen":
                    t0 = time.perf_counter()
                    r["probe_scoped_vmem"], _ = splash.probe_vmem(lowered, start_kib=256, tolerance_kib=4)
                    r["probe_s"] = round(time.perf_counter() - t0, 1)
        except Exception as exc:  # reported; the others still run
            r = {"compiled": False, "error": _first_line(exc)}
        if impl == "sparsegen" and probe and r.get("compiled"):
            r.update(verify_probe(chip, T))
        row[impl] = r
        print(f"   {chip} T={T:2d} {impl:21s} {'compiled' if r.get('compiled') else r.get('error')} "
              f"{r.get('compile_s', '')} s  VMEM {r.get('kernel_vmem')} probe {r.get('probe_scoped_vmem')}", flush=True)
    return row


def verify_probe(chip: str, T: int) -> dict:
    """sparsegen verify on the spec at these sizes: compiles, the VMEM probe, SMEM."""
    from sparsegen.backends import emit_module
    from sparsegen.tpu.verify import verify_plan

    plan, source, _ = generated_text(chip)
    t0 = time.perf_counter()
    res = verify_plan(plan, source, chip, {"B": B, "H": H, "D": D, "G": G, "P": n_cache_pages(T), "T": T, "NP": NP}, emit=emit_module)
    return {"probe_scoped_vmem": res.vmem_used, "vmem_estimate": res.vmem_estimate, "smem_used": res.smem_used,
            "verify_compiled": res.compiled, "verify_error": res.raw_error and res.raw_error.splitlines()[0][:300],
            "probe_s": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------ 3. cycles (helper process)


class _Const:
    """A scalar-prefetch ref whose every read is `value` (a Python int: a compile-time constant)."""

    def __init__(self, value):
        self.value = value

    def __getitem__(self, index):
        return self.value


def _constant_blocks_text(text: str, n: int) -> str:
    """The generated module with the key-block loop running blocks 0 .. n-1 (constants) and
    the page bounds min(b, 0) .. min(b, 0) + n * 512 / T (unknown to the compiler, so that
    each page's guard is compiled as generated; the estimator evaluates them)."""
    bounds = "lo, hi = first_page[at], end_page[at]"
    loop = "return lo, hi, lo // per_block, (hi + per_block - 1) // per_block"
    chained = "chained=not pieces"
    if bounds not in text or loop not in text or chained not in text:
        raise RuntimeError("the generated kernel's page bounds or loop bounds are not where this benchmark looks for them")
    text = text.replace(bounds, f"lo, hi = jnp.minimum(b, 0), jnp.minimum(b, 0) + {n} * (512 // T)")
    # The estimator reads scalar memory as 0, so it cannot follow the chained steps' state
    # (each step would both start its own first block and find it started): the figure is
    # the unchained kernel's, each step's first block exposed; chaining hides that on a TPU.
    text = text.replace(chained, "chained=False")
    return text.replace(loop, f"return lo, hi, 0, {n}")


VARIANTS = ("sparsegen+noguard", "sparsegen+onewait")


def _variant_text(text: str, variant: str) -> str:
    """Scratch variants of the generated kernel (--variants; a diagnosis, not sparsegen's
    output): "noguard", each page's copy and wait without its pl.when (what a key block
    wholly inside the page bounds could do); "onewait", noguard and one wait per operand for
    the whole slot (a descriptor over kc_pages.at[slot]), as paged_attention waits."""
    guard = "            @pl.when((page >= lo) & (page < hi))\n            def _copy():\n"
    wait = "        _pages(block, slot, False)  # this block's pages have arrived\n"
    if guard not in text or wait not in text:
        raise RuntimeError("the generated kernel's page copies are not where this benchmark looks for them")
    text = text.replace(guard, "            if True:  # bench variant: no guard\n")
    if variant.endswith("onewait"):
        text = text.replace(wait, "        pltpu.make_async_copy(kc_pages.at[slot], kc_pages.at[slot], kc_copies.at[slot]).wait()\n"
                                  "        pltpu.make_async_copy(vc_pages.at[slot], vc_pages.at[slot], vc_copies.at[slot]).wait()\n")
    return text


def _capture(fn, args, device):
    """The pallas_call `fn` makes when traced: (kernel, keywords, argument structs)."""
    calls = []
    real = pl.pallas_call

    def recorded(kernel, **kwargs):
        def run(*a):
            calls.append((kernel, kwargs, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_sharding(device)), a)))
            return real(kernel, **kwargs)(*a)

        return run

    pl.pallas_call = recorded
    try:
        with jax.default_device(device):
            jax.jit(fn).trace(*args)
    finally:
        pl.pallas_call = real
    (call,) = calls
    return call


def _sharding(device):
    from jax.sharding import SingleDeviceSharding

    return SingleDeviceSharding(device)


_CUSTOM = re.compile(r'custom_call_target="tpu_custom_call"')
_CYCLES = re.compile(r'estimated_cycles\\*"?\s*[:=]\s*\\*"?(\d+)')


def kernel_cycles(hlo_text: str) -> tuple[int, int]:
    """(the Mosaic kernels' estimate, the whole program's): estimated_cycles of the custom
    call lines, and of every line."""
    from sparsegen.tpu.cycles import NoProfile

    kernel = total = 0
    found = False
    for line in hlo_text.splitlines():
        c = sum(int(x) for x in _CYCLES.findall(line))
        if c or "estimated_cycles" in line:
            found = True
        total += c
        if _CUSTOM.search(line):
            kernel += c
    if not found:
        raise NoProfile("libtpu wrote no estimated_cycles: this libtpu may not know the flag")
    return kernel, total


def _estimate(call, device, subs: dict[int, int]) -> tuple[int, int]:
    kernel, kwargs, args = call

    def fresh(*refs):  # a new function each compile: Pallas caches kernel traces by function
        refs = list(refs)
        for i, v in subs.items():
            refs[i] = _Const(v)
        return kernel(*refs)

    with jax.default_device(device):
        compiled = jax.jit(lambda *a: pl.pallas_call(fresh, **kwargs)(*a)).trace(*args).lower().compile()
    return kernel_cycles(compiled.as_text())


_CALLS: dict[tuple, tuple] = {}


def cycle_job(job: dict) -> dict:
    from sparsegen.shapes import _load

    chip, T, impl = job["chip"], job["T"], job["impl"]
    device = _device(chip)
    if job["kind"] == "program":  # the real program: the ops around the kernel (at B = 4 and 8; see cycle_model)
        with jax.default_device(device):
            compiled = jax.jit(program(impl, chip, T)).trace(*structs(T, device, job["B"])).lower().compile()
        kernel, total = kernel_cycles(compiled.as_text())
        return {"kernel_as_compiled": kernel, "outside_kernel": total - kernel}
    n, batch = job["N"], job["B"]
    args = structs(T, device, batch)
    if impl.startswith("sparsegen"):
        text = _constant_blocks_text(generated_text(chip)[2], n)
        if impl != "sparsegen":
            text = _variant_text(text, impl)
        mod = _load(text, f"paged_decode_n{n}")
        call = _capture(lambda q, kc, vc, pages, lens: mod.paged_decode(q, kc, vc, pages, lens), args, device)
        subs = {}
    else:
        key = (impl, chip, T, batch)
        if key not in _CALLS:  # paged_attention is jitted: traced once per shape, captured once
            _CALLS[key] = _capture(program(impl, chip, T), args, device)
        call = _CALLS[key]
        subs = {0: n * KEY_BLOCK}  # lengths_ref: every read gives N key blocks' worth of tokens
    kernel, total = _estimate(call, device, subs)
    return {"cycles": kernel, "program_cycles": total, "grid": [int(g) for g in call[1]["grid_spec"].grid]}


def worker(request: str) -> None:
    from sparsegen.tpu.cycles import NoProfile

    for job in json.loads(Path(request).read_text()):
        print(json.dumps({"starting": job}), flush=True)
        t0 = time.perf_counter()
        try:
            out = cycle_job(job)
        except NoProfile as exc:
            print(json.dumps({"job": job, "no_profile": str(exc)}), flush=True)
            return
        except Exception as exc:
            out = {"error": _first_line(exc)}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({"job": job, "result": out}), flush=True)


def run_jobs(jobs: list[dict], timeout: float) -> list[dict]:
    """The helper process over `jobs`, restarted past a job libtpu aborts on; a result per job."""
    from sparsegen.tpu.cycles import FLAG

    results: dict[int, dict] = {}
    todo = list(range(len(jobs)))
    deadline = time.monotonic() + timeout
    while todo:
        with tempfile.TemporaryDirectory(prefix="paged-cycles-") as tmp:
            req = Path(tmp) / "jobs.json"
            req.write_text(json.dumps([jobs[i] for i in todo]))
            env = {**os.environ, "LIBTPU_INIT_ARGS": f"{os.environ.get('LIBTPU_INIT_ARGS', '')} {FLAG}={tmp}/profile".strip()}
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))
            try:
                proc = subprocess.run([sys.executable, "-m", "bench.bench_paged_decode", "--worker", str(req)], cwd=ROOT,
                                      capture_output=True, text=True, env=env, timeout=max(1.0, deadline - time.monotonic()))
                stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as exc:
                stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                stderr, rc = "", "timeout"
        started = False
        for line in stdout.splitlines():
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "starting" in msg:
                started = True
                continue
            i = todo.pop(0)
            started = False
            if "no_profile" in msg:
                for j in [i] + todo:
                    results[j] = {"error": f"no static profile: {msg['no_profile']}"}
                return [results.get(k, {"error": "not run"}) for k in range(len(jobs))]
            results[i] = msg["result"]
            j = jobs[i]
            what = f"N={j['N']} B={j['B']}" if j["kind"] == "blocks" else f"program B={j['B']}"
            r = results[i]
            print(f"   cycles {j['chip']} T={j['T']:2d} {j['impl']:21s} {what:13s}: "
                  f"{r.get('cycles', r.get('outside_kernel', r.get('error')))} ({r.get('seconds')} s)", flush=True)
        if rc == 0 or not todo:
            break
        if rc == "timeout":
            for j in todo:
                results[j] = {"error": "not estimated: out of time"}
            break
        if not started:
            tail = " | ".join(stderr.strip().splitlines()[-3:])
            for j in todo:
                results[j] = {"error": f"helper process stopped (exit {rc}): {tail[:300]}"}
            break
        why = next((ln.split("] ", 1)[-1] for ln in stderr.splitlines() if ln.startswith("F") and "] " in ln), f"exit {rc}")
        i = todo.pop(0)
        results[i] = {"error": f"not estimated: libtpu aborted: {why[:200]}"}
        print(f"   cycles {jobs[i]['chip']} T={jobs[i]['T']:2d} {jobs[i]['impl']:21s}: {results[i]['error']}", flush=True)
    return [results.get(k, {"error": "not run"}) for k in range(len(jobs))]


def cycle_jobs(chips, page_sizes, ns, variants: bool = False) -> list[dict]:
    jobs = []
    for chip in chips:
        for T in page_sizes:
            for impl in IMPLS + (VARIANTS if variants else ()):
                jobs += [{"kind": "blocks", "chip": chip, "T": T, "impl": impl, "N": n, "B": CYCLE_B} for n in ns]
                jobs.append({"kind": "blocks", "chip": chip, "T": T, "impl": impl, "N": LINE_FROM, "B": 2 * CYCLE_B})
                if impl == "sparsegen":
                    jobs += [{"kind": "program", "chip": chip, "T": T, "impl": impl, "B": b} for b in (CYCLE_B, 2 * CYCLE_B)]
    return jobs


def clock_and_hbm(chip: str) -> tuple[float, float]:
    from sparsegen.tpu.cycles import clock_hz
    from sparsegen.tpu.targets import TARGETS

    return clock_hz(TARGETS[chip]), TARGETS[chip].hbm_bytes_per_s


def cycle_model(jobs: list[dict], results: list[dict], chip: str, T: int, impl: str, blocks_per_row: np.ndarray,
                nbytes: int) -> dict:
    """Per key block and per (b, head group) cycles from the constant-N compiles, and the
    estimate for the real lengths (see the module docstring)."""
    mine = [(j, r) for j, r in zip(jobs, results) if (j["chip"], j["T"], j["impl"]) == (chip, T, impl)]
    errors = [r["error"] for _, r in mine if "error" in r]
    small = {j["N"]: r["cycles"] for j, r in mine if j["kind"] == "blocks" and j["B"] == CYCLE_B and "cycles" in r}
    big = {j["N"]: r["cycles"] for j, r in mine if j["kind"] == "blocks" and j["B"] == 2 * CYCLE_B and "cycles" in r}
    outside = {j["B"]: r["outside_kernel"] for j, r in mine if j["kind"] == "program" and "outside_kernel" in r}
    out: dict = {"measured_total_at_B4": small, "measured_total_at_B8": big, "errors": errors or None,
                 "outside_kernel_cycles_measured": outside}
    if len(outside) == 2:  # every op around the kernel is over (B, ...): extended on the line through B = 4 and 8
        (b0, c0), (b1, c1) = sorted(outside.items())
        out["outside_kernel_cycles"] = round(c0 + (c1 - c0) * (B - b0) / (b1 - b0))
    rows_small, rows_big = CYCLE_B * G, 2 * CYCLE_B * G
    if LINE_FROM not in small or LINE_FROM not in big:
        return out
    per_row_at = (big[LINE_FROM] - small[LINE_FROM]) / (rows_big - rows_small)
    fixed = small[LINE_FROM] - rows_small * per_row_at
    per_row = {n: (c - fixed) / rows_small for n, c in sorted(small.items())}
    line = [(n, c) for n, c in per_row.items() if n >= LINE_FROM]
    out.update({"kernel_fixed_cycles": round(fixed), "per_row_cycles": {n: round(c, 1) for n, c in per_row.items()}})
    if len(line) < 2:
        return out
    ns, cs = np.array([n for n, _ in line], float), np.array([c for _, c in line], float)
    slope, intercept = np.polyfit(ns, cs, 1)
    residual = float(np.max(np.abs(cs - (slope * ns + intercept))))
    rows = blocks_per_row.astype(np.int64)  # per b: key blocks; G head groups each
    estimate = fixed + G * float(np.sum(intercept + slope * rows))
    clock, hbm = clock_and_hbm(chip)
    hbm_cycles = nbytes / hbm * clock
    measured = {n: c for n, c in per_row.items() if n < LINE_FROM}
    alt = fixed + G * float(sum(measured[n] if n in measured else intercept + slope * n for n in rows))
    out.update({"per_key_block_cycles": round(float(slope), 1), "per_row_overhead_cycles": round(float(intercept), 1),
                "line_max_residual_cycles": round(residual, 1),
                "off_line_at_small_N": {n: round(c - (slope * n + intercept), 1) for n, c in per_row.items() if n < LINE_FROM},
                "estimated_cycles": round(estimate), "estimated_us": round(estimate / clock * 1e6, 1),
                "estimated_cycles_small_n_measured": round(alt),
                "hbm_cycles": round(hbm_cycles), "hbm_us": round(hbm_cycles / clock * 1e6, 1),
                "memory_bound": hbm_cycles > estimate, "clock_hz": clock})
    if out.get("outside_kernel_cycles") is not None:
        out["with_outside_ops_cycles"] = round(estimate + out["outside_kernel_cycles"])
    return out


# ------------------------------------------------------------------ the report


def print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=220)
    t = Table(title=f"1. HBM bytes, B = {B}, H = {H}, G = {G}, D = {D}, NP = {NP}, lengths uniform in [1, {MAX_LEN}] (seed {SEED}), key blocks of {KEY_BLOCK}")
    for c in ("T", "ideal MiB", "sparsegen MiB", "ratio", "paged_attention MiB", "ratio", "pages past length (ours / theirs)",
              "key blocks (ours / theirs)", "page table in SMEM"):
        t.add_column(c, justify="right")
    for b in result["bytes"]:
        o, p, i = b["sparsegen"], b["paged_attention"], b["ideal"]
        t.add_row(str(b["T"]), f"{i['bytes'] / 2**20:,.1f}", f"{o['bytes'] / 2**20:,.1f}", f"{o['ratio_to_ideal']:.4f}",
                  f"{p['bytes'] / 2**20:,.1f}", f"{p['ratio_to_ideal']:.4f}", f"{o['pages_past_length']} / {p['pages_past_length']}",
                  f"{o['key_blocks']} / {p['key_blocks']}", f"{b['page_table_smem_bytes'] // 1024} KiB")
    console.print(t)
    if result.get("aot"):
        a = Table(title="2. Ahead-of-time compiles (no TPU): scoped VMEM of the Mosaic kernel (KiB): from the HLO / probed")
        a.add_column("chip")
        a.add_column("T", justify="right")
        for impl in IMPLS:
            a.add_column(impl, justify="right")
        for r in result["aot"]:
            cells = []
            for impl in IMPLS:
                d = r[impl]
                if not d.get("compiled"):
                    cells.append(f"fails: {d.get('error', '')[:70]}")
                    continue
                hlo = ", ".join(f"{v / 1024:.0f}" for v in d["kernel_vmem"].values())
                probe = d.get("probe_scoped_vmem")
                cells.append(f"{hlo} / {probe / 1024:.0f}" if probe else f"{hlo} / -")
            a.add_row(r["chip"], str(r["T"]), *cells)
        console.print(a)
    if result.get("cycles"):
        c = Table(title="3. libtpu static cycle estimate of the kernel (loops compiled with a constant trip count N; real lengths by the fitted line)")
        for col in ("chip", "T", "impl", "per key block", "per (b, group)", "fixed", "fit resid.", "estimate (real lengths)", "us",
                    "HBM us (bytes)", "ops outside", "ratio to paged_attention"):
            c.add_column(col, justify="left" if col in ("chip", "impl") else "right")
        for r in result["cycles"]:
            base = next((x for x in result["cycles"] if (x["chip"], x["T"], x["impl"]) == (r["chip"], r["T"], "paged_attention")), None)
            m = r["model"]
            ratio = (f"{m['estimated_cycles'] / base['model']['estimated_cycles']:.2f}"
                     if m.get("estimated_cycles") and base and base["model"].get("estimated_cycles") else "")
            c.add_row(r["chip"], str(r["T"]), r["impl"], f"{m.get('per_key_block_cycles', '-')}", f"{m.get('per_row_overhead_cycles', '-')}",
                      f"{m.get('kernel_fixed_cycles', '-')}", f"{m.get('line_max_residual_cycles', '-')}",
                      f"{m['estimated_cycles']:,}" if m.get("estimated_cycles") else (m.get("errors") or ["-"])[0][:60],
                      f"{m.get('estimated_us', '-')}", f"{m.get('hbm_us', '-')}", f"{m.get('outside_kernel_cycles', '-')}", ratio)
        console.print(c)
        console.print("  per key block / per (b, group): the slope and intercept of per-row cycles against N (N >= 3) from compiles at "
                      f"B = {CYCLE_B} with the key-block loop's trip count a constant N; fixed: the kernel's cost independent of the grid "
                      "(B = 4 vs 8). HBM us: section 1's bytes at the chip's HBM bandwidth (the estimator's DMA model is optimistic). "
                      "ops outside: the XLA ops around ours in its program (cycles, not in the estimate column; paged_attention has none).")


def summary(result: dict) -> list[str]:
    """The issue's goals: bytes within 5% of the ideal, cycles at most paged_attention's."""
    lines = []
    for b in result["bytes"]:
        lines.append(f"T = {b['T']}: bytes / ideal: sparsegen {b['sparsegen']['ratio_to_ideal']:.4f}"
                     f" ({'within' if b['sparsegen']['within_5_percent'] else 'NOT within'} 5%), paged_attention "
                     f"{b['paged_attention']['ratio_to_ideal']:.4f} ({'within' if b['paged_attention']['within_5_percent'] else 'not within'} 5%)")
    for r in result.get("cycles", []):
        if r["impl"] != "sparsegen":
            continue
        base = next(x for x in result["cycles"] if (x["chip"], x["T"], x["impl"]) == (r["chip"], r["T"], "paged_attention"))
        o, p = r["model"].get("estimated_cycles"), base["model"].get("estimated_cycles")
        if o and p:
            lines.append(f"{r['chip']} T = {r['T']}: estimated cycles sparsegen / paged_attention = {o / p:.2f} "
                         f"({'at most' if o <= p else 'MORE than'} paged_attention's; per key block {r['model']['per_key_block_cycles']:.0f}"
                         f" vs {base['model']['per_key_block_cycles']:.0f})")
        else:
            lines.append(f"{r['chip']} T = {r['T']}: no cycle comparison ({(r['model'].get('errors') or base['model'].get('errors') or ['?'])[0]})")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="v5e only, T = 16 only, N in 1..4 (no json unless --json)")
    parser.add_argument("--no-aot", action="store_true")
    parser.add_argument("--no-probe", action="store_true", help="skip the VMEM probes (compile once each)")
    parser.add_argument("--no-cycles", action="store_true")
    parser.add_argument("--chips", default="v5e,v6e")
    parser.add_argument("--variants", action="store_true",
                        help="also estimate scratch variants of the generated kernel (see _variant_text): a diagnosis")
    parser.add_argument("--cycles-timeout", type=float, default=900)
    parser.add_argument("--json", metavar="FILE", default=None, help="default bench/results/paged_decode.json (not with --quick)")
    parser.add_argument("--worker", metavar="REQUEST", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        worker(a.worker)
        return 0
    started = time.perf_counter()
    chips = ["v5e"] if a.quick else a.chips.split(",")
    page_sizes = (16,) if a.quick else PAGE_SIZES
    ns = (1, 2, 3, 4) if a.quick else CYCLE_NS
    lens = lengths()
    result = {"B": B, "H": H, "G": G, "D": D, "NP": NP, "max_len": MAX_LEN, "key_block": KEY_BLOCK, "seed": SEED,
              "jax": jax.__version__, "quick": a.quick, "lengths": lens.tolist(), "mean_length": float(lens.mean()),
              "paged_attention_options": {"pages_per_compute_block": "512 / T", "megacore_mode": None,
                                          "inline_seq_dim": {"paged_attention": True, "paged_attention_grid": False}}}
    print("1. HBM bytes", flush=True)
    result["bytes"] = [hbm_bytes(T, lens) for T in page_sizes]
    tables = {T: page_table(T) for T in page_sizes}
    result["page_tables"] = {str(T): {"distinct_reached_entries": bool(len(np.unique(t[:, : -(-MAX_LEN // T)])) == t[:, : -(-MAX_LEN // T)].size)}
                             for T, t in tables.items()}
    if not a.no_aot:
        print("2. Ahead-of-time compiles", flush=True)
        t0 = time.perf_counter()
        result["aot"] = [aot(chip, T, not a.no_probe) for chip in chips for T in page_sizes]
        result["aot_s"] = round(time.perf_counter() - t0, 1)
    if not a.no_cycles:
        print("3. Static cycle estimates (helper process)", flush=True)
        t0 = time.perf_counter()
        jobs = cycle_jobs(chips, page_sizes, ns, a.variants)
        res = run_jobs(jobs, a.cycles_timeout)
        result["cycle_jobs"] = [{**j, **r} for j, r in zip(jobs, res)]
        result["cycles"] = []
        for chip in chips:
            for b in result["bytes"]:
                for impl in IMPLS + (VARIANTS if a.variants else ()):
                    nbytes = b["sparsegen" if impl.startswith("sparsegen") else "paged_attention"]["bytes"]
                    model = cycle_model(jobs, res, chip, b["T"], impl, np.asarray(b["key_blocks_per_row"]), nbytes)
                    result["cycles"].append({"chip": chip, "T": b["T"], "impl": impl, "model": model})
        result["cycles_s"] = round(time.perf_counter() - t0, 1)
    result["total_s"] = round(time.perf_counter() - started, 1)
    result["summary"] = summary(result)
    print_tables(result)
    for line in result["summary"]:
        print("  " + line)
    print(f"total {result['total_s']} s (AOT {result.get('aot_s', '-')} s, cycles {result.get('cycles_s', '-')} s)")
    default = "paged_decode_variants.json" if a.variants else "paged_decode.json"
    path = a.json or (None if a.quick else str(ROOT / "bench" / "results" / default))
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

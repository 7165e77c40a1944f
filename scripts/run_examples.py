"""`make run`: every generated kernel against its reference in the TPU simulator, as a table.

The simulator fills uninitialised memory with NaN and raises on out-of-bounds reads and on
non-consecutive output revisits, so a pass here is the closest thing to a TPU run.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

from sparsegen.jaxenv import quiet_libtpu  # noqa: E402

quiet_libtpu()

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sparsegen.compiler import load  # noqa: E402
from sparsegen.testing import example_args, tolerance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Two to three blocks along each index at the spec's own tiles: small enough for the simulator.
BLOCKS = 2
TARGETS = ("v5e", "v6e", "v4")
failures_aot: list[bool] = []


def sizes_for(kernel) -> dict[str, int]:
    sizes = {}
    for index in kernel.indices:
        if index.size.symbol is not None and index.size.literal is None:
            sizes[index.size.symbol] = index.tile * (BLOCKS + (1 if index.summed else 0))
    return sizes


def load_generated(name: str):
    spec = importlib.util.spec_from_file_location(f"generated_{name}", ROOT / "generated" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    import jax
    from jax.experimental.pallas import tpu as pltpu

    from sparsegen import verify

    table = Table(title="generated kernels vs reference in the TPU simulator; ahead-of-time compiles per TPU target")
    for column in ("kernel", "strategy", "shapes", "pattern", "max |err|", "tolerance", "sim time", "result", *TARGETS):
        table.add_column(column, justify="right" if column in ("max |err|", "sim time") else "left")
    # Ahead-of-time compiles through libtpu, one column per target (sparsegen verify --quick).
    compiles = {}
    for spec in sorted((ROOT / "specs").glob("*.spk")):
        for r in verify.verify_file(spec, TARGETS, probe=False)[1]:
            compiles[r.kernel, r.target] = f"[green]ok[/green] {r.compile_seconds:.1f}s" if r.compiled else "[red]fails[/red]"
            failures_aot.append(not r.compiled)
    failures = 0
    for spec in sorted((ROOT / "specs").glob("*.spk")):
        _, kernels = load(spec)
        for kernel in kernels:
            module = load_generated(kernel.name)
            sizes = sizes_for(kernel)
            patterns = {"mask": ("tril", "random"), "dense": ("random",)}.get(kernel.strategy, ("random", "all_empty"))
            for pattern in patterns:
                args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(0))
                ref = np.asarray(module.reference(*args, **keywords)).astype(np.float32)
                start = time.perf_counter()
                try:
                    out = getattr(module, kernel.name)(*args, **keywords, interpret=pltpu.InterpretParams())
                    out = np.asarray(jax.block_until_ready(out)).astype(np.float32)
                    error = float(np.abs(out - ref).max()) if out.size else 0.0
                    rtol, atol = tolerance(kernel)
                    scale = max(1.0, float(np.abs(ref).max())) if ref.size else 1.0
                    ok = bool(np.allclose(out, ref, rtol=rtol, atol=atol * scale)) and not np.isnan(out).any()
                    result = "[green]ok[/green]" if ok else "[red]MISMATCH[/red]"
                except Exception as exc:  # report and go on: the table is the point
                    pltpu.reset_tpu_interpret_mode_state()
                    error, ok, result = float("nan"), False, f"[red]{type(exc).__name__}[/red]"
                elapsed = time.perf_counter() - start
                failures += not ok
                shapes = ", ".join(f"{k}={v}" for k, v in sizes.items()) or "fixed"
                first = pattern == patterns[0]
                aot = [compiles[kernel.name, t] if first else "" for t in TARGETS]
                table.add_row(kernel.name, kernel.strategy, shapes, pattern, f"{error:.3g}", f"rtol {tolerance(kernel)[0]:g}", f"{elapsed:.2f} s", result, *aot)
    Console(width=170).print(table)
    return 1 if failures or any(failures_aot) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Building long specs (issue 22, item 12; goal: 10,000 lines in under 10 s).

    .venv/bin/python bench/bench_long_specs.py [LINES ...]

Runs `sparsegen build` as a user would (a fresh process, start-up included) on two shapes of
long spec: one kernel whose score passes through LINES chained elementwise locals, and
LINES / 7 kernels of seven lines each. Prints wall and CPU seconds: the ratio between sizes
shows whether generation stays linear.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAD = ["    in  q: f32[S, D]", "    in  k: f32[S, D]", "    in  v: f32[S, D]", "    out o: f32[S, D]"]
TILE = "    tile i = 128, j = 128, d = 128, e = 128"


def chain(lines: int) -> str:
    body = ["    t0[i, j] = q[i, d] * k[j, d] where i >= j"]
    body += [f"    t{m}[i, j] = t{m - 1}[i, j] * 0.5 + 1.0" for m in range(1, lines)]
    body += [f"    o[i, e] = softmax(t{lines - 1}[i, j], j) * v[j, e]"]
    return "\n".join(["kernel chain {", *HEAD, *body, TILE, "}"]) + "\n"


def many(lines: int) -> str:
    out = []
    for m in range(max(1, lines // 7)):
        out += [f"kernel k{m} {{", *HEAD, "    s[i, j] = q[i, d] * k[j, d] where i >= j", f"    t[i, j] = s[i, j] * 0.5 + {m}.0",
                "    o[i, e] = softmax(t[i, j], j) * v[j, e]", TILE, "}"]
    return "\n".join(out) + "\n"


def build(text: str, folder: Path) -> tuple[float, float]:
    spec = folder / "long.spk"
    spec.write_text(text)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sparsegen", "build", str(spec), "-o", str(folder / "out")], cwd=ROOT, check=True,
                   capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - start, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    sizes = [int(a) for a in sys.argv[1:]] or [1000, 2000, 10000]
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in (("chained locals, one kernel", chain), ("kernels of 7 lines", many)):
            for n in sizes:
                folder = Path(tmp) / f"{make.__name__}{n}"
                folder.mkdir()
                wall, cpu = build(make(n), folder)
                print(f"{name:28} {n:6} lines: {wall:6.2f} s wall, {cpu:6.2f} s CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())

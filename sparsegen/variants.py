"""`sparsegen variants`: expand tile choices, drop what cannot work, rank the rest.

Each variant is a kernel of its own (renamed `NAME_m512_n256_k512`), re-printed from the
checked model with new tiles and compiled through the whole pipeline, so it obeys every
rule `build` does. Variants the checks reject are dropped with their reason; unless
`--no-compile`, so are those that fail to compile ahead of time for a target. The rest are
ranked by the pipeline simulator's roofline estimate on the pattern, and, where a TPU is
present, timed and ranked by measured time; `--rank cycles` ranks by libtpu's static cycle
estimate instead (a profiled compile per variant: slow). Attention-like kernels take part
through their row walk (`tpu/attention/simulate.py`).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass, field

from .compiler import compile_source, lower_source
from .ir import Kernel
from .wrapper import spec_text
from .source import SourceFile, SpecError


@dataclass
class Variant:
    name: str
    tiles: dict[str, int]
    source: SourceFile
    plan: object | None = None
    rejected: str | None = None  # why the checks or the compiler dropped it
    report: object | None = None
    compiled: dict[str, bool] = field(default_factory=dict)
    measured: float | None = None  # median seconds on a TPU
    cycles: int | None = None  # libtpu's weighted static estimate of the forward passes (--rank cycles)
    cycles_reason: str | None = None  # why there is none
    cycles_report: object | None = None  # cycles.KernelCycles

    @property
    def estimate(self) -> float:
        return self.report.estimates[self.target]["seconds"] if self.report else math.inf

    target: str = "v5e"
    _code: str | None = field(default=None, repr=False)

    @property
    def code(self) -> str | None:
        """The module as `build` writes it, emitted and formatted when first asked for
        (ranking needs the plan only: a variant nobody writes or times is never formatted)."""
        if self._code is None and self.plan is not None:
            from .backends import emit_module

            self._code = emit_module(self.plan, self.source.name)
        return self._code


def parse_tile_options(items: list[str], kernel: Kernel) -> dict[str, list[int]]:
    """`["n=128,256", "k=512"]` -> {"n": [128, 256], "k": [512]} (ValueError on a bad item)."""
    options: dict[str, list[int]] = {}
    names = [i.name for i in kernel.indices]
    for item in items:
        name, sep, values = item.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise ValueError(f"--tile takes INDEX=SIZE,SIZE,... with INDEX one of {', '.join(names)}; got {item!r}")
        try:
            sizes = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--tile {name}: sizes must be integers, got {values!r}") from None
        if not sizes or any(s <= 0 for s in sizes):
            raise ValueError(f"--tile {name}: give positive sizes")
        options[name] = list(dict.fromkeys(options.get(name, []) + sizes))
    return options


def expand(kernel: Kernel, spec_name: str, options: dict[str, list[int]]) -> list[Variant]:
    """The cross product of tile options, in a deterministic order, as variant specs."""
    names = [i.name for i in kernel.indices]
    choices = [options.get(n, [kernel.index(n).tile]) for n in names]
    variants = []
    for values in itertools.product(*choices):
        tiles = dict(zip(names, values))
        name = kernel.name + "_" + "_".join(f"{n}{t}" for n, t in tiles.items())
        text = spec_text(kernel, name=name, tiles=tiles)
        variants.append(Variant(name, tiles, SourceFile(f"{spec_name} (variant {name})", text)))
    return variants


def default_sizes(kernel: Kernel, options: dict[str, list[int]]) -> dict[str, int]:
    """Eight blocks of the largest tile choice of each symbol (variants whose tiles do not
    divide it are dropped, saying so; --shape sets sizes)."""
    sizes = {}
    for symbol, literal in kernel.symbols:
        if literal is not None:
            continue
        tiles = []
        for index in kernel.indices:
            if index.size.symbol == symbol:
                tiles += options.get(index.name, [index.tile])
        sizes[symbol] = 8 * max(tiles) if tiles else 1024
    from .schedule.attention import whole_sizes

    sizes.update(whole_sizes(kernel))  # a row walk's summed and value indices: one block spans them
    for rel in kernel.relations:  # `h // n`: the smaller size follows from the larger one
        big = kernel.index(rel.index).size.symbol
        if big in sizes and rel.dim.symbol in sizes:
            sizes[big] = math.lcm(sizes[big], rel.divisor)
            sizes[rel.dim.symbol] = sizes[big] // rel.divisor
    return sizes


def build(variant: Variant, target: str) -> None:
    """Check and lower the variant (its module is emitted when its `code` is first read)."""
    try:
        (variant.plan,) = lower_source(variant.source, target)
    except SpecError as exc:
        variant.rejected = exc.diagnostics[0].message


def model(variant: Variant, sizes: dict[str, int], pattern: str, targets: list[str], seed: int) -> None:
    from .backends import analyse_module
    from .tpu.attention.simulate import LayoutRefused

    for index, tile, symbol, why in variant.plan.must_span():
        if sizes.get(symbol, tile) != tile:
            variant.rejected = f"tile {index} = {tile} must span {symbol}, which is {sizes[symbol]}: {why} (set sizes with --shape)"
            return
    try:
        variant.report = analyse_module(variant.plan, sizes, pattern, targets=tuple(targets), seed=seed, strict=True)
    except LayoutRefused as exc:
        variant.rejected = str(exc)
    except (ValueError, KeyError) as exc:
        variant.rejected = f"cannot model it on {pattern}: {exc}"


def compile_check(variant: Variant, sizes: dict[str, int], targets: list[str], nnz: float) -> None:
    from .verify import verify_plan

    for target in targets:
        plan = variant.plan if target == variant.plan.target.name else compile_source(variant.source, target)[0].plan
        result = verify_plan(plan, variant.source, target, sizes, nnz, probe=False)
        variant.compiled[target] = result.compiled
        if not result.compiled:
            variant.rejected = f"does not compile for {target}: {result.error.message if result.error else result.raw_error}"
            return


def time_on_tpu(variant: Variant, sizes: dict[str, int], pattern: str, seed: int, repeats: int = 7) -> None:
    """Median wall time of the compiled kernel on the local TPU, after a warm-up call."""
    import jax
    import numpy as np

    from .callconv import stored_tiles
    from .shapes import _load
    from .tpu.simulate import pattern_args

    plan = variant.plan
    # The module as written (jax itself: load_module's host stand-ins are for the simulator),
    # an einsum or a row-walk kernel alike.
    module = _load(variant.code, f"timed_{variant.name}")
    k = plan.kernel
    env = {s: (lit if lit is not None else sizes[s]) for s, lit in k.symbols}
    _, sparse = pattern_args(plan, env, pattern, seed)
    rng = np.random.default_rng(seed)
    args = []
    for p in plan.conv.params:
        op = k.operand(p.operand)
        shape = tuple(d.literal if d.literal is not None else env[d.symbol] for d in op.dims)
        if p.kind == "blocks":
            args.append(rng.standard_normal((len(sparse[op.name][0]), *stored_tiles(k, op))).astype(op.dtype.np_dtype))
        elif p.kind in ("coords", "out_coords"):
            args.append(sparse[op.name][p.dim])
        elif p.kind == "mask":
            args.append(sparse[op.name])
        elif p.kind == "index":
            args.append(np.zeros(op.dims[0].literal, np.int32))
        elif op.name in sparse:  # a condition's data (segment ids) from the pattern
            args.append(sparse[op.name])
        else:
            args.append(rng.standard_normal(shape).astype(op.dtype.np_dtype))
    keywords = {s: env[s] for s, lit in k.symbols if lit is None}
    args = [jax.device_put(a) for a in args]
    fn = getattr(module, plan.name)
    jax.block_until_ready(fn(*args, **keywords))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args, **keywords))
        times.append(time.perf_counter() - start)
    variant.measured = statistics.median(times)


def tpu_present_cheap() -> bool:
    """Whether this machine may have a TPU, without loading jax."""
    from .jaxenv import tpu_device_files

    return tpu_device_files()


def tpu_present() -> bool:
    try:
        import jax

        return any(d.platform == "tpu" for d in jax.devices())
    except Exception:
        return False


def estimate_cycles(variants: list[Variant], sizes: dict[str, int], pattern: str, target: str, seed: int) -> None:
    """libtpu's static cycle estimate of each variant's forward passes, the table-driven
    regions weighted by the pattern's walk (`tpu/cycles.py`, all in one helper process).
    Where there is none (this libtpu lacks the profile flag, a profile failed or was not
    weighted) the variant keeps `cycles` None and says why in `cycles_reason`."""
    import subprocess

    from . import cycles

    jobs = [{"spec": v.source.name, "text": v.source.text, "kernel": v.name, "target": target, "shapes": sizes,
             "pattern": pattern, "seed": seed, "backward": False} for v in variants]
    if not jobs:
        return
    try:
        found = cycles.measure(jobs)
    except (cycles.CyclesUnavailable, subprocess.TimeoutExpired, OSError) as exc:
        for v in variants:
            v.cycles_reason = f"no estimate: {exc}".splitlines()[0]
        return
    for v, k in zip(variants, found):
        v.cycles_report = k
        v.cycles = k.total(k.forward)
        if v.cycles is None:
            why = k.error or next((p.note for p in k.forward if p.cycles is None and p.note), None)
            v.cycles_reason = why or "no pass was estimated"


def rank(variants: list[Variant], by: str = "model") -> list[Variant]:
    """Survivors by measured time where there is one, else by the model; with `by="cycles"`,
    by libtpu's cycle estimate, those without one last. Ties by the model, then by name."""
    alive = [v for v in variants if v.rejected is None]
    if by == "cycles":
        return sorted(alive, key=lambda v: (v.cycles is None, v.cycles or 0, v.estimate, v.name))
    return sorted(alive, key=lambda v: (v.measured if v.measured is not None else math.inf, v.estimate, v.name))

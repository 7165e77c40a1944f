"""`sparsegen verify --cycles`: libtpu's static cycle estimate of every kernel pass, with the
table-driven regions walked as the real tables for the verify shapes and pattern take them.

libtpu, compiling ahead of time with `--xla_jf_dump_static_llo_profile_to=DIR`, walks a
kernel's final bundles over its whole grid and prints one `estimated_cycles` per HLO op. It
resolves `pl.program_id` conditions, but reads scalar-prefetch (SMEM) tables as zeros, so a
`pl.when(table[...] ...)` region is counted as if every table entry were 0. For each pass
(one `pallas_call`) of a kernel and of its backward, this module compiles:

- `raw`: the kernel as generated (what the estimator says on its own);
- `walk`: each `pl.when` condition replaced by a bit looked up from constants by the grid
  step (`program_id` only, so the estimator resolves it), the bits being the condition's
  value at that step for the real tables, evaluated on the host by running the kernel's
  own code on the tables (`region_conditions`);
- `zero`: the same lookup with the bits the estimator assumed (the tables read as zeros).

The estimate is `walk + (raw - zero)`: the real path, plus what reading the conditions from
SMEM costs over the constant lookup (measured on the estimator's own path, and assumed the
same on the real one). Passes whose conditions do not depend on the tables compile once.

What it gets wrong: index maps still read the tables as zeros, so the estimator sees the
block index change (and copies start) only where `program_id` alone moves it. The DMA
model is optimistic anyway: the HBM traffic of the real walk (index maps evaluated on the
host) is given as `hbm_cycles`, and a pass whose `hbm_cycles` exceed its estimate is
marked memory-bound: the estimate is a lower bound there. The bits cost a chain of scalar
selects per step (one per 32 steps of the grid axes the conditions vary along); `walk` and
`zero` both pay it, so it mostly cancels, but lookups over MAX_STEPS steps are not weighted
(the raw figure is given, marked).
A grid extent the generated code traces (the steps a walk needs) is compiled as the number
it had for these tables: left a traced value, the estimator walked a grid of its own size.
A region nested in a region reads block data (the host cannot evaluate it, and the
estimator counts such a region as run: measured). Generated code has one kind,
`_present_step`'s (a partial step whose other factor may hold NaN or Inf):
`_finite` runs wherever the enclosing region does, `_nonfinite` is walked as finite data
take it, never (`_CompilePl._nested`): the estimate is that of finite data.

Like libtpu's flags, the profile must be set before libtpu loads, so the compiles run in a
separate process (`python -m sparsegen.cycles REQUEST.json`), one for all kernels. That
process and its parent are the pipeline's part (`sparsegen/cycles.py`: each job's spec is
checked, lowered and emitted there); this module takes the lowered module and its generated
code (`estimate_job`), and holds what the estimate is made of.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
import re
import types
from dataclasses import dataclass, field

import numpy as np

FLAG = "--xla_jf_dump_static_llo_profile_to"
MAX_STEPS = 32 * 256  # bits of the longest lookup chain
# MXU multiply-adds per cycle and TensorCore, as FLOPs (bf16): 4 MXUs of 128x128 (v4, v5e,
# v5p), 4 of 256x256 (v6e). Each target's peak per core over these gives its clock.
MXU_FLOPS_PER_CYCLE = {"v4": 131072, "v5e": 131072, "v5p": 131072, "v6e": 524288}


class CyclesUnavailable(Exception):
    """libtpu gave no static profile (the flag is missing from this libtpu), or the helper process failed."""


class NoProfile(CyclesUnavailable):
    """A compile gave no `estimated_cycles`: this libtpu does not know the flag."""


def clock_hz(target) -> float:
    return target.bf16_flops / target.cores / MXU_FLOPS_PER_CYCLE[target.name]


@dataclass
class Region:
    name: str  # the decorated function's name: _init, _compute, _flush, ...
    count: int  # steps that run it with the real tables
    estimator_count: int  # steps the estimator counts (the tables read as zeros)
    flops: int  # MXU work of one run (2 * M * N * K per dot)


@dataclass
class PassCycles:
    kernel: str  # the Pallas kernel function
    grid: tuple[int, ...]
    steps: int
    raw: int | None  # the estimator on the kernel as generated
    cycles: int | None  # weighted: walk + (raw - zero)
    regions: list[Region] = field(default_factory=list)
    walk: int | None = None
    zero: int | None = None
    hbm_bytes: int = 0  # copies of the real walk, in and out
    hbm_cycles: int = 0
    mxu_cycles: float = 0.0  # the MXU minimum of the work the real walk does
    every_step_flops: int = 0  # MXU work outside every region
    order: int = 0  # position among the kernel's forward or backward passes
    note: str | None = None

    @property
    def computing_steps(self) -> int:
        """Steps that do MXU work: every step if some is outside the regions, else the most
        often run region that has some (regions of one step are exclusive in generated code)."""
        if self.every_step_flops:
            return self.steps
        return sum(r.count for r in self.regions if r.flops)

    @property
    def memory_bound(self) -> bool:
        return self.cycles is not None and self.hbm_cycles > self.cycles

    def to_json(self) -> dict:
        computing = self.computing_steps
        return {
            "kernel": self.kernel,
            "grid": list(self.grid),
            "steps": self.steps,
            "estimated_cycles": self.cycles,
            "raw_estimated_cycles": self.raw,
            "walk_cycles": self.walk,
            "zero_table_cycles": self.zero,
            "regions": [dataclasses.asdict(r) for r in self.regions],
            "computing_steps": computing,
            "cycles_per_computing_step": round(self.cycles / computing, 1) if self.cycles and computing else None,
            "mxu_min_cycles": round(self.mxu_cycles),
            "mxu_ratio": round(self.cycles / self.mxu_cycles, 3) if self.cycles and self.mxu_cycles else None,
            "hbm_bytes": self.hbm_bytes,
            "hbm_cycles": self.hbm_cycles,
            "memory_bound": self.memory_bound,
            "note": self.note,
        }


@dataclass
class KernelCycles:
    kernel: str
    target: str
    pattern: str
    forward: list[PassCycles] = field(default_factory=list)
    backward: list[PassCycles] = field(default_factory=list)
    error: str | None = None

    @staticmethod
    def total(passes: list[PassCycles]) -> int | None:
        return None if not passes or any(p.cycles is None for p in passes) else sum(p.cycles for p in passes)

    def to_json(self) -> dict:
        def side(passes):
            total, mxu = self.total(passes), sum(p.mxu_cycles for p in passes)
            return {
                "estimated_cycles": total,
                "mxu_min_cycles": round(mxu),
                "mxu_ratio": round(total / mxu, 3) if total and mxu else None,
                "memory_bound": any(p.memory_bound for p in passes),
                "passes": [p.to_json() for p in passes],
            }

        return {"pattern": self.pattern, "forward": side(self.forward), "backward": side(self.backward) if self.backward else None, "error": self.error}


# ------------------------------------------------------------------ the helper process


@dataclass
class Call:
    """One `pallas_call` as the generated function made it: the kernel, its keywords, its arguments."""

    kernel: object
    kwargs: dict
    args: tuple

    @property
    def grid_spec(self):
        return self.kwargs["grid_spec"]

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(int(g) for g in self.grid_spec.grid)

    @property
    def tables(self) -> list[np.ndarray]:
        return [np.asarray(t) for t in self.args[: self.grid_spec.num_scalar_prefetch]]


def capture(fn, args: list, keywords: dict, backward: bool, pl_module) -> tuple[list[Call], list[Call]]:
    """The `pallas_call`s the generated function `fn` makes for these concrete arguments, and
    those of its backward, run eagerly on the CPU; each call returns zeros, nothing runs.

    Intercepted at the call, not read from the traced program as verify's SMEM count is
    (`tpu.verify.scalar_memory`): a traced `pallas_call` holds its kernel as a jaxpr (and a
    source location) and its arguments as variables, while the estimate needs the kernel's
    Python function (run on the host with its `pl`, `jnp` and `lax` swapped, and re-traced
    with conditions replaced by lookups) and the tables' concrete values the wrapper computed
    for these arguments (the regions' conditions, the index maps' walk, a traced grid extent)."""
    import jax
    import jax.numpy as jnp

    calls: list[Call] = []
    real = pl_module.pallas_call

    def recorded(kernel, **kwargs):
        def run(*a):
            calls.append(Call(kernel, kwargs, a))
            # numpy's zeros: jax's would compile a broadcast per output shape (most of the
            # walk's time on a variant of masked_softmax).
            return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), kwargs["out_shape"])

        return run

    pl_module.pallas_call = recorded
    try:
        with jax.disable_jit(), jax.default_device(jax.devices("cpu")[0]):
            fn(*args, **keywords)
            forward = len(calls)
            if not backward:
                return calls, []
            floats = tuple(n for n, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))
            jax.grad(lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(fn(*a, **keywords))), argnums=floats)(*args)
            return calls[:forward], calls[2 * forward :]  # the grad's own forward calls come first
    finally:
        pl_module.pallas_call = real


class _HostPl(types.ModuleType):
    """`pl` for running a kernel body's conditions on the host, every grid step at once."""

    def __init__(self, grid):
        super().__init__("pl (host)")
        self.grid = grid
        self.steps = math.prod(grid)
        self.axes = np.indices(grid, dtype=np.int64).reshape(len(grid), self.steps)
        self.regions: list[tuple[str, np.ndarray]] = []

    def program_id(self, d):
        return self.axes[d]

    def num_programs(self, d):
        return self.grid[d]

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    def when(self, condition):
        def region(body):
            self.regions.append((body.__name__, np.broadcast_to(np.asarray(condition, bool), (self.steps,)).copy()))

        return region


@contextlib.contextmanager
def _globals(fn, **values):
    """Swap names in the module globals `fn` runs with (the generated module's `pl`, `jnp`, `lax`)."""
    while not hasattr(fn, "__globals__"):  # functools.partial, Pallas's index-map wrapper
        fn = fn.func if isinstance(fn, functools.partial) else fn.__wrapped__
    g = fn.__globals__
    missing = object()
    saved = {name: g.get(name, missing) for name in values}
    g.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                del g[name]
            else:
                g[name] = value


class _Absent:
    """A ref's contents on the host: code outside the regions (a dense kernel's product) runs
    on it and gives it back; conditions never depend on it in generated code."""

    def __getattr__(self, name):
        return _ABSENT

    def __call__(self, *args, **kwargs):
        return _ABSENT

    def __getitem__(self, key):
        return _ABSENT

    def __setitem__(self, key, value):
        pass

    def _op(self, *other):
        return _ABSENT

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _op
    __neg__ = __and__ = __or__ = __lt__ = __gt__ = __le__ = __ge__ = __iadd__ = __matmul__ = _op


_ABSENT = _Absent()


class _Passing(types.ModuleType):
    """`jnp` or `lax` on the host whose functions give _ABSENT back for an _ABSENT argument."""

    def __init__(self, host):
        super().__init__(host.__name__)
        self._host = host

    def __getattr__(self, name):
        value = getattr(self._host, name)
        if not callable(value) or isinstance(value, type):
            return value

        def call(*args, **kwargs):
            if any(isinstance(a, _Absent) for a in (*args, *kwargs.values())):
                return _ABSENT
            return value(*args, **kwargs)

        return call


def region_conditions(call: Call, zero: bool = False) -> list[tuple[str, np.ndarray]]:
    """Per `pl.when` region of the kernel, in order: its name and its condition at every grid
    step (row-major), for the call's tables (or zeros: what the estimator reads)."""
    from .simulate import _HOST_JNP, _HOST_LAX

    host = _HostPl(call.grid)
    tables = [np.zeros_like(t) if zero else t for t in call.tables]
    kernel = call.kernel
    bound = kernel.keywords if isinstance(kernel, functools.partial) else {}
    positional = len(inspect.signature(kernel).parameters) - len(bound)
    with _globals(kernel, pl=host, jnp=_Passing(_HOST_JNP), lax=_Passing(_HOST_LAX)):
        # Region bodies do not run here; code outside them runs on absent contents.
        kernel(*tables, *[_ABSENT] * (positional - len(tables)))
    return host.regions


def block_walks(call: Call):
    """Per BlockSpec of the call (inputs, then outputs): its spec, the array, whether it is an
    output, the bytes of one block, and the block index at every grid step (row-major, one row
    per coordinate), from the index maps run on the host with the real tables (None: no index
    map, the whole array is one block)."""
    from .simulate import _HOST_JNP, _HOST_LAX

    import jax

    gs, grid = call.grid_spec, call.grid
    steps = math.prod(grid)
    axes = list(np.indices(grid, dtype=np.int64).reshape(len(grid), steps))
    tables = call.tables
    operands = list(call.args[gs.num_scalar_prefetch :])
    outs = jax.tree.leaves(call.kwargs["out_shape"])
    ins = list(jax.tree.leaves(gs.in_specs, is_leaf=lambda s: hasattr(s, "index_map")))
    specs = ins + list(jax.tree.leaves(gs.out_specs, is_leaf=lambda s: hasattr(s, "index_map")))
    for n, (spec, array) in enumerate(zip(specs, operands + outs)):
        itemsize = np.dtype(array.dtype).itemsize
        if getattr(spec, "index_map", None) is None or spec.block_shape is None:
            yield spec, array, n >= len(ins), math.prod(array.shape) * itemsize, None
            continue
        with _globals(spec.index_map, jnp=_HOST_JNP, lax=_HOST_LAX):
            coords = spec.index_map(*axes, *tables)
        keys = np.stack([np.broadcast_to(np.asarray(c, np.int64), (steps,)) for c in coords])
        block = math.prod(1 if b is None else int(getattr(b, "block_size", b)) for b in spec.block_shape)
        yield spec, array, n >= len(ins), block * itemsize, keys


def hbm_bytes(call: Call) -> int:
    """Bytes the pipeline copies for the real tables: a block whenever its index changes."""
    from .simulate import _runs

    return sum(size if keys is None else int(_runs(keys).sum()) * size for _, _, _, size, keys in block_walks(call))


def _salt(word_of):
    """A word's salt, XOR-ed into its constant: every word of a lookup then differs (an all-zero
    table's chain cannot fold to a constant), and the same value comes out of int32 (device,
    products wrapping) and int64 (host) arithmetic: only the low 31 bits are kept."""
    return (word_of * 40503 + 12345) & 0x7FFFFFFF


def varying_axes(grid: tuple[int, ...], *bit_sets) -> tuple[int, ...]:
    """The grid axes along which some of these bits (each over every step, row-major) vary."""
    found = set()
    for bits in bit_sets:
        b = np.asarray(bits, bool).reshape(grid)
        found |= {d for d in range(len(grid)) if not (b == b.take([0], axis=d)).all()}
    return tuple(sorted(found))


def _lookup(bits: np.ndarray, grid: tuple[int, ...], pl, jnp, axes=None):
    """A condition equal to `bits[step]` from `program_id` and constants only, 32 bits a word.

    Only shifts, masks, XOR, products and compares: libtpu's static profiler evaluates those
    on its walk, but not an integer division or remainder by a constant that is not a power of
    two (`step // 31` came out 0 and `step % 31` 0 at every step: each step took step 0's
    bit, every region on the walk ran as at the first step). The words are salted (`_salt`)
    so that the walk's compile and the zero-table compile emit the same chain, whose cost
    cancels in walk - zero (an all-zero table's chain folded away otherwise).

    The step is counted over `axes` only (default: those the bits vary along), axes the bits
    do not vary along (a walk's parallel output axis) left out: the chain, whose cost grows
    with its length and does not quite cancel (paid on the critical path of a step that
    computes, hidden in one that does not), is shorter. The walk's and the zero-table
    compile must use the same axes (`varying_axes` of both), or one chain folds away."""
    bits = np.asarray(bits, bool).reshape(grid)
    axes = varying_axes(grid, bits) if axes is None else tuple(axes)
    bits = bits[tuple(slice(None) if d in axes else 0 for d in range(len(grid)))].reshape(-1)
    step = jnp.int32(0)
    for d in axes:
        step = step * grid[d] + pl.program_id(d)
    word_of = step >> 5
    word = jnp.int32(0)
    for k in range(0, len(bits), 32):
        value = sum(1 << j for j, b in enumerate(bits[k : k + 32]) if b) ^ _salt(k // 32)
        value = value - (1 << 32) if value >= 1 << 31 else value  # as int32
        word = jnp.where(word_of == k // 32, jnp.int32(value), word)
    word = word ^ _salt(word_of)
    return ((word >> (step & 31)) & 1) == 1


class _CompilePl(types.ModuleType):
    """`pl` for tracing a kernel to compile: each `pl.when` as given, or replaced by a lookup of
    its bits; records each region's MXU work."""

    def __init__(self, real, grid, bits=None, axes=None):
        super().__init__("pl (compile)")
        self._real, self._grid, self._bits, self._axes = real, grid, bits, axes
        self.flops: list[int] = []
        self.body_flops = 0  # dots outside every region: run at every step
        self._region = None
        self._rare = False  # inside a region finite data never run (its dots are no work)

    def __getattr__(self, name):
        return getattr(self._real, name)

    def when(self, condition):
        import jax.numpy as jnp

        if self._region is not None:
            return self._nested(condition)
        n = len(self.flops)
        self.flops.append(0)
        if self._bits is not None:
            condition = _lookup(self._bits[n], self._grid, self._real, jnp, None if self._axes is None else self._axes[n])
        inner = self._real.when(condition)

        def region(body):
            def traced():
                self._region = n
                try:
                    body()
                finally:
                    self._region = None

            return inner(traced)

        return region

    def _nested(self, condition):
        """A region inside a region: its condition reads block data (the host cannot walk it,
        and the estimator counts it as run). Generated code has one kind, `_present_step`'s:
        `_finite` runs wherever its enclosing region does on finite data (kept as it is,
        its dots the enclosing region's), `_nonfinite` never does: its condition is and-ed
        with `program_id(0) < 0`, false at every step, which the estimator resolves (the
        check it reads stays in the program), and its dots are not counted."""

        def region(body):
            rare = body.__name__ == "_nonfinite"
            inner = self._real.when(condition & (self._real.program_id(0) < 0) if rare else condition)

            def traced():
                saved, self._rare = self._rare, self._rare or rare
                try:
                    body()
                finally:
                    self._rare = saved

            return inner(traced)

        return region

    def count_dot(self, flops: int) -> None:
        if self._rare:
            return
        if self._region is None:
            self.body_flops += flops
        else:
            self.flops[self._region] += flops


def _counting_lax(real_lax, real_jnp, pl: _CompilePl):
    """`lax` and `jnp` whose dots add their FLOPs to the region being traced."""

    def dot_general(a, b, dimension_numbers, *args, **kwargs):
        out = real_lax.dot_general(a, b, dimension_numbers, *args, **kwargs)
        (contract, _), _ = dimension_numbers
        pl.count_dot(2 * math.prod(out.shape) * math.prod(a.shape[d] for d in contract))
        return out

    def dot(a, b, *args, **kwargs):
        out = real_jnp.dot(a, b, *args, **kwargs)
        pl.count_dot(2 * math.prod(out.shape) * a.shape[-1])
        return out

    lax = types.ModuleType("lax (counting)")
    lax.__getattr__ = lambda name: getattr(real_lax, name)
    lax.dot_general = dot_general
    jnp = types.ModuleType("jnp (counting)")
    jnp.__getattr__ = lambda name: getattr(real_jnp, name)
    jnp.dot = dot
    return lax, jnp


def estimate(call: Call, device, bits=None, axes=None) -> tuple[int, list[int], int]:
    """libtpu's estimated cycles for the call alone (its tables passed as arguments: constants
    abort the profile), each region's MXU FLOPs per run, and those of every step. `bits`: per
    region, its condition at every step, looked up instead of the kernel's (`_lookup`, over
    `axes[region]`: give the walk and the zero-table compile the same)."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as real_pl
    from jax.sharding import SingleDeviceSharding

    pl = _CompilePl(real_pl, call.grid, bits, axes)
    counting_lax, counting_jnp = _counting_lax(lax, jnp, pl)
    kernel = call.kernel

    def fresh(*a, **k):  # a new function each time: Pallas caches kernel traces by function
        return kernel(*a, **k)

    sharding = SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding) for a in call.args]
    kwargs = {**call.kwargs, "grid_spec": _static_grid(call)}
    with _globals(kernel, pl=pl, lax=counting_lax, jnp=counting_jnp), jax.default_device(device):
        compiled = jax.jit(lambda *a: real_pl.pallas_call(fresh, **kwargs)(*a)).trace(*structs).lower().compile()
    return parse_cycles(compiled.as_text()), pl.flops, pl.body_flops


def _static_grid(call: Call):
    """The call's grid spec with its grid as Python ints. A grid extent the generated code
    computes under jit (a walk's needed steps) was captured as a concrete array; passed on as
    it is, it stays a dynamic grid dimension in the compile, and libtpu's estimator walks a
    grid of its own choosing (sparsegen's grouped matmul: the same raw figure for 512 and
    2048 steps), not the call's."""
    gs = call.grid_spec
    if all(isinstance(g, int) for g in gs.grid):
        return gs
    static = copy.copy(gs)  # not dataclasses.replace: the spec's fields differ from its __init__'s
    object.__setattr__(static, "grid", call.grid)
    return static


def parse_cycles(text: str) -> int:
    """The estimate in a compiled module's text (the sum over its ops); CyclesUnavailable if none."""
    found = [int(n) for n in re.findall(r'estimated_cycles\\*"?\s*[:=]\s*\\*"?(\d+)', text)]
    if not found:
        raise NoProfile(f"libtpu wrote no estimated_cycles: this libtpu may not know {FLAG}")
    return sum(found)


def pass_cycles(call: Call, target, device) -> PassCycles:
    real = region_conditions(call)
    assumed = region_conditions(call, zero=True)
    grid, steps = call.grid, math.prod(call.grid)
    raw, flops, every_step = estimate(call, device)
    if len(flops) != len(real):
        raise ValueError(f"{_name(call)}: {len(flops)} regions traced but {len(real)} seen on the host (nested pl.when?)")
    regions = [Region(name, int(c.sum()), int(z.sum()), f) for (name, c), (_, z), f in zip(real, assumed, flops)]
    result = PassCycles(_name(call), grid, steps, raw, raw, regions, every_step_flops=every_step)
    if any(not np.array_equal(c, z) for (_, c), (_, z) in zip(real, assumed)):
        axes = [varying_axes(grid, c, z) for (_, c), (_, z) in zip(real, assumed)]
        longest = max(math.prod(grid[d] for d in a) for a in axes)
        if longest > MAX_STEPS:
            result.cycles = None
            result.note = f"not weighted: {longest} grid steps to look up (at most {MAX_STEPS}); use a smaller --shape"
        else:
            result.walk = estimate(call, device, [c for _, c in real], axes)[0]
            result.zero = estimate(call, device, [z for _, z in assumed], axes)[0]
            result.cycles = result.walk + raw - result.zero
    rate = MXU_FLOPS_PER_CYCLE[target.name] * _mxu_speed(call)
    work = steps * every_step + sum(r.count * r.flops for r in regions)
    result.mxu_cycles = work / rate
    result.hbm_bytes = hbm_bytes(call)
    result.hbm_cycles = round(result.hbm_bytes / target.hbm_bytes_per_s * clock_hz(target))
    return result


def _name(call: Call) -> str:
    fn = call.kernel.func if isinstance(call.kernel, functools.partial) else call.kernel
    return getattr(fn, "__name__", "kernel")


def _mxu_speed(call: Call) -> float:
    """MXU rate of the call's operands against bf16: int8 runs twice as fast (v5e, v5p, v6e:
    their int8 peak is twice the bf16 one; v4 takes no int8 matmul), f32 takes about three
    passes (f32 scales beside int8 data are applied after the sum, not on the MXU)."""
    dtypes = {np.dtype(a.dtype).name for a in call.args[call.grid_spec.num_scalar_prefetch :]}
    if "int8" in dtypes and "bfloat16" not in dtypes:
        return 2.0
    return 1 / 3 if "float32" in dtypes and "bfloat16" not in dtypes else 1.0


def concrete_args(plan, env: dict[str, int], pattern: str, seed: int = 0):
    """Arrays for the generated function: the pattern's coordinates and masks, zeros for data."""
    from ..patterns import condition_ids
    from ..shapes import arg_structs
    from .arguments import pattern_args

    params = [p for p in plan.conv.params if p.kind != "index"] if hasattr(plan, "conv") else []
    sparse = any(plan.kernel.operand(p.operand).sparsity in ("coo", "mask") for p in params) or condition_ids(plan)
    given = dict(zip([id(p) for p in params], pattern_args(plan, env, pattern, seed)[0])) if sparse else {}
    nb = next((len(given[id(p)]) for p in params if p.kind == "coords"), 0)
    structs, keywords = arg_structs(plan.kernel, env, nb)
    args = []
    for p, (shape, dtype) in zip(plan.conv.params, structs):
        value = given.get(id(p)) if p.kind != "blocks" else None  # a blocks stand-in has only its length
        args.append(np.asarray(value).astype(dtype) if value is not None else np.zeros(shape, dtype))
    return args, keywords


def estimate_job(n: int, job: dict, plan, module, skip: set[tuple], emit_line) -> None:
    """Estimate every pass of one job, given its lowered `plan` and its generated `module`
    (loaded), printing a line before each (so that the parent knows which one libtpu
    aborted on) and one with its result."""
    from ..shapes import sizes
    from .targets import TARGETS
    from .verify import _device

    try:
        env = sizes(plan.kernel, job["shapes"])
        args, keywords = concrete_args(plan, env, job["pattern"], job.get("seed", 0))
        with_backward = job.get("backward", True) and not plan.backward_error and plan.has_backward
        sides = dict(zip(("forward", "backward"), capture(getattr(module, plan.name), args, keywords, with_backward, module.pl)))
        target, device = TARGETS[job["target"]], _device(TARGETS[job["target"]].topology)
    except Exception as exc:  # reported per kernel; the others still run
        emit_line({"job": n, "side": "forward", "index": -1, "error": _first_line(exc)})
        return
    for side, calls in sides.items():
        for i, call in enumerate(calls):
            if (n, side, i) in skip:
                continue
            emit_line({"job": n, "side": side, "index": i, "starting": _name(call)})
            try:
                result = pass_cycles(call, target, device)
            except NoProfile:
                raise
            except Exception as exc:  # this pass only
                result = PassCycles(_name(call), call.grid, math.prod(call.grid), None, None, note=f"not estimated: {_first_line(exc)}")
            result.order = i
            emit_line({"job": n, "side": side, "index": i, "pass": {**dataclasses.asdict(result), "grid": list(result.grid)}})


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# ------------------------------------------------------------------ verify --cycles


def print_table(found: dict[tuple[str, str, str], KernelCycles], pattern: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"libtpu's static cycle estimate (pattern {pattern}; regions weighted by the real tables)")
    for column in ("kernel", "target", "pass", "grid steps", "computing", "cycles", "per computing step", "x MXU minimum", "HBM cycles", "note"):
        table.add_column(column, justify="left" if column in ("kernel", "target", "pass", "note") else "right")
    for (_, kernel, target), k in found.items():
        if k.error:
            table.add_row(kernel, target, "-", "", "", "", "", "", "", f"[red]{k.error}[/red]")
        for side, passes in (("fwd", k.forward), ("bwd", k.backward)):
            for p in passes:
                j = p.to_json()
                note = p.note or ("memory-bound: the estimate is optimistic (HBM needs more)" if p.memory_bound else "")
                table.add_row(kernel, target, f"{side} {p.kernel}", str(p.steps), str(j["computing_steps"]),
                              f"{p.cycles:,}" if p.cycles is not None else "-",
                              f"{j['cycles_per_computing_step']:,.0f}" if j["cycles_per_computing_step"] else "-",
                              f"{j['mxu_ratio']:.2f}" if j["mxu_ratio"] else "-", f"{p.hbm_cycles:,}", note)
    Console(width=200).print(table)

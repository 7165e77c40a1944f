"""`sparsegen verify`: compile kernels ahead of time for TPU targets through libtpu, no TPU needed.

This is the TPU's part: it takes a lowered module (`sparsegen/verify.py` checks and lowers
the spec through the compiler and hands each kernel's module here). For each kernel and target: does it compile, how much VMEM the compiler needs (found by
probing: compile with a tiny `vmem_limit_bytes` and raise it by what each failure says
is missing, until it compiles), SMEM for the prefetch tables, the compiled cost analysis
and the compile time. Failures point back at the spec.

jax is imported here only, and only when verify runs.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from ..source import Diagnostic, SourceFile
from ..shapes import _load, concrete, differentiated
from .lower import TpuModule
from .suggest import suggest_tiles
from .targets import TARGETS, format_bytes

# The static VMEM estimate (what `build` checks) must bound the compiler's figure, and not by
# too much: compiled <= estimate, and estimate <= ESTIMATE_SLACK * compiled + ESTIMATE_FLOOR.
ESTIMATE_SLACK = 1.4
ESTIMATE_FLOOR = 1 << 20

_UNITS = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class MissingLibtpu(Exception):
    """jax or libtpu is not installed."""


def require_libtpu() -> None:
    import importlib.util

    for module in ("jax", "libtpu"):
        if importlib.util.find_spec(module) is None:
            raise MissingLibtpu(f"sparsegen verify compiles through libtpu, and {module} is not installed: pip install 'sparsegen[tpu]'")


@dataclass
class Result:
    kernel: str
    target: str
    compiled: bool
    shapes: dict[str, int]
    nb: int | None
    vmem_estimate: int
    vmem_used: int | None = None
    vmem_limit: int = 0
    smem_used: int = 0
    smem_limit: int = 0
    flops: float | None = None
    bytes_accessed: float | None = None
    compile_seconds: float = 0.0
    backward: str | None = None  # "compiles", "fails: ...", or why jax.grad cannot go through the kernel
    error: Diagnostic | None = None
    raw_error: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self, source: SourceFile) -> dict:
        return {
            "kernel": self.kernel,
            "target": self.target,
            "compiled": self.compiled,
            "shapes": self.shapes,
            "nb": self.nb,
            "vmem_estimate_bytes": self.vmem_estimate,
            "vmem_used_bytes": self.vmem_used,
            "vmem_limit_bytes": self.vmem_limit,
            "smem_used_bytes": self.smem_used,
            "smem_limit_bytes": self.smem_limit,
            "flops": self.flops,
            "bytes_accessed": self.bytes_accessed,
            "compile_seconds": round(self.compile_seconds, 3),
            "backward": self.backward,
            "error": self.error.render(source) if self.error else None,
        }


# ------------------------------------------------------------------ shapes


# ----------------------------------------------------------------- compile


def _compile(plan: TpuModule, source: SourceFile, target_name: str, args, keywords, emit, vmem_limit=None, backward: bool = False, module=None):
    """The module's call (`backward`: its gradient's) compiled for `target_name` (`_trace`)."""
    return _lower(_trace(plan, source, target_name, args, keywords, emit, vmem_limit, backward, module), target_name)


def _trace(plan: TpuModule, source: SourceFile, target_name: str, args, keywords, emit, vmem_limit=None, backward: bool = False, module=None):
    """The module's call traced under jit for `target_name` with arguments of these shapes
    and dtypes (`args`) and `keywords`: the program `_lower` compiles, whose kernels
    `scalar_memory` reads. `module`: the plan's generated module, loaded (else emitted here)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    if vmem_limit is not None:
        plan = plan.with_vmem_limit(vmem_limit)
    if module is None or vmem_limit is not None:
        module = _load(emit(plan, source.name), f"verify_{plan.name}")
    fn = getattr(module, plan.name)
    device = _device(TARGETS[target_name].topology)
    sharding = SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in args]
    call = lambda *a: fn(*a, **keywords)  # noqa: E731
    if backward:
        # The gradient of a sum of the outputs for every float input whose gradients are derived: the backward passes.
        floats = differentiated(plan.conv, [dtype for _, dtype in args], plan.refused)
        if not floats:
            raise _NothingDerived("every float input's gradient is refused")
        call = jax.grad(lambda *a: sum(jnp.sum(o.astype(jnp.float32)) for o in _tuple_of(fn(*a, **keywords))), argnums=floats)
    with jax.default_device(device):
        return jax.jit(call).trace(*structs)


def _lower(traced, target_name: str):
    import jax

    # Some Mosaic lowerings ask which TPU they target: the default device tells them.
    with jax.default_device(_device(TARGETS[target_name].topology)):
        return traced.lower().compile()


def scalar_memory(jaxpr) -> int:
    """Bytes of scalar memory (SMEM) the largest kernel of a traced program takes: a
    pallas_call's scalar-prefetch operands (a walk's tables, first positions, page bounds)
    and its SMEM scratch, as the program hands them to Mosaic: what the generated module
    allocates, counted from the program itself (the module checks the same tables against
    `_SMEM_BYTES` as it builds them). `jaxpr`: `Traced.jaxpr`, or any jaxpr within it.
    The pallas_call's parameters are jax's own (0.12): test_verify's
    test_scalar_memory_is_what_the_module_checks holds this count to the module's."""
    from jax.experimental.pallas import tpu as pltpu

    most = 0
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        if eqn.primitive.name == "pallas_call":
            grid = eqn.params["grid_mapping"]  # its operands: dynamic grid bounds, scalar prefetch, inputs
            start = grid.num_dynamic_grid_bounds
            prefetch = [v.aval for v in eqn.invars[start : start + grid.num_index_operands]]
            scratch = [a for a in grid.scratch_avals if getattr(a, "memory_space", None) == pltpu.SMEM]
            most = max(most, sum(a.size * a.dtype.itemsize for a in prefetch + scratch))
        for value in eqn.params.values():  # jit, custom_vjp and control flow bodies
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    most = max(most, scalar_memory(sub))
    return most


class _NothingDerived(Exception):
    """No float input has a derived gradient: there is no backward to compile."""


def _tuple_of(out):
    return out if isinstance(out, tuple) else (out,)


_DEVICES: dict[str, object] = {}


def _device(topology: str):
    if topology not in _DEVICES:
        from jax.experimental import topologies

        _DEVICES[topology] = topologies.get_topology_desc(topology, "tpu").devices[0]
    return _DEVICES[topology]


def _size(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit[0].upper()])


def probe_vmem(plan: TpuModule, source: SourceFile, target: str, args, keywords, emit, start: int = 4096) -> int | None:
    """The smallest vmem_limit_bytes the kernel compiles with (to about a KiB), or None.

    Each failed compile says by how much the limit fell short; the limit grows by that
    until it compiles. `start` should be below the need (a guess saves compiles); if the
    kernel compiles at once, the probe starts over from 4 KiB to stay tight.
    """
    limit, first = start, True
    for _ in range(24):
        try:
            _compile(plan, source, target, args, keywords, emit, vmem_limit=limit)
        except Exception as exc:  # the compiler says how much is missing
            m = re.search(r"exceeded scoped vmem limit by ([\d.]+)\s*([KMGB])", str(exc))
            if not m:
                return None
            limit += _size(*m.groups()) + 1024
            first = False
            continue
        if first and limit > 4096:
            limit, first = 4096, False
            continue
        return limit
    return None


# ------------------------------------------------------------------ errors


def explain(plan: TpuModule, target: str, message: str) -> Diagnostic:
    """Turn a libtpu/Mosaic failure into a diagnostic at the spec."""
    k = plan.kernel
    tiles = ", ".join(f"{i.name}={i.tile}" for i in k.indices)
    chip = TARGETS[target]
    vmem = re.search(r"memory space vmem.*?Used ([\d.]+)([KMG])", message, re.S) or re.search(
        r"Scoped allocation with size ([\d.]+)([KMG])", message
    )
    if "vmem" in message.lower() and ("Ran out of memory" in message or "ScopedVmemOom" in message):
        need = f"{format_bytes(_size(*vmem.groups()))} or more" if vmem else "more than it has"
        notes = []
        smaller = suggest_tiles(k, chip)
        if smaller is not None and smaller.indices != k.indices:  # the static estimate thought these fit
            notes.append("tiles that fit: " + ", ".join(f"{i.name}={i.tile}" for i in smaller.indices))
        return Diagnostic(k.tile_span, f"tiles {tiles} need {need} of VMEM on {target} (limit {format_bytes(chip.vmem_bytes)})", tuple(notes))
    if "memory space smem" in message:
        return Diagnostic(k.tile_span, f"the scalar-prefetch tables of tiles {tiles} do not fit the SMEM of {target} ({format_bytes(chip.smem_bytes)}); use larger tiles")
    if "libtpu multi-process lockfile" in message:
        return Diagnostic(None, "another process holds libtpu; wait for it, or set ALLOW_MULTIPLE_LIBTPU_LOAD=1 (safe for ahead-of-time compiles)")
    first = next((line.strip() for line in message.splitlines() if line.strip()), "compilation failed")
    for operand, shape in plan.block_shapes():
        patterns = ("x".join(map(str, shape)), str(shape).replace(" ", ""), str(shape))
        if shape and any(p in message for p in patterns):
            op = k.operand(operand)
            return Diagnostic(op.span, f"'{op.name}' block {shape} ({op.dtype.name}) does not compile for {target} (Mosaic): {first}")
    return Diagnostic(k.name_span, f"kernel '{k.name}' does not compile for {target}: {first}")


# -------------------------------------------------------------------- verify


def verify_plan(plan: TpuModule, source: SourceFile, target: str, shapes: dict[str, int] | None = None, nnz: float = 0.1, probe: bool = True,
                *, emit) -> Result:
    """Compile a lowered module ahead of time for `target` (and its gradients), then probe
    the VMEM it needs. `emit(module, origin)` writes a module's source (the pipeline's
    `backends.emit_module`: this module takes lowered modules only, whatever their family)."""
    k = plan.kernel
    env, nb, args, keywords = concrete(k, shapes, nnz)
    chip = TARGETS[target]
    module = _load(emit(plan, source.name), f"verify_{plan.name}")
    result = Result(k.name, target, False, {s: env[s] for s, _ in k.symbols}, nb, plan.vmem_bytes, vmem_limit=chip.vmem_bytes, smem_limit=chip.smem_bytes)
    start = time.perf_counter()
    try:
        traced = _trace(plan, source, target, args, keywords, emit, module=module)
        # What the forward's kernels take of SMEM at these sizes, from the traced program: a
        # row walk's tables are sized by its classification (the dense count where the
        # condition reads traced operands), which only the module's code computes.
        result.smem_used = scalar_memory(traced.jaxpr)
        compiled = _lower(traced, target)
    except Exception as exc:
        result.compile_seconds = time.perf_counter() - start
        result.raw_error = str(exc)
        result.error = explain(plan, target, str(exc))
        return result
    result.compile_seconds = time.perf_counter() - start
    result.compiled = True
    if plan.backward_error:
        result.backward = f"not derived: {plan.backward_error}"
    elif plan.has_backward:
        try:
            _compile(plan, source, target, args, keywords, emit, backward=True, module=module)
            result.backward = "compiles"
        except _NothingDerived as exc:
            result.backward = f"not derived: {exc}"
        except Exception as exc:  # reported, not raised: the forward kernel stands on its own
            result.backward = "fails: " + next((line.strip() for line in str(exc).splitlines() if line.strip()), "compilation failed")
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    result.flops = cost.get("flops")
    result.bytes_accessed = cost.get("bytes accessed")
    if probe:
        result.vmem_used = probe_vmem(plan, source, target, args, keywords, emit, start=max(4096, plan.vmem_bytes // 2 // 4096 * 4096))
    return result

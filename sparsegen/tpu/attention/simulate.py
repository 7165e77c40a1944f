"""`plan --pattern` and `variants` for the row walk: the generated module's own walk, its
tables and index maps, counted as the einsum walks are (`tpu/simulate.py`).

The generated function runs eagerly on the host with its `pallas_call`s recorded, not run
(`cycles.capture`), with numpy in its `jnp` and `lax`'s place (`_host`): the classification
and `_walk_tables` compute the real tables for the pattern's data (`patterns.pattern_args`:
masks, segment ids) as jax would, with no XLA compile per operation and array shape (which
made a variant of a data-dependent walk take seconds), the index maps run on every
grid step at once (`cycles.block_walks`), and the kernel's own `pl.when` conditions say
which steps compute (`cycles.region_conditions`: its `_partial*` and `_full` regions). The
dense baseline is the same module with every block classified partial: every (row block,
key block) pair visited, the condition evaluated everywhere.
"""

from __future__ import annotations

import math

import numpy as np

from ...schedule.attention import PARTIAL
from ..simulate import Report, Simulation, Traffic, _HostLax, _HostNumpy, _runs, count_copies, roofline
from ..targets import TARGETS


class WalkSimulation(Simulation):
    """A Simulation whose outputs differ in block size (an output block, a row of
    logsumexp): write-backs are counted in bytes."""

    write_back_bytes: int = 0

    @property
    def hbm_bytes(self) -> int:
        return sum(t.copies * t.block_bytes for t in self.traffic.values()) + self.write_back_bytes + self.prefetch_bytes


class LayoutRefused(ValueError):
    """A block of the walk breaks the TPU layout rule at these sizes: the compile refuses it."""


def analyse_attention(plan, sizes: dict[str, int], pattern: str, targets=("v5e",), seed: int = 0, strict: bool = False) -> Report:
    """Simulate the row walk of an attention-like kernel on a pattern, and its dense twin.
    With `strict`, a block that breaks the TPU layout rule raises LayoutRefused (variants
    drops it); otherwise it is a note."""
    from ...shapes import _load
    from ..cycles import capture, concrete_args
    from .emit import emit_attention as emit

    k, p = plan.kernel, plan.plan
    env = {s: (lit if lit is not None else sizes[s]) for s, lit in k.symbols}
    args, keywords = concrete_args(plan, env, pattern, seed)
    module = _host(_load(emit(_forward_only(plan), "<memory>", formatted=False), f"sparsegen_walk_{plan.name}"))
    fn = getattr(module, plan.name)
    classify = next(n for n in module.block_kinds.__code__.co_names if n.startswith("_classify_blocks"))
    found: dict = {}
    real = _once(getattr(module, classify), found)
    setattr(module, classify, real)
    try:
        calls, _ = capture(fn, args, keywords, False, module.pl)
        problem = _layout_problem(plan, calls)
        if problem and strict:
            raise LayoutRefused(problem)
        sim = _walk(plan, calls)
        notes = _notes(p, module, args, keywords, pattern, sim) + ((f"{problem}: the compile will refuse it",) if problem else ())
        # The dense twin: every block classified partial (visited, the condition evaluated).
        setattr(module, classify, lambda xp, *a, **kw: xp.full_like(real(xp, *a), PARTIAL))
        dense = _walk(plan, capture(fn, args, keywords, False, module.pl)[0])
    finally:
        found.clear()  # the operands it holds (a mask of 64 MiB) go now, not when the module's cycles are collected
    parallel = bool(p.lead)
    estimates = {}
    for name in targets:
        ours, base = roofline(sim, k, TARGETS[name], parallel), roofline(dense, k, TARGETS[name], parallel)
        estimates[name] = {"seconds": ours["seconds"], "dense_seconds": base["seconds"],
                           "speedup": base["seconds"] / ours["seconds"] if ours["seconds"] else float("inf"), "bound": ours["bound"]}
    return Report(plan, env, pattern, sim, dense, estimates, None, tuple(notes), products="blocks visited (computing steps)")


def _once(classify, found: dict):
    """The module's classification, made once per set of arguments: the walk, its notes and
    its dense twin each classify the pattern's operands (a pass over a mask of 8192² each
    time). Arguments are compared as the function binds them (defaults filled in), arrays by
    their memory, shape and type (jax hands the walk a view of the caller's numpy array);
    they are kept in `found` with the result, so that no other array takes their memory
    while it lives."""
    import inspect

    signature = inspect.signature(classify)

    def key(value):
        if isinstance(value, np.ndarray):
            return ("array", value.__array_interface__["data"][0], value.shape, value.strides, value.dtype.str)
        try:
            hash(value)
        except TypeError:
            return ("id", id(value))
        return ("value", value)

    def once(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        k = tuple((name, id(v) if name == "xp" else key(v)) for name, v in bound.arguments.items())
        if k not in found:
            found[k] = (args, kwargs, classify(*args, **kwargs))
        return found[k][2]

    return once


def _forward_only(plan):
    """The plan without its backward: the walk is the forward's (a call not differentiated),
    and the module is half as long to emit and compile (test_plan_attention.py checks the
    report is the one the whole module gives)."""
    import dataclasses

    return dataclasses.replace(plan, backward_error="not simulated: the forward's walk is", backward_walk=None)


class _HostJnp(_HostNumpy):
    """`jnp` for the row walk's wrapper on the host: numpy, and jax.numpy for what numpy
    lacks (`bfloat16`)."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            import jax.numpy as jnp

            return getattr(jnp, name)


class _HostJaxLax(_HostLax):
    """`lax` on the host: `tpu.simulate`'s numpy functions, jax.lax's for the others."""

    def __getattr__(self, name):
        import jax

        return getattr(jax.lax, name)


_HOST_JNP = _HostJnp("jnp (numpy on the host, for the row walk)")
_HOST_JAX_LAX = _HostJaxLax("lax (numpy on the host, for the row walk)")


def _host(module):
    """The generated module with numpy for `jnp` and `lax`: the walk's code (`_row_walk`,
    `_walk_tables`) takes its jax branch (`xp` is not numpy itself), so the tables and the
    grid are those jax computes (test_plan_attention.py checks the reports are equal)."""
    module.jnp, module.lax = _HOST_JNP, _HOST_JAX_LAX
    return module


def _layout_problem(plan, calls) -> str | None:
    """The first block whose last two dimensions break the TPU layout rule (multiples of 8
    and 128, or the array's own), as Pallas checks it when it lowers the call."""
    from ..cycles import block_walks

    p = plan.plan
    for call in calls:
        for spec, array, is_output, _, _ in block_walks(call):
            block, shape = spec.block_shape, array.shape
            if block is None or len(block) < 2:
                continue
            for d, quantum in ((-2, 8), (-1, 128)):
                b = block[d]
                if b is not None and int(getattr(b, "block_size", b)) % quantum and int(getattr(b, "block_size", b)) != shape[d]:
                    what = "output" if is_output else "input"
                    name = _map_name(spec.index_map).strip("_").removesuffix("_map")
                    sizes = tuple(None if x is None else int(getattr(x, "block_size", x)) for x in block)
                    return (f"the {what} block {sizes} of '{name}' (array {tuple(shape)}) breaks the TPU layout rule: its last two "
                            f"dimensions must be multiples of 8 and 128 or span the array (choose other {p.query} or {p.key} tiles)")
    return None


def _notes(p, module, args, keywords, pattern: str, sim) -> tuple[str, ...]:
    """How the pattern was used, and for a traced condition what `max_steps` would save."""
    if not p.conditions:
        return ("no condition: every block is visited (the pattern is not used)",)
    if not p.data_dependent:
        return (f"the condition reads sizes only: the walk is the same for every pattern ({pattern} is not used)",)
    kinds = np.asarray(module.block_kinds(*args, **keywords))
    kinds = kinds.reshape((-1,) + kinds.shape[-2:])
    needed = max(int(module._row_walk(np, x)[1]) for x in (kinds, kinds.transpose(0, 2, 1)))
    dense = kinds.shape[-2] * kinds.shape[-1]
    return (f"the condition reads operands (classified under jit): the grid runs the {sim.grid[-1]} steps per group this "
            f"pattern needs (a traced extent); the walk's tables hold the dense count, {dense} steps per group, in scalar "
            f"memory; max_steps={needed} (the least this pattern allows, forward and backward) would shrink them to {needed}",)


def _walk(plan, calls) -> WalkSimulation:
    """Copies, write-backs and computing steps of the recorded calls (the forward walk, and
    the dense walk of stored outputs), added up."""
    from ..cycles import block_walks, region_conditions

    names = {o.fn: o.read.text for o in plan.operands}
    grid, steps, products, flops, write_backs, out_bytes, prefetch = (), 0, 0, 0, 0, 0, 0
    traffic: dict[str, Traffic] = {}
    for n, call in enumerate(calls):
        n_steps = math.prod(call.grid)
        regions = region_conditions(call)
        computing = np.zeros(n_steps, bool)
        for name, when in regions:
            if name.startswith("_partial") or name == "_full":  # a split condition's `_partial_<part>` too
                computing |= when
        cost = call.kwargs["cost_estimate"]
        kinds = call.tables[3]
        per_step = int(cost.flops) // kinds.size if kinds.size else 0
        grid = grid or call.grid
        steps += n_steps
        products += int(computing.sum())
        flops += int(computing.sum()) * per_step
        prefetch += sum(t.nbytes for t in call.tables)
        for spec, array, is_output, size, keys in block_walks(call):
            if is_output:
                count = 1 if keys is None else int(_runs(keys).sum())
                write_backs += count
                out_bytes += count * size
                continue
            label = names.get(_map_name(spec.index_map), _map_name(spec.index_map).strip("_").removesuffix("_map"))
            label += " (stored walk)" if n else ""  # the second call writes stored outputs over every block
            t = Traffic(label, size)
            if keys is None:
                t.copies = t.ideal = 1
            else:
                count_copies(t, keys, computing)
            key = label if label not in traffic else f"{label} ({len(traffic)})"
            traffic[key] = t
    sim = WalkSimulation(grid, steps, products, flops, write_backs, 0, prefetch, traffic)
    sim.write_back_bytes = out_bytes
    return sim


def _map_name(fn) -> str:
    """The generated index map's name under Pallas's and functools' wrappers."""
    import functools

    while not hasattr(fn, "__name__") or isinstance(fn, functools.partial):
        fn = fn.func if isinstance(fn, functools.partial) else fn.__wrapped__
    return fn.__name__

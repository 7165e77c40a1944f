"""Name hygiene: spec identifiers never shadow the names generated code relies on.

A generated module has fixed module-level names (imports and helpers, below). Spec
names become parameters and locals; each is taken from a NameTable that appends
underscores until the name is free, so `k`, `np`, `len` or `_kernel` as spec names
are all safe.
"""

from __future__ import annotations

import builtins
import keyword
import re

from .resources import read_resource

IMPORTS = frozenset({"functools", "jax", "jnp", "np", "lax", "pl", "pltpu", "plgpu"})
# Every helper the templates define (read from them, so a new helper is reserved the day it
# is written), the module's constants, and its fixed functions.
HELPERS = frozenset(
    name for template in ("helpers.py.j2", "module.py.j2", "tpu/module.py.j2", "tpu/attention.py.j2", "tpu/paged.py.j2", "gpu/module.py.j2",
                     "gpu/attention.py.j2", "gpu/paged.py.j2", "common/paged.py.j2")
    for name in re.findall(r"^def (_\w+)\(", read_resource("templates", template), re.M)
) | {
    "_NAME", "_BLOCK", "_FLUSH", "_LAST", "_EMPTY", "_PARTIAL", "_FULL", "_SKIP", "_SMEM_BYTES", "_PARTIALS", "_REFUSED",
    "_MESH_RULES", "_MESH_ARGS", "_MESH_OUTPUTS", "_MESH_SUMS", "_MESH_SIZES", "_MESH_SHIFTS", "_MESH_COO", "_placement",
    "_kernel", "_impl", "_reference", "_prepare", "_prefetch", "_init", "_compute", "_flush",
    "_RING_QUERY", "_RING_KEY", "_RING_ROLES", "_RING_DIMS", "_RING_MERGES", "_RING_ROWS", "_RING_DECLARED", "_RING_LSE",
    "_RING_LENGTHS", "_FUSED_MAX_ROWS", "_JAX_VERSION",
}  # fmt: skip
MODULE_NAMES = IMPORTS | HELPERS | {"reference", "block_kinds", "sharded"}
# Fixed parameter and local names of the generated functions.
FIXED_LOCALS = frozenset({"_", "sizes", "compiled", "interpret", "grid_spec", "residuals", "cotangent", "perturbed", "wanted", "mesh", "axes"}) | {
    # the row walk's (attention) fixed names: its kernels' nested functions and parameters,
    # the walk's wrapper locals, the classification's locals
    "masked", "bound", "overflow", "max_steps", "xp", "can", "must", "origin", "keys",
    "_scores", "_chain", "_step", "_partial", "_full", "_write", "_empty", "_start", "_finish", "_init", "_flush",
    "split",  # the classification's keyword (split kinds), and the phases of a split condition's parts
    "piece", "written",  # the condition walk's dense fallback in pieces (`_pieces`)
    *(f"_partial_{g}" for g in range(32)),
}  # fmt: skip
PYTHON_NAMES = frozenset(dir(builtins)) | frozenset(keyword.kwlist) | frozenset(keyword.softkwlist)


class NameTable:
    def __init__(self, reserved=()):
        self.used = set(reserved)

    def take(self, preferred: str, *also: set[str]) -> str:
        """`preferred`, underscores appended until free here and in the `also` sets."""
        name = preferred
        while name in self.used or any(name in taken for taken in also) or keyword.iskeyword(name):
            name += "_"
        self.used.add(name)
        return name


class ModuleNames:
    """The names of one generated module: public parameters keep the spec's names where they
    can; internal names (locals, tables, grid coordinates) avoid every name the module uses."""

    def __init__(self, kernel):
        symbols = [s for s, _ in kernel.symbols]
        # The public functions' bodies use only these names besides their parameters.
        # (`sharded`'s inner function also reads `_placement`, `_on_mesh` (`_on_mesh_coo`) and `_local_sizes`.)
        self.public = NameTable({"_prepare", "_impl", "_run", "_reference", "_check_interpret", "_check_bound", "_checked", "interpret", "max_steps",
                                 "_placement", "_on_mesh", "_on_mesh_coo", "_local_sizes"} | set(symbols))
        self.internal = NameTable(MODULE_NAMES | PYTHON_NAMES | FIXED_LOCALS | {kernel.name})
        self.functions = NameTable(MODULE_NAMES | {kernel.name})
        self.host_functions: dict[tuple, str] = {}  # a host function's (parameters, body) -> its name

    def local(self, preferred: str) -> str:
        return self.internal.take(preferred)

    def function(self, preferred: str) -> str:
        """A module-level function's name: free among functions and among the locals taken so
        far (a local of `_impl` holding an output named `_attention_kernel` must not shadow
        the kernel function it calls)."""
        parent = (self.parent.internal.used,) if self.parent is not None else ()
        name = self.functions.take(preferred, self.internal.used, *parent)
        self.internal.used.add(name)
        if self.parent is not None:
            self.parent.internal.used.add(name)
        return name

    def host_function(self, preferred: str, body: tuple) -> tuple[str, bool]:
        """A module-level host function for `body` (its parameters and lines): the name of one
        already written with that body (the forward pass and a gradient's classify alike), or a
        new name; and whether it is new (then the caller writes it)."""
        if body in self.host_functions:
            return self.host_functions[body], False
        name = self.function(preferred)
        self.host_functions[body] = name
        return name, True

    parent: "ModuleNames | None" = None

    def scope(self) -> "ModuleNames":
        """Names local to one pass (its kernel, index maps and tables): they avoid every
        module-level name taken so far, and each other, but not other passes' locals."""
        child = ModuleNames.__new__(ModuleNames)
        child.public, child.functions, child.parent = self.public, self.functions, self
        child.host_functions = self.host_functions
        child.internal = NameTable(self.internal.used)
        return child

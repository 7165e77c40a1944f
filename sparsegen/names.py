"""Name hygiene: spec identifiers never shadow the names generated code relies on.

A generated module has fixed module-level names (imports and helpers, below). Spec
names become parameters and locals; each is taken from a NameTable that appends
underscores until the name is free, so `k`, `np`, `len` or `_kernel` as spec names
are all safe.
"""

from __future__ import annotations

import builtins
import keyword

IMPORTS = frozenset({"functools", "jax", "jnp", "np", "lax", "pl", "pltpu"})
HELPERS = frozenset(
    {
        "_NAME", "_BLOCK", "_FLUSH", "_EMPTY", "_PARTIAL", "_FULL",
        "_fail", "_is_traced", "_as_array", "_as_coords", "_bind", "_need", "_check_dim",
        "_check_multiple", "_check_coords", "_check_offsets", "_next_live", "_coo_steps",
        "_block_kinds", "_densify", "_gather_blocks", "_kernel", "_impl", "_reference", "_prepare",
        "_sizes", "_check_smem", "_SMEM_BYTES", "_SKIP", "_check_padding", "_prefetch",
    }
)  # fmt: skip
MODULE_NAMES = IMPORTS | HELPERS | {"reference"}
# Fixed parameter and local names of the generated functions.
FIXED_LOCALS = frozenset({"sizes", "interpret", "grid_spec"})
PYTHON_NAMES = frozenset(dir(builtins)) | frozenset(keyword.kwlist) | frozenset(keyword.softkwlist)


class NameTable:
    def __init__(self, reserved=()):
        self.used = set(reserved)

    def take(self, preferred: str) -> str:
        name = preferred
        while name in self.used or keyword.iskeyword(name):
            name += "_"
        self.used.add(name)
        return name


class ModuleNames:
    """The names of one generated module: public parameters keep the spec's names where they
    can; internal names (locals, tables, grid coordinates) avoid every name the module uses."""

    def __init__(self, kernel):
        symbols = [s for s, _ in kernel.symbols]
        # The public functions' bodies use only these names besides their parameters.
        self.public = NameTable({"_prepare", "_impl", "_reference", "interpret"} | set(symbols))
        self.internal = NameTable(MODULE_NAMES | PYTHON_NAMES | FIXED_LOCALS | {kernel.name})
        self.functions = NameTable(MODULE_NAMES | {kernel.name})

    def local(self, preferred: str) -> str:
        return self.internal.take(preferred)

    def function(self, preferred: str) -> str:
        name = self.functions.take(preferred)
        self.internal.used.add(name)
        return name

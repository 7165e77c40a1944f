"""The Jinja environment every target's emitter renders with, and the helpers a module calls.

Generated modules carry only the host-side helpers they use (`templates/helpers.py.j2`),
helpers that helpers call included.
"""

from __future__ import annotations

import functools
import re

import jinja2

from .expr import render
from .jaxwindow import window_for
from .pytext import py_tuple
from .resources import resource_dir


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resource_dir("templates"))),
        bytecode_cache=_bytecode_cache(),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["py"] = lambda e: render(e, "py")
    env.filters["host"] = lambda e: render(e, "host")
    env.filters["pytuple"] = py_tuple
    env.filters["quote"] = lambda text: f'"{text}"'
    # Names as the targets of an assignment, or a return's tuple: "a, b", or "a," for one.
    env.filters["targets"] = lambda names: ", ".join(names) + ("," if len(names) == 1 else "")
    env.globals["jax_window"] = window_for  # the jax a target's modules state in their header and check
    return env


def _bytecode_cache() -> jinja2.BytecodeCache | None:
    """The templates compiled to Python once, kept in sparsegen's cache folder (jinja keys
    each by its name and the digest of its text): a process saves a quarter of a second
    of template compiling. None where the folder cannot be made."""
    from .resources import cache_dir  # one place says where sparsegen caches

    folder = cache_dir() / "templates"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return jinja2.FileSystemBytecodeCache(str(folder))


# Helpers emitted only where the module calls them (helpers calling helpers included).
_OPTIONAL = {
    "multiple": "_check_multiple", "span": "_check_span", "relate": "_relate", "blocks": "_as_blocks", "need": "_need",
    "coords": "_check_coords", "padding": "_check_padding", "offsets": "_check_offsets", "smem": "_check_smem",
    "next_live": "_next_live", "coo_steps": "_coo_steps", "block_kinds": "_block_kinds", "densify": "_densify",
    "gather": "_gather_blocks", "tails": "_mask_tail", "window": "_window", "join": "_block_slots", "zeros_for_none": "_zeros_for_none",
    "cut_blocks": "_cut_blocks", "blocks_of": "_blocks_of", "at_blocks": "_at_blocks", "add_blocks": "_add_blocks",
    "present": "_present", "expand": "_expand", "split_blocks": "_split_blocks", "join_blocks": "_join_blocks",
    "row_walk": "_row_walk", "block_min_max": "_block_min_max", "block_any_all": "_block_any_all", "extremes": "_max_of", "extremes_min": "_min_of",
    "floordiv": "_floordiv", "mod": "_mod", "whole": "_check_whole", "to_operand": "_to_operand", "scatter_blocks": "_scatter_blocks", "row_vector": "_row_vector", "softmax_rows": "_softmax_rows",
    "visited_product": "_visited_product", "page_bounds": "_page_bounds", "page_size": "_check_page_size",
    "matrix": "_matrix", "rows": "_rows", "width": "_width", "pad_to": "_pad_to", "unmatrix": "_unmatrix", "walk": "_walk", "deal": "_deal", "add_pieces": "_add_pieces", "gpu_interpret": "_gpu_interpret", "ring": "_ring_device",
    "coo_mesh": "_on_mesh_coo", "typed": "_typed", "typed_gradients": "_typed_gradients",
    "key_splits": "_key_splits", "lse_weights": "_lse_weights", "merge_splits": "_merge_splits", "split_lse": "_split_lse",
    "int32": "_int32", "group_presence": "_group_presence", "sat_add": "_sat_add", "sat_sub": "_sat_sub", "add_at": "_add_at", "pieces": "_pieces",
    "present_dot": "_present_dot", "present_step": "_present_step", "present_value": "_present_value", "present_add": "_present_add",
    "not_finite": "_not_finite", "present_values": "_present_values", "mma_update": "_mma_update",
}  # fmt: skip


def with_helpers(main: str) -> str:
    """A module's text with the helpers it calls in place of `{helpers}` (helpers that
    helpers call included)."""
    used = frozenset(fn for fn in _called(main) if fn in _OPTIONAL_NAMES)
    return main.replace("{helpers}", _helpers_text(used), 1)


_OPTIONAL_NAMES = frozenset(_OPTIONAL.values())
_CALL = re.compile(r"_\w+\(")
_WORD_CHAR = re.compile(r"\w")


def _called(text: str) -> set[str]:
    """The names `_name(` called in `text`, as `\\b(_\\w+)\\(` finds them (a leading `\\b` makes
    that regex slow; the word boundary is checked by hand)."""
    return {m.group()[:-1] for m in _CALL.finditer(text) if not m.start() or not _WORD_CHAR.match(text, m.start() - 1)}


@functools.lru_cache(maxsize=256)
def _helpers_text(used: frozenset[str]) -> str:
    """The helpers of a module that calls the optional helpers `used`, rendered once per set
    (a spec of many kernels asks for a handful of sets)."""
    env = environment()
    uses = {key: False for key in _OPTIONAL}
    called = set(used)
    for _ in range(3):  # helpers call helpers: until nothing new is used
        for key, fn in _OPTIONAL.items():
            uses[key] = uses[key] or fn in called
        called = set(used) | _called(env.get_template("helpers.py.j2").render(uses=uses))
    return env.get_template("helpers.py.j2").render(uses=uses).strip()

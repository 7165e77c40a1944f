"""Spec identifiers may be any non-keyword name: generated code keeps its own names apart.

Besides hand-written specs, hostile names are derived from the name tables the compiler
reserves (`sparsegen.names`: IMPORTS, HELPERS read from the helpers template, the module
names, FIXED_LOCALS), from the names the module template binds literally (`grid_spec`,
`sizes`, ...) and from the builtins the templates call: specs are generated whose
operands, indices and size symbols take every one of those names, in every walk, so a new
helper or fixed local is covered the day it is added. The row walk's (attention) names are
drawn from its generated code instead, so a name missing from the tables is still drawn.
"""

from __future__ import annotations

import builtins
import keyword
import re

import numpy as np
import pytest
from conftest import SWEEP, assert_matches, build, cpu_unless_sweep, in_both_modes
from oracle import oracle

from sparsegen import names as sg_names
from sparsegen.resources import read_resource
from sparsegen.testing import example_args

from hygiene_specs import MASKED_SDD, NASTY, NASTY_MASK, TRANSPOSED, XMASK_SDD  # noqa: E402


def run(text, sizes, pattern, interpret):
    kernel, mod = build(text)
    args, keywords = example_args(kernel, sizes, pattern, np.random.default_rng(3))
    out = getattr(mod, kernel.name)(*args, **keywords, interpret=interpret)
    assert_matches(kernel, out, oracle(kernel, args, keywords))
    return mod


@cpu_unless_sweep
def test_names_that_shadow_module_names(interpret):
    mod = run(NASTY, dict(np=256, len=256, pl=256), "random", interpret)
    import inspect

    # The public signature keeps the spec's names; only clashes are renamed.
    params = list(inspect.signature(mod.nasty).parameters)
    assert params[:4] == ["jnp_blocks", "jnp_idx_0", "jnp_idx_1", "_kernel"]
    assert "np" in params and "len" in params and "interpret" in params


@cpu_unless_sweep
def test_names_that_shadow_generated_locals(interpret):
    run(NASTY_MASK, dict(M=256, K=256, N=256), "tril", interpret)


@cpu_unless_sweep
def test_transposed_reads_and_a_mask_on_one_output_index(interpret):
    run(TRANSPOSED, dict(M=256, K=384, N=384), "empty_lines", interpret)


# The simulator (NaN-filled memory) where blocks are requested that the mask leaves empty,
# and where none is, the CPU interpreter the other patterns; every pattern in both under
# SPARSEGEN_SWEEP=1.
@pytest.mark.parametrize(*in_both_modes(["tril", "random", "all_empty", "all_full", "duplicates"], ["tril", "all_empty"], "pattern",
                                        alone=True), indirect=["interpret"])
def test_mask_input_with_coo_output(pattern, interpret):
    run(MASKED_SDD, dict(S=384, D=256, T=384), pattern, interpret)
    run(XMASK_SDD, dict(M=256, K=384, N=256), pattern, interpret)


# ----------------------------------------------------------------- derived hostile names


def _template_builtins() -> frozenset[str]:
    """Builtins the templates may call (a superset: any builtin named in their text)."""
    text = "".join(read_resource("templates", t) for t in ("helpers.py.j2", "module.py.j2", "tpu/module.py.j2"))
    words = set(re.findall(r"\b[A-Za-z_]\w*\b", text))
    return frozenset(w for w in words if w in dir(builtins) and not keyword.iskeyword(w) and not w.startswith("__"))


def _template_locals() -> frozenset[str]:
    """Names the module template (and the skeleton it extends) binds literally (not through a
    NameTable): module constants, locals such as `grid_spec = ...`, and parameters such as
    `sizes` and `interpret`."""
    text = "".join(read_resource("templates", t) for t in ("module.py.j2", "tpu/module.py.j2"))
    text = re.sub(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}", " ", text, flags=re.S)
    bound = set(re.findall(r"^\s*([A-Za-z_]\w*) = ", text, re.M))
    for params in re.findall(r"def\s+\w*\s*\((.*?)\)\s*:", text, re.S):
        bound |= set(re.findall(r"\b[A-Za-z_]\w*\b", re.sub(r"=[^,)]*", "", params)))  # not a default (`=None`)
    return frozenset(bound)


TABLES = sg_names.IMPORTS | sg_names.HELPERS | sg_names.MODULE_NAMES | sg_names.FIXED_LOCALS
TEMPLATE_LOCALS = _template_locals()
HOSTILE = sorted(TABLES | TEMPLATE_LOCALS | _template_builtins())
# What the checker refuses where (check.py): keywords anywhere; sizes named `interpret`,
# `max_steps` (keywords of the generated function) or after a helper. (Kernel names are not
# drawn from these tables: module names are refused.)
SIZE_NAMES = [n for n in HOSTILE if n not in ("interpret", "max_steps") and n not in sg_names.HELPERS]

# One spec per walk, with slots for operand names ({X}...), index names ({m} {n} {k}) and
# size symbols ({M} {N} {K}). Dense factors that cover the sparse one or apply at the end
# add operand slots where the walk supports them.
WALKS = {
    "dense": """
kernel {kernel} {{
    in  {X}: f32[{M}, {K}]
    in  {W}: f32[{M}, {K}]
    in  {Y}: f32[{K}, {N}]
    in  {S}: f32[{M}, {N}]
    out {O}: f32[{M}, {N}]
    {O}[{m}, {n}] = {S}[{m}, {n}] * {X}[{m}, {k}] * {W}[{m}, {k}] * {Y}[{k}, {n}]
    tile {m} = 128, {n} = 128, {k} = 128
}}
""",
    "coo_input": """
kernel {kernel} {{
    in  {X}: f32[{M}, {K}] coo
    in  {W}: f32[{M}, {K}]
    in  {Y}: f32[{K}, {N}]
    in  {S}: f32[{M}, {N}]
    out {O}: f32[{M}, {N}]
    {O}[{m}, {n}] = {S}[{m}, {n}] * {X}[{m}, {k}] * {W}[{m}, {k}] * {Y}[{k}, {n}]
    tile {m} = 128, {n} = 128, {k} = 128
}}
""",
    "mask": """
kernel {kernel} {{
    in  {X}: f32[{M}, {K}]
    in  {W}: f32[{M}, {K}]
    in  {Y}: f32[{K}, {N}]
    in  {S}: f32[{M}, {N}]
    in  {Q}: i32[{M}, {N}] mask
    out {O}: f32[{M}, {N}]
    {O}[{m}, {n}] = {Q}[{m}, {n}] * {S}[{m}, {n}] * {X}[{m}, {k}] * {W}[{m}, {k}] * {Y}[{k}, {n}]
    tile {m} = 128, {n} = 128, {k} = 128
}}
""",
    "coo_output": """
kernel {kernel} {{
    in  {X}: f32[{M}, {K}]
    in  {W}: f32[{M}, {K}]
    in  {Y}: f32[{K}, {N}]
    in  {S}: f32[{M}, {N}]
    out {O}: f32[{M}, {N}] coo
    {O}[{m}, {n}] = {S}[{m}, {n}] * {X}[{m}, {k}] * {W}[{m}, {k}] * {Y}[{k}, {n}]
    tile {m} = 128, {n} = 128, {k} = 128
}}
""",
    "coo_join": """
kernel {kernel} {{
    in  {X}: f32[{M}, {K}] coo
    in  {W}: f32[{M}, {K}]
    in  {Y}: f32[{K}, {N}]
    out {O}: f32[{M}, {N}] coo
    {O}[{m}, {n}] = {X}[{m}, {k}] * {W}[{m}, {k}] * {Y}[{k}, {n}]
    tile {m} = 128, {n} = 128, {k} = 128
}}
""",
    # Offsets on the left side; literal sizes (symbolic ones: see test_window.py).
    "window": """
kernel {kernel} {{
    in  {X}: f32[256, 256]
    in  {Y}: f32[256, 128]
    in  {A}: index[2]
    out {O}: f32[512, 384]
    {O}[{A}[0] + {m}, {A}[1] + {n}] = {X}[{m}, {k}] * {Y}[{k}, {n}]
    tile {m} = 128, {n} = 128, {k} = 128
}}
""",
}
ROLES = {"operand": ("X", "W", "Y", "S", "Q", "A", "O"), "index": ("m", "n", "k"), "size": ("M", "N", "K")}
NEUTRAL_SIZES = {"M": 256, "N": 128, "K": 256}


def _slots(template: str) -> dict[str, list[str]]:
    used = set(re.findall(r"(?<!\{)\{(\w+)\}(?!\})", template))
    return {role: [s for s in slots if s in used] for role, slots in ROLES.items()}


# Names the compiler once mishandled, each with its own test below too.
KNOWN_BUGS: dict[str, set[str]] = {}


def _eligible(role: str) -> list[str]:
    return [n for n in (SIZE_NAMES if role == "size" else HOSTILE) if n not in KNOWN_BUGS.get(role, ())]


def hostile_specs(walk: str) -> list[dict[str, str]]:
    """Slot assignments that give every hostile name every role (operand, index, size) the
    walk has slots for; names within one spec are distinct."""
    slots = _slots(WALKS[walk])
    pending = {role: list(_eligible(role)) for role in slots if slots[role]}
    specs = []
    while any(pending.values()):
        taken: set[str] = set()
        assignment = {}
        for role, names in slots.items():
            if not names:
                continue
            picks = [n for n in pending[role] if n not in taken][: len(names)]
            taken |= set(picks)
            # Fill the remaining slots with names already covered in this role.
            picks += [n for n in _eligible(role) if n not in taken][: len(names) - len(picks)]
            taken |= set(picks)
            pending[role] = [n for n in pending[role] if n not in picks]
            assignment.update(zip(names, picks))
        specs.append(assignment)
    return specs


HOSTILE_CASES = [(walk, n, a) for walk in WALKS for n, a in enumerate(hostile_specs(walk))]


def hostile_text(walk: str, n: int, assignment: dict[str, str]) -> str:
    return WALKS[walk].format(kernel=f"hostile_{walk}_{n}", **assignment)


def test_names_the_template_binds_are_reserved():
    """Every name the module template binds literally is in the tables that generated names
    avoid (a local missing there could take a spec's name and clobber it)."""
    missing = TEMPLATE_LOCALS - (sg_names.FIXED_LOCALS | sg_names.MODULE_NAMES)
    assert not missing, f"bound by templates/(tpu/)module.py.j2 but not reserved in sparsegen/names.py: {sorted(missing)}"


def test_hostile_names_cover_every_table_in_every_role():
    """The generated cases draw on the tables themselves: every helper, import, fixed local
    and module name is an operand, an index and (where allowed) a size, in every walk."""
    assert {"grid_spec", "sizes", "interpret", "reference", "jnp", "_kernel", "_coo_steps", "_block_kinds"} <= set(
        HOSTILE
    )
    assert sg_names.HELPERS <= set(HOSTILE) and "_fail" in sg_names.HELPERS  # helpers are read from the template
    for walk in WALKS:
        slots = _slots(WALKS[walk])
        for role, names in slots.items():
            if not names:
                continue
            covered = {a[s] for w, _, a in HOSTILE_CASES if w == walk for s in names}
            assert covered == set(_eligible(role)), (walk, role, set(_eligible(role)) - covered)


def _roles_of(walk: str, assignment: dict[str, str]) -> set[tuple[str, str]]:
    """(role, name) for every name a spec gives a role."""
    return {(role, assignment[s]) for role, slots in _slots(WALKS[walk]).items() for s in slots}


def run_subset(cases) -> set[tuple[str, int]]:
    """The specs that run, (walk, n): taken from the walks in turn, each time the spec of
    that walk that runs the most (role, name) pairs not yet run, until every hostile name
    has run in every role (in some walk). About one spec in five."""
    wanted = set().union(*(_roles_of(walk, a) for walk, _, a in cases))
    chosen: set[tuple[str, int]] = set()
    while wanted:
        for walk in WALKS:
            gain, n = max(((len(_roles_of(w, a) & wanted), n) for w, n, a in cases if w == walk and (w, n) not in chosen),
                          key=lambda g: (g[0], -g[1]), default=(0, None))
            if gain:
                chosen.add((walk, n))
                wanted -= _roles_of(walk, HOSTILE_ASSIGNMENTS[walk, n])
    return chosen


HOSTILE_ASSIGNMENTS = {(walk, n): a for walk, n, a in HOSTILE_CASES}
# The specs in `run_subset` (every hostile name in every role, in some walk) build and run
# their kernel in the CPU interpreter and their `reference`, both against the oracle; every
# spec does under SPARSEGEN_SWEEP=1 (each name in each role in every walk).
RUN = {(walk, n) for walk, n, _ in HOSTILE_CASES} if SWEEP else run_subset(HOSTILE_CASES)


def test_the_specs_that_run_run_every_name_in_every_role():
    """`run_subset` runs every (role, name) pair of the specs, and takes specs of every walk."""
    every = set().union(*(_roles_of(walk, a) for walk, _, a in HOSTILE_CASES))
    assert set().union(*(_roles_of(walk, HOSTILE_ASSIGNMENTS[walk, n]) for walk, n in RUN)) == every
    assert {walk for walk, _ in RUN} == set(WALKS)
    assert SWEEP or len(RUN) < len(HOSTILE_CASES) / 4, len(RUN)


RUN_CASES = [(walk, n, a) for walk, n, a in HOSTILE_CASES if (walk, n) in RUN]


@pytest.mark.parametrize("walk,n,assignment", RUN_CASES, ids=[f"{w}-{n}" for w, n, _ in RUN_CASES])
def test_hostile_names_build_and_run(walk, n, assignment):
    # Unformatted: black changes layout only, and would take most of these builds.
    kernel, mod = build(hostile_text(walk, n, assignment), formatted=False)
    sizes = {assignment[s]: v for s, v in NEUTRAL_SIZES.items() if s in assignment}
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(n))
    expected = oracle(kernel, args, keywords)
    assert_matches(kernel, getattr(mod, kernel.name)(*args, **keywords, interpret=True), expected)
    assert_matches(kernel, mod.reference(*args, **keywords), expected)


@pytest.mark.parametrize("walk", sorted(WALKS))
def test_operand_named_check_interpret(walk):
    assignment = dict(hostile_specs(walk)[0])
    assignment["Y"] = "_check_interpret"  # a dense input: its parameter keeps the name
    assert "_check_interpret" in sg_names.HELPERS
    kernel, mod = build(hostile_text(walk, 0, assignment))
    sizes = {assignment[s]: v for s, v in NEUTRAL_SIZES.items() if s in assignment}
    args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(0))
    assert_matches(kernel, getattr(mod, kernel.name)(*args, **keywords, interpret=True), oracle(kernel, args, keywords))


def _builtins_the_module_calls(text: str, neutral: str) -> list[str]:
    _, mod = build(text.replace("KERNEL", neutral))
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(mod))
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return sorted(n for n in called if n in dir(builtins))


KERNEL_NAMED = """
kernel KERNEL {
    in  x: f32[M, K] coo
    in  y: f32[K, N]
    out o: f32[M, N]
    o[m, n] = x[m, k] * y[k, n]
    tile m = 128, n = 128, k = 128
}
"""


def test_kernel_named_after_a_builtin_the_module_calls():
    """The language page allows any non-keyword kernel name (module names aside): a kernel
    named `len` must work, or be refused by the checker with a message."""
    from sparsegen.compiler import compile_source
    from sparsegen.source import SourceFile, SpecError

    called = _builtins_the_module_calls(KERNEL_NAMED, "neutral")
    assert {"len", "isinstance"} <= set(called)
    broken = {}
    for name in called:
        text = KERNEL_NAMED.replace("KERNEL", name)
        try:
            compile_source(SourceFile("k.spk", text))
        except SpecError:
            continue  # refused with a diagnostic: fine
        kernel, mod = build(text)
        args, keywords = example_args(kernel, dict(M=256, K=256, N=128), "random", np.random.default_rng(0))
        try:
            out = getattr(mod, name)(*args, **keywords, interpret=True)
            assert_matches(kernel, out, oracle(kernel, args, keywords))
        except Exception as exc:  # noqa: BLE001 - any failure counts
            broken[name] = f"{type(exc).__name__}: {exc}"[:120]
    assert not broken, broken


# --------------------------------------------- the row walk's own names, from its code
# The names above come from the compiler's tables: a name dropped from a table drops out of
# its test too. Here they come from what the code binds instead: every name the generated
# attention modules bind (functions, nested functions, parameters, locals, imports) that
# does not derive from a spec's identifiers, and every name the templates bind literally.
# Each becomes a lead index that the elementwise chain and the condition read (a lead
# index is a local of every kernel, index map and classification), and other roles too.

ATTENTION_COVER = [
    # Everything the walk has: a data-dependent condition (segment ids, a mask), grouped
    # heads, float operands in the chain per block, row, key and head, three row outputs.
    """kernel {kernel} {{
    in  {q}: f32[{B}, {H}, {S}, 64]
    in  {k}: f32[{B}, {G}, {S}, 64]
    in  {v}: f32[{B}, {G}, {S}, 64]
    in  {bias}: f32[{H}, {S}, {S}]
    in  {slope}: f32[{H}]
    in  {qb}: f32[{B}, {H}, {S}]
    in  {kb}: f32[{B}, {S}]
    in  {seg}: i32[{B}, {S}]
    in  {keep}: i8[{S}, {S}] mask
    out {o}: f32[{B}, {H}, {S}, 64]
    out {lse}: f32[{B}, {H}, {S}]
    out {tot}: f32[{B}, {H}, {S}]
    {raw}[{b}, {h}, {i}, {j}] = {q}[{b}, {h}, {i}, {d}] * {k}[{b}, {h} // 2, {j}, {d}] * 0.125
    {s}[{b}, {h}, {i}, {j}] = {raw}[{b}, {h}, {i}, {j}] + {bias}[{h}, {i}, {j}] - {slope}[{h}] * abs({i} - {j}) + {qb}[{b}, {h}, {i}] * tanh({kb}[{b}, {j}]) where {i} >= {j} and {seg}[{b}, {i}] == {seg}[{b}, {j}] and {keep}[{i}, {j}]
    {o}[{b}, {h}, {i}, {e}] = softmax({s}[{b}, {h}, {i}, {j}], {j}) * {v}[{b}, {h} // 2, {j}, {e}]
    {lse}[{b}, {h}, {i}] = logsumexp({s}[{b}, {h}, {i}, {j}], {j})
    {tot}[{b}, {h}, {i}] = sum({s}[{b}, {h}, {i}, {j}], {j})
    tile {b} = 1, {h} = 1, {i} = 128, {j} = 128, {d} = 64, {e} = 64
}}
""",
    # Stored softmax and scores, a max, sizes in the condition and the expression.
    """kernel {kernel} {{
    in  {q}: bf16[{S}, 128]
    in  {k}: bf16[{T}, 128]
    out {p}: f32[{S}, {T}]
    out {sc}: f32[{S}, {T}]
    out {m}: f32[{S}]
    {s}[{i}, {j}] = {q}[{i}, {d}] * {k}[{j}, {d}] where {i} - {j} < 300 and {i} + {T} - {S} >= {j}
    {p}[{i}, {j}] = softmax({s}[{i}, {j}], {j})
    {sc}[{i}, {j}] = 2.0 * {s}[{i}, {j}] / {T}
    {m}[{i}] = max({s}[{i}, {j}], {j})
    tile {i} = 128, {j} = 256, {d} = 128
}}
""",
]


def _slot_names(template: str) -> list[str]:
    return sorted(set(re.findall(r"(?<!\{)\{(\w+)\}(?!\})", template)))


def _bound_names(code: str) -> set[str]:
    """Every name a module binds: functions (nested too), parameters, assignment targets,
    loop and comprehension variables, imports."""
    import ast

    out = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.alias):
            out.add(node.asname or node.name.split(".")[0])
    return out


def _generated_fixed_names() -> frozenset[str]:
    """Names the generated attention modules bind whatever the spec calls things: the
    modules of ATTENTION_COVER with two different sets of spec names, intersected."""
    from sparsegen.compiler import lower_source
    from sparsegen.source import SourceFile
    from sparsegen.tpu.attention.emit import AttentionEmitter

    fixed = None
    for variant in ("x", "y"):
        names = set()
        for n, template in enumerate(ATTENTION_COVER):
            assignment = {s: f"{s}{variant}{variant}" for s in _slot_names(template)}
            assignment["kernel"] = f"cover{n}{variant}"
            (m,) = lower_source(SourceFile("cover.spk", template.format(**assignment)), "v5e")
            names |= _bound_names(AttentionEmitter(m).module("cover.spk", formatted=False))  # black binds nothing
        fixed = names if fixed is None else fixed & names
    return frozenset(fixed)


def _template_bound_names(template: str) -> frozenset[str]:
    """Names a template binds literally: def names, parameters, assignment targets."""
    text = re.sub(r"\{\{.*?\}\}|\{%.*?%\}|\{#.*?#\}", " ", read_resource("templates", template), flags=re.S)
    bound = set(re.findall(r"^\s*def\s+([A-Za-z_]\w*)", text, re.M))
    bound |= {n for targets in re.findall(r"^\s*([A-Za-z_][\w, ]*?) = ", text, re.M) for n in re.findall(r"[A-Za-z_]\w*", targets)}
    for params in re.findall(r"def\s+\w*\s*\((.*?)\)\s*:", text, re.S):
        bound |= set(re.findall(r"\b[A-Za-z_]\w*\b", re.sub(r"=[^,)]*", "", params)))
    return frozenset(bound)


# Helpers' own locals and parameters live in the helpers' scopes: only their names count. The
# skeleton's (templates/module.py.j2) names an attention module binds are in the generated code.
WALK_NAMES = sorted(
    (_generated_fixed_names() | _template_bound_names("tpu/attention.py.j2") | sg_names.HELPERS) - set(keyword.kwlist)
)
LEADS_PER_SPEC = 20


def walk_spec(n: int) -> tuple[str, dict[str, str]]:
    """The n-th spec: LEADS_PER_SPEC of WALK_NAMES as its lead indices (the last of size 2,
    the rest 1), read in the chain and the condition; names further on for its operands,
    locals, other indices and the sequence length. Odd specs classify from segment ids."""
    leads = [WALK_NAMES[(n * LEADS_PER_SPEC + x) % len(WALK_NAMES)] for x in range(LEADS_PER_SPEC)]
    roles = ["Q", "K", "V", "O", "L", "G", "R", "T", "i", "j", "d", "e"]
    start = (n * LEADS_PER_SPEC + len(WALK_NAMES) // 2) % len(WALK_NAMES)
    pool = [x for x in WALK_NAMES[start:] + WALK_NAMES[:start] if x not in leads]
    assignment = dict(zip(roles, pool))
    assignment["S"] = next(x for x in pool[len(roles):] if x in SIZE_NAMES)
    dims = ", ".join(["1"] * (LEADS_PER_SPEC - 1) + ["2"])
    lead = ", ".join("{%s}" % f"a{x}" for x in range(LEADS_PER_SPEC)).format(**{f"a{x}": a for x, a in enumerate(leads)})
    tiles = ", ".join(f"{a} = 1" for a in leads)
    spread = " + ".join(f"{x + 1} * {a}" for x, a in enumerate(leads))
    a = assignment
    segments = n % 2 == 1
    text = f"""kernel walk_names_{n} {{
    in  {a['Q']}: f32[{dims}, {a['S']}, 128]
    in  {a['K']}: f32[{dims}, {a['S']}, 128]
    in  {a['V']}: f32[{dims}, {a['S']}, 128]{f'''
    in  {a['G']}: i32[2, {a['S']}]''' if segments else ''}
    out {a['O']}: f32[{dims}, {a['S']}, 128]
    out {a['L']}: f32[{dims}, {a['S']}]
    {a['R']}[{lead}, {a['i']}, {a['j']}] = {a['Q']}[{lead}, {a['i']}, {a['d']}] * {a['K']}[{lead}, {a['j']}, {a['d']}] * 0.125
    {a['T']}[{lead}, {a['i']}, {a['j']}] = {a['R']}[{lead}, {a['i']}, {a['j']}] - 0.01 * ({spread}) * {a['j']} where {a['i']} + 64 * ({spread}) >= {a['j']}{f" and {a['G']}[{leads[-1]}, {a['i']}] == {a['G']}[{leads[-1]}, {a['j']}]" if segments else ''}
    {a['O']}[{lead}, {a['i']}, {a['e']}] = softmax({a['T']}[{lead}, {a['i']}, {a['j']}], {a['j']}) * {a['V']}[{lead}, {a['j']}, {a['e']}]
    {a['L']}[{lead}, {a['i']}] = logsumexp({a['T']}[{lead}, {a['i']}, {a['j']}], {a['j']})
    tile {tiles}, {a['i']} = 128, {a['j']} = 128, {a['d']} = 128, {a['e']} = 128
}}
"""
    return text, {**assignment, "leads": leads}


WALK_SPECS = -(-len(WALK_NAMES) // LEADS_PER_SPEC)


def test_walk_names_come_from_the_code():
    """The row walk's literal names are drawn (whether or not a table reserves them), and
    every one is some spec's lead index."""
    assert {"_partial", "_full", "_step", "_scores", "_chain", "masked", "bound", "overflow", "xp", "can", "must",
            "_visited_product", "grid_spec", "residuals", "cotangent"} <= set(WALK_NAMES)
    leads = {x for n in range(WALK_SPECS) for x in walk_spec(n)[1]["leads"]}
    assert leads == set(WALK_NAMES)


def build_unformatted(text: str):
    """(kernel, module) of an attention spec, the module as emitted before black formats
    it (the same code; black takes most of the build time of names this long)."""
    import importlib.util
    import sys

    from conftest import BUILD_CACHE

    from sparsegen.compiler import lower_source
    from sparsegen.source import SourceFile
    from sparsegen.tpu.attention.emit import AttentionEmitter

    (m,) = lower_source(SourceFile("walk_names.spk", text), "v5e")
    BUILD_CACHE.mkdir(parents=True, exist_ok=True)
    path = BUILD_CACHE / f"{m.name}_unformatted.py"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(AttentionEmitter(m).module("walk_names.spk", formatted=False))
    tmp.replace(path)
    spec = importlib.util.spec_from_file_location(f"sparsegen_test_{m.name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return m.kernel, mod


@pytest.mark.parametrize("n", range(WALK_SPECS))
def test_walk_names_as_lead_indices(n):
    """Every third spec (with and without segment ids; every spec under SPARSEGEN_SWEEP=1):
    the kernel and `reference` against the f64 oracle; the others trace both under jit
    (what binds and reads the names; a run compiles twenty nested grid axes), their outputs'
    shapes the oracle's. The gradient kernels traced (compared with `reference`'s gradient
    as well under SPARSEGEN_SWEEP=1)."""
    import jax
    import jax.numpy as jnp
    from attention_oracle import run as attention_oracle
    from test_attention import assert_gradients_match, gradients

    text, a = walk_spec(n)
    kernel, mod = build_unformatted(text)
    rng = np.random.default_rng(n)
    S = 200
    shape = (1,) * (LEADS_PER_SPEC - 1) + (2, S, 128)
    args = [jnp.asarray(rng.standard_normal(shape).astype(np.float32)) for _ in range(3)]
    if n % 2:
        args.append(jnp.asarray(np.sort(rng.integers(0, 3, (2, S))).astype(np.int32)))
    fn = getattr(mod, kernel.name)
    want = attention_oracle(kernel, [np.asarray(x) for x in args], {a["S"]: S})
    runs = (lambda *x: fn(*x, interpret=True), mod.reference)
    for run in runs:
        if SWEEP or n % 3 == 0:
            for g, w in zip(run(*args), want):
                np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-4, atol=2e-4)
        else:
            traced = jax.make_jaxpr(run)(*args)
            assert [tuple(v.aval.shape) for v in traced.jaxpr.outvars] == [np.shape(w) for w in want]

    def kernel_gradients(*x):
        return gradients(lambda *y: fn(*y, interpret=True), list(x), 3)

    if SWEEP:
        assert_gradients_match(kernel_gradients(*args), gradients(mod.reference, args, 3), bf16=False)
    else:
        # The forward and the backward (one fused walk, or dq and dk/dv), each a pallas_call.
        assert str(jax.make_jaxpr(kernel_gradients)(*args)).count("pallas_call") >= 2


def test_an_operand_named_like_a_key_side_map():
    """The key-side walk's index maps are the row walk's names plus a suffix; a spec name
    equal to one (`_delta_cols_map_by_key`) shadowed the map inside the backward (a crash
    under jax.grad): the suffixed names are drawn like every function's."""
    import jax
    import jax.numpy as jnp
    from conftest import build

    text = """kernel clash {
    in  q: f32[S, D]
    in  k: f32[S, D]
    in  _delta_cols_map_by_key: f32[S, D]
    out o: f32[S, D]

    s[i, j] = q[i, d] * k[j, d] where i >= j
    o[i, e] = softmax(s[i, j], j) * _delta_cols_map_by_key[j, e]

    tile i = 128, j = 128, d = 128, e = 128
}
"""
    _, mod = build(text, formatted=False)
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal((256, 128)).astype(np.float32)) for _ in range(3)]
    got = jax.grad(lambda *a: mod.clash(*a, interpret=True).sum(), argnums=(0, 1, 2))(*args)
    want = jax.grad(lambda *a: mod.reference(*a).sum(), argnums=(0, 1, 2))(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)

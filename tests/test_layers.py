"""The layers of `sparsegen/`: no import cycle, TPU and GPU siblings, no import from a layer up.

Read from the source with `ast` (nothing is imported): every `import` and `from ... import`
of a sparsegen module, relative ones resolved, those inside functions (lazy imports) counted
like the rest. An edge goes to the module named (`from .x import y` is an edge to `x.y` where
`x/y.py` exists, else to `x`); the parent packages an import runs on the way are not edges.

The allow-lists below name the imports that still break a rule, each with why it stands; they
may only shrink: an entry that no longer occurs fails the test, so a fix removes its entry.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "sparsegen"

# The layers, lowest first: a module may import from its own layer and those below it. A name
# ending in ".*" takes a package and everything in it; otherwise a module by its exact name
# (a package's `__init__` is the package's name). Every module of `sparsegen/` is in one layer.
LAYERS: list[tuple[str, list[str]]] = [
    # What every stage stands on and that knows no spec: spans and errors, packaged files,
    # the targets by name and backend, dtypes, expression trees, Python text, black, the JAX
    # environment, reserved names.
    (
        "base",
        ["source", "resources", "targets", "dtypes", "allocation", "expr", "pytext", "formatting", "formats", "jaxenv", "names"],
    ),
    # Spec text to a syntax tree.
    ("front end", ["syntax"]),
    # The checked kernels and what is derived from them alone: the checker builds the IR
    # (flow, check), then the calling convention, gradients, term rendering, patterns.
    ("IR", ["ir", "flow", "check", "callconv", "autodiff", "terms", "patterns"]),
    # Which blocks each walk visits, in what order, through which tables.
    ("schedule", ["schedule.*"]),
    # What every target shares above the schedule: the base of every lowered module, shapes
    # and argument makers, the mesh plan, the ring, the wrapper and the Jinja environment
    # (`templating`, `jaxwindow`), and the walks' backend-neutral halves (`walks.*`).
    ("block program", ["lowered", "shapes", "testing", "mesh", "ring", "wrapper", "templating", "jaxwindow", "walks.*"]),
    # The targets, siblings: neither imports the other (test_tpu_and_gpu_are_siblings).
    ("targets", ["tpu.*", "gpu.*"]),
    # One path from spec to module, and the commands around it.
    ("driver", ["backends", "compiler", "inprocess", "cli", "cycles", "verify", "variants", "__main__", ""]),
]

# Imports from a layer up that stand today, (importer, imported) with the reason; only shrinks.
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}

# Inside each target the same stages, lowest first (names relative to the target's package; ""
# is the package itself). The rules sit with the lowering: a TPU lowering calls its rules
# (`tpu/lower.py`), the rules read the lowered modules (`AttentionModule`), and the GPU
# lowering calls its rules inside (issue 38 item 3 makes them a stage of the pipeline).
TARGET_LAYERS: dict[str, list[tuple[str, list[str]]]] = {
    "tpu": [
        ("chip facts", ["targets", "layout", "vmem"]),
        ("lowering and rules", ["lower", "rules", "attention.lower", "paged.lower"]),
        ("kernel text", ["body", "attention.kernels", "describe", "attention.describe", "paged.describe"]),
        ("emit", ["emit", "attention.emit", "paged.emit", "attention", "paged"]),
        ("tools", ["arguments", "simulate", "attention.simulate", "picture", "cycles", "suggest", "verify"]),
    ],
    "gpu": [
        ("chip facts", ["targets"]),
        (
            "lowering and rules",
            [
                "plan",
                "rules",
                "lower",
                "elementwise",
                "product",
                "attention.backward",
                "attention.lower",
                "paged.lower",
            ],
        ),
        ("kernel text", ["describe", "attention.describe", "paged.describe", "attention.backward_kernels"]),
        ("emit", ["emit", "attention.emit", "paged.emit", "attention", "paged", ""]),
        ("tools", ["verify", "stage3"]),
    ],
}

# tpu/ <-> gpu/ imports that stand today; only shrinks.
SIBLING_ALLOWED: dict[tuple[str, str], str] = {}
# GPU templates that extend, include or import a TPU one (or the reverse); only shrinks.
TEMPLATE_SIBLING_ALLOWED: dict[tuple[str, str], str] = {}

# Import cycles (sets of modules) that stand today; only shrinks. An import cycle through
# layers holds an import from a layer up: the cycle test leaves out the edges UPWARD_ALLOWED
# forgives, so once that list is empty it sees every edge.
CYCLES_ALLOWED: dict[frozenset[str], str] = {}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name (without `sparsegen.`; the package itself is "") -> (file, is a package)."""
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, package)
    return found


def _imports() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, package) in modules.items():
        here = name.split(".") if name else []
        if not package:
            here = here[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                elif node.module == "sparsegen" or (node.module or "").startswith("sparsegen."):
                    module = node.module.removeprefix("sparsegen").removeprefix(".")
                else:
                    continue
                named = [
                    f"{module}.{a.name}".lstrip(".") if f"{module}.{a.name}".lstrip(".") in modules else module
                    for a in node.names
                ]
            else:
                continue
            for target in named:
                if isinstance(node, ast.Import):
                    if not (target == "sparsegen" or target.startswith("sparsegen.")):
                        continue
                    target = target.removeprefix("sparsegen").removeprefix(".")
                assert target in modules, f"{name} imports {target!r}, which is no module of sparsegen"
                if target != name:
                    targets.add(target)
        graph[name] = targets
    return graph


def _layer_of(module: str) -> int:
    for rank, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".*") and (module + ".").startswith(member[:-1])):
                return rank
    raise AssertionError(f"sparsegen.{module} is in no layer: add it to LAYERS in {__file__}")


def _show(module: str) -> str:
    return f"sparsegen.{module}" if module else "sparsegen"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    for module in _modules():
        _layer_of(module)


def test_no_import_cycle():
    graph = {a: {b for b in targets if (a, b) not in UPWARD_ALLOWED} for a, targets in _imports().items()}
    found = {frozenset(c) for c in _cycles(graph)}
    new = [sorted(c) for c in found - CYCLES_ALLOWED.keys()]
    assert not new, "import cycles: " + "; ".join(" <-> ".join(map(_show, c)) for c in new)
    gone = [sorted(c) for c in CYCLES_ALLOWED.keys() - found]
    assert not gone, "no longer a cycle, remove from CYCLES_ALLOWED: " + "; ".join(" <-> ".join(c) for c in gone)


def _family(module: str) -> str | None:
    head = module.split(".")[0]
    return head if head in ("tpu", "gpu") else None


def test_tpu_and_gpu_are_siblings():
    found = {
        (a, b)
        for a, targets in _imports().items()
        for b in targets
        if _family(a) and _family(b) and _family(a) != _family(b)
    }
    new = sorted(found - SIBLING_ALLOWED.keys())
    assert not new, "tpu/ and gpu/ import each other: " + ", ".join(f"{_show(a)} -> {_show(b)}" for a, b in new)
    gone = sorted(SIBLING_ALLOWED.keys() - found)
    assert not gone, "no longer imported, remove from SIBLING_ALLOWED: " + ", ".join(f"{a} -> {b}" for a, b in gone)


_TEMPLATES = ROOT.parent / "templates"
_TEMPLATE_USE = re.compile(r"""{%-?\s*(?:extends|include|import|from)\s+["']([^"']+)["']""")


def test_gpu_and_tpu_templates_are_siblings():
    found = set()
    for path in sorted(_TEMPLATES.rglob("*.j2")):
        name = path.relative_to(_TEMPLATES).as_posix()
        for used in _TEMPLATE_USE.findall(path.read_text()):
            families = {name.split("/")[0], used.split("/")[0]}
            if families == {"tpu", "gpu"}:
                found.add((name, used))
    new = sorted(found - TEMPLATE_SIBLING_ALLOWED.keys())
    assert not new, "GPU and TPU templates use each other: " + ", ".join(f"{a} -> {b}" for a, b in new)
    gone = sorted(TEMPLATE_SIBLING_ALLOWED.keys() - found)
    assert not gone, "no longer used, remove from TEMPLATE_SIBLING_ALLOWED: " + ", ".join(
        f"{a} -> {b}" for a, b in gone
    )


def test_no_import_from_a_layer_up():
    found = {(a, b) for a, targets in _imports().items() for b in targets if _layer_of(b) > _layer_of(a)}
    new = sorted(found - UPWARD_ALLOWED.keys())
    assert not new, "imports from a layer up: " + ", ".join(
        f"{_show(a)} ({LAYERS[_layer_of(a)][0]}) -> {_show(b)} ({LAYERS[_layer_of(b)][0]})" for a, b in new
    )
    gone = sorted(UPWARD_ALLOWED.keys() - found)
    assert not gone, "no longer imported, remove from UPWARD_ALLOWED: " + ", ".join(f"{a} -> {b}" for a, b in gone)


def _target_layer_of(module: str) -> tuple[str, int] | None:
    """(target, rank) of a module of tpu/ or gpu/, None for others."""
    family = _family(module)
    if family is None:
        return None
    inner = module.removeprefix(family).removeprefix(".")
    for rank, (_, members) in enumerate(TARGET_LAYERS[family]):
        if inner in members:
            return family, rank
    raise AssertionError(f"sparsegen.{module} is in no layer of its target: add it to TARGET_LAYERS in {__file__}")


def test_no_import_from_a_layer_up_inside_a_target():
    found = []
    for a, targets in _imports().items():
        here = _target_layer_of(a)
        for b in targets:
            there = _target_layer_of(b)
            if here and there and here[0] == there[0] and there[1] > here[1]:
                layers = TARGET_LAYERS[here[0]]
                found.append(f"{_show(a)} ({layers[here[1]][0]}) -> {_show(b)} ({layers[there[1]][0]})")
    assert not found, "imports from a layer up inside a target: " + ", ".join(sorted(found))


def test_the_checker_sees_lazy_and_relative_imports():
    """The reader itself: a lazy relative import inside a function is an edge."""
    graph = _imports()
    assert "schedule.attention" in graph["shapes"]  # `from .schedule.attention import ...` inside a function
    assert "tpu.verify" in graph["verify"]  # `from .tpu import verify as tpu_verify`

"""Kernels from Python without files: `sparsegen.compile(spec_text)` and `sparsegen.load(path)`.

The module returned is the code `sparsegen build` writes for the same spec (same bytes),
imported from a file in the user's cache folder (platformdirs' user cache dir, or
`SPARSEGEN_CACHE_DIR`), named by a digest of what decides its text: the spec, the name the
header gives it, the target, and sparsegen itself (its version and the digest of its code,
templates and grammar, so an edited checkout never reads a stale module). A second call with
the same spec returns the same module object; a new process reads the cached file without
compiling. A spec problem raises `SpecError`, whose text is the `FILE:LINE:COL: error:`
report with the source line and a caret.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from .compiler import compile_source
from .resources import cache_dir
from .source import SourceFile
from .targets import DEFAULT_TARGET

_PACKAGE = Path(__file__).resolve().parent


@functools.cache
def _compiler_digest() -> str:
    """sparsegen's version and the digest of every file that shapes generated code."""
    from .resources import resource_dir

    h = hashlib.sha256(_version().encode())
    folders = [_PACKAGE, resource_dir("templates"), resource_dir("grammars")]
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.suffix in (".py", ".j2", ".lark"):
                h.update(path.relative_to(folder).as_posix().encode())
                h.update(path.read_bytes())
    return h.hexdigest()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sparsegen")
    except PackageNotFoundError:
        return "unknown"


def compile(source: str, target: str = DEFAULT_TARGET, *, kernel: str | None = None, name: str = "<spec>") -> ModuleType:
    """The generated module of a kernel in spec text, imported.

    `kernel` names the kernel where the spec defines several; `name` is how diagnostics and
    the module's header name the spec. Raises `SpecError` for a spec problem and
    `ValueError` for an unknown target or kernel."""
    from .backends import chip_of

    try:
        chip_of(target)
    except Exception as exc:
        raise ValueError(f"sparsegen.compile: unknown target {target!r}: {exc}") from None
    spec = SourceFile(name, source)
    key = hashlib.sha256("\n".join([_compiler_digest(), target, name, spec.text]).encode()).hexdigest()[:24]
    folder, names = _kernels.get(key) or (cache_dir(), _read_index(cache_dir(), key))
    if names is None:
        modules = compile_source(spec, target)
        folder = _write(folder, {f"{m.kernel}-{key}.py": m.code for m in modules}, f"{key}.kernels")
        names = [m.kernel for m in modules]
    _kernels[key] = folder, names
    chosen = _choose(names, kernel, name)
    if (key, chosen) not in _loaded:
        _loaded[key, chosen] = _import(f"sparsegen_compiled.{chosen}_{key}", folder / f"{chosen}-{key}.py")
    return _loaded[key, chosen]


def load(path: str | os.PathLike, target: str = DEFAULT_TARGET, *, kernel: str | None = None) -> ModuleType:
    """`compile` of a spec file; the header names the file as the path is given."""
    spec = SourceFile.read(path)
    return compile(spec.text, target, kernel=kernel, name=spec.name)


_kernels: dict[str, tuple[Path, list[str]]] = {}  # digest -> where its modules are, and the spec's kernels in order
_loaded: dict[tuple[str, str], ModuleType] = {}


def _choose(names: list[str], kernel: str | None, spec: str) -> str:
    if kernel is None:
        if len(names) == 1:
            return names[0]
        raise ValueError(f"sparsegen.compile: {spec} defines kernels {', '.join(names)}: name one with kernel=")
    if kernel not in names:
        raise ValueError(f"sparsegen.compile: {spec} defines no kernel {kernel!r} (its kernels: {', '.join(names)})")
    return kernel


def _read_index(folder: Path, key: str) -> list[str] | None:
    """The kernels a compile of `key` wrote to `folder` (its index is written last), or None."""
    try:
        names = (folder / f"{key}.kernels").read_text(encoding="utf-8").split()
    except OSError:
        return None
    return names if all((folder / f"{n}-{key}.py").is_file() for n in names) else None


def _import(module_name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _write(folder: Path, files: dict[str, str], index: str) -> Path:
    """The modules written whole into `folder` (a private temporary folder where that cannot
    be written), then the index naming them: another process may read or write them at once."""
    for where in (folder, None):
        try:
            where = where or Path(tempfile.mkdtemp(prefix="sparsegen-"))
            where.mkdir(parents=True, exist_ok=True)
            for filename, text in [*files.items(), (index, "\n".join(n.rsplit("-", 1)[0] for n in files) + "\n")]:
                path = where / filename
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, path)
            return where
        except OSError:
            continue
    raise OSError("sparsegen.compile: no folder to write the module in")


__all__ = ["cache_dir", "compile", "load"]

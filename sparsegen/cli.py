"""The `sparsegen` command: build, check, plan (none of them imports jax) and verify.

Exit status: 0 on success, 1 when a spec has problems (or `check` finds stale
modules), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import errno
import gc
import os
import re
import sys
import tempfile
from pathlib import Path

from collections.abc import Callable

from .allocation import no_cycle_collection
from .compiler import Module, can_fork, check_source, compile_for_targets, emit_in_parallel, parallel_jobs, plans
from .source import SourceFile, SpecError
from .backends import analyse_module, describe_module
from .targets import BACKEND_OF, DEFAULT_TARGET, is_gpu, names_of


def describe(m) -> list[str]:
    return describe_module(m)


def _resolved(path: str | Path) -> Path:
    # os.path.realpath, not Path.resolve: that raises RuntimeError on a symlink loop.
    return Path(os.path.realpath(path))


def _project_root(out: Path) -> Path | None:
    """The nearest folder at or above `out` holding pyproject.toml or .git."""
    out = _resolved(out)
    for root in (out, *out.parents):
        if os.path.exists(root / "pyproject.toml") or os.path.exists(root / ".git"):
            return root
    return None


def _origin(spec: str, out: Path) -> str:
    """How a module written to `out` names its spec in its header: relative to the project
    root of `out` (the nearest folder at or above it holding pyproject.toml or .git), else
    by file name. Output then does not depend on how the path is spelled or on the cwd."""
    path, root = _resolved(spec), _project_root(out)
    if root is not None and path.is_relative_to(root):
        return path.relative_to(root).as_posix()
    return path.name


def _other_spec(path: Path, spec: str, out: Path) -> str | None:
    """The spec named in the header of the module at `path`, where that is another spec file
    that exists (one defining a kernel of the same name built it); None otherwise (the same
    spec, or one since moved or renamed: a rebuild is the remedy)."""
    found = _RECORDED_SOURCE.match(_header(path) or "")
    if not found or found[1] == _origin(spec, out):
        return None
    root = _project_root(out)
    where = (root if root is not None else _resolved(spec).parent) / found[1]
    return found[1] if where.is_file() and _resolved(where) != _resolved(spec) else None


def _compile_all(specs: list[str], target_of: Callable[[str], str], out: Path, jobs: int | None = 1) -> list[tuple[str, Module]] | None:
    """Compile every spec for `out`, each kernel for the target `target_of(kernel name)`;
    print every problem and return None if any spec fails. `jobs`: processes to lower and
    emit in (None: the cores available; `_in_parallel`)."""
    unique: list[str] = []
    seen: set[Path] = set()
    for spec in specs:
        if _resolved(spec) in seen:
            continue  # another spelling of a file already given (./a.spk, an absolute path, a link)
        seen.add(_resolved(spec))
        unique.append(spec)
    done, checked = _in_parallel(unique, target_of, out, jobs)
    modules: list[tuple[str, Module]] = []
    failed = False
    for spec in unique:
        if spec in done:
            modules += [(spec, m) for m in done[spec]]
            continue
        try:
            source, kernels = checked.get(spec, (None, None))
            modules += [(spec, m) for m in compile_for_targets(source or SourceFile.read(spec), target_of, origin=_origin(spec, out), kernels=kernels)]
        except SpecError as exc:
            print(exc.render(), file=sys.stderr)
            failed = True
    owners: dict[str, str] = {}
    for spec, m in modules:
        if m.kernel in owners and owners[m.kernel] != spec:
            print(f"{spec}: error: kernel '{m.kernel}' is also defined in {owners[m.kernel]}; both would write {m.kernel}.py", file=sys.stderr)
            failed = True
        owners.setdefault(m.kernel, spec)
    return None if failed else modules


def _in_parallel(specs: list[str], target_of: Callable[[str], str], out: Path, jobs: int | None) -> tuple[dict, dict]:
    """With more than one job where forking is safe: the specs checked here, and their
    kernels lowered and emitted by worker processes (`compiler.emit_in_parallel`). Returns
    the modules of the specs whose kernels all came back, and (source, kernels) of those
    checked; `_compile_all` compiles the others itself, which reports their problems."""
    if not can_fork(jobs):
        return {}, {}
    checked = {}
    with no_cycle_collection():
        for spec in specs:
            try:
                source = SourceFile.read(spec)
                checked[spec] = (source, check_source(source))
            except SpecError:
                pass  # compiled again by `_compile_all`, which reports it
    work = [(spec, k) for spec, (_, kernels) in checked.items() for k in kernels]
    jobs = parallel_jobs(jobs, len(work))
    if jobs == 1:
        return {}, checked
    found = emit_in_parallel([(k, target_of(k.name), _origin(spec, out)) for spec, k in work], jobs)
    done: dict[str, list] = {}
    for (spec, k), result in zip(work, found):
        done.setdefault(spec, []).append(None if result is None else Module(k.name, result[0], None, result[1]))
    return {spec: ms for spec, ms in done.items() if None not in ms}, checked


def _output_problem(out: Path) -> str | None:
    """Why `-o out` cannot be an output folder (it or a folder above it is a file), if so."""
    for path in (out, *out.parents):
        if os.path.isdir(path):
            return None
        if os.path.lexists(path):
            what = "a file" if os.path.isfile(path) else "a broken link" if not os.path.exists(path) else "a special file"
            return f"-o {out} is {what}, not a directory" if path == out else f"-o {out}: {path} is {what}, not a directory"
    return None


def _write_all(files: dict[Path, str]) -> None:
    """Write every file or none: all temporaries first, then renames.

    Files get the mode any new file gets (0o666 less the umask: 0644 under 022), not
    mkstemp's 0600, which would lock other users out of a module a rebuild replaced.
    An OSError names the file being written (never a temporary), with filename set to it.
    """
    mode = 0o666 & ~_umask()
    staged: list[tuple[str, Path]] = []
    try:
        for path, text in files.items():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                # Checked before any rename, so that a too-long kernel name writes nothing.
                if len(os.fsencode(path.name)) > _name_max(path.parent):
                    raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
                # A short temporary name: one built from NAME.py can be too long where NAME.py is not.
                fd, tmp = tempfile.mkstemp(prefix=".sparsegen-", suffix=".tmp", dir=path.parent)
                staged.append((tmp, path))
                os.fchmod(fd, mode)
                with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
                    f.write(text)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
        for tmp, path in staged:
            try:
                os.replace(tmp, path)
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from None
    finally:
        for tmp, _ in staged:
            Path(tmp).unlink(missing_ok=True)


def _umask() -> int:
    """The process's umask (reading it means setting it: put it straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):  # not known here: let the write itself fail
        return sys.maxsize


def _write_error(exc: OSError) -> None:
    print(f"{exc.filename}: error: cannot write: {exc.strerror}", file=sys.stderr)


def cmd_build(args) -> int:
    out = Path(args.output)
    if problem := _output_problem(out):
        print(f"sparsegen build: {problem}", file=sys.stderr)
        return 2
    modules = _compile_all(args.specs, lambda _: args.target, out, args.jobs)
    if modules is None:
        return 1
    files = {out / f"{m.kernel}.py": m.code for _, m in modules}
    try:
        _write_all(files)
    except OSError as exc:
        _write_error(exc)
        return 1
    if not args.quiet:
        for path in files:
            print(f"wrote {path}")
    return 0


# The first line of every generated module (templates/*/module.py.j2): what marks a file in
# the output folder as ours; other .py files there (__init__.py, hand-written code) are not.
GENERATED_HEADER = "# Generated by sparsegen from "
# The end of that line records the target the module was built for.
_RECORDED_TARGET = re.compile(r" \(sha256 [0-9a-f]+\) for ([0-9a-z]+)\. Do not edit:$")
# And the spec it was built from, as `_origin` names it.
_RECORDED_SOURCE = re.compile(re.escape(GENERATED_HEADER) + r"(.+) \(sha256 [0-9a-f]+\) for [0-9a-z]+\. Do not edit:$")


def _header(path: Path) -> str | None:
    """The first line of `path` if sparsegen wrote it, else None."""
    try:
        with path.open(encoding="utf-8") as f:
            first = f.readline(4096)
    except (OSError, UnicodeDecodeError):
        return None
    return first.rstrip("\n") if first.startswith(GENERATED_HEADER) else None


def _generated_modules(out: Path) -> list[Path]:
    """The modules in `out` that sparsegen wrote, by their first line."""
    return [path for path in sorted(out.glob("*.py")) if _header(path) is not None]


def _recorded_target(path: Path) -> str | None:
    """The target a generated module records in its header (None: no module, or no known target)."""
    found = _RECORDED_TARGET.search(_header(path) or "")
    return found[1] if found and found[1] in BACKEND_OF else None


def _build_commands(modules: list[tuple[str, Module]], out: str) -> str:
    """The `sparsegen build` command(s) that rewrite `modules`, one per target."""
    specs_of: dict[str, list[str]] = {}
    for spec, m in modules:
        specs = specs_of.setdefault(m.target, [])
        if spec not in specs:
            specs.append(spec)
    return " && ".join(
        f"sparsegen build {' '.join(specs)} -o {out}" + ("" if target == DEFAULT_TARGET else f" --target {target}")
        for target, specs in specs_of.items()
    )


def cmd_check(args) -> int:
    out = Path(args.output)
    if problem := _output_problem(out):
        print(f"sparsegen check: {problem}", file=sys.stderr)
        return 2
    # Without --target, each module is compared with its spec compiled for the target it was built for.
    target_of = (lambda _: args.target) if args.target else (lambda name: _recorded_target(out / f"{name}.py") or DEFAULT_TARGET)
    modules = _compile_all(args.specs, target_of, out, args.jobs)
    if modules is None:
        return 1
    stale, others, rebuilt, shared = 0, 0, [], set()
    for spec, m in modules:
        path = out / f"{m.kernel}.py"
        try:
            current = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            print(f"missing: {path} (from {spec})")
            stale += 1
            rebuilt.append((spec, m))
            continue
        if current == m.code:
            continue
        if other := _other_spec(path, spec, out):
            # Not this spec's module: rebuilding it from this spec would overwrite the other's.
            print(f"other spec: {path} (built from {other}, which also defines kernel '{m.kernel}'; not from {spec})")
            others += 1
            shared.add(spec)
            continue
        recorded, checked = _recorded_target(path), m.target
        why = f"; built for {recorded}, checked for {checked}" if recorded and recorded != checked else ""
        print(f"stale: {path} (from {spec}{why})")
        stale += 1
        rebuilt.append((spec, m))
    kernels = {m.kernel for _, m in modules}
    orphans = [path for path in _generated_modules(out) if path.stem not in kernels]
    for path in orphans:
        print(f"orphan: {path} (no spec defines kernel '{path.stem}')")
    rebuilt = [(spec, m) for spec, m in rebuilt if spec not in shared]  # a build of those would overwrite the other's
    if stale:
        run = f"; run: {_build_commands(rebuilt, args.output)}" if rebuilt else ""
        print(f"{stale} module{'s' if stale != 1 else ''} out of date{run}")
    if others:
        print(f"{others} module{'s' if others != 1 else ''} built from another spec with a kernel of the same name: rename one of "
              "the kernels, or build them into different folders")
    if orphans:
        print(f"{len(orphans)} orphan module{'s' if len(orphans) != 1 else ''}: delete {'them' if len(orphans) != 1 else 'it'}, or give the specs that define their kernels")
    if stale or others or orphans:
        return 1
    print(f"{len(modules)} module{'s' if len(modules) != 1 else ''} up to date in {out}")
    return 0


def cmd_plan(args) -> int:
    try:
        found = plans(args.spec, args.target)
    except SpecError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    if args.kernel:
        found = [p for p in found if p.name == args.kernel]
        if not found:
            print(f"{args.spec}: error: no kernel named '{args.kernel}'", file=sys.stderr)
            return 1
    if not args.pattern:
        if args.shape or args.json or args.png:
            print("sparsegen plan: --shape, --json and --png describe a run on a pattern: add --pattern", file=sys.stderr)
            return 2
        for n, p in enumerate(found):
            if n:
                print()
            print("\n".join(describe(p)))
        return 0
    # A pattern: walk the generated kernel's grid (this needs jax, for the generated code).
    # Usage problems first, before loading jax or simulating anything.
    if is_gpu(args.target):
        print(f"sparsegen plan: --pattern simulates the TPU pipeline; for {args.target}, `plan` without it describes the GPU "
              "schedule, and bench/bench_gpu.py times it on a GPU", file=sys.stderr)
        return 2
    if not _pattern_ok("plan", args.pattern) or (args.png and not _png_ok(args.png)) or not _have_jax("plan --pattern"):
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the index maps run on the host
    from .tpu import simulate
    from .shapes import default_shapes, parse_shapes

    try:
        shapes = parse_shapes(args.shape)
    except ValueError as exc:
        print(f"sparsegen plan: {exc}", file=sys.stderr)
        return 2
    if not _shape_names_ok("plan", shapes, {args.spec: [p.kernel for p in found]}):
        return 2
    reports = []
    for p in found:
        sizes = {**default_shapes(p.kernel), **shapes}
        missing = [s for s, lit in p.kernel.symbols if lit is None and s not in sizes]
        if missing:
            print(f"sparsegen plan: give --shape {','.join(f'{m}=...' for m in missing)}", file=sys.stderr)
            return 2
        try:
            reports.append(analyse_module(p, sizes, args.pattern, targets=tuple(names_of("tpu")), seed=args.seed, trace=bool(args.png)))
        except ValueError as exc:
            print(f"sparsegen plan: {exc}", file=sys.stderr)
            return 2
    if args.png:
        from .tpu.picture import draw

        try:
            draw(reports[0], args.png)
        except OSError as exc:
            print(f"{args.png}: error: cannot write: {exc.strerror or exc}", file=sys.stderr)
            return 1
    if args.json:
        import json

        print(json.dumps([r.to_json() for r in reports], indent=2, sort_keys=True))
    else:
        for n, r in enumerate(reports):
            if n:
                print()
            print("\n".join(describe(r.plan) + simulate.describe_report(r)))
    return 0


def _shape_names_ok(command: str, shapes: dict[str, int], kernels: dict) -> bool:
    """Every `--shape` name is a size of a kernel the command takes (`kernels`: per spec, its
    kernels; a misspelt name would be ignored): False after printing the usage error."""
    known = list(dict.fromkeys(s for found in kernels.values() for k in found for s, _ in k.symbols))
    unknown = [name for name in shapes if name not in known]
    if not unknown:
        return True
    name = unknown[0]
    specs = list(kernels)
    where = f"{specs[0]} has no size {name} (its" if len(specs) == 1 else f"none of {', '.join(map(str, specs))} has a size {name} (their"
    print(f"sparsegen {command}: --shape {name}={shapes[name]}: {where} sizes: {', '.join(known) or 'none'})", file=sys.stderr)
    return False


def _verify_options(args) -> dict[str, int] | None:
    """`--shape` and `--nnz`, checked (None after printing the usage error). The specs are
    checked here for their sizes' names; one with an error is reported by the run."""
    from .compiler import check_source
    from .shapes import parse_shapes

    try:
        shapes = parse_shapes(args.shape)
    except ValueError as exc:
        print(f"sparsegen verify: {exc}", file=sys.stderr)
        return None
    if shapes:
        kernels = {}
        for spec in args.specs:
            try:
                kernels[spec] = check_source(SourceFile.read(spec))
            except (SpecError, OSError):
                kernels[spec] = []
        if not _shape_names_ok("verify", shapes, kernels):
            return None
    if not 0 < args.nnz <= 1:
        print("sparsegen verify: --nnz is a fraction of the blocks, in (0, 1]", file=sys.stderr)
        return None
    if args.pattern and not args.cycles:
        print("sparsegen verify: --pattern is the pattern of --cycles: add --cycles", file=sys.stderr)
        return None
    if args.cycles and not _pattern_ok("verify", args.pattern or f"density={args.nnz}"):
        return None
    return shapes


def cmd_verify(args) -> int:
    targets = _target_list(args.target)
    unknown = [t for t in targets if t not in BACKEND_OF]
    if unknown or not targets:
        print(f"sparsegen verify: unknown target {', '.join(unknown) or '(none)'}; choose from {', '.join(names_of('tpu'))} (TPU) "
              f"or {', '.join(names_of('gpu'))} (GPU)", file=sys.stderr)
        return 2
    if any(is_gpu(t) for t in targets):
        if not all(is_gpu(t) for t in targets):
            print("sparsegen verify: give TPU chips or GPUs, not both, in one run", file=sys.stderr)
            return 2
        if args.cycles:
            print("sparsegen verify: --cycles is libtpu's estimate, for TPU targets only", file=sys.stderr)
            return 2
        shapes = _verify_options(args)
        return 2 if shapes is None else _verify_gpu(args, targets, shapes)
    from .jaxenv import quiet_libtpu
    from .tpu.verify import MissingLibtpu, require_libtpu
    from .verify import verify_file

    quiet_libtpu()
    try:
        require_libtpu()
    except MissingLibtpu as exc:
        print(f"sparsegen verify: {exc}", file=sys.stderr)
        return 2
    shapes = _verify_options(args)
    if shapes is None:
        return 2
    report, failed = [], False
    for spec in args.specs:
        try:
            source, results = verify_file(spec, targets, shapes, args.nnz, probe=not args.quick)
        except SpecError as exc:
            print(exc.render(), file=sys.stderr)
            failed = True
            continue
        report.append((spec, source, results))
        failed |= any(not r.compiled for r in results)
    cycles = _verify_cycles(args, report, shapes) if args.cycles else {}
    if cycles is None:
        return 2
    if args.json:
        import json

        payload = {"schema": 1, "results": [dict(spec=spec, **r.to_json(source), **_cycles_json(cycles, spec, r)) for spec, source, results in report for r in results]}
        print(json.dumps(payload, indent=2, sort_keys=True))
    else:
        _print_verify_table(report, args.verbose)
        if cycles:
            from .tpu.cycles import print_table

            print_table(cycles, args.pattern or f"density={args.nnz}")
    return 1 if failed else 0


def _verify_cycles(args, report, shapes):
    """`verify --cycles`: libtpu's cycle estimate per kernel (None after printing why not)."""
    from . import cycles

    pattern = args.pattern or f"density={args.nnz}"
    try:
        return cycles.for_verify(report, shapes, pattern, args.seed)
    except cycles.CyclesUnavailable as exc:
        print(f"sparsegen verify --cycles: {exc}", file=sys.stderr)
        return None


def _cycles_json(cycles, spec, result) -> dict:
    found = cycles.get((spec, result.kernel, result.target))
    return {"cycles": found.to_json()} if found is not None else {}


def _verify_gpu(args, targets: list[str], shapes: dict[str, int]) -> int:
    """`verify` for GPU targets: stage 2 per kernel, stage 3 for all of them in one process.
    Stage 3 is asked for unless --lower-only: its environment is found first, and without
    one (or where it could not compile) verify exits 2 saying how to provide it."""
    from .compiler import lower_source
    from .gpu.verify import gpu_python
    from .verify import verify_gpu_modules

    python = None
    if not args.lower_only:
        python, why = gpu_python()
        if python is None:
            print(f"sparsegen verify: cannot compile for {', '.join(targets)} (stage 3, ptxas): {why}", file=sys.stderr)
            return 2
    from .jaxenv import quiet_libtpu

    quiet_libtpu()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    items, specs, sources, failed = [], {}, {}, False
    for spec in args.specs:
        source = SourceFile.read(spec)
        try:
            found = [(m, source, target) for target in targets for m in lower_source(source, target)]
        except SpecError as exc:
            print(exc.render(), file=sys.stderr)
            failed = True
            continue
        for m, _, target in found:
            specs[m.name, target], sources[m.name, target] = spec, source
        items += found
    results = verify_gpu_modules(items, shapes, args.nnz, stage3=not args.lower_only, python=python)
    report = [(specs[r.kernel, r.target], r) for r in results]
    for r in results:
        failed |= not r.ok
        if r.error:
            print(SpecError([r.error], sources[r.kernel, r.target]).render(), file=sys.stderr)
            if args.verbose and r.raw_error:
                print("  raw compiler message:\n" + "\n".join("    " + line for line in r.raw_error.splitlines()), file=sys.stderr)
    # Asked for stage 3 and it did not run (ptxas missing): the measurements are not there.
    unmeasured = [r for r in results if r.lowered and r.compiled is None and not args.lower_only]
    status = 1 if failed else 2 if unmeasured else 0
    if unmeasured:
        print(f"sparsegen verify: stage 3 did not run for {len(unmeasured)} kernel{'s' if len(unmeasured) != 1 else ''}: {unmeasured[0].stage3}", file=sys.stderr)
    if args.json:
        import json

        print(json.dumps({"schema": 1, "results": [dict(spec=spec, **r.to_json()) for spec, r in report]}, indent=2, sort_keys=True))
        return status
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sparsegen verify (Mosaic GPU: stage 2 lowering under an abstract device, stage 3 ptxas for sm_90a)")
    for column in ("kernel", "target", "lowers", "backward", "shared memory used / estimate / limit", "compiles (ptxas)", "registers", "spills", "time"):
        table.add_column(column, justify="right" if column in ("registers", "spills", "time") else "left")
    for spec, r in report:
        smem = f"{r.smem_used if r.smem_used is not None else '?'} / {r.smem_estimate} / {r.smem_limit}"
        compiled = "yes" if r.compiled else "NO" if r.compiled is False else f"not run ({r.stage3})" if r.lowered else "-"
        backward = r.backward or "-"
        if r.backward_smem_used:  # an attention-like kernel's dq and dk/dv
            backward += " (shared memory " + ", ".join(f"{u} / {e}" for u, e in zip(r.backward_smem_used, r.backward_smem_estimate)) + ")"
        registers = "unknown" if r.registers is None else ", ".join(map(str, r.registers))
        if r.kernels and all("name" in kk for kk in r.kernels):
            registers = ", ".join(f"{kk['name'].removesuffix('_mosaic_gpu_kernel')} {kk['registers']}" for kk in r.kernels)
        table.add_row(r.kernel, r.target, "yes" if r.lowered else "NO", backward, smem, compiled, registers,
                      "unknown" if r.spill_bytes is None else f"{r.spill_bytes} B",
                      f"{r.lower_seconds + r.compile_seconds:.1f} s")
    Console(width=160).print(table)
    return status


def _print_verify_table(report, verbose: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from .tpu.targets import format_bytes

    table = Table(title="sparsegen verify: ahead-of-time compiles through libtpu")
    for column in ("kernel", "target", "compiles", "backward", "VMEM used / limit", "static estimate", "SMEM", "GFLOP", "MB accessed", "compile"):
        table.add_column(column, justify="left" if column in ("kernel", "target", "compiles", "backward") else "right")
    problems = []
    for _, source, results in report:
        for r in results:
            used = format_bytes(r.vmem_used) if r.vmem_used else "-"
            table.add_row(
                r.kernel,
                r.target,
                "[green]yes[/green]" if r.compiled else "[red]no[/red]",
                "-" if r.backward is None else "[green]yes[/green]" if r.backward == "compiles" else f"[red]{r.backward[:40]}[/red]",
                f"{used} / {format_bytes(r.vmem_limit)}",
                format_bytes(r.vmem_estimate),
                format_bytes(r.smem_used) if r.smem_used else "-",
                f"{r.flops / 1e9:.2f}" if r.flops else "-",
                f"{r.bytes_accessed / 1e6:.1f}" if r.bytes_accessed else "-",
                f"{r.compile_seconds:.1f} s" if r.compiled else "-",
            )
            if r.error is not None:
                problems.append((source, r))
    Console(width=160).print(table)
    for source, r in problems:
        print(r.error.render(source), file=sys.stderr)
        if verbose and r.raw_error:
            print(f"  raw compiler message ({r.target}):\n" + "\n".join("    " + line for line in r.raw_error.splitlines()), file=sys.stderr)


def _pattern_ok(command: str, pattern: str) -> bool:
    from .patterns import PatternError, parse_pattern

    try:
        parse_pattern(pattern)
    except PatternError as exc:
        print(f"sparsegen {command}: {exc}", file=sys.stderr)
        return False
    return True


def _png_ok(path: str) -> bool:
    """--png can be drawn (matplotlib is there) and written: known before simulating."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print("sparsegen plan: --png draws with matplotlib, which is not installed: pip install 'sparsegen[viz]'", file=sys.stderr)
        return False
    folder = Path(path).parent
    if os.path.isdir(path) or not os.path.isdir(folder):
        why = "is a directory" if os.path.isdir(path) else f"{folder} is not a directory" if os.path.lexists(folder) else f"{folder} does not exist"
        print(f"sparsegen plan: --png {path}: {why}", file=sys.stderr)
        return False
    return True


def _have_jax(command: str) -> bool:
    import importlib.util

    if importlib.util.find_spec("jax") is None:
        print(f"sparsegen {command} runs the generated module, which needs jax: pip install 'sparsegen[jax]'", file=sys.stderr)
        return False
    return True


def cmd_variants(args) -> int:
    from . import variants as vs
    from .jaxenv import quiet_libtpu

    if not _have_jax("variants"):
        return 2
    targets = _target_list(args.target)
    if not targets or any(BACKEND_OF.get(t) != "tpu" for t in targets):
        print(f"sparsegen variants: --target takes TPU chips from {', '.join(names_of('tpu'))} (GPU variants are not ranked yet: build each with --target h200 and run bench/bench_gpu.py)", file=sys.stderr)
        return 2
    if args.output and (problem := _output_problem(Path(args.output))):
        print(f"sparsegen variants: {problem}", file=sys.stderr)
        return 2
    if not _pattern_ok("variants", args.pattern):
        return 2
    if args.no_compile and not vs.tpu_present_cheap():
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    quiet_libtpu()
    try:
        found = plans(args.spec, targets[0])
    except SpecError as exc:
        print(exc.render(), file=sys.stderr)
        return 1
    if args.kernel:
        found = [p for p in found if p.name == args.kernel]
    if len(found) != 1:
        names = ", ".join(p.name for p in plans(args.spec, targets[0]))
        print(f"sparsegen variants: choose one kernel with --kernel (the spec has: {names})", file=sys.stderr)
        return 2
    kernel = found[0].kernel
    from .shapes import parse_shapes

    try:
        options = vs.parse_tile_options(args.tile, kernel)
        shapes = parse_shapes(args.shape)
        sizes = {**vs.default_sizes(kernel, options), **shapes}
    except ValueError as exc:
        print(f"sparsegen variants: {exc}", file=sys.stderr)
        return 2
    if not _shape_names_ok("variants", shapes, {args.spec: [kernel]}):
        return 2
    candidates = vs.expand(kernel, args.spec, options)
    for v in candidates:
        v.target = targets[0]
    timed = vs.tpu_present()
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, width=150)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("checking and planning", total=len(candidates))
        for v in candidates:
            vs.build(v, targets[0])
            progress.advance(task)
        alive = [v for v in candidates if v.rejected is None]
        task = progress.add_task(f"simulating on {args.pattern}", total=len(alive))
        for v in alive:
            vs.model(v, sizes, args.pattern, targets, args.seed)
            progress.advance(task)
        if not args.no_compile:
            alive = [v for v in candidates if v.rejected is None]
            task = progress.add_task("compiling ahead of time", total=len(alive))
            for v in alive:
                vs.compile_check(v, sizes, targets, args.nnz)
                progress.advance(task)
        if args.rank == "cycles":
            alive = [v for v in candidates if v.rejected is None]
            task = progress.add_task(f"libtpu's cycle estimate ({len(alive)} profiled compiles, in one process)", total=1)
            vs.estimate_cycles(alive, sizes, args.pattern, targets[0], args.seed)
            progress.advance(task)
        if timed:
            alive = [v for v in candidates if v.rejected is None]
            task = progress.add_task("timing on the TPU", total=len(alive))
            for v in alive:
                vs.time_on_tpu(v, sizes, args.pattern, args.seed)
                progress.advance(task)
    for v in candidates:
        if v.rejected is not None:
            print(f"dropped {v.name}: {v.rejected}", file=sys.stderr)
    ranked = vs.rank(candidates, args.rank)
    _print_variants(ranked, targets, args.pattern, sizes, timed, args.rank)
    for v in ranked:
        if args.rank == "cycles" and v.cycles is None:
            print(f"cycles unknown for {v.name} (ranked last): {v.cycles_reason}", file=sys.stderr)
    if args.output and ranked:
        try:
            _write_all({Path(args.output) / f"{v.name}.py": v.code for v in ranked})
        except OSError as exc:
            _write_error(exc)
            return 1
    if args.json_file:
        import json

        payload = {
            "schema": 1,
            "spec": args.spec,
            "pattern": args.pattern,
            "shapes": sizes,
            "targets": targets,
            "rank_by": "cycles" if args.rank == "cycles" else "measured time" if timed else "model",
            "variants": [
                {
                    "name": v.name,
                    "tiles": v.tiles,
                    "rank": ranked.index(v) + 1 if v in ranked else None,
                    "rejected": v.rejected,
                    "compiled": v.compiled,
                    "measured_seconds": v.measured,
                    "model": v.report.to_json() if v.report else None,
                    **({"cycles": _variant_cycles_json(v)} if args.rank == "cycles" else {}),
                }
                for v in candidates
            ],
        }
        Path(args.json_file).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return 0 if ranked else 1


def _variant_cycles_json(v) -> dict:
    """A variant's cycle estimate in `variants --json`: the figure ranked by (null: unknown, with the reason)."""
    forward = v.cycles_report.to_json()["forward"] if v.cycles_report is not None else None
    return {"estimated_cycles": v.cycles, "reason": v.cycles_reason if v.cycles is None else None, "forward": forward}


def _print_variants(ranked, targets, pattern, sizes, timed, by: str = "model") -> None:
    from rich.console import Console
    from rich.table import Table

    from .tpu.targets import format_bytes

    shapes = ", ".join(f"{k}={v}" for k, v in sizes.items())
    how = f"libtpu's cycle estimate ({targets[0]})" if by == "cycles" else "measured time" if timed else "the model"
    table = Table(title=f"variants ranked by {how}: pattern {pattern}, {shapes}")
    cycles = ["est. cycles"] if by == "cycles" else []
    for column in ("#", "variant", *cycles, "VMEM", "block products", "wasted copies", "HBM", *(f"{t} est." for t in targets), "vs dense", *(["measured"] if timed else [])):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for n, v in enumerate(ranked, 1):
        r = v.report
        row = [str(n), v.name, *([f"{v.cycles:,}" if v.cycles is not None else "unknown"] if by == "cycles" else []), format_bytes(v.plan.vmem_bytes), f"{r.sim.block_products} / {r.dense.block_products}", str(r.sim.wasted_copies), format_bytes(r.sim.hbm_bytes)]
        row += [f"{r.estimates[t]['seconds'] * 1e3:.3f} ms" for t in targets]
        row.append(f"{r.estimates[targets[0]]['speedup']:.2f}x")
        if timed:
            row.append(f"{v.measured * 1e3:.3f} ms" if v.measured is not None else "-")
        table.add_row(*row)
    Console(width=160).print(table)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sparsegen")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _target_list(text: str) -> list[str]:
    """A comma-separated --target, in lower case (H200 is h200)."""
    return [t.strip().lower() for t in text.split(",") if t.strip()]


SPEC_HELP = "a .spk spec file"
JOBS_HELP = "processes to lower and emit the kernels in, where there are 8 or more, at most one per 4 kernels (default: the cores available; 1: this one)"
SPECS_HELP = ".spk spec files (each may define several kernels)"
VERIFY_EPILOG = (
    "GPU targets are proven in two stages: stage 2 lowers each kernel under an abstract device (jax alone); "
    "stage 3 compiles it through XLA:GPU and ptxas for sm_90a (registers, spills), in a Python environment with "
    "the jax-cuda13 plugin: `make gpu-venv` in a sparsegen checkout makes one (.venv-gpu), or set "
    "SPARSEGEN_GPU_PYTHON to a Python that has jax, jax-cuda13-plugin and nvidia-cuda-nvcc. Without one, verify "
    "exits 2 saying so; --lower-only runs stage 2 alone."
)


def _jobs(text: str) -> int:
    """--jobs: a positive number of processes."""
    n = int(text) if text.strip().isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"a positive number of processes, got {text!r}")
    return n


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsegen", description="Compile .spk specs into Pallas kernel modules (TPU, or Mosaic GPU for H100/H200).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help="`sparsegen COMMAND --help` lists its options")
    targets = names_of("tpu") + names_of("gpu")
    tpu_names, gpu_names = ", ".join(names_of("tpu")), ", ".join(names_of("gpu"))

    build = sub.add_parser("build", help="write one module per kernel (nothing is written if any spec fails)")
    build.add_argument("specs", nargs="+", metavar="SPEC", help=SPECS_HELP)
    build.add_argument("-o", "--output", default=".", metavar="DIR", help="where to write NAME.py (default: .)")
    build.add_argument("--target", default=DEFAULT_TARGET, type=str.lower, choices=targets,
                       help=f"chip to build for and check against: {tpu_names} (TPU), {gpu_names} (Mosaic GPU) (default: {DEFAULT_TARGET})")
    build.add_argument("-q", "--quiet", action="store_true", help="do not list the files written")
    build.add_argument("-j", "--jobs", type=_jobs, metavar="N", help=JOBS_HELP)
    build.set_defaults(func=cmd_build)

    check = sub.add_parser("check", help="exit 1 if any module in DIR is missing or stale (writes nothing)")
    check.add_argument("specs", nargs="+", metavar="SPEC", help=SPECS_HELP + ", as given to build")
    check.add_argument("-o", "--output", default=".", metavar="DIR", help="the folder the modules were written to (default: .)")
    check.add_argument("--target", type=str.lower, choices=targets, help="compare with modules built for this target "
                       f"(default: the target each module's header records; {DEFAULT_TARGET} for a missing one)")
    check.add_argument("-j", "--jobs", type=_jobs, metavar="N", help=JOBS_HELP)
    check.set_defaults(func=cmd_check)

    plan = sub.add_parser("plan", help="print the kernel's plan: grid, blocks, index maps, memory")
    plan.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    plan.add_argument("--kernel", metavar="NAME", help="only this kernel of the spec")
    plan.add_argument("--target", default=DEFAULT_TARGET, type=str.lower, choices=targets,
                      help=f"chip to plan for: its memory budget, and for a GPU its walk and CTA tiles (default: {DEFAULT_TARGET})")
    plan.add_argument("--shape", metavar="M=4096,K=...", help="sizes of symbolic dimensions (default: 8 blocks of their tile)")
    plan.add_argument("--pattern", metavar="P", help="tril | density=F | band=W | FILE.npy: simulate the pipeline on it (needs jax)")
    plan.add_argument("--seed", type=int, default=0, help="seed of density= patterns")
    plan.add_argument("--json", action="store_true", help="counts and estimates as JSON")
    plan.add_argument("--png", metavar="FILE", help="draw the block pattern, the grid's traversal and its copies")
    plan.set_defaults(func=cmd_plan)
    verify = sub.add_parser("verify", help="compile ahead of time through libtpu (TPUs) or for a compile-only H200 (GPUs); no device needed",
                            epilog=VERIFY_EPILOG)
    verify.add_argument("specs", nargs="+", metavar="SPEC", help=SPECS_HELP)
    verify.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"comma-separated chips: any of {tpu_names} (default: {DEFAULT_TARGET}), or of {gpu_names} (Mosaic GPU; see below)")
    verify.add_argument("--shape", metavar="M=4096,K=...", help="sizes of symbolic dimensions (default: 8 blocks of their tile)")
    verify.add_argument("--nnz", type=float, default=0.1, help="fraction of blocks a coo operand stores (default: 0.1)")
    verify.add_argument("--json", action="store_true", help="machine-readable output")
    verify.add_argument("--quick", action="store_true", help="TPU targets: skip probing the compiler's VMEM need")
    verify.add_argument("--lower-only", action="store_true", help="GPU targets: stage 2 only (lowering), no ptxas compile (needs no plugin)")
    verify.add_argument("--verbose", action="store_true", help="print the raw compiler message of a failure")
    verify.add_argument("--cycles", action="store_true", help="libtpu's static cycle estimate per kernel and backward pass, regions weighted by the real tables of --pattern (slower compiles)")
    verify.add_argument("--pattern", metavar="P", help="with --cycles: tril | density=F | band=W | FILE.npy (default: density=NNZ)")
    verify.add_argument("--seed", type=int, default=0, help="with --cycles: seed of density= patterns")
    verify.set_defaults(func=cmd_verify)
    variants = sub.add_parser("variants", help="expand tile choices, drop what cannot work, rank the rest by a pipeline model (or libtpu's cycle estimate)")
    variants.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    variants.add_argument("--kernel", metavar="NAME", help="the kernel, if the spec has several")
    variants.add_argument("--tile", action="append", default=[], metavar="INDEX=SIZE,...", help="tile choices for one index (repeat)")
    variants.add_argument("--pattern", default="density=0.1", metavar="P", help="tril | density=F | band=W | FILE.npy (default: density=0.1)")
    variants.add_argument("--shape", metavar="M=4096,...", help="sizes of symbolic dimensions (default: 8 blocks of the largest tile)")
    variants.add_argument("--target", default=DEFAULT_TARGET, help=f"comma-separated TPU chips ({tpu_names}); the first ranks (default: {DEFAULT_TARGET})")
    variants.add_argument("--nnz", type=float, default=0.1, help="stored-block fraction for the compile check (default: 0.1)")
    variants.add_argument("--seed", type=int, default=0, help="seed of a density= pattern (default: 0)")
    variants.add_argument("--no-compile", action="store_true", help="skip ahead-of-time compiles (model only)")
    variants.add_argument("--rank", choices=("model", "cycles"), default="model",
                          help="model: the pipeline model, or measured time where a TPU is present (default); cycles: libtpu's static "
                               "cycle estimate of each variant on --pattern, for the first --target (slow: a profiled compile per "
                               "variant, three where a condition reads tables); a variant without one ranks last, saying why")
    variants.add_argument("-o", "--output", metavar="DIR", help="write the surviving variants' modules here")
    variants.add_argument("--json", dest="json_file", metavar="FILE", help="write the full report as JSON")
    variants.set_defaults(func=cmd_variants)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `sparsegen` program (argv None: sys.argv), or one command in a running process."""
    args = _parser().parse_args(argv)
    if args.func not in (cmd_build, cmd_check):
        return args.func(args)  # those that run generated code (plan, variants, verify) keep the collector: jax makes cycles
    # Generating allocates millions of long-lived objects: the cyclic collector waits until
    # the command is done instead of rescanning them while they are written (1.0 of 12 CPU s
    # of a build of 2,000 kernels). The program then exits: what it left (some 660,000 objects
    # in cycles there) is frozen, never searched (0.7 CPU s), at exit either.
    with no_cycle_collection():
        code = args.func(args)
        if argv is None:
            gc.freeze()
    return code


if __name__ == "__main__":
    sys.exit(main())

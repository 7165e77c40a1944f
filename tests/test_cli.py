"""The command line: build, check and plan; exit codes; atomic writes; no jax; no tracebacks."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, SPECS

EXAMPLES = sorted(str(p.relative_to(ROOT)) for p in SPECS.glob("*.spk"))
# A full build or check compiles all fifteen modules (about 10 s of CPU): the tests whose
# point is not the set of examples (spellings, stale and orphan reports, no jax) use these
# three specs, one with two kernels; test_generated_is_current checks every example.
FEW = ["specs/dsd_matmul.spk", "specs/masked_backward.spk", "specs/sdd_matmul.spk"]
FEW_MODULES = ["dsd_matmul.py", "masked_matmul_dx.py", "masked_matmul_dy.py", "sdd_matmul.py"]


def sparsegen(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "sparsegen", *map(str, args)], cwd=cwd, capture_output=True, text=True)


def in_process(*args, cwd=ROOT):
    """`sparsegen ARGS` as `sparsegen` runs it, by `main` in this process (a subprocess costs
    about 3 CPU-seconds of start-up): for the tests whose point is what check and build
    report, not the process (no jax, byte-identical builds, exit codes of bad usage)."""
    import contextlib
    import io

    from sparsegen.cli import main

    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as exc:
                code = exc.code
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_generated_is_current_and_build_check_and_plan_never_import_jax(tmp_path):
    """generated/ matches specs/ (what `sparsegen check` tells CI and pre-commit hooks); and
    check (which compiles every example as build does), build and plan never import jax. One
    process: a check of every example compiles them all (about 10 s of CPU)."""
    code = (
        "import sys\n"
        "from sparsegen.cli import main\n"
        f"assert main(['check', *{EXAMPLES!r}, '-o', 'generated']) == 0\n"
        f"assert main(['build', *{FEW!r}, '-o', {str(tmp_path)!r}, '-q']) == 0\n"
        "assert main(['plan', 'specs/dsd_matmul.spk']) == 0\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
        "print('no jax')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "no jax" in result.stdout, result.stdout + result.stderr
    assert f"{len(list((ROOT / 'generated').glob('*.py')))} modules up to date in generated\n" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == FEW_MODULES


# One spec per walk family (einsum, attention-like, condition, two kernels in one file):
# every example is compared with generated/ by test_generated_is_current.
DETERMINISM = ["specs/causal_attention.spk", "specs/dsd_matmul.spk", "specs/grouped_matmul.spk", "specs/masked_backward.spk"]


def test_two_builds_are_byte_identical(tmp_path):
    """Two builds of a copy of the project, one from its root and one from elsewhere with
    absolute paths, match each other and generated/ byte for byte."""
    examples = EXAMPLES if os.environ.get("SPARSEGEN_SWEEP") == "1" else DETERMINISM
    (tmp_path / "pyproject.toml").write_text("")
    shutil.copytree(SPECS, tmp_path / "specs")
    a, b = tmp_path / "a", tmp_path / "b"
    assert sparsegen("build", *examples, "-o", "a", cwd=tmp_path).returncode == 0
    assert sparsegen("build", *(tmp_path / e for e in examples), "-o", b, cwd=ROOT / "tests").returncode == 0
    names = sorted(p.name for p in a.iterdir())
    if examples is DETERMINISM:
        assert names == ["causal_attention.py", "dsd_matmul.py", "grouped_matmul.py", "masked_matmul_dx.py", "masked_matmul_dy.py"]
    else:
        assert names == ["batched_dsd.py", "block_slice.py", "causal_attention.py", "dds_matmul.py", "document_attention.py", "dsd_matmul.py",
                         "grouped_matmul.py", "local_gqa_attention.py", "masked_attention.py", "masked_matmul.py", "masked_matmul_dx.py",
                         "masked_matmul_dy.py", "masked_softmax.py", "sdd_matmul.py", "tril_matmul.py"]
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes()
        assert (a / name).read_bytes() == (ROOT / "generated" / name).read_bytes()


def test_header_names_the_spec_from_the_project_root_and_its_digest(tmp_path, monkeypatch):
    """In this process (`main`, from three working directories): five builds in subprocesses
    took 20 CPU-seconds, mostly starting Python; test_two_builds_are_byte_identical builds
    in subprocesses."""
    from sparsegen.cli import main

    def build(spec, out, cwd=ROOT):
        monkeypatch.chdir(cwd)
        return main(["build", str(spec), "-o", str(out), "-q"])

    digest = hashlib.sha256((SPECS / "dsd_matmul.spk").read_bytes()).hexdigest()[:16]
    project = tmp_path / "project"
    (project / "specs").mkdir(parents=True)
    (project / ".git").mkdir()
    shutil.copy(SPECS / "dsd_matmul.spk", project / "specs")
    for spec, cwd in [
        ("specs/dsd_matmul.spk", project),
        ("./dsd_matmul.spk", project / "specs"),
        (project / "specs" / "dsd_matmul.spk", ROOT),
    ]:
        assert build(spec, project / "src" / "kernels", cwd) == 0
        first = (project / "src" / "kernels" / "dsd_matmul.py").read_text().splitlines()[0]
        assert first == f"# Generated by sparsegen from specs/dsd_matmul.spk (sha256 {digest}) for v5e. Do not edit:", spec
    # A spec outside the output's project, or no project at all: the file name.
    for out in (project / "out", tmp_path / "loose"):
        assert build("specs/dsd_matmul.spk", out) == 0
        first = (out / "dsd_matmul.py").read_text().splitlines()[0]
        assert first == f"# Generated by sparsegen from dsd_matmul.spk (sha256 {digest}) for v5e. Do not edit:", out


def test_check_does_not_depend_on_how_the_spec_is_spelled(tmp_path):
    # Every example is checked by test_generated_is_current; here the spellings, on a few, in
    # a copy of the project holding their modules from generated/ (no orphans to report).
    (tmp_path / "pyproject.toml").write_text("")
    shutil.copytree(SPECS, tmp_path / "specs")
    (tmp_path / "tests").mkdir()
    (tmp_path / "generated").mkdir()
    _few_modules(tmp_path / "generated")
    for specs, cwd, out in [
        ([tmp_path / e for e in FEW], tmp_path, "generated"),
        ([f"../{e}" for e in FEW], tmp_path / "tests", "../generated"),
    ]:
        result = in_process("check", *specs, "-o", out, cwd=cwd)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout == f"{len(FEW_MODULES)} modules up to date in {out}\n", result.stdout + result.stderr


def test_diagnostics_name_the_spec_as_typed():
    result = sparsegen("build", "./tests/bad/tile_zero.spk", "-o", "/nonexistent/never-written")
    assert result.returncode == 1 and result.stderr.startswith("./tests/bad/tile_zero.spk:"), result.stderr


def _few_modules(folder, source=ROOT / "generated"):
    """FEW's modules copied into a folder: from generated/ (which the first test proves
    current) for a copy of the project, or from a build of FEW outside any project."""
    for name in FEW_MODULES:
        shutil.copy(source / name, folder / name)


@pytest.fixture(scope="module")
def few_built(tmp_path_factory):
    """FEW built once outside any project (headers name the spec file alone)."""
    out = tmp_path_factory.mktemp("few")
    assert in_process("build", *FEW, "-o", out).returncode == 0
    return out


def test_check_reports_stale_and_missing(tmp_path, few_built):
    _few_modules(tmp_path, few_built)
    (tmp_path / "dsd_matmul.py").write_text("# edited\n")
    (tmp_path / "sdd_matmul.py").unlink()
    result = in_process("check", *FEW, "-o", tmp_path)
    assert result.returncode == 1
    assert f"stale: {tmp_path / 'dsd_matmul.py'}" in result.stdout
    assert f"missing: {tmp_path / 'sdd_matmul.py'}" in result.stdout
    assert not (tmp_path / "sdd_matmul.py").exists(), "check must not write"


def test_check_compares_with_the_target_a_module_records(tmp_path):
    """A module built for h200 records it; `check` without --target compares it with an h200
    build (not v5e, which would call it stale and advise replacing the GPU kernel by a TPU
    one), and a stale module's advice keeps its target."""
    result = in_process("build", "specs/dsd_matmul.spk", "--target", "H200", "-o", tmp_path)  # any case
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "dsd_matmul.py").read_text().splitlines()
    assert lines[0].endswith(") for h200. Do not edit:") and lines[1] == "# change the spec and run `sparsegen build --target h200`."
    result = in_process("check", "specs/dsd_matmul.spk", "-o", tmp_path)
    assert result.returncode == 0 and result.stdout == f"1 module up to date in {tmp_path}\n", result.stdout + result.stderr
    # Asked for v5e: stale, saying which target the module was built for.
    result = in_process("check", "specs/dsd_matmul.spk", "-o", tmp_path, "--target", "v5e")
    assert result.returncode == 1 and "(from specs/dsd_matmul.spk; built for h200, checked for v5e)" in result.stdout
    # Edited, next to a missing TPU module: one build command per target.
    with (tmp_path / "dsd_matmul.py").open("a") as f:
        f.write("# edited\n")
    result = in_process("check", "specs/dsd_matmul.spk", "specs/sdd_matmul.spk", "-o", tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines()[-1] == (f"2 modules out of date; run: sparsegen build specs/dsd_matmul.spk -o {tmp_path} --target h200"
                                              f" && sparsegen build specs/sdd_matmul.spk -o {tmp_path}")


def test_check_reports_orphans_and_leaves_other_files_alone(tmp_path, few_built):
    _few_modules(tmp_path, few_built)
    (tmp_path / "old_kernel.py").write_text((tmp_path / "dsd_matmul.py").read_text())  # a spec since removed
    others = {
        "__init__.py": "",
        "helpers.py": "# Generated by hand\n",
        "notes.py": "x = 1\n# Generated by sparsegen from x.spk\n",
    }
    for name, text in others.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.py").write_bytes(b"\xff\xfe")
    result = in_process("check", *FEW, "-o", tmp_path)
    assert result.returncode == 1, result.stdout
    assert result.stdout.splitlines() == [
        f"orphan: {tmp_path / 'old_kernel.py'} (no spec defines kernel 'old_kernel')",
        "1 orphan module: delete it, or give the specs that define their kernels",
    ]
    for name, text in others.items():
        assert (tmp_path / name).read_text() == text
    assert (tmp_path / "old_kernel.py").exists(), "check must not delete"
    result = in_process("check", "specs/dsd_matmul.spk", "specs/sdd_matmul.spk", "-o", "generated")
    assert result.returncode == 1
    assert [line for line in result.stdout.splitlines() if line.startswith("orphan: ")] == [
        f"orphan: generated/{name}.py (no spec defines kernel '{name}')"
        for name in sorted(p.stem for p in (ROOT / "generated").glob("*.py") if p.stem not in ("dsd_matmul", "sdd_matmul", "__init__"))
    ]


def test_failed_build_writes_nothing(tmp_path):
    bad = ROOT / "tests" / "bad" / "tile_zero.spk"
    result = sparsegen("build", "specs/dsd_matmul.spk", bad, "-o", tmp_path / "out")
    assert result.returncode == 1
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert "error: tile i = 0" in result.stderr


def test_spec_errors_exit_1_without_traceback(capsys):
    from sparsegen.cli import main

    for bad in sorted((ROOT / "tests" / "bad").glob("*.spk")):
        assert main(["build", str(bad), "-o", "/nonexistent/never-written"]) == 1, bad
        err = capsys.readouterr().err
        assert "Traceback" not in err, bad
        assert err.startswith(f"{bad}:"), bad
    # And one through a real process, as a user runs it.
    result = sparsegen("build", ROOT / "tests" / "bad" / "layout_lanes.spk", "-o", "/nonexistent/never-written")
    assert result.returncode == 1 and "Traceback" not in result.stderr


def test_usage_errors_exit_2():
    assert sparsegen().returncode == 2
    assert sparsegen("build").returncode == 2
    assert sparsegen("build", "specs/dsd_matmul.spk", "--target", "v9").returncode == 2
    assert sparsegen("frobnicate").returncode == 2


def test_missing_and_non_utf8_files_are_errors(tmp_path):
    result = sparsegen("build", tmp_path / "absent.spk", "-o", tmp_path)
    assert result.returncode == 1 and "cannot read file" in result.stderr and "Traceback" not in result.stderr
    latin = tmp_path / "latin.spk"
    latin.write_bytes(b"\xff\xfe kernel")
    result = sparsegen("build", latin, "-o", tmp_path)
    assert result.returncode == 1 and "not UTF-8" in result.stderr and "Traceback" not in result.stderr


def test_same_kernel_name_in_two_specs_is_an_error(tmp_path):
    copy = tmp_path / "again.spk"
    copy.write_text((SPECS / "dsd_matmul.spk").read_text())
    result = sparsegen("build", "specs/dsd_matmul.spk", copy, "-o", tmp_path / "out")
    assert result.returncode == 1 and "also defined in" in result.stderr
    assert not (tmp_path / "out").exists()


def test_two_spellings_of_one_spec_compile_it_once(tmp_path):
    (tmp_path / "link.spk").symlink_to(SPECS / "dsd_matmul.spk")
    spellings = [
        "specs/dsd_matmul.spk",
        "./specs/dsd_matmul.spk",
        SPECS / "dsd_matmul.spk",
        "specs/../specs/dsd_matmul.spk",
        tmp_path / "link.spk",
    ]
    result = sparsegen("build", *spellings, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {tmp_path / 'out' / 'dsd_matmul.py'}\n"
    result = sparsegen("check", *spellings, "-o", tmp_path / "out")
    assert result.returncode == 0 and "1 module up to date" in result.stdout, result.stdout + result.stderr


def test_plan_describes_grid_blocks_and_memory():
    result = sparsegen("plan", "specs/masked_matmul.spk")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "grid (n_run)" in out and "n_steps = pl.cdiv(M, 512) * pl.cdiv(N, 512) * pl.cdiv(K, 1024)" in out
    assert "dimension_semantics (arbitrary)" in out
    assert "in  mask block (512, 512)" in out and "next_mask" in out
    assert "VMEM estimate: 10.1 MiB of 128 MiB on v5e" in out
    result = sparsegen("plan", "specs/dsd_matmul.spk", "--kernel", "nope")
    assert result.returncode == 1


def test_generated_modules_import_only_jax_numpy_and_stdlib():
    import ast

    allowed = {"functools", "jax", "numpy"}
    for path in (ROOT / "generated").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, (path.name, roots)


def test_output_that_is_a_file_is_a_usage_error(tmp_path):
    (tmp_path / "out.txt").write_text("not a folder")
    for command in ("build", "check"):
        result = sparsegen(command, ROOT / "specs" / "dsd_matmul.spk", "-o", "out.txt", cwd=tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert result.stderr == f"sparsegen {command}: -o out.txt is a file, not a directory\n"
        result = sparsegen(command, ROOT / "specs" / "dsd_matmul.spk", "-o", "out.txt/deeper", cwd=tmp_path)
        assert result.returncode == 2
        assert result.stderr == f"sparsegen {command}: -o out.txt/deeper: out.txt is a file, not a directory\n"
    assert (tmp_path / "out.txt").read_text() == "not a folder"


def _spec_named(tmp_path, name):
    spec = tmp_path / "long.spk"
    spec.write_text((SPECS / "dsd_matmul.spk").read_text().replace("kernel dsd_matmul", f"kernel {name}"))
    return spec


def test_write_errors_name_the_target_not_a_temporary(tmp_path):
    # NAME.py fits in a file name (255 bytes) but a temporary named after it would not.
    fits = "k" * 245
    result = sparsegen("build", _spec_named(tmp_path, fits), "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [f"{fits}.py"]
    # NAME.py itself is too long: the message names it, and nothing else is written.
    result = sparsegen("build", "specs/dsd_matmul.spk", _spec_named(tmp_path, "k" * 260), "-o", tmp_path / "out2")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr == f"{tmp_path / 'out2' / ('k' * 260 + '.py')}: error: cannot write: File name too long\n"
    assert not any((tmp_path / "out2").iterdir())


def _build_under_umask(umask, *args):
    """`sparsegen build` in a child process whose umask is `umask`."""
    code = f"import os, sys; os.umask({umask:#o}); from sparsegen.cli import main; sys.exit(main({list(map(str, args))!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)


def test_modules_are_written_with_the_umasks_mode(tmp_path):
    """A module gets 0o666 less the umask (0644 under 022), as any new file, also when a
    rebuild replaces one (mkstemp's 0600 would lock other users out of it)."""
    import stat

    module = tmp_path / "out" / "dsd_matmul.py"
    for umask, mode in [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600), (0o022, 0o644)]:
        result = _build_under_umask(umask, "build", "specs/dsd_matmul.spk", "-o", tmp_path / "out", "-q")
        assert result.returncode == 0, result.stderr
        assert stat.S_IMODE(module.stat().st_mode) == mode, (oct(umask), oct(module.stat().st_mode))
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["dsd_matmul.py"], "no temporary left behind"


def test_every_option_of_every_subcommand_has_help():
    import argparse

    from sparsegen.cli import _parser

    parser = _parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == {"build", "check", "plan", "verify", "variants"}
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help and action.help != argparse.SUPPRESS, (name, action.dest)
    assert all(a.help for a in parser._actions)


def test_version():
    import tomllib

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    result = sparsegen("--version")
    assert result.returncode == 0 and result.stdout == f"sparsegen {version}\n", result.stdout + result.stderr


@pytest.mark.parametrize("argv,said", [
    # a size the spec lacks (a lower-case typo) was ignored, exit 0
    (["verify", "specs/dsd_matmul.spk", "--quick", "--shape", "M=512,k=512"],
     "sparsegen verify: --shape k=512: specs/dsd_matmul.spk has no size k (its sizes: M, K, N)"),
    (["verify", "specs/dsd_matmul.spk", "specs/sdd_matmul.spk", "--quick", "--shape", "Q=5"],
     "sparsegen verify: --shape Q=5: none of specs/dsd_matmul.spk, specs/sdd_matmul.spk has a size Q (their sizes: M, K, N)"),
    (["verify", "specs/dsd_matmul.spk", "--target", "h200", "--lower-only", "--shape", "Q=5"],
     "sparsegen verify: --shape Q=5: specs/dsd_matmul.spk has no size Q (its sizes: M, K, N)"),
    (["plan", "specs/masked_matmul.spk", "--pattern", "tril", "--shape", "M=256,n=256"],
     "sparsegen plan: --shape n=256: specs/masked_matmul.spk has no size n (its sizes: M, K, N)"),
    (["variants", "specs/dsd_matmul.spk", "--tile", "m=128", "--shape", "Q=5", "--no-compile"],
     "sparsegen variants: --shape Q=5: specs/dsd_matmul.spk has no size Q (its sizes: M, K, N)"),
    # a size of zero was reported as "does not compile for v5e", exit 1
    (["verify", "specs/dsd_matmul.spk", "--quick", "--shape", "M=0"], "sparsegen verify: --shape M=0: sizes must be positive"),
    (["plan", "specs/masked_matmul.spk", "--pattern", "tril", "--shape", "M=0"], "sparsegen plan: --shape M=0: sizes must be positive"),
])
def test_shape_names_a_size_of_the_spec_and_is_positive(argv, said):
    result = in_process(*argv)
    assert (result.returncode, result.stderr.strip()) == (2, said)


def test_check_says_a_module_comes_from_another_spec_with_the_same_kernel(tmp_path):
    """Two specs define a kernel of one name: the module another spec built (its header names
    it) is not stale, and rebuilding it from this spec would overwrite it; `check` says
    where it comes from and advises no build of it (it advised `sparsegen build` of this spec)."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "specs").mkdir()
    (tmp_path / "other").mkdir()
    shutil.copy(SPECS / "dsd_matmul.spk", tmp_path / "specs" / "dsd_matmul.spk")
    shutil.copy(SPECS / "sdd_matmul.spk", tmp_path / "specs" / "sdd_matmul.spk")
    (tmp_path / "other" / "mine.spk").write_text((SPECS / "dsd_matmul.spk").read_text().replace("tile m = 512", "tile m = 256"))
    assert in_process("build", "other/mine.spk", "specs/sdd_matmul.spk", "-o", "generated", cwd=tmp_path).returncode == 0
    result = in_process("check", "specs/dsd_matmul.spk", "specs/sdd_matmul.spk", "-o", "generated", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        "other spec: generated/dsd_matmul.py (built from other/mine.spk, which also defines kernel 'dsd_matmul'; not from specs/dsd_matmul.spk)",
        "1 module built from another spec with a kernel of the same name: rename one of the kernels, or build them into different folders",
    ]
    # A module whose spec has moved (its header names a file that is gone) is stale: rebuilt from where it is now.
    (tmp_path / "other" / "mine.spk").unlink()
    result = in_process("check", "specs/dsd_matmul.spk", "specs/sdd_matmul.spk", "-o", "generated", cwd=tmp_path)
    assert result.stdout.splitlines() == ["stale: generated/dsd_matmul.py (from specs/dsd_matmul.spk)",
                                          "1 module out of date; run: sparsegen build specs/dsd_matmul.spk -o generated"]


def _matmuls(tiles: list[int]) -> str:
    """One small matmul kernel per tile of m (8192: m, n and k, which needs 2 GiB of VMEM)."""
    return "\n".join(f"kernel mm{n} {{\n    in  x: f32[M, K]\n    in  y: f32[K, N]\n    out o: f32[M, N]\n\n    o[m, n] = x[m, k] * y[k, n]\n\n"
                     f"    tile m = {t}, n = {128 if t < 8192 else t}, k = {128 if t < 8192 else t}\n}}\n" for n, t in enumerate(tiles))


def test_worker_processes_build_the_same_modules_and_report_the_same_problems(tmp_path):
    """Ten kernels: with -j 2 two forked workers lower and emit them (the parallel path is
    taken: counted), the modules are byte for byte those of -j 1; a kernel the lowering
    refuses (VMEM) among them is reported as one process reports it, and nothing is written."""
    good = tmp_path / "good.spk"
    good.write_text(_matmuls([128, 256, 512, 8, 16, 32, 64, 1024, 128, 256]))
    bad = tmp_path / "bad.spk"
    bad.write_text(_matmuls([128, 256, 8192, 16, 32, 64, 128, 256, 512]))
    run = (
        "import sys\n"
        "import sparsegen.compiler as c\n"
        "real, calls = c.emit_in_parallel, []\n"
        "c.emit_in_parallel = lambda work, jobs: calls.append(jobs) or real(work, jobs)\n"
        "from sparsegen.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "print('workers', calls)\n"
        "sys.exit(code)\n"
    )

    def build(spec, out, jobs):
        return subprocess.run([sys.executable, "-c", run, "build", spec, "-o", out, "-q", "-j", str(jobs)], cwd=ROOT, capture_output=True, text=True)

    one, two = build(good, tmp_path / "one", 1), build(good, tmp_path / "two", 2)
    assert one.returncode == two.returncode == 0, one.stderr + two.stderr
    assert "workers []" in one.stdout and "workers [2]" in two.stdout
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(f"mm{n}.py" for n in range(10)) == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    one, two = build(bad, tmp_path / "bad_one", 1), build(bad, tmp_path / "bad_two", 2)
    assert one.returncode == two.returncode == 1 and "workers [2]" in two.stdout
    assert "need 2048.1 MiB of VMEM" in one.stderr and one.stderr == two.stderr
    assert not (tmp_path / "bad_one").exists() and not (tmp_path / "bad_two").exists()


def test_a_build_in_a_running_process_leaves_the_collector_as_it_was(tmp_path):
    """`main([...])` (a notebook, a test) pauses the cyclic collector during a build and
    resumes it; only the program itself (`main()`, about to exit) freezes what is left."""
    import gc

    frozen = gc.get_freeze_count()
    assert in_process("build", "specs/dsd_matmul.spk", "-o", tmp_path, "-q").returncode == 0
    assert gc.isenabled() and gc.get_freeze_count() == frozen

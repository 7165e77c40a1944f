"""The fast formatter is byte-identical to black, in its default configuration, on whole
modules; the checked-in modules are black-clean under that configuration."""

from __future__ import annotations

import ast
import os

import black
import pytest
from conftest import GENERATED, SPECS, spec_text, with_tiles
from hygiene_specs import MASKED_SDD, NASTY, NASTY_MASK, TRANSPOSED, XMASK, XMASK_SDD
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsegen.backends import emit_module
from sparsegen.compiler import compile_source
from sparsegen.tpu.attention import AttentionModule
from sparsegen.tpu.emit import _Emitter
from sparsegen.formatting import BLACK_MODE, format_module
from sparsegen.source import SourceFile, SpecError

TEXTS = [spec_text(p.stem) for p in sorted(SPECS.glob("*.spk"))] + [NASTY, NASTY_MASK, TRANSPOSED, XMASK, MASKED_SDD, XMASK_SDD]


def raw_and_name(text):
    module, *_ = compile_source(SourceFile("f.spk", text))
    if isinstance(module.plan, AttentionModule):  # the row walk's and the paged walk's (its subclass)
        return emit_module(module.plan, "f.spk", formatted=False), module.plan.name
    return _Emitter(module.plan).module("f.spk"), module.plan.name


def syntax(code: str) -> str:
    """A module's syntax tree, its docstrings' lines stripped (black re-indents docstrings and
    puts a long one's closing quotes on a line of their own: layout, as black's own check has it)."""
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                first.value.value = "\n".join(line.strip() for line in first.value.value.strip().splitlines())
    return ast.dump(tree)


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_identical_to_black(text):
    """... and black changes layout only: the modules the tests build unformatted
    (tests/conftest.py's `build`) are the code the formatted ones are."""
    raw, name = raw_and_name(text)
    formatted = format_module(raw, names=(name,))
    assert formatted == black.format_str(raw, mode=black.Mode())
    assert syntax(formatted) == syntax(raw)


@settings(max_examples=12 if os.environ.get("SPARSEGEN_SWEEP") == "1" else 6, deadline=None, derandomize=True)
@given(st.sampled_from(["dsd_matmul", "dds_matmul", "masked_matmul", "sdd_matmul"]), st.lists(st.sampled_from([16, 64, 128, 256, 512, 1024, 2048, 4096]), min_size=3, max_size=3))
def test_identical_to_black_on_variants(name, tiles):
    try:
        raw, kernel = raw_and_name(with_tiles(spec_text(name), m=tiles[0], n=tiles[1], k=tiles[2]).replace(f"kernel {name}", f"kernel {name}_v{tiles[0]}"))
    except SpecError:
        return  # a tiling the checks reject
    assert format_module(raw, names=(kernel,)) == black.format_str(raw, mode=black.Mode())


def test_the_mode_is_blacks_default():
    assert BLACK_MODE == black.Mode()


def test_target_versions_are_inferred_for_the_whole_module():
    """The f-string in the first statement makes black target 3.6+, where a call exploded one
    argument per line gets a trailing comma after `*rest`; formatted alone, the second
    statement would target every version and get none."""
    source = 'x = f"{y}"\n\n\ndef g():\n    return function_with_a_long_name(first_argument_value_aaaaaaaaaaaaaaaaa, second_argument_value_bbbbbbbbbbbbbbb, *rest)\n'
    assert "*rest,\n" in black.format_str(source, mode=black.Mode())
    assert format_module(source) == black.format_str(source, mode=black.Mode())


@pytest.mark.parametrize("path", sorted(GENERATED.glob("*.py")), ids=lambda p: p.name)
def test_generated_modules_are_black_clean_at_the_default_configuration(path):
    code = path.read_text()
    assert black.format_str(code, mode=black.Mode()) == code


def _fresh_caches(monkeypatch, folder):
    """The formatter as in a new process whose cache folder is `folder`."""
    from sparsegen import formatting

    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(folder))
    monkeypatch.setattr(formatting, "_DISK", formatting._DiskCache())
    for cached in (formatting._format_whole, formatting._black, formatting._features, formatting._left_alone, formatting._format_chunk):
        cached.cache_clear()


def test_a_rebuild_formats_from_the_disk_cache(tmp_path, monkeypatch):
    """What black returned is kept on disk: a new process formats the same modules (a spec
    and a variant of its tiles) without calling black, to the same bytes."""
    text, name = raw_and_name(spec_text("dsd_matmul"))
    variant, _ = raw_and_name(with_tiles(spec_text("dsd_matmul"), m=256, n=128, k=512))
    _fresh_caches(monkeypatch, tmp_path)
    first = format_module(text, (name,))
    assert first == black.format_str(text, mode=BLACK_MODE)
    assert any(tmp_path.rglob("module-*.py")) and any(tmp_path.rglob("chunk-*.py"))
    expected = black.format_str(variant, mode=BLACK_MODE)
    assert format_module(variant, (name,)) == expected

    def no_black(*args, **kwargs):
        raise AssertionError("black was called")

    _fresh_caches(monkeypatch, tmp_path)
    monkeypatch.setattr(black, "format_str", no_black)
    monkeypatch.setattr(black, "lib2to3_parse", no_black)
    assert format_module(text, (name,)) == first
    assert format_module(variant, (name,)) == expected


def test_names_are_stood_in_for_as_words_and_word_starts():
    """A kernel's name is swapped for a stand-in where it is a word or starts one
    (`NAME_on_mesh`), never inside another word; the text is black's."""
    text = "def mm(a):\n    return mm_on_mesh(a)+xmm+mm( a )+mmx\n\n\nmm_ = mm\n"
    assert format_module(text, ("mm",)) == black.format_str(text, mode=BLACK_MODE)


def test_templates_are_compiled_once_into_the_cache_folder(tmp_path, monkeypatch):
    """jinja keeps the compiled templates in sparsegen's cache folder: a new environment (a
    new process) loads them from there and renders the same module."""
    from sparsegen import templating

    text = spec_text("dsd_matmul")
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(tmp_path))
    templating.environment.cache_clear()
    try:
        first = compile_source(SourceFile("f.spk", text))[0].code
        assert len(list((tmp_path / "templates").glob("*.cache"))) >= 2
        templating.environment.cache_clear()
        assert compile_source(SourceFile("f.spk", text))[0].code == first
    finally:
        templating.environment.cache_clear()

"""Reads through tables (language v2, section 2), the front end: `kc[h // 8, pages[b, j // T],
j % T, d]`, `%` and a size as divisor in subscripts are parsed and checked, and every target
refuses them with one diagnostic at the read until the schedules handle them (issue 19).
Each diagnostic's LINE:COL is checked by the bad-spec corpus (tests/bad/table_*, modulus_*,
lowering_*); here: the forms, the sizes they bind, the IR, the refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparsegen import syntax as ast
from sparsegen.backends import lower_kernel, not_lowered
from sparsegen.check import check
from sparsegen.compiler import check_source, compile_file, compile_source
from sparsegen.ir import Size
from sparsegen.source import SourceFile, SpecError
from sparsegen.syntax import parse

PAGED = Path("/work/shared/specs-v2/paged_decode.spk")
PAGED_TEXT = """\
# Grouped-query decoding over a paged key/value cache (specs-v2/paged_decode.spk).
kernel paged_decode {
    in  q: bf16[B, H, D]
    in  kc: bf16[G, P, T, D]
    in  vc: bf16[G, P, T, D]
    in  pages: index[B, NP]
    in  lens: index[B]
    out o: bf16[B, H, D]

    s[b, h, j] = q[b, h, d] * kc[h // 8, pages[b, j // T], j % T, d] * 0.08838834764831845 where j < lens[b]
    o[b, h, e] = softmax(s[b, h, j], j) * vc[h // 8, pages[b, j // T], j % T, e]

    tile b = 1, h = 8, j = 512, d = 128, e = 128
}
"""


def _kernel(text: str, name: str = "t.spk"):
    (k,) = check_source(SourceFile(name, text))
    return k


def _paged():
    return _kernel(PAGED.read_text() if PAGED.exists() else PAGED_TEXT, "paged_decode.spk")


def _errors(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        check(parse(SourceFile("t.spk", text)))
    return [line for line in info.value.render().splitlines() if ": error: " in line]


# ------------------------------------------------------------------------- parsing


def test_the_v2_subscripts_parse_with_their_spans():
    spec = parse(SourceFile("paged.spk", PAGED_TEXT))
    score = spec.kernels[0].statements[0]
    kc = ast.factors(score.value)[1]
    h8, table, mod, d = kc.subscripts
    assert h8.divisor == 8 and h8.plain
    assert table.table is not None and table.table.operand.text == "pages"
    assert (table.span.line, table.span.col) == (10, 42)
    b, jt = table.table.subscripts
    assert b.index.text == "b" and b.plain
    assert jt.index.text == "j" and jt.divisor is None and jt.divisor_size.text == "T"
    assert (jt.by_span.line, jt.by_span.col) == (10, 56)
    assert mod.modulus.text == "T" and not mod.plain
    assert [n.text for n in table.indices] == ["b", "j"]
    assert table.text == "pages[b, j // T]" and mod.text == "j % T"
    assert d.index.text == "d" and d.plain


@pytest.mark.parametrize("subscript, check_it", [
    ("pages[b, 0]", lambda s: s.table.subscripts[1].literal == 0 and s.table.subscripts[1].indices == ()),
    ("pages[b // 2, j % 4]", lambda s: s.table.subscripts[0].divisor == 2 and s.table.subscripts[1].modulus == 4),
    ("i % 8", lambda s: s.modulus == 8 and s.by_span is not None),
    ("i % -3", lambda s: s.modulus == -3),
    ("i // -3", lambda s: s.divisor == -3),
    ("s[0] + i", lambda s: s.offset.operand.text == "s" and s.offset.position == 0 and s.plain),
    ("i + s[1]", lambda s: s.offset.position == 1),
])
def test_subscript_forms(subscript, check_it):
    spec = parse(SourceFile("t.spk", f"kernel k {{\n    o[i] = x[{subscript}]\n}}\n"))
    (sub,) = ast.factors(spec.kernels[0].statements[0].value)[0].subscripts
    assert check_it(sub)


def test_an_offset_is_one_literal_entry():
    with pytest.raises(SpecError) as info:
        parse(SourceFile("t.spk", "kernel k {\n    o[i] = x[s[i] + i]\n}\n"))
    assert info.value.render().startswith("t.spk:2:16: error: an offset reads one entry of an index operand at a literal position")


# -------------------------------------------------------------------- checking


def test_paged_decode_checks_and_j_ranges_over_np_times_t():
    k = _paged()
    sizes = {i.name: i.size for i in k.indices}
    assert sizes["b"] == Size("B", None) and sizes["h"] == Size("H", None)
    assert sizes["j"] == Size(None, None, ("NP", "T")) and sizes["j"].text == "NP * T"
    assert k.index("j").blocks == "ceil(NP * T / 512)"
    score, out = k.statements
    (q, kc) = score.factors
    assert kc.indices == ("h", "b", "j", "d")  # every index the read uses, once
    assert score.summed == ("d",)
    assert kc.text == "kc[h // 8, pages[b, j // T], j % T, d]"
    table = kc.subs[1].table
    assert table.operand == "pages" and [s.text for s in table.subs] == ["b", "j // T"]
    assert table.subs[1].divisor == "T" and kc.subs[2].modulus == "T"
    assert not kc.lowered and q.lowered
    assert [r.text for r in score.condition.reads] == ["lens[b]"]
    assert out.value.text == "vc[h // 8, pages[b, j // T], j % T, e]"
    assert {(r.index, r.divisor) for r in k.relations} == {("h", 8)}
    assert k.operand("pages").sparsity == "index" and k.operand("pages").rank == 2


def test_literal_pages_give_a_literal_size():
    k = _kernel("""kernel k {
    in  kc: f32[P, 16, D]
    in  pages: index[B, 4]
    out o: f32[B, D]
    o[b, d] = kc[pages[b, j // 16], j % 16, d]
    tile b = 1, j = 64, d = 128
}
""")
    assert k.index("j").size == Size(None, 64)


def test_a_modulus_by_a_literal_fixes_the_dimension_and_the_divisor_size_multiplies():
    k = _kernel("""kernel k {
    in  kc: f32[P, T, D]
    in  pages: index[B, NP]
    out o: f32[B, D]
    o[b, d] = kc[pages[b, j // 16], j % 16, d]
    tile b = 1, j = 64, d = 128
}
""")
    assert dict(k.symbols)["T"] == 16
    assert k.index("j").size == Size(None, None, ("NP", 16))


def test_modulus_beside_a_plain_binding_and_a_size_divisor_relation():
    k = _kernel("""kernel k {
    in  x: f32[M, 4]
    in  w: f32[N]
    in  y: f32[Q, T]
    out o: f32[N]
    o[i] = x[i // 4, i % 4] * w[i] * y[i // T, i % T]
    tile i = 128
}
""")
    assert k.index("i").size == Size("N", None)
    assert {(r.index, r.divisor, r.dim.text) for r in k.relations} == {("i", 4, "M"), ("i", "T", "Q")}


def test_an_index_operand_read_as_a_table_may_have_any_shape_and_still_offsets_a_vector():
    k = _kernel("""kernel k {
    in  x: f32[P, D]
    in  t: index[B, C, 2]
    out o: f32[B, C, D]
    o[b, c, d] = x[t[b, c, 1], d]
    tile b = 1, c = 8, d = 128
}
""")
    assert k.operand("t").dims == (Size("B", None), Size("C", None), Size(None, 2))
    # An offset still reads a vector with a literal length (language v1).
    assert "index operand 's' needs a literal length" in _errors("""kernel k {
    in  x: f32[M]
    in  s: index[L]
    out o: f32[M]
    o[i] = x[s[0] + i]
    tile i = 128
}
""")[0]


@pytest.mark.parametrize("read", ["x[i, i % 4]", "x[i // 2, i // 4]", "x[i % 4, i % 4]"])
def test_a_diagonal_is_still_refused_but_j_div_and_j_mod_may_share_an_access(read):
    errors = _errors(f"""kernel k {{
    in  x: f32[M, 4]
    out o: f32[M]
    o[i] = {read}
    tile i = 128
}}
""")
    assert any("index 'i' is used twice in one access" in e for e in errors), errors


def _paged_like(kc_dims: str, statement: str, tiles: str = "b = 1, j = 128, d = 128") -> str:
    return f"""kernel k {{
    in  kc: f32[{kc_dims}]
    in  pages: index[B, NP]
    out o: f32[B, D]
    {statement}
    tile {tiles}
}}
"""


@pytest.mark.parametrize("text, where, message", [
    # j // 16 alone (no j % 16 beside it) binds nothing, as `h // 4` alone does in v1
    (_paged_like("P, D", "o[b, d] = kc[pages[b, j // 16], d]"), "5:27", "index 'j' has no size"),
    (_paged_like("P, T, D", "o[b, d] = kc[pages[b, b], j % T, d]"), "5:27", "index 'b' is used twice in one access"),
    # a table is an access of its own: j // T in it and beside it is no diagonal (and no size)
    (_paged_like("P, T, D", "o[b, d] = kc[pages[b, j // T], j // T, d]"), "5:27", "index 'j' has no size"),
    (_paged_like("P, T, D", "o[b, d] = kc[pages[b, j // P2], j % T, d]"), "5:32", "'P2' is not a size"),
    (_paged_like("P, T, D", "o[b, d] = kc[pages[b, j // d], j % T, d]"), "5:32", "'d' is an index; `j // ...` takes a positive integer or a size"),
    (_paged_like("P, T, D", "o[b, d] = kc[pages[b, j // T], j % T, d] where pages[b, j // T] >= 0"), "5:61",
     "an operand in a condition is read with plain indices"),
    (_paged_like("P, T, D", "o[b, d] = kc[pages[b, j // T, 0], j % T, d]"), "5:18", "'pages' has 2 dimensions but is accessed with 3 subscripts"),
    (_paged_like("P, T, D", "o[b, d] = pages[b, j // T] * kc[b, j % T, d]"), "5:15", "'pages' is an index operand"),
])
def test_more_table_diagnostics(text, where, message):
    errors = _errors(text)
    assert errors[0].startswith(f"t.spk:{where}: error: {message}"), errors


# --------------------------------------------------------------------- refusal

REFUSAL = "error: not supported yet: reads through tables ('pages[b, j // T]') are checked but not lowered for {} targets (issue 19)"

# Both targets lower the paged walk (tests/test_paged.py, tests/test_gpu_decode.py); a table
# read anywhere else, as in this einsum, is refused.
GATHERED = """\
# A sum over a sequence's cached rows (an einsum reading through a table: no walk lowers it).
kernel gathered_sum {
    in  kc: f32[P, T, D]
    in  pages: index[B, NP]
    out o: f32[B, D]

    o[b, d] = kc[pages[b, j // T], j % T, d]

    tile b = 8, j = 128, d = 128
}
"""


@pytest.mark.parametrize("target, backend", [("v5e", "TPU"), ("h200", "GPU")])
def test_a_table_read_outside_the_paged_walk_is_refused_at_it(target, backend):
    k = _kernel(GATHERED, "gathered_sum.spk")
    module, problems = lower_kernel(k, target)
    assert module is None and len(problems) == 1
    (d,) = problems
    assert (d.span.line, d.span.col) == (7, 18)
    assert d.message == REFUSAL.format(backend)[len("error: "):]


def test_the_build_stops_at_the_refusal_with_one_diagnostic():
    source = SourceFile("gathered_sum.spk", GATHERED)
    with pytest.raises(SpecError) as info:
        compile_source(source, "h200")
    report = info.value.render().splitlines()
    assert report[0] == "gathered_sum.spk:7:18: " + REFUSAL.format("GPU")
    assert report[2].index("^") == 4 + 18 - 1 and report[2].count("~") == len("pages[b, j // T]") - 1
    assert sum(": error: " in line for line in report) == 1


@pytest.mark.skipif(not PAGED.exists(), reason="the shared v2 examples are not here")
@pytest.mark.parametrize("target", ["v5e", "h200"])
def test_the_shared_paged_decode_spec_builds(target):
    (m,) = compile_file(PAGED, target)
    assert m.kernel == "paged_decode"


@pytest.mark.parametrize("spec, first", [
    ("""kernel k {
    in  x: f32[M, 8]
    out o: f32[N]
    o[i] = x[i // 8, i % 8]
    tile i = 128
}
""", "4:22: error: not supported yet: '%' in a subscript ('i % 8')"),
    ("""kernel k {
    in  x: f32[Q, T]
    in  w: f32[N]
    out o: f32[N]
    o[i] = x[i // T, i % T] * w[i]
    tile i = 128
}
""", "5:14: error: not supported yet: a size as a subscript's divisor ('i // T')"),
])
@pytest.mark.parametrize("target", ["v5e", "h200"])
def test_every_unlowered_form_is_refused_once(spec, first, target):
    with pytest.raises(SpecError) as info:
        compile_source(SourceFile("t.spk", spec), target)
    lines = [line for line in info.value.render().splitlines() if ": error: " in line]
    backend = "GPU" if target == "h200" else "TPU"
    assert len(lines) == 1 and lines[0].startswith("t.spk:" + first), lines
    assert lines[0].endswith(f"is checked but not lowered for {backend} targets (issue 19)"), lines


def test_kernels_without_v2_forms_are_not_refused():
    for spec in sorted((Path(__file__).parents[1] / "specs").glob("*.spk")):
        if "pages[" in spec.read_text():
            continue  # the paged examples read through tables (tests/test_paged.py)
        for k in check_source(SourceFile.read(spec)):
            assert not_lowered(k, "v5e") is None, spec
            assert all(r.lowered for st in k.statements for r in (st.target, *st.factors)), spec


@pytest.mark.parametrize("command", ["build", "check"])
def test_the_cli_stops_at_the_refusal(tmp_path, capsys, command):
    from sparsegen.cli import main

    spec = tmp_path / "gathered_sum.spk"
    spec.write_text(GATHERED)
    assert main([command, str(spec), "-o", str(tmp_path / "out"), "--target", "h200"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{spec}:7:18: " + REFUSAL.format("GPU")), err
    assert err.count(": error: ") == 1
    assert not (tmp_path / "out" / "gathered_sum.py").exists()

"""Every runtime check of a generated module is reachable and has a test (issue 44).

The messages are read from the source, not listed by hand: every `_fail(...)` (and other
`raise`) of the templates (templates/*.j2, templates/*/*.j2), and every `_fail(...)` an
emitter writes into generated code (a string in sparsegen/ holding one). Each becomes a
pattern (its literal text, its placeholders any text); CASES maps each to inputs that raise
it from a generated wrapper, and `test_every_check_has_a_triggering_case` fails on a
message no case raises: a check added without a test, or one whose test was lost, fails
the suite. A check reached by several conditions (a page entry that is negative, or past
the page count; a coordinate below -1 or past the blocks) has a case per condition: each
condition can be removed alone, and only its own case sees it.

No kernel runs here: every check fires in the wrapper, before the pallas_call.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, build, spec_text, with_tiles
from mesh_jobs import one_device_mesh

from sparsegen.testing import example_args

# ------------------------------------------------------------------ the messages, from the source

_JINJA = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)
_LITERAL = re.compile(r'[rbf]*"(?:[^"\\\n]|\\.)*"|[rbf]*\'(?:[^\'\\\n]|\\.)*\'')


def _call_argument(text: str, open_at: int) -> str:
    """The text inside the parentheses that open at `open_at` (string literals skipped whole)."""
    depth, i = 0, open_at
    while True:
        c = text[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
        elif c in "\"'":
            i = _LITERAL.match(text, i).end() - 1
        i += 1


def _pattern(argument: str) -> tuple[str, str]:
    """(regex, text) for the messages an f-string argument makes: its literal text, every
    `{...}` placeholder any text (written `{}` in the text). Literals after a `+` outside a
    string (a conditional suffix) are optional: any text."""
    head, tail, at = [], False, 0
    for m in _LITERAL.finditer(argument):
        if "+" in argument[at : m.start()]:
            tail = True
            break
        head.append(m.group().lstrip("rbf")[1:-1].replace('\\"', '"').replace("\\'", "'"))
        at = m.end()
    s, regex, text, i = "".join(head), "", "", 0
    while i < len(s):
        if s[i] == "{":
            depth = 0
            while True:
                depth += {"{": 1, "}": -1}.get(s[i], 0)
                i += 1
                if depth == 0:
                    break
            regex, text = regex + ".*?", text + "{}"
        else:
            regex, text = regex + re.escape(s[i]), text + s[i]
            i += 1
    return regex + (".*" if tail else ""), text + ("{}" if tail else "")


class Message(NamedTuple):
    where: str  # file:line of the check
    error: str  # the exception's type
    regex: str  # what it raises, after "<kernel>: "
    text: str  # its literal text, placeholders as {}


def source_messages() -> list[Message]:
    """Every message a generated wrapper can raise, from the templates and the emitters."""
    found = []
    for path in sorted((ROOT / "templates").rglob("*.j2")):
        text = _JINJA.sub("{J}", path.read_text())  # a Jinja expression: a placeholder too
        for m in re.finditer(r"\b_fail\(|\braise (\w+)\(", text):
            if text[max(0, m.start() - 4) : m.start()] == "def " or m.group(1) == "ValueError":
                continue  # `def _fail` and its own `raise ValueError(f"{_NAME}: {message}")`
            where = f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
            found.append(Message(where, m.group(1) or "ValueError", *_pattern(_call_argument(text, m.end() - 1))))
    # Checks an emitter writes into the generated code: `_fail(` inside a string literal.
    for path in sorted((ROOT / "sparsegen").rglob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"""['"]\s*_fail\(""", text):
            where = f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}"
            found.append(Message(where, "ValueError", *_pattern(_call_argument(text, m.end() - 1))))
    return found


MESSAGES = source_messages()


# ------------------------------------------------------------------ the modules the cases call

def two_device_mesh():
    """A mesh whose axis has two devices (this process has one: listed twice). `sharded`'s
    checks of the sizes against the axis run before anything is placed on it."""
    device = jax.devices()[0]
    return jax.sharding.Mesh(np.array([device, device]), ("data",))


# Cross attention without a condition: its rows may be split alone (keys whole).
CROSS = """
kernel cross {
    in  q: f32[B, S, D]
    in  k: f32[B, T, D]
    in  v: f32[B, T, E]
    out o: f32[B, S, E]
    s[b, i, j] = q[b, i, d] * k[b, j, d]
    o[b, i, e] = softmax(s[b, i, j], j) * v[b, j, e]
    tile b = 1, i = 128, j = 128, d = 128, e = 128
}"""

NARROW = """
kernel narrow {
    in  x: f32[M, K]
    out o: f32[M]
    o[m] = x[m, k]
    tile m = 128, k = 64
}"""

OFFSETS = """
kernel gmm_offsets {
    in  x: bf16[M, K]
    in  w: bf16[E, K, N]
    in  lo: i32[E1]
    out o: bf16[M, N]
    o[m, n] = x[m, k] * w[g, k, n] where lo[g] <= m < lo[g + 1]
    tile m = 128, k = 128, n = 128, g = 1
}"""

WINDOW = """
kernel window_copy {
    in  g: f32[M, N]
    in  at: index[2]
    out o: f32[P, Q]
    o[at[0] + m, at[1] + n] = g[m, n]
    tile m = 128, n = 128
}"""


# ------------------------------------------------------------------ the cases

DSD = with_tiles(spec_text("dsd_matmul"), m=128, n=128, k=128)


def dsd(**changes):
    """dsd_matmul (its x stored as blocks: coordinates, padding) called with arguments
    changed: `a0`..`a3` (blocks, the two coordinates, y: a value, or a function of the
    argument), or keywords (None: left out)."""
    kernel, mod = build(DSD)
    args, keywords = example_args(kernel, dict(M=256, K=256, N=128), "random", np.random.default_rng(0))
    keywords["interpret"] = True
    for key, value in changes.items():
        if key.startswith("a"):
            n = int(key[1:])
            args[n] = value(args[n]) if callable(value) else value
        elif value is None:
            keywords.pop(key)
        else:
            keywords[key] = value
    return mod.dsd_matmul(*args, **keywords)


def first(value):
    """A coordinate array with its first entry set to `value`."""
    return lambda coords: np.concatenate([[value], np.asarray(coords)[1:]]).astype(np.int32)


def traced_size():
    kernel, mod = build(DSD)
    args, keywords = example_args(kernel, dict(M=256, K=256, N=128), "random", np.random.default_rng(0))
    jax.jit(lambda M: mod.dsd_matmul(*args, M=M, interpret=True))(keywords["M"])


def traced_interpret():
    kernel, mod = build(DSD)
    args, keywords = example_args(kernel, dict(M=256, K=256, N=128), "random", np.random.default_rng(0))
    jax.jit(lambda flag: mod.dsd_matmul(*args, **keywords, interpret=flag))(True)


def smem(monkeypatch):
    _, mod = build(DSD)
    monkeypatch.setattr(mod, "_SMEM_BYTES", 16)  # four entries: dsd_matmul's tables need more
    dsd()


def batched_blocks():
    """batched_dsd's stored blocks keep b's tile-1 dimension, here 2 wide."""
    _, mod = build(with_tiles(spec_text("batched_dsd"), b=1, m=128, n=128, k=128))
    mod.batched_dsd(np.zeros((1, 2, 128, 128), jnp.bfloat16), *([np.zeros(1, np.int32)] * 3),
                    np.zeros((1, 128, 128), jnp.bfloat16), M=128, interpret=True)


def window(P):
    """An output written at an offset, of a size the tile does not divide."""
    _, mod = build(WINDOW)
    mod.window_copy(np.zeros((128, 128), np.float32), np.zeros(2, np.int32), P=P, Q=256, interpret=True)


def narrow(K):
    _, mod = build(NARROW)
    mod.narrow(np.zeros((128, K), np.float32), interpret=True)


def gqa(H, G):
    """local_gqa_attention (`h // 4`) with H query heads and G key/value heads."""
    _, mod = build(spec_text("local_gqa_attention"))
    q, kv = jnp.zeros((1, H, 256, 128), jnp.bfloat16), jnp.zeros((1, G, 256, 128), jnp.bfloat16)
    mod.local_gqa_attention(q, kv, kv, interpret=True)


def head_dim(D):
    _, mod = build(spec_text("causal_attention"))
    q = jnp.zeros((1, 1, 512, D), jnp.bfloat16)
    mod.causal_attention(q, q, q, interpret=True)


def max_steps(value):
    _, mod = build(spec_text("document_attention"))
    q = jnp.zeros((1, 1, 512, 64), jnp.bfloat16)
    seg = np.zeros((1, 512), np.int32)  # one document: the second row block sees two key blocks
    mod.document_attention(q, q, q, seg, max_steps=value, interpret=True)


def block_slice(start):
    _, mod = build(spec_text("block_slice"))
    mod.block_slice(np.zeros((512, 512), np.int32), np.array(start, np.int32), interpret=True)


def offsets_short():
    """`lo[g + 1]` over E groups needs E + 1 entries: 3 groups, 3 entries."""
    _, mod = build(OFFSETS)
    x, w = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((3, 128, 128), jnp.bfloat16)
    mod.gmm_offsets(x, w, np.array([0, 100, 256], np.int32), interpret=True)


def paged(target="v5e", T=16, NP=4, P=6, entry=None, j=512, interpret=True):
    """paged_decode (key blocks of `j`): two sequences, the first of NP pages, the second of
    one token; `entry`: ((b, n), value) written into the page table."""
    _, mod = build(with_tiles(spec_text("paged_decode"), b=1, h=8, j=j, d=128, e=128), target)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 8, 128)), jnp.bfloat16)
    kc = jnp.asarray(rng.standard_normal((1, P, T, 128)), jnp.bfloat16)
    pages = np.tile(np.arange(NP, dtype=np.int32), (2, 1))
    if entry is not None:
        pages[entry[0]] = entry[1]
    lens = np.array([NP * T, 1], np.int32)
    return mod.paged_decode(q, kc, kc, pages, lens, interpret=interpret)


def refused_gradient():
    """A paged walk's gradient through the table (`_REFUSED`)."""
    _, mod = build(spec_text("paged_decode"))
    q = jnp.zeros((1, 8, 128), jnp.bfloat16)
    kc = jnp.zeros((1, 2, 16, 128), jnp.bfloat16)
    pages, lens = np.zeros((1, 1), np.int32), np.array([16], np.int32)
    loss = lambda kc: mod.paged_decode(q, kc, kc, pages, lens, interpret=True).astype(jnp.float32).sum()  # noqa: E731
    jax.eval_shape(jax.grad(loss), kc)  # traced: the refusal is made as the backward is traced


def gpu_simulator():
    from jax.experimental.pallas import tpu as pltpu

    paged("h200", T=64, NP=2, P=3, interpret=pltpu.InterpretParams())


def sharded(text, axes, mesh=None, sizes=None):
    """`sharded(mesh, **axes)`, called on example arguments of `sizes` where given."""
    kernel, mod = build(text)
    fn = mod.sharded(one_device_mesh() if mesh is None else mesh, **axes)
    if sizes is not None:
        args, keywords = example_args(kernel, sizes, "random", np.random.default_rng(0))
        fn(*args, **keywords, interpret=True)


CAUSAL = spec_text("causal_attention")
CAUSAL128 = with_tiles(CAUSAL, b=1, h=1, i=128, j=128, d=128, e=128)

# A piece of a message's text (placeholders {}) -> the cases that raise it, one per site
# where several checks raise the same text, one per condition where a check has several.
# A case is a function; one naming `monkeypatch` takes pytest's.
CASES = {
    "got shape": [("rank", lambda: dsd(a3=lambda y: y[0]))],
    "has dtype": [("dtype", lambda: dsd(a3=lambda y: np.asarray(y, np.float32)))],
    "must hold integers": [("float coordinates", lambda: dsd(a1=lambda c: np.asarray(c, np.float32)))],
    "sizes shape the grid": [("a traced size", traced_size)],
    "must be an integer": [("a float size", lambda: dsd(M=256.0)), ("a bool size", lambda: dsd(M=True))],
    "sizes must be positive": [("a zero size", lambda: dsd(M=0))],
    "{} is {}, but {} = {} from {}": [("a keyword that disagrees with an array", lambda: dsd(N=256))],
    "{} is {}, but the spec declares {}": [("a tile dimension of the blocks", lambda: dsd(a0=lambda b: b[:, :64]))],
    "interpret is traced": [("a traced interpret", traced_interpret)],
    "interpret must be True": [("a string interpret", lambda: dsd(interpret="yes"))],
    "NotImplementedError": [("a gradient through a page table", refused_gradient)],
    "mesh must be": [("a mesh's name", lambda: build(DSD)[1].sharded("data", m="data"))],
    "has no index": [("an index the spec lacks", lambda: sharded(DSD, {"z": "data"}))],
    "cannot be split: {}": [("an offset read", lambda: sharded(spec_text("block_slice"), {"i": "data"}))],
    "zigzag order": [
        ("an index other than the query", lambda: sharded(CAUSAL, {"b": ("data", "zigzag")})),
        ("the query alone, keys whole", lambda: sharded(CROSS, {"i": ("data", "zigzag")})),
    ],
    "several mesh axes": [("a tuple of axes", lambda: sharded(DSD, {"m": ("data", "model")}))],
    "not an axis of the mesh": [("an axis the mesh lacks", lambda: sharded(DSD, {"m": "nope"}))],
    "is given to both": [("two indices on one axis", lambda: sharded(DSD, {"m": "data", "n": "data"}))],
    "is split with the query index {}, as a ring": [
        ("the rows alone, keys of the same size", lambda: sharded(CAUSAL, {"i": "data"})),
    ],
    "are split over two mesh axes": [
        ("rows and keys on two axes", lambda: sharded(CAUSAL, {"i": "data", "j": "model"})),
    ],
    "cannot travel with the query index": [
        ("a mask read along rows and keys", lambda: sharded(spec_text("masked_attention"), {"i": "data", "j": "data"})),
    ],
    "is not divisible by": [
        ("a size the axis does not divide", lambda: sharded(DSD, {"n": "data"}, two_device_mesh(), dict(M=256, K=256, N=129))),
        ("zigzag: two chunks a device", lambda: sharded(CAUSAL128, {"i": ("data", "zigzag"), "j": "data"}, two_device_mesh(),
                                                        dict(B=1, H=1, S=258, D=128))),
    ],
    "whole number of stored blocks": [
        ("a device's slice of a coo dimension ends inside a block",
         lambda: sharded(DSD, {"m": "data"}, two_device_mesh(), dict(M=384, K=128, N=128))),
    ],
    "is not a multiple of its tile": [("an output written at an offset, not whole blocks", lambda: window(P=200))],
    "TPU's (8, 128) tiles": [("a narrow tile that does not span", lambda: narrow(K=128))],
    "as {} needs": [("heads not a multiple of the group", lambda: gqa(H=6, G=2))],
    "needs {} = {} / {}": [("heads and groups disagree", lambda: gqa(H=8, G=1))],
    "but its tile is 1": [("a batch block dimension not 1", batched_blocks)],
    "carried only by": [("a size only the sparse input carries", lambda: dsd(M=None))],
    "is out of range": [
        ("a coordinate past the blocks", lambda: dsd(a1=first(2))),
        ("a coordinate below -1", lambda: dsd(a1=first(-2))),
    ],
    "marks padding": [("-1 in one coordinate only", lambda: dsd(a1=first(-1)))],
    "read in blocks)": [("an offset not a multiple of the tile", lambda: block_slice([64, 0]))],
    "out of bounds": [
        ("an offset past the end", lambda: block_slice([0, 512])),
        ("a negative offset", lambda: block_slice([-128, 0])),
    ],
    "bytes of SMEM": [("tables larger than scalar memory", smem)],
    "tile of {} must span it": [("a head dimension the tile must span", lambda: head_dim(64))],
    "is the TPU simulator": [("the TPU simulator's parameters for a GPU module", gpu_simulator)],
    "pages must divide": [("a page that does not divide the key block", lambda: paged(T=48, NP=2, P=3))],
    "on a GPU pages": [
        ("a page not a multiple of 8", lambda: paged("h200", T=4, NP=2, P=3)),
        # Steps of 128 keys in blocks of 384: a page of 192 divides the block, not the step.
        ("a page that neither divides the step nor is a multiple of it", lambda: paged("h200", T=192, NP=2, P=3, j=384)),
    ],
    "must be a positive int": [
        ("max_steps zero", lambda: max_steps(0)),
        ("max_steps a bool", lambda: max_steps(True)),
        ("max_steps a float", lambda: max_steps(2.0)),
    ],
    "is below the": [("max_steps below the walk's", lambda: max_steps(1))],
    "pages (read as": [
        ("a reached entry past the page count", lambda: paged(entry=((0, 1), 6))),
        ("a reached entry that is negative", lambda: paged(entry=((0, 1), -1))),
        ("a reached entry negative on a GPU", lambda: paged("h200", T=64, NP=2, P=3, entry=((0, 0), -1))),
    ],
    "reads entry": [("an offsets table one entry short", offsets_short)],
}

# Messages no input can raise, and why (each proven by its own test below).
UNREACHABLE = {
    "too few for": "an index operand's length is a literal, checked first ('start length'), and "
                   "every position it is read at is below it (a spec error otherwise)",
}

# Checks whose triggering cases live in another test file: key -> (file, test that raises it).
TESTED_ELSEWHERE = {
    "(generated by sparsegen) needs": ("test_jax_window.py", "test_a_generated_module_refuses_a_jax_outside_the_window"),
}


def _messages_of(key: str) -> list[Message]:
    return [m for m in MESSAGES if key in (m.error if key.endswith("Error") else m.text)]


def test_every_check_has_a_triggering_case():
    """Each message of the source is keyed by exactly one entry of CASES (or UNREACHABLE),
    which holds a case per site that raises that text."""
    keyed = {}
    for file, test in TESTED_ELSEWHERE.values():
        assert f"def {test}(" in (ROOT / "tests" / file).read_text(), f"{file} has no {test}"
    for key in [*CASES, *UNREACHABLE, *TESTED_ELSEWHERE]:
        found = _messages_of(key)
        assert found, f"no message of the templates holds {key!r}: update the key"
        assert len({m.text for m in found}) == 1, f"{key!r} is in several messages: {[m.text for m in found]}"
        for m in found:
            assert m.where not in keyed, f"{m.where} is keyed by both {keyed[m.where]!r} and {key!r}"
            keyed[m.where] = key
        if key in CASES:
            assert len(CASES[key]) >= len(found), f"{key!r} is raised at {len(found)} sites, but has {len(CASES[key])} cases"
    missing = [f"{m.where}: {m.text}" for m in MESSAGES if m.where not in keyed]
    assert not missing, "runtime checks without a test (add a case to CASES):\n" + "\n".join(missing)


@pytest.mark.parametrize("key,case", [(key, n) for key, cases in CASES.items() for n in range(len(cases))],
                         ids=[f"{key}: {why}" for key, cases in CASES.items() for why, _ in cases])
def test_check_is_raised(key, case, request):
    (message,) = {m.text: m for m in _messages_of(key)}.values()
    _, fn = CASES[key][case]
    needs = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    error = {"ValueError": ValueError, "NotImplementedError": NotImplementedError}[message.error]
    with pytest.raises(error) as info:
        fn(*(request.getfixturevalue(n) for n in needs))
    assert re.fullmatch(r"\w+: " + message.regex, str(info.value), re.S), (message.text, str(info.value))


def test_the_offsets_length_check_is_unreachable():
    """`_check_offsets`' "too few entries": a shorter index operand is refused by the length
    check before it (so the check guards nothing a caller can reach), and a spec reading past
    its literal length is refused at the spec."""
    from sparsegen.compiler import lower_source
    from sparsegen.source import SourceFile, SpecError

    with pytest.raises(ValueError, match=r"block_slice: start length is 1, but the spec declares 2"):
        block_slice([0])
    with pytest.raises(SpecError, match="position 3 is out of range"):
        lower_source(SourceFile("bad.spk", spec_text("block_slice").replace("start[1]", "start[3]")), "v5e")

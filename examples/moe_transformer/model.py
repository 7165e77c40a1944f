"""A small decoder-only transformer with a mixture-of-experts feed-forward, twice: its
attention and its experts' grouped matmuls as sparsegen-generated kernels on a device mesh
(`KernelOps`), and as plain `jax.numpy` (`PlainOps`, the control). Everything else (the
embeddings, norms, projections, router and loss) is one code path, shared.

Parameters are f32; the kernels take bf16 and accumulate in f32, and the control rounds
at the same places (its attention output, each expert's projections), so the two models
differ only by the order of f32 sums and agree to bf16 rounding.

Each layer: x += attention(rmsnorm(x)); x += moe(rmsnorm(x)).

- Attention: causal, grouped-query (`Config.heads` query heads, two per key/value head:
  the spec's `h // 2`), head dimension 64 (the spec's tile spans it).
- Mixture of experts: a linear router, softmax, top-k experts per token, their gates
  renormalized to sum to one (dropless: every token reaches its experts). The kernel path
  sorts the (token, choice) rows by expert within each data shard, so each device's rows
  arrive grouped (`gid` ascending), runs the experts' up and down projections as grouped
  matmuls (`kernels/expert_matmul.py`, megablox gmm), and scatters the rows back, weighted
  by their gates. The control runs every expert on every token and weights by the gates
  (zero for experts not chosen): the same sums, no sorting.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .kernels import expert_matmul, gqa_attention

# Which mesh axis splits each kernel index (`sharded(mesh, **axes)`). Attention splits its
# batch over "data" and its sequence over "seq": a ring (context parallelism), each device
# keeps its query rows while the key and value shards travel round the axis.
ATTENTION_AXES = dict(b="data", i="seq", j="seq")
# The experts' grouped matmuls: rows over "data" (each data shard's tokens), experts over
# "seq" (expert parallelism: each device multiplies by its experts, psum adds the rows).
EXPERT_AXES = dict(m="data", g="seq")
MESH_AXES = ("data", "seq")

HEAD_DIM = 64  # the spec's D: its tile d = e = 64 spans the dimension
GROUP = 2  # query heads per key/value head: the spec's `h // 2`


@dataclass(frozen=True)
class Config:
    vocab: int = 32
    seq: int = 128  # a multiple of the attention's tile, 32
    batch: int = 8
    d_model: int = 128
    layers: int = 2
    heads: int = 8  # key/value heads: heads // 2
    experts: int = 8
    top_k: int = 2
    d_ff: int = 256
    seed: int = 0

    @property
    def kv_heads(self) -> int:
        return self.heads // GROUP


def init(cfg: Config, key) -> dict:
    """f32 parameters, scaled by 1/sqrt(fan-in)."""

    def dense(key, *shape):
        return jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[-2])

    keys = iter(jax.random.split(key, 3 + 7 * cfg.layers))
    hd, e = HEAD_DIM, cfg.experts
    params = {
        "embed": jax.random.normal(next(keys), (cfg.vocab, cfg.d_model), jnp.float32),
        "pos": 0.1 * jax.random.normal(next(keys), (cfg.seq, cfg.d_model), jnp.float32),
        "out": dense(next(keys), cfg.d_model, cfg.vocab),
        "layers": [],
    }
    for _ in range(cfg.layers):
        params["layers"].append({
            "wq": dense(next(keys), cfg.d_model, cfg.heads * hd),
            "wk": dense(next(keys), cfg.d_model, cfg.kv_heads * hd),
            "wv": dense(next(keys), cfg.d_model, cfg.kv_heads * hd),
            "wo": dense(next(keys), cfg.heads * hd, cfg.d_model),
            "router": dense(next(keys), cfg.d_model, e),
            "w_up": dense(next(keys), e, cfg.d_model, cfg.d_ff),
            "w_down": dense(next(keys), e, cfg.d_ff, cfg.d_model),
        })
    return params


def rmsnorm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def route(x, router, top_k: int):
    """Top-k routing: (experts [..., k] int32, gates [..., k] f32 summing to one)."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    gates, experts = jax.lax.top_k(probs, top_k)
    return experts.astype(jnp.int32), gates / jnp.sum(gates, axis=-1, keepdims=True)


class KernelOps:
    """Attention and experts as the generated kernels, each under `sharded` on `mesh`."""

    name = "kernels"

    def __init__(self, mesh, interpret=True):
        self.mesh = mesh
        self.interpret = interpret
        self.shards = mesh.shape["data"]
        self._attention = gqa_attention.sharded(mesh, **ATTENTION_AXES)
        self._matmul = expert_matmul.sharded(mesh, **EXPERT_AXES)

    def attention(self, q, k, v):
        """q [B, H, S, D], k and v [B, G, S, D], bf16: o [B, H, S, D] bf16."""
        return self._attention(q, k, v, interpret=self.interpret)

    def experts(self, x, experts, gates, w_up, w_down):
        """x [B, S, d] f32, experts and gates [B, S, k]: the gated sum of the chosen experts'
        outputs, [B, S, d] f32."""
        b, s, d = x.shape
        k = experts.shape[-1]
        n = self.shards
        # Each data shard's (token, choice) rows, sorted by expert: a device's rows arrive
        # grouped, so the kernel walks each row block against the few experts it meets.
        ids = experts.reshape(n, b * s * k // n)
        order = jnp.argsort(ids, axis=1, stable=True)
        gid = jnp.take_along_axis(ids, order, axis=1)
        token = order // k  # the row's token within its shard
        rows = jnp.take_along_axis(x.reshape(n, b * s // n, d), token[..., None], axis=1)
        rows = rows.reshape(-1, d).astype(jnp.bfloat16)
        gid = gid.reshape(-1)
        h = self._matmul(rows, w_up.astype(jnp.bfloat16), gid, interpret=self.interpret)
        h = jax.nn.gelu(h.astype(jnp.float32)).astype(jnp.bfloat16)
        y = self._matmul(h, w_down.astype(jnp.bfloat16), gid, interpret=self.interpret)
        # Back to (token, choice) order: row r of a shard came from position order[r].
        back = jnp.argsort(order, axis=1)
        y = jnp.take_along_axis(y.reshape(n, -1, d), back[..., None], axis=1)
        y = y.reshape(b, s, k, d).astype(jnp.float32)
        return jnp.einsum("bskd,bsk->bsd", y, gates)


class PlainOps:
    """The control: the same attention and experts in plain jax.numpy, rounded to bf16 at
    the kernels' outputs."""

    name = "control"

    def attention(self, q, k, v):
        g = q.shape[1] // k.shape[1]
        k = jnp.repeat(k, g, axis=1).astype(jnp.float32)
        v = jnp.repeat(v, g, axis=1).astype(jnp.float32)
        s = jnp.einsum("bhid,bhjd->bhij", q.astype(jnp.float32), k) * (1.0 / np.sqrt(HEAD_DIM))
        causal = jnp.tril(jnp.ones((q.shape[2], q.shape[2]), bool))
        p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
        return jnp.einsum("bhij,bhjd->bhid", p, v).astype(jnp.bfloat16)

    def experts(self, x, experts, gates, w_up, w_down):
        # Every expert on every token; the gates of the experts not chosen are zero.
        weight = jnp.einsum("bske,bsk->bse", jax.nn.one_hot(experts, w_up.shape[0], dtype=jnp.float32), gates)
        up = w_up.astype(jnp.bfloat16).astype(jnp.float32)
        down = w_down.astype(jnp.bfloat16).astype(jnp.float32)
        h = jnp.einsum("bsd,edf->bsef", x.astype(jnp.bfloat16).astype(jnp.float32), up).astype(jnp.bfloat16)
        h = jax.nn.gelu(h.astype(jnp.float32)).astype(jnp.bfloat16).astype(jnp.float32)
        y = jnp.einsum("bsef,efd->bsed", h, down).astype(jnp.bfloat16).astype(jnp.float32)
        return jnp.einsum("bsed,bse->bsd", y, weight)


def forward(params, tokens, ops, cfg: Config):
    """Logits [B, S, vocab] f32 of next tokens."""
    b, s = tokens.shape
    hd = HEAD_DIM
    x = params["embed"][tokens] + params["pos"][:s]
    for layer in params["layers"]:
        h = rmsnorm(x)
        q = (h @ layer["wq"]).reshape(b, s, cfg.heads, hd).transpose(0, 2, 1, 3)
        k = (h @ layer["wk"]).reshape(b, s, cfg.kv_heads, hd).transpose(0, 2, 1, 3)
        v = (h @ layer["wv"]).reshape(b, s, cfg.kv_heads, hd).transpose(0, 2, 1, 3)
        o = ops.attention(*(t.astype(jnp.bfloat16) for t in (q, k, v)))
        x = x + o.astype(jnp.float32).transpose(0, 2, 1, 3).reshape(b, s, cfg.heads * hd) @ layer["wo"]
        h = rmsnorm(x)
        experts, gates = route(h, layer["router"], cfg.top_k)
        x = x + ops.experts(h, experts, gates, layer["w_up"], layer["w_down"])
    return rmsnorm(x) @ params["out"]


def loss_fn(params, inputs, targets, ops, cfg: Config):
    """Mean cross-entropy of the next tokens `targets` [B, S] after `inputs` [B, S]."""
    logp = jax.nn.log_softmax(forward(params, inputs, ops, cfg), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

"""The decoder's forward over a paged KV cache (:mod:`models.paged_attention`).

:func:`paged_forward` feeds ``S`` tokens per row (a prefill chunk, one decode token, or a
mix of row lengths) at explicit positions, writes their keys / values into each row's
pages and attends over the row's cached tokens. The layer math is the decoder's
(:mod:`lopd_jax.rollout.decode_step` for one query; here for ``S``): RMS norms, q / k norms, RoPE
tables per layer type, sliding windows per layer, GQA, LoRA. Layers are unrolled with
per-layer weights (:func:`lopd_jax.rollout.decode_step.layer_weights`) and per-layer page pools, so
a pool is updated in place and never copied.

Attention goes through :func:`models.paged_attention.attend`: JAX's TPU kernel
(``ragged_paged_attention``) on TPU, the pure-JAX path elsewhere, or either one forced
with ``backend``; with an inference ``mesh`` the kernel runs per shard.

:func:`paged_forward_scan` is the same forward as a ``lax.scan`` over the stacked layer
weights, for deep models on TPU (one layer body to compile instead of ``L``). Its pools
are one stacked array [L, P, page_size, 2 * KV, hd] (:func:`stacked_pools`), carried
through the scan; each layer reads and writes its pages through a flat view of the stack
(page ids shifted by ``layer * P``), so no layer's pool is ever sliced out (copied).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import layer_tables, rms_norm
from models.paged_attention import attend
from models.rope import apply_rope, cos_sin
from lopd_jax.rollout.decode_step import _proj, stacked_weights

__all__ = ["empty_pools", "paged_forward", "paged_forward_scan", "stacked_pools"]


def empty_pools(cfg, num_pages: int, page_size: int, dtype=None) -> tuple[jax.Array, ...]:
    """One zero page pool [num_pages, page_size, 2 * KV, hd] per layer."""
    shape = (num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)
    return tuple(jnp.zeros(shape, dtype or cfg.jnp_dtype) for _ in range(cfg.num_layers))


def stacked_pools(cfg, num_pages: int, page_size: int, dtype=None) -> jax.Array:
    """Every layer's zero page pool in one array [L, num_pages, page_size, 2 * KV, hd]."""
    return jnp.zeros((cfg.num_layers, num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim),
                     dtype or cfg.jnp_dtype)


def _layer(cfg, x, p, cos, sin, pos, valid, kv_lens, window, pool, page_table, num_pages: int, lora: bool,
           attn_kw: dict):
    """One layer for S queries per row. x [B, S, D]; pos / valid [B, S]. Returns (x, pool)."""
    eps, wf = cfg.rms_norm_eps, cfg.rmsnorm_weight_first
    B, S = x.shape[:2]
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pre = cfg.norm_placement == "pre"

    a_in = rms_norm(x, p["attn_norm"], eps, wf) if pre else x
    q = _proj(cfg, "q", a_in, p, 1, lora)  # [B, S, H, hd]
    k = _proj(cfg, "k", a_in, p, 1, lora)
    v = _proj(cfg, "v", a_in, p, 1, lora)
    if cfg.qk_norm == "per_head":
        q = rms_norm(q, p["q_norm"], eps, wf)
        k = rms_norm(k, p["k_norm"], eps, wf)
    elif cfg.qk_norm == "full":
        q = rms_norm(q.reshape(B, S, H * hd), p["q_norm"], eps, wf).reshape(B, S, H, hd)
        k = rms_norm(k.reshape(B, S, KV * hd), p["k_norm"], eps, wf).reshape(B, S, KV, hd)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    o, pool = attend(q.reshape(B, S, KV, H // KV, hd), k, v, pool, page_table, pos, valid, kv_lens, window,
                     1.0 / math.sqrt(hd), num_pages, **attn_kw)
    o = _proj(cfg, "o", o.reshape(B, S, H, hd), p, 2, lora)
    x = x + o if pre else x + rms_norm(o, p["attn_norm"], eps, wf)

    m_in = rms_norm(x, p["mlp_norm"], eps, wf) if pre else x
    hmid = jax.nn.silu(_proj(cfg, "gate", m_in, p, 1, lora)) * _proj(cfg, "up", m_in, p, 1, lora)
    m = _proj(cfg, "down", hmid, p, 1, lora)
    x = x + m if pre else x + rms_norm(m, p["mlp_norm"], eps, wf)
    return x, pool


def _inputs(model: nnx.Module, ids, positions, inputs_embeds):
    """(input embeddings in the compute dtype, int32 positions, (per-layer windows, per-layer
    RoPE table index, the (cos, sin) tables at ``positions``)) for a paged forward."""
    cfg = model.cfg
    if inputs_embeds is None:
        x = jnp.take(model.embed[...], ids, axis=0).astype(cfg.jnp_dtype)
    else:
        x = inputs_embeds.astype(cfg.jnp_dtype)
    pos = positions.astype(jnp.int32)
    windows, rope_index, inv_freq, rope_scale = layer_tables(cfg)
    tables = [cos_sin(pos, inv_freq[t], rope_scale[t]) for t in range(len(inv_freq))]
    return x, pos, (windows, rope_index, tables)


def paged_forward(model: nnx.Module, layers: list[dict], ids: jax.Array | None, positions: jax.Array,
                  valid: jax.Array, kv_lens: jax.Array, pools: tuple[jax.Array, ...], page_table: jax.Array,
                  num_pages: int, lora: bool = False, inputs_embeds: jax.Array | None = None, *,
                  backend: str = "auto", mesh=None, kernel=None):
    """Feed ``ids`` [B, S] (or ``inputs_embeds`` [B, S, D]) at ``positions`` [B, S].

    Args:
      model: a :class:`models.decoder.Decoder` (its config, embedding and final norm).
      layers: :func:`lopd_jax.rollout.decode_step.layer_weights` of the same model.
      valid: [B, S] False on padding (not written, not attended).
      kv_lens: [B] tokens in each row's cache after this call (these tokens included).
      pools: per-layer page pools; page_table [B, pages_per_row].
      num_pages: static count of leading pages per row attention reads (covers ``kv_lens``).
      lora: apply the LoRA adapters.
      backend / mesh / kernel: the attention backend (:func:`models.paged_attention.attend`).

    Returns:
      ``(final-norm hidden states [B, S, D], new pools)``.
    """
    cfg = model.cfg
    x, pos, (windows, rope_index, tables) = _inputs(model, ids, positions, inputs_embeds)
    pools = list(pools)
    for i, p in enumerate(layers):
        cos, sin = tables[int(rope_index[i])]
        x, pools[i] = _layer(cfg, x, p, cos, sin, pos, valid, kv_lens, int(windows[i]), pools[i], page_table,
                             num_pages, lora, {"backend": backend, "mesh": mesh, "kernel": kernel})
    h = rms_norm(x, model.final_norm[...], cfg.rms_norm_eps, cfg.rmsnorm_weight_first)
    return h, tuple(pools)


def paged_forward_scan(model: nnx.Module, ids: jax.Array | None, positions: jax.Array, valid: jax.Array,
                       kv_lens: jax.Array, pools: jax.Array, page_table: jax.Array, num_pages: int,
                       lora: bool = False, inputs_embeds: jax.Array | None = None, *, backend: str = "auto",
                       mesh=None, kernel=None):
    """:func:`paged_forward` as a scan over layers on stacked pools (:func:`stacked_pools`).

    Same arguments and results, except ``pools`` is one array [L, P, page_size, 2 * KV, hd]
    and the layer weights are read from ``model``'s stacked parameters.
    """
    cfg = model.cfg
    x, pos, (windows, rope_index, tables) = _inputs(model, ids, positions, inputs_embeds)
    cos_all = jnp.stack([c for c, _ in tables])
    sin_all = jnp.stack([s for _, s in tables])
    stacked = stacked_weights(model, lora)
    distinct = tuple(sorted({int(w) for w in windows}))

    def body(carry, xs):
        x, pools = carry
        p, i, window, ri = xs
        attn_kw = {"backend": backend, "mesh": mesh, "kernel": kernel, "layer": i, "windows": distinct}
        x, pools = _layer(cfg, x, p, cos_all[ri], sin_all[ri], pos, valid, kv_lens, window, pools, page_table,
                          num_pages, lora, attn_kw)
        return (x, pools), None

    xs = (stacked, jnp.arange(cfg.num_layers, dtype=jnp.int32), jnp.asarray(windows, jnp.int32),
          jnp.asarray(rope_index, jnp.int32))
    (x, pools), _ = jax.lax.scan(body, (x, pools), xs)
    h = rms_norm(x, model.final_norm[...], cfg.rms_norm_eps, cfg.rmsnorm_weight_first)
    return h, pools

"""The decoder's forward over a paged KV cache (:mod:`models.paged_attention`), for the engine.

:func:`paged_forward` feeds ``S`` tokens per row (a prefill chunk, one decode token, or a
mix of row lengths) at explicit positions, writes their keys / values into each row's
pages and attends over the row's cached tokens. Each layer is
:func:`models.layer.decoder_layer` with the paged backend
(:func:`models.layer.paged_cache_attention`: JAX's TPU kernel ``ragged_paged_attention`` on
TPU, the pure-JAX path elsewhere, or either forced with ``backend``; per shard with an
inference ``mesh``). Layers are unrolled with per-layer weights and per-layer page pools,
so a pool is updated in place and never copied.

:func:`paged_forward_scan` is the same forward as a ``lax.scan`` over the stacked layer
weights, for deep models on TPU (one layer body to compile instead of ``L``), on one
stacked pool [L, P, page_size, 2 * KV, hd] (:func:`stacked_pools`) that each layer reads
and writes through a flat view (page ids shifted by ``layer * P``), never sliced (copied).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.layer import decoder_layer, layer_tables, paged_cache_attention, rope_tables, stacked_weights

__all__ = ["empty_pools", "paged_forward", "paged_forward_scan", "stacked_pools"]


def empty_pools(cfg, num_pages: int, page_size: int, dtype=None) -> tuple[jax.Array, ...]:
    """One zero page pool [num_pages, page_size, 2 * KV, hd] per layer."""
    shape = (num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim)
    return tuple(jnp.zeros(shape, dtype or cfg.jnp_dtype) for _ in range(cfg.num_layers))


def stacked_pools(cfg, num_pages: int, page_size: int, dtype=None) -> jax.Array:
    """Every layer's zero page pool in one array [L, num_pages, page_size, 2 * KV, hd]."""
    return jnp.zeros((cfg.num_layers, num_pages, page_size, 2 * cfg.num_kv_heads, cfg.head_dim),
                     dtype or cfg.jnp_dtype)


def _inputs(model: nnx.Module, ids, positions, inputs_embeds):
    """(input embeddings in the compute dtype, int32 positions, (per-layer windows, per-layer
    RoPE table index, the stacked (cos, sin) tables at ``positions``)) for a paged forward."""
    cfg = model.cfg
    if inputs_embeds is None:
        x = jnp.take(model.embed[...], ids, axis=0).astype(cfg.jnp_dtype)
    else:
        x = inputs_embeds.astype(cfg.jnp_dtype)
    pos = positions.astype(jnp.int32)
    windows, rope_index, _, _ = layer_tables(cfg)
    return x, pos, (windows, rope_index, rope_tables(cfg, pos))


def paged_forward(model: nnx.Module, layers: list[dict], ids: jax.Array | None, positions: jax.Array,
                  valid: jax.Array, kv_lens: jax.Array, pools: tuple[jax.Array, ...], page_table: jax.Array,
                  num_pages: int, lora: bool = False, inputs_embeds: jax.Array | None = None, *,
                  backend: str = "auto", mesh=None, kernel=None):
    """Feed ``ids`` [B, S] (or ``inputs_embeds`` [B, S, D]) at ``positions`` [B, S].

    Args:
      model: a :class:`models.decoder.Decoder` (its config, embedding and final norm).
      layers: :func:`models.layer.layer_weights` of the same model.
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
    x, pos, (windows, rope_index, (cos, sin)) = _inputs(model, ids, positions, inputs_embeds)
    pools = list(pools)
    for i, p in enumerate(layers):
        t = int(rope_index[i])
        attend = paged_cache_attention(pools[i], page_table, pos, valid, kv_lens, int(windows[i]), num_pages,
                                       backend=backend, mesh=mesh, kernel=kernel)
        x, pools[i] = decoder_layer(cfg, x, p, cos[t], sin[t], attend, lora=lora)
    return model.final_hidden(x), tuple(pools)


def paged_forward_scan(model: nnx.Module, ids: jax.Array | None, positions: jax.Array, valid: jax.Array,
                       kv_lens: jax.Array, pools: jax.Array, page_table: jax.Array, num_pages: int,
                       lora: bool = False, inputs_embeds: jax.Array | None = None, *, backend: str = "auto",
                       mesh=None, kernel=None):
    """:func:`paged_forward` as a scan over layers on stacked pools (:func:`stacked_pools`).

    Same arguments and results, except ``pools`` is one array [L, P, page_size, 2 * KV, hd]
    and the layer weights are read from ``model``'s stacked parameters.
    """
    cfg = model.cfg
    x, pos, (windows, rope_index, (cos, sin)) = _inputs(model, ids, positions, inputs_embeds)
    distinct = tuple(sorted({int(w) for w in windows}))

    def body(carry, xs):
        x, pools = carry
        p, i, window, t = xs
        attend = paged_cache_attention(pools, page_table, pos, valid, kv_lens, window, num_pages, backend=backend,
                                       mesh=mesh, kernel=kernel, layer=i, windows=distinct)
        x, pools = decoder_layer(cfg, x, p, cos[t], sin[t], attend, lora=lora)
        return (x, pools), None

    xs = (stacked_weights(model, lora), jnp.arange(cfg.num_layers, dtype=jnp.int32), jnp.asarray(windows, jnp.int32),
          jnp.asarray(rope_index, jnp.int32))
    (x, pools), _ = jax.lax.scan(body, (x, pools), xs)
    return model.final_hidden(x), pools

"""One-token decode steps laid out for the static sampler's compiled loop (``benchmarks/static_sampler.py``).

The decoder's cached call scans over stacked layers and keeps keys / values as
``[layers, batch, T, kv_heads, head_dim]``: right for prefill, sharding and TPU, but inside
a per-token ``while_loop`` on XLA:CPU it copies, for every layer and token, the layer's
weights and cache slice out of the stacks and transposes the slice for the attention dots.
Here the layers are unrolled in Python with per-layer weights sliced once per turn
(:func:`models.layer.layer_weights`), and each layer's cache is carried separately in
attention layout ``[batch, kv_heads, T, head_dim]``: a new token's key / value is a
one-row scatter in place and both attention dots are batched matmuls with no transpose.
:func:`to_layers` / :func:`from_layers` change the layout once per turn, between the
decoder's prefill and the decode loop. The layer is :func:`models.layer.decoder_layer`;
only the attention (:func:`head_major_attention`) is this module's own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import KVCache
from models.layer import decoder_layer, layer_tables, rope_tables

__all__ = ["decode_step", "from_layers", "head_major_attention", "to_layers"]

_MASK = -1e30  # as in models.attention


def to_layers(kv: KVCache) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Stacked ``[L, B, T, KV, hd]`` keys / values -> per-layer ``[B, KV, T, hd]`` tuples."""
    L = kv.k.shape[0]
    return (tuple(kv.k[i].transpose(0, 2, 1, 3) for i in range(L)),
            tuple(kv.v[i].transpose(0, 2, 1, 3) for i in range(L)))


def from_layers(ks, vs, lengths: jax.Array) -> KVCache:
    """Inverse of :func:`to_layers` (with the cache's filled ``lengths``)."""
    return KVCache(jnp.stack([k.transpose(0, 2, 1, 3) for k in ks]),
                   jnp.stack([v.transpose(0, 2, 1, 3) for v in vs]), lengths)


def head_major_attention(ck, cv, pos, kv_ok, window: int):
    """The attention backend (:func:`models.layer.decoder_layer`) for one query per row over a
    head-major cache ``ck`` / ``cv`` [B, KV, T, hd]: writes the token's key / value at slot
    ``pos`` [B] (dropped past the end) and attends over the filled slots ``kv_ok`` [B, T]
    up to ``pos``, within a static ``window`` (0 = none). The returned cache is (ck, cv)."""
    def attend(q, k, v):
        rows = jnp.arange(q.shape[0])
        new_k = ck.at[rows, :, pos].set(k[:, 0].astype(ck.dtype), mode="drop")
        new_v = cv.at[rows, :, pos].set(v[:, 0].astype(cv.dtype), mode="drop")
        k_pos = jnp.arange(ck.shape[2], dtype=jnp.int32)[None]
        ok = kv_ok & (k_pos <= pos[:, None])
        if window > 0:
            ok = ok & (pos[:, None] - k_pos < window)
        s = jnp.einsum("bkgd,bktd->bkgt", q[:, 0], new_k.astype(q.dtype), preferred_element_type=jnp.float32)
        s = jnp.where(ok[:, None, None], s * (1.0 / math.sqrt(q.shape[-1])), _MASK)
        w = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bkgt,bktd->bkgd", w.astype(new_v.dtype), new_v, preferred_element_type=jnp.float32)
        return o.astype(q.dtype)[:, None], (new_k, new_v)
    return attend


def decode_step(model: nnx.Module, layers: list[dict], tokens: jax.Array, lengths: jax.Array, live: jax.Array,
                ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...], lora: bool = False):
    """Feed one token per row at position ``lengths`` and return the final hidden states.

    Equivalent to the decoder's cached call ``model(tokens[:, None],
    positions=lengths[:, None], attention_mask=live[:, None], cache=...,
    return_hidden=True)``: every row's key / value is written at slot ``lengths`` (dropped
    past the capacity), rows with ``live`` False neither grow nor see that slot.

    Args:
      model: the decoder (its graph and embedding / final-norm parameters).
      layers: :func:`models.layer.layer_weights` of the same model.
      tokens / lengths / live: [B] ids, filled cache lengths, rows that advance.
      ks / vs: per-layer caches [B, KV, T, hd] (:func:`to_layers`).
      lora: apply the LoRA adapters (``layers`` must hold them).

    Returns:
      ``(hidden [B, D] in the compute dtype, new lengths [B], ks, vs)``.
    """
    cfg = model.cfg
    x = jnp.take(model.embed[...], tokens[:, None], axis=0).astype(cfg.jnp_dtype)  # [B, 1, D]
    pos = lengths.astype(jnp.int32)
    new_lengths = jnp.where(live, jnp.maximum(lengths, pos + 1), lengths)
    kv_ok = jnp.arange(ks[0].shape[2], dtype=jnp.int32)[None] < new_lengths[:, None]
    windows, rope_index, _, _ = layer_tables(cfg)
    cos, sin = rope_tables(cfg, pos[:, None])
    ks, vs = list(ks), list(vs)
    for i, p in enumerate(layers):
        t = int(rope_index[i])
        attend = head_major_attention(ks[i], vs[i], pos, kv_ok, int(windows[i]))
        x, (ks[i], vs[i]) = decoder_layer(cfg, x, p, cos[t], sin[t], attend, lora=lora)
    return model.final_hidden(x)[:, 0], new_lengths, tuple(ks), tuple(vs)

"""One-token decode steps laid out for the sampler's compiled loop ("unrolled" layers).

The decoder's own cached call (:class:`models.decoder.Decoder` with a
:class:`models.decoder.KVCache`) scans over stacked layers and keeps keys / values as
``[layers, batch, T, kv_heads, head_dim]``. That is the right shape for prefill, for
sharding and for the TPU compiler, but inside a per-token ``while_loop`` on XLA:CPU it
costs, for every layer and every generated token (measured with the profiler on the
41.6M-parameter benchmark model): a copy of the layer's weights out of the stack
(dynamic-slice), a copy of the layer's cache slice out of and back into the stacked cache,
and two transposes of that slice so the attention dots see their batch dimensions first.

Here the same math runs with

* layers unrolled in Python with **per-layer weights sliced once per turn**, before the
  loop (loop invariants, never copied per token);
* **per-layer caches in attention layout** ``[batch, kv_heads, T, head_dim]`` carried
  separately through the loop: a new token's key / value is a scatter of one row in
  place, and both attention dots are batched matmuls with no transpose.

The layout change is applied once per turn (:func:`to_layers` / :func:`from_layers`),
between the decoder's prefill and the decode loop. The layer math is the decoder's
(``rms_norm``, RoPE tables, q/k norms, pre/post norm placement, sliding windows, LoRA,
fp32 softmax), written for one query position; tests check the hidden states against
the decoder's cached call and the sampler's log-probs against the training forward.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import KVCache, layer_tables, projection_shapes, rms_norm
from models.lora import lora_delta
from models.rope import apply_rope, cos_sin

__all__ = ["decode_step", "from_layers", "layer_weights", "to_layers"]

_MASK = -1e30  # as in models.attention


def stacked_weights(model: nnx.Module, lora: bool) -> dict[str, jax.Array]:
    """The model's stacked [L, ...] layer weights by name, LoRA factors included when ``lora``."""
    cfg = model.cfg
    names = list(projection_shapes(cfg)) + ["attn_norm", "mlp_norm"]
    if cfg.qk_norm != "none":
        names += ["q_norm", "k_norm"]
    if lora:
        names += [f"lora_{n}_{ab}" for n in cfg.lora.targets for ab in "ab"]
    return {n: getattr(model, n)[...] for n in names}


def layer_weights(model: nnx.Module, lora: bool) -> list[dict[str, jax.Array]]:
    """Per-layer parameter dicts (static slices of :func:`stacked_weights`). Call inside
    the jitted turn, outside the decode loop."""
    stacked = stacked_weights(model, lora)
    return [{n: w[i] for n, w in stacked.items()} for i in range(model.cfg.num_layers)]


def to_layers(kv: KVCache) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Stacked ``[L, B, T, KV, hd]`` keys / values -> per-layer ``[B, KV, T, hd]`` tuples."""
    L = kv.k.shape[0]
    return (tuple(kv.k[i].transpose(0, 2, 1, 3) for i in range(L)),
            tuple(kv.v[i].transpose(0, 2, 1, 3) for i in range(L)))


def from_layers(ks, vs, lengths: jax.Array) -> KVCache:
    """Inverse of :func:`to_layers` (with the cache's filled ``lengths``)."""
    return KVCache(jnp.stack([k.transpose(0, 2, 1, 3) for k in ks]),
                   jnp.stack([v.transpose(0, 2, 1, 3) for v in vs]), lengths)


def _proj(cfg, name: str, x, p, n_in: int, lora: bool):
    """The decoder's projection (tensordot over the last ``n_in`` axes, plus LoRA)."""
    dt = cfg.jnp_dtype
    in_axes = tuple(range(x.ndim - n_in, x.ndim))
    y = jnp.tensordot(x, p[name].astype(dt), axes=(in_axes, tuple(range(n_in))))
    if lora and f"lora_{name}_a" in p:
        y = y + lora_delta(x, p[f"lora_{name}_a"], p[f"lora_{name}_b"], n_in, cfg.lora.scale).astype(y.dtype)
    return y


def _layer(cfg, x, p, cos, sin, pos, kv_ok, window: int, ck, cv, lora: bool):
    """One layer for one query per row. x [B, 1, D]; pos [B]; kv_ok [B, T] (filled slots);
    ck / cv [B, KV, T, hd]. Returns (x, ck, cv) with this token's key / value written."""
    eps, wf = cfg.rms_norm_eps, cfg.rmsnorm_weight_first
    B = x.shape[0]
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pre = cfg.norm_placement == "pre"

    a_in = rms_norm(x, p["attn_norm"], eps, wf) if pre else x
    q = _proj(cfg, "q", a_in, p, 1, lora)  # [B, 1, H, hd]
    k = _proj(cfg, "k", a_in, p, 1, lora)
    v = _proj(cfg, "v", a_in, p, 1, lora)
    if cfg.qk_norm == "per_head":
        q = rms_norm(q, p["q_norm"], eps, wf)
        k = rms_norm(k, p["k_norm"], eps, wf)
    elif cfg.qk_norm == "full":
        q = rms_norm(q.reshape(B, 1, H * hd), p["q_norm"], eps, wf).reshape(B, 1, H, hd)
        k = rms_norm(k.reshape(B, 1, KV * hd), p["k_norm"], eps, wf).reshape(B, 1, KV, hd)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)

    rows = jnp.arange(B)
    ck = ck.at[rows, :, pos].set(k[:, 0].astype(ck.dtype), mode="drop")
    cv = cv.at[rows, :, pos].set(v[:, 0].astype(cv.dtype), mode="drop")

    T = ck.shape[2]
    k_pos = jnp.arange(T, dtype=jnp.int32)[None]
    ok = kv_ok & (k_pos <= pos[:, None])
    if window > 0:
        ok = ok & (pos[:, None] - k_pos < window)
    qg = q[:, 0].reshape(B, KV, H // KV, hd)
    s = jnp.einsum("bkgd,bktd->bkgt", qg, ck.astype(q.dtype), preferred_element_type=jnp.float32)
    s = jnp.where(ok[:, None, None], s * (1.0 / math.sqrt(hd)), _MASK)
    w = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bkgt,bktd->bkgd", w.astype(cv.dtype), cv, preferred_element_type=jnp.float32).astype(q.dtype)
    o = _proj(cfg, "o", o.reshape(B, 1, H, hd), p, 2, lora)
    x = x + o if pre else x + rms_norm(o, p["attn_norm"], eps, wf)

    m_in = rms_norm(x, p["mlp_norm"], eps, wf) if pre else x
    hmid = jax.nn.silu(_proj(cfg, "gate", m_in, p, 1, lora)) * _proj(cfg, "up", m_in, p, 1, lora)
    m = _proj(cfg, "down", hmid, p, 1, lora)
    x = x + m if pre else x + rms_norm(m, p["mlp_norm"], eps, wf)
    return x, ck, cv


def decode_step(model: nnx.Module, layers: list[dict], tokens: jax.Array, lengths: jax.Array, live: jax.Array,
                ks: tuple[jax.Array, ...], vs: tuple[jax.Array, ...], lora: bool = False):
    """Feed one token per row at position ``lengths`` and return the final hidden states.

    Equivalent to the decoder's cached call ``model(tokens[:, None],
    positions=lengths[:, None], attention_mask=live[:, None], cache=...,
    return_hidden=True)``: every row's key / value is written at slot ``lengths`` (dropped
    past the capacity), rows with ``live`` False neither grow nor see that slot.

    Args:
      model: the decoder (its graph and embedding / final-norm parameters).
      layers: :func:`layer_weights` of the same model.
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
    windows, rope_index, inv_freq, rope_scale = layer_tables(cfg)
    tables = [cos_sin(pos[:, None], inv_freq[t], rope_scale[t]) for t in range(len(inv_freq))]
    ks, vs = list(ks), list(vs)
    for i, p in enumerate(layers):
        cos, sin = tables[int(rope_index[i])]
        x, ks[i], vs[i] = _layer(cfg, x, p, cos, sin, pos, kv_ok, int(windows[i]), ks[i], vs[i], lora)
    h = rms_norm(x, model.final_norm[...], cfg.rms_norm_eps, cfg.rmsnorm_weight_first)
    return h[:, 0], new_lengths, tuple(ks), tuple(vs)

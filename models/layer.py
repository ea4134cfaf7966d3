"""One decoder layer for every mode: training, prefill and decode, with no KV cache, a dense
one or a paged one.

:func:`decoder_layer` is the layer's math, written once for Qwen3, Olmo-3 and Llama: RMS
norms before the sublayers or after them (Olmo-3), q / k / v projections with an optional
LoRA update, per-head (Qwen3) or full-width (Olmo-3) q / k norms, RoPE (YaRN included, from
:func:`rope_tables`), attention, the output projection and the SwiGLU MLP. Attention is the
one part that differs by mode, so it is passed in as ``attend(q, k, v) -> (out, cache)``:
:func:`sequence_attention` (training and calls without a cache: plain, causal tiles,
blockwise or splash), :func:`dense_cache_attention` (a layer's slices of a
:class:`models.decoder.KVCache`) or :func:`paged_cache_attention` (a page pool,
:func:`models.paged_attention.attend`). A layer's weights are read by one helper,
:func:`stacked_weights` ([L, ...], for a scan), which :func:`layer_weights` slices per layer.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from models import attention as attn_lib
from models import paged_attention
from models.config import LORA_TARGETS, ModelConfig
from models.lora import lora_delta
from models.partitioning import Rules, constrain
from models.rope import apply_rope, cos_sin, inv_frequencies

__all__ = ["decoder_layer", "dense_cache_attention", "layer_tables", "layer_weights", "paged_cache_attention",
           "project", "projection_shapes", "rms_norm", "rope_tables", "segment_positions", "sequence_attention",
           "stacked_weights"]

# attend(q [B, S, KV, G, hd], k [B, S, KV, hd], v [B, S, KV, hd]) -> (out [B, S, KV, G, hd], new cache)
Attend = Callable[[jax.Array, jax.Array, jax.Array], tuple]


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[tuple, tuple, tuple, tuple]]:
    """name -> (in_shape, out_shape, in_logical_axes, out_logical_axes) per projection."""
    d, f, h, kv, hd = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    return {
        "q": ((d,), (h, hd), ("embed",), ("heads", "head_dim")),
        "k": ((d,), (kv, hd), ("embed",), ("kv_heads", "head_dim")),
        "v": ((d,), (kv, hd), ("embed",), ("kv_heads", "head_dim")),
        "o": ((h, hd), (d,), ("heads", "head_dim"), ("embed",)),
        "gate": ((d,), (f,), ("embed",), ("mlp",)),
        "up": ((d,), (f,), ("embed",), ("mlp",)),
        "down": ((f,), (d,), ("mlp",), ("embed",)),
    }


def rms_norm(x, weight, eps, weight_first: bool):
    """RMSNorm in fp32; ``weight_first`` multiplies before casting back (Olmo-3 style)."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if weight_first:
        return (weight.astype(jnp.float32) * xf).astype(dtype)
    return weight.astype(dtype) * xf.astype(dtype)


@functools.lru_cache(maxsize=64)
def layer_tables(cfg: ModelConfig):
    """Static per-layer tables: sliding windows [L] (0 = full), RoPE table index [L],
    inverse frequencies [n_types, hd/2] and cos/sin scaling [n_types]."""
    windows = np.asarray([cfg.sliding_window if t == "sliding_attention" else 0 for t in cfg.layer_types], np.int32)
    rope_index = np.asarray([cfg.rope_type_names.index(t) for t in cfg.layer_types], np.int32)
    tables = [inv_frequencies(cfg.rope_by_type[t], cfg.head_dim) for t in cfg.rope_type_names]
    return windows, rope_index, np.stack([t[0] for t in tables]), np.asarray([t[1] for t in tables], np.float32)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [n_types, B, S, hd] at ``positions`` [B, S], one table per RoPE type
    (layer ``i`` reads table ``layer_tables(cfg)[1][i]``)."""
    _, _, inv_freq, rope_scale = layer_tables(cfg)
    return jax.vmap(lambda f, s: cos_sin(positions, f, s))(jnp.asarray(inv_freq), jnp.asarray(rope_scale))


def stacked_weights(model, lora: bool) -> dict[str, jax.Array]:
    """The model's stacked [L, ...] layer weights by name, LoRA factors included when ``lora``."""
    cfg = model.cfg
    names = list(projection_shapes(cfg)) + ["attn_norm", "mlp_norm"]
    if cfg.qk_norm != "none":
        names += ["q_norm", "k_norm"]
    if lora:
        names += [f"lora_{n}_{ab}" for n in cfg.lora.targets for ab in "ab"]
    return {n: getattr(model, n)[...] for n in names}


def layer_weights(model, lora: bool) -> list[dict[str, jax.Array]]:
    """Per-layer weight dicts (static slices of :func:`stacked_weights`), for layers unrolled
    in Python; sliced once, outside any decode loop."""
    stacked = stacked_weights(model, lora)
    return [{n: w[i] for n, w in stacked.items()} for i in range(model.cfg.num_layers)]


def project(cfg: ModelConfig, name: str, x, p, n_in: int, lora: bool, rng=None, flat: bool = False):
    """Projection ``name`` over the last ``n_in`` axes of ``x``, plus its LoRA update when
    ``lora`` (with dropout when ``rng`` is given).

    ``flat``: one 2-D matmul over the flattened tokens instead of a tensordot. On XLA:CPU the
    weight gradient x^T dy then needs no transposed copy of dy (the tensordot's copied the
    SiLU gradient in every layer); sharded models keep the tensordot, which merges no
    sharded axes."""
    w = p[name].astype(cfg.jnp_dtype)
    if flat:
        k = math.prod(w.shape[:n_in])
        y = (x.reshape(-1, k) @ w.reshape(k, -1)).reshape(*x.shape[:x.ndim - n_in], *w.shape[n_in:])
    else:
        in_axes = tuple(range(x.ndim - n_in, x.ndim))
        y = jnp.tensordot(x, w, axes=(in_axes, tuple(range(n_in))))
    if lora and f"lora_{name}_a" in p:
        lc = cfg.lora
        if rng is not None:
            rng = jax.random.fold_in(rng, LORA_TARGETS.index(name))
        y = y + lora_delta(x, p[f"lora_{name}_a"], p[f"lora_{name}_b"], n_in, lc.scale, lc.dropout,
                           rng).astype(y.dtype)
    return y


def decoder_layer(cfg: ModelConfig, x, p, cos, sin, attend: Attend, *, lora: bool = False, rng=None,
                  rules: Rules | None = None, flat: bool = False):
    """One decoder layer on x [B, S, D] in every mode; ``attend`` picks the mode.

    Args:
      p: the layer's weights (a :func:`layer_weights` dict, or a scan slice of
        :func:`stacked_weights`).
      cos / sin: the layer's RoPE table at the tokens' positions [B, S, hd] (:func:`rope_tables`).
      attend: the attention backend (:func:`sequence_attention`, :func:`dense_cache_attention`,
        :func:`paged_cache_attention` or a caller's own with that signature).
      lora / rng: apply the LoRA adapters; LoRA dropout key (none when None).
      rules: sharding rules for the activation constraints (none when None).
      flat: projections as flat 2-D matmuls (:func:`project`).

    Returns:
      ``(x, cache)``: the layer's output [B, S, D] and what ``attend`` returned as its cache.
    """
    eps, wf = cfg.rms_norm_eps, cfg.rmsnorm_weight_first
    B, S, _ = x.shape
    H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pre = cfg.norm_placement == "pre"
    proj = functools.partial(project, cfg, p=p, lora=lora, rng=rng, flat=flat)

    a_in = rms_norm(x, p["attn_norm"], eps, wf) if pre else x
    q = proj("q", a_in, n_in=1)  # [B, S, H, hd]
    k = proj("k", a_in, n_in=1)
    v = proj("v", a_in, n_in=1)
    if cfg.qk_norm == "per_head":
        q = rms_norm(q, p["q_norm"], eps, wf)
        k = rms_norm(k, p["k_norm"], eps, wf)
    elif cfg.qk_norm == "full":
        q = rms_norm(q.reshape(B, S, H * hd), p["q_norm"], eps, wf).reshape(B, S, H, hd)
        k = rms_norm(k.reshape(B, S, KV * hd), p["k_norm"], eps, wf).reshape(B, S, KV, hd)
    q = constrain(apply_rope(q, cos, sin), ("act_batch", "act_seq", "act_heads", None), rules)
    k = apply_rope(k, cos, sin)

    o, cache = attend(q.reshape(B, S, KV, H // KV, hd), k, v)
    o = checkpoint_name(o.reshape(B, S, H, hd), "attn_out")
    o = proj("o", o, n_in=2)
    x = x + o if pre else x + rms_norm(o, p["attn_norm"], eps, wf)
    x = constrain(x, ("act_batch", "act_seq", "act_embed"), rules)

    m_in = rms_norm(x, p["mlp_norm"], eps, wf) if pre else x
    g = proj("gate", m_in, n_in=1)
    u = proj("up", m_in, n_in=1)
    hmid = constrain(jax.nn.silu(g) * u, ("act_batch", "act_seq", "act_mlp"), rules)
    m = proj("down", hmid, n_in=1)
    x = x + m if pre else x + rms_norm(m, p["mlp_norm"], eps, wf)
    return constrain(x, ("act_batch", "act_seq", "act_embed"), rules), cache


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Positions [B, S] int32 restarting at 0 at the first token of each segment (a maximal
    run of equal ids in ``segment_ids`` [B, S]) and counting up by one within it."""
    S = segment_ids.shape[1]
    index = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                             axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def sequence_attention(cfg: ModelConfig, positions, valid, window, *, default_positions: bool,
                       rules: Rules | None = None, segment_ids=None) -> Attend:
    """Attention among the call's own tokens (no cache; the returned cache is None) by
    ``cfg.attention_impl``. Splash masks and causal tiles are index-based, exact only for
    ``default_positions`` (0 .. S-1, or :func:`segment_positions` of ``segment_ids``): other
    positions run blockwise / plain instead. ``segment_ids`` [B, S] (packed rows) keep each
    query to the keys of its own segment."""
    impl = cfg.attention_impl
    if not default_positions:
        impl = {"splash": "blockwise", "causal_plain": "plain"}.get(impl, impl)
    windows = tuple(int(w) for w in layer_tables(cfg)[0])

    def attend(q, k, v):
        return attn_lib.attention(q, k, v, positions, positions, valid, window, 1.0 / math.sqrt(q.shape[-1]),
                                  impl=impl, block_q=cfg.attention_block_q, block_kv=cfg.attention_block_kv,
                                  windows=windows, rules=rules, segment_ids=segment_ids), None
    return attend


def dense_cache_attention(ck, cv, positions, k_pos, k_valid, window) -> Attend:
    """Write the new keys / values into one layer's cache ``ck`` / ``cv`` [B, T, KV, hd] at
    ``positions`` [B, S] (dropped past the end) and attend over the cache (key slots
    ``k_pos`` [B, T], filled where ``k_valid``). The returned cache is the new (ck, cv)."""
    def attend(q, k, v):
        rows = jnp.arange(q.shape[0])[:, None]
        new_k = ck.at[rows, positions].set(k.astype(ck.dtype), mode="drop")
        new_v = cv.at[rows, positions].set(v.astype(cv.dtype), mode="drop")
        out = attn_lib.plain_attention(q, new_k.astype(q.dtype), new_v.astype(q.dtype), positions, k_pos, k_valid,
                                       window, 1.0 / math.sqrt(q.shape[-1]))
        return out, (new_k, new_v)
    return attend


def paged_cache_attention(pool, page_table, positions, valid, kv_lens, window, num_pages: int, **backend) -> Attend:
    """Write the new keys / values into a page pool and attend over each row's pages
    (:func:`models.paged_attention.attend`, whose arguments these are; ``backend``: its
    keyword arguments). The returned cache is the new pool."""
    def attend(q, k, v):
        return paged_attention.attend(q, k, v, pool, page_table, positions, valid, kv_lens, window,
                                      1.0 / math.sqrt(q.shape[-1]), num_pages, **backend)
    return attend

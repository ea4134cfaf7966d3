"""The decoder-only transformer serving Qwen3, Olmo-3 and Llama (``flax.nnx``).

Layer parameters are stacked along a leading ``layers`` axis and the layers run under
``jax.lax.scan`` (compile time independent of depth) with a configurable remat policy.
Inputs are token ids or input embeddings (for latent splicing); the call can return the
final hidden states without the LM head (for chunked losses and the experience encoder),
and can read / write a KV cache for prefill and one-token decode steps.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models import attention as attn_lib
from models.config import LORA_TARGETS, ModelConfig
from models.lora import LoRAParam, init_lora_pair, lora_delta, merged_weight
from models.partitioning import Rules, constrain
from models.rope import apply_rope, cos_sin, inv_frequencies


class KVCache(NamedTuple):
    """Keys / values [layers, batch, max_len, kv_heads, head_dim] and filled lengths [batch]."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array


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


_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attn_out": jax.checkpoint_policies.save_only_these_names("attn_out"),
}


@functools.lru_cache(maxsize=64)
def layer_tables(cfg: ModelConfig):
    """Static per-layer tables: sliding windows [L] (0 = full), RoPE table index [L],
    inverse frequencies [n_types, hd/2] and cos/sin scaling [n_types]."""
    windows = np.asarray([cfg.sliding_window if t == "sliding_attention" else 0 for t in cfg.layer_types], np.int32)
    rope_index = np.asarray([cfg.rope_type_names.index(t) for t in cfg.layer_types], np.int32)
    tables = [inv_frequencies(cfg.rope_by_type[t], cfg.head_dim) for t in cfg.rope_type_names]
    return windows, rope_index, np.stack([t[0] for t in tables]), np.asarray([t[1] for t in tables], np.float32)


class Decoder(nnx.Module):
    """Qwen3 / Olmo-3 / Llama decoder. ``model(input_ids)`` returns logits [batch, seq, vocab].

    Parameters (logical axes in ``logical_axes`` metadata): ``embed`` [V, D]; per layer
    (stacked, leading L): ``q, k, v, o, gate, up, down`` kernels, ``attn_norm``,
    ``mlp_norm``, ``q_norm``, ``k_norm``; ``final_norm`` [D]; ``lm_head`` [D, V] when
    embeddings are untied. LoRA factors (``lora_<proj>_a`` / ``_b``) exist when
    ``cfg.lora`` is set.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, rules: Rules | None = None):
        self.cfg = cfg
        self.rules = rules
        pd = cfg.jnp_param_dtype
        L, d, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
        init = jax.nn.initializers.normal(0.02)

        def param(shape, axes, key=None):
            value = init(rngs.params() if key is None else key, shape, jnp.float32).astype(pd)
            return nnx.Param(value, logical_axes=axes)

        def ones(shape, axes):
            return nnx.Param(jnp.ones(shape, pd), logical_axes=axes)

        self.embed = param((V, d), ("vocab", "embed"))
        for name, (ins, outs, in_ax, out_ax) in projection_shapes(cfg).items():
            setattr(self, name, param((L, *ins, *outs), ("layers", *in_ax, *out_ax)))
        self.attn_norm = ones((L, d), ("layers", "norm"))
        self.mlp_norm = ones((L, d), ("layers", "norm"))
        if cfg.qk_norm == "per_head":
            self.q_norm = ones((L, cfg.head_dim), ("layers", "norm"))
            self.k_norm = ones((L, cfg.head_dim), ("layers", "norm"))
        elif cfg.qk_norm == "full":
            self.q_norm = ones((L, cfg.num_heads * cfg.head_dim), ("layers", "norm"))
            self.k_norm = ones((L, cfg.num_kv_heads * cfg.head_dim), ("layers", "norm"))
        self.final_norm = ones((d,), ("norm",))
        if not cfg.tie_word_embeddings:
            self.lm_head = param((d, V), ("embed", "vocab"))
        if cfg.lora is not None:
            self.init_lora(rngs)


    # ----- LoRA -----
    def init_lora(self, rngs: nnx.Rngs):
        """(Re)create LoRA factors for ``cfg.lora.targets`` (B = 0, so the model is unchanged)."""
        lc = self.cfg.lora
        for name, (ins, outs, in_ax, out_ax) in projection_shapes(self.cfg).items():
            if name in lc.targets:
                a, b = init_lora_pair(rngs.params(), self.cfg.num_layers, ins, outs, lc.rank,
                                      in_ax, out_ax, self.cfg.jnp_param_dtype)
                setattr(self, f"lora_{name}_a", a)
                setattr(self, f"lora_{name}_b", b)

    def merge_lora(self):
        """Fold every LoRA update into its base kernel and zero the B factors."""
        lc = self.cfg.lora
        if lc is None:
            return
        for name in lc.targets:
            a, b = getattr(self, f"lora_{name}_a"), getattr(self, f"lora_{name}_b")
            w = getattr(self, name)
            w.set_value(merged_weight(w[...], a[...], b[...], lc.scale))
            b.set_value(jnp.zeros_like(b[...]))

    # ----- pieces used by callers -----
    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        """Input embeddings [B, S, D] in the compute dtype."""
        out = jnp.take(self.embed[...], input_ids, axis=0).astype(self.cfg.jnp_dtype)
        return constrain(out, ("act_batch", "act_seq", "act_embed"), self.rules)

    def lm_head_kernel(self) -> jax.Array:
        """The output projection [D, V] (the transposed embedding when tied)."""
        if self.cfg.tie_word_embeddings:
            return self.embed[...].T
        return self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Project final hidden states [..., D] to logits [..., V] (compute dtype)."""
        dt = self.cfg.jnp_dtype
        return jnp.dot(hidden.astype(dt), self.lm_head_kernel().astype(dt),
                       preferred_element_type=jnp.float32).astype(dt)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``max_len`` tokens."""
        c = self.cfg
        shape = (c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim)
        dtype = dtype or c.jnp_dtype
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

    # ----- forward -----
    def __call__(self, input_ids=None, *, inputs_embeds=None, positions=None, attention_mask=None,
                 lora: bool = False, return_hidden: bool = False, cache: KVCache | None = None,
                 dropout_rng=None):
        """Run the decoder.

        Args:
          input_ids: [B, S] int tokens, or None when ``inputs_embeds`` [B, S, D] is given.
          positions: [B, S] RoPE positions (default 0..S-1; with a cache, the slots written).
            With ``attention_impl="splash"`` (index-based masks) a call with explicit
            positions uses blockwise attention, and a cached call plain attention.
          attention_mask: [B, S] bool, False on padding (keys masked out).
          lora: apply the LoRA adapters (requires ``cfg.lora``).
          return_hidden: return final-norm hidden states [B, S, D] instead of logits.
          cache: a :class:`KVCache`; new keys / values are written at ``positions`` and
            queries attend to everything cached so far. The call then returns
            ``(output, new_cache)``.
          dropout_rng: PRNG key for LoRA dropout (no dropout when None).
        """
        cfg = self.cfg
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if lora and cfg.lora is None:
            raise ValueError("lora=True but the model has no LoRA adapters (set cfg.lora).")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds.astype(cfg.jnp_dtype)
        B, S = x.shape[:2]
        if attention_mask is None:
            attention_mask = jnp.ones((B, S), bool)
        attention_mask = attention_mask.astype(bool)
        # splash masks and causal_plain's skipped tiles are index-based: exact only for default
        # positions and no cache
        impl = cfg.attention_impl
        if impl == "splash" and (positions is not None or cache is not None):
            impl = "blockwise" if cache is None else "plain"
        if impl == "causal_plain" and (positions is not None or cache is not None):
            impl = "plain"
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
            if cache is not None:
                positions = positions + cache.lengths[:, None]
        positions = positions.astype(jnp.int32)

        windows, rope_index, inv_freq, rope_scale = layer_tables(cfg)
        cos, sin = jax.vmap(lambda f, s: cos_sin(positions, f, s))(
            jnp.asarray(inv_freq), jnp.asarray(rope_scale))  # [n_types, B, S, hd]

        if cache is None:
            k_pos, k_valid, new_lengths = positions, attention_mask, None
        else:
            T = cache.k.shape[2]
            written = jnp.max(jnp.where(attention_mask, positions + 1, 0), axis=1)
            new_lengths = jnp.maximum(cache.lengths, written)
            k_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
            k_valid = k_pos < new_lengths[:, None]

        layer_params = self._layer_params(lora)
        xs = {"p": layer_params, "window": jnp.asarray(windows), "rope": jnp.asarray(rope_index),
              "idx": jnp.arange(cfg.num_layers)}

        def body(carry, layer):
            # The whole cache rides in the carry and each layer's slice is updated in place:
            # passing it as scanned input/output would copy the full cache every step.
            h, ck_all, cv_all = carry
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, layer["idx"])
            ck = cv = None
            if ck_all is not None:
                ck = jax.lax.dynamic_index_in_dim(ck_all, layer["idx"], 0, keepdims=False)
                cv = jax.lax.dynamic_index_in_dim(cv_all, layer["idx"], 0, keepdims=False)
            h, new_k, new_v = self._layer(h, layer["p"], cos[layer["rope"]], sin[layer["rope"]], positions,
                                          k_pos, k_valid, layer["window"], lora, rng, ck, cv, impl)
            if ck_all is not None:
                ck_all = jax.lax.dynamic_update_index_in_dim(ck_all, new_k, layer["idx"], 0)
                cv_all = jax.lax.dynamic_update_index_in_dim(cv_all, new_v, layer["idx"], 0)
            return (h, ck_all, cv_all), None

        if cfg.remat_policy != "none" and cache is None:
            body = jax.checkpoint(body, policy=_REMAT[cfg.remat_policy], prevent_cse=not cfg.scan_layers)
        carry = (x, None, None) if cache is None else (x, cache.k, cache.v)
        if cfg.scan_layers:
            carry, _ = jax.lax.scan(body, carry, xs)
        else:
            for i in range(cfg.num_layers):
                carry, _ = body(carry, jax.tree.map(lambda a: a[i], xs))
        x, ck_all, cv_all = carry

        h = rms_norm(x, self.final_norm[...], cfg.rms_norm_eps, cfg.rmsnorm_weight_first)
        out = h if return_hidden else constrain(self.logits(h), ("act_batch", "act_seq", "act_vocab"), self.rules)
        if cache is None:
            return out
        return out, KVCache(ck_all, cv_all, new_lengths)

    def _layer_params(self, lora: bool) -> dict:
        names = list(projection_shapes(self.cfg)) + ["attn_norm", "mlp_norm"]
        if self.cfg.qk_norm != "none":
            names += ["q_norm", "k_norm"]
        p = {n: getattr(self, n)[...] for n in names}
        if lora:
            for n in self.cfg.lora.targets:
                p[f"lora_{n}_a"] = getattr(self, f"lora_{n}_a")[...]
                p[f"lora_{n}_b"] = getattr(self, f"lora_{n}_b")[...]
        return p

    def _proj(self, name, x, p, n_in, lora, rng):
        dt = self.cfg.jnp_dtype
        w = p[name].astype(dt)
        if self.rules is None:
            # Unsharded: one 2-D matmul over the flattened tokens. XLA:CPU then takes the
            # weight gradient x^T dy without writing dy transposed (tensordot over [B, S]
            # made it copy the SiLU gradient transposed in every layer: 1.15x slower step).
            # Sharded models keep the tensordot, so no reshape merges sharded axes.
            k = math.prod(w.shape[:n_in])
            y = (x.reshape(-1, k) @ w.reshape(k, -1)).reshape(*x.shape[:x.ndim - n_in], *w.shape[n_in:])
        else:
            in_axes = tuple(range(x.ndim - n_in, x.ndim))
            y = jnp.tensordot(x, w, axes=(in_axes, tuple(range(n_in))))
        if lora and f"lora_{name}_a" in p:
            lc = self.cfg.lora
            if rng is not None:
                rng = jax.random.fold_in(rng, LORA_TARGETS.index(name))
            y = y + lora_delta(x, p[f"lora_{name}_a"], p[f"lora_{name}_b"], n_in, lc.scale,
                               lc.dropout, rng).astype(y.dtype)
        return y

    def _layer(self, x, p, cos, sin, positions, k_pos, k_valid, window, lora, rng, ck, cv, impl):
        cfg = self.cfg
        eps, wf = cfg.rms_norm_eps, cfg.rmsnorm_weight_first
        B, S, _ = x.shape
        H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pre = cfg.norm_placement == "pre"

        a_in = rms_norm(x, p["attn_norm"], eps, wf) if pre else x
        q = self._proj("q", a_in, p, 1, lora, rng)  # [B, S, H, hd]
        k = self._proj("k", a_in, p, 1, lora, rng)
        v = self._proj("v", a_in, p, 1, lora, rng)
        if cfg.qk_norm == "per_head":
            q = rms_norm(q, p["q_norm"], eps, wf)
            k = rms_norm(k, p["k_norm"], eps, wf)
        elif cfg.qk_norm == "full":
            q = rms_norm(q.reshape(B, S, H * hd), p["q_norm"], eps, wf).reshape(B, S, H, hd)
            k = rms_norm(k.reshape(B, S, KV * hd), p["k_norm"], eps, wf).reshape(B, S, KV, hd)
        q = constrain(apply_rope(q, cos, sin), ("act_batch", "act_seq", "act_heads", None), self.rules)
        k = apply_rope(k, cos, sin)

        new_k = new_v = None
        if ck is not None:
            bidx = jnp.arange(B)[:, None]
            new_k = ck.at[bidx, positions].set(k.astype(ck.dtype), mode="drop")
            new_v = cv.at[bidx, positions].set(v.astype(cv.dtype), mode="drop")
            k, v = new_k.astype(q.dtype), new_v.astype(q.dtype)

        qg = q.reshape(B, S, KV, H // KV, hd)
        o = attn_lib.attention(qg, k, v, positions, k_pos, k_valid, window, 1.0 / math.sqrt(hd),
                               impl=impl if ck is None else "plain",
                               block_q=cfg.attention_block_q, block_kv=cfg.attention_block_kv,
                               windows=tuple(int(w) for w in layer_tables(cfg)[0]), rules=self.rules)
        o = checkpoint_name(o.reshape(B, S, H, hd), "attn_out")
        o = self._proj("o", o, p, 2, lora, rng)
        x = x + o if pre else x + rms_norm(o, p["attn_norm"], eps, wf)
        x = constrain(x, ("act_batch", "act_seq", "act_embed"), self.rules)

        m_in = rms_norm(x, p["mlp_norm"], eps, wf) if pre else x
        g = self._proj("gate", m_in, p, 1, lora, rng)
        u = self._proj("up", m_in, p, 1, lora, rng)
        hmid = constrain(jax.nn.silu(g) * u, ("act_batch", "act_seq", "act_mlp"), self.rules)
        m = self._proj("down", hmid, p, 1, lora, rng)
        x = x + m if pre else x + rms_norm(m, p["mlp_norm"], eps, wf)
        return constrain(x, ("act_batch", "act_seq", "act_embed"), self.rules), new_k, new_v

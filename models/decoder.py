"""The decoder-only transformer serving Qwen3, Olmo-3 and Llama (``flax.nnx``).

Layer parameters are stacked along a leading ``layers`` axis and the layers
(:func:`models.layer.decoder_layer`) run under ``jax.lax.scan`` (compile time independent
of depth) with a configurable remat policy. Inputs are token ids or input embeddings (for
latent splicing); the call can return the final hidden states without the LM head (for
chunked losses and the experience encoder), and can read / write a dense KV cache
(:class:`KVCache`) for prefill and one-token decode steps. Training rows may pack several
sequences (``segment_ids``), each attending only within itself.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layer import (decoder_layer, dense_cache_attention, layer_tables, projection_shapes, rms_norm,
                          rope_tables, segment_positions, sequence_attention, stacked_weights)
from models.lora import init_lora_pair, merged_weight
from models.partitioning import Rules, constrain


class KVCache(NamedTuple):
    """Keys / values [layers, batch, max_len, kv_heads, head_dim] and filled lengths [batch]."""

    k: jax.Array
    v: jax.Array
    lengths: jax.Array


_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attn_out": jax.checkpoint_policies.save_only_these_names("attn_out"),
}


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

    def final_hidden(self, x: jax.Array) -> jax.Array:
        """The last layer's output [..., D] through the final RMS norm."""
        return rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps, self.cfg.rmsnorm_weight_first)

    # ----- forward -----
    def __call__(self, input_ids=None, *, inputs_embeds=None, positions=None, attention_mask=None,
                 lora: bool = False, return_hidden: bool = False, cache: KVCache | None = None,
                 dropout_rng=None, segment_ids=None):
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
          segment_ids: [B, S] int32 for packed rows: each row numbers its sequences 1, 2, ...
            (a segment = a run of equal ids), 0 on padding. A token attends only to its own
            segment (and, as ever, not to keys where ``attention_mask`` is False); outputs at
            segment-0 tokens are unspecified. Without ``positions`` each segment's positions
            restart at 0 (:func:`models.layer.segment_positions`), so every segment gives what
            it gives alone and every attention impl stays exact; with explicit positions,
            splash / causal_plain run blockwise / plain as above. Not with ``cache``.
        """
        cfg = self.cfg
        self._check_call_args(input_ids, inputs_embeds, lora)
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds.astype(cfg.jnp_dtype)
        B, S = x.shape[:2]
        if attention_mask is None:
            attention_mask = jnp.ones((B, S), bool)
        attention_mask = attention_mask.astype(bool)
        default_positions = positions is None and cache is None
        segment_ids = _packed_segment_ids(segment_ids, cache, (B, S))
        positions = _token_positions(positions, segment_ids, cache, B, S)

        windows, rope_index, _, _ = layer_tables(cfg)
        cos, sin = rope_tables(cfg, positions)  # [n_types, B, S, hd]
        cache_keys = None if cache is None else _cache_key_slots(cache, positions, attention_mask, B)
        xs = {"p": stacked_weights(self, lora), "window": jnp.asarray(windows), "rope": jnp.asarray(rope_index),
              "idx": jnp.arange(cfg.num_layers)}

        attend_for = self._attention_for_layer(positions, attention_mask, segment_ids, default_positions,
                                               cache_keys)
        body = self._layer_body(attend_for, cos, sin, lora, dropout_rng)
        x, ck_all, cv_all = self._run_layers(body, x, xs, cache)

        h = self.final_hidden(x)
        out = h if return_hidden else constrain(self.logits(h), ("act_batch", "act_seq", "act_vocab"), self.rules)
        if cache is None:
            return out
        return out, KVCache(ck_all, cv_all, cache_keys.new_lengths)

    def _check_call_args(self, input_ids, inputs_embeds, lora: bool) -> None:
        """Raise ValueError unless exactly one input is given and LoRA is available when asked for."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if lora and self.cfg.lora is None:
            raise ValueError("lora=True but the model has no LoRA adapters (set cfg.lora).")

    def _attention_for_layer(self, positions, attention_mask, segment_ids, default_positions: bool,
                             cache_keys: _CacheKeySlots | None):
        """``attend_for(layer, ck_all, cv_all)``: one scanned layer's attention, over the call's
        own tokens (``ck_all`` None) or over that layer's slice of the full cache."""
        cfg = self.cfg

        def attend_for(layer, ck_all, cv_all):
            if ck_all is None:
                return sequence_attention(cfg, positions, attention_mask, layer["window"],
                                          default_positions=default_positions, rules=self.rules,
                                          segment_ids=segment_ids)
            ck = jax.lax.dynamic_index_in_dim(ck_all, layer["idx"], 0, keepdims=False)
            cv = jax.lax.dynamic_index_in_dim(cv_all, layer["idx"], 0, keepdims=False)
            return dense_cache_attention(ck, cv, positions, cache_keys.k_pos, cache_keys.k_valid,
                                         layer["window"])

        return attend_for

    def _layer_body(self, attend_for, cos, sin, lora: bool, dropout_rng):
        """The scan body ``(h, ck_all, cv_all), layer -> (carry, None)`` running one decoder layer."""
        cfg = self.cfg

        def body(carry, layer):
            # The whole cache rides in the carry and each layer's slice is updated in place:
            # passing it as scanned input/output would copy the full cache every step.
            h, ck_all, cv_all = carry
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, layer["idx"])
            attend = attend_for(layer, ck_all, cv_all)
            h, kv = decoder_layer(cfg, h, layer["p"], cos[layer["rope"]], sin[layer["rope"]], attend, lora=lora,
                                  rng=rng, rules=self.rules, flat=self.rules is None)
            if ck_all is not None:
                ck_all = jax.lax.dynamic_update_index_in_dim(ck_all, kv[0], layer["idx"], 0)
                cv_all = jax.lax.dynamic_update_index_in_dim(cv_all, kv[1], layer["idx"], 0)
            return (h, ck_all, cv_all), None

        return body

    def _run_layers(self, body, x, xs, cache: KVCache | None):
        """Run ``body`` over the stacked layers ``xs`` (scanned or unrolled, rematerialized when
        configured and uncached); returns the final carry ``(h, ck_all, cv_all)``."""
        cfg = self.cfg
        if cfg.remat_policy != "none" and cache is None:
            body = jax.checkpoint(body, policy=_REMAT[cfg.remat_policy], prevent_cse=not cfg.scan_layers)
        carry = (x, None, None) if cache is None else (x, cache.k, cache.v)
        if cfg.scan_layers:
            carry, _ = jax.lax.scan(body, carry, xs)
        else:
            for i in range(cfg.num_layers):
                carry, _ = body(carry, jax.tree.map(lambda a: a[i], xs))
        return carry


class _CacheKeySlots(NamedTuple):
    """A cached call's key slots: the new filled lengths [B], slot indices and validity [B, T]."""

    new_lengths: jax.Array
    k_pos: jax.Array
    k_valid: jax.Array


def _packed_segment_ids(segment_ids, cache: KVCache | None, shape: tuple[int, int]):
    """``segment_ids`` checked against the call (no cache, shape [B, S]) as int32; None stays None."""
    if segment_ids is None:
        return None
    if cache is not None:
        raise ValueError("segment_ids (packed rows) work only without a KV cache; decode each sequence in "
                         "its own row instead.")
    if segment_ids.shape != shape:
        raise ValueError(f"segment_ids has shape {segment_ids.shape}; it must be [batch, seq] = {shape} "
                         "like the inputs.")
    return segment_ids.astype(jnp.int32)


def _token_positions(positions, segment_ids, cache: KVCache | None, B: int, S: int) -> jax.Array:
    """RoPE positions [B, S] int32: as given, else restarting per segment, else 0..S-1 (after
    the filled length with a cache)."""
    if positions is None and segment_ids is not None:
        positions = segment_positions(segment_ids)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        if cache is not None:
            positions = positions + cache.lengths[:, None]
    return positions.astype(jnp.int32)


def _cache_key_slots(cache: KVCache, positions, attention_mask, B: int) -> _CacheKeySlots:
    """The cache's lengths after writing the unmasked ``positions`` and its key slots [B, T]."""
    T = cache.k.shape[2]
    written = jnp.max(jnp.where(attention_mask, positions + 1, 0), axis=1)
    new_lengths = jnp.maximum(cache.lengths, written)
    k_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    k_valid = k_pos < new_lengths[:, None]
    return _CacheKeySlots(new_lengths, k_pos, k_valid)

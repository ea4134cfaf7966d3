"""Rotary position embeddings: default and YaRN frequencies, rotate-half application."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from models.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim / 2] (float32) and the cos/sin scaling factor.

    Matches ``transformers``' default and YaRN initializers (including the
    ``truncate`` rounding of the correction range and the derived attention factor).
    """
    dim = head_dim
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_extra = (1.0 / pos_freqs).astype(np.float32)
    if rope.rope_type == "default":
        return inv_extra, 1.0
    if rope.rope_type != "yarn":
        raise ValueError(f"RoPE type {rope.rope_type!r} is not supported; use default or yarn.")
    if rope.original_max_position_embeddings is None:
        raise ValueError("YaRN needs original_max_position_embeddings.")
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    inv_inter = (1.0 / (factor * pos_freqs)).astype(np.float32)
    orig = rope.original_max_position_embeddings

    def correction_dim(num_rot):
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extra_factor = (1 - ramp).astype(np.float32)
    inv = inv_inter * (1 - extra_factor) + inv_extra * extra_factor
    return inv.astype(np.float32), float(attention_factor)


def cos_sin(positions: jnp.ndarray, inv_freq: jnp.ndarray, scaling: float):
    """cos and sin tables [..., head_dim] in fp32 for integer ``positions`` [...]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq.astype(jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scaling, jnp.sin(emb) * scaling


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotate-half RoPE. x: [B, S, heads, head_dim]; cos/sin: [B, S, head_dim] (fp32).

    Computed in fp32 and cast back to x's dtype, as ``transformers`` does for fp32 tables.
    """
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(dtype)

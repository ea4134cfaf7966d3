"""The composer's compressor: a shared-weight cross-attention resampler (docs/method.md, "Compressor").

It turns the encoder's last hidden states for one experience, ``H`` of shape ``[L, d]``
with a padding mask, into ``K`` latent vectors of width ``d`` that the teacher uses
directly as input embeddings. ``K`` learnable queries attend to ``concat(H, latents)``
through ONE attention + feed-forward block applied ``depth`` times with the same weights
(Perceiver-resampler style, iterated rather than stacked).

Every parameter carries logical axis names as nnx metadata (``logical_axes=...``) so the
sharding rules in the config can map them to mesh axes. Names used: ``"latents"`` (the
query rows), ``"embed"`` (model width), ``"heads"`` (the flattened heads x head_dim axis
of the query / output projections), ``"kv"`` (the same axis of the key / value
projections) and ``"mlp"`` (the feed-forward hidden axis; also the output side of the
d x d ``proj_in`` / input side of ``proj_out``, so that no kernel repeats a name -- a
repeated name would map two dimensions to one mesh axis).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# torch.nn.LayerNorm's default epsilon; the authors' PyTorch release builds on it.
LAYERNORM_EPS = 1e-5


def _linear(d_in: int, d_out: int, axes: tuple[str, str], *, use_bias: bool, dtype: Any,
            param_dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in, d_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        kernel_metadata={"logical_axes": axes},
        bias_metadata={"logical_axes": (axes[1],)},
    )


def _layernorm(d: int, *, eps: float, dtype: Any, param_dtype: Any,
               rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        d, epsilon=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
        scale_metadata={"logical_axes": ("embed",)},
        bias_metadata={"logical_axes": ("embed",)},
    )


class ResamplerBlock(nnx.Module):
    """One cross-attention + feed-forward block; the compressor iterates it ``depth`` times.

    Attention: LayerNorm(H) and LayerNorm(latents) separately; queries from the latents;
    keys and values from ``concat(H, latents)``; no projection biases; q and k each scaled
    by ``head_dim ** -0.25``; fp32 softmax with the padding mask (latent keys are always
    valid); output projection; residual. Feed-forward: LayerNorm -> Linear(d, ff_mult*d)
    -> GELU -> Linear(ff_mult*d, d); residual. The two feed-forward Linears have no bias
    (as in the authors' release) unless ``ff_bias``.
    """

    def __init__(self, d_model: int, num_heads: int, *, ff_mult: int = 4,
                 approximate_gelu: bool = False, eps: float = LAYERNORM_EPS, ff_bias: bool = False,
                 dtype: Any = jnp.float32, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.approximate_gelu = approximate_gelu
        self.dtype = dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm_media = _layernorm(d_model, eps=eps, **kw)
        self.norm_latents = _layernorm(d_model, eps=eps, **kw)
        self.q_proj = _linear(d_model, d_model, ("embed", "heads"), use_bias=False, **kw)
        self.k_proj = _linear(d_model, d_model, ("embed", "kv"), use_bias=False, **kw)
        self.v_proj = _linear(d_model, d_model, ("embed", "kv"), use_bias=False, **kw)
        self.o_proj = _linear(d_model, d_model, ("heads", "embed"), use_bias=False, **kw)
        self.ff_norm = _layernorm(d_model, eps=eps, **kw)
        self.ff_in = _linear(d_model, ff_mult * d_model, ("embed", "mlp"), use_bias=ff_bias, **kw)
        self.ff_out = _linear(ff_mult * d_model, d_model, ("mlp", "embed"), use_bias=ff_bias, **kw)

    def _split_heads(self, x: jax.Array) -> jax.Array:
        n, t, _ = x.shape
        return x.reshape(n, t, self.num_heads, self.head_dim)

    def __call__(self, media: jax.Array, latents: jax.Array, key_mask: jax.Array) -> jax.Array:
        """Update ``latents [N, K, d]`` given ``media [N, L, d]`` and ``key_mask [N, L + K]``."""
        n, k, d = latents.shape
        h = self.norm_media(media)
        lat = self.norm_latents(latents)
        kv_in = jnp.concatenate([h, lat], axis=1)
        scale = self.head_dim ** -0.25
        q = self._split_heads(self.q_proj(lat)) * scale
        key = self._split_heads(self.k_proj(kv_in)) * scale
        val = self._split_heads(self.v_proj(kv_in))
        logits = jnp.einsum("nqhd,nkhd->nhqk", q, key).astype(jnp.float32)
        logits = jnp.where(key_mask[:, None, None, :], logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(val.dtype)
        attn = jnp.einsum("nhqk,nkhd->nqhd", probs, val).reshape(n, k, d)
        latents = latents + self.o_proj(attn)
        ff = self.ff_in(self.ff_norm(latents))
        ff = jax.nn.gelu(ff, approximate=self.approximate_gelu)
        return latents + self.ff_out(ff)


class Compressor(nnx.Module):
    """Shared-weight cross-attention resampler: ``[N, L, d]`` hidden states -> ``[N, K, d]``.

    Args:
      d_model: width d (the backbone hidden size).
      num_heads: attention heads (the backbone's); must divide ``d_model``.
      num_latents: K, the number of learnable queries (and output vectors).
      depth: how many times the single shared block is applied.
      ff_mult: feed-forward hidden size is ``ff_mult * d_model``.
      approximate_gelu: False (default) is exact erf GELU, as torch ``nn.GELU()``;
        True is the tanh approximation.
      eps: LayerNorm epsilon (torch default 1e-5).
      ff_bias: biases on the feed-forward Linears (False, as the release: its composer
        checkpoints map one to one, see :mod:`lopd_jax.method.compressor_import`).
      param_dtype / dtype: parameter storage and computation dtypes (softmax is fp32).
      rngs: ``nnx.Rngs`` for initialization.

    Call as ``compressor(hidden, mask)`` with ``hidden [N, L, d]`` and ``mask [N, L]``
    (True = real token). Rows of ``hidden`` at masked positions do not affect the output.
    """

    def __init__(self, d_model: int, num_heads: int, num_latents: int = 32, depth: int = 8,
                 ff_mult: int = 4, *, approximate_gelu: bool = False,
                 eps: float = LAYERNORM_EPS, ff_bias: bool = False, param_dtype: Any = jnp.float32,
                 dtype: Any = jnp.float32, rngs: nnx.Rngs):
        if d_model <= 0 or num_heads <= 0 or d_model % num_heads:
            raise ValueError(
                f"Compressor: d_model={d_model} must be a positive multiple of "
                f"num_heads={num_heads}; pass the backbone's hidden size and head count.")
        if num_latents <= 0 or depth <= 0 or ff_mult <= 0:
            raise ValueError(
                f"Compressor: num_latents={num_latents}, depth={depth} and ff_mult={ff_mult} "
                "must all be positive integers.")
        self.d_model = d_model
        self.num_latents = num_latents
        self.depth = depth
        self.dtype = dtype
        init = jax.nn.initializers.normal(stddev=d_model ** -0.5)
        self.queries = nnx.Param(
            init(rngs.params(), (num_latents, d_model), param_dtype),
            logical_axes=("latents", "embed"))
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.proj_in = _linear(d_model, d_model, ("embed", "mlp"), use_bias=True, **kw)
        self.block = ResamplerBlock(d_model, num_heads, ff_mult=ff_mult,
                                    approximate_gelu=approximate_gelu, eps=eps, ff_bias=ff_bias, **kw)
        self.proj_out = _linear(d_model, d_model, ("mlp", "embed"), use_bias=True, **kw)
        self.norm_out = _layernorm(d_model, eps=eps, **kw)

    def __call__(self, hidden: jax.Array, mask: jax.Array) -> jax.Array:
        """Compress ``hidden [N, L, d]`` under ``mask [N, L]`` (bool) to ``[N, K, d]``."""
        if hidden.ndim != 3 or hidden.shape[-1] != self.d_model:
            raise ValueError(
                f"Compressor expects hidden states [N, L, {self.d_model}], got shape "
                f"{hidden.shape}; batch experiences along the first axis.")
        if mask.shape != hidden.shape[:2]:
            raise ValueError(
                f"Compressor mask must have shape {hidden.shape[:2]} (= hidden[:2]), got "
                f"{mask.shape}.")
        n = hidden.shape[0]
        mask = mask.astype(bool)
        # Zero padded rows up front so even non-finite padding cannot leak through 0 * inf.
        hidden = jnp.where(mask[..., None], hidden, jnp.zeros((), hidden.dtype))
        media = self.proj_in(hidden)
        latents = jnp.broadcast_to(self.queries[...].astype(media.dtype),
                                   (n, self.num_latents, self.d_model))
        key_mask = jnp.concatenate(
            [mask, jnp.ones((n, self.num_latents), dtype=bool)], axis=1)

        # One block, same weights every iteration: scan over the iteration count with the
        # block's state closed over, so compile time does not grow with depth.
        graphdef, state = nnx.split(self.block)

        def step(lat, _):
            return nnx.merge(graphdef, state)(media, lat, key_mask), None

        latents, _ = jax.lax.scan(step, latents, None, length=self.depth)
        return self.norm_out(self.proj_out(latents))

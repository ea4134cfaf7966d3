"""LoRA adapters for the decoder's seven projections.

LoRA weights live in their own NNX variable collection (:class:`LoRAParam`, not a
subclass of ``nnx.Param``), so ``nnx.state(model, nnx.Param)`` is the frozen backbone and
``nnx.state(model, LoRAParam)`` the adapter. Whether an adapter is applied is an argument
of the model call (``lora=True``), never a mutation.

Shapes (leading ``layers`` axis, stacked for the layer scan): ``a`` [L, *in_shape, r]
initialised like PEFT (Kaiming-uniform), ``b`` [L, r, *out_shape] zero-initialised, so a
fresh adapter leaves the model unchanged.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx


class LoRAParam(nnx.Variable):
    """A trainable LoRA factor; its own collection, separate from backbone ``nnx.Param``."""


def init_lora_pair(key, num_layers, in_shape, out_shape, rank, in_axes, out_axes, dtype):
    """Fresh (a, b) LoRA factors for one stacked projection."""
    fan_in = math.prod(in_shape)
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) as in PEFT / nn.Linear
    a = jax.random.uniform(key, (num_layers, *in_shape, rank), jnp.float32, -bound, bound).astype(dtype)
    b = jnp.zeros((num_layers, rank, *out_shape), dtype)
    return (
        LoRAParam(a, logical_axes=("layers", *in_axes, "lora_rank")),
        LoRAParam(b, logical_axes=("layers", "lora_rank", *out_axes)),
    )


def lora_delta(x, a, b, n_in: int, scale: float, dropout: float = 0.0, rng=None):
    """The low-rank update scale * (dropout(x) . a) . b for one layer's factors."""
    if dropout > 0.0 and rng is not None:
        keep = jax.random.bernoulli(rng, 1.0 - dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - dropout), 0).astype(x.dtype)
    in_axes = tuple(range(x.ndim - n_in, x.ndim))
    h = jnp.tensordot(x, a.astype(x.dtype), axes=(in_axes, tuple(range(n_in))))
    return jnp.tensordot(h, b.astype(x.dtype), axes=((h.ndim - 1,), (0,))) * scale


def merged_weight(w, a, b, scale: float):
    """w + scale * a @ b for stacked factors (leading layer axis), in fp32 then w's dtype."""
    r = a.shape[-1]
    a2 = a.reshape(a.shape[0], -1, r).astype(jnp.float32)
    b2 = b.reshape(b.shape[0], r, -1).astype(jnp.float32)
    delta = jnp.einsum("lir,lro->lio", a2, b2) * scale
    return (w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype)

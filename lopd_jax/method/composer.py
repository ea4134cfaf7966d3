"""The composer phi = (encoder LoRA psi, compressor chi): experiences -> latent vectors.

The encoder is the frozen backbone theta0 with its LoRA switched on; it reads each
retrieved experience (task-conditioned text, tokenized) and returns final hidden states,
which the shared-weight compressor (lopd_jax.method.compressor) turns into K vectors. The n_ret
experiences of a task are encoded separately and concatenated in retrieval order:
B tasks x n_ret experiences -> [B, n_ret * K, d].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from lopd_jax.method.compressor import Compressor
from models.config import LoraConfig, ModelConfig


DEFAULT_FRAMING_BEFORE = ("Reference example: a different, already solved task, given as "
                          "latent memory:\n")
DEFAULT_FRAMING_AFTER = "\nEnd of reference example. Now solve your own task from scratch.\n\n"


@dataclasses.dataclass(frozen=True)
class LatentFraming:
    """Fixed text around the latent slots inserted before the task text.

    docs/method.md, "Teacher sequence".
    """

    before: str = DEFAULT_FRAMING_BEFORE
    after: str = DEFAULT_FRAMING_AFTER
    num_slots: int = 96

    def __post_init__(self):
        if self.num_slots < 1:
            raise ValueError(f"LatentFraming.num_slots must be >= 1, got {self.num_slots} "
                             "(it is n_ret * K, e.g. 3 * 32 = 96)")


COMPRESSOR_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ComposerConfig:
    """Composer sizes: latents per experience K, compressor depth, experiences n_ret, LoRA.

    ``ff_bias``: biases on the compressor's feed-forward Linears (False = the release's).
    ``max_experience_tokens``: encoder inputs are cut to this many tokens (None = no cut,
    as the release; inputs are then padded to a length bucket of the longest one).
    ``framing_before`` / ``framing_after``: the text around the latent slots (None = the
    built-in framing, :data:`lopd_jax.method.composer.DEFAULT_FRAMING_BEFORE`); set them
    to the release's exact text to reproduce its teacher prompt token for token.
    ``param_dtype``: the compressor's parameter (and so its AdamW moments') dtype; None =
    the backbone's ``model.param_dtype``. ``bfloat16`` reproduces the release, which casts
    its compressor to bfloat16 before the AdamW step (docs/release_parity.md, item 13).
    """

    num_latents: int = 32
    depth: int = 8
    n_ret: int = 3
    ff_mult: int = 4
    lora: LoraConfig = LoraConfig(rank=8, alpha=16.0, dropout=0.0)
    max_experience_tokens: int | None = None
    ff_bias: bool = False
    framing_before: str | None = None
    framing_after: str | None = None
    param_dtype: str | None = None

    def __post_init__(self):
        if self.param_dtype not in (None, *COMPRESSOR_DTYPES):
            raise ValueError(f"composer.param_dtype={self.param_dtype!r}; choose one of {COMPRESSOR_DTYPES}, or none "
                             "for the backbone's model.param_dtype.")

    @property
    def num_slots(self) -> int:
        """Latent vectors per task (n_ret * K; 96 by default)."""
        return self.n_ret * self.num_latents

    def latent_framing(self, num_slots: int | None = None):
        """The :class:`lopd_jax.method.composer.LatentFraming` of this config (``num_slots``
        default: n_ret * K)."""
        text = {k: v for k, v in (("before", self.framing_before), ("after", self.framing_after)) if v is not None}
        return LatentFraming(num_slots=num_slots or self.num_slots, **text)


def make_compressor(model_cfg: ModelConfig, cfg: ComposerConfig, rngs: nnx.Rngs) -> Compressor:
    """A compressor sized to the backbone (width = hidden size, heads = attention heads)."""
    d, heads = model_cfg.hidden_size, model_cfg.num_heads
    while d % heads:  # head_dim = d / heads must be whole (docs/method.md, "Compressor")
        heads -= 1
    param_dtype = jnp.dtype(cfg.param_dtype) if cfg.param_dtype else model_cfg.jnp_param_dtype
    return Compressor(d, heads, num_latents=cfg.num_latents, depth=cfg.depth, ff_mult=cfg.ff_mult,
                      ff_bias=cfg.ff_bias, param_dtype=param_dtype, dtype=model_cfg.jnp_dtype, rngs=rngs)


def compose(encoder, compressor: Compressor, exp_tokens: jax.Array, exp_mask: jax.Array,
            dropout_rng=None) -> jax.Array:
    """Latents [B, n_ret * K, d] from experience tokens [B, n_ret, L] with mask [B, n_ret, L].

    ``encoder`` is a Decoder whose LoRA parameters are the composer's; it is called with
    ``lora=True`` and ``return_hidden=True`` (hidden states after the final norm).
    """
    B, n, L = exp_tokens.shape
    flat_ids = exp_tokens.reshape(B * n, L)
    flat_mask = exp_mask.reshape(B * n, L).astype(bool)
    # a missing experience (all-False row) still runs through the encoder with one valid key;
    # the compressor then sees none of its states and the teacher masks its slots (slot_mask)
    enc_mask = flat_mask.at[:, 0].set(True)
    hidden = encoder(flat_ids, attention_mask=enc_mask, lora=True, return_hidden=True, dropout_rng=dropout_rng)
    latents = compressor(hidden, flat_mask)  # [B * n, K, d]
    return latents.reshape(B, n * latents.shape[1], latents.shape[2]).astype(jnp.float32)


def slot_mask(exp_mask: jax.Array, num_latents: int) -> jax.Array:
    """[B, n_ret * K] bool: False on the K slots of each experience with no valid token
    (the bank returned fewer than n_ret hits)."""
    valid = jnp.any(exp_mask.astype(bool), axis=-1)  # [B, n_ret]
    return jnp.repeat(valid, num_latents, axis=1)

"""Declarative Hugging Face <-> decoder parameter tables, one per model family.

Each :class:`TensorRule` names a Hugging Face tensor (``{i}`` stands for the layer index of
stacked parameters), our parameter, and a :class:`Transform` with its inverse. Import,
export and the PEFT adapter export read these tables; no code elsewhere matches names.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Transform:
    """HF tensor <-> our (per-layer) tensor. ``n_in`` > 0 marks a linear layer: the HF
    weight is [out, in] (torch ``nn.Linear``) and ours is [*in_dims, *out_dims] with the
    first ``n_in`` dims flattening to ``in``; ``n_in == 0`` is the identity."""

    n_in: int = 0

    def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        """The HF shape for our per-layer shape."""
        if not self.n_in:
            return tuple(ours)
        return (math.prod(ours[self.n_in:]), math.prod(ours[:self.n_in]))

    def to_ours(self, w: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
        """HF tensor -> ours (shape ``ours``)."""
        return (w.T if self.n_in else w).reshape(ours)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """Our tensor -> HF layout (C-contiguous)."""
        if not self.n_in:
            return np.ascontiguousarray(x)
        rows = math.prod(x.shape[:self.n_in])
        return np.ascontiguousarray(x.reshape(rows, -1).T)


IDENTITY = Transform(0)
LINEAR = Transform(1)        # [out, in] <-> [in, *out] (q, k, v, gate, up, down, lm_head)
LINEAR_2IN = Transform(2)    # [out, in] <-> [heads, head_dim, out] (o)


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """One HF tensor name pattern <-> one of our parameters.

    ``when``: ``"always"``, ``"untied"`` (only with separate LM head) -- the condition for
    the tensor to exist in a checkpoint of a given config.
    """

    hf: str
    ours: str
    transform: Transform = IDENTITY
    when: str = "always"

    @property
    def stacked(self) -> bool:
        """Whether ``hf`` has a ``{i}`` layer placeholder (our parameter has a leading L)."""
        return "{i}" in self.hf

    def applies(self, cfg: ModelConfig) -> bool:
        """Whether this tensor exists for ``cfg``."""
        return self.when == "always" or (self.when == "untied" and not cfg.tie_word_embeddings)

    def hf_names(self, cfg: ModelConfig) -> list[str]:
        """All concrete HF names (one per layer when stacked)."""
        return [self.hf.format(i=i) for i in range(cfg.num_layers)] if self.stacked else [self.hf]


_PROJ = [
    TensorRule("model.layers.{i}.self_attn.q_proj.weight", "q", LINEAR),
    TensorRule("model.layers.{i}.self_attn.k_proj.weight", "k", LINEAR),
    TensorRule("model.layers.{i}.self_attn.v_proj.weight", "v", LINEAR),
    TensorRule("model.layers.{i}.self_attn.o_proj.weight", "o", LINEAR_2IN),
    TensorRule("model.layers.{i}.mlp.gate_proj.weight", "gate", LINEAR),
    TensorRule("model.layers.{i}.mlp.up_proj.weight", "up", LINEAR),
    TensorRule("model.layers.{i}.mlp.down_proj.weight", "down", LINEAR),
]
_BASE = [
    TensorRule("model.embed_tokens.weight", "embed"),
    *_PROJ,
    TensorRule("model.norm.weight", "final_norm"),
    TensorRule("lm_head.weight", "lm_head", LINEAR, when="untied"),
]
_QK_NORM = [
    TensorRule("model.layers.{i}.self_attn.q_norm.weight", "q_norm"),
    TensorRule("model.layers.{i}.self_attn.k_norm.weight", "k_norm"),
]
_PRE_NORMS = [
    TensorRule("model.layers.{i}.input_layernorm.weight", "attn_norm"),
    TensorRule("model.layers.{i}.post_attention_layernorm.weight", "mlp_norm"),
]

TABLES: dict[str, tuple[TensorRule, ...]] = {
    "qwen3": (*_BASE, *_QK_NORM, *_PRE_NORMS),
    "olmo3": (*_BASE, *_QK_NORM,
              TensorRule("model.layers.{i}.post_attention_layernorm.weight", "attn_norm"),
              TensorRule("model.layers.{i}.post_feedforward_layernorm.weight", "mlp_norm")),
    "llama": (*_BASE, *_PRE_NORMS),  # no q/k norm, no biases
}

# Tensors a checkpoint may carry that the model does not use: RoPE buffers saved by old
# releases, and a copy of the embedding under lm_head in tied checkpoints (transformers
# ignores it too; the embedding is used).
IGNORED_ALWAYS = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)
IGNORED_WHEN_TIED = ("lm_head.weight",)

# PEFT adapter naming: our projection -> HF module (rule name without ".weight").
PEFT_PREFIX = "base_model.model."


def table(cfg: ModelConfig) -> tuple[TensorRule, ...]:
    """The rules that apply to ``cfg`` (its family; lm_head only when untied)."""
    if cfg.family not in TABLES:
        raise ValueError(f"no Hugging Face mapping for family {cfg.family!r}; known: {sorted(TABLES)}.")
    return tuple(r for r in TABLES[cfg.family] if r.applies(cfg))


def ignorable(name: str, cfg: ModelConfig) -> bool:
    """Whether a checkpoint tensor not in the table may be skipped silently."""
    if cfg.tie_word_embeddings and name in IGNORED_WHEN_TIED:
        return True
    return any(p.fullmatch(name) for p in IGNORED_ALWAYS)


def projection_module(cfg: ModelConfig, proj: str) -> str:
    """HF module pattern (with ``{i}``) of projection ``proj`` (q, k, ..., down)."""
    for r in TABLES[cfg.family]:
        if r.ours == proj and r.stacked and r.transform.n_in:
            return r.hf[: -len(".weight")]
    raise KeyError(f"projection {proj!r} has no Hugging Face module in the {cfg.family} table.")


def peft_names(cfg: ModelConfig, proj: str, layer: int) -> tuple[str, str]:
    """PEFT safetensors names of the (A, B) factors of ``proj`` in ``layer``."""
    mod = PEFT_PREFIX + projection_module(cfg, proj).format(i=layer)
    return f"{mod}.lora_A.weight", f"{mod}.lora_B.weight"


def lora_to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's factors a [*in, r], b [r, *out] -> PEFT lora_A [r, in], lora_B [out, r]."""
    r = a.shape[-1]
    return (np.ascontiguousarray(a.reshape(-1, r).T), np.ascontiguousarray(b.reshape(r, -1).T))


def peft_to_lora(lora_a: np.ndarray, lora_b: np.ndarray, a_shape, b_shape) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of :func:`lora_to_peft` for one layer (shapes without the layer axis)."""
    return lora_a.T.reshape(a_shape), lora_b.T.reshape(b_shape)

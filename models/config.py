"""Typed configuration of the decoder backbone shared by Qwen3, Olmo-3 and Llama.

One decoder serves all three families; everything that differs between them is a field
here (norm placement, q/k-norm span or none, per-layer attention pattern, RoPE per layer
type), so the model code never branches on a family name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax.numpy as jnp

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "save_attn_out")
ATTENTION_IMPLS = ("plain", "causal_plain", "blockwise", "splash")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters for one layer type.

    ``rope_type`` is ``"default"`` or ``"yarn"``; the YaRN fields follow the Hugging Face
    names. ``attention_factor=None`` means "derive it from ``factor``" as ``transformers``
    does (0.1 ln(factor) + 1).
    """

    theta: float = 1_000_000.0
    rope_type: Literal["default", "yarn"] = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapter settings: which projections, rank, alpha and input dropout."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self):
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad:
            raise ValueError(f"LoRA targets {bad} are unknown; choose from {LORA_TARGETS}.")
        if self.rank <= 0:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}.")

    @property
    def scale(self) -> float:
        """The factor alpha / rank applied to the low-rank update."""
        return self.alpha / self.rank


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture, numerics and memory settings of a decoder-only backbone.

    Family differences:
      * ``norm_placement``: ``"pre"`` (Qwen3: x + attn(norm(x))) or ``"post"``
        (Olmo-3: x + norm(attn(x))).
      * ``qk_norm``: ``"per_head"`` (RMSNorm over head_dim, Qwen3), ``"full"``
        (RMSNorm over the whole q / k projection before the head split, Olmo-3) or
        ``"none"`` (Llama).
      * ``layer_types``: per-layer ``"full_attention"`` / ``"sliding_attention"``; sliding
        layers attend to the last ``sliding_window`` positions (self included).
      * ``rope``: RoPE parameters per layer type.
      * ``rmsnorm_weight_first``: False multiplies the weight after casting back to the
        input dtype (Qwen3 / Llama style), True multiplies in fp32 first (Olmo-3 style).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    norm_placement: Literal["pre", "post"] = "pre"
    qk_norm: Literal["per_head", "full", "none"] = "per_head"
    rmsnorm_weight_first: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    rope: tuple[tuple[str, RopeConfig], ...] = (("full_attention", RopeConfig()),)
    max_position_embeddings: int = 40_960
    family: Literal["qwen3", "olmo3", "llama"] = "qwen3"
    # numerics
    param_dtype: str = "float32"
    dtype: str = "float32"
    # memory
    scan_layers: bool = True
    remat_policy: str = "none"
    attention_impl: str = "plain"
    attention_block_q: int = 512
    attention_block_kv: int = 512
    lora: LoraConfig | None = None

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_layers is "
                f"{self.num_layers}; give one type per layer."
            )
        for t in self.layer_types:
            if t not in ("full_attention", "sliding_attention"):
                raise ValueError(f"layer type {t!r} is unknown; use full_attention or sliding_attention.")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding_attention layers need sliding_window > 0.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}."
            )
        rope_types = dict(self.rope)
        missing = sorted(set(self.layer_types) - set(rope_types))
        if missing:
            raise ValueError(f"no RoPE parameters for layer types {missing}; add them to `rope`.")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy={self.remat_policy!r}; choose from {REMAT_POLICIES}.")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r}; choose from {ATTENTION_IMPLS}.")
        for name in ("param_dtype", "dtype"):
            if getattr(self, name) not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"{name}={getattr(self, name)!r}; use float32, bfloat16 or float16.")

    # ----- derived -----
    @property
    def jnp_param_dtype(self):
        """Storage dtype of the parameters."""
        return jnp.dtype(self.param_dtype)

    @property
    def jnp_dtype(self):
        """Compute dtype of matmuls and activations (norms and softmax stay fp32)."""
        return jnp.dtype(self.dtype)

    @property
    def rope_by_type(self) -> dict[str, RopeConfig]:
        """RoPE parameters keyed by layer type."""
        return dict(self.rope)

    @property
    def rope_type_names(self) -> tuple[str, ...]:
        """Distinct layer types in a fixed order (indexes the per-type RoPE tables)."""
        return tuple(sorted(set(self.layer_types)))

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matmuls (q, k, v, o and the gated MLP): what the
        FLOP and collective estimates multiply by tokens (norms and biases left out)."""
        d, hd = self.hidden_size, self.head_dim
        return d * hd * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * d * self.intermediate_size

    def num_params(self, include_embeddings: bool = True) -> int:
        """Number of backbone parameters (no LoRA)."""
        d, hd = self.hidden_size, self.head_dim
        qk = hd * 2 if self.qk_norm == "per_head" else (self.num_heads + self.num_kv_heads) * hd
        per_layer = self.layer_matmul_params() + 2 * d + (qk if self.qk_norm != "none" else 0)
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + d + (emb if include_embeddings else 0)


def _olmo3_layer_types(n: int) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n))


def qwen3(hidden, intermediate, layers, heads, kv_heads, *, tie, vocab=151_936, head_dim=128, **kw):
    """A Qwen3 configuration (pre-norm, per-head q/k norm, RoPE theta 1e6)."""
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, norm_placement="pre", qk_norm="per_head",
        rope=(("full_attention", RopeConfig(theta=1_000_000.0)),), family="qwen3", **kw,
    )


OLMO3_YARN = RopeConfig(
    theta=500_000.0, rope_type="yarn", factor=8.0, original_max_position_embeddings=8192,
    beta_fast=32.0, beta_slow=1.0, attention_factor=1.2079441541679836,
)


def olmo3(hidden, intermediate, layers, heads, kv_heads, *, vocab=100_278, head_dim=128,
          sliding_window=4096, full_rope=OLMO3_YARN, sliding_rope=RopeConfig(theta=500_000.0), **kw):
    """An Olmo-3 configuration (post-norm, full-projection q/k norm, 3 sliding : 1 full)."""
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
        tie_word_embeddings=False, norm_placement="post", qk_norm="full", rmsnorm_weight_first=True,
        layer_types=_olmo3_layer_types(layers), sliding_window=sliding_window,
        rope=(("full_attention", full_rope), ("sliding_attention", sliding_rope)),
        max_position_embeddings=65_536, family="olmo3", **kw,
    )


def llama(hidden, intermediate, layers, heads, kv_heads, *, tie, vocab=49_152, head_dim=None,
          rope_theta=100_000.0, rms_norm_eps=1e-5, **kw):
    """A Llama configuration (pre-norm, no q/k norm, no biases, RoPE theta from the config)."""
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim or hidden // heads,
        rms_norm_eps=rms_norm_eps, tie_word_embeddings=tie, norm_placement="pre", qk_norm="none",
        rope=(("full_attention", RopeConfig(theta=rope_theta)),), family="llama", **kw,
    )


def named_config(name: str, **overrides: Any) -> ModelConfig:
    """The named backbone configurations: Qwen3 0.6B-8B, Olmo-3-7B, SmolLM2-135M (Llama) and
    tiny test sizes."""
    table = {
        "qwen3_0_6b": lambda: qwen3(1024, 3072, 28, 16, 8, tie=True),
        "qwen3_1_7b": lambda: qwen3(2048, 6144, 28, 16, 8, tie=True),
        "qwen3_4b": lambda: qwen3(2560, 9728, 36, 32, 8, tie=True),
        "qwen3_8b": lambda: qwen3(4096, 12288, 36, 32, 8, tie=False),
        "olmo3_7b": lambda: olmo3(4096, 11008, 32, 32, 32),
        "smollm2_135m": lambda: llama(576, 1536, 30, 9, 3, tie=True, max_position_embeddings=8192),
        # tiny sizes for tests and the CPU default; head_dim != hidden / heads on purpose
        "tiny_qwen3": lambda: qwen3(64, 128, 2, 4, 2, tie=True, vocab=512, head_dim=24,
                                    max_position_embeddings=4096),
        # 4 layers, twice as wide: the CPU miniature's capacity check (docs/miniature.md)
        "small_qwen3": lambda: qwen3(128, 384, 4, 4, 2, tie=True, vocab=512, head_dim=32,
                                     max_position_embeddings=4096),
        "tiny_olmo3": lambda: olmo3(64, 128, 4, 4, 4, vocab=512, head_dim=16, sliding_window=8,
                                    full_rope=dataclasses.replace(OLMO3_YARN, original_max_position_embeddings=64)),
        "tiny_llama": lambda: llama(64, 128, 2, 4, 2, tie=True, vocab=512, head_dim=24,
                                    max_position_embeddings=4096),
    }
    if name not in table:
        raise KeyError(f"unknown model config {name!r}; known: {sorted(table)}")
    cfg = table[name]()
    return cfg.replace(**overrides) if overrides else cfg

"""Hugging Face ``config.json`` <-> :class:`models.config.ModelConfig`.

Supported architectures: ``Qwen3ForCausalLM`` (model_type ``qwen3``),
``Olmo3ForCausalLM`` (``olmo3``) and ``LlamaForCausalLM`` (``llama``; default or YaRN RoPE). Missing fields take the ``transformers`` defaults of the
family, so a config means here what it means to ``transformers`` 5.x.

RoPE: both ``rope_parameters`` (flat, or nested per layer type) and the older
``rope_theta`` + ``rope_scaling`` are read. Olmo-3 follows the per-layer-type semantics of
``transformers`` 5.x (an old-format ``rope_scaling`` applies to full-attention layers
only); ``yarn_on_sliding_layers=True`` restores the behaviour of older releases that
applied YaRN to every layer.
"""

from __future__ import annotations

import math
from typing import Any

from models.config import ModelConfig, RopeConfig

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Olmo3ForCausalLM": "olmo3", "LlamaForCausalLM": "llama"}
_ARCH_OF = {v: k for k, v in ARCHITECTURES.items()}
LAYER_TYPES = ("full_attention", "sliding_attention")

# transformers defaults per family (Qwen3Config / Olmo3Config / LlamaConfig)
_DEFAULTS = {
    "qwen3": dict(rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=32_768,
                  tie_word_embeddings=False, sliding_window=4096, max_window_layers=28),
    "olmo3": dict(rope_theta=500_000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
                  tie_word_embeddings=False, sliding_window=4096),
    "llama": dict(rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=2048,
                  tie_word_embeddings=False),
}
# what each family's decoder layer looks like (ModelConfig fields)
_FAMILY_FIELDS = {
    "qwen3": dict(norm_placement="pre", qk_norm="per_head", rmsnorm_weight_first=False),
    "olmo3": dict(norm_placement="post", qk_norm="full", rmsnorm_weight_first=True),
    "llama": dict(norm_placement="pre", qk_norm="none", rmsnorm_weight_first=False),
}


class UnsupportedConfigError(ValueError):
    """The checkpoint's config.json uses an architecture or option this decoder lacks."""


def detect_family(hf: dict) -> str:
    """``"qwen3"``, ``"olmo3"`` or ``"llama"`` from ``architectures`` (preferred) or ``model_type``."""
    archs = hf.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    if archs:
        raise UnsupportedConfigError(
            f"config.json field `architectures`={archs} is not supported; supported: {sorted(ARCHITECTURES)}.")
    mt = hf.get("model_type")
    if mt in _ARCH_OF:
        return mt
    raise UnsupportedConfigError(
        f"config.json field `model_type`={mt!r} is not supported (and no `architectures`); "
        f"supported: {sorted(_ARCH_OF)}.")


def _check_supported(hf: dict) -> None:
    def bad(field, value, why):
        raise UnsupportedConfigError(f"config.json field `{field}`={value!r} is not supported: {why}.")

    if hf.get("attention_bias", False):
        bad("attention_bias", hf["attention_bias"], "projections here have no bias")
    if hf.get("mlp_bias", False):
        bad("mlp_bias", hf["mlp_bias"], "projections here have no bias")
    if hf.get("hidden_act", "silu") != "silu":
        bad("hidden_act", hf["hidden_act"], "only the SiLU-gated MLP is implemented")
    if hf.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        bad("partial_rotary_factor", hf["partial_rotary_factor"], "RoPE covers the whole head here")
    if hf.get("quantization_config"):
        bad("quantization_config", "...", "load an unquantized checkpoint")
    if hf.get("pretraining_tp", 1) not in (None, 1):
        bad("pretraining_tp", hf["pretraining_tp"], "only pretraining_tp=1 matches transformers' forward")


def _rope_from_dict(p: dict, field: str, theta_default: float, max_pos: int, truncate_default: bool) -> RopeConfig:
    p = dict(p)
    kind = p.get("rope_type", p.get("type", "default"))
    theta = float(p.get("rope_theta", theta_default))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind != "yarn":
        raise UnsupportedConfigError(
            f"config.json field `{field}.rope_type`={kind!r} is not supported; use 'default' or 'yarn'.")
    if p.get("partial_rotary_factor", 1.0) not in (None, 1.0):
        raise UnsupportedConfigError(f"config.json field `{field}.partial_rotary_factor` is not supported.")
    orig = int(p.get("original_max_position_embeddings") or max_pos)
    factor = p.get("factor")
    factor = float(max_pos / orig if factor is None else factor)
    attn = p.get("attention_factor")
    if attn is None and p.get("mscale") and p.get("mscale_all_dim"):
        def ms(scale, m):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        attn = ms(factor, p["mscale"]) / ms(factor, p["mscale_all_dim"])
    return RopeConfig(
        theta=theta, rope_type="yarn", factor=factor, original_max_position_embeddings=orig,
        beta_fast=float(p.get("beta_fast") or 32.0), beta_slow=float(p.get("beta_slow") or 1.0),
        attention_factor=None if attn is None else float(attn),
        truncate=bool(p.get("truncate", truncate_default)),
    )


def _parse_rope(hf: dict, family: str, yarn_on_sliding_layers: bool) -> dict[str, RopeConfig]:
    theta = hf.get("rope_theta", _DEFAULTS[family]["rope_theta"])
    max_pos = hf.get("max_position_embeddings", _DEFAULTS[family]["max_position_embeddings"])
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    nested = isinstance(params, dict) and any(k in LAYER_TYPES for k in params)
    if nested:
        unknown = sorted(set(params) - set(LAYER_TYPES))
        if unknown:
            raise UnsupportedConfigError(f"config.json field `rope_parameters` has unknown layer types {unknown}.")
        per_type = {}
        for t in LAYER_TYPES:
            p = dict(params.get(t) or {"rope_type": "default"})
            if t == "full_attention" and scaling:
                p.update(scaling)  # transformers merges an old rope_scaling into full layers
            # transformers reads `truncate` from the top level of rope_parameters, which a
            # nested dict never has: per-type YaRN always truncates there.
            per_type[t] = _rope_from_dict(p, f"rope_parameters.{t}", theta, max_pos, True)
    else:
        flat = dict(params or {})
        if scaling:
            if family == "olmo3":
                # Olmo3Config (transformers 5.x) puts an old-format rope_scaling on the
                # full-attention layers only; sliding layers keep default RoPE.
                full = _rope_from_dict({**flat, **scaling}, "rope_scaling", theta, max_pos, True)
                slide = _rope_from_dict({"rope_type": "default", "rope_theta": flat.get("rope_theta", theta)},
                                        "rope_parameters", theta, max_pos, True)
                per_type = {"full_attention": full, "sliding_attention": slide}
            else:
                flat.update(scaling)
                rope = _rope_from_dict(flat, "rope_scaling", theta, max_pos, True)
                per_type = {t: rope for t in LAYER_TYPES}
        else:
            rope = _rope_from_dict(flat, "rope_parameters", theta, max_pos, True)
            per_type = {t: rope for t in LAYER_TYPES}
    if yarn_on_sliding_layers:
        per_type["sliding_attention"] = per_type["full_attention"]
    return per_type


def from_hf_config(hf: dict, *, yarn_on_sliding_layers: bool = False, **overrides: Any) -> ModelConfig:
    """A :class:`ModelConfig` for a Hugging Face config dict (``config.json`` contents).

    Args:
      hf: the parsed config.json.
      yarn_on_sliding_layers: apply the full-attention RoPE (YaRN) to sliding layers too
        (older ``transformers`` behaviour for Olmo-3); default is per-layer-type RoPE.
      **overrides: ModelConfig fields to set (dtype, attention_impl, lora, ...).
    """
    family = detect_family(hf)
    _check_supported(hf)
    d = _DEFAULTS[family]
    try:
        L = int(hf["num_hidden_layers"])
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        fields = dict(vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
                      intermediate_size=int(hf["intermediate_size"]), num_layers=L, num_heads=heads)
    except KeyError as e:
        raise UnsupportedConfigError(f"config.json lacks the required field `{e.args[0]}`.") from None
    kv = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hidden // heads

    if family == "qwen3":
        window = hf.get("sliding_window", d["sliding_window"]) if hf.get("use_sliding_window", False) else None
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if window is not None and i >= hf.get("max_window_layers", d["max_window_layers"])
            else "full_attention" for i in range(L)]
    elif family == "olmo3":
        window = hf.get("sliding_window", d["sliding_window"])
        layer_types = hf.get("layer_types") or [
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(L)]
    else:  # llama: every layer attends to the whole prefix
        window = None
        layer_types = ["full_attention"] * L
    family_fields = _FAMILY_FIELDS[family]
    layer_types = tuple(layer_types)
    bad_types = sorted(set(layer_types) - set(LAYER_TYPES))
    if bad_types:
        raise UnsupportedConfigError(f"config.json field `layer_types` has unsupported entries {bad_types}.")
    if len(layer_types) != L:
        raise UnsupportedConfigError(
            f"config.json field `layer_types` has {len(layer_types)} entries for {L} layers.")
    if "sliding_attention" in layer_types and not window:
        raise UnsupportedConfigError(
            "config.json has sliding_attention layers but no `sliding_window` "
            "(Qwen3 also needs `use_sliding_window`: true).")

    rope_by_type = _parse_rope(hf, family, yarn_on_sliding_layers)
    used = sorted(set(layer_types))
    cfg = ModelConfig(
        **fields, num_kv_heads=int(kv), head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", d["rms_norm_eps"])),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", d["tie_word_embeddings"])),
        layer_types=layer_types, sliding_window=int(window) if "sliding_attention" in layer_types else None,
        rope=tuple((t, rope_by_type[t]) for t in used),
        max_position_embeddings=int(hf.get("max_position_embeddings", d["max_position_embeddings"])),
        family=family, **family_fields,
    )
    return cfg.replace(**overrides) if overrides else cfg


def _rope_to_dict(r: RopeConfig) -> dict:
    out: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta}
    if r.rope_type == "yarn":
        out.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                   beta_fast=r.beta_fast, beta_slow=r.beta_slow)
        if r.attention_factor is not None:
            out["attention_factor"] = r.attention_factor
        if not r.truncate:
            out["truncate"] = False
    return out


def to_hf_config(cfg: ModelConfig, *, dtype: str = "bfloat16", extra: dict | None = None) -> dict:
    """A ``config.json`` dict that ``transformers`` loads as the same architecture.

    ``extra`` adds or replaces fields (e.g. bos / eos / pad token ids).
    """
    want = _FAMILY_FIELDS[cfg.family]
    if any(getattr(cfg, k) != v for k, v in want.items()):
        raise UnsupportedConfigError(
            f"norm_placement={cfg.norm_placement!r}, qk_norm={cfg.qk_norm!r}, rmsnorm_weight_first="
            f"{cfg.rmsnorm_weight_first} has no {cfg.family} Hugging Face equivalent (it needs {want}).")
    rope = cfg.rope_by_type
    sliding = "sliding_attention" in cfg.layer_types
    out: dict[str, Any] = {
        "architectures": [_ARCH_OF[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "layer_types": list(cfg.layer_types),
        "dtype": dtype,
        "use_cache": True,
    }
    full = rope.get("full_attention", next(iter(rope.values())))
    out["rope_theta"] = full.theta  # read by transformers releases before rope_parameters
    if cfg.family == "llama":
        if sliding or len({rope[t] for t in set(cfg.layer_types)}) != 1:
            raise UnsupportedConfigError("Llama configs have full attention and one RoPE on every layer.")
        del out["layer_types"]
        out["rope_parameters"] = _rope_to_dict(full)
        out["mlp_bias"] = False
        out["pretraining_tp"] = 1
    elif cfg.family == "qwen3":
        kinds = {rope[t] for t in set(cfg.layer_types)}
        if len(kinds) != 1:
            raise UnsupportedConfigError("Qwen3 configs have one RoPE for all layers; this config has several.")
        out["rope_parameters"] = _rope_to_dict(full)
        out["use_sliding_window"] = sliding
        out["sliding_window"] = cfg.sliding_window if sliding else None
        if sliding:
            out["max_window_layers"] = cfg.layer_types.index("sliding_attention")
    else:
        slide = rope.get("sliding_attention", full)
        out["rope_parameters"] = {"full_attention": _rope_to_dict(full),
                                  "sliding_attention": _rope_to_dict(slide)}
        out["sliding_window"] = cfg.sliding_window or 4096
    if extra:
        out.update(extra)
    return out

"""Write the decoder's LoRA adapter in PEFT format (adapter_config.json +
adapter_model.safetensors) for ``peft.PeftModel.from_pretrained`` on the matching
``transformers`` model.

PEFT names: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in]
and ``...lora_B.weight`` [out, r]; PEFT scales the update by ``lora_alpha / r``, as here.
"""

from __future__ import annotations

import os

import jax

from models import hf_mapping
from models.config import ModelConfig
from models.hf_export import export_dtype, to_host
from models.storage import open_storage

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_config(cfg: ModelConfig, base_model_name_or_path: str | None = None) -> dict:
    """The PEFT ``LoraConfig`` dict for ``cfg.lora``."""
    lc = cfg.lora
    modules = [hf_mapping.projection_module(cfg, t).rsplit(".", 1)[-1] for t in lc.targets]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lc.rank,
        "lora_alpha": lc.alpha,
        "lora_dropout": lc.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
    }


def save_peft_adapter(model, path: str | os.PathLike, base_model_name_or_path: str | None = None,
                      dtype: str = "float32") -> list[str]:
    """Write ``model``'s LoRA adapter as a PEFT adapter directory (local or ``gs://``).

    Args:
      model: a :class:`models.decoder.Decoder` with ``cfg.lora`` set.
      path: output directory or ``gs://bucket/prefix``.
      base_model_name_or_path: recorded in adapter_config.json (the base checkpoint).
      dtype: tensor dtype in the file.

    Returns:
      The names of the files written.
    """
    cfg: ModelConfig = model.cfg
    if cfg.lora is None:
        raise ValueError("the model has no LoRA adapter (cfg.lora is None); nothing to export.")
    np_dtype = export_dtype(dtype)
    tensors = {}
    for proj in cfg.lora.targets:
        a_all = getattr(model, f"lora_{proj}_a")[...]
        b_all = getattr(model, f"lora_{proj}_b")[...]
        for i in range(cfg.num_layers):
            lora_a, lora_b = hf_mapping.lora_to_peft(to_host(a_all[i]), to_host(b_all[i]))
            name_a, name_b = hf_mapping.peft_names(cfg, proj, i)
            tensors[name_a] = lora_a.astype(np_dtype)
            tensors[name_b] = lora_b.astype(np_dtype)
    if jax.process_index() != 0:
        return []
    store = open_storage(path)
    store.write_safetensors(ADAPTER_WEIGHTS, tensors, {"format": "pt"})
    store.write_json(ADAPTER_CONFIG, adapter_config(cfg, base_model_name_or_path))
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]

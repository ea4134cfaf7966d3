"""Qwen3 / Olmo-3 / Llama decoder, LoRA, and Hugging Face import / export (and GGUF import).

The Hugging Face entry points are imported lazily so ``import models.config`` stays light:
``from_pretrained`` (safetensors directories or ``.gguf`` files), ``load_config``,
``load_peft_adapter``, ``save_pretrained``, ``gguf_tokenizer``, ``GGUFStorage``,
``save_peft_adapter``.
"""

import importlib

_LAZY = {
    "from_pretrained": "models.hf_import",
    "load_config": "models.hf_import",
    "load_peft_adapter": "models.hf_import",
    "save_pretrained": "models.hf_export",
    "save_peft_adapter": "models.peft_export",
    "gguf_tokenizer": "models.gguf_vocab",
    "GGUFStorage": "models.gguf",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    """Import the Hugging Face entry points on first use."""
    if name in _LAZY:

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")

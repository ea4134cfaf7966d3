"""Read a llama.cpp GGUF file as a Hugging Face checkpoint (config.json + safetensors).

:class:`GGUFStorage` is a read-only :class:`models.storage.Storage` presenting one ``.gguf`` file
as a checkpoint directory: ``config.json`` from the file's metadata, ``model.safetensors``
listing its tensors under Hugging Face names in float32, each dequantized on demand, so
:func:`models.hf_import.from_pretrained` loads it exactly as it loads safetensors.
:func:`unpermute_qk` undoes llama.cpp's interleaving of the q / k rows, as ``transformers``'
GGUF loader does. Supported: architecture ``llama``; F32, F16 and every block quantization the
installed ``gguf`` package can dequantize; anything else raises :class:`UnsupportedGGUFError`.
The tokenizer and chat template come from the file too (:mod:`models.gguf_vocab`).
Details: ``docs/smollm2.md``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from models.storage import Storage, TensorInfo

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURES = {"llama": "LlamaForCausalLM"}

# GGUF tensor name -> Hugging Face name, per architecture ("{i}" is the layer index)
_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


class UnsupportedGGUFError(ValueError):
    """The GGUF file uses an architecture, tensor type or option this importer lacks."""


def is_gguf_path(path: Any) -> bool:
    """Whether ``path`` names a GGUF file (by its ``.gguf`` suffix)."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).lower().endswith(".gguf")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q / k row permutation of a [n_head * head_dim, in] weight.

    llama.cpp stores ``w.reshape(n, 2, hd // 2, in).swapaxes(1, 2)``; this is the inverse
    (``n_head`` is the number of query heads for q and of key/value heads for k)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def supported_tensor_types() -> set[str]:
    """Names of the GGML tensor types the installed ``gguf`` package dequantizes."""
    from gguf import quants  # optional: only .gguf files need the gguf package

    return {"F32", "F16"} | {t.name for t in quants._type_traits}


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _hf_name(gguf_name: str) -> str:
    m = _LAYER.fullmatch(gguf_name)
    key = f"blk.{{i}}.{m.group(2)}" if m else gguf_name
    hf = _LLAMA_NAMES.get(key)
    if hf is None:
        return gguf_name  # not ours: from_pretrained lists it as an unexpected tensor
    return hf.format(i=m.group(1)) if m else hf


class GGUFStorage(Storage):
    """A GGUF file seen as a read-only Hugging Face checkpoint directory.

    Files: ``config.json`` (from the metadata) and ``model.safetensors`` (the tensors,
    float32, Hugging Face names and layouts). ``hf_config`` is that config dict and
    ``metadata`` the file's other key/value fields (tokenizer arrays left out).
    """

    def __init__(self, path: str | os.PathLike):
        try:
            import gguf  # optional: only .gguf files need it
        except ImportError as e:
            raise ImportError("reading a .gguf file needs the `gguf` package: pip install gguf") from e
        self.path = os.fspath(path)
        self.url = self.path
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"{self.path} does not exist (a .gguf file was expected).")
        self.reader = gguf.GGUFReader(self.path)
        arch = _field(self.reader, "general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedGGUFError(
                f"{self.path}: GGUF architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}.")
        self.arch = arch
        ok = supported_tensor_types()
        bad = sorted({t.tensor_type.name for t in self.reader.tensors} - ok)
        if bad:
            raise UnsupportedGGUFError(
                f"{self.path}: GGUF tensor type(s) {bad} cannot be dequantized by gguf "
                f"{getattr(gguf, '__version__', '?')}; supported: {sorted(ok)}. Upgrade the gguf package "
                "or re-quantize the file (llama-quantize) to a supported type.")
        self._tensors = {_hf_name(t.name): t for t in self.reader.tensors}
        if "rope_freqs.weight" in self._tensors:
            raise UnsupportedGGUFError(f"{self.path}: tensor rope_freqs.weight (Llama-3 RoPE scaling) is not "
                                       "supported; only default RoPE is.")
        self.metadata = {k: _field(self.reader, k) for k in self.reader.fields
                         if not k.startswith("tokenizer.ggml.") and not k.startswith("GGUF.")}
        self.hf_config = self._config()

    def _config(self) -> dict:
        a, r = self.arch, self.reader

        def need(key):
            v = _field(r, f"{a}.{key}")
            if v is None:
                raise UnsupportedGGUFError(f"{self.path}: metadata key {a}.{key} is missing.")
            return v

        hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
        kv = int(_field(r, f"{a}.attention.head_count_kv", heads))
        head_dim = int(_field(r, f"{a}.attention.key_length", hidden // heads))
        rot = int(_field(r, f"{a}.rope.dimension_count", head_dim))
        if rot != head_dim:
            raise UnsupportedGGUFError(f"{self.path}: {a}.rope.dimension_count={rot} != head_dim {head_dim}; "
                                       "partial rotary embeddings are not supported.")
        scaling = _field(r, f"{a}.rope.scaling.type", "none")
        if scaling not in (None, "none"):
            raise UnsupportedGGUFError(f"{self.path}: {a}.rope.scaling.type={scaling!r} is not supported; "
                                       "only unscaled RoPE is.")
        tokens = r.fields.get("tokenizer.ggml.tokens")
        vocab = _field(r, f"{a}.vocab_size") or (len(tokens.data) if tokens is not None else None)
        if vocab is None:
            vocab = int(self._tensors["model.embed_tokens.weight"].shape[1])
        out = {
            "architectures": [ARCHITECTURES[a]], "model_type": a,
            "vocab_size": int(vocab), "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "max_position_embeddings": int(_field(r, f"{a}.context_length", 2048)),
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(_field(r, f"{a}.rope.freq_base", 10_000.0)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
        }
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": out["rope_theta"]}
        for ours, key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")):
            v = _field(r, f"tokenizer.ggml.{key}")
            if v is not None:
                out[ours] = int(v)
        return out

    # ----- Storage -----
    def exists(self, name: str) -> bool:
        return name in (CONFIG_FILE, WEIGHTS_FILE)

    def describe(self, name: str) -> str:
        return f"{self.path} [{name}]"

    def read_bytes(self, name, start=None, stop=None):
        if name != CONFIG_FILE:
            raise FileNotFoundError(f"{self.describe(name)}: a GGUF file holds only {CONFIG_FILE} and "
                                    f"{WEIGHTS_FILE} (read its tensors with read_tensor).")
        return json.dumps(self.hf_config).encode("utf-8")[start:stop]

    def write_bytes(self, name, data):
        raise OSError(f"{self.path} is a GGUF file, read-only here; write the converted checkpoint "
                      "elsewhere (python -m lopd_jax.convert_gguf).")

    def list_tensors(self, name: str) -> dict[str, TensorInfo]:
        if name != WEIGHTS_FILE:
            raise FileNotFoundError(f"{self.describe(name)} does not exist.")
        return {hf: TensorInfo(hf, WEIGHTS_FILE, "F32", tuple(int(d) for d in reversed(t.shape)))
                for hf, t in self._tensors.items()}

    def read_tensor(self, info: TensorInfo) -> np.ndarray:
        """One tensor dequantized to float32 in the Hugging Face layout ([out, in])."""
        from gguf import quants  # optional: only .gguf files need the gguf package

        t = self._tensors[info.name]
        w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32).reshape(info.shape)
        cfg = self.hf_config
        if info.name.endswith("self_attn.q_proj.weight"):
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif info.name.endswith("self_attn.k_proj.weight"):
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        return np.ascontiguousarray(w)

    def tensor_types(self) -> dict[str, int]:
        """How many tensors of each GGML type the file holds (e.g. ``{"Q4_1": 210, ...}``)."""
        out: dict[str, int] = {}
        for t in self.reader.tensors:
            out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
        return out


def generation_config(store: GGUFStorage) -> dict:
    """``generation_config.json`` contents: the file's bos / eos / pad token ids."""
    return {k: store.hf_config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in store.hf_config}

"""Write a :class:`Decoder` as a Hugging Face checkpoint (safetensors shards + index +
config.json) that ``transformers.AutoModelForCausalLM.from_pretrained`` loads.

Tensors are gathered to the host one at a time (one layer of one stacked parameter) and
written shard by shard, so host memory stays near ``max_shard_size``. LoRA adapters are
folded in on the host in fp32 (``merge_lora=True``) without touching the caller's model.
On several hosts every process takes part in the gathers and process 0 writes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

from models import hf_config, hf_mapping
from models.config import ModelConfig
from models.hf_import import INDEX_FILE, SINGLE_FILE
from models.storage import LocalStorage, Storage, open_storage

EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from ``int`` or strings like ``"2GB"``, ``"500MB"``, ``"1GiB"`` (as transformers)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}.")
        return size
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size={size!r}; use bytes or a size like '2GB', '500MB', '1GiB'.")
    return max(1, int(float(m.group(1)) * _UNITS[m.group(2).upper()]))


def export_dtype(dtype: str):
    """The numpy dtype for an export dtype name."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose from {sorted(EXPORT_DTYPES)}.")
    return np.dtype(EXPORT_DTYPES[dtype])


def to_host(x: jax.Array) -> np.ndarray:
    """A (possibly sharded, possibly multi-host) array as one host numpy array."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    rule: hf_mapping.TensorRule
    layer: int | None
    nbytes: int


def _entries(model, cfg: ModelConfig, itemsize: int) -> list[_Entry]:
    rules = hf_mapping.table(cfg)
    out = []

    def add(rule, layer):
        shape = getattr(model, rule.ours).shape
        per = shape[1:] if layer is not None else shape
        out.append(_Entry(rule.hf.format(i=layer) if layer is not None else rule.hf, rule, layer,
                          int(np.prod(per)) * itemsize))

    flat = [r for r in rules if not r.stacked]
    for r in flat:
        if r.ours == "embed":
            add(r, None)
    for i in range(cfg.num_layers):
        for r in rules:
            if r.stacked:
                add(r, i)
    for r in flat:
        if r.ours != "embed":
            add(r, None)
    return out


def _shard_plan(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    shards: list[list[_Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def _merged(model, cfg: ModelConfig, name: str, layer: int, w: np.ndarray) -> np.ndarray:
    lc = cfg.lora
    a = to_host(getattr(model, f"lora_{name}_a")[layer]).astype(np.float32)
    b = to_host(getattr(model, f"lora_{name}_b")[layer]).astype(np.float32)
    r = a.shape[-1]
    delta = (a.reshape(-1, r) @ b.reshape(r, -1)).reshape(w.shape) * np.float32(lc.scale)
    return w.astype(np.float32) + delta


def host_tensor(model, entry_rule: hf_mapping.TensorRule, layer: int | None, merge_lora: bool) -> np.ndarray:
    """One of our parameters (one layer of it when stacked) in our layout, on the host."""
    cfg: ModelConfig = model.cfg
    var = getattr(model, entry_rule.ours)[...]
    w = to_host(var[layer] if layer is not None else var)
    if merge_lora and cfg.lora is not None and layer is not None and entry_rule.ours in cfg.lora.targets:
        w = _merged(model, cfg, entry_rule.ours, layer, w)
    return w


def _write_extras(store: Storage, tokenizer, generation_config) -> list[str]:
    written = []
    if generation_config is not None:
        gc = generation_config
        if not isinstance(gc, dict):
            gc = gc.to_diff_dict() if hasattr(gc, "to_diff_dict") else gc.to_dict()
        store.write_json("generation_config.json", gc)
        written.append("generation_config.json")
    if tokenizer is not None:
        if isinstance(store, LocalStorage):
            written += [os.path.basename(f) for f in tokenizer.save_pretrained(str(store.root))]
        else:
            with tempfile.TemporaryDirectory() as tmp:
                for f in tokenizer.save_pretrained(tmp):
                    with open(f, "rb") as fh:
                        store.write_bytes(os.path.basename(f), fh.read())
                    written.append(os.path.basename(f))
    return written


def save_pretrained(model, path: str | os.PathLike | Storage, dtype: str = "bfloat16", merge_lora: bool = True,
                    max_shard_size: int | str = "2GB", tokenizer=None, generation_config=None,
                    extra_config: dict[str, Any] | None = None) -> list[str]:
    """Write ``model`` as a Hugging Face checkpoint directory (local or ``gs://``).

    Args:
      model: a :class:`models.decoder.Decoder` (sharded or not).
      path: output directory or ``gs://bucket/prefix`` (or a :class:`Storage`).
      dtype: tensor dtype in the files (``bfloat16``, ``float32`` or ``float16``).
      merge_lora: fold the LoRA adapters (if any) into the exported kernels. With False
        the base weights are written and the adapter is left out (see
        :func:`models.peft_export.save_peft_adapter`).
      max_shard_size: bytes per safetensors shard (int or "2GB"-style string); more than
        one shard adds model.safetensors.index.json.
      tokenizer: a ``transformers`` tokenizer to save alongside.
      generation_config: dict or ``transformers.GenerationConfig`` for generation_config.json.
      extra_config: fields added to config.json (e.g. ``bos_token_id``, ``eos_token_id``).

    Returns:
      The names of the files written.
    """
    cfg: ModelConfig = model.cfg
    np_dtype = export_dtype(dtype)
    limit = parse_size(max_shard_size)
    writer = jax.process_index() == 0
    store = (path if isinstance(path, Storage) else open_storage(path)) if writer else None
    if writer and isinstance(store, LocalStorage):
        store.root.mkdir(parents=True, exist_ok=True)

    shards = _shard_plan(_entries(model, cfg, np_dtype.itemsize), limit)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map, total = {}, 0
    for fname, shard in zip(names, shards):
        tensors = {}
        for e in shard:
            w = host_tensor(model, e.rule, e.layer, merge_lora)
            tensors[e.name] = e.rule.transform.to_hf(w).astype(np_dtype, copy=False)
            del w
            weight_map[e.name] = fname
            total += e.nbytes
        if writer:
            store.write_safetensors(fname, tensors, {"format": "pt"})
        del tensors
    if not writer:
        return []
    written = list(names)
    if n > 1:
        store.write_json(INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append(INDEX_FILE)
    store.write_json("config.json", hf_config.to_hf_config(cfg, dtype=dtype, extra=extra_config))
    written.append("config.json")
    written += _write_extras(store, tokenizer, generation_config)
    return written


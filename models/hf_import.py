"""Load a Hugging Face Qwen3 / Olmo-3 / Llama checkpoint (local or ``gs://``) into a :class:`Decoder`.

The model is built abstractly (``nnx.eval_shape``: no random init of billions of weights),
the checkpoint is checked against the mapping table (missing / unexpected / misshaped /
non-float tensors are all listed in one error), and each parameter is then assembled one
device shard at a time: for each distinct shard the needed HF tensors are read one by one,
transformed, sliced and copied into the shard buffer, which goes straight to its devices.
Host memory therefore stays near one HF tensor plus one device shard of one parameter.
Devices holding the same shard (replication) share one read; distinct shards of the same
parameter each re-read the HF tensors they cover (memory over read bandwidth).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx

from models import hf_config, hf_mapping
from models.config import LoraConfig, ModelConfig
from models.decoder import Decoder
from models.gguf import GGUFStorage, is_gguf_path
from models.lora import LoRAParam
from models.partitioning import DEFAULT_RULES, Rules
from models.storage import FLOAT_DTYPES, Storage, TensorInfo, open_storage

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_LIST_LIMIT = 20


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match what the config implies (lists every problem)."""


def open_checkpoint(path: str | os.PathLike | Storage) -> Storage:
    """The checkpoint at ``path``: a :class:`Storage` as is, a ``.gguf`` file as a
    :class:`models.gguf.GGUFStorage` (dequantized on read), else a directory (local or gs://)."""
    if isinstance(path, Storage):
        return path
    return GGUFStorage(path) if is_gguf_path(path) else open_storage(path)


def load_config(path: str | os.PathLike | Storage, *, yarn_on_sliding_layers: bool = False,
                **overrides: Any) -> ModelConfig:
    """The :class:`ModelConfig` of the checkpoint at ``path`` (reads config.json only)."""
    store = open_checkpoint(path)
    return hf_config.from_hf_config(store.read_json("config.json"),
                                    yarn_on_sliding_layers=yarn_on_sliding_layers, **overrides)


def checkpoint_tensors(store: Storage) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint (single file, or sharded with an index), headers only."""
    if store.exists(INDEX_FILE):
        index = store.read_json(INDEX_FILE)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{store.describe(INDEX_FILE)} has no `weight_map`.")
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not store.exists(f)]
        if absent:
            raise FileNotFoundError(
                f"{store.describe(INDEX_FILE)} refers to shard files that do not exist: {absent}.")
        infos: dict[str, TensorInfo] = {}
        for f in files:
            infos.update(store.list_tensors(f))
        not_there = sorted(n for n, f in weight_map.items() if n not in infos or infos[n].file != f)
        if not_there:
            raise ValueError(f"{store.describe(INDEX_FILE)} lists tensors its shard files lack: "
                             f"{_clip(not_there)}.")
        return infos
    if store.exists(SINGLE_FILE):
        return store.list_tensors(SINGLE_FILE)
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {store.url}; a Hugging Face safetensors checkpoint is expected "
        "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True)).")


def _clip(names: Sequence[str]) -> str:
    names = list(names)
    more = f" ... and {len(names) - _LIST_LIMIT} more" if len(names) > _LIST_LIMIT else ""
    return ", ".join(names[:_LIST_LIMIT]) + more


def check_tensors(cfg: ModelConfig, model: Decoder, infos: dict[str, TensorInfo]) -> None:
    """Raise :class:`CheckpointMismatchError` listing missing, unexpected, misshaped and
    non-floating tensors of the checkpoint against the mapping table for ``cfg``."""
    expected: dict[str, tuple[int, ...]] = {}
    for rule in hf_mapping.table(cfg):
        var = getattr(model, rule.ours)
        per_layer = tuple(var.shape[1:] if rule.stacked else var.shape)
        for name in rule.hf_names(cfg):
            expected[name] = rule.transform.hf_shape(per_layer)
    missing = [n for n in expected if n not in infos]
    unexpected = sorted(n for n in infos if n not in expected and not hf_mapping.ignorable(n, cfg))
    misshaped = [f"{n} {list(infos[n].shape)} (expected {list(expected[n])})"
                 for n in expected if n in infos and tuple(infos[n].shape) != expected[n]]
    bad_dtype = [f"{n} ({infos[n].dtype})" for n in expected if n in infos and infos[n].dtype not in FLOAT_DTYPES]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_clip(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {_clip(unexpected)}")
    if misshaped:
        problems.append(f"misshaped tensors: {_clip(misshaped)}")
    if bad_dtype:
        problems.append(f"non-floating tensors (dequantize first): {_clip(bad_dtype)}")
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint does not match the {cfg.family} config "
            f"(layers={cfg.num_layers}, hidden={cfg.hidden_size}, tied={cfg.tie_word_embeddings}):\n  "
            + "\n  ".join(problems))


def _index_key(idx: tuple[slice, ...], shape: tuple[int, ...]) -> tuple:
    # slices are unhashable before Python 3.12; normalise to (start, stop, step)
    return tuple(s.indices(n) for s, n in zip(idx, shape))


def _build_shard(rule: hf_mapping.TensorRule, store: Storage, infos, shape, idx, dtype):
    """The host buffer of one device shard ``idx`` of the parameter ``rule.ours``."""
    if not rule.stacked:
        w = store.read_tensor(infos[rule.hf])
        return np.asarray(rule.transform.to_ours(w, shape)[idx], dtype=dtype)
    layers = range(*idx[0].indices(shape[0]))
    rest = idx[1:]
    shard_rest = tuple(len(range(*s.indices(n))) for s, n in zip(rest, shape[1:]))
    out = np.empty((len(layers), *shard_rest), dtype)
    for j, i in enumerate(layers):
        w = store.read_tensor(infos[rule.hf.format(i=i)])
        out[j] = rule.transform.to_ours(w, shape[1:])[rest]
        del w
    return out


def _load_param(rule, store, infos, shape, sharding, dtype) -> jax.Array:
    """Assemble one parameter in its target sharding, one distinct shard at a time."""
    idx_map = sharding.addressable_devices_indices_map(shape)
    groups: dict[tuple, tuple[tuple, list]] = {}
    for dev, idx in idx_map.items():
        groups.setdefault(_index_key(idx, shape), (idx, []))[1].append(dev)
    per_device = {}
    for idx, devs in groups.values():
        host = _build_shard(rule, store, infos, shape, idx, dtype)
        for dev in devs:
            per_device[dev] = jax.device_put(host, dev)
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, [per_device[d] for d in idx_map])


def _target_sharding(var, part_rules: Rules | None):
    if part_rules is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return part_rules.sharding(var.get_metadata()["logical_axes"], var.shape)


def from_pretrained(path: str | os.PathLike | Storage, dtype: str = "float32", mesh: jax.sharding.Mesh | None = None,
                    rules: Rules | Sequence | None = None, param_dtype: str | None = None,
                    lora: LoraConfig | None = None, attention_impl: str = "plain",
                    yarn_on_sliding_layers: bool = False, lora_seed: int = 0,
                    **config_overrides: Any) -> Decoder:
    """Load a Hugging Face Qwen3 / Olmo-3 / Llama checkpoint into a :class:`Decoder`.

    Args:
      path: local directory or ``gs://bucket/prefix`` (or a :class:`Storage`) holding
        config.json and model.safetensors (or shards + model.safetensors.index.json), or
        a local ``.gguf`` file (Llama; dequantized to ``param_dtype``, :mod:`models.gguf`).
      dtype: compute dtype; ``param_dtype`` (default: ``dtype``) is the storage dtype.
      mesh: place parameters sharded on this mesh by logical-axis ``rules`` (a rules
        tuple for :class:`Rules`, or a :class:`Rules`; default rules when None). Without a
        mesh, parameters go to the first local device.
      lora: add fresh LoRA adapters (A random with ``lora_seed``, B zero).
      attention_impl: ``"plain"``, ``"causal_plain"``, ``"blockwise"`` or ``"splash"`` (:mod:`models.attention`).
      yarn_on_sliding_layers: Olmo-3: also apply the full-attention YaRN RoPE to sliding
        layers (older transformers behaviour); default is per-layer-type RoPE.
      **config_overrides: further :class:`ModelConfig` fields (remat_policy, scan_layers, ...).

    Returns:
      The model; ``model(input_ids)`` gives logits [batch, seq, vocab].
    """
    store = open_checkpoint(path)
    cfg = hf_config.from_hf_config(
        store.read_json("config.json"), yarn_on_sliding_layers=yarn_on_sliding_layers,
        dtype=dtype, param_dtype=param_dtype or dtype, lora=lora, attention_impl=attention_impl,
        **config_overrides)
    if isinstance(rules, Rules):
        if mesh is not None and rules.mesh is not mesh:
            raise ValueError("pass either a Rules (with its mesh) or a mesh plus a rules tuple, not both.")
        part_rules = rules
    elif mesh is not None:
        part_rules = Rules(mesh, tuple(rules) if rules is not None else DEFAULT_RULES)
    elif rules is not None:
        raise ValueError("`rules` needs a `mesh` (or pass a Rules instance).")
    else:
        part_rules = None

    infos = checkpoint_tensors(store)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), rules=part_rules))
    check_tensors(cfg, model, infos)

    np_dtype = np.dtype(cfg.jnp_param_dtype)
    table = hf_mapping.table(cfg)
    for rule in table:
        var = getattr(model, rule.ours)
        shape = tuple(var.shape)
        arr = _load_param(rule, store, infos, shape, _target_sharding(var, part_rules), np_dtype)
        var.set_value(arr)
    if cfg.lora is not None:
        model.init_lora(nnx.Rngs(lora_seed))
        for _, var in nnx.iter_graph(model):
            if isinstance(var, LoRAParam):
                var.set_value(jax.device_put(var[...], _target_sharding(var, part_rules)))

    filled = {r.ours for r in table}
    for path_, var in nnx.iter_graph(model):
        if isinstance(var, nnx.Param) and not isinstance(var.get_value(), jax.Array):
            name = ".".join(map(str, path_))
            raise RuntimeError(f"parameter {name!r} has no rule in the {cfg.family} mapping table "
                               f"(filled: {sorted(filled)}); extend models/hf_mapping.py.")
    return model


def load_peft_adapter(model: Decoder, path: str | os.PathLike | Storage) -> None:
    """Load a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into the
    LoRA parameters of ``model`` in place, keeping their shardings.

    ``model.cfg.lora`` must match the adapter: same rank, alpha and target modules.
    """
    cfg = model.cfg
    store = path if isinstance(path, Storage) else open_storage(path)
    ac = store.read_json("adapter_config.json")
    if cfg.lora is None:
        raise ValueError("the model has no LoRA parameters; build it with lora=LoraConfig(...) first.")
    if ac.get("peft_type") != "LORA" or ac.get("use_dora") or ac.get("use_rslora"):
        raise ValueError(f"{store.describe('adapter_config.json')}: only plain LoRA adapters are supported "
                         f"(peft_type={ac.get('peft_type')!r}, use_dora, use_rslora must be off).")
    want_modules = {hf_mapping.projection_module(cfg, t).rsplit(".", 1)[-1] for t in cfg.lora.targets}
    got_modules = ac.get("target_modules")
    got_modules = {got_modules} if isinstance(got_modules, str) else set(got_modules or ())
    mismatch = [f"{k}: adapter {a!r} vs model {b!r}" for k, a, b in (
        ("r", ac.get("r"), cfg.lora.rank), ("lora_alpha", ac.get("lora_alpha"), cfg.lora.alpha),
        ("target_modules", sorted(got_modules), sorted(want_modules))) if a != b]
    if mismatch:
        raise ValueError(f"{store.describe('adapter_config.json')} does not match model.cfg.lora: "
                         + "; ".join(mismatch))
    infos = store.list_tensors("adapter_model.safetensors")
    expected = {n for t in cfg.lora.targets for i in range(cfg.num_layers) for n in hf_mapping.peft_names(cfg, t, i)}
    missing, unexpected = sorted(expected - set(infos)), sorted(set(infos) - expected)
    if missing or unexpected:
        raise CheckpointMismatchError(f"adapter tensors do not match: missing {_clip(missing)}; "
                                      f"unexpected {_clip(unexpected)}.")
    for t in cfg.lora.targets:
        a_var, b_var = getattr(model, f"lora_{t}_a"), getattr(model, f"lora_{t}_b")
        a_host = np.empty(a_var.shape, np.dtype(a_var[...].dtype))
        b_host = np.empty(b_var.shape, np.dtype(b_var[...].dtype))
        for i in range(cfg.num_layers):
            name_a, name_b = hf_mapping.peft_names(cfg, t, i)
            a_host[i], b_host[i] = hf_mapping.peft_to_lora(
                store.read_tensor(infos[name_a]), store.read_tensor(infos[name_b]), a_var.shape[1:], b_var.shape[1:])
        a_var.set_value(jax.device_put(a_host, a_var[...].sharding))
        b_var.set_value(jax.device_put(b_host, b_var[...].sharding))

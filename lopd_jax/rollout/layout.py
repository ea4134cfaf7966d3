"""The sampling layout: bf16 weights, tensor-parallel x data-parallel, LoRA merged.

The trainer keeps fp32 master weights sharded FSDP-style (split along ``embed`` over
``fsdp``), which suits the backward pass and not decoding: every decode step would
all-gather each layer's weights. The engine decodes instead on an **inference mesh**
``(data, tensor)`` over the same chips: bf16 weights with the projections split over
``tensor`` along heads / KV heads / MLP, the embedding and LM head along the vocabulary,
norms replicated; the page pool's KV heads over ``tensor`` (:func:`pool_sharding`). Rows
and pages are not split over ``data`` (each ``data`` replica runs every row,
:func:`attention_mesh`): that would need the scheduler to keep an episode's pages and slot
in one data shard, since the kernel path reads shard-local pages.

Once per RL step :func:`local_params` (with :func:`global_merge` when the params span
processes) runs one jitted call from the trainer's params to the engine's: the student
LoRA folded into its base kernels (in fp32), a cast to the sampling dtype and the reshard;
:func:`reshard_cost` gives its bytes and roofline time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from lopd_jax.settings.errors import ConfigError
from models.config import ModelConfig
from models.decoder import Decoder
from models.layer import projection_shapes
from models.lora import merged_weight
from models.partitioning import Rules, split_state, tree_shardings

__all__ = ["INFERENCE_RULES", "ReshardCost", "attention_mesh", "default_tensor", "engine_devices", "global_merge",
           "inference_mesh", "inference_model_config", "inference_shardings", "laid_out", "local_params",
           "merge_lora_cast", "pool_sharding", "replicated_locally", "reshard_cost"]

INFERENCE_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("vocab", "tensor"),
    ("embed", None),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("lora_rank", None),
    ("kv", "tensor"),
    ("latents", None),
    ("act_batch", "data"),
    ("act_seq", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def default_tensor(cfg: ModelConfig, chips: int) -> int:
    """The tensor-parallel width: the largest divisor of ``chips`` that divides the KV
    heads (each chip then holds whole KV heads of the page pool); the rest is ``data``."""
    return math.gcd(chips, cfg.num_kv_heads)


def inference_mesh(devices, tensor: int) -> Mesh:
    """A ``(data, tensor)`` mesh over ``devices`` in their order, Auto axes.

    Pass the training mesh's devices (``train_mesh.devices.flat``): a jitted reshard needs
    its input and output shardings over one device order (TPU rejects two orders), and
    consecutive devices of a topology-aware training mesh are neighbours, which keeps each
    tensor group's collectives local."""
    devices = list(devices)
    if tensor < 1 or len(devices) % tensor:
        raise ValueError(f"inference tensor width {tensor} must divide the {len(devices)} devices")
    grid = np.asarray(devices, dtype=object).reshape(len(devices) // tensor, tensor)
    return Mesh(grid, ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)


def inference_model_config(cfg: ModelConfig, dtype: str = "bfloat16") -> ModelConfig:
    """The engine's model config: no LoRA (merged into the kernels), weights and compute in ``dtype``."""
    return cfg.replace(lora=None, dtype=dtype, param_dtype=dtype)


def inference_shardings(cfg: ModelConfig, mesh: Mesh, dtype: str = "bfloat16"):
    """``(graphdef, abstract params, shardings)`` of the engine's model on ``mesh``."""
    model = nnx.eval_shape(lambda: Decoder(inference_model_config(cfg, dtype), rngs=nnx.Rngs(0)))
    gd, (abstract,), (axes,) = split_state(model)
    return gd, abstract, tree_shardings(abstract, axes, Rules(mesh, INFERENCE_RULES))


def merge_lora_cast(params: dict, cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
    """Trainer params (a pure dict, LoRA factors included when ``cfg.lora``) -> the
    engine's: each LoRA pair folded into its kernel in fp32, the factors dropped,
    every array cast to ``dtype``."""
    out = {k: v for k, v in params.items() if not k.startswith("lora_")}
    if cfg.lora is not None:
        for name in cfg.lora.targets:
            out[name] = merged_weight(params[name].astype(jnp.float32), params[f"lora_{name}_a"],
                                      params[f"lora_{name}_b"], cfg.lora.scale)
    return jax.tree.map(lambda x: x.astype(dtype), out)


def pool_sharding(mesh: Mesh) -> NamedSharding:
    """A page pool [pages, page_size, 2 * KV, hd] on ``mesh``: KV heads over ``tensor`` (each
    chip whole key / value pairs), pages and rows replicated over ``data``."""
    return NamedSharding(mesh, P(None, None, "tensor", None))


def attention_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` as :func:`models.paged_attention.attend` should see it under the engine's
    layout: its ``data`` axis renamed ``replica``, so the kernel's ``shard_map`` splits
    KV heads over ``tensor`` and runs every row on each replica (the pool is not split
    over ``data``; :func:`pool_sharding`)."""
    return Mesh(mesh.devices, ("replica", "tensor"), axis_types=(AxisType.Auto,) * 2)


def engine_devices(cfg: ModelConfig, devices: int, tensor: int, local: Sequence | None = None) -> tuple[list, int]:
    """``(devices, tensor)`` of a process's engine mesh (the ``engine`` section's
    ``devices`` / ``tensor``; 0 = all of ``local``, :func:`default_tensor`): the first
    ``devices`` of ``local`` (this process's devices by default) and the tensor width. A
    :class:`lopd_jax.settings.errors.ConfigError` naming the key when they do not fit."""
    local = list(jax.local_devices() if local is None else local)
    if devices > len(local):
        raise ConfigError(f"engine.devices={devices} but this process has {len(local)} devices; lower it "
                          "(0 = all of them).")
    local = local[:devices or len(local)]
    width = tensor or default_tensor(cfg, len(local))
    if len(local) % width or cfg.num_kv_heads % width:
        raise ConfigError(f"engine.tensor={width} must divide both the engine's {len(local)} devices and the "
                          f"model's {cfg.num_kv_heads} KV heads; use a common divisor, or 0 for the default "
                          f"({default_tensor(cfg, len(local))}).")
    return local, width


def replicated_locally(tree):
    """``tree`` with every array that spans processes replicated by one collective (which
    every process calls) and taken from this process's first copy; the others as they are."""
    leaves = _spanning(tree)
    if not leaves:
        return tree
    rep = NamedSharding(leaves[0].sharding.mesh, P())
    tree = jax.jit(lambda t: t, out_shardings=rep)(tree)
    return jax.tree.map(lambda x: x.addressable_data(0) if isinstance(x, jax.Array) else x, tree)


def laid_out(params, shardings, dtype) -> bool:
    """Whether ``params`` already are engine params: ``shardings``' tree, shardings and ``dtype``."""
    return jax.tree.structure(params) == jax.tree.structure(shardings) and all(
        isinstance(x, jax.Array) and x.sharding == s and x.dtype == dtype
        for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings)))


def _spanning(tree) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_fully_addressable]


def _global_layout(order: list, tensor: int):
    """``(global mesh, this process's (data, tensor) grid)`` for :func:`global_merge`: the
    devices ``order`` as a ``(-1, tensor)`` grid (tensor the minor axis) or, failing that, a
    ``(tensor, -1)`` grid (tensor the major axis; e.g. a trainer's order that interleaves
    the processes), the first in which every process holds the same number of devices in
    each tensor column; its grid keeps each device's column. ``(the first mesh, None)``
    when neither does."""
    n, found = len(order), []
    for minor in (True, False):
        column = (lambda k: k % tensor) if minor else (lambda k: k // (n // tensor))  # noqa: E731
        counts: dict[int, list[int]] = {}
        for k, d in enumerate(order):
            counts.setdefault(d.process_index, [0] * tensor)[column(k)] += 1
        grid = np.asarray(order, dtype=object).reshape((-1, tensor) if minor else (tensor, -1))
        mesh = Mesh(grid, ("data", "tensor") if minor else ("tensor", "data"), axis_types=(AxisType.Auto,) * 2)
        found.append(mesh)
        if all(len(set(c)) == 1 for c in counts.values()):
            mine = jax.process_index()
            cols = [[d for k, d in enumerate(order) if column(k) == j and d.process_index == mine]
                    for j in range(tensor)]
            return mesh, np.asarray(cols, dtype=object).T
    return found[0], None


@functools.lru_cache(maxsize=8)
def _merge_to(cfg: ModelConfig, dtype: str, mesh: Mesh | None, treedef, specs: tuple):
    """``merge_lora_cast`` jitted once per setting; with ``mesh``, its output laid out on it."""
    fn = lambda p: merge_lora_cast(p, cfg, jnp.dtype(dtype))  # noqa: E731
    if mesh is None:
        return jax.jit(fn)
    return jax.jit(fn, out_shardings=jax.tree.unflatten(treedef, [NamedSharding(mesh, s) for s in specs]))


def global_merge(cfg: ModelConfig, order: Sequence, tensor: int, shardings, dtype: str = "bfloat16"):
    """``(merge, grid)``: the one jitted collective that brings trainer params spanning
    processes (over the devices ``order``, the trainer's) to every process's engine, and
    this process's ``(data, tensor)`` device grid for its shards (None: the fallback).

    A jitted call has one device order for its input and output, so ``merge``'s output lies
    over ``order`` itself, arranged as a ``(data, tensor)`` grid in which every process
    holds whole tensor columns' worth of devices (:func:`_global_layout`), in the engine's
    ``shardings``' specs: each chip receives only its merged tensor shard and keeps its
    column. When no such grid exists, ``merge`` replicates its output instead (each chip
    receives everything)."""
    gmesh, grid = _global_layout(list(order), tensor)
    leaves, treedef = jax.tree.flatten(shardings)
    specs = tuple(s.spec for s in leaves) if grid is not None else (P(),) * len(leaves)
    return _merge_to(cfg, dtype, gmesh, treedef, specs), grid


def local_params(params: dict, cfg: ModelConfig, mesh: Mesh, shardings, dtype: str = "bfloat16") -> dict:
    """Trainer params (a pure dict, LoRA factors included when ``cfg.lora``; on any devices)
    -> the engine's on ``mesh`` (this process's local devices) in ``shardings``: LoRA folded
    in, cast to ``dtype`` (:func:`merge_lora_cast`).

    Params on this process's devices are merged where they are and copied to ``mesh``.
    Params spanning processes (FSDP over a pod) take one jitted collective
    (:func:`global_merge`), which every process must call together; each process then
    assembles the shards it received into arrays on its own devices with no copy (a copy on
    the host when ``mesh`` orders them differently, or after the replicated fallback).
    """
    spanning = _spanning(params)
    if not spanning:
        treedef = jax.tree.structure(shardings)
        return jax.device_put(_merge_to(cfg, dtype, None, treedef, ())(params), shardings)
    merge, grid = global_merge(cfg, spanning[0].sharding.mesh.devices.flat, mesh.shape["tensor"], shardings, dtype)
    out = merge(params)
    if grid is None:
        return jax.device_put(jax.tree.map(lambda x: x.addressable_data(0), out), shardings)
    lmesh = Mesh(grid, ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    local = jax.tree.map(
        lambda x, s: jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(lmesh, s.spec), [sh.data for sh in x.addressable_shards]), out, shardings)
    return local if lmesh.devices.tolist() == mesh.devices.tolist() else jax.device_put(local, shardings)


@dataclasses.dataclass(frozen=True)
class ReshardCost:
    """Per chip, per RL step: bytes read (the trainer's fp32 shard + LoRA), written (the
    engine's bf16 shard), received over ICI (the engine's shard less what the chip holds),
    and the roofline time ``max(HBM bytes / HBM bandwidth, ICI bytes / ICI bandwidth)``."""

    hbm_read: float
    hbm_written: float
    ici_received: float
    seconds: float


def reshard_cost(cfg: ModelConfig, chips: int, tensor: int, hbm_bw: float, ici_bw: float,
                 train_bytes_per_param: int = 4, infer_bytes_per_param: int = 2) -> ReshardCost:
    """Analytic cost of the reshard (:func:`global_merge`, :func:`local_params`) on ``chips``
    chips (FSDP over all of them in training; ``tensor``-way tensor parallel in inference), parameters from ``cfg``."""
    n = cfg.num_params()
    lora = 0
    if cfg.lora is not None:
        lora = sum(cfg.num_layers * (math.prod(i) + math.prod(o)) * cfg.lora.rank
                   for name, (i, o, _, _) in projection_shapes(cfg).items() if name in cfg.lora.targets)
    read = (n + lora) * train_bytes_per_param / chips
    written = n * infer_bytes_per_param / tensor
    received = written * (1 - 1 / chips)  # at most 1/chips of its shard is already local
    return ReshardCost(read, written, received, max((read + written) / hbm_bw, received / ici_bw))


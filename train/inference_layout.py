"""The sampling layout: bf16 weights, tensor-parallel x data-parallel, LoRA merged.

The trainer keeps fp32 master weights sharded FSDP-style (every matrix split along
``embed`` over the ``fsdp`` axis), which suits the backward pass and not decoding: every
decode step would all-gather each layer's weights. The engine decodes instead on an
**inference mesh** ``(data, tensor)`` over the same chips:

* weights in bf16, the projections split over ``tensor`` along heads / KV heads / MLP
  (columns of q, k, v, gate, up; rows of o, down), the embedding and LM head along the
  vocabulary, norms replicated; replicated over ``data``;
* decode rows (slots) and KV pages over ``data``, KV heads of the page pool over
  ``tensor`` (:func:`models.paged_attention.attend`).

Once per RL step :func:`make_reshard` builds one jitted call from the trainer's params
(in its shardings) to the engine's: the student LoRA folded into its base kernels
(:func:`models.lora.merged_weight`, in fp32), a cast to bf16, and the reshard (XLA's
collectives). :func:`reshard_cost` gives its bytes and roofline time.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from models.config import ModelConfig
from models.decoder import Decoder, projection_shapes
from models.lora import merged_weight
from models.partitioning import Rules
from train.mesh import split_state, tree_shardings

__all__ = ["INFERENCE_RULES", "ReshardCost", "inference_mesh", "inference_model_config", "inference_shardings",
           "default_tensor", "make_reshard", "merge_lora_cast", "reshard_cost"]

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


def make_reshard(cfg: ModelConfig, train_shardings, mesh: Mesh, dtype: str = "bfloat16"):
    """``(reshard, graphdef, shardings)``: ``reshard(params)`` is one jitted call from the
    trainer's params (in ``train_shardings``) to the engine's bf16 merged params on the
    inference ``mesh``; ``graphdef`` rebuilds the engine's model with ``nnx.merge``."""
    gd, _, out_sh = inference_shardings(cfg, mesh, dtype)
    fn = jax.jit(lambda p: merge_lora_cast(p, cfg, jnp.dtype(dtype)), in_shardings=(train_shardings,),
                 out_shardings=out_sh)
    return fn, gd, out_sh


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
    """Analytic cost of :func:`make_reshard` on ``chips`` chips (FSDP over all of them in
    training; ``tensor``-way tensor parallel in inference), parameters from ``cfg``."""
    n = cfg.num_params()
    lora = 0
    if cfg.lora is not None:
        lora = sum(cfg.num_layers * (math.prod(i) + math.prod(o)) * cfg.lora.rank
                   for name, (i, o, _, _) in projection_shapes(cfg).items() if name in cfg.lora.targets)
    read = (n + lora) * train_bytes_per_param / chips
    written = n * infer_bytes_per_param / tensor
    received = written * (1 - 1 / chips)  # at most 1/chips of its shard is already local
    return ReshardCost(read, written, received, max((read + written) / hbm_bw, received / ici_bw))


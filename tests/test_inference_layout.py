"""The sampling layout (train/inference_layout.py): the trainer's FSDP fp32 params with a
trained LoRA, resharded in one jitted call to bf16 merged weights on a data x tensor mesh
of 8 CPU devices, give the training layout's logits within bf16 tolerance."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from models.config import LoraConfig, named_config
from models.decoder import Decoder
from lopd_jax.settings.sections import MeshConfig
from train import mesh as mesh_lib
from train.inference_layout import (default_tensor, inference_mesh, make_reshard, merge_lora_cast,
                                    reshard_cost)


def _trained_student():
    """tiny_qwen3 in fp32 with a LoRA whose B factors are non-zero (a trained adapter)."""
    cfg = named_config("tiny_qwen3", dtype="float32", param_dtype="float32").replace(
        lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "gate", "down")))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    for name in cfg.lora.targets:
        b = getattr(model, f"lora_{name}_b")
        b.set_value(0.05 * jax.random.normal(jax.random.key(hash(name) % 1000), b[...].shape))
    return cfg, model


def test_reshard_gives_the_training_logits_in_bf16():
    cfg, model = _trained_student()
    train_mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    rules = mesh_lib.rules_for(train_mesh)
    _, (params,), (axes,) = mesh_lib.split_state(model)
    train_sh = mesh_lib.tree_shardings(params, axes, rules)
    params = mesh_lib.put(params, train_sh)
    ids = jax.random.randint(jax.random.key(1), (4, 12), 1, cfg.vocab_size)
    ref = nnx.jit(lambda m, x: m(x, lora=True))(model, ids).astype(jnp.float32)

    mesh = inference_mesh(train_mesh.devices.flat, tensor=2)
    reshard, gd, out_sh = make_reshard(cfg, train_sh, mesh)
    infer = reshard(params)
    assert reshard(params) is not None and reshard._cache_size() == 1  # one compiled call, reused
    assert not any(k.startswith("lora_") for k in infer)
    for k, x in infer.items():
        assert x.dtype == jnp.bfloat16 and x.sharding == out_sh[k], k
    assert infer["q"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)  # heads split
    assert infer["gate"].sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor")  # MLP split
    assert infer["down"].sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)

    logits = jax.jit(lambda p, x: nnx.merge(gd, p)(x).astype(jnp.float32))  # one compile for both calls
    out = logits(infer, ids)
    scale = float(jnp.abs(ref).max())
    err = float(jnp.abs(out - ref).max())
    assert err < 2e-2 * scale, (err, scale)
    # the LoRA really is in the merged weights: without it the logits are further away
    plain = merge_lora_cast({k: v for k, v in params.items()}, cfg.replace(lora=None))
    off = logits(jax.device_put(plain, out_sh), ids)
    assert float(jnp.abs(off - ref).max()) > 3 * err


def test_tensor_width_and_reshard_cost():
    q8 = named_config("qwen3_8b")
    assert default_tensor(q8, 16) == 8 and default_tensor(q8, 4) == 4
    with pytest.raises(ValueError, match="must divide the 8 devices"):
        inference_mesh(jax.devices(), tensor=3)
    c = reshard_cost(q8, chips=16, tensor=8, hbm_bw=2.76e12, ici_bw=600e9)
    n = q8.num_params()
    assert c.hbm_read == pytest.approx(4 * n / 16) and c.hbm_written == pytest.approx(2 * n / 8)
    assert c.ici_received == pytest.approx(c.hbm_written * 15 / 16)
    assert c.seconds == pytest.approx(max((c.hbm_read + c.hbm_written) / 2.76e12, c.ici_received / 600e9))

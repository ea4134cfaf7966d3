"""The sampling layout (lopd_jax/rollout/layout.py): the trainer's FSDP fp32 params with a
trained LoRA, resharded in one jitted call to bf16 merged weights on a data x tensor mesh
of 8 CPU devices, give the training layout's logits within bf16 tolerance."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from models.config import LoraConfig, named_config
from models.decoder import Decoder
from lopd_jax.settings.sections import MeshConfig
from train import mesh as mesh_lib
from models.partitioning import split_state, tree_shardings
from lopd_jax.rollout import layout as inference_layout
from lopd_jax.rollout.layout import (default_tensor, inference_mesh, inference_shardings, local_params,
                                    merge_lora_cast, reshard_cost)
from tests.paths import ROOT


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
    _, (params,), (axes,) = split_state(model)
    train_sh = tree_shardings(params, axes, rules)
    params = mesh_lib.put(params, train_sh)
    ids = jax.random.randint(jax.random.key(1), (4, 12), 1, cfg.vocab_size)
    ref = nnx.jit(lambda m, x: m(x, lora=True))(model, ids).astype(jnp.float32)

    mesh = inference_mesh(train_mesh.devices.flat, tensor=2)
    gd, _, out_sh = inference_shardings(cfg, mesh)
    infer = local_params(params, cfg, mesh, out_sh)
    assert local_params(params, cfg, mesh, out_sh) is not None
    merge = inference_layout._merge_to(cfg, "bfloat16", None, jax.tree.structure(out_sh), ())
    assert merge._cache_size() == 1  # one compiled call, reused by the second RL step
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


_LAYOUT_PROBE = """
from lopd_jax.io.startup import configure_platform
configure_platform()
import json
from lopd_jax.programs.compile_check import topology_devices
from lopd_jax.settings.sections import MeshConfig
from configs import load_config
from train import mesh as mesh_lib
from lopd_jax.rollout.layout import _global_layout
devices, _, _ = topology_devices("v5p-32")
out = {}
for name, mesh in (("config", load_config("qwen3_8b").mesh), ("fsdp_only", MeshConfig(data=1, fsdp=-1, tensor=1))):
    order = list(mesh_lib.make_mesh(mesh, devices).devices.flat)
    gmesh, grid = _global_layout(order, 4)
    col = {d: j for j in range(4) for d in gmesh.devices.take(j, axis=list(gmesh.axis_names).index("tensor")).flat}
    out[name] = {"procs": [d.process_index for d in order], "axes": list(gmesh.axis_names),
                 "grid": [[d.process_index, col[d]] for d in grid.flat], "same_order": list(gmesh.devices.flat) == order}
print(json.dumps(out))
"""


@pytest.mark.process
def test_the_reshard_to_each_host_sends_each_chip_its_tensor_shard_on_v5p_32():
    """Every host holds one chip per tensor column of the merged params' global layout, so it
    receives only tensor shards (not a replicated copy), for both trainer layouts of v5p-32:
    the config's fsdp x tensor 4 (each host's 4 chips a tensor group: tensor the minor axis)
    and FSDP alone, whose device order interleaves the 4 hosts (position k on host k mod 4:
    tensor the major axis)."""
    pytest.importorskip("libtpu")
    root = ROOT
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="", PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", _LAYOUT_PROBE], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    config, fsdp = r["config"], r["fsdp_only"]
    assert config["procs"] == [k // 4 for k in range(16)] and config["axes"] == ["data", "tensor"]
    assert fsdp["procs"] == [k % 4 for k in range(16)] and fsdp["axes"] == ["tensor", "data"]
    for layout in (config, fsdp):
        assert layout["same_order"]
        assert layout["grid"] == [[0, j] for j in range(4)]  # host 0's chips, one per tensor column, in column order

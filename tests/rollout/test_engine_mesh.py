"""The engine on its inference layout (lopd_jax/rollout/engine.py, lopd_jax/rollout/layout.py): a
rollout on a 2 x 2 (data x tensor) mesh of CPU devices, from FSDP-sharded fp32 training
params with a trained LoRA, gives one device's greedy tokens and log-probs (within 1e-5)
and the same sampled trajectories, with more episodes than slots and several turns; the
weights and page pools are split over ``tensor``; a bad ``engine.tensor`` is refused."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from lopd_jax.settings.errors import ConfigError
from models.config import LoraConfig, named_config
from models.decoder import Decoder
from train import mesh as mesh_lib
from models.partitioning import split_state, tree_shardings
from lopd_jax.rollout.engine import Engine
from lopd_jax.rollout.episode_spec import EpisodeSpec
from lopd_jax.settings.sections import EngineConfig, SamplingParams

STOPS = (0, 17)
OBS = [[50, 51], [52], [53, 54, 55]]


@pytest.fixture(scope="module")
def student():
    """tiny_qwen3 (GQA: 4 heads, 2 KV heads) in fp32 with a trained LoRA, its params FSDP-
    sharded over the 8 devices as the trainer holds them."""
    cfg = named_config("tiny_qwen3", dtype="float32", param_dtype="float32").replace(
        lora=LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "gate", "down")))
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    for i, name in enumerate(cfg.lora.targets):
        b = getattr(model, f"lora_{name}_b")
        b.set_value(0.05 * jax.random.normal(jax.random.key(i), b[...].shape))
    train_mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(data=1, fsdp=8, tensor=1))
    _, (params,), (axes,) = split_state(model)
    params = mesh_lib.put(params, tree_shardings(params, axes, mesh_lib.rules_for(train_mesh)))
    assert len(params["q"].sharding.device_set) == 8
    return model, params


def _specs(n=5):
    """``n`` episodes (more than the 2 slots), 1 to 3 turns each, per-turn caps ending turns
    mid-chunk."""
    rs = np.random.RandomState(1)

    def scripted(turns):
        state = {"t": 0}

        def step(ids, lps, raws):
            state["t"] += 1
            return None if state["t"] >= turns else OBS[state["t"] - 1]
        return step
    return [EpisodeSpec(rs.randint(2, 500, size=rs.randint(2, 14)).tolist(), 64, 4 + i % 5, scripted(1 + i % 3))
            for i in range(n)]


def _engine(model, devices, tensor, sampling):
    return Engine(model, stop_ids=STOPS, lora=True, sampling=sampling,
                  config=EngineConfig(slots=2, page_size=8, decode_chunk=3, prefill_chunk=8, env_workers=0,
                                      devices=devices, tensor=tensor))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_2x2_mesh_samples_what_one_device_samples(student, temperature):
    model, params = student
    sampling = SamplingParams(temperature=temperature, top_p=1.0, top_k=0)
    one, four = _engine(model, 1, 1, sampling), _engine(model, 4, 2, sampling)
    assert dict(four.mesh.shape) == {"data": 2, "tensor": 2} and dict(one.mesh.shape) == {"data": 1, "tensor": 1}
    local = four.local_params(params)
    assert local["q"].sharding.spec == P(None, None, "tensor", None) and len(local["q"].sharding.device_set) == 4
    assert not any(k.startswith("lora_") for k in local) and four.local_params(local) is local
    a = one.run(one.local_params(params), _specs(), jax.random.key(3))
    b = four.run(local, _specs(), jax.random.key(3))
    assert four.metrics["prefill_calls"] >= 3 and any(len(r.turns) > 1 for r in a)
    for x, y in zip(a, b):
        assert [t.tolist() for t in x.turns] == [t.tolist() for t in y.turns] and x.context == y.context
        for u, v in zip(x.logprobs + x.raw_logprobs, y.logprobs + y.raw_logprobs):
            np.testing.assert_allclose(u, v, atol=1e-5)
    # the pools the engine decodes on: KV heads over tensor, on the mesh's 4 devices
    pool = four._empty_pools(4)[0]
    assert pool.sharding.spec == P(None, None, "tensor", None) and len(pool.sharding.device_set) == 4
    if temperature == 0.0:  # the LoRA is really on: without it the greedy tokens differ
        plain = Engine(model, stop_ids=STOPS, sampling=sampling, config=one.config)
        c = plain.run(plain.local_params(params), _specs(), jax.random.key(3))
        assert any(x.context != y.context for x, y in zip(a, c))


def test_a_tensor_width_that_does_not_fit_is_refused(student):
    model, _ = student
    with pytest.raises(ConfigError, match=r"engine.tensor=3 must divide both the engine's 4 devices"):
        _engine(model, 4, 3, SamplingParams())
    with pytest.raises(ConfigError, match=r"engine.tensor=4 .* model's 2 KV heads.*default \(2\)"):
        _engine(model, 4, 4, SamplingParams())
    with pytest.raises(ConfigError, match=r"engine.devices=16 but this process has 8 devices"):
        _engine(model, 16, 0, SamplingParams())
    with pytest.raises(ConfigError, match="engine.dtype='float16'"):
        EngineConfig(dtype="float16")
    assert dict(_engine(model, 0, 0, SamplingParams()).mesh.shape) == {"data": 4, "tensor": 2}

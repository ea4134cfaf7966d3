"""The length-bucketed warm-up (SFT) step equals the padded one on the same rows: loss,
metrics and every gradient within 1e-5 relative (fp32), on one device (the fused head + NLL,
:func:`lopd_jax.method.linear_nll.weighted_linear_nll`, normalised by the whole batch's weight) and
on a 2-device mesh (the chunked head); then the whole step is one update on the sums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lopd_jax.settings.config import StagesSection
from tests.train.test_length_buckets import B, BUCKETS, COMPOSER, LAYOUT, SHARD_TOKENS, _backbone, _batch, _close_trees
from train import mesh as mesh_lib
from train.bucketed_steps import bucketed_batch
from train.system import LOPDSystem
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.settings.sections import MeshConfig, StepConfig
from train.warmup import BucketedSFTStep, make_sft_step, sft_loss, sft_state_shardings

HINT_WEIGHT = 3.0  # stages.warmup_hint_token_weight on some tokens: the loss is a weighted token mean


def _sft_batch():
    """Rows of every bucket (lengths 32, 7, 18, 12, 27, 9, 20, 5; row 5 unsupervised), with
    hint-weighted tokens in two rows."""
    b = _batch(1)
    mask = b["loss_mask"].copy()
    mask[0, 10:14] *= HINT_WEIGHT
    mask[2, 6:9] *= HINT_WEIGHT
    return {"tokens": b["tokens"], "attention_mask": b["attention_mask"], "loss_mask": mask}


def _opt_state(system):
    theta0, lora0, _ = system.initial_params()
    keys = iter(jax.random.split(jax.random.key(3), 64))
    params = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(next(keys), x.shape), theta0)
    return params, lora0


def _pass_sums(system, params, lora0, bb):
    """Summed (loss, grads) of :func:`sft_loss` over the passes, each with the batch's totals."""
    fn = jax.jit(jax.value_and_grad(lambda p, mb, t: sft_loss(system, p, lora0, mb, t), has_aux=True))
    totals = {"weight": jnp.float32(bb.stats["weight"]), "tokens": jnp.float32(bb.stats["supervised"])}
    loss, grads = 0.0, None
    for mb in bb.passes:
        (l, _), g = fn(params, mb, totals)
        loss = loss + l
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    return loss, grads


@pytest.fixture(scope="module")
def padded():
    """One-device system, params, LoRA, the batch and the padded loss, metrics and gradients."""
    system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, StepConfig(loss=LossConfig(logits_chunk=8)))
    params, lora0 = _opt_state(system)
    np_batch = _sft_batch()
    batch = {k: jnp.asarray(v) for k, v in np_batch.items()}
    (loss, metrics), grads = jax.jit(jax.value_and_grad(lambda p: sft_loss(system, p, lora0, batch),
                                                        has_aux=True))(params)
    assert float(metrics["tokens"]) > 0 and float(loss) > 0
    return system, params, lora0, np_batch, loss, metrics, grads


def _check_metrics(got, want):
    for k in ("nll", "tokens"):
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, err_msg=k)


def test_bucketed_warmup_equals_padded(padded):
    """Fused path: the passes' loss, metrics and gradients == the padded batch's; the whole
    step (AdamW on the summed gradients) == the padded step's update on its gradients."""
    system, params, lora0, np_batch, want_loss, want_m, want_g = padded
    bb = bucketed_batch(np_batch, BUCKETS, SHARD_TOKENS, 3)  # 3 "shards" on one device: a padding row
    assert [p.seq for p in bb.plan] == [32, 20] and min(bb.plan[-1].rows) < 0 and bb.padded_tokens() < B * 32
    bb = bb.put(system)
    loss, grads = _pass_sums(system, params, lora0, bb)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _close_trees(grads, want_g)

    opt, _ = make_sft_step(system, _stages())
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt": opt.init(params)}
    step = BucketedSFTStep(system, state, opt)
    acc = step.accumulate(state, lora0, bb)
    _check_metrics(acc["metrics"], want_m)
    _close_trees(acc["grads"][0], want_g)
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (the steps donate their state)
    s1, m1 = step._update_jit(copy(state), {"grads": (want_g,), "metrics": dict(want_m)}, {})
    s2, m2 = step(copy(state), lora0, bb)
    _check_metrics(m2, m1)
    np.testing.assert_allclose(float(m2["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
    _close_trees(s2["params"], s1["params"], tol=1e-4)  # Adam's per-element scaling (test_length_buckets_text)
    assert int(s2["step"]) == 1


def test_bucketed_warmup_sharded_equals_padded(padded):
    """Chunked path (2-device mesh, batch shards of 1 row per pass and shard): the same sums."""
    _, params, lora0, np_batch, want_loss, want_m, want_g = padded
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=2, tensor=1), jax.devices()[:2])
    system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, StepConfig(loss=LossConfig(logits_chunk=8)),
                               rules=mesh_lib.rules_for(mesh))
    bb = bucketed_batch(np_batch, BUCKETS, SHARD_TOKENS, 2)
    assert all(len(p.rows) % 2 == 0 for p in bb.plan) and len({p.seq for p in bb.plan}) == 2
    opt, _ = make_sft_step(system, _stages())
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt": opt.init(params)}
    state = mesh_lib.put(state, sft_state_shardings(system, opt, state))
    lora0 = mesh_lib.put(lora0, system.composer_shardings()["lora"])
    bb = bb.put(system)
    loss, grads = _pass_sums(system, state["params"], lora0, bb)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _close_trees(jax.device_get(grads), want_g)
    acc = jax.device_get(BucketedSFTStep(system, state, opt).accumulate(state, lora0, bb))
    _check_metrics(acc["metrics"], want_m)
    _close_trees(acc["grads"][0], want_g)


def _stages():
    return StagesSection(warmup_steps=4, warmup_lr=1e-3)

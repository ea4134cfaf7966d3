"""What the margin is doing, per LOPD step: Delta against the teacher without latents and
each loss term's share of the composer's gradient, against separate jax.grad references."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lopd_jax.method import losses
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.settings.sections import StepConfig
from tests.train.test_lopd_step import COMPOSER, LAYOUT, _backbone, _batch
from train.steps import grad_shares, lopd_grads, lopd_loss, make_lopd_step
from train.system import LOPDSystem

SHARES = ("composer_grad_share_distill", "composer_grad_share_margin", "composer_grad_share_anchor")


def _state(system):
    state, frozen = system.init_state()
    state = dict(state)
    state["beta"] = jnp.float32(0.7)  # a live margin term
    noise = jax.random.split(jax.random.key(5), len(jax.tree.leaves(state["composer"])))
    leaves, tree = jax.tree.flatten(state["composer"])  # phi != phi0: a live anchor term
    state["composer"] = jax.tree.unflatten(tree, [x + 0.02 * jax.random.normal(k, x.shape, x.dtype)
                                                  for x, k in zip(leaves, noise)])
    return state, frozen


@pytest.fixture(scope="module")
def setup():
    cfg = StepConfig(loss=LossConfig(logits_chunk=8, top_m=5), student_lr=1e-3, composer_lr=1e-3)
    system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, cfg)
    state, frozen = _state(system)
    batch = {k: jnp.asarray(v) for k, v in _batch().items()}
    return system, state, frozen, batch


def test_shares_match_separate_gradients(setup):
    system, state, frozen, batch = setup
    rng = jax.random.key(1)
    fn = lambda sp, cp: lopd_loss(system, sp, cp, state, frozen, batch, rng)  # noqa: E731
    metrics, grads, per_term = lopd_grads(fn, state["student"], state["composer"], True)
    got = grad_shares(grads[1], per_term)
    ref_grads = [jax.grad(lambda cp, k=k: fn(state["student"], cp)[1]["loss_terms"][k])(state["composer"])
                 for k in range(3)]
    norms = np.array([float(optax.global_norm(g)) for g in ref_grads])
    assert np.all(norms > 0)
    np.testing.assert_allclose([float(got[k]) for k in SHARES], norms / norms.sum(), rtol=1e-4, atol=1e-6)
    total = jax.grad(lambda cp: fn(state["student"], cp)[0])(state["composer"])
    for a, b in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(total)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    beta_m = float(state["beta"]) * system.step_cfg.loss.margin
    assert float(jnp.sum(metrics["loss_terms"])) + beta_m == pytest.approx(float(metrics["loss"]), rel=1e-5)


def test_delta_vs_plain_teacher_is_delta_with_the_slots_masked(setup):
    system, state, frozen, batch = setup
    _, metrics = lopd_loss(system, state["student"], state["composer"], state, frozen, batch, jax.random.key(1))
    from lopd_jax.method.composer import slot_mask
    from lopd_jax.method.losses_kl import chunked_token_logp
    from lopd_jax.method.splice import teacher_hidden_states
    teacher = system.backbone(frozen, state["composer"]["lora"])
    lat = system.latents(frozen, state["composer"], batch["exp_tokens"], batch["exp_mask"], jax.random.key(1))
    tok, am = batch["tokens"], batch["attention_mask"].astype(bool)

    def logp(mask_exp):
        h = teacher_hidden_states(teacher, tok, am, batch["insert_at"], lat, LAYOUT, slot_mask(mask_exp, 3))
        return chunked_token_logp(h[:, :-1], teacher.lm_head_kernel(), tok[:, 1:], chunk_size=8)

    mask = batch["loss_mask"][:, 1:]
    adv = losses.advantages_from_rewards(batch["rewards"])
    ref = losses.privilege_delta(logp(batch["exp_mask"]), logp(jnp.zeros_like(batch["exp_mask"])), mask, adv)[0]
    assert float(metrics["delta_vs_plain_teacher"]) == pytest.approx(float(ref), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("micro_batch", [0, 2])
def test_lopd_step_logs_the_margin_metrics(setup, micro_batch):
    system, state, frozen, batch = setup
    if micro_batch:
        system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT,
                                   dataclasses.replace(system.step_cfg, micro_batch=micro_batch))
    step = make_lopd_step(system, state, batch)
    _, m = step(jax.tree.map(jnp.copy, state), frozen, batch)
    m = jax.tree.map(np.asarray, m)
    for k in ("delta", "delta_vs_plain_teacher", "beta", *SHARES):
        assert np.ndim(m[k]) == 0 and np.isfinite(m[k]), k
    assert sum(float(m[k]) for k in SHARES) == pytest.approx(1.0, abs=1e-5)
    assert all(float(m[k]) > 0 for k in SHARES)
    assert "loss_terms" not in m

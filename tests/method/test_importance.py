"""Importance correction for stale samples (steps.is_correction): the weights against a NumPy
reference (token and sequence level, tis and mis, masked tokens, an empty rollout), the
settings, ``none`` untouched by the behaviour log-probs, on-policy samples (weight 1) giving
the uncorrected losses, and packed passes with ``tis`` equal to the padded step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import load_config
from lopd_jax.method import importance, losses
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.method.losses_kl import chunked_token_logp
from lopd_jax.settings.errors import ConfigError
from lopd_jax.settings.overrides import apply_overrides
from lopd_jax.settings.sections import StepConfig
from tests.train.test_length_buckets import COMPOSER, LAYOUT, _backbone, _batch, _check_lopd, _close_trees
from tests.train.test_packing import _pack
from train.bucketed_steps import BucketedGRPOStep, BucketedLOPDStep, with_group_advantages
from train.steps import grpo_loss, lopd_loss
from train.system import LOPDSystem

CAP = 1.5

# ----------------------------------------------------------------------------- weights vs NumPy


def _ref_weights(log_r, correction, cap):
    r = np.exp(log_r)
    if correction == "tis":
        return np.minimum(r, cap), (r > cap).astype(np.float64)
    keep = ((r >= 1.0 / cap) & (r <= cap)).astype(np.float64)
    return keep, 1.0 - keep


def _ref(logp, old, mask, correction, cap, level):
    """NumPy weights and metrics (float64)."""
    m = mask > 0
    with np.errstate(invalid="ignore"):
        lr = np.where(m, logp.astype(np.float64) - old, 0.0)
    N = m.sum()
    flag = "is_clipped_fraction" if correction == "tis" else "is_masked_fraction"
    if level == "token":
        w, f = _ref_weights(lr, correction, cap)
        return w, {"is_weight_mean": (w * m).sum() / N, flag: (f * m).sum() / N, "is_log_ratio_mean": lr[m].sum() / N}
    n = m.sum(1)
    seq = lr.sum(1) / np.maximum(n, 1)
    w, f = _ref_weights(seq, correction, cap)
    has = n > 0
    return w, {"is_weight_mean": (w * n).sum() / N, flag: f[has].sum() / has.sum(),
               "is_log_ratio_mean": lr[m].sum() / N}


def _random_inputs(seed=0):
    """[6, 11] log-probs around -2 with per-row shifts (ratios both sides of the cap), NaN /
    inf on masked tokens, row 4 without a supervised token."""
    rng = np.random.RandomState(seed)
    shape = (6, 11)
    old = -2.0 + 0.3 * rng.standard_normal(shape)
    logp = old + np.array([0.0, 0.8, -0.9, 0.3, 5.0, -0.2])[:, None] + 0.4 * rng.standard_normal(shape)
    mask = (rng.uniform(size=shape) < 0.7).astype(np.float32)
    mask[4] = 0.0
    logp = np.where(mask > 0, logp, np.nan)
    old = np.where(mask > 0, old, -np.inf)
    return logp.astype(np.float32), old.astype(np.float32), mask


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_token_weights_match_numpy(correction):
    logp, old, mask = _random_inputs()
    w, metrics = importance.token_weights(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mask), correction, CAP)
    want_w, want_m = _ref(logp, old, mask, correction, CAP, "token")
    np.testing.assert_allclose(np.asarray(w)[mask > 0], want_w[mask > 0], rtol=1e-5)
    assert (np.asarray(w)[mask == 0] == 1.0).all()  # off the mask: weight 1, never NaN
    assert set(metrics) == set(want_m)
    for k, v in want_m.items():
        np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-5, err_msg=k)
    flag = "is_clipped_fraction" if correction == "tis" else "is_masked_fraction"
    assert 0 < float(metrics[flag]) < 1  # both kinds of token present
    # with the whole batch's token count: the same share of a larger mean
    _, share = importance.token_weights(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mask), correction, CAP,
                                        jnp.float32(3 * mask.sum()))
    np.testing.assert_allclose(float(share["is_weight_mean"]), want_m["is_weight_mean"] / 3, rtol=1e-5)


@pytest.mark.parametrize("correction", ["tis", "mis"])
def test_sequence_weights_match_numpy(correction):
    logp, old, mask = _random_inputs(1)
    w, metrics = importance.sequence_weights(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mask), correction, CAP)
    want_w, want_m = _ref(logp, old, mask, correction, CAP, "sequence")
    np.testing.assert_allclose(np.asarray(w), want_w, rtol=1e-5)
    assert float(w[4]) == 1.0  # the empty rollout: weight 1, and not counted below
    for k, v in want_m.items():
        np.testing.assert_allclose(float(metrics[k]), v, rtol=1e-5, err_msg=k)
    flag = "is_clipped_fraction" if correction == "tis" else "is_masked_fraction"
    assert 0 < float(metrics[flag]) < 1
    _, share = importance.sequence_weights(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mask), correction, CAP,
                                           jnp.float32(mask.sum()), jnp.float32(10.0))
    np.testing.assert_allclose(float(share[flag]), want_m[flag] * 5 / 10, rtol=1e-5)  # 5 rollouts of 10


def test_weighted_kl_scales_each_rollout_and_needs_old_logp():
    logp, old, mask = _random_inputs(2)
    kl = np.abs(np.random.RandomState(3).standard_normal(mask.shape)).astype(np.float32)
    tis = LossConfig(is_correction="tis", is_cap=CAP)
    got, _ = importance.weighted_kl(jnp.asarray(kl), jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mask), tis)
    want_w, _ = _ref(logp, old, mask, "tis", CAP, "sequence")
    np.testing.assert_allclose(np.asarray(got)[mask > 0], (kl * want_w[:, None])[mask > 0], rtol=1e-5)
    same, extra = importance.weighted_kl(jnp.asarray(kl), jnp.asarray(logp), None, jnp.asarray(mask), LossConfig())
    assert extra == {} and np.array_equal(np.asarray(same), kl)
    with pytest.raises(ValueError, match="old_logp.*is_correction=none"):
        importance.weighted_kl(jnp.asarray(kl), jnp.asarray(logp), None, jnp.asarray(mask), tis)


def test_settings_are_validated():
    cfg = apply_overrides(load_config("tiny"), ["steps.is_correction=mis", "steps.is_cap=3"])
    assert (cfg.steps.loss.is_correction, cfg.steps.loss.is_cap) == ("mis", 3.0)
    assert LossConfig().is_correction == "none" and LossConfig().is_cap == 2.0
    for bad in (["steps.is_correction=ppo"], ["steps.is_cap=1"], ["steps.is_cap=inf"],
                ["arm=grpo", "arms.grpo_epochs=2", "steps.is_correction=tis"]):
        with pytest.raises(ConfigError):
            apply_overrides(load_config("tiny"), bad)


# ----------------------------------------------------------------------------- the LOPD loss from stats


def _stats(seed=0):
    rng = np.random.RandomState(seed)
    _, _, mask = _random_inputs(seed)
    shape = mask.shape
    stats = {"kl": np.abs(rng.standard_normal(shape)), "student_logp": -2.0 + 0.5 * rng.standard_normal(shape),
             "teacher_logp": -2.0 + 0.5 * rng.standard_normal(shape)}
    return {k: jnp.asarray(v, jnp.float32) for k, v in stats.items()}, jnp.asarray(mask), \
        jnp.asarray(rng.uniform(-1, 1, shape[0]), jnp.float32)


def test_lopd_loss_from_stats_on_policy_weights_are_one():
    """old_logp == the student's log-probs: ``tis`` / ``mis`` give ``none``'s loss and KL
    gradient exactly, with weight mean 1; Delta is never weighted."""
    stats, mask, adv = _stats()

    def run(loss_cfg, old):
        f = lambda kl: losses.lopd_loss_from_stats({**stats, "kl": kl}, mask, adv, 0.7, loss=loss_cfg,  # noqa: E731
                                                   old_logp=old)
        return jax.value_and_grad(f, has_aux=True)(stats["kl"])

    (want, want_m), want_g = run(LossConfig(), None)
    (same, same_m), same_g = run(LossConfig(), stats["student_logp"] - 1.0)  # none ignores old_logp
    assert float(same) == float(want) and np.array_equal(same_g, want_g) and set(same_m) == set(want_m)
    for corr in ("tis", "mis"):
        (got, got_m), got_g = run(LossConfig(is_correction=corr), stats["student_logp"])
        assert float(got) == float(want) and np.array_equal(got_g, want_g)
        assert float(got_m["is_weight_mean"]) == 1.0 and float(got_m["is_log_ratio_mean"]) == 0.0
        assert set(got_m) - set(want_m) == {"is_weight_mean", "is_log_ratio_mean",
                                            "is_clipped_fraction" if corr == "tis" else "is_masked_fraction"}
    # stale samples: the KL gradient is w_i / N per token, Delta and the logp gap unchanged
    old = stats["student_logp"] - jnp.asarray(np.linspace(-1, 1, mask.shape[0]), jnp.float32)[:, None]
    (_, m), g = run(LossConfig(is_correction="tis", is_cap=CAP), old)
    w, _ = _ref(np.asarray(stats["student_logp"]), np.asarray(old), np.asarray(mask), "tis", CAP, "sequence")
    np.testing.assert_allclose(np.asarray(g), np.asarray(mask) * w[:, None] / float(mask.sum()), rtol=1e-5)
    for k in ("delta", "teacher_student_logp_gap", "delta_per_rollout"):
        np.testing.assert_array_equal(np.asarray(m[k]), np.asarray(want_m[k]), err_msg=k)
    with pytest.raises(ValueError, match="old_logp"):
        run(LossConfig(is_correction="mis"), None)


# ----------------------------------------------------------------------------- the steps on a tiny model


def _system(correction="none"):
    return LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, StepConfig(loss=LossConfig(
        logits_chunk=8, top_m=5, is_correction=correction, is_cap=CAP)))


@functools.lru_cache(maxsize=None)
def _steps(correction="none"):
    """``(system, lopd, grpo)``: the system of ``correction`` and its jitted padded LOPD and
    GRPO ``(state, frozen, batch) -> (grads, metrics)`` (one per correction: compiled once)."""
    system = _system(correction)

    def lopd(state, frozen, batch):
        _, sub = jax.random.split(state["rng"])
        fn = lambda sp, cp: lopd_loss(system, sp, cp, state, frozen, batch, sub)  # noqa: E731
        (_, m), g = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(state["student"], state["composer"])
        return g, m

    def grpo(state, frozen, batch):
        (_, m), g = jax.value_and_grad(lambda sp: grpo_loss(system, sp, state, frozen, batch, 4),
                                       has_aux=True)(state["student"])
        return g, m

    return system, jax.jit(lopd), jax.jit(grpo)


@pytest.fixture(scope="module")
def model():
    """A system's state (beta != 0, phi != phi0), the batch, and the student's current
    token log-probs on it ([B, S], aligned with the tokens)."""
    system = _steps()[0]
    state, frozen = system.init_state()
    state["beta"] = jnp.float32(0.7)
    keys = iter(jax.random.split(jax.random.key(5), 64))
    state["composer"] = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(next(keys), x.shape), state["composer"])
    np_batch = _batch()

    @jax.jit
    def current_logp(state, frozen, tokens, amask):
        student, use_lora = system.student(state["student"], frozen, state["composer"]["lora"])
        hidden = student(tokens, attention_mask=amask, lora=use_lora, return_hidden=True)
        lp = chunked_token_logp(hidden[:, :-1], student.lm_head_kernel(), tokens[:, 1:], chunk_size=8,
                                compute_dtype=system.model_cfg.jnp_dtype)
        return jnp.pad(lp, ((0, 0), (1, 0)))

    logp = np.asarray(current_logp(state, frozen, jnp.asarray(np_batch["tokens"]),
                                   jnp.asarray(np_batch["attention_mask"])))
    return state, frozen, np_batch, np.where(np_batch["attention_mask"], logp, 0.0).astype(np.float32)


def _stale(logp, amask):
    """Behaviour log-probs of an older student: per-row shifts on both sides of log CAP plus noise."""
    rng = np.random.RandomState(9)
    shift = np.array([0.0, 0.6, -0.7, 0.2, -0.1, 0.9, -0.3, 0.45])[:, None]
    return np.where(amask, logp - shift + 0.1 * rng.standard_normal(logp.shape), 0.0).astype(np.float32)


def _lopd_value_grads(correction, state, frozen, batch):
    return _steps(correction)[1](state, frozen, {k: jnp.asarray(v) for k, v in batch.items()})


def _grpo_value_grads(correction, state, frozen, batch):
    return _steps(correction)[2](state, frozen, {k: jnp.asarray(v) for k, v in batch.items()})


def _grpo_batch(np_batch, old):
    b = {k: np_batch[k] for k in ("tokens", "attention_mask", "loss_mask", "rewards")}
    return {**b, "old_logp": old}


def _close_metrics(got, want, keys):
    for k in keys:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)


def test_on_policy_samples_give_the_uncorrected_steps(model):
    """old_logp = the current student's log-probs: every weight 1, and the ``tis`` LOPD and
    GRPO losses and gradients equal ``none``'s (``mis`` on-policy: the test above)."""
    state, frozen, np_batch, logp = model
    batch, gb = {**np_batch, "old_logp": logp}, _grpo_batch(np_batch, logp)
    for run, b in ((_lopd_value_grads, batch), (_grpo_value_grads, gb)):
        want_g, want_m = run("none", state, frozen, b)
        g, m = run("tis", state, frozen, b)
        np.testing.assert_allclose(float(m["is_weight_mean"]), 1.0, rtol=1e-6)
        assert float(m["is_clipped_fraction"]) == 0.0 and abs(float(m["is_log_ratio_mean"])) < 1e-5
        _close_metrics(m, want_m, want_m)
        _close_trees(g, want_g)


def test_stale_samples_change_the_lopd_step_but_not_delta(model):
    """``none`` does not read ``old_logp`` (bit for bit the same step whatever it holds);
    ``tis`` on stale samples: clipped rollouts, another KL, the same Delta; ``tis`` without
    ``old_logp``: a clear error."""
    state, frozen, np_batch, logp = model
    old = _stale(logp, np_batch["attention_mask"])
    g0, m0 = _lopd_value_grads("none", state, frozen, {**np_batch, "old_logp": logp})
    g1, m1 = _lopd_value_grads("none", state, frozen, {**np_batch, "old_logp": old})
    for a, b in zip(jax.tree.leaves((g1, m1)), jax.tree.leaves((g0, m0))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    g, m = _lopd_value_grads("tis", state, frozen, {**np_batch, "old_logp": old})
    assert 0 < float(m["is_clipped_fraction"]) < 1
    assert abs(float(m["distill_kl"]) - float(m0["distill_kl"])) > 1e-4
    _close_metrics(m, m0, ("delta", "delta_per_rollout", "teacher_student_logp_gap", "anchor"))
    with pytest.raises(ValueError, match="old_logp"):
        jax.eval_shape(_steps("tis")[1], state, frozen, {k: jnp.asarray(v) for k, v in np_batch.items()})


def test_packed_lopd_with_tis_equals_the_padded_step(model):
    """Sequence-level weights on each trajectory's own tokens of packed rows."""
    state, frozen, np_batch, logp = model
    batch = {**np_batch, "old_logp": _stale(logp, np_batch["attention_mask"])}
    want_g, want_m = _lopd_value_grads("tis", state, frozen, batch)
    assert 0 < float(want_m["is_clipped_fraction"]) < 1
    system = _steps("tis")[0]
    acc = BucketedLOPDStep(system, state).accumulate(state, frozen, _pack(batch).put(system))
    _check_lopd(acc, want_g, want_m, system.step_cfg.loss.margin)


def test_packed_grpo_with_tis_equals_the_padded_step(model):
    """Token-level weights on packed rows, groups across segments."""
    state, frozen, np_batch, logp = model
    gb = _grpo_batch(np_batch, _stale(logp, np_batch["attention_mask"]))
    want_g, want_m = _grpo_value_grads("tis", state, frozen, gb)
    assert 0 < float(want_m["is_clipped_fraction"]) < 1
    system = _steps("tis")[0]
    pb = _pack(with_group_advantages(gb, 4), splice=None)
    acc = BucketedGRPOStep(system, state, group_size=4).accumulate(state, frozen, pb.put(system))
    got = dict(acc["metrics"])
    got["ratio_max_dev"] = got.pop("ratio_max_dev_max")
    assert set(got) == set(want_m)
    _close_metrics(got, want_m, want_m)
    _close_trees(acc["grads"][0], want_g)


def test_grpo_none_is_ppo_against_the_sampler_and_mis_masks_tokens(model):
    """``none``: the loss is PPO-clip with the ratio against ``old_logp`` (no ``is_*``
    metric); ``mis`` on stale samples drops tokens and clips nothing (the ratio's reference
    is the current policy)."""
    state, frozen, np_batch, logp = model
    old = _stale(logp, np_batch["attention_mask"])
    g0, m0 = _grpo_value_grads("none", state, frozen, _grpo_batch(np_batch, old))
    assert not any(k.startswith("is_") for k in m0)
    mask = np_batch["loss_mask"][:, 1:]
    adv = losses.group_advantages(jnp.asarray(np_batch["rewards"]), group_size=4)
    want = losses.ppo_clip_loss(jnp.asarray(logp[:, 1:]), jnp.asarray(old[:, 1:]), adv, jnp.asarray(mask), 0.2)
    np.testing.assert_allclose(float(m0["loss"]), float(want), rtol=1e-5)
    g, m = _grpo_value_grads("mis", state, frozen, _grpo_batch(np_batch, old))
    assert 0 < float(m["is_masked_fraction"]) < 1 and float(m["clip_fraction"]) == 0.0
    assert float(m["is_weight_mean"]) == pytest.approx(1.0 - float(m["is_masked_fraction"]))
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0))) > 0

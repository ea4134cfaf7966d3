"""Length-bucketed training steps equal the padded steps on the same trajectories
(LOPD with latents, top-M, margin and anchor; GRPO), the pass plan, the settings."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lopd_jax.planning.length_model import pass_tokens, plan_passes, sample_lengths
from lopd_jax.settings.errors import ConfigError
from lopd_jax.settings.length_config import LengthConfig
from configs import load_config
from lopd_jax.method import losses
from lopd_jax.method.splice import SpliceLayout
from lopd_jax.settings.overrides import apply_overrides
from train import mesh as mesh_lib
from train.bucketed_steps import (BucketedGRPOStep, BucketedLOPDStep, bucketed_batch, grpo_bucketed_batch,
                                  row_lengths)
from train.steps import grad_shares, grpo_loss, lopd_grads, lopd_loss, lopd_update
from train.system import LOPDSystem
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.settings.sections import MeshConfig, StepConfig

from tests.train.test_lopd_step import COMPOSER, _backbone  # the same perturbed tiny Qwen3 backbone

LAYOUT = SpliceLayout(before_ids=(11, 12, 13), after_ids=(14, 15), num_slots=6, slot_id=7)
B, S, LE, G = 8, 32, 9, 4
LENGTHS = np.array([32, 7, 18, 12, 27, 9, 20, 5])  # rows of every bucket, in mixed order
BUCKETS = (20, 32)
SHARD_TOKENS = 64  # 2 rows of 32 or 3 of 20 per shard and pass: two pass shapes per plan


def _batch(seed=0):
    rng = np.random.RandomState(seed)
    tokens = rng.randint(16, 512, (B, S)).astype(np.int32)
    amask = np.arange(S)[None] < LENGTHS[:, None]
    tokens[~amask] = 0
    insert_at = rng.randint(1, 4, B).astype(np.int32)
    loss_mask = (np.arange(S)[None] >= insert_at[:, None] + 2) & amask
    loss_mask[5] = False  # a rollout without supervised tokens (R < B)
    return {"tokens": tokens, "attention_mask": amask, "loss_mask": loss_mask.astype(np.float32),
            "insert_at": insert_at,
            "exp_tokens": rng.randint(16, 512, (B, COMPOSER.n_ret, LE)).astype(np.int32),
            "exp_mask": np.arange(LE)[None, None] < rng.randint(4, LE + 1, (B, COMPOSER.n_ret, 1)),
            "rewards": np.array([1.0, 0.5, 1.0, 0.0, 0.25, 1.0, 0.0, 0.75], np.float32)}


def _close_trees(got, want, tol=1e-5):
    """Every leaf within ``tol`` of the other, relative to the leaf's largest entry."""
    n = 0
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        scale = np.abs(w).max() + 1e-30
        np.testing.assert_allclose(g / scale, w / scale, atol=tol, err_msg=jax.tree_util.keystr(path))
        n += 1
    assert n == len(jax.tree.leaves(want))


# ----------------------------------------------------------------------------- the plan


def test_plan_covers_every_row_once_within_its_bucket():
    lengths = sample_lengths(LengthConfig(), 64, 4096, seed=3, scale=0.1)
    buckets = (512, 1024, 2048, 4096)
    for fill in ("longest_first", "own_bucket"):
        plan = plan_passes(lengths, buckets, 4096, 4, fill)
        rows = [r for p in plan for r in p.rows if r >= 0]
        assert sorted(rows) == list(range(64)), fill
        for p in plan:
            assert len(p.rows) % 4 == 0 and p.seq * len(p.rows) // 4 <= max(4096, p.seq)
            assert all(lengths[r] <= p.seq for r in p.rows if r >= 0)
            if fill == "own_bucket":  # each row in its own (smallest) bucket
                assert all(min(b for b in buckets if b >= lengths[r]) == p.seq for r in p.rows if r >= 0)
        assert plan_passes(lengths, buckets, 4096, 4, fill) == plan  # deterministic
        assert pass_tokens(plan) < 64 * 4096 / 2  # far less than padding every row to the cap
    # longest_first never processes more tokens than own_bucket
    assert pass_tokens(plan_passes(lengths, buckets, 4096, 4)) <= pass_tokens(
        plan_passes(lengths, buckets, 4096, 4, "own_bucket"))
    with pytest.raises(ValueError, match="exceeds"):
        plan_passes([5000], buckets, 4096, 1)


def test_length_settings_are_validated():
    cfg = apply_overrides(load_config("tiny"), ["lengths.buckets=256,512", "lengths.turn_median=40"])
    assert cfg.lengths.bucket_lengths(1024) == (256, 512, 1024) and cfg.lengths.enabled
    assert LengthConfig(buckets=(256, 2048)).bucket_lengths(1024) == (256, 1024)
    for bad in (["lengths.buckets=300"], ["lengths.buckets=512,256"], ["lengths.fill=packed"],
                ["lengths.bucket_tokens=-1"], ["lengths.turns_mean=0.5"], ["lengths.obs_sigma=-1"]):
        with pytest.raises(ConfigError):
            apply_overrides(load_config("tiny"), bad)
    d = sample_lengths(LengthConfig(), 20000, 40960)
    assert 7000 < d.mean() < 9000 and 5000 < np.median(d) < 7000 and 15000 < np.percentile(d, 90) < 19000


# ----------------------------------------------------------------------------- LOPD


@pytest.fixture(scope="module")
def lopd():
    """A LOPD system with beta != 0 (the margin counts) and phi != phi0 (the anchor counts),
    a batch, and the padded step's gradients and metrics on it."""
    system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, StepConfig(loss=LossConfig(logits_chunk=8, top_m=5)))
    state, frozen = system.init_state()
    state["beta"] = jnp.float32(0.7)
    keys = iter(jax.random.split(jax.random.key(5), 64))
    state["composer"] = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(next(keys), x.shape), state["composer"])
    np_batch = _batch()
    batch = {k: jnp.asarray(v) for k, v in np_batch.items()}
    _, sub = jax.random.split(state["rng"])

    def padded(state, frozen, batch):
        fn = lambda sp, cp: lopd_loss(system, sp, cp, state, frozen, batch, sub)  # noqa: E731
        (_, m), g = jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(state["student"], state["composer"])
        return g, m

    want_g, want_m = jax.jit(padded)(state, frozen, batch)
    assert float(want_m["anchor"]) > 0 and abs(float(want_m["delta"])) > 0
    assert float(want_m["supervised_rollouts"]) == B - 1
    assert max(float(jnp.abs(w).max()) for w in jax.tree.leaves(want_g[1])) > 0  # a composer gradient
    return system, state, frozen, np_batch, want_g, want_m


def _check_lopd(acc, want_g, want_m, margin):
    got_m = losses.add_margin_constant(acc["metrics"], margin)  # the passes' sums, as the step finishes them
    assert set(got_m) == set(want_m)
    for k in want_m:
        atol = 1e-6 if k == "delta_per_rollout" else 1e-7
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, atol=atol, err_msg=k)
    _close_trees(acc["grads"][:2], want_g)  # then the margin and anchor terms' composer gradients


def test_bucketed_lopd_step_equals_padded(lopd):
    """Gradients and metrics of the passes == the padded batch's; then whole steps
    (optimizer updates, dual step, metrics) agree."""
    system, state, frozen, np_batch, want_g, want_m = lopd
    bb = bucketed_batch(np_batch, BUCKETS, SHARD_TOKENS, 3)  # 3 "shards" on one device: a padding row
    assert list(row_lengths(np_batch)) == list(LENGTHS)
    assert [p.seq for p in bb.plan] == [32, 20] and min(bb.plan[-1].rows) < 0
    assert bb.padded_tokens() < B * S
    step = BucketedLOPDStep(system, state)
    bb = bb.put(system)
    _check_lopd(step.accumulate(state, frozen, bb), want_g, want_m, system.step_cfg.loss.margin)

    # the whole step against the padded step's end (train.steps.lopd_update, the tail of
    # make_lopd_step) applied to the padded gradients and metrics
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (the steps donate their state)
    rng, _ = jax.random.split(state["rng"])
    _, sub = jax.random.split(state["rng"])
    fn = lambda sp, cp: lopd_loss(system, sp, cp, state, frozen, {k: jnp.asarray(v) for k, v in np_batch.items()},  # noqa: E731
                                  sub)

    def padded_shares():  # the padded step's composer gradient shares (train.steps.make_lopd_step logs them)
        _, grads, per_term = lopd_grads(fn, state["student"], state["composer"], True)
        return grad_shares(grads[1], per_term)

    shares = jax.jit(padded_shares)()
    s1, m1 = jax.jit(lambda st, g, m: lopd_update(system, st, g, dict(m) | shares, rng, jnp.mean(np_batch["rewards"]),
                                                   jnp.sum(np_batch["attention_mask"].astype(np.float32))))(
        copy(state), want_g, want_m)
    s2, m2 = step(copy(state), frozen, bb)
    assert set(m1) == set(m2)
    for k in m1:
        atol = 1e-4 if k.startswith("composer_grad_share") else 1e-6
        np.testing.assert_allclose(np.asarray(m2[k]), np.asarray(m1[k]), rtol=1e-5, atol=atol, err_msg=k)
    for k in ("student", "composer", "beta"):
        _close_trees(s2[k], s1[k])
    for k in ("step", "rng"):
        np.testing.assert_array_equal(np.asarray(s2[k]), np.asarray(s1[k]))
    assert step._pass_jit._cache_size() == len(BUCKETS)  # one compile per bucket here


def test_bucketed_lopd_sharded_equals_padded(lopd):
    """2 batch shards on a 2-device mesh (every pass a multiple of 2 rows): same gradients."""
    system1, state, frozen, np_batch, want_g, want_m = lopd
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=2, tensor=1), jax.devices()[:2])
    system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, system1.step_cfg, rules=mesh_lib.rules_for(mesh))
    bb = bucketed_batch(np_batch, BUCKETS, SHARD_TOKENS, 2)
    assert all(len(p.rows) % 2 == 0 for p in bb.plan)
    s = mesh_lib.put(state, system.state_shardings(state))
    f = mesh_lib.put(frozen, system.frozen_shardings())
    acc = BucketedLOPDStep(system, s).accumulate(s, f, bb.put(system))
    _check_lopd(jax.device_get(acc), want_g, want_m, system.step_cfg.loss.margin)


# ----------------------------------------------------------------------------- GRPO


def grpo_batch():
    """A GRPO batch: :func:`_batch`'s rows with sampler log-probs ``old_logp``."""
    np_batch = {k: v for k, v in _batch(2).items() if k in ("tokens", "attention_mask", "loss_mask", "rewards")}
    rng = np.random.RandomState(4)
    np_batch["old_logp"] = np.where(np_batch["attention_mask"], -3.0 + 0.5 * rng.standard_normal((B, S)),
                                    0.0).astype(np.float32)
    return np_batch


def test_bucketed_grpo_equals_padded():
    """Groups split over passes: advantages over whole groups, token mean over the batch."""
    system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, StepConfig(loss=LossConfig(logits_chunk=8, top_m=5)))
    state, frozen = system.init_state()
    np_batch = grpo_batch()
    batch = {k: jnp.asarray(v) for k, v in np_batch.items()}
    bb = grpo_bucketed_batch(np_batch, G, BUCKETS, SHARD_TOKENS, 1)
    groups = [{r // G for r in p.rows if r >= 0} for p in bb.plan]
    assert any(len(g) > 1 for g in groups)  # passes mix groups, and groups span passes

    (_, want_m), want_g = jax.jit(jax.value_and_grad(
        lambda sp: grpo_loss(system, sp, state, frozen, batch, G), has_aux=True))(state["student"])
    step = BucketedGRPOStep(system, state, group_size=G)
    acc = step.accumulate(state, frozen, bb.put(system))
    got_m = dict(acc["metrics"])
    got_m["ratio_max_dev"] = got_m.pop("ratio_max_dev_max")
    for k in want_m:
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, atol=1e-7, err_msg=k)
    assert float(want_m["clip_fraction"]) > 0  # the clipped branch is exercised
    _close_trees(acc["grads"][0], want_g)

    s2, m2 = step(jax.tree.map(jnp.copy, state), frozen, bb.put(system))  # the update runs on the sums
    assert int(s2["step"]) == 1 and float(m2["student_grad_norm"]) > 0

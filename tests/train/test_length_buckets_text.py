"""Length-bucketed text-distillation (OPSD / SDPO / SDFT / Skill-SD) and cold-start steps
equal the padded steps on the same trajectories: loss, metrics, every gradient, whole steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.train.test_length_buckets import B, BUCKETS, COMPOSER, LAYOUT, S, _backbone, _batch, _close_trees
from train.bucketed_steps import BucketedColdStartStep, BucketedTextStep, bucketed_batch
from train.steps import cold_start_loss
from train.system import LOPDSystem
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.settings.sections import StepConfig
from train.text_steps import text_distill_loss

C = 6  # context block width
EMA_DECAY = 0.9
SHORT = BUCKETS[0]  # rows cut to at most this: every pass is (3 rows, SHORT), so each step compiles one pass
SHARDS, SHARD_TOKENS = 3, SHORT  # 3 "shards" on one device, one row each: 3 passes, the last with a padding row


def _short_batch(seed):
    """:func:`test_length_buckets._batch` with every row cut to at most ``SHORT`` tokens of
    the ``S``-token rows (lengths 20, 7, 18, 12, 20, 9, 20, 5; row 5 has no supervised token)."""
    batch = _batch(seed)
    amask = batch["attention_mask"] & (np.arange(S)[None] < SHORT)
    batch["tokens"] = np.where(amask, batch["tokens"], 0)
    batch["loss_mask"] = batch["loss_mask"] * amask
    batch["attention_mask"] = amask
    return batch


def _passes(np_batch, system):
    """The batch in passes (checked: three passes of (3, ``SHORT``), a padding row last)."""
    bb = bucketed_batch(np_batch, BUCKETS, SHARD_TOKENS, SHARDS)
    assert [(p.seq, len(p.rows)) for p in bb.plan] == [(SHORT, 3)] * 3 and min(bb.plan[-1].rows) < 0
    assert bb.padded_tokens() < B * S
    return bb


@pytest.fixture(scope="module")
def system():
    """A tiny LOPD system (top-M 5, logits chunks of 8)."""
    return LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, StepConfig(loss=LossConfig(logits_chunk=8, top_m=5)))


def _copy(t):
    return jax.tree.map(jnp.copy, t)  # the steps donate their state


def _check_metrics(got, want, skip=()):
    assert set(got) == set(want)
    for k in want:
        if k not in skip:
            np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-6, err_msg=k)


def _text_distill_inputs(system, rows):
    """SDFT's form: ``(state, frozen, numpy batch, batch)`` with the EMA teacher moved away
    from the student, the text-distillation fields of ``rows`` (a :func:`_batch`), context
    blocks of lengths 0 to ``C``, rows 2 and 6 left out (``row_weight`` 0)."""
    state, frozen = system.init_state()
    keys = iter(jax.random.split(jax.random.key(7), 64))
    state["ema"] = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), state["student"])
    rng = np.random.RandomState(3)
    np_batch = {k: v for k, v in rows.items() if k in ("tokens", "attention_mask", "loss_mask", "insert_at", "rewards")}
    np_batch["ctx_ids"] = rng.randint(16, 512, (B, C)).astype(np.int32)
    np_batch["ctx_len"] = np.array([6, 0, 3, 5, 1, 6, 2, 4], np.int32)
    np_batch["row_weight"] = np.array([1, 1, 0, 1, 1, 1, 0, 1], np.float32)
    return state, frozen, np_batch, {k: jnp.asarray(v) for k, v in np_batch.items()}


def _check_step(step, state, frozen, bb, want_g, want_m, keys):
    """The whole bucketed step against its update applied to the padded batch's gradients
    and metrics (the padded steps end in the same update function: one update per batch).
    States after AdamW within 1e-4: Adam's per-element normalisation turns the ~1e-6
    relative rounding of a gradient entry much smaller than its leaf's largest into more."""
    extras = {"mean_reward": jnp.float32(bb.stats["mean_reward"]), "tokens": jnp.float32(bb.stats["tokens"])}
    s1, m1 = step._update_jit(_copy(state), {"grads": (want_g,), "metrics": dict(want_m)}, extras)
    s2, m2 = step(_copy(state), frozen, bb)
    _check_metrics(jax.device_get(m2), jax.device_get(m1))
    for k in keys:
        _close_trees(s2[k], s1[k], tol=1e-4)
    for k in ("step", "rng"):
        np.testing.assert_array_equal(np.asarray(s2[k]), np.asarray(s1[k]), err_msg=k)
    assert int(s2["step"]) == int(state["step"]) + 1


def test_bucketed_text_distill_step_equals_padded(system):
    """SDFT's form (the teacher an EMA that differs from the student, updated after the
    step; the other arms' teacher is theta0 through the same loss): rows of mixed lengths,
    a row left out (``row_weight`` 0), a row without supervised tokens, context blocks of
    different lengths, a padding row in a pass. Gradients and metrics of the passes ==
    the padded batch's, then the whole step is one update (AdamW, EMA) on them."""
    state, frozen, np_batch, batch = _text_distill_inputs(system, _short_batch(1))
    bb = _passes(np_batch, system)
    assert all(p["ctx_ids"].shape[1] == C for p in bb.passes)  # the context block is never cut
    distilled = (np_batch["loss_mask"][:, 1:] != 0) & (np_batch["row_weight"][:, None] != 0)
    assert bb.stats["supervised"] == distilled.sum() < (np_batch["loss_mask"][:, 1:] != 0).sum()

    (_, want_m), want_g = jax.jit(jax.value_and_grad(
        lambda sp: text_distill_loss(system, sp, state, frozen, batch, True), has_aux=True))(state["student"])
    assert float(want_m["supervised_rollouts"]) == B - 3 and abs(float(want_m["delta"])) > 0
    step = BucketedTextStep(system, state, EMA_DECAY)
    bb = bb.put(system)
    acc = step.accumulate(state, frozen, bb)
    _check_metrics(acc["metrics"], want_m)
    _close_trees(acc["grads"][0], want_g)
    assert step._pass_jit._cache_size() == 1  # one compile for the three passes of one shape

    _check_step(step, state, frozen, bb, want_g, want_m, ("student", "student_opt", "ema"))


def test_bucketed_cold_start_step_equals_padded(system):
    """The cold start (latents spliced into the teacher, NLL token mean over the whole
    batch, two clip groups): gradients and metrics of the passes == the padded batch's,
    then the whole step is one update on them."""
    state = system.init_cold_start_state(seed=3)
    frozen = system.initial_params()[0]
    np_batch = {k: v for k, v in _short_batch(4).items() if k != "rewards"}
    batch = {k: jnp.asarray(v) for k, v in np_batch.items()}
    bb = _passes(np_batch, system)

    _, sub = jax.random.split(state["rng"])
    (_, want_m), want_g = jax.jit(jax.value_and_grad(
        lambda cp: cold_start_loss(system, cp, frozen, batch, sub), has_aux=True))(state["composer"])
    step = BucketedColdStartStep(system, state)
    bb = bb.put(system)
    acc = step.accumulate(state, frozen, bb)
    _check_metrics(acc["metrics"], want_m)
    _close_trees(acc["grads"][0], want_g)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(want_g["compressor"]))

    _check_step(step, state, frozen, bb, want_g, want_m, ("composer", "composer_opt"))

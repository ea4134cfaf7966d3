"""Fewer than n_ret retrieved experiences (release parity item 10): the missing experiences'
latent slots are masked out of the teacher's attention, so whatever the composer makes of
an empty experience cannot change the teacher; and the teacher sequence's context cap."""

import jax.numpy as jnp
import numpy as np

from lopd_jax.method.composer import slot_mask
from lopd_jax.method.splice import teacher_hidden_states, teacher_mask, teacher_tokens
from tests.train.test_lopd_step import COMPOSER, LAYOUT, S, B, _backbone, _batch
from train.system import LOPDSystem
from lopd_jax.settings.sections import StepConfig


def test_slot_mask_and_teacher_mask():
    exp_mask = np.zeros((2, COMPOSER.n_ret, 5), bool)
    exp_mask[0, :, :3] = True
    exp_mask[1, 0, :2] = True  # task 1: one hit of n_ret = 2
    sm = np.asarray(slot_mask(jnp.asarray(exp_mask), COMPOSER.num_latents))
    K = COMPOSER.num_latents
    assert sm.shape == (2, COMPOSER.num_slots) and sm[0].all() and sm[1, :K].all() and not sm[1, K:].any()
    amask = jnp.ones((2, 8), bool)
    ins = jnp.asarray([1, 3])
    tm = np.asarray(teacher_mask(amask, ins, LAYOUT, jnp.asarray(sm)))
    first = 3 + len(LAYOUT.before_ids)  # task 1's first slot
    assert tm[0].all()
    assert tm[1, first:first + K].all() and not tm[1, first + K:first + 2 * K].any()
    assert tm[1].sum() == 8 + LAYOUT.length - K


def test_masked_slots_do_not_reach_the_teacher():
    model = _backbone()
    batch = _batch()
    tokens, amask, ins = (jnp.asarray(batch[k]) for k in ("tokens", "attention_mask", "insert_at"))
    rng = np.random.RandomState(0)
    lat = jnp.asarray(rng.randn(B, LAYOUT.num_slots, model.cfg.hidden_size), jnp.float32)
    K = COMPOSER.num_latents
    sm = np.ones((B, LAYOUT.num_slots), bool)
    sm[1, K:] = False  # task 1 retrieved one experience of two
    other = lat.at[1, K:].set(100.0)  # anything in the masked slots
    a = np.asarray(teacher_hidden_states(model, tokens, amask, ins, lat, LAYOUT, jnp.asarray(sm)))
    b = np.asarray(teacher_hidden_states(model, tokens, amask, ins, other, LAYOUT, jnp.asarray(sm)))
    valid = np.asarray(amask) & (np.arange(S)[None] >= np.asarray(ins)[:, None])
    np.testing.assert_allclose(a[valid], b[valid], atol=1e-6)
    c = np.asarray(teacher_hidden_states(model, tokens, amask, ins, other, LAYOUT))  # unmasked: it does
    assert np.abs(c[1][valid[1]] - a[1][valid[1]]).max() > 1e-3


def test_empty_experience_rows_give_finite_latents():
    system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, StepConfig())
    batch = _batch()
    exp_mask = np.array(batch["exp_mask"])
    exp_mask[2, 1] = False  # no second experience for task 2
    frozen, lora, comp = system.initial_params()
    lat = np.asarray(system.latents(frozen, {"lora": lora, "compressor": comp}, jnp.asarray(batch["exp_tokens"]),
                                    jnp.asarray(exp_mask)))
    assert np.isfinite(lat).all()


def test_teacher_sequence_exceeds_the_student_cap_by_the_block():
    """Decision: the student's sequence keeps the full rollout cap; the teacher sees the cap
    plus the inserted block (L_ins more positions), with no cut."""
    cap = S
    ids = jnp.arange(cap)[None].repeat(2, 0)
    t = teacher_tokens(ids, jnp.asarray([2, 5]), LAYOUT)
    assert t.shape == (2, cap + LAYOUT.length)
    assert list(np.asarray(t[0, -3:])) == list(range(cap - 3, cap))  # the last student tokens are kept

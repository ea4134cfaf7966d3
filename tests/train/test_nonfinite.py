"""Non-finite guard (release parity item 9): a step whose gradient norm or Delta is not
finite leaves the student, the composer, their optimizer states and beta unchanged, and is
counted; the host tracker stops the run after steps.max_nonfinite_skips in a row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.train.test_lopd_step import COMPOSER, LAYOUT, _backbone, _batch
from train.nonfinite import NonFiniteError, NonFiniteTracker
from train.steps import make_lopd_step
from train.system import LOPDSystem
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.settings.sections import StepConfig


def _host(tree):
    return jax.tree.map(lambda x: np.array(x), tree)


def test_nan_step_is_skipped_and_counted():
    cfg = StepConfig(loss=LossConfig(logits_chunk=8, top_m=5, margin=1.0), student_lr=1e-3, composer_lr=1e-3)
    system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, cfg)
    state, frozen = system.init_state()
    good = {k: jnp.asarray(v) for k, v in _batch().items()}
    bad = dict(good, rewards=good["rewards"].at[1].set(jnp.nan))  # NaN advantage -> NaN Delta and phi grads
    step = make_lopd_step(system, state, good)
    state, m0 = step(state, frozen, good)
    assert float(m0["nonfinite"]) == 0.0 and float(state["beta"]) > 0
    before = _host(state)
    state, m1 = step(state, frozen, bad)
    assert float(m1["nonfinite"]) == 1.0
    assert not np.isfinite(float(m1["composer_grad_norm"]))
    after = _host(state)
    for part in ("student", "student_opt", "composer", "composer_opt", "beta"):
        for a, b in zip(jax.tree.leaves(after[part]), jax.tree.leaves(before[part])):
            np.testing.assert_array_equal(a, b, err_msg=part)
    assert int(after["step"]) == int(before["step"]) + 1
    state, m2 = step(state, frozen, good)  # training goes on from the kept state
    assert float(m2["nonfinite"]) == 0.0
    assert not np.array_equal(np.asarray(state["student"]["q"]), before["student"]["q"])


def test_tracker_stops_after_consecutive_skips():
    t = NonFiniteTracker(max_skips=2, stage="lopd")
    assert t.update({"nonfinite": 1.0}, 1) == 1
    assert t.update({"nonfinite": 0.0}, 2) == 1  # a finite step resets the run of skips
    assert t.update({"nonfinite": 1.0}, 3) == 2
    with pytest.raises(NonFiniteError, match="2 consecutive steps .*max_nonfinite_skips"):
        t.update({"nonfinite": 1.0}, 4)
    never = NonFiniteTracker(max_skips=0)
    assert [never.update({"nonfinite": 1.0}, s) for s in range(5)][-1] == 5

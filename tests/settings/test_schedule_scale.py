"""``stages.schedule_scale``: none leaves the config as it is, auto scales eta_beta and the
composer's learning rate by the paper's LOPD steps over the run's."""

import dataclasses

import pytest

from lopd_jax.settings.errors import ConfigError
from lopd_jax.settings.schedule_scale import PAPER_LOPD_STEPS, apply_schedule_scale, schedule_factor


def test_schedule_scale_none_changes_nothing_and_auto_scales_to_the_run():
    from configs import load_config

    cfg = load_config("miniature")
    assert cfg.stages.schedule_scale == "none" and apply_schedule_scale(cfg) is cfg
    auto = apply_schedule_scale(dataclasses.replace(cfg, stages=dataclasses.replace(cfg.stages, schedule_scale="auto")))
    T = cfg.stages.lopd_steps
    assert auto.steps.eta_beta == pytest.approx(cfg.steps.eta_beta * PAPER_LOPD_STEPS / T)
    assert auto.steps.composer_lr == pytest.approx(cfg.steps.composer_lr * PAPER_LOPD_STEPS / T)
    assert dataclasses.replace(auto, steps=cfg.steps, stages=cfg.stages) == cfg  # nothing else moved
    # the paper's own length: unchanged; paper values at 16 steps: 0.5 * 50/16 and 1e-5 * 50/16
    assert schedule_factor("auto", PAPER_LOPD_STEPS) == 1.0 and schedule_factor("auto", 0) == 1.0
    assert schedule_factor("auto", 16) == pytest.approx(3.125)
    with pytest.raises(ConfigError, match="schedule_scale"):
        dataclasses.replace(cfg.stages, schedule_scale="fast")

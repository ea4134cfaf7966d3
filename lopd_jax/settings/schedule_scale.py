"""``stages.schedule_scale``: scale the privilege margin's dual step and the composer's learning
rate to the run's length, so a short run sees the paper's balance between how fast the
composer can collapse and how fast β can grow (docs/method.md, "Deviation: scaled schedule
for short runs"). Applied once, when the run's config is resolved (:func:`apply_schedule_scale`).
"""

from __future__ import annotations

import dataclasses

from lopd_jax.settings.errors import ConfigError

PAPER_LOPD_STEPS = 50  # the paper's LOPD steps, at which its eta_beta and composer_lr were set
SCHEDULE_SCALES = ("none", "auto")


def schedule_factor(mode: str, lopd_steps: int) -> float:
    """The factor on ``steps.eta_beta`` and ``steps.composer_lr``: 1 for ``"none"``;
    ``PAPER_LOPD_STEPS / lopd_steps`` for ``"auto"`` (1 when there are no LOPD steps).

    Why this factor: the dual ascent ``β ← max(0, β + η_β (m − Δ))`` raises β by at most
    ``η_β·m`` per step, so by the end of a run of T steps β can reach ``η_β·m·T``; an AdamW
    step moves the composer by about ``composer_lr`` per parameter, so over the run it moves
    about ``composer_lr·T``. Multiplying both by ``50 / T`` keeps both totals at the paper's
    (β up to 0.5·0.05·50 = 1.25; composer movement 50 paper steps' worth) and keeps their
    per-step ratio ``composer_lr / η_β`` -- collapse speed over β growth -- unchanged.
    """
    if mode not in SCHEDULE_SCALES:
        raise ConfigError(f"stages.schedule_scale={mode!r}: use one of {SCHEDULE_SCALES} ('auto' scales "
                          f"steps.eta_beta and steps.composer_lr by {PAPER_LOPD_STEPS} / stages.lopd_steps).")
    if mode == "none" or lopd_steps <= 0:
        return 1.0
    return PAPER_LOPD_STEPS / lopd_steps


def apply_schedule_scale(cfg):
    """``cfg`` (a :class:`lopd_jax.settings.config.TrainConfig`) with ``steps.eta_beta`` and
    ``steps.composer_lr`` multiplied by :func:`schedule_factor`; the same object when the
    factor is 1 (``stages.schedule_scale="none"``, the default)."""
    factor = schedule_factor(cfg.stages.schedule_scale, cfg.stages.lopd_steps)
    if factor == 1.0:
        return cfg
    steps = dataclasses.replace(cfg.steps, eta_beta=cfg.steps.eta_beta * factor,
                                composer_lr=cfg.steps.composer_lr * factor)
    return dataclasses.replace(cfg, steps=steps)


__all__ = ["PAPER_LOPD_STEPS", "SCHEDULE_SCALES", "schedule_factor", "apply_schedule_scale"]

"""Which training-stage algorithm a run uses (its *arm*): the arms' declarations and settings.

``TrainConfig.arm`` picks the algorithm of the training stage; every other stage of the
pipeline (warm-up, held-out evaluation, experience bank, export, metrics, plot) is the
same for all arms. :data:`ARM_SPECS` declares each arm as the settings floor needs it
(:class:`ArmSpec`: its teacher's context, whether it uses the composer and its cold start,
whether it draws groups of ``arms.group_size``, what it implies and its config
cross-checks); its training behaviour is the module ``train/arms/<name>.py``, looked up by
the same name (``train.arms.registry``). ``TrainConfig.arms`` (:class:`ArmSection`) holds the
settings only some arms read. The arms (see docs/baselines.md):

* ``lopd`` -- LOPD (the default).
* ``lopd_frozen_composer`` -- LOPD with phi = phi0 (cold-started, never updated).
* ``grpo`` -- GRPO: G rollouts per task, group-normalized advantages, PPO-clip.
* ``opsd`` -- self-distillation from theta0 with the task's oracle hint as text context.
* ``sdpo`` -- self-distillation from theta0 with a successful sibling rollout as context.
* ``sdft`` -- self-distillation from an EMA of the student with a demonstration (the
  reference solution of another task of the family) as context.
* ``skill_sd`` -- self-distillation from theta0 with a skill summary chosen by UCB1.
* ``experiences_text`` -- self-distillation from theta0 with the experiences LOPD's composer
  would compress (the same bank, the same retrieval) given as text.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

from lopd_jax.settings.errors import ConfigError

TEACHER_CONTEXTS = ("latents", "text", "none")


@dataclasses.dataclass(frozen=True)
class ArmSpec:
    """What the settings floor knows of an arm (its training behaviour: ``train/arms/<name>.py``).

    ``teacher``: the teacher's context (``latents`` from the composer, ``text``, or
    ``none``: no teacher). ``composer``: the arm uses the composer, so the run cold-starts
    it. ``group``: the arm draws ``arms.group_size`` rollouts per task (else
    ``env.group_size``). ``implies``: ``(dotted field, value)`` pairs the arm sets on the
    config (:func:`resolve_arm`). ``checks``: functions of the config returning a problem
    (a message naming the fix) or None; run when the config is built.
    """

    name: str
    teacher: Literal[TEACHER_CONTEXTS]
    composer: bool = False
    group: bool = False
    implies: tuple[tuple[str, Any], ...] = ()
    checks: tuple[Callable[[Any], str | None], ...] = ()

    def __post_init__(self):
        if self.teacher not in TEACHER_CONTEXTS:
            raise ValueError(f"arm {self.name}: teacher={self.teacher!r} is not one of {TEACHER_CONTEXTS}")
        if self.composer != (self.teacher == "latents"):
            raise ValueError(f"arm {self.name}: the composer is used exactly when the teacher reads latents")

    def problems(self, cfg) -> list[str]:
        """Every cross-check of this arm that ``cfg`` fails, as messages."""
        out = []
        n = cfg.env.tasks_per_step * cfg.env.group_size
        if self.group and n % cfg.arms.group_size:
            out.append(f"arm={self.name}: arms.group_size={cfg.arms.group_size} must divide the "
                       f"{n} rollouts per step (env.tasks_per_step * env.group_size).")
        return out + [p for p in (check(cfg) for check in self.checks) if p]


def _one_epoch_with_correction(cfg) -> str | None:
    """GRPO with an importance correction runs one PPO update per batch."""
    if cfg.steps.loss.is_correction != "none" and cfg.arms.grpo_epochs > 1:
        return (f"arm=grpo: steps.is_correction={cfg.steps.loss.is_correction} takes the current policy as PPO's "
                "proximal policy, which holds for one update per batch only; set arms.grpo_epochs=1 (now "
                f"{cfg.arms.grpo_epochs}) or steps.is_correction=none.")
    return None


ARM_SPECS: dict[str, ArmSpec] = {s.name: s for s in (
    ArmSpec("lopd", "latents", composer=True),
    ArmSpec("lopd_frozen_composer", "latents", composer=True, implies=(("steps.freeze_composer", True),)),
    ArmSpec("grpo", "none", group=True, checks=(_one_epoch_with_correction,)),
    ArmSpec("opsd", "text"),
    ArmSpec("sdpo", "text", group=True),
    ArmSpec("sdft", "text"),
    ArmSpec("skill_sd", "text"),
    ArmSpec("experiences_text", "text"),
)}
ARMS = tuple(ARM_SPECS)


def arm_spec(name: str) -> ArmSpec:
    """The declaration of arm ``name``; a :class:`ConfigError` listing the registered arms
    when there is none."""
    try:
        return ARM_SPECS[name]
    except KeyError:
        raise ConfigError(f"arm={name!r} is not a registered arm; choose one of {list(ARMS)} "
                          "(lopd_jax/settings/arm_config.py).") from None


def uses_composer(cfg) -> bool:
    """Whether the run's arm uses the composer (and so the cold start)."""
    return arm_spec(cfg.arm).composer


def group_size(cfg) -> int:
    """G, rollouts per drawn task, of the run's arm."""
    return cfg.arms.group_size if arm_spec(cfg.arm).group else cfg.env.group_size


def rollouts_per_step(cfg) -> int:
    """Rollouts every arm samples per training step (the equal-budget unit)."""
    return cfg.env.tasks_per_step * cfg.env.group_size


def resolve_arm(cfg):
    """``cfg`` with what its arm implies applied (``lopd_frozen_composer``:
    ``steps.freeze_composer``); the config itself runs the arm's cross-checks."""
    for path, value in arm_spec(cfg.arm).implies:
        cfg = _replace_path(cfg, path.split("."), value)
    return cfg


def _replace_path(obj, path: list[str], value):
    """``obj`` (nested frozen dataclasses) with the field at ``path`` set to ``value``."""
    if not path:
        return value
    head = getattr(obj, path[0])
    new = _replace_path(head, path[1:], value)
    return obj if new == head else dataclasses.replace(obj, **{path[0]: new})


@dataclasses.dataclass(frozen=True)
class ArmSection:
    """Settings of the non-default arms.

    ``group_size``: G, rollouts per task for ``grpo`` and ``sdpo``; they draw
    ``env.tasks_per_step * env.group_size / G`` tasks per step, so every arm samples the
    same number of rollouts per step. ``grpo_epochs``: PPO updates per batch (1: the
    ratio is exactly 1 at the update). ``context_tokens``: the text arms' context block
    (framing + text) is cut to this many tokens. ``ema_decay``: ``sdft``'s teacher
    ``ema <- decay * ema + (1 - decay) * student`` after every step. ``ucb_c``: the
    exploration constant of ``skill_sd``'s UCB1 (score = mean + c sqrt(2 ln N / n)).
    """

    group_size: int = 4
    grpo_epochs: int = 1
    context_tokens: int = 256
    ema_decay: float = 0.98
    ucb_c: float = 1.0

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"arms.group_size={self.group_size} must be >= 2 (group-normalized advantages "
                             "and sibling rollouts need a group).")
        if self.grpo_epochs < 1 or self.context_tokens < 8:
            raise ValueError("arms.grpo_epochs must be >= 1 and arms.context_tokens >= 8.")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"arms.ema_decay={self.ema_decay} must be in [0, 1).")
        if self.ucb_c < 0:
            raise ValueError(f"arms.ucb_c={self.ucb_c} must be >= 0.")

"""Which training-stage algorithm a run uses (its *arm*) and the arms' own settings.

``TrainConfig.arm`` picks the algorithm of the training stage; every other stage of the
pipeline (warm-up, held-out evaluation, experience bank, export, metrics, plot) is the
same for all arms. ``TrainConfig.arms`` (:class:`ArmSection`) holds the settings only some
arms read. The arms (see docs/baselines.md):

* ``lopd`` -- LOPD (the default).
* ``lopd_frozen_composer`` -- LOPD with phi = phi0 (cold-started, never updated).
* ``grpo`` -- GRPO: G rollouts per task, group-normalized advantages, PPO-clip.
* ``opsd`` -- self-distillation from theta0 with the task's oracle hint as text context.
* ``sdpo`` -- self-distillation from theta0 with a successful sibling rollout as context.
* ``sdft`` -- self-distillation from an EMA of the student with a demonstration (the
  reference solution of another task of the family) as context.
* ``skill_sd`` -- self-distillation from theta0 with a skill summary chosen by UCB1.
"""

from __future__ import annotations

import dataclasses

ARMS = ("lopd", "lopd_frozen_composer", "grpo", "opsd", "sdpo", "sdft", "skill_sd")
COMPOSER_ARMS = ("lopd", "lopd_frozen_composer")
TEXT_ARMS = ("opsd", "sdpo", "sdft", "skill_sd")
GROUP_ARMS = ("grpo", "sdpo")


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

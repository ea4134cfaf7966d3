"""``skill_sd``: self-distillation from theta0 with a skill summary as text context: the
library is one :func:`lopd_jax.method.text_context.skill_summary` per distinct procedure
among the bank's successes; per row, UCB1 (``arms.ucb_c``) picks a skill of the row's family
and is credited with the row's improvement after the step. The UCB1 counts go into every
checkpoint's metadata."""

from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np

from lopd_jax.method.text_context import skill_summary
from train.arms.text import TextArm


def build_skills(entries) -> list[dict]:
    """Skill-SD's library: one skill summary per distinct procedure among the bank's
    (successful) trajectories, with its family."""
    out, seen = [], set()
    for e in entries:
        text = skill_summary(e)
        if text not in seen:
            seen.add(text)
            out.append({"text": text, "family": (e.info or {}).get("family") or e.env_id})
    return out


class UCB1:
    """UCB1 over ``n`` arms: untried arms first (lowest index), then the largest
    ``mean + c * sqrt(2 ln N / n_k)`` with N the pulls among the candidates."""

    def __init__(self, n: int, c: float = 1.0):
        self.c = c
        self.counts = [0] * n
        self.sums = [0.0] * n

    def select(self, candidates: Sequence[int]) -> int:
        """The arm to pull among ``candidates``."""
        for k in candidates:
            if self.counts[k] == 0:
                return k
        total = sum(self.counts[k] for k in candidates)

        def score(k):
            return self.sums[k] / self.counts[k] + self.c * math.sqrt(2 * math.log(total) / self.counts[k])
        return max(candidates, key=score)

    def update(self, k: int, reward: float) -> None:
        """Record one pull of arm ``k`` with ``reward``."""
        self.counts[k] += 1
        self.sums[k] += reward

    def state(self) -> dict:
        """JSON state (checkpoint metadata)."""
        return {"counts": list(self.counts), "sums": list(self.sums)}

    def set_state(self, s: dict) -> None:
        """Inverse of :meth:`state`."""
        self.counts, self.sums = [int(x) for x in s["counts"]], [float(x) for x in s["sums"]]


class SkillSDArm(TextArm):
    """A UCB1-chosen skill per row (see the module docstring)."""

    name = "skill_sd"
    framing = ("A skill that helps with tasks like this one:", "End of skill. Now solve your own task.")

    def __init__(self, ctx, bank):
        super().__init__(ctx, bank)
        self.skills = build_skills(bank.entries)
        self.ucb = UCB1(len(self.skills), ctx.cfg.arms.ucb_c)
        self.picked: list[int | None] = []  # the skill of each row of the latest batch

    def contexts(self, step, trajs):
        """Per row: the skill UCB1 picks among its family's (all skills when it has none)."""
        self.picked, texts = [], []
        for t in trajs:
            cands = [k for k, s in enumerate(self.skills) if s["family"] == t.task.family] or \
                list(range(len(self.skills)))
            k = self.ucb.select(cands) if cands else None
            self.picked.append(k)
            texts.append(None if k is None else self.skills[k]["text"])
        return texts

    def after_step(self, metrics):
        """Credit each picked skill with its row's improvement (``delta_per_rollout``; the
        metrics are global, so every process updates alike)."""
        metrics = jax.device_get(metrics)
        per_row = np.asarray(metrics["delta_per_rollout"], np.float64)
        for k, r in zip(self.picked, per_row):
            if k is not None:
                self.ucb.update(k, float(r))
        return metrics

    def meta(self) -> dict:
        """The UCB1 state."""
        return {"ucb": self.ucb.state()}

    def restore(self, meta: dict) -> None:
        """The UCB1 state of a restored checkpoint."""
        if "ucb" in meta:
            self.ucb.set_state(meta["ucb"])


ARM = SkillSDArm

"""A hidden rule that drifts during training: at stated LOPD steps a stated fraction of the
rule's keys (dispatch: customers) gets a new target (hub), drawn from the seed and the drift's
index, so the privileged context that helped before a drift can mislead after it.

:class:`DriftSchedule` says when and how much; :meth:`DriftSchedule.rule_at` gives the map in
force at a step. The synthetic task source applies it (``drift_every`` / ``drift_steps`` /
``drift_fraction``; docs/miniature.md, "The drifting variant").
"""

from __future__ import annotations

import dataclasses
import random
from typing import Sequence

from lopd_jax.envs.synthetic.domains import HiddenRule


@dataclasses.dataclass(frozen=True)
class DriftSchedule:
    """When the hidden rule drifts and how much.

    Args:
        every: drift at steps ``every, 2*every, ...`` (0: not periodic).
        steps: drift at these steps (ascending, > 0); exclusive with ``every``.
        fraction: share of the rule's keys that get a new target at each drift, in (0, 1];
            ``round(fraction * len(keys))`` keys, at least one.

    A drift "at step ``a``" means the map changes between step ``a - 1`` and step ``a``:
    steps ``>= a`` (and a held-out evaluation after ``a`` updates) use the new map.
    """

    every: int = 0
    steps: tuple[int, ...] = ()
    fraction: float = 0.5

    def __post_init__(self):
        steps = tuple(int(s) for s in self.steps)
        object.__setattr__(self, "steps", steps)
        if self.every < 0:
            raise ValueError(f"drift_every={self.every}: give a positive step count, or 0 for no periodic drift")
        if self.every and steps:
            raise ValueError("give drift_every or drift_steps, not both")
        if any(s <= 0 for s in steps) or list(steps) != sorted(set(steps)):
            raise ValueError(f"drift_steps={steps}: give ascending, distinct steps > 0")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"drift_fraction={self.fraction}: give a share of customers in (0, 1]")

    @property
    def enabled(self) -> bool:
        """Whether the rule drifts at all."""
        return bool(self.every or self.steps)

    def index(self, step: int) -> int:
        """How many drifts have happened by step ``step`` (0 before the first)."""
        if self.every:
            return max(step, 0) // self.every
        return sum(1 for s in self.steps if s <= step)

    def moved(self, n_keys: int) -> int:
        """How many keys get a new target at each drift."""
        return max(1, round(self.fraction * n_keys))

    def rule_at(self, rule: HiddenRule, base: dict[str, str], step: int, *, seed: int,
                family_id: str) -> dict[str, str]:
        """The map in force at ``step``: ``base`` (the map at step 0) after every drift so
        far; drift ``k`` moves :meth:`moved` keys, chosen with their new targets (never the
        current one) from ``(seed, family_id, k)``."""
        current = dict(base)
        for k in range(1, self.index(step) + 1):
            rng = random.Random(f"lopd-hidden-rule-drift:{seed}:{family_id}:{k}")
            for key in rng.sample(sorted(rule.keys), self.moved(len(rule.keys))):
                current[key] = rng.choice([v for v in rule.values if v != current[key]])
        return current


def drift_schedule(every: int, steps: Sequence[int] | None, fraction: float) -> DriftSchedule:
    """The schedule from the task source's keyword arguments."""
    return DriftSchedule(every=int(every), steps=tuple(steps or ()), fraction=float(fraction))

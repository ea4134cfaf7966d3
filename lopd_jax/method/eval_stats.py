"""Evaluation statistics over finished rollouts: success, reward and the behaviour
statistics of the paper's Table 3.

Per trajectory, then averaged: ``success_rate`` (reward >= ``success_threshold``),
``mean_reward``, ``mean_env_steps``, ``repeated_calls`` (identical to an earlier call of the
episode) and ``first_response_tokens``; pooled: ``tool_calls_per_step`` and ``reward_per_call``
(``None`` without calls). Also mean tool calls, error observations, tokens, finish reasons and
the mean reward per task family. :func:`no_tool_baseline` is the reward of answering at once
without any tool call on the same tasks: the floor a reported reward should be read against.
Definitions in full: ``docs/evaluation.md``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Sequence

from lopd_jax.core.types import AssistantTurn


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def behaviour_stats(trajectories: Sequence[Any], success_threshold: float = 1.0) -> dict[str, Any]:
    """The statistics above for :class:`lopd_jax.rollout.episodes.Trajectory` objects."""
    if not trajectories:
        raise ValueError("behaviour_stats needs at least one trajectory")
    rewards = [float(t.reward) for t in trajectories]
    steps = [int(t.env_stats.get("turns", 0)) for t in trajectories]
    calls = [int(t.env_stats.get("tool_calls", 0)) for t in trajectories]
    families: dict[str, list[float]] = defaultdict(list)
    for t in trajectories:
        families[t.task.family or t.task.env_id].append(float(t.reward))
    total_calls = sum(calls)
    return {
        "num_trajectories": len(trajectories),
        "success_rate": _mean([r >= success_threshold for r in rewards]),
        "mean_reward": _mean(rewards),
        "mean_env_steps": _mean(steps),
        "tool_calls_per_step": float(total_calls / sum(steps)) if sum(steps) else 0.0,
        "repeated_calls": _mean([int(t.env_stats.get("repeated_calls", 0)) for t in trajectories]),
        "first_response_tokens": _mean([t.turn_lengths[0] if t.turn_lengths else 0 for t in trajectories]),
        "reward_per_call": float(sum(rewards) / total_calls) if total_calls else None,
        "mean_tool_calls": _mean(calls),
        "mean_errors": _mean([int(t.env_stats.get("errors", 0)) for t in trajectories]),
        "mean_generated_tokens": _mean([float(sum(t.turn_lengths)) for t in trajectories]),
        "mean_total_tokens": _mean([float(len(t.tokens)) for t in trajectories]),
        "finish_reasons": dict(Counter(t.finish_reason for t in trajectories)),
        "reward_by_family": {k: _mean(v) for k, v in sorted(families.items())},
    }


def no_tool_baseline(make_env: Any, tasks: Sequence[Any], answer: str = "Done.") -> float:
    """Mean reward over ``tasks`` of answering ``answer`` in plain text at once (no tool call).

    ``make_env`` is the task source's environment factory; each episode is one
    ``Environment.step`` with the plain-text answer, which ends it.
    """

    if not tasks:
        raise ValueError("no_tool_baseline needs at least one task")
    rewards = []
    for task in tasks:
        with make_env() as env:
            env.reset(task)
            result = env.step(AssistantTurn(raw=answer, content=answer))
            rewards.append(float(result.reward if result.done else env.finish()))
    return _mean(rewards)

"""Chat-format rollouts on the continuous-batching :class:`train.engine.Engine`.

:func:`engine_rollout` takes what :func:`train.rollout.rollout` takes (tasks, a policy's
parameters, a chat format, an environment factory, caps) and returns the same
:class:`train.rollout.Trajectory` s -- exact token ids, both log-probs, masks, messages,
rewards, finish reasons -- with each episode advanced by the engine: its turns go to its
environment on the engine's thread pool (``EngineConfig.env_workers``; the rollout's
``env_workers`` is not used) while the other episodes keep decoding.

Episode ``i`` samples with ``fold_in(rng, i)`` (then the token's position), so a task's
trajectory depends on ``rng``, its index and the weights only.

An environment whose ``step`` raises ends its own episode with finish reason
``"env_error"`` and reward 0 (the environment contract says ``step`` never raises for
anything the model wrote, so this is a broken environment, not a model error).

Not supported here (yet): composer latents (:class:`train.rollout.LatentContext`),
multi-host rows and host-side stop strings; :func:`train.rollout.rollout` still serves them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from lopd_jax.chat_base import ChatFormat
from lopd_jax.envs.base import Environment
from lopd_jax.types import Task
from train.engine import Engine, EpisodeSpec
from train.rollout import RolloutConfig, Trajectory, _advance, _Episode, start_episode
from train.sampling import SamplingParams

__all__ = ["FINISH_ENV_ERROR", "engine_rollout"]

FINISH_ENV_ERROR = "env_error"


def engine_rollout(engine: Engine, params, fmt: ChatFormat, make_env: Callable[[], Environment],
                   tasks: Sequence[Task], rng: jax.Array, config: RolloutConfig = RolloutConfig(),
                   sampling: SamplingParams | None = None) -> list[Trajectory]:
    """Run one episode per task on ``engine``; one :class:`Trajectory` per task, in order.

    Args mirror :func:`train.rollout.rollout` (see the module docstring for what differs).
    The engine's run metrics are left in ``engine.metrics``.
    """
    if not tasks:
        raise ValueError("engine_rollout needs at least one task")
    missing = set(fmt.stop_ids) - set(engine.stop_ids)
    if missing:
        raise ValueError(f"the engine does not stop on the chat format's stop ids {sorted(missing)}; "
                         f"build it with Engine(..., stop_ids=fmt.stop_ids)")
    episodes: list[_Episode] = []
    try:
        for task in tasks:
            episodes.append(start_episode(task, make_env, fmt, config))

        def stepper(ep: _Episode):
            def step(ids: np.ndarray, lps: np.ndarray, raws: np.ndarray):
                _advance(ep, ids, lps, raws, fmt, config)
                return None if ep.finish_reason is not None else ep.pending[1:]
            return step

        specs = [EpisodeSpec(ep.pending, config.max_total_tokens, config.max_turn_tokens, stepper(ep))
                 for ep in episodes]
        results = engine.run(params, specs, rng, sampling)
        for ep, res in zip(episodes, results):
            if res.error is not None and ep.finish_reason is None:
                ep.end(0.0, FINISH_ENV_ERROR)
        return [ep.result() for ep in episodes]
    finally:
        for ep in episodes:
            ep.env.close()

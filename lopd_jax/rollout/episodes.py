"""Multi-turn rollouts (docs/method.md, "Rollout") on the rollout engine.

:func:`rollout` runs one episode per task: each episode's prompt, then its turns, each
turn's text parsed with its :class:`lopd_jax.chat.base.ChatFormat` and passed to its
:class:`Environment.step`, and the observation ids from ``ChatFormat.observation_ids``
appended -- with every episode advanced by :class:`lopd_jax.rollout.engine.Engine`: a finished turn
goes to its environment (on the engine's ``env_workers`` threads) while the other
episodes keep decoding, and its slot takes the next ready episode.

Token in, token out: ``Trajectory.tokens`` holds the exact sampled ids and the exact
observation ids; nothing is re-tokenized. ``mask`` is 1 exactly on generated assistant
tokens (each closing end-of-turn id included) and 0 on prompt / observation ids, including
an end-of-turn id the chat format supplies after a turn cut off by the per-turn cap.
``logprobs`` / ``raw_logprobs`` are aligned with ``tokens`` (entry ``j`` is the log-prob of
``tokens[j]``; 0 where ``mask`` is 0), so a training step compares them with the log-prob
its logits at ``j - 1`` give to ``tokens[j]``.

Determinism: task ``i`` of a call is episode ``first_episode + i``, sampled with
``fold_in(rng, first_episode + i)`` (then each token's position). Its trajectory depends
only on ``rng``, that identity and the weights -- not on the slots, the batch it was
rolled out in, the process that ran it or timing.

Composer conditioning (the paper's "Base + Composer" row): with a :class:`LatentContext`
the first chunk of each trajectory is the teacher-format prompt -- the latent block
(framing before, slots, framing after) inserted at the first user message's content, as
:mod:`lopd_jax.method.splice` builds it for training -- and the input embeddings of the slots are
the task's latent vectors (the other ids take the policy's own embeddings).
``Trajectory.tokens`` stay in the student's format (no block); the block's length counts
against ``max_total_tokens`` (the model's context).

Caps: at most ``max_env_steps`` environment steps; at most ``max_turn_tokens`` generated
per turn; at most ``max_total_tokens`` in the whole trajectory (prompt and observations
included). When a cap ends an episode, ``env.finish()`` scores the state. A turn cut off by
the total cap is not passed to the environment (it cannot be followed by an observation).
An environment whose ``step`` raises ends its own episode with finish reason
``"env_error"`` and reward 0 (the environment contract says ``step`` never raises for
anything the model wrote, so this is a broken environment, not a model error).

Multi-host: each process rolls out its own tasks on its own engine (no per-turn
cross-host step); ``first_episode`` is the global index of its first task. The policy's
parameters are brought to the engine's layout on the process's devices first
(:meth:`Engine.local_params`: LoRA merged, sampling dtype, split over the engine's
``tensor`` axis; one collective when they span processes, so every process calls
:func:`rollout`, even one without tasks).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from lopd_jax.chat.base import ChatFormat, TokenTrajectory
from lopd_jax.envs.base import Environment
from lopd_jax.core.shapes import bucket
from lopd_jax.method.splice import SpliceLayout
from lopd_jax.core.types import Message, Task, ToolSchema
from lopd_jax.settings.sections import RolloutConfig, SamplingParams
from lopd_jax.rollout.engine import Engine, EpisodeSpec

FINISH_DONE = "done"
FINISH_MAX_STEPS = "max_steps"
FINISH_MAX_TOKENS = "max_tokens"
FINISH_ENV_ERROR = "env_error"


@dataclasses.dataclass(frozen=True)
class LatentContext:
    """Latent conditioning of a rollout: ``latents[i]`` [num_slots, D] fill the slots of
    the block ``layout`` inserted into task ``i``'s prompt."""

    layout: SpliceLayout
    latents: jax.Array | np.ndarray

    def first_chunks(self, prompts: Sequence[Sequence[int]], insert_at: Sequence[int]) -> list[list[int]]:
        """Teacher-format prompts: the block's ids inserted at each insertion point."""
        block = [int(x) for x in self.layout.block_ids]
        return [list(p[:a]) + block + list(p[a:]) for p, a in zip(prompts, insert_at)]

    def slot_embeds(self, insert_at: Sequence[int]) -> list[tuple[int, np.ndarray]]:
        """Per task, ``(first slot position in its teacher-format prompt, latents [num_slots, D])``
        (:attr:`lopd_jax.rollout.engine.EpisodeSpec.embeds`)."""
        latents = np.asarray(jax.device_get(self.latents))
        first = len(self.layout.before_ids)
        return [(int(a) + first, latents[i]) for i, a in enumerate(insert_at)]


@dataclasses.dataclass
class Trajectory:
    """One finished episode, token in / token out.

    ``messages`` are the initial messages, then per step the parsed assistant message and
    the observation messages (for the experience bank). ``insert_at`` is the index in
    ``tokens`` where the first user message's content starts (the latent splice point).
    ``num_turns`` counts generated assistant turns, ``turn_lengths`` their token counts.
    ``finish_reason`` is ``"done"`` (the environment ended it), ``"max_steps"`` or
    ``"max_tokens"`` (a cap ended it and ``env.finish()`` scored it), or ``"env_error"``
    (its environment raised; reward 0).
    """

    task: Task
    tokens: np.ndarray
    mask: np.ndarray
    logprobs: np.ndarray
    raw_logprobs: np.ndarray
    messages: list[Message]
    tools: list[ToolSchema]
    reward: float
    env_stats: dict
    num_turns: int
    turn_lengths: list[int]
    insert_at: int
    finish_reason: str

    def __len__(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass
class _Episode:
    """Host-side state of one running trajectory."""

    task: Task
    env: Environment
    messages: list[Message]
    tools: list[ToolSchema]
    traj: TokenTrajectory
    insert_at: int
    pending: list[int]
    logprobs: list[float] = dataclasses.field(default_factory=list)
    raw_logprobs: list[float] = dataclasses.field(default_factory=list)
    turn_lengths: list[int] = dataclasses.field(default_factory=list)
    steps: int = 0
    extra: int = 0  # context tokens the model sees beyond ``traj`` (an inserted latent block)
    reward: float | None = None
    finish_reason: str | None = None

    def add_context(self, ids: Sequence[int]) -> None:
        self.traj.add_context(ids)
        self.logprobs += [0.0] * len(ids)
        self.raw_logprobs += [0.0] * len(ids)

    def end(self, reward: float, reason: str) -> None:
        self.reward, self.finish_reason = float(reward), reason

    def result(self) -> Trajectory:
        return Trajectory(
            task=self.task, tokens=np.asarray(self.traj.ids, np.int32), mask=np.asarray(self.traj.mask, np.int32),
            logprobs=np.asarray(self.logprobs, np.float32), raw_logprobs=np.asarray(self.raw_logprobs, np.float32),
            messages=self.messages, tools=self.tools, reward=self.reward, env_stats=self.env.stats.as_dict(),
            num_turns=len(self.turn_lengths), turn_lengths=self.turn_lengths, insert_at=self.insert_at,
            finish_reason=self.finish_reason)



def start_episode(task: Task, make_env: Callable[[], Environment], fmt: ChatFormat,
                  config: RolloutConfig) -> _Episode:
    """A new episode for ``task``: a fresh environment, reset, and its prompt as context.

    Raises ValueError when the prompt alone reaches ``config.max_total_tokens``.
    """
    env = make_env()
    messages, tools = env.reset(task)
    prompt = fmt.prompt_ids(messages, tools)
    if len(prompt) >= config.max_total_tokens:
        env.close()
        raise ValueError(f"task {task.task_id!r}: the prompt has {len(prompt)} tokens, not below "
                         f"max_total_tokens={config.max_total_tokens}; raise the cap")
    ep = _Episode(task, env, list(messages), list(tools), TokenTrajectory(), fmt.insertion_point(prompt),
                  list(prompt))
    ep.add_context(prompt)
    return ep

def _advance(ep: _Episode, ids: np.ndarray, lps: np.ndarray, raws: np.ndarray, fmt: ChatFormat,
             cfg: RolloutConfig) -> None:
    """Record one generated turn, step the environment, append the observation."""
    ep.traj.add_generated(ids)
    ep.logprobs += [float(x) for x in lps]
    ep.raw_logprobs += [float(x) for x in raws]
    ep.turn_lengths.append(len(ids))
    closed = len(ids) > 0 and int(ids[-1]) in fmt.stop_ids
    if not closed and len(ep.traj) + ep.extra >= cfg.max_total_tokens:
        ep.end(ep.env.finish(), FINISH_MAX_TOKENS)
        return
    turn = fmt.parse_generated(ids)
    result = ep.env.step(turn)
    ep.steps += 1
    ep.messages.append(fmt.assistant_message(turn))
    if result.done:
        ep.end(result.reward, FINISH_DONE)
        return
    if ep.steps >= cfg.max_env_steps:
        ep.end(ep.env.finish(), FINISH_MAX_STEPS)
        return
    obs_ids = fmt.observation_ids(result.observation, turn_closed=closed)
    if len(ep.traj) + ep.extra + len(obs_ids) >= cfg.max_total_tokens:  # no room left for a generated token
        ep.end(ep.env.finish(), FINISH_MAX_TOKENS)
        return
    ep.messages.extend(result.observation)
    ep.add_context(obs_ids)
    # The loop never feeds a turn's last sampled id to the cache; it goes first.
    ep.pending = [int(ids[-1]), *obs_ids]


def rollout(engine: Engine, params, fmt: ChatFormat, make_env: Callable[[], Environment],
            tasks: Sequence[Task], rng: jax.Array, config: RolloutConfig = RolloutConfig(),
            sampling: SamplingParams | None = None, latents: LatentContext | None = None,
            first_episode: int = 0, on_finish: Callable[[int], None] | None = None) -> list[Trajectory]:
    """Run one episode per task (repeat a task for a group) on ``engine``.

    Args:
      engine: the rollout engine (its stop ids must include ``fmt.stop_ids``).
      params: the policy's pure parameter dict (e.g. the student's current parameters, in
        the trainer's layout), or :meth:`Engine.local_params` of it.
      fmt: the chat format of the model's tokenizer.
      make_env: environment factory (e.g. ``TaskSource.make_env``); one env per task.
      tasks: the tasks, in output order (multi-host: this process's; may be empty).
      rng: PRNG key; episode ``e`` samples with ``fold_in(rng, e)`` (see the module docstring).
      config: episode caps.
      sampling: overrides the engine's default :class:`SamplingParams`.
      latents: optional :class:`LatentContext` (one latent row per task): condition the
        policy on composer latents (see the module docstring).
      first_episode: the identity of ``tasks[0]`` (its index in the whole batch).
      on_finish: called with the number of this process's episodes that just ended
        (progress reporting).

    Returns:
      One :class:`Trajectory` per task, in order. The engine's run metrics are left in
      ``engine.metrics``.
    """
    params, rng = engine.local_params(params), engine.local_key(rng)  # a collective when they span processes
    if not tasks:
        return []
    missing = set(fmt.stop_ids) - set(engine.stop_ids)
    if missing:
        raise ValueError(f"the engine does not stop on the chat format's stop ids {sorted(missing)}; "
                         f"build it with Engine(..., stop_ids=fmt.stop_ids)")
    episodes: list[_Episode] = []
    try:
        for task in tasks:
            episodes.append(start_episode(task, make_env, fmt, config))
        embeds = [None] * len(episodes)
        if latents is not None:
            n = np.shape(latents.latents)[0]
            if n != len(episodes):
                raise ValueError(f"LatentContext has latents for {n} tasks but {len(episodes)} tasks are rolled out")
            firsts = latents.first_chunks([ep.pending for ep in episodes], [ep.insert_at for ep in episodes])
            embeds = latents.slot_embeds([ep.insert_at for ep in episodes])
            for ep, first in zip(episodes, firsts):
                ep.pending, ep.extra = first, latents.layout.length
                if len(first) >= config.max_total_tokens:
                    raise ValueError(f"task {ep.task.task_id!r}: the prompt with the latent block has {len(first)} "
                                     f"tokens, not below max_total_tokens={config.max_total_tokens}; raise the cap")

        def stepper(ep: _Episode):
            def step(ids: np.ndarray, lps: np.ndarray, raws: np.ndarray):
                _advance(ep, ids, lps, raws, fmt, config)
                return None if ep.finish_reason is not None else ep.pending[1:]
            return step

        specs = [EpisodeSpec(ep.pending, config.max_total_tokens, config.max_turn_tokens, stepper(ep), embeds=e)
                 for ep, e in zip(episodes, embeds)]
        results = engine.run(params, specs, rng, sampling, first_id=first_episode, on_finish=on_finish)
        for ep, res in zip(episodes, results):
            if res.error is not None and ep.finish_reason is None:
                ep.end(0.0, FINISH_ENV_ERROR)
        return [ep.result() for ep in episodes]
    finally:
        for ep in episodes:
            ep.env.close()


def training_arrays(trajectories: Sequence[Trajectory], *, length: int | None = None,
                    buckets: Sequence[int] = (), minimum: int = 16, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Right-padded numpy arrays for a training step.

    The sequence length is ``length`` if given (an error if a trajectory is longer), else
    the length bucket of the longest trajectory. Returns ``tokens`` [B, S] int32,
    ``mask`` [B, S] float32 (supervision), ``attention_mask`` [B, S] bool, ``logprobs`` and
    ``raw_logprobs`` [B, S] float32 (aligned with ``tokens``), ``rewards`` [B] float32,
    ``insert_at`` [B] int32 and ``lengths`` [B] int32.
    """
    if not trajectories:
        raise ValueError("training_arrays needs at least one trajectory")
    longest = max(len(t) for t in trajectories)
    S = bucket(longest, buckets, minimum) if length is None else int(length)
    if longest > S:
        raise ValueError(f"a trajectory has {longest} tokens but length={S}; raise the length "
                         "or lower max_total_tokens")
    B = len(trajectories)
    out = {"tokens": np.full((B, S), pad_id, np.int32), "mask": np.zeros((B, S), np.float32),
           "attention_mask": np.zeros((B, S), bool), "logprobs": np.zeros((B, S), np.float32),
           "raw_logprobs": np.zeros((B, S), np.float32),
           "rewards": np.asarray([t.reward for t in trajectories], np.float32),
           "insert_at": np.asarray([t.insert_at for t in trajectories], np.int32),
           "lengths": np.asarray([len(t) for t in trajectories], np.int32)}
    for b, t in enumerate(trajectories):
        n = len(t)
        out["tokens"][b, :n] = t.tokens
        out["mask"][b, :n] = t.mask
        out["attention_mask"][b, :n] = True
        out["logprobs"][b, :n] = t.logprobs
        out["raw_logprobs"][b, :n] = t.raw_logprobs
    return out

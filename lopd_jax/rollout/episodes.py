"""Multi-turn chat episodes (docs/method.md, "Rollout") on the continuous-batching engine (:mod:`lopd_jax.rollout.engine`).

:func:`rollout` runs one episode per task: its prompt, then turns parsed with the
:class:`lopd_jax.chat.base.ChatFormat`, each passed to :meth:`Environment.step` (on the
engine's ``env_workers`` threads) and answered with ``ChatFormat.observation_ids``. Token in,
token out: ``Trajectory.tokens`` are the sampled and observation ids, never re-tokenized;
``mask`` is 1 on generated ids; ``logprobs`` are aligned with ``tokens``. Task ``i`` is
episode ``first_episode + i``: its tokens depend on ``rng``, that identity and the weights
only. With a :class:`LatentContext` the first chunk carries the composer's latent block.
Caps (``max_env_steps``, ``max_turn_tokens``, ``max_total_tokens``) end an episode scored by
``env.finish()``; observations longer than ``max_observation_chars`` are cut (with a note).
Environment faults end only their own episode (finish reason ``"env_error"``, reward 0, the
cause in ``Trajectory.error``, counted in ``engine.metrics``); every environment is closed
exactly once, as soon as its episode ends. Multi-host: every process calls it (one collective).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import math
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from lopd_jax.chat.base import ChatFormat, TokenTrajectory
from lopd_jax.envs.base import Environment
from lopd_jax.core.shapes import bucket
from lopd_jax.method.splice import SpliceLayout
from lopd_jax.core.text import clean_text
from lopd_jax.core.types import Message, StepResult, Task, ToolSchema
from lopd_jax.settings.sections import RolloutConfig, SamplingParams
from lopd_jax.rollout.engine import Engine
from lopd_jax.rollout.env_threads import EnvThreads
from lopd_jax.rollout.episode_spec import EpisodeResult, EpisodeSpec

FINISH_DONE = "done"
FINISH_MAX_STEPS = "max_steps"
FINISH_MAX_TOKENS = "max_tokens"
FINISH_ENV_ERROR = "env_error"
MAX_ERROR_CHARS = 2000  # the longest fault text kept on a trajectory


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
        (:attr:`lopd_jax.rollout.episode_spec.EpisodeSpec.embeds`)."""
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
    (its environment failed; reward 0). ``error`` names the failing call and its cause
    (``"reset: RuntimeError: ..."``, ``"step: ..."``, ``"timeout: ..."``; a failing
    ``close`` after a finished episode is noted here and keeps its result).
    ``policy_version`` is the update count of the student whose weights sampled its oldest
    generated token, ``latest_version`` its newest (they differ for a partial rollout that
    went on under new weights; set by the training stage, 0 elsewhere).
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
    error: str | None = None
    policy_version: int = 0
    latest_version: int = 0

    def __len__(self) -> int:
        return len(self.tokens)


def _fault(stage: str, exc: BaseException | str) -> str:
    """``"stage: Type: message"`` (cut to ``MAX_ERROR_CHARS``, always valid text)."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return clean_text(f"{stage}: {text}")[:MAX_ERROR_CHARS]


@dataclasses.dataclass
class _Episode:
    """Host-side state of one running trajectory. Its environment's calls run on a step
    thread; the state is changed under ``lock`` and never after :meth:`abandon`."""

    task: Task
    env: Environment | None
    messages: list[Message] = dataclasses.field(default_factory=list)
    tools: list[ToolSchema] = dataclasses.field(default_factory=list)
    traj: TokenTrajectory = dataclasses.field(default_factory=TokenTrajectory)
    insert_at: int = 0
    pending: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    raw_logprobs: list[float] = dataclasses.field(default_factory=list)
    turn_lengths: list[int] = dataclasses.field(default_factory=list)
    steps: int = 0
    extra: int = 0  # context tokens the model sees beyond ``traj`` (an inserted latent block)
    reward: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    stage: str = "reset"  # the environment call under way (names a fault)
    abandoned: bool = False
    closed: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add_context(self, ids: Sequence[int]) -> None:
        self.traj.add_context(ids)
        self.logprobs += [0.0] * len(ids)
        self.raw_logprobs += [0.0] * len(ids)

    def end(self, reward: float, reason: str, error: str | None = None) -> None:
        """End the episode (no-op once ended or abandoned)."""
        with self.lock:
            if self.finish_reason is None and not self.abandoned:
                self.reward, self.finish_reason, self.error = float(reward), reason, error

    def fail(self, error: str) -> None:
        """End the episode as an environment error."""
        self.end(0.0, FINISH_ENV_ERROR, error)

    def score(self, reason: str) -> None:
        """End the episode at a cap, scored by ``env.finish()`` (a failing one is a fault)."""
        self.stage = "finish"
        reward = float(self.env.finish())
        if not math.isfinite(reward):
            raise ValueError(f"finish() returned the reward {reward}; rewards are finite numbers in [0, 1]")
        self.end(reward, reason)

    def abandon(self) -> None:
        """The engine gave up on this episode's step: later results of it are dropped."""
        with self.lock:
            self.abandoned = True

    def close(self) -> str | None:
        """Close the environment once; the fault text if ``close`` raised."""
        with self.lock:
            if self.closed or self.env is None:
                return None
            self.closed = True
        try:
            self.env.close()
        except Exception as exc:  # the episode's result stands; the fault is noted
            return _fault("close", exc)
        return None

    def result(self) -> Trajectory:
        with self.lock:
            try:
                stats = self.env.stats.as_dict() if self.env is not None else {}
            except Exception:  # a broken environment's statistics are not worth a batch
                stats = {}
            return Trajectory(
                task=self.task, tokens=np.asarray(self.traj.ids, np.int32),
                mask=np.asarray(self.traj.mask, np.int32), logprobs=np.asarray(self.logprobs, np.float32),
                raw_logprobs=np.asarray(self.raw_logprobs, np.float32), messages=list(self.messages),
                tools=list(self.tools), reward=0.0 if self.reward is None else self.reward, env_stats=stats,
                num_turns=len(self.turn_lengths), turn_lengths=list(self.turn_lengths), insert_at=self.insert_at,
                finish_reason=self.finish_reason or FINISH_ENV_ERROR, error=self.error)


def bound_messages(messages: Sequence[Message], max_chars: int) -> list[Message]:
    """``messages`` with every text content longer than ``max_chars`` cut there, followed by
    a note saying how much was left out; raises TypeError for an entry that is not a message."""
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise TypeError(f"an observation holds a {type(m).__name__}, not a message dict")
        content = m.get("content")
        if isinstance(content, str) and len(content) > max_chars:
            m = {**m, "content": content[:max_chars] + f"\n[output cut: {len(content) - max_chars} of "
                 f"{len(content)} characters left out (rollout.max_observation_chars={max_chars})]"}
        out.append(m)
    return out


def start_episode(task: Task, make_env: Callable[[], Environment], fmt: ChatFormat,
                  config: RolloutConfig) -> _Episode:
    """A new episode for ``task``: a fresh environment, reset, and its prompt as context.

    An environment that cannot be made or reset, or whose reset gives no prompt below
    ``config.max_total_tokens``, yields an episode already ended as an ``env_error``
    (its environment closed).
    """
    ep = _Episode(task, None)
    try:
        ep.stage = "make_env"
        ep.env = make_env()
        ep.stage = "reset"
        out = ep.env.reset(task)
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], (list, tuple))):
            raise TypeError(f"reset returned {type(out).__name__}, not (messages, tools)")
        messages, tools = bound_messages(out[0], config.max_observation_chars), list(out[1] or [])
        ep.stage = "prompt"
        prompt = fmt.prompt_ids(messages, tools)
        if len(prompt) >= config.max_total_tokens:
            raise ValueError(f"task {task.task_id!r}: the prompt has {len(prompt)} tokens, not below "
                             f"max_total_tokens={config.max_total_tokens}; raise the cap")
        ep.insert_at = fmt.insertion_point(prompt)
    except Exception as exc:
        ep.fail(_fault(ep.stage, exc))
        ep.close()  # the reset's fault is the one kept
        return ep
    ep.messages, ep.tools, ep.pending = list(messages), tools, list(prompt)
    ep.add_context(prompt)
    return ep


def _step(ep: _Episode, turn) -> StepResult:
    ep.stage = "step"
    result = ep.env.step(turn)
    if not isinstance(getattr(result, "done", None), bool) or not isinstance(
            getattr(result, "observation", None), (list, tuple)):
        raise TypeError(f"step returned {type(result).__name__}, not a StepResult (observation list, done flag)")
    if result.done and not math.isfinite(float(result.reward)):
        raise ValueError(f"step returned the reward {result.reward}; rewards are finite numbers in [0, 1]")
    return result


def _advance(ep: _Episode, ids: np.ndarray, lps: np.ndarray, raws: np.ndarray, fmt: ChatFormat,
             cfg: RolloutConfig) -> None:
    """Record one generated turn, step the environment, append the observation (or end)."""
    with ep.lock:
        if ep.abandoned:
            return
        ep.traj.add_generated(ids)
        ep.logprobs += [float(x) for x in lps]
        ep.raw_logprobs += [float(x) for x in raws]
        ep.turn_lengths.append(len(ids))
    closed = len(ids) > 0 and int(ids[-1]) in fmt.stop_ids
    if not closed and len(ep.traj) + ep.extra >= cfg.max_total_tokens:
        return ep.score(FINISH_MAX_TOKENS)
    turn = fmt.parse_generated(ids)
    result = _step(ep, turn)
    with ep.lock:
        if ep.abandoned:
            return
        ep.steps += 1
        ep.messages.append(fmt.assistant_message(turn))
    if result.done:
        return ep.end(result.reward, FINISH_DONE)
    if ep.steps >= cfg.max_env_steps:
        return ep.score(FINISH_MAX_STEPS)
    ep.stage = "observation"
    observation = bound_messages(result.observation, cfg.max_observation_chars)
    obs_ids = fmt.observation_ids(observation, turn_closed=closed)
    if len(ep.traj) + ep.extra + len(obs_ids) >= cfg.max_total_tokens:  # no room left for a generated token
        return ep.score(FINISH_MAX_TOKENS)
    with ep.lock:
        if ep.abandoned:
            return
        ep.messages.extend(observation)
        ep.add_context(obs_ids)
        # The loop never feeds a turn's last sampled id to the cache; it goes first.
        ep.pending = [int(ids[-1]), *obs_ids]


def _stepper(ep: _Episode, fmt: ChatFormat, config: RolloutConfig):
    """The engine's ``step`` for ``ep``: the next ids, or None once the episode ended (its
    environment then closed); any fault of the environment ends this episode only."""
    def step(ids: np.ndarray, lps: np.ndarray, raws: np.ndarray):
        try:
            _advance(ep, ids, lps, raws, fmt, config)
        except Exception as exc:
            ep.fail(_fault(ep.stage, exc))
        if ep.finish_reason is None and not ep.abandoned:
            return ep.pending[1:]
        closing = ep.close()
        if closing is not None:
            with ep.lock:
                ep.error = ep.error or closing
        return None
    return step


CLOSE_WORKERS = 8  # environments closed at once (a close usually ends a worker process)
_closers: list[EnvThreads] = []  # the process's one pool of closing threads, made on first use
_closers_lock = threading.Lock()


def _close_pool() -> EnvThreads:
    """The threads that close environments: one pool for the process, closed at exit."""
    with _closers_lock:
        if not _closers:
            _closers.append(EnvThreads(CLOSE_WORKERS, name="env-close"))
            atexit.register(_closers[0].close)
        return _closers[0]


def _close_all(episodes: Sequence[_Episode], timeout: float) -> None:
    """Close every environment not closed yet on the shared closing threads, waiting at
    most ``timeout`` seconds in all (0 = no limit); a close that raises or is not done by
    then is noted (one still queued runs later; a running one's thread is replaced)."""
    def close(ep):
        err = ep.close()
        if err is not None:
            with ep.lock:
                ep.error = ep.error or err
    pool = _close_pool()
    pending = {pool.submit(close, ep): ep for ep in episodes if not ep.closed and ep.env is not None}
    if not pending:
        return
    _, late = concurrent.futures.wait(pending, timeout=timeout or None)
    for fut in late:
        if fut.running():
            pool.abandon(fut)
        ep = pending[fut]
        with ep.lock:
            ep.error = ep.error or _fault("close", f"still running after engine.env_timeout_s={timeout:g}s")


def fault_counts(episodes: Sequence[_Episode]) -> dict[str, int]:
    """``env_errors`` (episodes ended by their environment) and ``env_error_<call>`` per
    failing call."""
    m = {"env_errors": sum(ep.finish_reason == FINISH_ENV_ERROR for ep in episodes)}
    for ep in episodes:
        if ep.error:
            key = "env_error_" + ep.error.split(":", 1)[0]
            m[key] = m.get(key, 0) + 1
    return m


@dataclasses.dataclass
class EpisodeBatch:
    """Episodes of a batch of tasks made ready for the engine (:func:`prepare_episodes`):
    ``episodes`` in task order, the indices of the ``live`` ones (those whose reset worked)
    and their :class:`EpisodeSpec` s, in that order."""

    episodes: list[_Episode]
    live: list[int]
    specs: list[EpisodeSpec]


def prepare_episodes(tasks: Sequence[Task], make_env: Callable[[], Environment], fmt: ChatFormat,
                     config: RolloutConfig, latents: LatentContext | None = None, first_episode: int = 0,
                     rng: np.ndarray | None = None) -> EpisodeBatch:
    """Start one episode per task (environments made and reset) and its engine spec; task
    ``i`` is identity ``first_episode + i``, sampled with the run's key or ``rng`` (key
    data). A failing reset ends its own episode (no spec). Close them with
    :func:`finish_episodes` (also on error)."""
    episodes: list[_Episode] = []
    try:
        for task in tasks:
            episodes.append(start_episode(task, make_env, fmt, config))
        embeds = [None] * len(episodes)
        if latents is not None:
            firsts = latents.first_chunks([ep.pending for ep in episodes], [ep.insert_at for ep in episodes])
            embeds = latents.slot_embeds([ep.insert_at for ep in episodes])
            for ep, first in zip(episodes, firsts):
                if ep.finish_reason is not None:
                    continue
                ep.pending, ep.extra = first, latents.layout.length
                if len(first) >= config.max_total_tokens:
                    raise ValueError(f"task {ep.task.task_id!r}: the prompt with the latent block has {len(first)} "
                                     f"tokens, not below max_total_tokens={config.max_total_tokens}; raise the cap")
    except BaseException:
        _close_all(episodes, 0.0)
        raise
    live = [i for i, ep in enumerate(episodes) if ep.finish_reason is None]
    specs = [EpisodeSpec(episodes[i].pending, config.max_total_tokens, config.max_turn_tokens,
                         _stepper(episodes[i], fmt, config), embeds=embeds[i], abandon=episodes[i].abandon,
                         identity=first_episode + i, rng=rng) for i in live]
    return EpisodeBatch(episodes, live, specs)


def finish_episodes(batch: EpisodeBatch, results: Sequence[EpisodeResult | None], close_timeout: float,
                    version: int = 0) -> list[Trajectory]:
    """The trajectories of a prepared batch from the engine's ``results`` (one per live
    episode, in order; None: the run dropped it unfinished, an ``env_error``). Every
    environment not closed yet is closed (waiting at most ``close_timeout`` seconds in all).
    Each trajectory's ``policy_version`` / ``latest_version`` are the oldest / newest
    versions of the weights that sampled its tokens (``version`` for one without any)."""
    try:
        for i, res in zip(batch.live, results):
            ep = batch.episodes[i]
            if res is None:
                error = _fault("engine", "the run ended before the episode (cancelled)")
            elif res.error is None:
                continue
            else:
                error = res.error if res.error.startswith("timeout") else _fault("engine", res.error)
            with ep.lock:  # a timed-out step (abandoned) or a fault the engine caught
                if ep.finish_reason is None or ep.abandoned:
                    ep.reward, ep.finish_reason, ep.error = 0.0, FINISH_ENV_ERROR, error
    finally:
        _close_all(batch.episodes, close_timeout)
    trajs = [ep.result() for ep in batch.episodes]
    for t in trajs:
        t.policy_version = t.latest_version = version
    for i, res in zip(batch.live, results):
        if res is not None:
            trajs[i].policy_version, trajs[i].latest_version = res.version_range(version)
    return trajs


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
      One :class:`Trajectory` per task, in order. The engine's run metrics, with the
      environment faults counted, are left in ``engine.metrics``.
    """
    params, rng = engine.local_params(params), engine.local_key(rng)  # a collective when they span processes
    if not tasks:
        return []
    missing = set(fmt.stop_ids) - set(engine.stop_ids)
    if missing:
        raise ValueError(f"the engine does not stop on the chat format's stop ids {sorted(missing)}; "
                         f"build it with Engine(..., stop_ids=fmt.stop_ids)")
    if latents is not None and np.shape(latents.latents)[0] != len(tasks):
        raise ValueError(f"LatentContext has latents for {np.shape(latents.latents)[0]} tasks but {len(tasks)} "
                         "tasks are rolled out")
    batch = prepare_episodes(tasks, make_env, fmt, config, latents, first_episode)
    results = []
    try:
        if len(batch.live) < len(batch.episodes) and on_finish is not None:
            on_finish(len(batch.episodes) - len(batch.live))
        if batch.specs:
            results = engine.run(params, batch.specs, rng, sampling, first_id=first_episode, on_finish=on_finish)
        else:
            engine.metrics, engine.last_timing = {}, None
    finally:
        trajs = finish_episodes(batch, results + [None] * (len(batch.live) - len(results)),
                                engine.config.env_timeout_s)
    engine.metrics = {**engine.metrics, **fault_counts(batch.episodes)}
    return trajs


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

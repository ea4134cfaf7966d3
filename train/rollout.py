"""The multi-turn rollout loop (SPEC 2.2): a batch of trajectories advancing together.

Each turn, every active trajectory gets one assistant turn from :class:`train.sampler.Sampler`
(one compiled prefill + decode call for the whole batch, KV cache reused across turns).
Between turns, on the host, each trajectory's new ids are decoded and parsed with its
:class:`lopd_jax.chat_base.ChatFormat`, passed to its :class:`Environment.step`, and the
observation ids from ``ChatFormat.observation_ids`` are appended. Finished trajectories drop
out of the batch (the cache shrinks to a smaller batch bucket when it can).

Token in, token out: ``Trajectory.tokens`` holds the exact sampled ids and the exact
observation ids; nothing is re-tokenized. ``mask`` is 1 exactly on generated assistant
tokens (each closing end-of-turn id included) and 0 on prompt / observation ids, including
an end-of-turn id the chat format supplies after a turn cut off by the per-turn cap.
``logprobs`` / ``raw_logprobs`` are aligned with ``tokens`` (entry ``j`` is the log-prob of
``tokens[j]``; 0 where ``mask`` is 0), so a training step compares them with the log-prob
its logits at ``j - 1`` give to ``tokens[j]``.

Composer conditioning (the paper's "Base + Composer" row): with a :class:`LatentContext`
the first chunk of each trajectory is the teacher-format prompt -- the latent block
(framing before, slots, framing after) inserted at the first user message's content, as
:mod:`lopd_jax.splice` builds it for training -- and the prefill's input embeddings of the
slots are the task's latent vectors. ``Trajectory.tokens`` stay in the student's format
(no block); the block's length counts against ``max_total_tokens`` (the model's context).

Caps: at most ``max_env_steps`` environment steps; at most ``max_turn_tokens`` generated
per turn; at most ``max_total_tokens`` in the whole trajectory (prompt and observations
included). When a cap ends an episode, ``env.finish()`` scores the state. A turn cut off by
the total cap is not passed to the environment (it cannot be followed by an observation).

Multi-host (a :attr:`Sampler.multihost` sampler): ``tasks`` are this process's rows only
and ``global_rows`` the size of the whole batch; this process runs only its own
environments, in the cache rows it owns (:meth:`Sampler.local_rows`), and may have no
tasks at all. Every process makes the same number of sampler calls: a turn runs while
any row on any host is live (one small cross-host reduction per turn).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lopd_jax.chat_base import ChatFormat, TokenTrajectory
from lopd_jax.envs.base import Environment
from lopd_jax.splice import SpliceLayout, splice_latents
from lopd_jax.types import Message, Task, ToolSchema
from train import distributed
from train.sampler import Sampler, SamplingParams, bucket

FINISH_DONE = "done"
FINISH_MAX_STEPS = "max_steps"
FINISH_MAX_TOKENS = "max_tokens"


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Episode caps (SPEC 2.2) and host-side parallelism.

    ``env_workers > 0`` runs parsing and ``Environment.step`` of the batch's trajectories
    in that many threads (useful for subprocess-isolated environments).
    """

    max_env_steps: int = 30
    max_turn_tokens: int = 2048
    max_total_tokens: int = 40_960
    env_workers: int = 0

    def __post_init__(self):
        for name in ("max_env_steps", "max_turn_tokens", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"RolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.env_workers < 0:
            raise ValueError(f"RolloutConfig.env_workers must be >= 0, got {self.env_workers}")


@dataclasses.dataclass(frozen=True)
class LatentContext:
    """Latent conditioning of a rollout: ``latents[i]`` [num_slots, D] fill the slots of
    the block ``layout`` inserted into task ``i``'s prompt; ``embed`` maps ids [B, C] to the
    policy's input embeddings [B, C, D] (e.g. its embedding table)."""

    layout: SpliceLayout
    latents: jax.Array | np.ndarray
    embed: Callable

    def first_chunks(self, prompts: Sequence[Sequence[int]], insert_at: Sequence[int]) -> list[list[int]]:
        """Teacher-format prompts: the block's ids inserted at each insertion point."""
        block = [int(x) for x in self.layout.block_ids]
        return [list(p[:a]) + block + list(p[a:]) for p, a in zip(prompts, insert_at)]

    def embeds(self, chunks: Sequence[Sequence[int] | None], rows: Sequence[int | None], insert_at: Sequence[int]):
        """Input embeddings [len(chunks), C, D] of right-padded ``chunks`` (row ``r`` holds
        task ``rows[r]``) with the slots replaced by the tasks' latents."""
        C = max(len(c) for c in chunks if c is not None)
        ids = np.zeros((len(chunks), C), np.int32)
        at = np.zeros(len(chunks), np.int32)
        take = np.zeros(len(chunks), np.int32)
        for r, (c, i) in enumerate(zip(chunks, rows)):
            if c is not None:
                ids[r, :len(c)] = c
                at[r], take[r] = insert_at[i], i
        latents = jnp.take(jnp.asarray(self.latents), jnp.asarray(take), axis=0)
        return splice_latents(self.embed(jnp.asarray(ids)), latents, jnp.asarray(at), self.layout)


@dataclasses.dataclass
class Trajectory:
    """One finished episode, token in / token out.

    ``messages`` are the initial messages, then per step the parsed assistant message and
    the observation messages (for the experience bank). ``insert_at`` is the index in
    ``tokens`` where the first user message's content starts (the latent splice point).
    ``num_turns`` counts generated assistant turns, ``turn_lengths`` their token counts.
    ``finish_reason`` is ``"done"`` (the environment ended it), ``"max_steps"`` or
    ``"max_tokens"`` (a cap ended it and ``env.finish()`` scored it).
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


def rollout(sampler: Sampler, params, fmt: ChatFormat, make_env: Callable[[], Environment],
            tasks: Sequence[Task], rng: jax.Array, config: RolloutConfig = RolloutConfig(),
            sampling: SamplingParams | None = None, latents: LatentContext | None = None,
            global_rows: int | None = None, on_turn: Callable[[int], None] | None = None) -> list[Trajectory]:
    """Run one episode per task (repeat a task for a group) with all of them batched.

    Args:
      sampler: the batched sampler (its stop ids should be ``fmt.stop_ids``).
      params: the policy's pure parameter dict (e.g. the student's current parameters).
      fmt: the chat format of the model's tokenizer.
      make_env: environment factory (e.g. ``TaskSource.make_env``); one env per task.
      tasks: the tasks, in output order.
      rng: PRNG key; turn ``t`` samples with ``fold_in(rng, t)``.
      config: caps and host parallelism.
      sampling: overrides the sampler's default :class:`SamplingParams`.
      latents: optional :class:`LatentContext` (one latent row per task): condition the
        policy on composer latents (see the module docstring).
      global_rows: multi-host only: the rows of the whole batch over all processes
        (``tasks`` are this process's share; see the module docstring).
      on_turn: called after every turn with the number of this process's episodes that
        finished in it (progress reporting).

    Returns:
      One :class:`Trajectory` per task (this process's), in order.
    """
    multihost = sampler.multihost
    if multihost and global_rows is None:
        raise ValueError("a multi-host rollout needs global_rows (the batch size over all processes)")
    if not tasks and not multihost:
        raise ValueError("rollout needs at least one task")
    missing = set(fmt.stop_ids) - set(sampler.stop_ids)
    if missing:
        raise ValueError(f"the sampler does not stop on the chat format's stop ids {sorted(missing)}; "
                         f"build it with Sampler(..., stop_ids=fmt.stop_ids)")
    episodes: list[_Episode] = []
    pool = concurrent.futures.ThreadPoolExecutor(config.env_workers) if config.env_workers else None
    try:
        for task in tasks:
            episodes.append(start_episode(task, make_env, fmt, config))
        if latents is not None:
            n = np.shape(latents.latents)[0]
            if n != len(episodes):
                raise ValueError(f"LatentContext has latents for {n} tasks but {len(episodes)} tasks are rolled out")
            firsts = latents.first_chunks([ep.pending for ep in episodes], [ep.insert_at for ep in episodes])
            for ep, first in zip(episodes, firsts):
                ep.pending, ep.extra = first, latents.layout.length
                if len(first) >= config.max_total_tokens:
                    raise ValueError(f"task {ep.task.task_id!r}: the prompt with the latent block has {len(first)} "
                                     f"tokens, not below max_total_tokens={config.max_total_tokens}; raise the cap")
        rows: list[int | None] = list(range(len(episodes)))
        cache = sampler.new_cache(global_rows if multihost else len(rows))
        if multihost:
            lo, hi = sampler.local_rows(cache.batch)
            if len(rows) > hi - lo:
                raise ValueError(f"{len(rows)} tasks on this process but it owns {hi - lo} of the "
                                 f"{cache.batch} rows")
            rows += [None] * (hi - lo - len(rows))
        turn = 0
        while (distributed.global_any(any(r is not None for r in rows)) if multihost
               else any(r is not None for r in rows)):
            chunks = [None if i is None else episodes[i].pending for i in rows]
            caps = [0 if i is None else min(config.max_turn_tokens,
                                            config.max_total_tokens - len(episodes[i].traj) - episodes[i].extra)
                    for i in rows]
            embeds = None
            if latents is not None and turn == 0:
                if any(c is not None for c in chunks):
                    embeds = latents.embeds(chunks, rows, [ep.insert_at for ep in episodes])
                else:  # a process without tasks still feeds (empty) embeddings: the same program everywhere
                    lat = jnp.asarray(latents.latents)
                    embeds = np.zeros((len(chunks), 1, lat.shape[-1]), lat.dtype)
            gen, cache = sampler.extend(params, cache, chunks, caps, jax.random.fold_in(rng, turn), sampling=sampling,
                                        inputs_embeds=embeds)
            turn += 1
            work = [(r, i) for r, i in enumerate(rows) if i is not None]
            args = [(episodes[i], gen.tokens[r], gen.logprobs[r], gen.raw_logprobs[r], fmt, config) for r, i in work]
            if pool is None:
                for a in args:
                    _advance(*a)
            else:
                list(pool.map(lambda a: _advance(*a), args))
            before = sum(i is not None for i in rows)
            rows = [None if i is None or episodes[i].finish_reason is not None else i for i in rows]
            if on_turn is not None:
                on_turn(before - sum(i is not None for i in rows))
            live = [r for r, i in enumerate(rows) if i is not None]
            if live and not multihost and sampler.batch_bucket(len(live)) < cache.batch:
                cache = sampler.compact(cache, live)
                rows = [rows[r] for r in live] + [None] * (cache.batch - len(live))
        return [ep.result() for ep in episodes]
    finally:
        for ep in episodes:
            ep.env.close()
        if pool is not None:
            pool.shutdown()


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

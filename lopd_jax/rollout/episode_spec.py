"""What :meth:`lopd_jax.rollout.engine.Engine.run` takes and gives per episode: the
:class:`EpisodeSpec` (first chunk, caps, the environment step callback) and the
:class:`EpisodeResult` (turns, log-probs, the weights' versions, context, the error that
ended it), the engine's own bookkeeping of an episode in flight (:class:`EpisodeState`),
and the :class:`EpisodeFeed` a run takes more episodes (and new weights) from."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import numpy as np


@dataclasses.dataclass
class EpisodeSpec:
    """One episode for :meth:`Engine.run`.

    ``first``: the first chunk of ids; ``max_total``: cap on the context (ids fed plus
    generated); ``max_turn``: cap on tokens generated per turn; ``step(ids, logprobs,
    raw_logprobs)``: called (on a worker thread) with each finished turn, returns the
    observation ids to append, or None when the episode is over. ``turn_caps``: optional
    per-turn caps (turn ``j`` is also capped at ``turn_caps[j]``; e.g. a benchmark's forced
    turn lengths). ``embeds``: optional ``(start, vectors [k, D])``: the input embeddings
    of context positions ``start .. start + k - 1`` (inside ``first``) are ``vectors``
    instead of their ids' embeddings. ``abandon()``: optional, called (on the engine's
    thread) when a ``step`` runs past ``engine.env_timeout_s`` and the engine gives up on it;
    the step may still return later, and its result is then ignored. ``identity``:
    optional, the episode's identity instead of ``first_id + i`` (:meth:`Engine.run`).
    ``rng``: optional key data (``jax.random.key_data``) of the episode's own base key,
    used instead of the run's key (episodes of several steps in one run).
    """

    first: Sequence[int]
    max_total: int
    max_turn: int
    step: Callable[[np.ndarray, np.ndarray, np.ndarray], Sequence[int] | None]
    turn_caps: Sequence[int] | None = None
    embeds: tuple[int, np.ndarray] | None = None
    abandon: Callable[[], None] | None = None
    identity: int | None = None
    rng: np.ndarray | None = None


@dataclasses.dataclass
class EpisodeResult:
    """What an episode generated: per turn the ids, processed and raw log-probs and the
    version of the weights that sampled each id (:class:`EpisodeFeed`; 0 in a run without
    one); the full context (first chunk, turns, observations); ``error`` says why the
    episode ended early: the repr of an exception its ``step`` raised, a step past
    ``engine.env_timeout_s`` (``"timeout: ..."``) or an observation that is not ids below
    the cap."""

    turns: list[np.ndarray]
    logprobs: list[np.ndarray]
    raw_logprobs: list[np.ndarray]
    context: list[int]
    error: str | None = None
    versions: list[np.ndarray] = dataclasses.field(default_factory=list)

    def version_range(self, default: int = 0) -> tuple[int, int]:
        """The oldest and newest versions that sampled its ids (``default`` for none)."""
        seen = [v for v in self.versions if len(v)]
        if not seen:
            return default, default
        return int(min(v.min() for v in seen)), int(max(v.max() for v in seen))


@dataclasses.dataclass(frozen=True)
class FeedItem:
    """What :meth:`EpisodeFeed.more` gives: new ``episodes`` (possibly none) and, when the
    weights change, the new ``params`` and their ``version``; every episode in flight goes
    on under them (its cache, computed under the old weights, is kept)."""

    episodes: Sequence[EpisodeSpec] = ()
    params: Any = None
    version: int = 0


class EpisodeFeed(Protocol):
    """A stream of episodes for one long :meth:`Engine.run` (e.g. the steps of an
    asynchronous training stage, :mod:`train.async_rollouts`).

    ``max_total``: the largest ``EpisodeSpec.max_total`` it will give (sizes the page pool).
    :meth:`more` is called on the engine's thread whenever every episode given so far has
    been admitted once and fewer than the in-flight limit run; ``idle`` says nothing runs,
    waits or steps in the engine, so the feed must then give work, block until it can, or
    end. It returns a :class:`FeedItem` (``FeedItem()``: nothing now) or None when the feed
    is over (the run ends when its episodes do). :meth:`ended` is called as each episode
    ends; :meth:`take_drops` (polled every iteration) names episodes to drop unfinished
    (e.g. to restart them under newer weights); ``cancelled`` ends the run at once
    (episodes in flight are dropped unfinished).
    """

    max_total: int
    cancelled: bool

    def more(self, idle: bool) -> FeedItem | None: ...

    def ended(self, spec: EpisodeSpec, result: "EpisodeResult") -> None: ...

    def take_drops(self) -> Sequence[EpisodeSpec]: ...


@dataclasses.dataclass
class EpisodeState:
    """An episode in the engine: its context, cached length, pages, the turn being
    generated, its slot and admission order, and its result so far."""

    spec: EpisodeSpec
    eid: int
    ctx: list[int]
    cached: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    turn: list[int] = dataclasses.field(default_factory=list)
    lps: list[float] = dataclasses.field(default_factory=list)
    raws: list[float] = dataclasses.field(default_factory=list)
    vers: list[int] = dataclasses.field(default_factory=list)  # the weights' version of each id of the turn
    slot: int | None = None
    admitted: int = 0  # admission counter (newest = largest)
    result: EpisodeResult = dataclasses.field(default_factory=lambda: EpisodeResult([], [], [], []))
    submitted: float = 0.0  # when its pending environment step was submitted (monotonic)
    ready_since: float = 0.0  # when it last became ready

    @property
    def cap(self) -> int:
        """Tokens this turn may generate in all."""
        cap = min(self.spec.max_turn, self.spec.max_total - len(self.ctx))
        caps, j = self.spec.turn_caps, len(self.result.turns)
        return cap if caps is None or j >= len(caps) else max(1, min(cap, int(caps[j])))

"""What :meth:`lopd_jax.rollout.engine.Engine.run` takes and gives per episode: the
:class:`EpisodeSpec` (first chunk, caps, the environment step callback) and the
:class:`EpisodeResult` (turns, log-probs, context, the error that ended it), and the
engine's own bookkeeping of an episode in flight (:class:`EpisodeState`)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

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
    """

    first: Sequence[int]
    max_total: int
    max_turn: int
    step: Callable[[np.ndarray, np.ndarray, np.ndarray], Sequence[int] | None]
    turn_caps: Sequence[int] | None = None
    embeds: tuple[int, np.ndarray] | None = None
    abandon: Callable[[], None] | None = None
    identity: int | None = None


@dataclasses.dataclass
class EpisodeResult:
    """What an episode generated: per turn the ids, processed and raw log-probs; the full
    context (first chunk, turns, observations); ``error`` says why the episode ended early:
    the repr of an exception its ``step`` raised, a step past ``engine.env_timeout_s``
    (``"timeout: ..."``) or an observation that is not ids below the cap."""

    turns: list[np.ndarray]
    logprobs: list[np.ndarray]
    raw_logprobs: list[np.ndarray]
    context: list[int]
    error: str | None = None


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
    slot: int | None = None
    admitted: int = 0  # admission counter (newest = largest)
    result: EpisodeResult | None = None
    submitted: float = 0.0  # when its pending environment step was submitted (monotonic)
    ready_since: float = 0.0  # when it last became ready

    @property
    def cap(self) -> int:
        """Tokens this turn may generate in all."""
        cap = min(self.spec.max_turn, self.spec.max_total - len(self.ctx))
        caps, j = self.spec.turn_caps, len(self.result.turns)
        return cap if caps is None or j >= len(caps) else max(1, min(cap, int(caps[j])))

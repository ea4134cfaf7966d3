"""Length-aware training batches: the settings, the bucket plan and the episode-length model.

Without buckets every training step pads every trajectory to the total-token cap. With length
buckets (``lengths.buckets``) a step's rows are grouped into *passes* (micro-batches) of
one bucket length each, compiled once per bucket, and the passes' gradients are summed
into one optimizer update (:mod:`train.bucketed_steps`); with ``lengths.packing`` each row
holds several whole trajectories (:mod:`lopd_jax.settings.pack_plan`, docs/packing.md).

* :class:`LengthConfig` -- the ``lengths`` config section: the bucket lengths, packing, the
  tokens one batch shard takes per pass, how passes are filled, and the parameters of the
  episode-length distribution the compile check estimates step time for.
* :func:`plan_passes` -- the passes of one batch from its rows' lengths (pure, so every
  process of a pod computes the same plan from the same lengths).
* :func:`sample_lengths` -- episode lengths drawn from the distribution (prompt, geometric
  number of turns, lognormal turn and observation lengths), capped; the compile check's
  step estimate on it is :mod:`lopd_jax.settings.length_estimate`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import numpy as np

from lopd_jax.settings.errors import ConfigError

SEQ_MULTIPLE = 128  # training sequence lengths are multiples of this (as train.step_spec.padded_seq_len)
FILLS = ("longest_first", "own_bucket")


@dataclasses.dataclass(frozen=True)
class LengthConfig:
    """The ``lengths`` section: length-aware training batches and the length distribution.

    ``buckets``: training sequence lengths below the cap (multiples of 128, ascending);
    the padded cap (``rollout.max_total_tokens`` rounded up to 128) is always the last
    bucket. ``()`` = every row padded to the cap in one pass (the old behaviour).
    ``bucket_tokens``: tokens one batch shard processes per pass (rows per shard = this //
    bucket length, at least 1); 0 = what the padded step processes per micro-step
    (``steps.micro_batch`` rows, or all of a shard's rows, times the cap), so the largest
    pass needs no more memory than the padded step.
    ``packing``: pack whole trajectories back to back into the passes' rows
    (:mod:`lopd_jax.settings.pack_plan`, docs/packing.md) instead of one per row; the
    rows' lengths are still the buckets (with no buckets, the cap).
    ``fill``: (buckets without packing) ``longest_first`` sorts rows longest first and fills each pass in that order
    (a pass takes the bucket of its longest row; shorter rows may ride along instead of
    padding rows); ``own_bucket`` puts each row in its own bucket only (partly filled passes
    get padding rows).

    The distribution (compile check's estimate; ``python -m lopd_jax.compile_check
    lengths.turn_median=500``): prompt tokens lognormal (``prompt_median``,
    ``prompt_sigma``); assistant turns geometric with mean ``turns_mean``; each turn
    lognormal (``turn_median``, ``turn_sigma``); an observation after every turn but the
    last, lognormal (``obs_median``, ``obs_sigma``); ``first_turn_median`` > 0 replaces the
    first turn's median (a thinking-length first turn). Defaults: mean about 8,000 tokens,
    median 6,000, 90th percentile 17,000.
    """

    buckets: tuple[int, ...] = ()
    packing: bool = False
    bucket_tokens: int = 0
    fill: Literal["longest_first", "own_bucket"] = "longest_first"
    prompt_median: float = 1500.0
    prompt_sigma: float = 0.5
    turns_mean: float = 8.0
    turn_median: float = 300.0
    turn_sigma: float = 1.2
    first_turn_median: float = 0.0
    obs_median: float = 150.0
    obs_sigma: float = 0.8

    def __post_init__(self):
        b = tuple(self.buckets)
        if any(not isinstance(x, int) or x < SEQ_MULTIPLE or x % SEQ_MULTIPLE for x in b):
            raise ConfigError(f"lengths.buckets={b}: every bucket must be a multiple of {SEQ_MULTIPLE} (>= 128).")
        if list(b) != sorted(set(b)):
            raise ConfigError(f"lengths.buckets={b} must be strictly ascending.")
        if self.bucket_tokens < 0:
            raise ConfigError(f"lengths.bucket_tokens={self.bucket_tokens} must be >= 0 (0 = the padded step's).")
        if self.fill not in FILLS:
            raise ConfigError(f"lengths.fill={self.fill!r}; choose one of {FILLS}.")
        for k in ("prompt_median", "turn_median", "obs_median", "turns_mean"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"lengths.{k}={getattr(self, k)} must be > 0.")
        if self.turns_mean < 1:
            raise ConfigError(f"lengths.turns_mean={self.turns_mean} must be >= 1 (at least one turn).")
        for k in ("prompt_sigma", "turn_sigma", "obs_sigma", "first_turn_median"):
            if getattr(self, k) < 0:
                raise ConfigError(f"lengths.{k}={getattr(self, k)} must be >= 0.")

    def bucket_lengths(self, cap: int) -> tuple[int, ...]:
        """The bucket lengths of a run whose padded sequence length is ``cap``: the
        configured buckets below it, then ``cap``."""
        return tuple(x for x in self.buckets if x < cap) + (cap,)

    @property
    def enabled(self) -> bool:
        """Whether steps run in length-aware passes: buckets below the cap, or packing
        (else every row is padded to the cap)."""
        return bool(self.buckets) or self.packing


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass of a bucketed step: ``seq`` tokens per row, ``rows`` the batch rows it
    holds (-1: a padding row), a multiple of the batch shards long."""

    seq: int
    rows: tuple[int, ...]


def bucket_of(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket holding ``length`` tokens (ValueError when none does)."""
    for b in buckets:
        if length <= b:
            return b
    raise ValueError(f"a row of {length} tokens exceeds the largest bucket {buckets[-1]}")


def rows_per_pass(seq: int, shard_tokens: int, shards: int) -> int:
    """Rows of a pass of ``seq`` tokens: ``shard_tokens // seq`` (>= 1) per batch shard."""
    return max(1, shard_tokens // seq) * shards


def plan_passes(lengths: Sequence[int], buckets: Sequence[int], shard_tokens: int, shards: int,
                fill: str = "longest_first") -> list[Pass]:
    """The passes of a batch whose row ``i`` needs ``lengths[i]`` tokens.

    Rows go longest first. A pass takes the bucket of the longest row left and as many
    rows of that bucket as fit (:func:`rows_per_pass`); its rows per shard are rounded up
    to a power of two (at most what fits), so a bucket compiles for a few row counts
    only. The slack is filled by the next (shorter) rows with ``fill="longest_first"``,
    by padding rows (-1) with ``own_bucket``. Deterministic in its arguments (ties keep
    row order): every process of a pod plans the same passes from the same lengths.
    """
    buckets = tuple(buckets)
    if fill not in FILLS:
        raise ValueError(f"fill={fill!r}; choose one of {FILLS}")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    own = [bucket_of(max(int(lengths[i]), 1), buckets) for i in order]
    passes: list[Pass] = []
    k = 0
    while k < len(order):
        seq = own[k]
        cap = rows_per_pass(seq, shard_tokens, shards) // shards
        same = 0
        while k + same < len(order) and own[k + same] == seq and same < cap * shards:
            same += 1
        per_shard = min(cap, 1 << (-(-same // shards) - 1).bit_length())
        take = order[k:k + (per_shard * shards if fill == "longest_first" else same)]
        k += len(take)
        passes.append(Pass(seq, tuple(take) + (-1,) * (per_shard * shards - len(take))))
    return passes


def pass_tokens(passes: Sequence[Pass]) -> int:
    """Tokens the passes process (rows times length, padding rows included)."""
    return sum(p.seq * len(p.rows) for p in passes)


def sample_lengths(cfg: LengthConfig, n: int, cap: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """``n`` episode lengths (int) drawn from ``cfg``'s distribution, every median times
    ``scale`` (e.g. 0.1 for a 4,096-token cap), capped at ``cap``."""
    rng = np.random.default_rng(seed)
    turns = rng.geometric(1.0 / cfg.turns_mean, n)
    k = int(turns.max())
    live = np.arange(k)[None, :] < turns[:, None]

    def lognormal(median, sigma, shape):
        return np.exp(np.log(median * scale) + sigma * rng.standard_normal(shape))

    prompt = lognormal(cfg.prompt_median, cfg.prompt_sigma, n)
    turn = lognormal(cfg.turn_median, cfg.turn_sigma, (n, k))
    if cfg.first_turn_median > 0:
        turn[:, 0] = lognormal(cfg.first_turn_median, cfg.turn_sigma, n)
    obs = lognormal(cfg.obs_median, cfg.obs_sigma, (n, k))
    total = prompt + (turn * live).sum(1) + (obs * (np.arange(k)[None, :] < turns[:, None] - 1)).sum(1)
    return np.minimum(np.ceil(total), cap).astype(np.int64)


__all__ = ["LengthConfig", "Pass", "FILLS", "bucket_of", "rows_per_pass", "plan_passes", "pass_tokens",
           "sample_lengths"]

"""The bucket plan of a length-aware training step and the episode-length model.

Without buckets every training step pads every trajectory to the total-token cap. With length
buckets (``lengths.buckets``, :class:`lopd_jax.settings.length_config.LengthConfig`) a step's
rows are grouped into *passes* (micro-batches) of one bucket length each, compiled once per
bucket, and the passes' gradients are summed into one optimizer update
(:mod:`train.bucketed_steps`); with ``lengths.packing`` each row holds several whole
trajectories (:mod:`lopd_jax.planning.pack_plan`, docs/packing.md).

* :func:`plan_passes` -- the passes of one batch from its rows' lengths (pure, so every
  process of a pod computes the same plan from the same lengths).
* :func:`sample_lengths` -- episode lengths drawn from the ``lengths`` section's
  distribution (prompt, geometric number of turns, lognormal turn and observation lengths),
  capped; the compile check's step estimate on it is :mod:`lopd_jax.planning.length_estimate`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from lopd_jax.settings.length_config import FILLS, LengthConfig


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


__all__ = ["Pass", "bucket_of", "rows_per_pass", "plan_passes", "pass_tokens", "sample_lengths"]

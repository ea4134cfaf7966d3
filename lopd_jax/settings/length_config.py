"""The ``lengths`` config section: length-aware training batches and the episode-length
distribution the compile check estimates step time for.

The section's settings only; the bucket plan and the length model that read them are
:mod:`lopd_jax.planning.length_model`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

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
    (:mod:`lopd_jax.planning.pack_plan`, docs/packing.md) instead of one per row; the
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


__all__ = ["SEQ_MULTIPLE", "FILLS", "LengthConfig"]

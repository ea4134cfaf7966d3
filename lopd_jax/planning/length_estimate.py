"""The compile check's step estimate for the ``lengths`` distribution: padded, bucketed, packed.

:func:`step_estimate` draws batches of episode lengths
(:func:`lopd_jax.planning.length_model.sample_lengths`), lays each out as the trainer
would -- every row at the cap; length-bucketed passes
(:func:`lopd_jax.planning.length_model.plan_passes`); packed rows
(:func:`lopd_jax.planning.pack_plan.plan_packed_passes`) -- and averages the real share of
row tokens, the model FLOPs and the time at 100% of a peak FLOP rate. A packed row's
attention is reported twice: within its segments (the model's FLOPs) and as executed --
over the whole row by a kernel that sees only causal row blocks, or block by block within
the segments by one that skips the others (the splash kernel, ``kernel_skips``).
"""

from __future__ import annotations

from typing import Callable, Sequence

from lopd_jax.planning.length_model import plan_passes, sample_lengths
from lopd_jax.planning.pack_plan import plan_packed_passes
from lopd_jax.settings.length_config import LengthConfig

# flops(rows, seq, segments=0, segment_lengths=None, row_layouts=None): FLOPs of a pass (see step_estimate)
FlopsFn = Callable[..., float]


# collectives(rows, seq, segments): seconds one pass spends in ICI collectives (see step_estimate)
CollectivesFn = Callable[[int, int, int], float]


def _side(flops: float, executed: float, real: float, row_tokens: float, peak_flops: float,
          collective_s: float | None) -> dict:
    out = {"flops": flops, "executed_flops": executed, "seconds": executed / peak_flops,
           "flops_per_real_token": flops / real, "executed_flops_per_real_token": executed / real,
           "real_fraction": real / row_tokens}
    if collective_s is not None:
        out |= {"collective_seconds": collective_s, "seconds_with_collectives": out["seconds"] + collective_s}
    return out


def step_estimate(cfg: LengthConfig, flops: FlopsFn, batch: int, cap: int, shards: int, shard_tokens: int,
                  peak_flops: float, draws: int = 200, seed: int = 0,
                  attention_length: float = float("inf"), collectives: CollectivesFn | None = None,
                  padded_passes: int = 1, kernel_skips: bool = False) -> dict:
    """Expected FLOPs and time at 100% of ``peak_flops`` (the slice's, per second) of one step
    on batches of ``batch`` episodes drawn from ``cfg``'s distribution: ``padded`` (every
    row at ``cap``), ``bucketed`` (passes of ``cfg.bucket_lengths(cap)``) and ``packed``
    (whole episodes back to back in rows of those lengths), ``shard_tokens`` per batch
    shard and pass, ``shards`` batch shards; averaged over ``draws`` batches.

    ``flops(rows, seq)``: FLOPs of ``rows`` rows of ``seq`` tokens, one episode each (e.g.
    :func:`lopd_jax.programs.compile_check.step_flops`); ``flops(rows, seq, segments,
    segment_lengths)``: of packed rows holding up to ``segments`` episodes each, attention
    within the episodes of ``segment_lengths`` tokens, or over whole rows when None.

    ``kernel_skips``: the attention kernel skips the blocks outside each row's segments (and
    the padding's, but the diagonal); executed FLOPs then come from ``flops(rows, seq,
    segments, row_layouts=...)`` with each row's episode lengths in order, on every side.

    Per side: ``flops`` (the model's: packed attention within segments), ``executed_flops``
    (packed: attention over whole rows, or as the skipping kernel runs it; padded and
    bucketed: the same as ``flops``, or as that kernel runs them), ``seconds`` (from the executed),
    both per real (prompt or generated) token, and ``real_fraction`` of the row tokens.
    ``packed`` also has ``segments``: per row length the most episodes a row held (the
    pass shape's K) in any draw.

    ``collectives(rows, seq, segments)``: seconds one pass of ``rows`` rows (over the whole
    mesh) spends in ICI collectives, not overlapped
    (:mod:`lopd_jax.planning.collective_estimate`); given, each side also has
    ``collective_seconds`` and ``seconds_with_collectives``. The padded step runs in
    ``padded_passes`` equal passes (its micro-batches).
    """
    buckets = cfg.bucket_lengths(cap)
    lengths = sample_lengths(cfg, batch * draws, cap, seed).reshape(draws, batch)
    real = float(lengths.sum(1).mean())
    padded = flops(batch, cap)
    comm = {"padded": 0.0, "bucketed": 0.0, "packed": 0.0}
    if collectives is not None:
        comm["padded"] = padded_passes * collectives(batch // padded_passes, cap, 0)
    cache: dict[tuple, float] = {}

    def cached(*key) -> float:
        if key not in cache:
            cache[key] = flops(*key)
        return cache[key]

    bucketed = bucket_rows = bucket_exec = padded_exec = 0.0
    packed = executed = packed_rows = 0.0
    segments: dict[int, int] = {}
    for row in lengths:
        if kernel_skips:
            padded_exec += flops(batch, cap, 0, None, [[int(n)] for n in row])
        for p in plan_passes(row, buckets, shard_tokens, shards, cfg.fill):
            bucketed += cached(len(p.rows), p.seq)
            if kernel_skips:
                bucket_exec += flops(len(p.rows), p.seq, 0, None, [[int(row[i])] if i >= 0 else [] for i in p.rows])
            bucket_rows += len(p.rows) * p.seq
            if collectives is not None:
                comm["bucketed"] += collectives(len(p.rows), p.seq, 0)
        for q in plan_packed_passes(row, buckets, shard_tokens, shards, attention_length):
            members: Sequence[int] = [int(row[i]) for r in q.rows for i in r]
            packed += flops(len(q.rows), q.seq, q.segments, members)
            if kernel_skips:
                executed += flops(len(q.rows), q.seq, q.segments, None, [[int(row[i]) for i in r] for r in q.rows])
            else:
                executed += cached(len(q.rows), q.seq, q.segments, None)
            packed_rows += q.tokens
            segments[q.seq] = max(segments.get(q.seq, 0), q.segments)
            if collectives is not None:
                comm["packed"] += collectives(len(q.rows), q.seq, q.segments)
    n = float(draws)
    per_step = {k: (v if k == "padded" else v / n) if collectives is not None else None for k, v in comm.items()}
    return {"real_tokens": real, "mean_length": real / batch, "buckets": buckets, "kernel_skips": kernel_skips,
            "padded": _side(padded, padded_exec / n if kernel_skips else padded, real, batch * cap, peak_flops,
                            per_step["padded"]),
            "bucketed": _side(bucketed / n, (bucket_exec if kernel_skips else bucketed) / n, real, bucket_rows / n,
                              peak_flops, per_step["bucketed"]),
            "packed": _side(packed / n, executed / n, real, packed_rows / n, peak_flops, per_step["packed"])
            | {"segments": dict(sorted(segments.items()))}}


__all__ = ["CollectivesFn", "FlopsFn", "step_estimate"]

"""The packing plan: whole trajectories packed into rows of a few bucket lengths.

A packed training step runs a batch in *passes*; a pass's rows all have one length (a
bucket) and each row holds one or more whole trajectories back to back (*segments*),
never a trajectory split across rows. :func:`plan_packed_passes` is pure and
deterministic, so every process of a pod plans the same passes from the same lengths.
docs/packing.md says how the rows are filled and balanced over chips.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from lopd_jax.planning.length_model import bucket_of


@dataclasses.dataclass(frozen=True)
class PackedPass:
    """One pass of a packed step: ``seq`` tokens per row; ``rows`` the batch rows (trajectory
    indices) each packed row holds, in order (an empty tuple: a padding row); a multiple
    of the batch shards long, shard ``s`` taking rows ``[s * n / shards, (s + 1) * n / shards)``;
    ``segments``: the most trajectories of any row, rounded up to a power of two (the
    per-segment arrays' width, so a pass shape compiles for few values)."""

    seq: int
    rows: tuple[tuple[int, ...], ...]
    segments: int

    @property
    def tokens(self) -> int:
        """Row tokens the pass processes (padding included)."""
        return self.seq * len(self.rows)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _fill(items: Sequence[int], lengths, seq: int, n_rows: int, shards: int):
    """Worst-fit decreasing: each trajectory (longest first) into the least-filled row that
    holds it, rows interleaved over shards so that every shard's load stays balanced.
    Returns ``(rows, left over items)``."""
    per_shard = n_rows // shards
    # row r of shard s is rows[s * per_shard + r]; visiting rows round-robin over shards
    # breaks load ties across shards first
    order = [s * per_shard + r for r in range(per_shard) for s in range(shards)]
    rows: list[list[int]] = [[] for _ in range(n_rows)]
    load = [0] * n_rows
    left = []
    for i in items:
        n = int(lengths[i])
        best = None
        for r in order:
            if load[r] + n <= seq and (best is None or load[r] < load[best]):
                best = r
        if best is None:
            left.append(i)
        else:
            rows[best].append(i)
            load[best] += n
    return rows, left


def _candidates(items, lengths, buckets, shard_tokens: int, shards: int):
    """The (seq, rows) shapes a pass over ``items`` (longest first) may take: every bucket
    holding the longest, every power-of-two rows per shard up to what fits in
    ``shard_tokens``, no more rows than hold all the items' tokens twice over."""
    longest = max(1, int(lengths[items[0]]))
    need = sum(max(1, int(lengths[i])) for i in items)
    for seq in buckets:
        if seq < longest:
            continue
        cap = max(1, shard_tokens // seq)
        r = 1
        while r <= cap:
            yield seq, r * shards
            if r * shards * seq >= 2 * need:
                break
            r *= 2


def row_cost(seq: int, attention_length: float) -> float:
    """The work of one row of ``seq`` tokens in token units: its tokens, plus causal
    attention over the whole row (``seq / 2`` keys per query on average) weighed by
    ``attention_length``, the context length at which a token's attention costs as much as
    its matmuls (:func:`attention_length`); ``inf``: tokens only."""
    return seq * (1.0 + seq / (2.0 * attention_length))


def attention_length(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> float:
    """The context length at which a token's causal attention (QK^T and PV: 4 heads x
    head_dim FLOPs per key) costs as much as its layer matmuls (q, k, v, o and the MLP:
    2 FLOPs per weight): about 23,500 tokens for Qwen3-8B, 288 for the tiny test models."""
    weights = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
    return 2.0 * weights / (4.0 * heads * head_dim)


def _greedy(items, lengths, buckets, shard_tokens, shards) -> list[PackedPass]:
    """Passes for ``items``: each at the bucket of the longest item left, with the fewest
    power-of-two rows per shard whose tokens hold the items left (at most what fits)."""
    passes = []
    while items:
        longest = max(1, int(lengths[items[0]]))
        seq = bucket_of(longest, buckets)
        need = sum(max(1, int(lengths[i])) for i in items)
        cap = max(1, shard_tokens // seq)
        per_shard = min(_pow2(-(-need // (seq * shards))), 1 << (cap.bit_length() - 1))
        rows, items = _fill(items, lengths, seq, per_shard * shards, shards)
        passes.append(_pass(seq, rows))
    return passes


def _pass(seq: int, rows) -> PackedPass:
    return PackedPass(seq, tuple(tuple(r) for r in rows), _pow2(max(1, max(len(r) for r in rows))))


def plan_packed_passes(lengths: Sequence[int], buckets: Sequence[int], shard_tokens: int,
                       shards: int, attention_length: float = float("inf")) -> list[PackedPass]:
    """The packed passes of a batch whose trajectory ``i`` needs ``lengths[i]`` tokens.

    Trajectories go longest first. Each pass packs them worst-fit into rows of one bucket
    length (the least-filled row that holds a trajectory takes it; a trajectory no row
    holds waits for a later pass), rows spread so that every batch shard gets the same
    number of rows and about the same tokens. A pass's shape -- a bucket holding the
    longest trajectory left, a power-of-two number of rows per shard within
    ``shard_tokens`` -- is the one whose whole plan (this pass, then the greedy rule for
    the rest) costs least (:func:`row_cost`: row tokens, plus whole-row attention when
    ``attention_length`` is finite, since the kernels compute every causal block of a row,
    masked or not); ties go to fewer, shorter rows.
    """
    buckets = tuple(buckets)
    lengths = [int(x) for x in lengths]
    if not lengths:
        raise ValueError("a batch needs at least one trajectory")
    if max(int(x) for x in lengths) > buckets[-1]:
        raise ValueError(f"a trajectory of {max(lengths)} tokens exceeds the largest bucket {buckets[-1]}")
    items = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    passes: list[PackedPass] = []
    while items:
        best = None
        for seq, n_rows in _candidates(items, lengths, buckets, shard_tokens, shards):
            rows, left = _fill(items, lengths, seq, n_rows, shards)
            if len(left) == len(items):
                continue
            rest = _greedy(left, lengths, buckets, shard_tokens, shards)
            work = n_rows * row_cost(seq, attention_length) + sum(
                len(p.rows) * row_cost(p.seq, attention_length) for p in rest)
            cost = (work, n_rows, seq)
            if best is None or cost < best[0]:
                best = (cost, _pass(seq, rows), left)
        _, chosen, items = best
        passes.append(chosen)
    return passes


def packed_real_fraction(passes: Sequence[PackedPass], lengths: Sequence[int]) -> float:
    """Real tokens over row tokens of a plan."""
    real = sum(int(lengths[i]) for p in passes for r in p.rows for i in r)
    return real / max(1, sum(p.tokens for p in passes))


__all__ = ["PackedPass", "attention_length", "plan_packed_passes", "packed_real_fraction", "row_cost"]

"""Packed step batches: a whole step batch cut into passes of packed rows (host, numpy).

:func:`packed_batch` lays the trajectories of each
:class:`lopd_jax.planning.pack_plan.PackedPass` back to back in its rows and builds what the
packed steps read (:mod:`lopd_jax.method.packing`): packed token arrays, ``segment_ids``,
``unpack_index``, per-trajectory arrays ``[P, K, ...]`` with ``row_valid`` / ``row_index``,
and for the teachers with an inserted block (the latent splice, a text context) the
packed teacher rows. The result is a :class:`train.bucketed_steps.BucketedBatch`, run by
the same pass-accumulating steps as length buckets. docs/packing.md.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from lopd_jax.method.splice import SpliceLayout
from lopd_jax.planning.pack_plan import PackedPass, attention_length, plan_packed_passes
from train.bucketed_steps import SEQ_KEYS, BucketedBatch, batch_stats, row_lengths


def _blocks(batch: dict, splice: SpliceLayout | None):
    """``(block ids of trajectory i, first slot offset in the block or None, width)``: the
    latent splice's fixed block, a text arm's context block, or no teacher block."""
    if splice is not None:
        ids = splice.block_ids
        return (lambda i: ids), len(splice.before_ids), splice.length
    if "ctx_ids" in batch:
        ctx, n = np.asarray(batch["ctx_ids"]), np.asarray(batch["ctx_len"])
        return (lambda i: ctx[i, :int(n[i])]), None, ctx.shape[1]
    return None, None, 0


def _pack_pass(batch: dict, p: PackedPass, lengths: np.ndarray, splice: SpliceLayout | None) -> dict:
    P, S, K = len(p.rows), p.seq, p.segments
    B = len(lengths)
    block_of, slot_at, width = _blocks(batch, splice)
    seq_keys = [k for k in SEQ_KEYS if k in batch]
    out = {k: np.zeros((P, S), np.asarray(batch[k]).dtype) for k in seq_keys}
    seg = np.zeros((P, S), np.int32)
    index = np.full((P, K, S), -1, np.int32)
    rows = np.full((P, K), -1, np.int64)
    if block_of is not None:
        ST = S + K * width
        t_tok = np.zeros((P, ST), np.asarray(batch["tokens"]).dtype)
        t_seg = np.zeros((P, ST), np.int32)
        t_mask = np.zeros((P, ST), bool)
        t_slot = np.full((P, ST), -1, np.int32)
        align = np.zeros((P, S), np.int32)
        n_slots = 0 if splice is None else splice.num_slots
    for r, members in enumerate(p.rows):
        off, t_off = 0, 0
        for k, i in enumerate(members):
            n = int(lengths[i])
            rows[r, k] = i
            for key in seq_keys:
                out[key][r, off:off + n] = np.asarray(batch[key])[i, :n]
            # the first token's supervision is never read by a padded row (losses use
            # loss_mask[:, 1:]); packed, it would be the previous segment's last prediction
            out["loss_mask"][r, off] = 0
            seg[r, off:off + n] = k + 1
            index[r, k, :n] = np.arange(off, off + n)
            if block_of is not None:
                ins = int(batch["insert_at"][i])
                if not 0 <= ins <= n:
                    raise ValueError(f"trajectory {i}: insertion point {ins} outside its {n} tokens")
                blk = np.asarray(block_of(i))
                tokens, amask = np.asarray(batch["tokens"])[i], np.asarray(batch["attention_mask"])[i]
                m = n + len(blk)
                t_tok[r, t_off:t_off + m] = np.concatenate([tokens[:ins], blk, tokens[ins:n]])
                t_mask[r, t_off:t_off + m] = np.concatenate([amask[:ins] != 0, np.ones(len(blk), bool),
                                                             amask[ins:n] != 0])
                t_seg[r, t_off:t_off + m] = k + 1
                if slot_at is not None:
                    first = t_off + ins + slot_at
                    t_slot[r, first:first + n_slots] = k * n_slots + np.arange(n_slots)
                j = np.arange(n)
                align[r, off:off + n] = t_off + np.where(j < ins, j, j + len(blk))
                t_off += m
            off += n
    mb = dict(out)
    mb["segment_ids"] = seg
    mb["attention_mask"] = (seg > 0) & (mb["attention_mask"] != 0) if "attention_mask" in mb else seg > 0
    mb["unpack_index"] = index
    valid = rows >= 0
    first = rows[valid][0]
    take = np.where(valid, rows, first)
    for key, v in batch.items():
        v = np.asarray(v)
        if key in seq_keys or key in ("ctx_ids", "ctx_len", "insert_at") or v.ndim == 0 or v.shape[0] != B:
            continue
        mb[key] = v[take]
    mb["row_valid"] = valid.astype(np.float32)
    mb["row_index"] = rows.astype(np.int32)
    if block_of is not None:
        mb.update(teacher_tokens=t_tok, teacher_segment_ids=t_seg, teacher_attention_mask=t_mask,
                  teacher_align=align)
        if slot_at is not None:
            mb["teacher_slot"] = t_slot
    return mb


def model_attention_length(cfg) -> float:
    """:func:`lopd_jax.planning.pack_plan.attention_length` of a model config: what a
    packed row's whole-row attention weighs in the plan. ``inf`` (tokens only) for the
    splash kernel, which skips the blocks across segments (:mod:`models.splash`): there a
    trajectory's attention costs the same in whichever row it is packed."""
    if cfg.attention_impl == "splash":
        return float("inf")
    return attention_length(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


def packed_batch(batch: dict, buckets: Sequence[int], shard_tokens: int, shards: int,
                 splice: SpliceLayout | None = None, attention_length: float = float("inf")) -> BucketedBatch:
    """A whole step batch (numpy, every row, right-padded) as packed passes
    (:func:`lopd_jax.planning.pack_plan.plan_packed_passes`): rows of ``buckets`` lengths,
    ``shard_tokens`` tokens per batch shard and pass, ``shards`` batch shards,
    ``attention_length`` the model's (:func:`model_attention_length`; the plan weighs
    whole-row attention by it). ``splice``:
    the latent splice's layout when the step's teacher reads latents (LOPD, cold start);
    batches with ``ctx_ids`` / ``ctx_len`` (the text arms) get their context blocks."""
    lengths = row_lengths(batch)
    plan = plan_packed_passes(lengths, buckets, shard_tokens, shards, attention_length)
    passes = [_pack_pass(batch, p, lengths, splice) for p in plan]
    return BucketedBatch(passes, plan, len(lengths), batch_stats(batch))


__all__ = ["model_attention_length", "packed_batch"]

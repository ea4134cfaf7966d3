"""The step batches of the training stages, built from trajectories and the bank.

* :func:`experience_arrays` tokenizes the composer's encoder inputs
  (:func:`lopd_jax.method.bank.encoder_input_text`) of the retrieved experiences to
  ``exp_tokens`` / ``exp_mask`` ``[B, n_ret, L_e]`` (L_e: the cap, or a length bucket).
* :func:`lopd_batch` / :func:`cold_start_batch` assemble the step batches documented in
  :mod:`train.steps`, each process only the rows it owns (:func:`local_share`).

Multi-host: every process builds only its own rows of each batch; the bank (built the
same on every host, :mod:`train.bank_stage`) retrieves the same experiences everywhere.
"""

from __future__ import annotations

import sys
from typing import Sequence

import jax
import numpy as np

from lopd_jax.method.bank import Experience, ExperienceBank, encoder_input_text
from train import distributed
from lopd_jax.rollout.episodes import Trajectory, training_arrays
from lopd_jax.core.shapes import bucket
from lopd_jax.core.text import content_ids

EXP_LEN_MINIMUM = 64  # smallest experience-length bucket when inputs are not cut


def experience_arrays(ctx, instructions: Sequence[str], retrieved: Sequence[Sequence[Experience]],
                      n_ret: int | None = None):
    """``(exp_tokens int32, exp_mask bool)`` ``[B, n_ret, L_e]`` of the encoder inputs.

    ``L_e`` is ``composer.max_experience_tokens`` when set (longer inputs are cut, and the
    log says how many), else the power-of-two bucket of the longest input (no cut, as the
    release). A task with fewer than ``n_ret`` experiences leaves the rest of its rows
    all-False: :func:`lopd_jax.method.composer.slot_mask` masks their latent slots.
    """
    cap = ctx.cfg.composer.max_experience_tokens
    n = ctx.cfg.composer.n_ret if n_ret is None else n_ret
    B = len(instructions)
    rows = [[content_ids(ctx.tokenizer, encoder_input_text(task, e, ctx.cfg.bank.max_obs_chars))
             for e in exps[:n]] for task, exps in zip(instructions, retrieved)]
    longest = max((len(ids) for r in rows for ids in r), default=1)
    L = cap if cap is not None else bucket(longest, (), EXP_LEN_MINIMUM)
    cut = sum(len(ids) > L for r in rows for ids in r)
    if cut:
        print(f"[lopd] composer.max_experience_tokens={cap}: cut {cut} of {sum(map(len, rows))} experience "
              f"inputs (longest {longest} tokens); set composer.max_experience_tokens=none to keep them whole",
              file=sys.stderr, flush=True)
    toks = np.full((B, n, L), ctx.tokenizer.pad_token_id or 0, np.int32)
    mask = np.zeros((B, n, L), bool)
    for b, r in enumerate(rows):
        for j, ids in enumerate(r):
            ids = ids[:L]
            toks[b, j, :len(ids)] = ids
            mask[b, j, :len(ids)] = True
    return toks, mask


def retrieved_experience_arrays(ctx, bank: ExperienceBank, tasks, n_ret: int | None = None
                                ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`experience_arrays` of the n_ret (default ``composer.n_ret``) experiences ``bank``
    retrieves for each task."""
    instructions = [t.instruction for t in tasks]
    return experience_arrays(ctx, instructions, bank.retrieve(instructions, [t.task_id for t in tasks], n_ret),
                             n_ret)


def local_share(ctx, items: Sequence, rows: int) -> tuple[list, int]:
    """This process's rows of a ``rows``-row batch of ``items`` (the same list on every
    process) padded by repeating the last item: ``(its items, how many are real)``.

    Rows are owned as the batch sharding places them (:meth:`train.run_context.RunContext.local_rows`);
    on one process this is ``(items + padding, len(items))``.
    """
    if not items:
        raise ValueError("a batch needs at least one item")
    lo, hi = ctx.local_rows(rows)
    padded = list(items) + [items[-1]] * (rows - len(items))
    return padded[lo:hi], max(0, min(hi, len(items)) - lo)


def _step_arrays(ctx, trajs: Sequence[Trajectory], bank: ExperienceBank, rows: int | None) -> dict[str, np.ndarray]:
    """Step arrays of this process's rows; ``rows=None``: ``trajs`` are already exactly them."""
    trajs, real = (list(trajs), len(trajs)) if rows is None else local_share(ctx, trajs, rows)
    arr = training_arrays(trajs, buckets=ctx.seq_buckets(), minimum=128, pad_id=ctx.tokenizer.pad_token_id or 0)
    et, em = retrieved_experience_arrays(ctx, bank, [t.task for t in trajs])
    arr["mask"][real:] = 0  # padding rows (repeats of the last row) carry no supervision
    return {"tokens": arr["tokens"], "attention_mask": arr["attention_mask"], "loss_mask": arr["mask"],
            "insert_at": arr["insert_at"], "exp_tokens": et, "exp_mask": em, "rewards": arr["rewards"],
            "old_logp": arr["raw_logprobs"]}


def gather_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every process's rows of a batch (this process's rows, numpy), in process (= row)
    order, on every process; entries whose trailing shapes differ between processes (the
    experience length bucket) are zero-padded to the largest (their masks stay False)."""
    parts = distributed.allgather_objects(batch)
    if len(parts) == 1:
        return batch
    out = {}
    for k in batch:
        arrs = [np.asarray(p[k]) for p in parts]
        shape = np.max([a.shape for a in arrs], axis=0)
        arrs = [np.pad(a, [(0, 0)] + [(0, int(n) - d) for n, d in zip(shape[1:], a.shape[1:])]) for a in arrs]
        out[k] = np.concatenate(arrs)
    return out


def batch_rows(ctx, n: int) -> int:
    """``n`` rounded up to a multiple of the devices the batch is split over."""
    return bucket(n, (n,), 1, ctx.batch_shards)


def lopd_batch(ctx, trajs: Sequence[Trajectory], bank: ExperienceBank) -> dict[str, np.ndarray]:
    """The LOPD step batch of one step's rollouts (with n_ret retrieved experiences each,
    and ``old_logp``: the sampler's temperature-1 log-probs, for ``steps.is_correction``);
    multi-host: ``trajs`` are this process's rollouts, i.e. its rows of the batch."""
    total = len(trajs) * jax.process_count()
    if total % ctx.batch_shards:
        raise ValueError(f"{total} rollouts per step do not split over {ctx.batch_shards} batch "
                         "shards; make env.tasks_per_step * env.group_size a multiple of mesh.data * mesh.fsdp.")
    return _step_arrays(ctx, trajs, bank, None)


def cold_start_batch(ctx, trajs: Sequence[Trajectory], bank: ExperienceBank) -> dict[str, np.ndarray]:
    """The cold-start batch of successful trajectories (rewards unused): this process's
    rows of it (``trajs`` is the whole batch, the same on every process)."""
    batch = _step_arrays(ctx, trajs, bank, batch_rows(ctx, len(trajs)))
    batch.pop("rewards")
    batch.pop("old_logp")  # the cold start fits the teacher to these trajectories: no behaviour policy
    return batch

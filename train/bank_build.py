"""Experience bank construction and the step batches that read from it.

* :func:`build_bank` rolls the student out once over the training split, admits the
  rollouts with reward >= ``bank.min_reward`` (SPEC 5), builds the FAISS index and saves
  the bank under ``<workdir>/bank``; or loads the bank named by ``bank.path``.
  Admitted experiences keep their exact token ids, supervision spans and insertion point,
  so the cold start trains on the very ids the student produced.
* :func:`experience_arrays` tokenizes the composer's encoder inputs
  (:func:`lopd_jax.bank.encoder_input_text`) of the retrieved experiences to
  ``exp_tokens`` / ``exp_mask`` ``[B, n_ret, L_e]`` (L_e: the cap, or a length bucket).
* :func:`lopd_batch` / :func:`cold_start_batch` assemble the step batches documented in
  :mod:`train.steps`, each process only the rows it owns (:func:`local_share`).

Multi-host: every process rolls out its own rows of each bank batch; the admitted
experiences of all hosts are gathered (in row order) so every host builds the same bank
and retrieves the same experiences; process 0 saves it.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

import jax
import numpy as np

from lopd_jax.bank import EmptyBankError, Experience, ExperienceBank, encoder_input_text
from train.rollout import Trajectory, training_arrays
from train.sampler import bucket

BANK_DIR = "bank"
BANK_RNG_OFFSET = 1 << 20  # bank rollouts use fold_in(seed key, offset + batch): never an LOPD step's key


def make_embedder(cfg):
    """The embedder the bank section names (hashing, or the backbone Qwen3-Embedding one)."""
    if cfg.bank.embedder == "hashing":
        from lopd_jax.embedders import HashingEmbedder
        return HashingEmbedder(dim=cfg.bank.embedder_dim)
    from lopd_jax.backbone_embedder import BackboneEmbedder
    return BackboneEmbedder.from_pretrained(cfg.bank.embedder_path, pool_token=cfg.bank.embedder_pool_token)


def _spans(mask: np.ndarray) -> list[list[int]]:
    """[start, end) runs of ones in a 0/1 mask."""
    m = np.concatenate([[0], np.asarray(mask, np.int8), [0]])
    d = np.diff(m)
    return [[int(a), int(b)] for a, b in zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1))]


def to_experience(traj: Trajectory) -> Experience:
    """A bank entry for a finished trajectory (messages for retrieval, ids for training)."""
    t = traj.task
    return Experience(task_id=t.task_id, env_id=t.env_id, instruction=t.instruction, messages=list(traj.messages),
                      reward=float(traj.reward), token_ids=[int(x) for x in traj.tokens],
                      info={"family": t.family, "mask_spans": _spans(traj.mask), "insert_at": int(traj.insert_at)})


def from_experience(exp: Experience) -> Trajectory:
    """The trajectory arrays kept in a bank entry (for the cold start)."""
    from lopd_jax.types import Task
    if exp.token_ids is None or "mask_spans" not in exp.info:
        raise ValueError(f"bank entry {exp.task_id!r} has no token ids / mask; the cold start needs a bank built "
                         "by this program (or set stages.cold_start_steps=0).")
    tokens = np.asarray(exp.token_ids, np.int32)
    mask = np.zeros(len(tokens), np.int32)
    for a, b in exp.info["mask_spans"]:
        mask[a:b] = 1
    z = np.zeros(len(tokens), np.float32)
    task = Task(task_id=exp.task_id, env_id=exp.env_id, instruction=exp.instruction, family=exp.info.get("family") or "")
    return Trajectory(task=task, tokens=tokens, mask=mask, logprobs=z, raw_logprobs=z, messages=exp.messages,
                      tools=[], reward=exp.reward, env_stats={}, num_turns=0, turn_lengths=[],
                      insert_at=int(exp.info["insert_at"]), finish_reason="done")


def build_bank(ctx, params, workdir: str) -> tuple[ExperienceBank, dict]:
    """Collect rollouts on the training split and build (or load) the bank.

    Returns ``(bank, info)``; raises :class:`EmptyBankError` with what to change when no
    rollout reaches ``bank.min_reward``.
    """
    cfg = ctx.cfg
    embedder = make_embedder(cfg)
    if cfg.bank.path:
        bank = ExperienceBank.load(cfg.bank.path, embedder)
        return bank, {"path": cfg.bank.path, "entries": len(bank), "loaded": True}
    from train import distributed
    bank = ExperienceBank(embedder, cfg.bank_config())
    key = jax.random.key(cfg.seed)
    B = cfg.env.tasks_per_step
    rewards = []
    for i in range(0, len(ctx.train_tasks), B):
        trajs, _ = ctx.rollout_split(params, ctx.train_tasks[i:i + B], jax.random.fold_in(key, BANK_RNG_OFFSET + i))
        admitted = [to_experience(t) for t in trajs if float(t.reward) >= cfg.bank.min_reward]
        # every host's rewards and admitted experiences, in row order: the same bank everywhere
        rewards += distributed.allgather_list([t.reward for t in trajs])
        bank.add_many(distributed.allgather_list(admitted))
    bank.num_offered = len(rewards)
    info = {"rollouts": len(rewards), "reward_mean": float(np.mean(rewards)), "entries": len(bank),
            "min_reward": cfg.bank.min_reward}
    if not len(bank):
        best = max(rewards)
        raise EmptyBankError(
            f"The experience bank is empty: none of {len(rewards)} rollouts of the training split reached "
            f"bank.min_reward={cfg.bank.min_reward} (best reward {best:.3f}, mean {info['reward_mean']:.3f}). "
            "Lower bank.min_reward (e.g. bank.min_reward=" f"{best:.2f}" "), warm the model up longer "
            "(stages.warmup_steps), or load a bank built elsewhere (bank.path=DIR).")
    bank.build()
    path = os.path.join(workdir, BANK_DIR)
    if jax.process_index() == 0:
        bank.save(path)
    distributed.sync("bank_saved")  # the other processes read it back next
    info["path"] = path
    return bank, info


def load_bank(ctx, path: str) -> ExperienceBank:
    """The bank saved at ``path`` with the configured embedder."""
    return ExperienceBank.load(path, make_embedder(ctx.cfg))


EXP_LEN_MINIMUM = 64  # smallest experience-length bucket when inputs are not cut


def experience_arrays(ctx, instructions: Sequence[str], retrieved: Sequence[Sequence[Experience]],
                      n_ret: int | None = None):
    """``(exp_tokens int32, exp_mask bool)`` ``[B, n_ret, L_e]`` of the encoder inputs.

    ``L_e`` is ``composer.max_experience_tokens`` when set (longer inputs are cut, and the
    log says how many), else the power-of-two bucket of the longest input (no cut, as the
    release). A task with fewer than ``n_ret`` experiences leaves the rest of its rows
    all-False: :func:`lopd_jax.composer.slot_mask` masks their latent slots.
    """
    cap = ctx.cfg.composer.max_experience_tokens
    n = ctx.cfg.composer.n_ret if n_ret is None else n_ret
    B = len(instructions)
    rows = [[ctx.tokenizer.encode(encoder_input_text(task, e, ctx.cfg.bank.max_obs_chars), add_special_tokens=False)
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

    Rows are owned as the batch sharding places them (:meth:`train.sampler.Sampler.local_rows`);
    on one process this is ``(items + padding, len(items))``.
    """
    if not items:
        raise ValueError("a batch needs at least one item")
    lo, hi = ctx.sampler.local_rows(rows)
    padded = list(items) + [items[-1]] * (rows - len(items))
    return padded[lo:hi], max(0, min(hi, len(items)) - lo)


def _step_arrays(ctx, trajs: Sequence[Trajectory], bank: ExperienceBank, rows: int | None) -> dict[str, np.ndarray]:
    """Step arrays of this process's rows; ``rows=None``: ``trajs`` are already exactly them."""
    trajs, real = (list(trajs), len(trajs)) if rows is None else local_share(ctx, trajs, rows)
    arr = training_arrays(trajs, buckets=ctx.seq_buckets(), minimum=128, pad_id=ctx.tokenizer.pad_token_id or 0)
    et, em = retrieved_experience_arrays(ctx, bank, [t.task for t in trajs])
    arr["mask"][real:] = 0  # padding rows (repeats of the last row) carry no supervision
    return {"tokens": arr["tokens"], "attention_mask": arr["attention_mask"], "loss_mask": arr["mask"],
            "insert_at": arr["insert_at"], "exp_tokens": et, "exp_mask": em, "rewards": arr["rewards"]}


def batch_rows(ctx, n: int) -> int:
    """``n`` rounded up to a multiple of the devices the batch is split over."""
    return bucket(n, (n,), 1, ctx.sampler.batch_shards)


def lopd_batch(ctx, trajs: Sequence[Trajectory], bank: ExperienceBank) -> dict[str, np.ndarray]:
    """The LOPD step batch of one step's rollouts (with n_ret retrieved experiences each);
    multi-host: ``trajs`` are this process's rollouts, i.e. its rows of the batch."""
    total = len(trajs) * jax.process_count()
    if total % ctx.sampler.batch_shards:
        raise ValueError(f"{total} rollouts per step do not split over {ctx.sampler.batch_shards} batch "
                         "shards; make env.tasks_per_step * env.group_size a multiple of mesh.data * mesh.fsdp.")
    return _step_arrays(ctx, trajs, bank, None)


def cold_start_batch(ctx, trajs: Sequence[Trajectory], bank: ExperienceBank) -> dict[str, np.ndarray]:
    """The cold-start batch of successful trajectories (rewards unused): this process's
    rows of it (``trajs`` is the whole batch, the same on every process)."""
    batch = _step_arrays(ctx, trajs, bank, batch_rows(ctx, len(trajs)))
    batch.pop("rewards")
    return batch

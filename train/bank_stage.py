"""The bank stage: experience bank construction (the step batches that read from it are
:mod:`train.batches`).

* :func:`build_bank` rolls the student out over the training split (``bank.passes``
  times; once in the paper), admits the rollouts with reward >= ``bank.min_reward``
  (docs/method.md, "Experience bank"), builds the FAISS index and saves
  the bank under ``<workdir>/bank``; or loads the bank named by ``bank.path``.
  Admitted experiences keep their exact token ids, supervision spans and insertion point,
  so the cold start trains on the very ids the student produced.
* :func:`to_experience` / :func:`from_experience` convert between a trajectory and a
  bank entry.

Multi-host: every process rolls out its own rows of each bank batch; the admitted
experiences of all hosts are gathered (in row order) so every host builds the same bank
and retrieves the same experiences; process 0 saves it.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from lopd_jax.chat.tokenizers import hf_tokenizer
from lopd_jax.method.bank import EmptyBankError, Experience, ExperienceBank, without_clusters
from lopd_jax.method.embedders import HashingEmbedder
from lopd_jax.core.types import Task
from train import distributed
from lopd_jax.method.backbone_embedder import BackboneEmbedder
from train.metrics import Progress
from lopd_jax.rollout.episodes import Trajectory

BANK_DIR = "bank"
BANK_RNG_OFFSET = 1 << 20  # bank rollouts use fold_in(seed key, offset + pass * tasks + batch): never an LOPD step's key


def make_embedder(cfg):
    """The embedder the bank section names (hashing, or the backbone Qwen3-Embedding one)."""
    if cfg.bank.embedder == "hashing":
        return HashingEmbedder(dim=cfg.bank.embedder_dim)
    path = cfg.bank.embedder_path
    return BackboneEmbedder.from_pretrained(path, hf_tokenizer(path), pool_token=cfg.bank.embedder_pool_token)


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
    bank = ExperienceBank(embedder, cfg.bank_config())
    withhold = withheld_clusters(ctx)
    key = jax.random.key(cfg.seed)
    B = cfg.env.tasks_per_step
    rewards, n = [], len(ctx.train_tasks)
    batches = [(p, j) for p in range(cfg.bank.passes) for j in range(0, n, B)]
    with Progress(cfg.bank.passes * n, "bank", unit="rollout") as bar:
        for p, j in batches:  # pass 0 keeps the one-pass bank's keys
            trajs, _ = ctx.rollout_split(params, ctx.train_tasks[j:j + B],
                                         jax.random.fold_in(key, BANK_RNG_OFFSET + p * n + j))
            good = [t for t in trajs if float(t.reward) >= cfg.bank.min_reward]
            admitted = without_clusters([to_experience(t) for t in good],
                                        [ctx.source.cluster_key(t.task) for t in good], withhold)
            # every host's rewards and admitted experiences, in row order: the same bank everywhere
            batch_rewards = distributed.allgather_list([t.reward for t in trajs])
            rewards += batch_rewards
            bank.add_many(distributed.allgather_list(admitted))
            bar.update(len(batch_rewards), admitted=len(bank), reward=float(np.mean(rewards)))
    bank.num_offered = len(rewards)
    info = {"rollouts": len(rewards), "reward_mean": float(np.mean(rewards)), "entries": len(bank),
            "min_reward": cfg.bank.min_reward, "passes": cfg.bank.passes,
            **({"withheld_clusters": sorted(withhold)} if withhold else {})}
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


def withheld_clusters(ctx) -> set[str]:
    """``bank.withhold_clusters`` as a set, each key checked against the training tasks' cluster
    keys (a key no training task has is a typo, not a withheld customer)."""
    withhold = set(ctx.cfg.bank.withhold_clusters)
    unknown = withhold - {ctx.source.cluster_key(t) for t in ctx.train_tasks}
    if unknown:
        raise ValueError(f"bank.withhold_clusters names {sorted(unknown)}, which no training task has; use keys "
                         f"as TaskSource.cluster_key gives them (e.g. dispatch.ship:customer=bob)")
    return withhold


def load_bank(ctx, path: str) -> ExperienceBank:
    """The bank saved at ``path`` with the configured embedder."""
    return ExperienceBank.load(path, make_embedder(ctx.cfg))

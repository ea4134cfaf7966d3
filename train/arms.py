"""The training stage of each arm (``TrainConfig.arm``; :mod:`lopd_jax.settings.arm_config`).

:func:`training_stage` runs the arm's stage in place of the LOPD stage of
:func:`train.loop.run`; every other stage is shared. ``lopd`` and
``lopd_frozen_composer`` are :class:`train.training_stage.LOPDStage`; the others run
:class:`PolicyStage` (the same resumable loop of rollouts, batch, jitted step and held-out
evaluations) around an arm object: :class:`GRPOArm` (G rollouts per task, group-normalized
advantages, PPO-clip against the sampler's temperature-1 log-probs, ``arms.grpo_epochs``
updates per batch) or :class:`TextArm` (OPSD / SDPO / SDFT / Skill-SD: top-M + tail reverse
KL to a teacher with a text context, :mod:`train.text_steps`).

Every arm samples ``env.tasks_per_step * env.group_size`` rollouts per step, so arms
compare at equal rollouts. Every arm's state has the LOPD state's layout (plus ``ema`` for
SDFT), so export and resume read all arms' checkpoints alike (docs/baselines.md).
"""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lopd_jax.method.text_context import context_block_ids, pack_blocks, skill_summary, trajectory_text
from lopd_jax.settings.arm_config import COMPOSER_ARMS, GROUP_ARMS
from train import distributed
from train.bank_stage import to_experience
from train.bucketed_steps import BucketedGRPOStep, BucketedTextStep
from lopd_jax.rollout.episodes import training_arrays
from train.steps import make_grpo_step
from train.text_steps import make_text_distill_step, text_state_shardings
from train.training_stage import LOPDStage, TrainingStage, rollout_records, write_rollouts

SUCCESS = 1.0  # reward of a solved task (SDPO's "successful sibling")


def resolve_arm(cfg):
    """``cfg`` with what its arm implies applied: ``lopd_frozen_composer`` sets
    ``steps.freeze_composer`` (the config itself checks the arm's settings, e.g. that
    ``arms.group_size`` divides the rollouts per step)."""
    if cfg.arm == "lopd_frozen_composer" and not cfg.steps.freeze_composer:
        cfg = dataclasses.replace(cfg, steps=dataclasses.replace(cfg.steps, freeze_composer=True))
    return cfg


def uses_composer(cfg) -> bool:
    """Whether the arm needs the composer (and so the cold start)."""
    return cfg.arm in COMPOSER_ARMS


def group_size(cfg) -> int:
    """G, rollouts per drawn task, of the arm."""
    return cfg.arms.group_size if cfg.arm in GROUP_ARMS else cfg.env.group_size


def rollouts_per_step(cfg) -> int:
    """Rollouts every arm samples per training step (the equal-budget unit)."""
    return cfg.env.tasks_per_step * cfg.env.group_size


def training_stage(ctx, bank, bank_path: str, composer0, writer):
    """Run the arm's training stage; returns ``(state, preempted)``."""
    arm = ctx.cfg.arm
    if arm in COMPOSER_ARMS:
        return LOPDStage(ctx, bank, bank_path, composer0, writer).run()
    impl = GRPOArm(ctx) if arm == "grpo" else TextArm(ctx, bank)
    return PolicyStage(ctx, impl, composer0, bank_path, writer).run()


# ----------------------------------------------------------------------------- arms


class GRPOArm:
    """GRPO (docs/method.md, "Baselines in brief") on the run's rollouts: see the module docstring."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.group_size = ctx.cfg.arms.group_size
        self.epochs = ctx.cfg.arms.grpo_epochs

    def init_state(self, state):
        """The training state as is (GRPO adds nothing to the LOPD state's layout)."""
        return state

    def shardings(self, state):
        """The LOPD state's shardings."""
        return self.ctx.system.state_shardings(state)

    def batch(self, step: int, trajs) -> dict[str, np.ndarray]:
        """The GRPO batch of step ``step``'s trajectories: tokens, masks, sampler log-probs, rewards."""
        ctx = self.ctx
        arr = training_arrays(trajs, buckets=ctx.seq_buckets(), minimum=128, pad_id=ctx.tokenizer.pad_token_id or 0)
        batch = {"tokens": arr["tokens"], "attention_mask": arr["attention_mask"], "loss_mask": arr["mask"],
                 "old_logp": arr["raw_logprobs"], "rewards": arr["rewards"]}
        # with lengths.buckets: every row in length-bucketed passes (train.bucketed_steps)
        return ctx.bucketed(batch, self.group_size) if ctx.cfg.lengths.enabled else batch

    def make_step(self, state, batch):
        """The jitted GRPO update, repeated ``arms.grpo_epochs`` times per batch (epoch 1's
        metrics); length-bucketed (:class:`train.bucketed_steps.BucketedGRPOStep`) when the
        batch is."""
        if isinstance(batch, dict):
            step = make_grpo_step(self.ctx.system, state, batch, group_size=self.group_size)
        else:
            step = BucketedGRPOStep(self.ctx.system, state, group_size=self.group_size)

        def run(st, frozen, b):
            first = None
            for _ in range(self.epochs):  # epoch 1's metrics: its ratio is exactly pi / pi_sampler
                st, m = step(st, frozen, b)
                first = m if first is None else first
            return st, first
        return run

    def after_step(self, metrics: dict) -> None:
        """Nothing to update after a step."""
        pass

    def meta(self) -> dict:
        """No state of its own in the checkpoint metadata."""
        return {}

    def restore(self, meta: dict) -> None:
        """Nothing of its own to restore."""
        pass


class TextArm:
    """OPSD / SDPO / SDFT / Skill-SD: chooses each row's text context (see the module and
    :mod:`lopd_jax.method.text_context` docstrings, and docs/baselines.md for the choices)."""

    def __init__(self, ctx, bank):
        cfg = ctx.cfg
        self.ctx, self.arm = ctx, cfg.arm
        self.group_size = group_size(cfg)
        self.width = cfg.arms.context_tokens
        self.ema_decay = cfg.arms.ema_decay if self.arm == "sdft" else None
        self._hints: dict[tuple[str, int], str] = {}
        self.by_family: dict[str, list] = {}
        for t in ctx.train_tasks:
            self.by_family.setdefault(t.family, []).append(t)
        self.skills: list[dict] = build_skills(bank.entries) if self.arm == "skill_sd" else []
        self.ucb = UCB1(len(self.skills), cfg.arms.ucb_c)
        self._picked: list[int | None] = []

    # ----- contexts -----
    def hint(self, task) -> str:
        """The task's oracle hint (the task source's ``oracle_hint``), cached per task and
        drift of its hidden rule (a drifting source changes a task's solution)."""
        key = (task.task_id, task.payload.get("drift_index", 0))
        if key not in self._hints:
            self._hints[key] = self.ctx.source.oracle_hint(task)
        return self._hints[key]

    def demonstration(self, task, step: int, row: int) -> str:
        """SDFT's demonstration: another training task of ``task``'s family (drawn from
        (seed, step, row)) with its reference solution."""
        pool = [t for t in self.by_family.get(task.family, []) if t.task_id != task.task_id]
        if not pool:
            pool = [t for t in self.ctx.train_tasks if t.task_id != task.task_id] or [task]
        other = random.Random(f"{self.ctx.cfg.seed}/{step}/{row}").choice(pool)
        other = self.ctx.source.at_step([other], step)[0]
        return f"Task: {other.instruction}\nSolution:\n{self.hint(other)}"

    def contexts(self, step: int, trajs: Sequence) -> tuple[list[str | None], list[int | None]]:
        """Per row: the context text (None: no distillation) and the skill index picked."""
        texts: list[str | None] = []
        picked: list[int | None] = [None] * len(trajs)
        if self.arm == "opsd":
            texts = [self.hint(t.task) for t in trajs]
        elif self.arm == "sdft":
            texts = [self.demonstration(t.task, step, i) for i, t in enumerate(trajs)]
        elif self.arm == "sdpo":
            G = self.group_size
            for i, t in enumerate(trajs):
                g0 = i - i % G
                sibs = [j for j in range(g0, g0 + G) if j != i and trajs[j].reward >= SUCCESS]
                # the first successful sibling after this row in the group (cyclically)
                sibs.sort(key=lambda j: (j - i) % G)
                texts.append(trajectory_text(to_experience(trajs[sibs[0]]), self.ctx.cfg.bank.max_obs_chars)
                             if sibs else None)
        elif self.arm == "skill_sd":
            for i, t in enumerate(trajs):
                cands = [k for k, s in enumerate(self.skills) if s["family"] == t.task.family] or \
                    list(range(len(self.skills)))
                k = self.ucb.select(cands) if cands else None
                picked[i] = k
                texts.append(None if k is None else self.skills[k]["text"])
        else:
            raise ValueError(f"TextArm does not run arm {self.arm!r}")
        return texts, picked

    # ----- arm protocol -----
    def init_state(self, state):
        """The training state, with SDFT's EMA teacher (a copy of the student) added."""
        if self.ema_decay is not None:
            state = {**state, "ema": jax.tree.map(jnp.copy, state["student"])}
        return state

    def shardings(self, state):
        """The text-distillation state's shardings (:func:`train.text_steps.text_state_shardings`)."""
        return text_state_shardings(self.ctx.system, state)

    def batch(self, step: int, trajs):
        """The text-distillation batch of step ``step``'s trajectories, each row with its
        context block; with ``lengths.buckets`` a :class:`train.bucketed_steps.BucketedBatch`
        of it (built from every row, the same on every process)."""
        ctx = self.ctx
        pad = ctx.tokenizer.pad_token_id or 0
        texts, self._picked = self.contexts(step, trajs)
        blocks = [None if x is None else context_block_ids(ctx.tokenizer, self.arm, x, self.width) for x in texts]
        ctx_ids, ctx_len = pack_blocks(blocks, self.width, pad)
        arr = training_arrays(trajs, buckets=ctx.seq_buckets(), minimum=128, pad_id=pad)
        batch = {"tokens": arr["tokens"], "attention_mask": arr["attention_mask"], "loss_mask": arr["mask"],
                 "insert_at": arr["insert_at"], "ctx_ids": ctx_ids, "ctx_len": ctx_len,
                 "row_weight": np.asarray([x is not None for x in texts], np.float32), "rewards": arr["rewards"],
                 "old_logp": arr["raw_logprobs"]}  # the sampler's log-probs, for steps.is_correction
        # with lengths.buckets: every row in length-bucketed passes (train.bucketed_steps)
        return ctx.bucketed(batch) if ctx.cfg.lengths.enabled else batch

    def make_step(self, state, batch):
        """The jitted text-distillation update (:func:`train.text_steps.make_text_distill_step`);
        length-bucketed (:class:`train.bucketed_steps.BucketedTextStep`) when the batch is."""
        if not isinstance(batch, dict):
            return BucketedTextStep(self.ctx.system, state, self.ema_decay)
        return make_text_distill_step(self.ctx.system, state, batch, self.ema_decay)

    def after_step(self, metrics: dict) -> None:
        """Skill-SD: credit each picked skill with its row's improvement (UCB1 update)."""
        if self.arm == "skill_sd":
            per_row = np.asarray(metrics["delta_per_rollout"], np.float64)
            for k, r in zip(self._picked, per_row):
                if k is not None:
                    self.ucb.update(k, float(r))

    def meta(self) -> dict:
        """Skill-SD's UCB1 state for the checkpoint metadata."""
        return {"ucb": self.ucb.state()} if self.arm == "skill_sd" else {}

    def restore(self, meta: dict) -> None:
        """Skill-SD: the UCB1 state of a restored checkpoint."""
        if self.arm == "skill_sd" and "ucb" in meta:
            self.ucb.set_state(meta["ucb"])


def build_skills(entries) -> list[dict]:
    """Skill-SD's library: one :func:`lopd_jax.method.text_context.skill_summary` per distinct
    procedure among the bank's (successful) trajectories, with its family."""
    out, seen = [], set()
    for e in entries:
        text = skill_summary(e)
        if text not in seen:
            seen.add(text)
            out.append({"text": text, "family": (e.info or {}).get("family") or e.env_id})
    return out


class UCB1:
    """UCB1 over ``n`` arms: untried arms first (lowest index), then the largest
    ``mean + c * sqrt(2 ln N / n_k)`` with N the pulls among the candidates."""

    def __init__(self, n: int, c: float = 1.0):
        self.c = c
        self.counts = [0] * n
        self.sums = [0.0] * n

    def select(self, candidates: Sequence[int]) -> int:
        """The arm to pull among ``candidates``."""
        for k in candidates:
            if self.counts[k] == 0:
                return k
        total = sum(self.counts[k] for k in candidates)

        def score(k):
            return self.sums[k] / self.counts[k] + self.c * math.sqrt(2 * math.log(total) / self.counts[k])
        return max(candidates, key=score)

    def update(self, k: int, reward: float) -> None:
        """Record one pull of arm ``k`` with ``reward``."""
        self.counts[k] += 1
        self.sums[k] += reward

    def state(self) -> dict:
        """JSON state (checkpoint metadata)."""
        return {"counts": list(self.counts), "sums": list(self.sums)}

    def set_state(self, s: dict) -> None:
        """Inverse of :meth:`state`."""
        self.counts, self.sums = [int(x) for x in s["counts"]], [float(x) for x in s["sums"]]


# ----------------------------------------------------------------------------- the loop


class PolicyStage(TrainingStage):
    """The training stage of a non-LOPD arm around an arm object (:class:`GRPOArm`,
    :class:`TextArm`): the shared resumable loop (stage name ``lopd``, so metrics, plots,
    checkpoints and export are shared) with the arm's batch and step.

    Multi-host: each process rolls out only the rows it owns (like the LOPD stage), then
    every row's trajectory is gathered to every process in row order, so the arm's batch
    builder (group advantages, SDPO's sibling, Skill-SD's UCB1 choice, SDFT's
    demonstration) runs identically on every host over all rows; each process then keeps
    its own rows of every per-row array (:meth:`make_batch`) for the loop's global arrays.
    The step's metrics are global (replicated), so host state updated from them (Skill-SD's
    UCB1 counts) stays the same on every process."""

    def __init__(self, ctx, impl, composer0, bank_path: str, writer):
        cfg, system = ctx.cfg, ctx.system
        state, frozen = system.init_state(composer=composer0, seed=cfg.seed)
        state = impl.init_state(state)
        shardings = impl.shardings(state)
        G = impl.group_size
        n_roll = rollouts_per_step(cfg)
        if n_roll % ctx.batch_shards:
            raise ValueError(f"{n_roll} rollouts per step do not split over {ctx.batch_shards} batch "
                             "shards; make env.tasks_per_step * env.group_size a multiple of mesh.data * mesh.fsdp.")
        super().__init__(ctx, state, frozen, shardings, n_roll // G, G, bank_path, writer)
        self.impl, self.label, self.rows = impl, cfg.arm, n_roll

    def gather(self, s: int, mine: list, local: dict) -> tuple[list, dict]:
        """Every row's trajectory of step ``s`` (each process rolled out its own rows; all are
        gathered to every process, in row order) and their statistics."""
        parts = distributed.allgather_objects(mine)  # every process's rows, in process (= row) order
        trajs = [t for part in parts for t in part]
        if len(trajs) != self.rows:
            raise ValueError(f"gathered {len(trajs)} of {self.rows} rollouts of step {s + 1}")
        info = {"rollouts": len(trajs), "rollout_seconds": local["rollout_seconds"],
                "reward_mean": float(np.mean([t.reward for t in trajs])),
                "success_rate": float(np.mean([t.reward >= SUCCESS for t in trajs])),
                "mean_length": float(np.mean([len(t) for t in trajs]))}
        if self.log_rollouts:
            rows, row = [], 0
            for p, part in enumerate(parts):
                rows += rollout_records("lopd", s + 1, part, row, p)
                row += len(part)
            write_rollouts(self.rollout_log, rows)
        return trajs, info

    def make_batch(self, s: int, trajs) -> dict:
        """This process's rows of the arm's batch (built from every row, the same on every
        process; :meth:`train.run_context.RunContext.local_rows`)."""
        batch = self.impl.batch(s, trajs)
        lo, hi = self.ctx.local_rows(self.rows)
        if (lo, hi) == (0, self.rows) or not isinstance(batch, dict):  # a BucketedBatch puts its own rows
            return batch
        for k, v in batch.items():
            if np.shape(v)[:1] != (self.rows,):
                raise ValueError(f"batch entry {k!r} has shape {np.shape(v)}, not {self.rows} rows first")
        return {k: np.asarray(v)[lo:hi] for k, v in batch.items()}

    def make_step(self, state, batch):
        """The arm's jitted step."""
        return self.impl.make_step(state, batch)

    def after_step(self, metrics):
        """The metrics on the host, after the arm has read them (Skill-SD's UCB1 update)."""
        metrics = jax.device_get(metrics)
        self.impl.after_step(metrics)
        return metrics

    def meta(self, s: int) -> dict:
        """The shared metadata plus the arm and its own state."""
        return {**super().meta(s), "arm": self.ctx.cfg.arm, **self.impl.meta()}

    def restore(self, state, meta: dict) -> None:
        """Continue from a restored checkpoint, the arm's own state included."""
        super().restore(state, meta)
        self.impl.restore(meta)

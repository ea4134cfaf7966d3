"""What every stage of a training run shares: the run context.

:class:`RunContext` builds, once per process, everything the stages use from a
:class:`lopd_jax.settings.config.TrainConfig`: tokenizer, chat format and latent block, splice
layout, mesh and sharding rules, the initial backbone theta (random ``model.name`` or the
``model.hf_path`` checkpoint), the :class:`train.system.LOPDSystem`, the rollout engine
(:class:`lopd_jax.rollout.engine.Engine`) and the task source with its splits. Which stages of the run finished is the
stage ledger's business (:mod:`train.ledger`).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lopd_jax.chat.formats import make_chat_format
from lopd_jax.chat.tokenizers import TINY_FAMILIES, _builtin_corpus, hf_tokenizer, qwen3_tokenizer, tiny_tokenizer
from lopd_jax.envs.registry import get_task_source
from lopd_jax.settings.errors import ConfigError
from models import from_pretrained
from models.decoder import Decoder
from train import distributed, mesh as mesh_lib
from train.bucketed_steps import bucketed_batch, grpo_bucketed_batch, with_group_advantages
from train.packed_batches import model_attention_length, packed_batch
from lopd_jax.rollout.engine import Engine
from lopd_jax.rollout.engine_calls import key_data
from lopd_jax.rollout.episodes import EpisodeBatch, prepare_episodes, rollout
from train.step_spec import splice_layout, step_spec
from train.system import LOPDSystem


def domain_corpus(source, split: str, family: str) -> str:
    """The tiny tokenizer's training text: its built-in corpus plus the rendered prompts
    (system text, tool schemas, instructions) of ``split``, so the tiny BPE learns the
    environment's own vocabulary and prompts take about half as many tokens."""

    fmt = make_chat_format(family, tiny_tokenizer(family))
    texts = []
    for task in source.tasks(split):
        env = source.make_env()
        try:
            messages, tools = env.reset(task)
            texts.append(fmt.render(messages, tools, add_generation_prompt=True))
        finally:
            env.close()
    return _builtin_corpus() + "\n" + "\n".join(dict.fromkeys(texts))


def run_tokenizer(cfg, family: str, source_fn):
    """The run's tokenizer (``model.tokenizer``; ``auto`` resolved as :class:`lopd_jax.settings.config.ModelSection`
    says). ``source_fn()`` gives the task source, needed only by the tiny tokenizer (its corpus)."""
    m = cfg.model
    kind = m.tokenizer
    if kind == "auto":
        kind = "hf" if m.hf_path else ("tiny" if (m.name or "").startswith("tiny") else family)
    if kind == "tiny":
        if family not in TINY_FAMILIES:
            raise ConfigError(f"model.tokenizer=tiny has no chat tokens for family {family!r} (it serves the "
                              f"random-init tiny models: {sorted(TINY_FAMILIES)}); with model.hf_path set "
                              "model.tokenizer=auto, which reads the checkpoint's own tokenizer.")
        # as many base tokens as the model's vocabulary leaves room for (the corpus may give fewer)
        return tiny_tokenizer(family, vocab_size=max(512, (m.vocab_size or 512) - 32),
                              corpus=domain_corpus(source_fn(), cfg.env.train_split, family))
    if kind == "hf":
        return hf_tokenizer(m.hf_path)  # local or gs://
    if kind == "qwen3":
        return qwen3_tokenizer()
    raise ValueError(f"no built-in tokenizer for family {family!r}; set model.tokenizer=hf with model.hf_path.")


def stratified(tasks, n: int) -> list:
    """The first ``n`` of ``tasks`` taken round-robin over their families (in order of first
    appearance), so a capped evaluation set covers every family instead of the first few."""
    by_family: dict[str, list] = {}
    for t in tasks:
        by_family.setdefault(t.family, []).append(t)
    out, queues = [], [list(v) for v in by_family.values()]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


class RunContext:
    """The static pieces of a run, built from its config (see the module docstring).

    Attributes: ``cfg``, ``tokenizer``, ``fmt`` (chat format), ``block`` (LatentBlock),
    ``layout`` (SpliceLayout), ``mesh``, ``rules``, ``model_cfg``, ``system``,
    ``engine`` (the rollout engine), ``source``, ``train_tasks``, ``eval_tasks``.
    """

    def __init__(self, cfg):
        self.cfg = cfg
        self.spec = step_spec(cfg)  # the LOPD step's shapes and settings (shared with the compile check)
        self.model_cfg = self.spec.model
        self.source = get_task_source(cfg.env.source, **cfg.env.kwargs)
        self.tokenizer = run_tokenizer(cfg, self.model_cfg.family, lambda: self.source)
        if len(self.tokenizer) > self.model_cfg.vocab_size:
            raise ValueError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's vocabulary is "
                             f"{self.model_cfg.vocab_size}; raise model.vocab_size.")
        self.fmt, self.block, self.layout = splice_layout(cfg, self.model_cfg.family, self.tokenizer)
        self.mesh = mesh_lib.make_mesh(self.spec.mesh)
        self.rules = mesh_lib.rules_for(self.mesh, self.spec.mesh)
        if cfg.model.hf_path:
            m = cfg.model
            backbone = from_pretrained(m.hf_path, dtype=m.dtype, param_dtype=m.param_dtype, mesh=self.mesh,
                                       rules=self.rules, lora=cfg.composer.lora, attention_impl=m.attention_impl,
                                       yarn_on_sliding_layers=m.yarn_on_sliding_layers, lora_seed=cfg.seed,
                                       remat_policy=m.remat_policy, attention_block_q=m.attention_block_q,
                                       attention_block_kv=m.attention_block_kv)
        else:
            backbone = Decoder(self.model_cfg, rngs=nnx.Rngs(cfg.seed), rules=self.rules)
        self.system = LOPDSystem.create(backbone, self.spec.composer, self.layout, self.spec.steps, self.rules,
                                        seed=cfg.seed)
        # place theta0 / LoRA / compressor on the mesh once (random init builds on one device)
        theta, lora, comp = self.system.initial_params()
        self.system._theta0 = mesh_lib.put(theta, self.system.frozen_shardings())
        sh = self.system.composer_shardings()
        self.system._lora0 = mesh_lib.put(lora, sh["lora"])
        self.system._comp0 = mesh_lib.put(comp, sh["compressor"])
        self.student_lora = self.cfg.steps.student_mode == "lora"
        self.engine = Engine(backbone, stop_ids=self.fmt.stop_ids, config=cfg.engine,
                             sampling=cfg.rollout.sampling, lora=self.student_lora,
                             pad_id=self.tokenizer.pad_token_id or 0)
        self.train_tasks = self.source.tasks(cfg.env.train_split)
        eval_tasks = self.source.tasks(cfg.env.eval_split)
        self.eval_tasks = stratified(eval_tasks, cfg.stages.eval_tasks) if cfg.stages.eval_tasks else eval_tasks
        if not self.train_tasks:
            raise ValueError(f"the {cfg.env.source!r} source has no {cfg.env.train_split!r} tasks; "
                             "check env.kwargs / env.train_split.")

    # ----- helpers shared by the stages -----
    def set_theta0(self, theta) -> None:
        """Make ``theta`` (e.g. the warmed-up backbone) the frozen theta0 and the student's start."""
        self.system._theta0 = mesh_lib.put(theta, self.system.frozen_shardings())

    def ckpt_dir(self, stage: str) -> str:
        """Checkpoint directory of one stage."""
        return os.path.join(self.cfg.checkpoint_dir, stage)

    def policy_params(self, student, frozen) -> dict:
        """The rollout's parameter dict for a student (full params or LoRA) and theta0."""
        _, lora0, _ = self.system.initial_params()
        if self.student_lora:
            return {**frozen, **student}
        return {**student, **lora0}

    def student_model(self, student, frozen):
        """The student as a Decoder (for export): full params with a zero-B adapter, or
        theta0 plus the student's LoRA (merged by the exporter)."""
        _, lora0, _ = self.system.initial_params()
        if self.student_lora:
            return self.system.backbone(frozen, student)
        # zeros on the adapters' own devices (the arrays may span hosts: no host round trip)
        return self.system.backbone(student, jax.jit(lambda t: jax.tree.map(jnp.zeros_like, t))(lora0))

    @property
    def batch_shards(self) -> int:
        """Devices a step batch's rows are split over (the mesh's ``act_batch`` axes)."""
        spec = self.rules.spec(("act_batch",))[0]
        axes = () if spec is None else ((spec,) if isinstance(spec, str) else spec)
        return int(np.prod([self.rules.mesh.shape[a] for a in axes])) if axes else 1

    def local_rows(self, rows: int) -> tuple[int, int]:
        """``[start, stop)``: the rows of a ``rows``-row step batch this process owns (as the
        batch sharding places them; all rows on one process)."""
        if jax.process_count() == 1:
            return 0, rows
        return distributed.row_range(mesh_lib.batch_sharding(self.rules, 1), rows)

    def rollout(self, params, tasks, rng, sampling=None, *, first_episode: int = 0, on_finish=None):
        """Trajectories of ``tasks`` under ``params`` on this process's engine; task ``i`` is
        episode ``first_episode + i`` (:func:`lopd_jax.rollout.episodes.rollout`)."""
        return rollout(self.engine, params, self.fmt, self.source.make_env, list(tasks), rng,
                       self.cfg.rollout.caps, sampling, first_episode=first_episode, on_finish=on_finish)

    def rollout_split(self, params, tasks, rng, sampling=None, *, gather: bool = False, first_episode: int = 0):
        """Roll out a whole batch ``tasks`` (the same list on every process) split across hosts.

        Each process rolls out only the rows it owns (:meth:`local_rows`) and gets their
        trajectories back; ``gather=True`` returns every row's trajectory, in order, on
        every process (:func:`train.distributed.allgather_list`). Row ``r`` is episode
        ``first_episode + r``, whichever process runs it.
        Returns ``(trajectories, first_row)``: the row of the first returned trajectory.
        """
        tasks = list(tasks)
        if jax.process_count() == 1:
            return self.rollout(params, tasks, rng, sampling, first_episode=first_episode), 0
        lo, hi = self.task_rows(len(tasks))
        mine = self.rollout(params, tasks[lo:hi], rng, sampling, first_episode=first_episode + lo)
        return (distributed.allgather_list(mine), 0) if gather else (mine, lo)

    def task_rows(self, n: int) -> tuple[int, int]:
        """``[lo, hi)``: the tasks of an ``n``-task batch this process rolls out (its rows
        of the batch padded to whole batch shards, cut at ``n``)."""
        if jax.process_count() == 1:
            return 0, n
        lo, hi = self.local_rows(-(-n // self.batch_shards) * self.batch_shards)
        return min(lo, n), min(hi, n)

    def prepare_rows(self, tasks, rng, first_episode: int) -> EpisodeBatch:
        """``tasks`` (rows ``first_episode..`` of a batch) made ready for the engine, sampled
        with ``rng`` (:func:`lopd_jax.rollout.episodes.prepare_episodes`)."""
        return prepare_episodes(list(tasks), self.source.make_env, self.fmt, self.cfg.rollout.caps,
                                first_episode=first_episode, rng=key_data(rng))

    def seq_buckets(self) -> tuple[int, ...]:
        """The padded training sequence length: one bucket, the total-token cap rounded up
        to 128. Step batches are built at it; with ``lengths.buckets`` the training stage
        then cuts their rows into length-bucketed passes (:meth:`length_buckets`)."""
        return (self.spec.seq,)

    def length_buckets(self) -> tuple[int, ...]:
        """The training passes' sequence lengths: ``lengths.buckets`` below the cap, then
        the cap (:meth:`lopd_jax.settings.length_config.LengthConfig.bucket_lengths`)."""
        return self.cfg.lengths.bucket_lengths(self.spec.seq)

    def bucketed(self, batch: dict, group_size: int | None = None):
        """The whole step batch ``batch`` (numpy, every row; the same on every process) as a
        :class:`train.bucketed_steps.BucketedBatch` of ``lengths.buckets`` passes (of packed
        rows with ``lengths.packing``, :func:`train.packed_batches.packed_batch`); GRPO
        batches (``group_size``) get their group advantages first. Tokens per batch shard
        and pass: ``lengths.bucket_tokens``, or the padded step's (``steps.micro_batch``
        rows, or all of a shard's rows, times the cap)."""
        rows, shards = len(batch["tokens"]), self.batch_shards
        local = max(1, rows // shards)
        micro = self.cfg.steps.micro_batch
        per_shard = self.cfg.lengths.bucket_tokens or (micro if 0 < micro < local else local) * self.spec.seq
        if self.cfg.lengths.packing:
            if group_size is not None:
                batch = with_group_advantages(batch, group_size)
            splice = self.system.layout if "exp_tokens" in batch else None  # LOPD and cold start: latents
            return packed_batch(batch, self.length_buckets(), per_shard, shards, splice,
                                model_attention_length(self.system.model_cfg))
        args = (self.length_buckets(), per_shard, shards, self.cfg.lengths.fill)
        if group_size is not None:
            return grpo_bucketed_batch(batch, group_size, *args)
        return bucketed_batch(batch, *args)

"""The paper's "Base + Composer" evaluation: the base model conditioned on composer latents.

:func:`load_composer_run` reopens a training run with :func:`train.run_reader.open_run`:
theta0 (the frozen backbone the composer was trained against), the composer phi of the
newest ``lopd`` checkpoint or of the ``cold_start`` one (``stage="cold_start"``, or
``"auto"`` before LOPD has a checkpoint) and the run's bank. :func:`latent_context`
retrieves ``bank.eval_n_ret`` experiences per task (the release's setting is 1; default
``composer.n_ret``), encodes them exactly as the training steps do and returns a
:class:`lopd_jax.rollout.episodes.LatentContext`: the rollout prefills each task's
teacher-format prompt with the latents at the slots, and theta0 generates from there.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from lopd_jax.method.splice import SpliceLayout
from lopd_jax.settings.errors import ConfigError
from lopd_jax.settings.run_config import load_run_config
from train import mesh as mesh_lib
from train.batches import experience_arrays
from train.checkpoint import CheckpointError
from train.distributed import replicated_array
from lopd_jax.rollout.episodes import LatentContext
from train.run_reader import COMPOSER_STAGES, open_run

@dataclasses.dataclass
class ComposerRun:
    """A reopened run: ``ctx`` (:class:`train.run_context.RunContext`), ``frozen`` theta0,
    ``composer`` ``{"lora", "compressor"}``, ``bank``, the ``stage`` and ``step`` the
    composer came from."""

    ctx: object
    frozen: dict
    composer: dict
    bank: object
    stage: str
    step: int
    latents_fn: object = dataclasses.field(default=None, repr=False)

    def base_params(self) -> dict:
        """The sampler's parameters of the base policy theta0 (LoRA slots with B = 0 are
        never applied by the rollout sampler unless the run trains a LoRA student, and
        then they hold the fresh, zero adapter)."""
        _, lora0, _ = self.ctx.system.initial_params()
        return {**self.frozen, **lora0}


def load_composer_run(workdir: str, stage: str = "auto") -> ComposerRun:
    """Reopen the run in ``workdir`` (see the module docstring; :func:`train.run_reader.open_run`).

    Raises ``ValueError`` naming what is missing (no config, no bank, no composer
    checkpoint of the asked stage).
    """

    if stage not in COMPOSER_STAGES:
        raise ValueError(f"composer stage {stage!r}: choose from {COMPOSER_STAGES}")
    try:
        run = open_run(workdir, load_run_config(workdir))
        run.bank_path()  # the bank stage finished: checked before the costly part (model and system)
        frozen = run.theta0()
        composer, found, step = run.composer(stage)
        bank = run.bank()
    except (ConfigError, CheckpointError) as e:
        raise ValueError(str(e)) from None
    return ComposerRun(run.ctx, frozen, composer, bank, found, step)


def eval_n_ret(ctx) -> int:
    """Experiences retrieved per task for Base + Composer (``bank.eval_n_ret`` or ``composer.n_ret``)."""
    return ctx.cfg.bank.eval_n_ret or ctx.cfg.composer.n_ret


def eval_layout(ctx):
    """The latent block of Base + Composer prompts: ``eval_n_ret * K`` slots (the run's own
    layout when ``eval_n_ret == composer.n_ret``)."""

    n = eval_n_ret(ctx)
    if n == ctx.cfg.composer.n_ret:
        return ctx.layout
    block = ctx.fmt.framing_ids(ctx.cfg.composer.latent_framing(n * ctx.cfg.composer.num_latents))
    return SpliceLayout(tuple(block.before_ids), tuple(block.after_ids), block.num_slots, block.slot_id)


def task_latents(run: ComposerRun, tasks: Sequence) -> jax.Array:
    """c_phi [len(tasks), eval_n_ret * K, d] from the run's composer and retrieved experiences.

    The composer encodes each experience on its own, so it serves any number of them (the
    release trains with 3 and evaluates Base + Composer with 1). The sampler cannot mask
    slots inside its KV cache, so a task with fewer hits than ``eval_n_ret`` repeats them.
    """

    ctx = run.ctx
    n = eval_n_ret(ctx)
    instructions = [t.instruction for t in tasks]
    hits = run.bank.retrieve(instructions, [t.task_id for t in tasks], n)
    hits = [[h[i % len(h)] for i in range(n)] for h in hits]
    exp_tokens, exp_mask = experience_arrays(ctx, instructions, hits, n)
    if run.latents_fn is None:
        run.latents_fn = jax.jit(ctx.system.latents)
    if jax.process_count() > 1:  # the same inputs on every process, as one global replicated value
        exp_tokens, exp_mask = (replicated_array(x, mesh_lib.replicated(ctx.rules)) for x in (exp_tokens, exp_mask))
    else:
        exp_tokens, exp_mask = jnp.asarray(exp_tokens), jnp.asarray(exp_mask)
    return run.latents_fn(run.frozen, run.composer, exp_tokens, exp_mask)


def rows_latent_context(run: ComposerRun, tasks: Sequence, lo: int, hi: int):
    """The :class:`lopd_jax.rollout.episodes.LatentContext` of ``tasks[lo:hi]``, the rows of one batch
    ``tasks`` (the same list on every process) that this process rolls out.

    On one process: :func:`latent_context` of those tasks. On several, every process
    encodes the whole batch (one global program) and takes its rows of the latents as host
    numpy, so the rollout's per-process inputs are this process's rows only.
    """
    if jax.process_count() == 1:
        return latent_context(run, list(tasks)[lo:hi])

    latents = np.asarray(multihost_utils.process_allgather(task_latents(run, tasks), tiled=True))[lo:hi]
    return LatentContext(eval_layout(run.ctx), latents)


def latent_context(run: ComposerRun, tasks: Sequence, latents=None):
    """A :class:`lopd_jax.rollout.episodes.LatentContext` for ``tasks`` (``latents`` default:
    :func:`task_latents`); the other prompt ids take the policy's own embeddings."""

    latents = task_latents(run, tasks) if latents is None else latents
    return LatentContext(eval_layout(run.ctx), latents)

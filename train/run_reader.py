"""Open a finished or partial training run: config, context, theta0, student, composer, bank.

:func:`open_run` reads a run's working directory (``stages.json``, the stage checkpoints,
the bank) the way :mod:`train.loop` wrote it, given the run's saved config, and returns a
:class:`Run` whose pieces are restored on first use: ``ctx`` (the run context, with
``workdir`` set to where the run is now), :meth:`Run.theta0` (the frozen backbone after
any warm-up), :meth:`Run.student` (a training-stage checkpoint's student, any arm),
:meth:`Run.composer` (phi from the newest ``lopd`` or ``cold_start`` checkpoint) and
:meth:`Run.bank`.

:func:`restore_newest` is the checkpoint lookup the loop's resume shares: the newest
complete step of a :class:`train.checkpoint.Checkpointer`, restored into a template's
layout. Missing pieces raise :class:`train.checkpoint.CheckpointError` naming them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from lopd_jax.io import files
from train import warmup
from train.arms.registry import arm_class
from train.bank_stage import load_bank
from train.checkpoint import Checkpointer, CheckpointError, abstract_tree
from train.ledger import StageLedger
from train.run_context import RunContext
from train.text_steps import text_state_shardings

COMPOSER_STAGES = ("auto", "lopd", "cold_start")


def restore_newest(ckpt: Checkpointer, template: Any, shardings: Any = None):
    """``(state, metadata, step)`` of the newest complete checkpoint of ``ckpt`` restored into
    ``template``'s layout (``shardings``: where each leaf goes, see
    :func:`train.checkpoint.abstract_tree`), or None when there is none."""
    step = ckpt.latest_step()
    if step is None:
        return None
    state, meta = ckpt.restore(step, abstract_tree(template, shardings))
    return state, meta, step


def _restore_stage(ctx, stage: str, template) -> tuple[Any, int | None]:
    """``(state, step)`` of the newest checkpoint of ``stage`` in ``template``'s layout, or
    ``(None, None)`` when the stage has none."""
    directory = ctx.ckpt_dir(stage)
    if not os.path.isdir(directory) and "://" not in directory:
        return None, None
    ckpt = Checkpointer(directory, async_save=False)
    try:
        found = restore_newest(ckpt, template)
        return (None, None) if found is None else (found[0], found[2])
    finally:
        ckpt.close()


def abstract_train_state(system, cfg):
    """``(abstract state, shardings)`` of the arm's training-stage checkpoint (the LOPD
    state's layout plus what the arm adds, e.g. SDFT's ``ema``), for restoring it outside the
    loop (export)."""
    abstract, _ = system.abstract_state(cfg.seed)
    abstract = arm_class(cfg.arm).add_state(cfg, abstract)
    return abstract, text_state_shardings(system, abstract)


class Run:
    """A training run reopened from its working directory (see the module docstring).

    ``cfg`` is the saved config (``workdir`` set to ``workdir``), ``ledger`` its
    :class:`train.ledger.StageLedger`; ``ctx`` (the costly part: model, system, sampler)
    is built on first use.
    """

    def __init__(self, workdir: str, cfg):
        self.workdir = workdir
        self.cfg = cfg
        self.ledger = StageLedger(workdir)
        self._theta0 = None

    @functools.cached_property
    def ctx(self):
        """The run's :class:`train.run_context.RunContext`, rebuilt from its config."""
        return RunContext(self.cfg)

    @property
    def tokenizer(self):
        """The run's tokenizer."""
        return self.ctx.tokenizer

    def theta0(self) -> dict:
        """The frozen backbone theta0 (the warm-up result when the run had a warm-up stage;
        it then also becomes the context's theta0, :meth:`RunContext.set_theta0`)."""
        if self._theta0 is not None:
            return self._theta0
        ctx, cfg = self.ctx, self.cfg
        system = ctx.system
        theta = system.initial_params()[0]
        if cfg.stages.warmup_steps > 0:
            opt, _ = warmup.make_sft_step(system, cfg.stages)
            target = {"step": jnp.zeros((), jnp.int32), "params": theta, "opt": jax.eval_shape(opt.init, theta)}
            warm, _ = _restore_stage(ctx, "warmup", target)
            if warm is None:
                raise CheckpointError(f"the run in {self.workdir!r} has a warm-up stage but no warm-up checkpoint "
                                      f"in {ctx.ckpt_dir('warmup')!r}")
            ctx.set_theta0(warm["params"])
            theta = system.initial_params()[0]
        self._theta0 = theta
        return theta

    def student(self, step: int | None = None):
        """The student parameters of training-stage (``lopd``) checkpoint ``step`` (default:
        the newest), in the arm's state layout (:func:`abstract_train_state`)."""
        directory = os.path.join(self.cfg.checkpoint_dir, "lopd")  # as ctx.ckpt_dir, without building ctx
        if not files.exists(directory):  # checked before theta0 and Orbax (which would create it)
            raise CheckpointError(self._no_student(directory))
        self.theta0()  # a LoRA student sits on theta0: the warm-up result, when there was one
        abstract, shardings = abstract_train_state(self.ctx.system, self.cfg)
        with Checkpointer(directory) as ck:
            if ck.latest_step() is None:
                raise CheckpointError(self._no_student(directory))
            state, _ = ck.restore(step, abstract_tree(abstract, shardings))
        return state["student"]

    def _no_student(self, directory: str) -> str:
        return (f"the run in {self.workdir} has no student checkpoint yet (none in {directory}): its training "
                f"stage has not saved a step. Run or resume the training (python -m lopd_jax.train with the "
                f"run's --config and --workdir={self.workdir}), then export.")

    def composer(self, stage: str = "auto") -> tuple[dict, str, int]:
        """``(composer, stage, step)``: the composer ``{"lora", "compressor"}`` of the newest
        checkpoint of ``stage`` (``lopd``, ``cold_start``, or ``auto``: ``lopd`` when it has a
        checkpoint, else ``cold_start``)."""
        if stage not in COMPOSER_STAGES:
            raise ValueError(f"composer stage {stage!r}: choose from {COMPOSER_STAGES}")
        system, seed = self.ctx.system, self.cfg.seed
        _, lora0, comp0 = system.initial_params()
        for name in (("lopd", "cold_start") if stage == "auto" else (stage,)):
            if name == "lopd":
                template, _ = system.init_state(composer={"lora": lora0, "compressor": comp0}, seed=seed)
            else:
                template = system.init_cold_start_state(seed)
            state, step = _restore_stage(self.ctx, name, template)
            if state is not None:
                return state["composer"], name, int(step)
        raise CheckpointError(f"no composer checkpoint ({stage}) in {self.cfg.checkpoint_dir!r}; "
                              "run the cold start (or LOPD) stage first")

    def bank_path(self) -> str:
        """Where the ``bank`` stage saved (or found) the bank; CheckpointError before that stage."""
        if not self.ledger.done("bank"):
            raise CheckpointError(f"the run in {self.workdir!r} has not built its experience bank yet "
                                  "(stage 'bank')")
        return self.ledger.result("bank")["path"]

    def bank(self):
        """The experience bank the ``bank`` stage built (or loaded), with the configured embedder."""
        return load_bank(self.ctx, self.bank_path())


def open_run(workdir: str, cfg) -> Run:
    """The run in ``workdir`` with its saved config ``cfg`` (the programs read it with
    :func:`lopd_jax.settings.run_config.load_run_config`, which raises
    :class:`lopd_jax.settings.errors.ConfigError` when there is none or it does not load)."""
    return Run(workdir, dataclasses.replace(cfg, workdir=workdir))  # the run may have moved


# A Hugging Face export of a run's student carries this file: where the policy came from
# and the episode settings it was trained and evaluated with, so that
# ``python -m lopd_jax.evaluate --model=EXPORT`` evaluates it the way the run did.
EXPORT_RUN_FILE = "lopd_run.json"


def export_run_info(cfg) -> dict[str, Any]:
    """The :data:`EXPORT_RUN_FILE` record of a run with config ``cfg``: its workdir, task
    source (name and kwargs), episode caps and chat settings."""
    r = cfg.rollout.caps
    return {"workdir": cfg.workdir,
            "env": {"source": cfg.env.source, "kwargs": dict(cfg.env.kwargs)},
            "rollout": {"max_env_steps": r.max_env_steps, "max_turn_tokens": r.max_turn_tokens,
                        "max_total_tokens": r.max_total_tokens},
            "chat": {"enable_thinking": cfg.rollout.enable_thinking}}


def read_export_run_info(model_dir: str) -> dict[str, Any] | None:
    """The :data:`EXPORT_RUN_FILE` record of a Hugging Face checkpoint directory (local or
    ``gs://``), or None when it is not a run's export."""

    path = files.join(model_dir, EXPORT_RUN_FILE)
    if not files.exists(path):
        return None
    try:
        info = json.loads(files.read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg}); delete it to evaluate {model_dir!r} with "
                         "the command-line defaults") from e
    if not isinstance(info, dict):
        raise ValueError(f"{path} must hold a JSON object; delete it to use the command-line defaults")
    return info

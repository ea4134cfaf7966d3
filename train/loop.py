"""The end-to-end LOPD training program: warm-up, evaluation, bank, cold start, LOPD, export.

:func:`run` executes the stages of :data:`train.ledger.STAGE_ORDER` in order; each
finished stage is recorded in ``<workdir>/stages.json`` and skipped on a rerun, and stages
with steps checkpoint and resume from their latest checkpoint. Every batch is a function of
(seed, stage, step), so a resumed run reproduces an uninterrupted one bit for bit.

Multi-host: every process runs the same program and owns a contiguous block of every
batch's rows; it rolls out and builds only those rows, and what must agree (the bank's
admitted experiences, rollout statistics, held-out trajectories) is gathered. Only process
0 writes metrics, the ledger, the bank and the export (docs/pods.md).

This module holds the stages other than training (:mod:`train.training_stage`,
:mod:`train.arms`) and orders them; nothing in ``train/`` imports it. SIGTERM sets a flag
the step loops poll: the state is saved and :func:`run` returns :data:`PREEMPTED`.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp

from lopd_jax.io import files
from models import save_pretrained
from train import mesh as mesh_lib, warmup
from lopd_jax.settings.arm_config import resolve_arm, uses_composer
from train.training_stage import ArmStage
from train.bank_stage import build_bank, from_experience, load_bank
from train.batches import batch_rows, cold_start_batch, gather_rows, local_share
from train.bucketed_steps import BucketedColdStartStep
from train.checkpoint import install_preemption_handler
from train.data import TaskPipeline
from train.ledger import StageLedger
from train.metrics import MetricsWriter, plot_run
from lopd_jax.rollout.episodes import training_arrays
from train.run_context import RunContext
from train.run_reader import EXPORT_RUN_FILE, export_run_info
from train.stage_loop import evaluate_policy, log, run_steps
from train.steps import make_cold_start_step

PREEMPTED = "preempted"
EXPORT_DIR = "export"
PLOT_FILE = "plot.png"


# ----------------------------------------------------------------------------- evaluation


def _eval_note(ev: dict) -> str:
    """``", success 8.3%, no-tool baseline 0.0000"`` for a held-out evaluation record."""
    note = f", success {ev['success_rate']:.1%}" if "success_rate" in ev else ""
    if ev.get("no_tool_baseline") is not None:
        note += f", no-tool baseline {ev['no_tool_baseline']:.4f}"
    return note


# ----------------------------------------------------------------------------- step loops


# ----------------------------------------------------------------------------- stages


def warmup_stage(ctx: RunContext, writer):
    """Supervised warm-up on oracle demonstrations; returns ``(theta, preempted)``."""

    cfg, system = ctx.cfg, ctx.system
    theta0, lora0, _ = system.initial_params()
    demos = warmup.warmup_pool(ctx)
    # the global batch's indices on every process; each builds only the rows it owns
    pipe = TaskPipeline(list(range(len(demos))), cfg.stages.warmup_batch, seed=cfg.seed, process_index=0,
                        process_count=1)
    rows = batch_rows(ctx, cfg.stages.warmup_batch)
    pad_id = ctx.tokenizer.pad_token_id or 0

    def arrays(trajs, real):
        arr = training_arrays(trajs, buckets=ctx.seq_buckets(), minimum=128, pad_id=pad_id)
        arr["mask"][real:] = 0  # padding rows carry no supervision
        return {"tokens": arr["tokens"], "attention_mask": arr["attention_mask"], "loss_mask": arr["mask"]}

    def batch_fn(s):
        items = [demos[i] for i in pipe[s]]
        if cfg.lengths.enabled:  # the whole batch on every process: the pass plan needs every row's length
            return ctx.bucketed(arrays(items + [items[-1]] * (rows - len(items)), len(items)))
        return arrays(*local_share(ctx, items, rows))

    opt, step = warmup.make_sft_step(system, cfg.stages)
    state = {"step": jnp.zeros((), jnp.int32), "params": jax.tree.map(jnp.copy, theta0)}
    state["opt"] = opt.init(state["params"])
    if cfg.lengths.enabled:  # length-bucketed passes, one update (train.warmup.BucketedSFTStep)
        jitted = warmup.BucketedSFTStep(system, state, opt)
        state_sh = jitted.state_sh
    else:
        jitted, state_sh = warmup.jit_sft_step(system, opt, step, state, batch_fn(0))
    if state_sh is not None:  # committed like the step's outputs, so step 2 does not recompile
        state = mesh_lib.put(state, state_sh)
    state, preempted = run_steps(ctx, "warmup", state, cfg.stages.warmup_steps,
                                 lambda st, b: jitted(st, lora0, b), batch_fn, shardings=state_sh, writer=writer)
    return state["params"], preempted


def cold_start_stage(ctx: RunContext, bank, writer):
    """Composer cold start on the bank's successes; ``(phi0, preempted)`` (docs/method.md, "Cold start")."""

    cfg, system = ctx.cfg, ctx.system
    trajs = [from_experience(e) for e in bank.entries]
    pipe = TaskPipeline(list(range(len(trajs))), min(cfg.stages.cold_start_batch, len(trajs)), seed=cfg.seed,
                        process_index=0, process_count=1)

    def batch_fn(s):
        batch = cold_start_batch(ctx, [trajs[i] for i in pipe[s]], bank)
        # with lengths.buckets: the whole batch (every host's rows) in length-bucketed passes
        return ctx.bucketed(gather_rows(batch)) if cfg.lengths.enabled else batch

    state = system.init_cold_start_state(cfg.seed)
    shardings = system.cold_start_shardings(state)
    state = mesh_lib.put(state, shardings)
    if cfg.lengths.enabled:
        step = BucketedColdStartStep(system, state)
    else:
        step = make_cold_start_step(system, state, batch_fn(0))
    frozen = system.initial_params()[0]
    state, preempted = run_steps(ctx, "cold_start", state, cfg.stages.cold_start_steps,
                                 lambda st, b: step(st, frozen, b), batch_fn, shardings=shardings, writer=writer)
    return state["composer"], preempted


# ----------------------------------------------------------------------------- the run


def run(cfg, resumed: bool = False) -> str | dict:
    """Run (or resume) every stage of ``cfg``; returns the summary dict or :data:`PREEMPTED`.

    The caller saves (and checks) the run's config.json first -- ``lopd_jax.train`` does,
    with :func:`lopd_jax.settings.run_config.save_run_config` -- and says whether it ``resumed``.
    """

    cfg = resolve_arm(cfg)
    ledger = _open_ledger(cfg.workdir, resumed)
    ctx = _build_context(cfg)
    writer = MetricsWriter(cfg.workdir, console=False)
    try:
        return _run_stages(ctx, ledger, writer)
    finally:
        writer.close()


def _open_ledger(workdir: str, resumed: bool) -> StageLedger:
    """Install the SIGTERM handler and open the run's ledger, logging the stages already done."""
    install_preemption_handler()
    ledger = StageLedger(workdir)
    log(f"{'resuming' if resumed else 'starting'} run in {workdir}; done: "
        f"{[s for s in ledger.data if ledger.done(s)]}")
    return ledger


def _build_context(cfg) -> RunContext:
    """The run's :class:`RunContext` (model and system), logging how long it took to build."""
    t_build = time.perf_counter()
    ctx = RunContext(cfg)
    log(f"built the model and system in {time.perf_counter() - t_build:.1f}s on {jax.device_count()} device(s)")
    return ctx


def _run_stages(ctx: RunContext, ledger: StageLedger, writer) -> str | dict:
    """Stages 1-8 in order, those the ledger has done skipped; the summary or :data:`PREEMPTED`."""
    if _run_warmup(ctx, ledger, writer):
        return PREEMPTED
    frozen, lora0, _ = ctx.system.initial_params()
    theta_params = {**frozen, **lora0}  # the starting student (theta0) in either student mode
    before = _evaluate(ctx, ledger, writer, "eval_before", theta_params, step=0)
    if jax.process_index() == 0:
        print(f"held-out reward before: {before:.4f}{_eval_note(ledger.result('eval_before'))}", flush=True)
    bank_path = _ensure_bank(ctx, ledger, theta_params)
    bank = load_bank(ctx, bank_path)
    composer0, preempted = _run_cold_start(ctx, ledger, bank, writer)
    if preempted:
        return PREEMPTED
    t0 = time.perf_counter()
    state, preempted = ArmStage(ctx, bank, bank_path, composer0, writer).run()  # LOPD or the arm's (train.arms)
    if preempted:
        return PREEMPTED
    _mark_once(ledger, "lopd", t0)
    student = ctx.policy_params(state["student"], frozen)
    after = _evaluate(ctx, ledger, writer, "eval_after", student, step=ctx.cfg.stages.lopd_steps)
    _export_and_plot(ctx, ledger, writer, state["student"], frozen)
    return _summary(ledger, before, after)


def _mark_once(ledger: StageLedger, stage: str, t0: float) -> None:
    """Record ``stage`` as done, with the seconds since ``t0``, unless a previous run did."""
    if not ledger.done(stage):
        ledger.mark(stage, seconds=time.perf_counter() - t0)


def _run_warmup(ctx: RunContext, ledger: StageLedger, writer) -> bool:
    """1. The warm-up (tiny random-init models), when it has steps; True when preempted."""
    t0 = time.perf_counter()
    if ctx.cfg.stages.warmup_steps > 0:
        theta, preempted = warmup_stage(ctx, writer)
        if preempted:
            return True
        ctx.set_theta0(theta)
        _mark_once(ledger, "warmup", t0)
    return False


def _evaluate(ctx: RunContext, ledger: StageLedger, writer, stage: str, params, step: int) -> float:
    """The held-out evaluation ``stage`` (2. ``eval_before``, 6. ``eval_after``) of ``params``
    after ``step`` training steps, unless done; returns its mean reward."""
    if not ledger.done(stage):
        t0 = time.perf_counter()
        ev = evaluate_policy(ctx, params, step=step)
        writer.write(step, stage, ev)
        writer.flush()  # before the ledger says done: a gs:// metrics object then has it
        ledger.mark(stage, seconds=time.perf_counter() - t0, **ev)
    return ledger.result(stage)["reward_mean"]


def _ensure_bank(ctx: RunContext, ledger: StageLedger, theta_params) -> str:
    """3. The experience bank, built unless done; returns its path."""
    if not ledger.done("bank"):
        t0 = time.perf_counter()
        _, info = build_bank(ctx, theta_params, ctx.cfg.workdir)
        ledger.mark("bank", seconds=time.perf_counter() - t0, **info)
        log(f"bank: {info}")
    return ledger.result("bank")["path"]


def _run_cold_start(ctx: RunContext, ledger: StageLedger, bank, writer):
    """4. The composer's cold start, or the initial composer when the run has none;
    ``(composer0, preempted)``."""
    cfg = ctx.cfg
    t0 = time.perf_counter()
    if cfg.stages.cold_start_steps > 0 and uses_composer(cfg):
        composer0, preempted = cold_start_stage(ctx, bank, writer)
        if preempted:
            return composer0, True
        _mark_once(ledger, "cold_start", t0)
        return composer0, False
    _, lora0, comp0 = ctx.system.initial_params()
    return {"lora": lora0, "compressor": comp0}, False


def _export_and_plot(ctx: RunContext, ledger: StageLedger, writer, student, frozen) -> None:
    """7. The export, unless done, and 8. the plot (process 0, when the run has training steps)."""
    cfg, workdir = ctx.cfg, ctx.cfg.workdir
    if not ledger.done("export"):
        t0 = time.perf_counter()
        export_student(ctx, student, frozen, files.join(workdir, EXPORT_DIR))
        ledger.mark("export", seconds=time.perf_counter() - t0, path=files.join(workdir, EXPORT_DIR))
    writer.flush()
    if jax.process_index() == 0 and cfg.stages.lopd_steps > 0:  # nothing to plot without training steps
        plot_run(files.join(workdir, "metrics.jsonl"), files.join(workdir, PLOT_FILE),
                 margin=cfg.steps.loss.margin)


def _summary(ledger: StageLedger, before: float, after: float) -> dict:
    """Print the before/after line (process 0), log and return the run's summary."""
    if jax.process_index() == 0:
        print(f"held-out reward after: {after:.4f} (before {before:.4f})"
              f"{_eval_note(ledger.result('eval_after'))}", flush=True)
    summary = {"before": before, "after": after,
               "success_before": ledger.result("eval_before").get("success_rate"),
               "success_after": ledger.result("eval_after").get("success_rate"),
               "no_tool_baseline": ledger.result("eval_before").get("no_tool_baseline"),
               "seconds": {s: ledger.result(s).get("seconds") for s in ledger.data}}
    log(f"done: {summary}")
    return summary


def export_student(ctx: RunContext, student, frozen, out_dir: str, dtype: str | None = None) -> list[str]:
    """Write the student as a Hugging Face checkpoint (with the tokenizer) to ``out_dir``,
    plus the run's :data:`train.run_reader.EXPORT_RUN_FILE` (task source, episode caps)."""

    model = ctx.student_model(student, frozen)
    dtype = dtype or ctx.cfg.model.param_dtype
    written = save_pretrained(model, out_dir, dtype=dtype, tokenizer=ctx.tokenizer, merge_lora=True,
                              extra_config={"eos_token_id": ctx.fmt.end_of_turn_id,
                                            "pad_token_id": ctx.tokenizer.pad_token_id})
    if jax.process_index() == 0:
        files.write_text(files.join(out_dir, EXPORT_RUN_FILE), json.dumps(export_run_info(ctx.cfg), indent=2))
        written.append(EXPORT_RUN_FILE)
    return written

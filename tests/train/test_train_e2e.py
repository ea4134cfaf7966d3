"""``python -m lopd_jax.train`` end to end on a shortened tiny config, in subprocesses.

One uninterrupted run (metrics, plot, Orbax checkpoints, HF export, printed rewards); the
same run killed with SIGKILL during the LOPD stage and rerun gives bitwise the same
exported student and the same final metrics; config errors exit 2 before anything is
written; an empty bank stops with the explanation (exit 3).
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file
from tests.paths import ROOT
from tests.train.records import volatile


SHORT = ["stages.warmup_steps=3", "stages.warmup_batch=4", "stages.cold_start_steps=2", "stages.cold_start_batch=2",
         "stages.lopd_steps=3", "stages.eval_tasks=2", "stages.eval_every=0", "env.tasks_per_step=2",
         "env.kwargs.n_train_per_family=1", "env.kwargs.n_heldout_per_family=1", "bank.min_reward=0.0",
         "checkpoint.every_steps=1", "composer.max_experience_tokens=64", "rollout.max_env_steps=2",
         "rollout.max_turn_tokens=32"]


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "force_host_platform_device_count" not in f)  # one device: faster here
    return env


def _cmd(workdir, *extra):
    return [sys.executable, "-m", "lopd_jax.train", "--config=tiny", f"--workdir={workdir}", *SHORT, *extra]


def _run(workdir, *extra, timeout=600):
    return subprocess.run(_cmd(workdir, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def _records(workdir, stage):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["stage"] == stage]


def _final(workdir, stage="lopd"):
    by_step = {r["step"]: r for r in _records(workdir, stage)}
    last = by_step[max(by_step)]
    return {k: v for k, v in last.items() if not volatile(k)}


def ensure_full_run(tmp_path_factory):
    """The uninterrupted reference run, made once per test session (shared by test files)."""
    workdir = str(tmp_path_factory.getbasetemp() / "e2e_full_run")
    log = workdir + ".stdout"
    if not os.path.exists(log):
        proc = _run(workdir)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(log, "w") as f:
            f.write(proc.stdout)
    return workdir, open(log).read()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return ensure_full_run(tmp_path_factory)


@pytest.mark.process
def test_full_run_writes_everything(full_run):
    workdir, stdout = full_run
    assert "held-out reward before:" in stdout and "held-out reward after:" in stdout
    assert "no-tool baseline 0.0000" in stdout and "success " in stdout
    lopd = _records(workdir, "lopd")
    assert [r["step"] for r in lopd] == [1, 2, 3]
    for key in ("reward_mean", "delta", "beta", "distill_kl", "anchor", "rollouts", "tokens", "rollout_seconds",
                "train_seconds"):
        assert all(np.isfinite(r[key]) for r in lopd), key
    assert lopd[0]["rollouts"] == 2
    assert _records(workdir, "warmup") and _records(workdir, "cold_start")
    assert os.path.getsize(os.path.join(workdir, "plot.png")) > 1000
    assert os.path.isdir(os.path.join(workdir, "checkpoints", "lopd", "3", "state"))
    export = os.path.join(workdir, "export")
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert os.path.exists(os.path.join(export, name)), name
    stages = json.load(open(os.path.join(workdir, "stages.json")))
    assert all(stages[s]["done"] for s in ("warmup", "eval_before", "bank", "cold_start", "lopd", "eval_after"))
    assert stages["bank"]["entries"] >= 1
    # a rerun finds every stage done, changes nothing and reports the same rewards
    again = _run(workdir)
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout.splitlines()[-1] == stdout.splitlines()[-1]


@pytest.mark.process
def test_sigkill_during_lopd_then_resume_matches_uninterrupted(full_run, tmp_path):
    ref, _ = full_run
    workdir = str(tmp_path / "w")
    p = subprocess.Popen(_cmd(workdir), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         text=True)
    # kill once the first LOPD step is logged and its checkpoint is complete (so the rerun resumes
    # from a mid-stage checkpoint rather than starting the stage over)
    metrics = os.path.join(workdir, "metrics.jsonl")
    first = os.path.join(workdir, "checkpoints", "lopd", "1")
    deadline = time.time() + 500
    while time.time() < deadline and p.poll() is None:
        if (os.path.exists(metrics) and '"stage": "lopd"' in open(metrics).read()
                and all(os.path.isdir(os.path.join(first, d)) for d in ("state", "meta"))):
            break
        time.sleep(0.1)
    assert p.poll() is None, "the run ended before it could be killed during the LOPD stage"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert len(_records(workdir, "lopd")) < 3
    proc = _run(workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lopd: resumed from step" in proc.stderr
    a = load_file(os.path.join(ref, "export", "model.safetensors"))
    b = load_file(os.path.join(workdir, "export", "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert _final(ref) == _final(workdir)


@pytest.mark.process
def test_unknown_key_and_missing_weights_exit_2(tmp_path):
    workdir = str(tmp_path / "w")
    bad = _run(workdir, "stages.lopd_stepz=3")
    assert bad.returncode == 2 and "stages.lopd_stepz" in bad.stderr and "lopd_steps" in bad.stderr
    missing = str(tmp_path / "no_such_ckpt")
    bad = _run(workdir, f"model.hf_path={missing}", "model.name=none", "model.vocab_size=none")
    assert bad.returncode == 2 and missing in bad.stderr
    bad = _run(workdir, "rollout.temperature=hot")
    assert bad.returncode == 2 and "rollout.temperature" in bad.stderr
    assert not os.path.exists(workdir)  # nothing written


@pytest.mark.process
def test_empty_bank_stops_with_explanation(tmp_path):
    workdir = str(tmp_path / "w")
    proc = _run(workdir, "stages.warmup_steps=0", "bank.min_reward=1.5", "stages.eval_tasks=1")
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "experience bank is empty" in proc.stderr and "bank.min_reward" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.process
def test_evaluate_of_the_export_replays_the_runs_own_episodes(full_run, tmp_path):
    """``evaluate --model=<run>/export`` with no episode flags uses the run's task source and
    caps (from the export's lopd_run.json) and, greedy, reproduces the episodes the run's
    own machinery rolls out with the student: the exported weights, tokenizer and chat
    template render and decode exactly what training saw."""
    import jax

    from lopd_jax.programs.evaluate import main
    from lopd_jax.settings.run_config import load_run_config
    from lopd_jax.rollout.episodes import rollout
    from train.run_reader import EXPORT_RUN_FILE, open_run

    workdir, _ = full_run
    info = json.load(open(os.path.join(workdir, "export", EXPORT_RUN_FILE)))
    assert info["rollout"] == {"max_env_steps": 2, "max_turn_tokens": 32, "max_total_tokens": 512}
    out = tmp_path / "eval.json"
    assert main([f"--model={workdir}/export", "--split=heldout", "--temperature=0", "--num_tasks=3",
                 f"--out={out}"]) == 0
    result = json.loads(out.read_text())
    cfg = result["config"]
    assert (cfg["env"], cfg["max_steps"], cfg["max_turn_tokens"], cfg["max_total_tokens"]) == ("synthetic", 2, 32, 512)
    assert cfg["env_kwargs"] == info["env"]["kwargs"] and cfg["env_kwargs"]["n_heldout_per_family"] == 1
    # a flag still wins over the run's setting
    out2 = tmp_path / "eval2.json"
    assert main([f"--model={workdir}/export", "--temperature=0", "--num_tasks=1", "--max_turn_tokens=4",
                 f"--out={out2}"]) == 0
    again = json.loads(out2.read_text())
    assert again["config"]["max_turn_tokens"] == 4 and max(again["trajectories"][0]["turn_lengths"]) <= 4

    run = open_run(workdir, load_run_config(workdir))
    ctx = run.ctx
    tasks = ctx.source.tasks("heldout")[:3]
    greedy = dataclasses.replace(ctx.cfg.rollout.sampling, temperature=0.0)
    own = rollout(ctx.engine, ctx.policy_params(run.student(), run.theta0()), ctx.fmt, ctx.source.make_env, tasks,
                  jax.random.key(0), ctx.cfg.rollout.caps, greedy)
    for mine, theirs in zip(own, result["trajectories"]):
        assert theirs["task_id"] == mine.task.task_id
        assert (theirs["turn_lengths"], theirs["finish_reason"], theirs["reward"]) == \
            (list(mine.turn_lengths), mine.finish_reason, mine.reward)
        gen = np.asarray(mine.mask) > 0
        np.testing.assert_allclose(theirs["mean_raw_logprob"], float(np.asarray(mine.raw_logprobs)[gen].mean()),
                                   atol=1e-4)

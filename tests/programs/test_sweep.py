"""``python -m lopd_jax.sweep``: planning, stage-sharing keys and copies, resume skipping
finished runs, and the report (results.json, results.md, figures) from run files."""

import json
import os

import numpy as np
import pytest

from lopd_jax.programs import sweep
from lopd_jax.settings.errors import ConfigError


def _args(tmp, *extra):
    return sweep.build_parser().parse_args([f"--workdir={tmp}", "--config=tiny", *extra])


def _fake_run(wd, before, after, rewards, with_bank=True):
    """A finished run's files as train.loop writes them (stages.json, metrics.jsonl)."""
    os.makedirs(os.path.join(wd, "checkpoints", "warmup", "3"), exist_ok=True)
    open(os.path.join(wd, "checkpoints", "warmup", "3", "state"), "w").write("x")
    if with_bank:
        os.makedirs(os.path.join(wd, "bank"), exist_ok=True)
        open(os.path.join(wd, "bank", "entries.json"), "w").write("[]")
    def ev(r):
        return {"reward_mean": r, "success_rate": r / 2, "tool_calls_per_step": 1.0, "mean_env_steps": 2.0}
    stages = {"warmup": {"done": True, "seconds": 1.0}, "eval_before": {"done": True, **ev(before)},
              "bank": {"done": True, "path": os.path.join(wd, "bank"), "rollouts": 16},
              "lopd": {"done": True, "seconds": 10.0}, "eval_after": {"done": True, **ev(after)},
              "export": {"done": True}}
    json.dump(stages, open(os.path.join(wd, "stages.json"), "w"))
    rows = [{"step": 0, "stage": "warmup", "nll": 1.0}, {"step": 0, "stage": "eval_before", **ev(before)}]
    rows += [{"step": i + 1, "stage": "lopd", "rollouts": 8, "reward_mean": r, "delta": 0.01 * i, "beta": 0.1,
              "rollout_seconds": 2.0} for i, r in enumerate(rewards)]
    rows.append({"step": len(rewards), "stage": "eval_after", **ev(after)})
    with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_plan_names_runs_and_rejects_bad_input(tmp_path):
    specs = sweep.plan(_args(tmp_path, "--arms=lopd,grpo", "--seeds=0,1", "--grid", "steps.margin=0,0.1"))
    assert [(s.name, s.seed) for s in specs][:4] == [("lopd__steps.margin=0", 0), ("lopd__steps.margin=0.1", 0),
                                                      ("grpo__steps.margin=0", 0), ("grpo__steps.margin=0.1", 0)]
    assert len(specs) == 8 and specs[0].workdir(str(tmp_path)).endswith("runs/lopd__steps.margin=0/seed0")
    specs = sweep.plan(_args(tmp_path, "--arms=grpo,lopd@steps.margin=0@composer.n_ret=1", "--seeds=3"))
    assert [s.name for s in specs] == ["grpo", "lopd__steps.margin=0__composer.n_ret=1"]
    cfg = sweep.run_config("tiny", specs[1], str(tmp_path))
    assert cfg.steps.loss.margin == 0 and cfg.composer.n_ret == 1 and cfg.seed == 3 and cfg.arm == "lopd"
    for bad in (["--arms=lopd,ppo"], ["--seeds=a"], ["--grid", "steps.margin"], ["--grid", "steps.nope=1"],
                ["--arms=lopd@steps.margin"]):
        with pytest.raises(ConfigError):
            sweep.plan(_args(tmp_path, *bad))


def test_stage_keys_share_what_the_stages_read(tmp_path):
    key = lambda *o: sweep.stage_keys(sweep.run_config("tiny", sweep.RunSpec(*o), str(tmp_path)))  # noqa: E731
    lopd, grpo = key("lopd", 0, (), ()), key("grpo", 0, (), ())
    assert lopd["pre"] == grpo["pre"]  # the arm does not change warm-up, evaluation or bank
    assert key("lopd", 1, (), ())["pre"] != lopd["pre"]  # the seed does
    margin = key("lopd", 0, (("steps.margin", "0.1"),), ())
    assert margin == lopd  # the margin only acts in the LOPD stage
    k = key("lopd", 0, (("composer.num_latents", "8"),), ())
    assert k["pre"] == lopd["pre"] and k["cold"] != lopd["cold"]  # K changes the cold start only


def test_adopt_stages_copies_checkpoints_bank_and_records(tmp_path):
    src, dst = str(tmp_path / "a"), str(tmp_path / "b")
    _fake_run(src, 0.3, 0.5, [0.3, 0.4])
    assert sweep.adopt_stages(src, dst, sweep.PRE_STAGES) == ["warmup", "eval_before", "bank"]
    ledger = json.load(open(os.path.join(dst, "stages.json")))
    assert ledger["bank"]["path"] == os.path.join(dst, "bank") and ledger["warmup"]["shared_from"] == src
    assert os.path.exists(os.path.join(dst, "checkpoints", "warmup", "3", "state"))
    assert os.path.exists(os.path.join(dst, "bank", "entries.json"))
    stages = [json.loads(x)["stage"] for x in open(os.path.join(dst, "metrics.jsonl"))]
    assert stages == ["warmup", "eval_before"]
    assert sweep.adopt_stages(src, dst, sweep.PRE_STAGES) == []  # already there: nothing copied twice


def test_sweep_skips_finished_runs_and_reports(tmp_path, capsys):
    root = str(tmp_path)
    finals = {("lopd", 0): 0.6, ("lopd", 1): 0.5, ("grpo", 0): 0.4, ("grpo", 1): 0.45}
    for (arm, seed), after in finals.items():
        for margin in ("0", "0.1"):
            spec = sweep.RunSpec(arm, seed, (("steps.margin", margin),), ())
            _fake_run(spec.workdir(root), 0.3, after + (0.05 if margin == "0.1" else 0.0), [0.3, after])
    argv = [f"--workdir={root}", "--config=tiny", "--arms=lopd,grpo", "--seeds=0,1", "--no_base_composer",
            "--grid", "steps.margin=0,0.1", "--threshold=0.55"]
    assert sweep.main(argv) == 0
    assert not any("train.log" in fs for _, _, fs in os.walk(root))  # nothing was launched
    res = json.load(open(os.path.join(root, "results.json")))
    assert len(res["records"]) == 8 and res["threshold"] == 0.55
    rec = next(r for r in res["records"] if r["name"] == "lopd__steps.margin=0" and r["seed"] == 0)
    assert rec["rollouts"] == 16 and rec["after"]["reward_mean"] == 0.6 and rec["rollouts_to_threshold"] == 16
    assert rec["rollouts_per_minute"] == pytest.approx(240.0)
    md = open(os.path.join(root, "results.md")).read()
    m = np.mean([0.6, 0.5])
    assert f"| lopd__steps.margin=0 | 2 | 0.300 ± 0.000 | {m:.3f} ± {np.std([0.6, 0.5], ddof=1):.3f} |" in md
    assert "16 (1/2)" in md  # lopd margin 0: only seed 0 reaches 0.55 at a held-out evaluation
    for fig in ("fig3_arms.png", "fig3_margin.png", "fig4_curves.png"):
        assert os.path.getsize(os.path.join(root, fig)) > 1000
    shared = json.load(open(os.path.join(root, sweep.SHARED_FILE)))
    assert len(shared) == 2  # one pre-stage source per seed (composer cold start: none in these runs)


# The shortest run of every stage on the tiny config (one task per family, one step each)
SHORT_RUN = ["stages.warmup_steps=1", "stages.warmup_batch=2", "stages.cold_start_steps=1",
             "stages.cold_start_batch=2", "stages.lopd_steps=1", "stages.eval_tasks=1", "stages.eval_every=0",
             "env.tasks_per_step=1", "env.kwargs.n_train_per_family=1", "env.kwargs.n_heldout_per_family=1",
             "bank.min_reward=0.0", "checkpoint.every_steps=1", "composer.max_experience_tokens=64",
             "rollout.max_env_steps=1", "rollout.max_turn_tokens=16"]


@pytest.mark.process
def test_sweep_runs_its_children_end_to_end(tmp_path):
    """``python -m lopd_jax.sweep`` started from another directory: the training child and the
    Base + Composer child run in the checkout and finish, and the report is written."""
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "force_host_platform_device_count" not in f)  # one device: faster here
    root = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, "-m", "lopd_jax.sweep", "--config=tiny", "--arms=lopd", "--seeds=0",
                           f"--workdir={root}", *SHORT_RUN], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    wd = sweep.RunSpec("lopd", 0, (), tuple(SHORT_RUN)).workdir(str(root))
    log = open(os.path.join(wd, "train.log")).read() if os.path.exists(os.path.join(wd, "train.log")) else ""
    assert proc.returncode == 0, proc.stderr[-2000:] + log[-3000:]
    assert sweep.finished(wd) and "1/1 lopd seed 0" in proc.stderr and "ran in" in proc.stderr
    assert os.path.exists(os.path.join(wd, "export", "model.safetensors"))
    assert "reward_mean" in json.load(open(os.path.join(wd, "base_composer.json")))  # the second child
    res = json.load(open(os.path.join(root, "results.json")))
    assert [(r["name"], r["seed"]) for r in res["records"]] == [("lopd", 0)]
    assert "| lopd | 1 |" in open(os.path.join(root, "results.md")).read()

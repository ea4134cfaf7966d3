"""benchmarks/miniature_core.py: a forked run's saved config passes the resume check of
``python -m lopd_jax.train`` for every arm (the frozen-composer arm once failed it)."""

import json
import os

import pytest

from benchmarks import miniature_core


@pytest.mark.parametrize("arm", ["lopd", "lopd_frozen_composer", "grpo", "m0", "grpo_async2"])
def test_fork_saves_a_config_the_training_cli_resumes(tmp_path, arm):
    from lopd_jax.settings.run_config import check_resume, load_run_config, save_run_config
    from lopd_jax.programs.train import resolve_config

    core = miniature_core
    prefix = str(tmp_path / "prefix")
    save_run_config(resolve_config(["--config=tiny", f"--workdir={prefix}", "stages.lopd_steps=0"]), prefix)
    with open(os.path.join(prefix, "stages.json"), "w") as f:
        json.dump({"warmup": {"done": True}, "cold_start": {"done": True}, "lopd": {"done": True}}, f)
    with open(os.path.join(prefix, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"stage": "warmup", "step": 1}) + "\n" + json.dumps({"stage": "lopd", "step": 1}) + "\n")
    run_dir = str(tmp_path / "runs" / f"{arm}_s1")
    overrides = [*core.arm_overrides(arm), "seed=1"]
    core.fork(prefix, run_dir, "tiny", overrides)
    assert set(json.load(open(os.path.join(run_dir, "stages.json")))) == {"warmup", "cold_start"}
    assert [json.loads(line)["stage"] for line in open(os.path.join(run_dir, "metrics.jsonl"))] == ["warmup"]
    # what `python -m lopd_jax.train --config=tiny --workdir=run_dir ARM seed=1` checks on resume
    check_resume(load_run_config(run_dir), resolve_config(["--config=tiny", f"--workdir={run_dir}", *overrides]))
    if arm.endswith("_async2"):
        cfg = load_run_config(run_dir)
        assert (cfg.arm, cfg.rollout.mode, cfg.rollout.max_staleness) == ("grpo", "async", 2)


def test_report_of_finished_runs_only(tmp_path):
    """``--report_only`` over a sweep with no finished run: an empty report (its imports,
    which once named a moved constant, run first)."""
    core = miniature_core
    os.makedirs(tmp_path / "runs" / "lopd_s0")
    assert core.sweep_report(str(tmp_path), ["lopd", "m0"], [0, 1]) == []
    assert "| arm |" in core.table([])


def test_runs_share_a_compilation_cache_under_the_workdir(monkeypatch):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert miniature_core.run_env("/w")["JAX_COMPILATION_CACHE_DIR"] == os.path.join("/w", "jax_cache")
    assert miniature_core.run_env("/w", "/c")["JAX_COMPILATION_CACHE_DIR"] == "/c"
    assert "JAX_COMPILATION_CACHE_DIR" not in miniature_core.run_env("/w", "none")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/mine")  # the user's own cache wins
    assert miniature_core.run_env("/w")["JAX_COMPILATION_CACHE_DIR"] == "/mine"


def test_arms_are_registered_arms_or_m0(tmp_path, capsys):
    assert miniature_core.unknown_arms(["lopd", "m0", "grpo_async2", "opsd_partial1", "ppo", "ppo_async1"]) == \
        ["ppo", "ppo_async1"]
    with pytest.raises(SystemExit) as e:
        miniature_core.main([f"--workdir={tmp_path}", "--arms=lopd,ppo"])
    assert e.value.code == 2 and "lopd_frozen_composer" in capsys.readouterr().err


def test_several_prefixes_name_their_directories_and_records_for_rank_arms(tmp_path):
    """``--prefix_seeds``: W/prefix_P and W/runs/ARM_pP_sSEED, which rank_arms reads back as
    (prefix, seed); the one-prefix layout is unchanged."""
    from benchmarks import rank_arms

    W = str(tmp_path)
    assert miniature_core.prefix_dir(W, None) == os.path.join(W, "prefix")
    assert miniature_core.prefix_dir(W, 3) == os.path.join(W, "prefix_3")
    for arm, seed, prefix in (("lopd_frozen_composer", 2, 3), ("m0", 0, None), ("grpo_async2", 1, 0)):
        path = miniature_core.run_dir_of(W, arm, seed, prefix)
        os.makedirs(path)
        open(os.path.join(path, "config.json"), "w").write("{}")
        assert rank_arms.find_runs(W)[arm] == {(prefix, seed): path}

"""benchmarks.rank_arms on run directories built here (both layouts)."""

import json
import os

import numpy as np
import pytest

from benchmarks import rank_arms


def _write_run(path, rewards, done=True, arg_probs=None):
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({}, f)
    n = len(rewards)
    per_task = {"task_id": [f"dispatch.ship/heldout/{i:04d}" for i in range(n)],
                "cluster": [f"dispatch.ship:customer=c{i % 8}" for i in range(n)],
                "reward": [float(r) for r in rewards]}
    if arg_probs is not None:
        per_task["oracle_arg_prob"] = [float(p) for p in arg_probs]
    ledger = {"eval_before": {"done": True, "reward_mean": 0.2}}
    if done:
        ledger["eval_after"] = {"done": True, "reward_mean": float(np.mean(rewards)), "per_task": per_task}
    with open(os.path.join(path, "stages.json"), "w") as f:
        json.dump(ledger, f)


def _write_arms(W, success: dict, rng, seeds: int = 3, tasks: int = 64):
    """Finished miniature-layout runs ``W/runs/ARM_sSEED``: each task succeeds with the arm's probability."""
    for arm, prob in success.items():
        for seed in range(seeds):
            _write_run(str(W / "runs" / f"{arm}_s{seed}"), rng.random(tasks) < prob)


def test_rank_arms_ranks_only_what_an_interval_separates(tmp_path, capsys):
    rng = np.random.default_rng(0)
    W = tmp_path / "mini"
    _write_arms(W, {"lopd": 0.9, "lopd_frozen_composer": 0.2, "m0": 0.85, "grpo": 0.3}, rng)
    _write_run(str(W / "runs" / "opsd_s0"), rng.random(64) < 0.5, done=False)
    r = rank_arms.report(str(W), resamples=2000)
    rows = {(c["a"], c["b"]): c for c in r["contrasts"]}
    assert rows[("lopd", "lopd_frozen_composer")]["significant"] and rows[("lopd", "grpo")]["significant"]
    assert not rows[("lopd", "m0")]["significant"]
    assert rows[("lopd", "opsd")]["missing"] == ["opsd"]
    assert any("opsd seed 0" in m for m in r["missing"])
    assert r["metric"] == "reward" and not r["primary_recorded"] and r["clusters"] == "customer"
    holm = sorted(c["p_holm"] for c in rows.values() if not c["missing"])
    raw = sorted(c["p_value"] for c in rows.values() if not c["missing"])
    assert all(h >= q for h, q in zip(holm, raw))
    assert rank_arms.main(["--workdir", str(W), "--resamples", "500"]) == 0
    out = capsys.readouterr().out
    assert "lopd > lopd_frozen_composer" in out and "lopd vs m0: not ranked" in out
    assert "no finished run of opsd" in out and "not recorded" in out
    assert "lopd − opsd (oracle hint, upper bound)" in out and "cluster-level t" in out
    assert "Holm over the 3 contrasts of this table" in out  # the family: the finished pre-registered contrasts


def test_rank_arms_reads_the_sweep_layout(tmp_path):
    rng = np.random.default_rng(1)
    for name, arm in (("lopd__steps.margin=0.05", "lopd"), ("lopd__steps.margin=0", "m0"), ("grpo", "grpo")):
        for seed in range(2):
            _write_run(str(tmp_path / "runs" / name / f"seed{seed}"), rng.random(16) < 0.5)
    runs = rank_arms.find_runs(str(tmp_path))
    assert sorted(runs) == ["grpo", "lopd", "m0"] and sorted(runs["m0"]) == [(None, 0), (None, 1)]
    assert rank_arms.main(["--workdir", str(tmp_path / "nowhere")]) == 2


def test_staleness_contrasts_pair_each_async_arm_with_its_sync_arm(tmp_path, capsys):
    """``ARM_asyncK`` runs form a second family against ``ARM`` (what staleness costs): a
    clear loss is ranked, an equal arm is not, and an async arm without its sync arm is left out."""
    rng = np.random.default_rng(2)
    W = tmp_path / "mini"
    _write_arms(W, {"lopd": 0.8, "lopd_async1": 0.8, "lopd_async2": 0.1, "grpo_async1": 0.5}, rng)
    r = rank_arms.report(str(W), resamples=2000)
    rows = {(c["a"], c["b"]): c for c in r["staleness"]}
    assert sorted(rows) == [("lopd_async1", "lopd"), ("lopd_async2", "lopd")]
    assert rows[("lopd_async2", "lopd")]["significant"] and rows[("lopd_async2", "lopd")]["estimate"] < 0
    assert not rows[("lopd_async1", "lopd")]["significant"]
    assert rank_arms.main(["--workdir", str(W), "--resamples", "500"]) == 0
    out = capsys.readouterr().out
    assert "what staleness costs" in out and "lopd > lopd_async2" in out and "lopd_async1 vs lopd: not ranked" in out


def test_sweep_names_of_async_runs():
    assert rank_arms.arm_of("lopd__rollout.mode=async__rollout.max_staleness=2") == "lopd_async2"
    assert rank_arms.arm_of("grpo__rollout.mode=async") == "grpo_async1"
    assert rank_arms.arm_of("lopd__steps.margin=0__rollout.mode=async__rollout.max_staleness=1") == "m0_async1"
    assert rank_arms.arm_of("lopd__rollout.mode=sync") == "lopd__rollout.mode=sync"
    assert rank_arms.arm_of("grpo__rollout.mode=async__rollout.max_staleness=2__rollout.partial=true"
                            "__rollout.batch_order=finished") == "grpo_partial2"
    from benchmarks.miniature_core import arm_overrides
    assert arm_overrides("lopd_partial1") == ["rollout.mode=async", "rollout.max_staleness=1", "rollout.partial=true",
                                              "rollout.batch_order=finished"]
    assert rank_arms.staleness_pairs(["lopd", "lopd_partial2", "lopd_async1"]) == [
        ("lopd_async1", "lopd"), ("lopd_partial2", "lopd")]


def test_primary_metric_ranks_when_every_run_records_it(tmp_path, capsys):
    """With ``oracle_arg_prob`` in every run the contrasts use it (a small, consistent gap in
    probability is ranked although the greedy rewards are equal); the secondary's
    contrasts are printed beside it."""
    rng = np.random.default_rng(3)
    W = tmp_path / "mini"
    for arm, shift in (("lopd", 0.1), ("lopd_frozen_composer", 0.0)):
        for seed in range(3):
            base = rng.uniform(0.2, 0.6, 64)
            _write_run(str(W / "runs" / f"{arm}_s{seed}"), np.arange(64) % 2, arg_probs=base + shift)
    r = rank_arms.report(str(W), resamples=2000)
    assert r["primary_recorded"] and r["metric"] == "oracle_arg_prob"
    row = r["contrasts"][0]
    assert (row["a"], row["b"]) == ("lopd", "lopd_frozen_composer") and row["significant"]
    assert row["estimate"] == pytest.approx(0.1, abs=0.05)
    assert r["secondary"]["contrasts"][0]["estimate"] == 0.0
    fig = tmp_path / "contrasts.png"
    assert rank_arms.main(["--workdir", str(W), "--resamples", "500", f"--figure={fig}"]) == 0
    out = capsys.readouterr().out
    assert "lopd > lopd_frozen_composer" in out and "on the secondary, reward" in out
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"figure: {fig}" in out


def test_intermediate_evaluations_and_the_change_since_one(tmp_path, capsys):
    """``--stage=eval@K`` reads the evaluation after step K from metrics.jsonl; ``--since``
    compares each run's per-task change: two arms that end level but started apart at step 8
    are ranked on what they gained, not on where they ended."""
    rng = np.random.default_rng(5)
    W = tmp_path / "mini"
    for arm, start in (("lopd", 0.2), ("lopd_frozen_composer", 0.5)):
        for seed in range(3):
            end = rng.uniform(0.3, 0.7, 64)
            path = W / "runs" / f"{arm}_s{seed}"
            _write_run(str(path), np.arange(64) % 2, arg_probs=end)
            with open(path / "metrics.jsonl", "w") as f:
                for step, probs in ((8, end - 0.5 + start + 0.01), (16, end)):
                    per_task = {"task_id": [f"dispatch.ship/heldout/{i:04d}" for i in range(64)],
                                "cluster": [f"dispatch.ship:customer=c{i % 8}" for i in range(64)],
                                "reward": [0.0] * 64, "oracle_arg_prob": [float(p) for p in probs]}
                    f.write(json.dumps({"step": step, "stage": "eval", "per_task": per_task}) + "\n")
    level = rank_arms.report(str(W), resamples=1000)["contrasts"][0]
    assert not level["significant"]
    at8 = rank_arms.report(str(W), stage="eval@8", resamples=1000)["contrasts"][0]
    assert at8["estimate"] == pytest.approx(level["estimate"] - 0.3, abs=1e-9)
    gain = rank_arms.report(str(W), since="eval@8", resamples=1000)
    assert gain["contrasts"][0]["significant"] and gain["contrasts"][0]["estimate"] == pytest.approx(0.3, abs=1e-9)
    assert rank_arms.main(["--workdir", str(W), "--since=eval@8", "--resamples", "500"]) == 0
    out = capsys.readouterr().out
    assert "change from eval@8 to eval_after" in out and "lopd > lopd_frozen_composer" in out
    assert "| greedy reward change | sample SD | oracle_arg_prob change |" in out
    assert rank_arms.main(["--workdir", str(W), "--stage=eval@x"]) == 2
    assert "eval@STEP" in capsys.readouterr().err
    missing = rank_arms.report(str(W), since="eval@12", resamples=200)
    assert not missing["means"] and any("no finished eval@12" in m for m in missing["missing"])


def test_several_prefixes_pair_runs_by_prefix_and_seed_never_across_prefixes(tmp_path, capsys):
    """``ARM_pP_sSEED`` runs of 3 prefixes: each prefix moves both arms by up to 0.5, LOPD is
    0.1 above the frozen composer within every prefix. The report pairs within prefix (the
    gap is ranked, the prefix shifts cancel) and names the runs by prefix and seed; arms run
    on disjoint prefixes are refused, not paired."""
    rng = np.random.default_rng(6)
    W = tmp_path / "mini"
    base = rng.uniform(0.2, 0.4, 64)
    for p, shift in ((0, 0.0), (1, 0.5), (2, -0.2)):
        for arm, gain in (("lopd", 0.1), ("lopd_frozen_composer", 0.0)):
            for seed in range(2):
                _write_run(str(W / "runs" / f"{arm}_p{p}_s{seed}"), np.arange(64) % 2,
                           arg_probs=base + shift + gain + rng.normal(0, 0.01, 64))
    _write_run(str(W / "runs" / "lopd_p3_s0"), np.arange(64) % 2, done=False)
    runs = rank_arms.find_runs(str(W))
    assert sorted(runs["lopd"]) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0)]
    r = rank_arms.report(str(W), resamples=500)
    row = r["contrasts"][0]
    assert (row["a"], row["b"], row["prefixes"], row["runs"]) == ("lopd", "lopd_frozen_composer", 3, (6, 6))
    assert row["significant"] and row["lo"] > 0.05 and row["hi"] < 0.15
    assert any("lopd prefix 3 seed 0" in m for m in r["missing"])
    assert rank_arms.main(["--workdir", str(W), "--resamples", "200"]) == 0
    out = capsys.readouterr().out
    assert "6 vs 6 in 3 prefixes" in out and "within each prefix" in out
    W2 = tmp_path / "disjoint"
    for arm, p in (("lopd", 0), ("lopd_frozen_composer", 1)):
        _write_run(str(W2 / "runs" / f"{arm}_p{p}_s0"), np.arange(64) % 2, arg_probs=base)
    assert rank_arms.main(["--workdir", str(W2)]) == 2
    assert "no prefix in common" in capsys.readouterr().err


def test_clusters_restrict_the_contrasts_to_the_chosen_customers(tmp_path, capsys):
    """``--clusters`` compares on those customers' held-out tasks only (the headroom testbed's
    primary), ``--except_clusters`` on the others (its secondary): LOPD gains 0.3 on c0 and c1
    and nothing elsewhere."""
    rng = np.random.default_rng(7)
    W = tmp_path / "mini"
    gain = np.where(np.arange(64) % 8 < 2, 0.3, 0.0)
    for arm, g in (("lopd", gain), ("lopd_frozen_composer", 0.0 * gain)):
        for seed in range(3):
            _write_run(str(W / "runs" / f"{arm}_s{seed}"), np.arange(64) % 2,
                       arg_probs=0.3 + g + rng.normal(0, 0.02, 64))
    keys = ["dispatch.ship:customer=c0", "dispatch.ship:customer=c1"]
    chosen = rank_arms.report(str(W), resamples=200, keep=keys)["contrasts"][0]
    assert chosen["estimate"] == pytest.approx(0.3, abs=0.02) and chosen["clusters"] == 2 and chosen["tasks"] == 16
    others = rank_arms.report(str(W), resamples=200, drop=tuple(keys))["contrasts"][0]
    assert others["estimate"] == pytest.approx(0.0, abs=0.02) and others["clusters"] == 6
    assert rank_arms.main(["--workdir", str(W), "--resamples", "200", f"--clusters={','.join(keys)}"]) == 0
    assert "of the clusters dispatch.ship:customer=c0" in capsys.readouterr().out
    assert rank_arms.main(["--workdir", str(W), "--clusters=dispatch.ship:customer=zed"]) == 2
    assert "no held-out task has a selected cluster key" in capsys.readouterr().err

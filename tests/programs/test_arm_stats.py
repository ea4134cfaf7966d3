"""Arms compared from per-task outcomes: cluster keys, the demo's gain interval, the premise gaps."""

import numpy as np
import pytest

from lopd_jax.envs.synthetic.env import SyntheticTaskSource
from lopd_jax.method import statistics
from lopd_jax.programs import arm_stats, demo, premise


def _outcomes(rewards, n_customers=4):
    ids = [f"dispatch.ship/heldout/{i:04d}" for i in range(len(rewards))]
    return {"task_id": ids, "cluster": [f"dispatch.ship:customer=c{i % n_customers}" for i in range(len(rewards))],
            "reward": [float(r) for r in rewards]}


def test_hidden_rule_tasks_cluster_by_customer():
    src = SyntheticTaskSource(n_train_per_family=2, n_heldout_per_family=8, families=["dispatch"])
    tasks = src.tasks("heldout")
    keys = [src.cluster_key(t) for t in tasks]
    assert all(k == f"dispatch.ship:customer={t.payload['params']['customer']}" for k, t in zip(keys, tasks))
    other = SyntheticTaskSource(n_train_per_family=1, n_heldout_per_family=2, families=["bank"]).tasks("heldout")
    assert src.cluster_key(other[0]) == other[0].task_id
    assert arm_stats.cluster_name([{"task_id": [t.task_id for t in tasks], "cluster": keys}]) == "customer"


def test_contrast_lines_up_tasks_and_matches_the_cluster_t():
    rng = np.random.default_rng(0)
    a = [_outcomes(rng.integers(0, 2, 16)) for _ in range(3)]
    b = [_outcomes(rng.integers(0, 2, 16)) for _ in range(3)]
    b[1] = {k: v[::-1] for k, v in b[1].items()}  # another order: lined up by task id
    got = arm_stats.contrast(a, b, resamples=300)
    A = np.array([r["reward"] for r in a])
    B = np.array([r["reward"] for r in [b[0], {k: v[::-1] for k, v in b[1].items()}, b[2]]])
    ref = statistics.cluster_t(A, B, a[0]["cluster"])
    assert (got["lo"], got["hi"], got["estimate"]) == pytest.approx((ref["lo"], ref["hi"], ref["estimate"]))
    boot = statistics.paired_bootstrap(A, B, a[0]["cluster"], resamples=300)  # the secondary column
    assert (got["bootstrap"]["lo"], got["bootstrap"]["hi"]) == pytest.approx((boot["lo"], boot["hi"]))
    assert got["clusters"] == 4 and got["effective_sample_size"]["clusters"] == 4
    with pytest.raises(ValueError, match="lacks"):
        arm_stats.outcome_matrix([a[0], {k: v[:5] for k, v in a[1].items()}])


def test_contrast_pairs_runs_by_seed_and_only_when_both_arms_ran_the_same_seeds():
    rng = np.random.default_rng(1)
    a = [{**_outcomes(rng.integers(0, 2, 16)), "seed": s} for s in (0, 1, 2)]
    b = [{**_outcomes(rng.integers(0, 2, 16)), "seed": s} for s in (0, 1, 2)]
    A, B = (np.array([r["reward"] for r in runs]) for runs in (a, b))
    got = arm_stats.contrast(a, b[::-1], resamples=300)  # listed in another order: lined up by seed
    ref = statistics.cluster_t(A, B, a[0]["cluster"], paired_seeds=True)
    assert got["paired_seeds"] and (got["lo"], got["hi"]) == pytest.approx((ref["lo"], ref["hi"]))
    b[2]["seed"] = 5  # as many runs, but not the same seeds: not paired by position
    got = arm_stats.contrast(a, b, resamples=300)
    ref = statistics.cluster_t(A, B, a[0]["cluster"], paired_seeds=False)
    assert not got["paired_seeds"] and (got["lo"], got["hi"]) == pytest.approx((ref["lo"], ref["hi"]))
    assert "3 vs 3 (unpaired)" in arm_stats.format_contrasts(
        [{**got, "a": "x", "b": "y", "missing": [], "p_holm": got["p_value"], "significant": False}])


def _demo_runs(seeds):
    before = _outcomes([1, 1, 1, 1] + [0] * 12)  # a quarter of every customer's tasks
    runs = {}
    for k in seeds:  # every customer gains: 3 of its 4 tasks on seed 0, and c0, c2 all 4 on the others
        after = _outcomes([1, 1, 1, 1] * 3 + ([1, 0, 1, 0] if k else [0, 0, 0, 0]))
        runs[k] = {"before": float(np.mean(before["reward"])), "after": float(np.mean(after["reward"])),
                   "curve": [(0, 0.25), (16, float(np.mean(after["reward"])))], "after_tasks": after,
                   "before_tasks": before}
    return runs


def test_demo_prints_the_gain_with_its_interval():
    s = demo.summarize({"rows": {}, "no_tool_baseline": 0.0}, _demo_runs([0, 1, 2]))
    text = demo.report(s)
    assert "mean ± sample SD over 3 seeds" in text and f"{s['after_sd']:.4f}" in text
    assert s["after_sd"] == pytest.approx(np.std([0.75, 0.875, 0.875], ddof=1))
    assert "95% cluster t over 16 held-out tasks in 4 customer clusters, df 2; seeds (3 vs 1)" in text
    assert "run-to-run seed variance added" in text  # seeds 1, 2 beat seed 0 on every customer: df min(4, 3) - 1
    assert "excludes 0 (a gain)" in text and "spread" not in text.split("\n")[-1]
    assert text.split("\n")[-1].startswith("what this shows:") and "compares no other arm" in text
    one = demo.report(demo.summarize({"rows": {}, "no_tool_baseline": 0.0}, _demo_runs([0])))
    assert "one seed per arm" in one and "needs >= 2 seeds" in one and "(one seed)" in one


def test_premise_gaps_carry_a_task_interval():
    rows = {"base": {"reward": 0.25, "success_rate": 0.25, "tool_calls": 1.0, "errors": 0.0,
                     "per_task": _outcomes([0, 1, 0, 0] * 4)},
            "base + oracle text": {"reward": 1.0, "success_rate": 1.0, "tool_calls": 1.0, "errors": 0.0,
                                   "per_task": _outcomes([1] * 16)}}
    premise.add_gaps(rows)
    lo, hi = rows["base + oracle text"]["reward_gap_ci"]
    # per-customer gaps 1, 0, 1, 1: with 4 clusters the t interval (df 3) reaches below 0
    half = 3.182446305284263 * 0.5 / 2  # t_{3, 0.975} * SD of the gaps / sqrt(4)
    assert (lo, hi) == pytest.approx((0.75 - half, 0.75 + half)) and rows["base"]["reward_gap_ci"] == [0.0, 0.0]
    assert "customer clusters (4 clusters, df = clusters - 1)" in premise.format_table(rows, 0.0)


def test_sweep_report_contrasts_every_pair_with_holm():
    from lopd_jax.programs import sweep_report
    rng = np.random.default_rng(3)
    records = [{"name": name, "seed": seed, "per_task": _outcomes(rng.random(32) < p)}
               for name, p in (("lopd", 0.9), ("grpo", 0.2), ("opsd", 0.25)) for seed in range(3)]
    text = sweep_report.contrasts(records, resamples=500)
    assert "Holm over the 3 pairs of this table" in text and "lopd − grpo" in text
    assert "grpo − opsd (oracle hint, upper bound)" in text
    assert "lopd > grpo" in text and "grpo vs opsd (oracle hint, upper bound): not ranked" in text
    assert sweep_report.contrasts(records[:3]) == ""


def test_contrast_of_several_prefixes_pairs_within_prefix_and_takes_the_prefix_as_the_run_unit():
    """Runs of 3 prefixes x 2 seeds: each prefix shifts both arms alike (its theta0, bank and
    phi0), the arms differ by 0.1 in every prefix. The contrast equals the cluster t of the
    per-prefix seed means paired by prefix, so the prefix shifts cancel; runs are never paired
    across prefixes, and arms that share no prefix are refused."""
    rng = np.random.default_rng(4)
    shift = {0: 0.0, 1: 0.4, 2: -0.3}
    base = rng.uniform(0.2, 0.5, 16)

    def runs(gain, seeds=(0, 1), prefixes=(0, 1, 2)):
        return [{**_outcomes(base + shift[p] + gain + rng.normal(0, 0.01, 16)), "seed": s, "prefix": p}
                for p in prefixes for s in seeds]

    a, b = runs(0.1), runs(0.0)
    got = arm_stats.contrast(a, b[::-1], resamples=300)
    A, B = (np.array([np.mean([r["reward"] for r in x if r["prefix"] == p], 0) for p in (0, 1, 2)]) for x in (a, b))
    ref = statistics.cluster_t(A, B, a[0]["cluster"], paired_seeds=True)
    assert (got["lo"], got["hi"], got["estimate"]) == pytest.approx((ref["lo"], ref["hi"], ref["estimate"]))
    assert got["prefixes"] == 3 and got["runs"] == (6, 6) and got["seeds"] == (3, 3)
    assert got["lo"] > 0.05 and got["hi"] < 0.15  # paired within prefix: the shifts of up to 0.7 cancel
    # an arm that ran prefix 1 with other seeds still pairs prefix by prefix; prefix 2 of one arm only is left out
    part = arm_stats.contrast(a, runs(0.0, seeds=(5,), prefixes=(0, 1)), resamples=300)
    assert part["prefixes"] == 2 and part["runs"] == (4, 2) and part["prefixes_dropped"] == [2]
    with pytest.raises(ValueError, match="no prefix in common"):
        arm_stats.contrast(runs(0.1, prefixes=(0,)), runs(0.0, prefixes=(1,)))
    with pytest.raises(ValueError, match="some runs carry a prefix"):
        arm_stats.contrast(a, [{k: v for k, v in r.items() if k != "prefix"} for r in b])
    assert "6 vs 6 in 3 prefixes" in arm_stats.format_contrasts(
        arm_stats.contrast_family({"lopd": a, "grpo": b}, [("lopd", "grpo")], resamples=300))

"""lopd_jax.method.statistics against plain NumPy references written here."""

import numpy as np
import pytest

from lopd_jax.method import statistics as st


def test_sample_sd_is_ddof_1():
    x = [0.25, 0.5, 1.0, 0.0]
    mean = sum(x) / 4
    assert st.sample_sd(x) == pytest.approx((sum((v - mean) ** 2 for v in x) / 3) ** 0.5)
    assert np.isnan(st.sample_sd([1.0]))


def test_bootstrap_ci_matches_a_resampling_loop():
    x = np.random.default_rng(3).normal(size=25)
    rng = np.random.default_rng(7)
    reps = sorted(np.mean([x[rng.integers(0, 25)] for _ in range(25)]) for _ in range(500))
    lo, hi = st.bootstrap_ci(x, resamples=500, seed=7)
    # same generator, same draws (row-major) -> the same replicates; numpy's default quantile interpolation
    assert (lo, hi) == pytest.approx((np.quantile(reps, 0.025), np.quantile(reps, 0.975)))


def test_bootstrap_ci_covers_the_mean_about_95_percent():
    rng = np.random.default_rng(0)
    hits = 0
    for i in range(300):
        lo, hi = st.bootstrap_ci(rng.normal(1.0, 2.0, size=40), resamples=1000, seed=i)
        hits += lo <= 1.0 <= hi
    assert 0.89 <= hits / 300 <= 0.98  # the percentile interval runs slightly narrow at n=40


def _reference_paired(a, b, clusters, resamples, seed, paired_seeds):
    """The hierarchical bootstrap as an explicit loop over replicates with the same draws."""
    keys = list(dict.fromkeys(clusters))
    members = [[t for t, c in enumerate(clusters) if c == k] for k in keys]
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, len(keys), size=(resamples, len(keys)))
    sa = rng.integers(0, a.shape[0], size=(resamples, a.shape[0]))
    sb = sa if paired_seeds else rng.integers(0, b.shape[0], size=(resamples, b.shape[0]))
    reps = []
    for r in range(resamples):
        tasks = [t for k in drawn[r] for t in members[k]]
        reps.append(a[sa[r]][:, tasks].mean() - b[sb[r]][:, tasks].mean())
    return np.quantile(reps, [0.025, 0.975])


@pytest.mark.parametrize("paired_seeds", [True, False])
def test_paired_bootstrap_matches_the_loop(paired_seeds):
    rng = np.random.default_rng(1)
    clusters = [f"c{t % 5}" for t in range(12)]
    a = rng.integers(0, 2, size=(3, 12)).astype(float)
    b = rng.integers(0, 2, size=(3, 12)).astype(float)
    got = st.paired_bootstrap(a, b, clusters, paired_seeds=paired_seeds, resamples=400, seed=4)
    ref = _reference_paired(a, b, clusters, 400, 4, paired_seeds)
    assert (got["lo"], got["hi"]) == pytest.approx(tuple(ref))
    assert got["estimate"] == pytest.approx(a.mean() - b.mean())
    assert got["clusters"] == 5 and got["tasks"] == 12 and got["seed_resampling"]


def test_paired_bootstrap_with_one_seed_resamples_tasks_only():
    a, b = np.array([1.0, 1.0, 0.0, 1.0]), np.array([0.0, 1.0, 0.0, 0.0])
    got = st.paired_bootstrap(a, b, resamples=200)
    assert not got["seed_resampling"] and got["seeds"] == (1, 1)
    assert "tasks only" in st.describe_design(got)
    with pytest.raises(ValueError, match="same tasks"):
        st.paired_bootstrap(a, b[:3])


def test_clustered_bootstrap_covers_about_95_percent():
    """Outcomes with a shared cluster effect: the clustered interval covers the true
    difference about 95% of the time (an i.i.d. task bootstrap would run narrow)."""
    rng = np.random.default_rng(2)
    clusters = np.repeat(np.arange(12), 4)
    hits = 0
    for i in range(200):
        effect = rng.normal(0.0, 1.0, size=12)[clusters]  # shared by both arms' tasks of a cluster: paired
        shift = rng.normal(0.0, 0.5, size=12)[clusters]  # the arms' difference varies by cluster too
        a = effect + shift + 0.3 + rng.normal(0.0, 0.5, size=(2, 48))
        b = effect + rng.normal(0.0, 0.5, size=(2, 48))
        c = st.paired_bootstrap(a, b, clusters, resamples=500, seed=i)
        hits += c["lo"] <= 0.3 <= c["hi"]
    assert 0.86 <= hits / 200 <= 0.99


def test_effective_sample_size_is_kish():
    rng = np.random.default_rng(5)
    clusters = np.repeat(np.arange(8), [3, 5, 4, 6, 2, 4, 5, 3])
    y = rng.normal(size=8)[clusters] + rng.normal(0.0, 0.7, size=clusters.size)
    n, K = y.size, 8
    m = np.bincount(clusters)
    means = np.array([y[clusters == k].mean() for k in range(K)])
    msb = sum(m[k] * (means[k] - y.mean()) ** 2 for k in range(K)) / (K - 1)
    msw = sum(((y[clusters == k] - means[k]) ** 2).sum() for k in range(K)) / (n - K)
    m0 = (n - (m ** 2).sum() / n) / (K - 1)
    icc = (msb - msw) / (msb + (m0 - 1) * msw)
    deff = 1 + ((m ** 2).sum() / n - 1) * icc
    got = st.effective_sample_size(y, clusters)
    assert got["icc"] == pytest.approx(icc) and got["design_effect"] == pytest.approx(deff)
    assert got["n_eff"] == pytest.approx(n / deff) and got["clusters"] == K
    independent = st.effective_sample_size(rng.normal(size=40), np.arange(40))
    assert independent["n_eff"] == pytest.approx(40.0)


def test_holm_matches_the_step_down_rule():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1, running max
    expected = {3: 0.02, 0: 0.03, 2: 0.06, 1: 0.06}
    assert st.holm(p) == pytest.approx([expected[i] for i in range(4)])
    assert st.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_stratified_bootstrap_ci_resamples_each_stratum():
    x = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    strata = ["a", "a", "a", "b", "b", "b", "b"]
    rng = np.random.default_rng(0)
    a, b = x[:3], x[3:]
    reps = (a[rng.integers(0, 3, size=(300, 3))].mean(1) + b[rng.integers(0, 4, size=(300, 4))].mean(1)) / 2
    assert st.bootstrap_ci(x, resamples=300, strata=strata) == pytest.approx(tuple(np.quantile(reps, [0.025, 0.975])))

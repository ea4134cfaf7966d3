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


def test_student_t_matches_scipy():
    from scipy import stats  # a dependency of jax; the module itself stays NumPy-only
    for df in (1, 2, 3, 4, 7, 8, 15, 63, 500):
        for level in (0.5, 0.9, 0.95, 0.99):
            assert st.t_quantile(level, df) == pytest.approx(stats.t.ppf((1 + level) / 2, df), rel=1e-10)
        for t in (0.0, 0.4, 2.36, 6.0):
            assert st.t_two_sided_p(t, df) == pytest.approx(2 * stats.t.sf(t, df), abs=1e-12)
    with pytest.raises(ValueError, match="whole number"):
        st.t_two_sided_p(1.0, 2.5)


def test_cluster_t_with_equal_clusters_and_one_seed_is_the_one_sample_t():
    from scipy import stats
    rng = np.random.default_rng(6)
    clusters = np.repeat(np.arange(6), 4)
    a, b = rng.normal(0.3, 1.0, size=24), rng.normal(0.0, 1.0, size=24)
    d = np.array([(a - b)[clusters == g].mean() for g in range(6)])
    got = st.cluster_t(a, b, clusters)
    ref = stats.ttest_1samp(d, 0.0)
    half = stats.t.ppf(0.975, 5) * d.std(ddof=1) / np.sqrt(6)
    assert got["p_value"] == pytest.approx(ref.pvalue) and got["df"] == 5 and got["seed_variance"] == 0.0
    assert (got["lo"], got["hi"]) == pytest.approx((d.mean() - half, d.mean() + half))
    assert "one seed per arm" in st.describe_design(got)


def test_cluster_t_adds_the_seeds_common_shift_as_a_two_way_anova():
    """Equal clusters, paired seeds: the variance is (MS_clusters + max(0, MS_seeds - MS_residual)) / (G S)
    of the per-(seed, cluster) contrasts, the t's df min(G, S) - 1 once the seed term enters."""
    rng = np.random.default_rng(7)
    S, G = 4, 6
    clusters = np.repeat(np.arange(G), 3)
    a = rng.normal(size=(S, 18)) + rng.normal(0.0, 1.0, size=(S, 1))  # each run shifted as a whole
    b = rng.normal(size=(S, 18))
    d = np.array([[(a - b)[s, clusters == g].mean() for g in range(G)] for s in range(S)])
    grand, by_seed, by_cluster = d.mean(), d.mean(1), d.mean(0)
    ms_c = S * np.sum((by_cluster - grand) ** 2) / (G - 1)
    ms_s = G * np.sum((by_seed - grand) ** 2) / (S - 1)
    ms_e = np.sum((d - by_seed[:, None] - by_cluster[None, :] + grand) ** 2) / ((S - 1) * (G - 1))
    assert ms_s > ms_e
    got = st.cluster_t(a, b, clusters)
    assert got["se"] ** 2 == pytest.approx((ms_c + ms_s - ms_e) / (G * S))
    assert got["df"] == S - 1 and got["paired_seeds"] and got["seed_variance"] > 0
    assert "run-to-run seed variance added" in st.describe_design(got, "customer")
    unpaired = st.cluster_t(a, b[:3], clusters)  # 4 vs 3 seeds: each arm's own seed term
    assert not unpaired["paired_seeds"] and unpaired["estimate"] == pytest.approx(a.mean() - b[:3].mean())


def test_cluster_t_weights_clusters_by_their_tasks():
    """Unequal clusters: the estimate is the difference of task means and the variance the CR2
    one, sum w^2 (d_g - est)^2 / (1 - w)."""
    rng = np.random.default_rng(8)
    clusters = np.repeat(np.arange(5), [2, 3, 5, 8, 12])
    a, b = rng.normal(size=30), rng.normal(size=30)
    w = np.bincount(clusters) / 30
    d = np.array([(a - b)[clusters == g].mean() for g in range(5)])
    got = st.cluster_t(a, b, clusters)
    assert got["estimate"] == pytest.approx(d @ w) == pytest.approx(a.mean() - b.mean())
    assert got["se"] ** 2 == pytest.approx(np.sum(w ** 2 * (d - d @ w) ** 2 / (1 - w)))


def test_cluster_t_edge_cases():
    x = np.array([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    same = st.cluster_t(x, x, ["c0", "c1", "c0", "c1"])
    assert (same["estimate"], same["lo"], same["hi"], same["p_value"]) == (0.0, 0.0, 0.0, 1.0)
    one = st.cluster_t(x, x[::-1] * 0.5, ["c"] * 4)
    assert one["clusters"] == 1 and one["lo"] == -np.inf and one["hi"] == np.inf and one["p_value"] == 1.0
    with pytest.raises(ValueError, match="same tasks"):
        st.cluster_t(x, x[:, :3])


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

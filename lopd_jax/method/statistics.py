"""Statistics for comparing runs: sample spread, intervals for a difference between arms
built for few clusters, effective sample size of clustered outcomes and Holm's correction
for a family of contrasts (NumPy only).

Outcomes of an arm are a ``[seeds, tasks]`` array (one held-out evaluation per seed, the
same tasks for every seed) and each task carries a cluster key (tasks of one cluster share
what makes their outcomes dependent: the customer of a hidden-rule family, the problem of
a code task). :func:`cluster_t`, the primary interval of every arm contrast, is a paired
cluster-level t (G - 1 degrees of freedom) with the run-to-run seed variance added where
the seeds show one; :func:`paired_bootstrap`, which resamples seeds and clusters, is kept as
a secondary column (it under-covers with about 8 clusters). docs/statistics.md explains
the choices and gives both intervals' simulated coverage.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import numpy as np

LEVEL = 0.95
RESAMPLES = 10_000
SEED = 0


def sample_sd(x: Sequence[float]) -> float:
    """The sample standard deviation (ddof=1); NaN with fewer than two values."""
    a = np.asarray(x, dtype=np.float64).ravel()
    return float(a.std(ddof=1)) if a.size >= 2 else float("nan")


def percentile_interval(replicates: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of bootstrap ``replicates`` at ``level``."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level}: a confidence level is in (0, 1), e.g. 0.95")
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(np.asarray(replicates, dtype=np.float64), [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def bootstrap_ci(x: Sequence[float], level: float = LEVEL, resamples: int = RESAMPLES,
                 seed: int = SEED, strata: Sequence[Any] | None = None) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``x`` (i.i.d. resampling, fixed seed).

    With ``strata`` (one key per value) each stratum is resampled on its own and the
    statistic is the mean of the stratum means (a score averaged over categories)."""
    a = np.asarray(x, dtype=np.float64).ravel()
    if a.size == 0:
        raise ValueError("bootstrap_ci needs at least one value")
    rng = np.random.default_rng(seed)
    if strata is None:
        idx = rng.integers(0, a.size, size=(resamples, a.size))
        return percentile_interval(a[idx].mean(axis=1), level)
    sidx, K = _cluster_index(strata, a.size)
    reps = np.zeros(resamples)
    for k in range(K):
        xs = a[sidx == k]
        reps += xs[rng.integers(0, xs.size, size=(resamples, xs.size))].mean(axis=1) / K
    return percentile_interval(reps, level)


def _cluster_index(clusters: Sequence[Any] | None, n_tasks: int) -> tuple[np.ndarray, int]:
    """Tasks' cluster numbers (0..K-1 in first-seen order) and K; each task its own without keys."""
    if clusters is None:
        return np.arange(n_tasks), n_tasks
    if len(clusters) != n_tasks:
        raise ValueError(f"{len(clusters)} cluster keys for {n_tasks} tasks; give one key per task")
    order: dict[Any, int] = {}
    idx = np.array([order.setdefault(c, len(order)) for c in clusters])
    return idx, len(order)


def _as_seeds_by_tasks(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"{name} must be [seeds, tasks] (or [tasks] for one seed), got shape {np.shape(x)}")
    return a


def _paired_inputs(a: Any, b: Any, paired_seeds: bool | None) -> tuple[np.ndarray, np.ndarray, bool]:
    """``a`` and ``b`` as ``[seeds, tasks]`` over the same tasks, and whether their seeds pair
    (default: as many seeds in both)."""
    a, b = _as_seeds_by_tasks(a, "a"), _as_seeds_by_tasks(b, "b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"a has {a.shape[1]} tasks and b {b.shape[1]}; a paired comparison needs the same tasks")
    if paired_seeds is None:
        paired_seeds = a.shape[0] == b.shape[0]
    if paired_seeds and a.shape[0] != b.shape[0]:
        raise ValueError(f"paired_seeds needs as many seeds in a ({a.shape[0]}) as in b ({b.shape[0]})")
    return a, b, bool(paired_seeds)


def paired_bootstrap(a: Any, b: Any, clusters: Sequence[Any] | None = None, *, paired_seeds: bool | None = None,
                     level: float = LEVEL, resamples: int = RESAMPLES, seed: int = SEED) -> dict[str, Any]:
    """Hierarchical bootstrap of ``mean(a) - mean(b)`` over seeds and clusters of tasks.

    ``a`` [Sa, T] and ``b`` [Sb, T] are per-seed, per-task outcomes on the same T tasks (a
    1-D array is one seed); ``clusters`` [T] the tasks' cluster keys (None: every task its
    own cluster). Each replicate draws K clusters with replacement (all tasks of a drawn
    cluster enter, the same draw for both arms: paired over tasks) and Sa (Sb) seeds with
    replacement; with ``paired_seeds`` (default: both arms have the same number of seeds,
    row s of ``a`` and ``b`` the same seed) one seed draw serves both arms. The estimate is
    the difference of the seed-then-task means. Returns ``estimate``, ``lo``, ``hi``,
    ``p_value`` (two-sided bootstrap: twice the smaller tail share at 0, at most 1) and
    the design: ``seeds`` (a, b), ``tasks``, ``clusters``, ``level``, ``resamples``,
    ``seed_resampling`` (False with one seed per arm: the interval is then over tasks alone),
    ``paired_seeds``.
    """
    a, b, paired_seeds = _paired_inputs(a, b, paired_seeds)
    T = a.shape[1]
    cidx, K = _cluster_index(clusters, T)
    rng = np.random.default_rng(seed)
    # one cluster draw per replicate -> per-task weights (how often its cluster was drawn)
    drawn = rng.integers(0, K, size=(resamples, K))
    counts = np.zeros((resamples, K))
    np.add.at(counts, (np.arange(resamples)[:, None], drawn), 1.0)
    task_w = counts[:, cidx]  # [R, T]

    def seed_weights(S: int) -> np.ndarray:
        w = np.zeros((resamples, S))
        np.add.at(w, (np.arange(resamples)[:, None], rng.integers(0, S, size=(resamples, S))), 1.0)
        return w

    wa = seed_weights(a.shape[0])
    wb = wa if paired_seeds else seed_weights(b.shape[0])

    def means(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.einsum("rt,rt->r", w @ x, task_w) / (w.sum(1) * task_w.sum(1))

    reps = means(a, wa) - means(b, wb)
    lo, hi = percentile_interval(reps, level)
    p = min(1.0, 2.0 * min(np.mean(reps <= 0.0), np.mean(reps >= 0.0)))
    return {"estimate": float(a.mean() - b.mean()), "lo": lo, "hi": hi, "p_value": float(p),
            "seeds": (a.shape[0], b.shape[0]), "tasks": T, "clusters": K, "level": level, "resamples": resamples,
            "seed_resampling": bool(a.shape[0] > 1 or b.shape[0] > 1), "paired_seeds": bool(paired_seeds)}


def _t_central(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer ``df`` (closed form, Abramowitz & Stegun 26.7.3-4)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    k = np.arange(1, (df - 1) // 2 if df % 2 else df // 2)  # the terms after the leading 1
    if df % 2:  # odd: (2/pi) [theta + sin cos (1 + 2/3 cos^2 + (2*4)/(3*5) cos^4 + ...)]
        series = 1.0 + np.sum(np.cumprod(c2 * (2 * k) / (2 * k + 1))) if df > 1 else 0.0
        return float(2.0 / math.pi * (theta + math.sin(theta) * math.cos(theta) * series))
    # even: sin (1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ...)
    return float(math.sin(theta) * (1.0 + np.sum(np.cumprod(c2 * (2 * k - 1) / (2 * k)))))


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p-value of a t statistic with integer ``df`` degrees of freedom."""
    if df < 1 or int(df) != df:
        raise ValueError(f"df={df}: Student's t here takes a whole number of degrees of freedom >= 1")
    return max(0.0, 1.0 - _t_central(abs(float(t)), int(df)))


@functools.lru_cache(maxsize=256)
def t_quantile(level: float, df: int) -> float:
    """The two-sided ``level`` critical value of Student's t with integer ``df`` (its
    ``(1 + level) / 2`` quantile), to machine precision by bisection on the exact CDF."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level}: a confidence level is in (0, 1), e.g. 0.95")
    t_two_sided_p(0.0, df)  # validates df
    lo, hi = 0.0, 1.0
    while _t_central(hi, df) < level:
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-13 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if _t_central(mid, df) < level else (lo, mid)
    return 0.5 * (lo + hi)


def _seed_variance(cells: np.ndarray, w: np.ndarray) -> float:
    """The run-to-run variance of the estimate one arm's (or a paired contrast's) seeds add
    beyond what the clusters' spread already holds: ``cells`` [S, G] are per-seed cluster
    means, ``w`` [G] the clusters' task shares. The spread of the per-seed means, less its
    seed-by-cluster part (the two-way interaction, counted once through the clusters), over
    S; 0 with one seed or when the seeds show no common shift."""
    S, G = cells.shape
    if S < 2 or G < 2:
        return 0.0
    per_seed = cells @ w
    resid = cells - cells.mean(0) - per_seed[:, None] + per_seed.mean()
    interaction = G * np.sum(w ** 2 * resid ** 2) / ((S - 1) * (G - 1))
    return max(0.0, float(per_seed.var(ddof=1)) - interaction) / S


def cluster_t(a: Any, b: Any, clusters: Sequence[Any] | None = None, *, paired_seeds: bool | None = None,
              level: float = LEVEL) -> dict[str, Any]:
    """Paired cluster-level t interval of ``mean(a) - mean(b)``, built for few clusters.

    ``a`` [Sa, T], ``b`` [Sb, T], ``clusters`` and ``paired_seeds`` as in
    :func:`paired_bootstrap`. Each cluster's contrast ``d_g`` is the difference of its
    tasks' outcomes averaged over seeds and tasks (per seed first when the seeds pair); the
    estimate is ``sum_g w_g d_g`` with ``w_g`` the cluster's share of the tasks (= the
    difference of the seed-then-task means). Its variance is the cluster-robust one with the
    CR2 leverage correction, ``sum_g w_g^2 (d_g - est)^2 / (1 - w_g)`` (the sample variance
    of the ``d_g`` over G when clusters are equal), plus the run-to-run seed variance
    (:func:`_seed_variance`: a shift a seed gives every cluster at once, invisible to the
    clusters' spread). The interval uses Student's t with G - 1 degrees of freedom, or
    min(G, S) - 1 when the seed variance enters (S the seed count of the arm it came from).
    Returns ``estimate``, ``lo``, ``hi``, ``p_value`` (two-sided t), ``se``, ``df``,
    ``seed_variance``, ``seeds`` (a, b), ``tasks``, ``clusters``, ``level``, ``method``,
    ``seed_spread`` (False with one seed per arm: no seed-to-seed spread in it) and
    ``paired_seeds``. With one cluster there is no interval (``lo``/``hi`` infinite, p 1).
    """
    a, b, paired_seeds = _paired_inputs(a, b, paired_seeds)
    T = a.shape[1]
    cidx, G = _cluster_index(clusters, T)
    n = np.bincount(cidx, minlength=G).astype(np.float64)
    w = n / T
    A, B = (np.stack([np.bincount(cidx, weights=row, minlength=G) for row in x]) / n
            for x in (a, b))  # per-seed cluster means [S, G]
    if paired_seeds:
        d = (A - B).mean(0)
        seed_parts = [(_seed_variance(A - B, w), a.shape[0])]
    else:
        d = A.mean(0) - B.mean(0)
        seed_parts = [(_seed_variance(A, w), a.shape[0]), (_seed_variance(B, w), b.shape[0])]
    est = float(a.mean() - b.mean())
    out = {"estimate": est, "seeds": (a.shape[0], b.shape[0]), "tasks": T, "clusters": G, "level": level,
           "method": "cluster_t", "seed_spread": bool(a.shape[0] > 1 or b.shape[0] > 1),
           "paired_seeds": paired_seeds}
    if G < 2:
        return {**out, "lo": -math.inf, "hi": math.inf, "p_value": 1.0, "se": math.inf, "df": 0,
                "seed_variance": 0.0}
    center = float(d @ w)
    seed_var = sum(v for v, _ in seed_parts)
    se = math.sqrt(float(np.sum(w ** 2 * (d - center) ** 2 / (1.0 - w))) + seed_var)
    df = min([G - 1] + [S - 1 for v, S in seed_parts if v > 0.0])
    half = t_quantile(level, df) * se
    p = (1.0 if est == 0.0 else 0.0) if se == 0.0 else t_two_sided_p(est / se, df)
    return {**out, "lo": est - half, "hi": est + half, "p_value": p, "se": se, "df": int(df),
            "seed_variance": seed_var}


def intraclass_correlation(values: Sequence[float], clusters: Sequence[Any]) -> float:
    """One-way ANOVA estimate of the intra-cluster correlation (clipped below at 0)."""
    y = np.asarray(values, dtype=np.float64).ravel()
    cidx, K = _cluster_index(clusters, y.size)
    n = y.size
    if K < 2 or n <= K:
        return 0.0
    m = np.bincount(cidx, minlength=K).astype(np.float64)
    means = np.bincount(cidx, weights=y, minlength=K) / m
    msb = np.sum(m * (means - y.mean()) ** 2) / (K - 1)
    msw = np.sum((y - means[cidx]) ** 2) / (n - K)
    m0 = (n - np.sum(m ** 2) / n) / (K - 1)
    denom = msb + (m0 - 1.0) * msw
    return float(max(0.0, (msb - msw) / denom)) if denom > 0 else 0.0


def effective_sample_size(values: Sequence[float], clusters: Sequence[Any]) -> dict[str, float]:
    """Kish's effective sample size of clustered outcomes: ``n / deff`` with the design
    effect ``deff = 1 + (m_w - 1) * icc``, ``m_w = sum m_k^2 / n`` (the size-weighted mean
    cluster size) and ``icc`` from :func:`intraclass_correlation`. Also returns ``n``,
    ``clusters`` (K, the floor ``n_eff`` reaches when icc = 1 and clusters are equal) and
    ``icc``."""
    y = np.asarray(values, dtype=np.float64).ravel()
    cidx, K = _cluster_index(clusters, y.size)
    m = np.bincount(cidx, minlength=K).astype(np.float64)
    icc = intraclass_correlation(y, clusters)
    deff = 1.0 + (np.sum(m ** 2) / y.size - 1.0) * icc
    return {"n": int(y.size), "clusters": int(K), "icc": icc, "design_effect": float(deff),
            "n_eff": float(y.size / deff)}


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error control), in the input order."""
    p = np.asarray(p_values, dtype=np.float64).ravel()
    k = p.size
    order = np.argsort(p, kind="stable")
    adjusted = np.maximum.accumulate(np.minimum(1.0, (k - np.arange(k)) * p[order]))
    out = np.empty(k)
    out[order] = adjusted
    return out.tolist()


def format_interval(c: dict[str, Any], digits: int = 4) -> str:
    """``+x [lo, hi]`` of a :func:`cluster_t` or :func:`paired_bootstrap` result."""
    return f"{c['estimate']:+.{digits}f} [{c['lo']:+.{digits}f}, {c['hi']:+.{digits}f}]"


def describe_design(c: dict[str, Any], cluster_name: str = "cluster") -> str:
    """What a :func:`cluster_t` (or :func:`paired_bootstrap`) interval is over, in words."""
    level = f"{c['level']:.0%}"
    if c.get("method") != "cluster_t":
        if c["seed_resampling"]:
            what = f"paired bootstrap over seeds ({c['seeds'][0]} vs {c['seeds'][1]}) and held-out tasks"
        else:
            what = "bootstrap over held-out tasks only (one seed per arm: no seed-to-seed spread in it)"
        return f"{level} {what}, {c['tasks']} tasks in {c['clusters']} {cluster_name} clusters"
    where = f"{c['tasks']} held-out tasks in {c['clusters']} {cluster_name} clusters, df {c['df']}"
    if not c["seed_spread"]:
        return f"{level} cluster t over {where}; one seed per arm: no seed-to-seed spread in it"
    seeds = "run-to-run seed variance added" if c["seed_variance"] > 0 else "no common seed shift seen"
    return (f"{level} cluster t over {where}; seeds ({c['seeds'][0]} vs {c['seeds'][1]}) averaged within each "
            f"cluster, {seeds}")

"""Tests for lopd_jax.method.losses / losses_kl against NumPy float64 formulas and the plain path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lopd_jax.method import losses as L
from lopd_jax.method.loss_config import LossConfig

# ----------------------------------------------------------------------------- NumPy refs


def np_lse(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    return (m + np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)))[..., 0]


def np_log_softmax(x):
    return x - np_lse(x)[..., None]


def np_kl(student_logits, teacher_logits, m):
    """docs/method.md, "Distillation loss", in float64: teacher top-M plus an unrenormalized tail."""
    ls = np_log_softmax(np.asarray(student_logits, np.float64))
    lt = np_log_softmax(np.asarray(teacher_logits, np.float64))
    idx = np.argsort(-lt, axis=-1, kind="stable")[..., :m]
    ls_i = np.take_along_axis(ls, idx, -1)
    lt_i = np.take_along_axis(lt, idx, -1)

    def with_tail(x):
        tail = np.log(-np.expm1(np.minimum(np_lse(x), -1e-7)))
        return np.concatenate([x, tail[..., None]], -1)

    ps, pt = with_tail(ls_i), with_tail(lt_i)
    return np.sum(np.exp(ps) * (ps - pt), -1)


def assert_kl_close(got, student_logits, teacher_logits, m):
    """Compare with the float64 reference at fp32 accuracy.

    The literal formula forms the tail as 1 - sum p[I] from fp32 log-probs, so the
    teacher's tail carries an absolute error of about one ulp(1) ~ 1.2e-7, i.e. a relative
    error ulp/tail_T, which the KL multiplies by the student's tail mass. The tolerance
    allows 4 ulp of that (plus fp32 rounding); it is tight wherever the tail is not tiny.
    """
    ls = np_log_softmax(np.asarray(student_logits, np.float64))
    lt = np_log_softmax(np.asarray(teacher_logits, np.float64))
    idx = np.argsort(-lt, axis=-1, kind="stable")[..., :m]
    tail_s = np.maximum(1 - np.exp(np.take_along_axis(ls, idx, -1)).sum(-1), 1e-7)
    tail_t = np.maximum(1 - np.exp(np.take_along_axis(lt, idx, -1)).sum(-1), 1e-7)
    ref = np_kl(student_logits, teacher_logits, m)
    tol = 2e-6 + 2e-5 * np.abs(ref) + 4 * 2.0**-23 * tail_s / tail_t
    err = np.abs(np.asarray(got, np.float64) - ref)
    assert np.all(err <= tol), f"max err {err.max()} vs tol {tol[np.argmax(err - tol)]}"


def np_masked_mean(x, mask):
    m = np.asarray(mask, bool)
    return np.where(m, x, 0).sum() / max(m.sum(), 1)


def np_rollout_mean(x, mask):
    m = np.asarray(mask, bool)
    vals = [np.asarray(x)[i][m[i]].mean() for i in range(len(m)) if m[i].any()]
    return float(np.mean(vals)) if vals else 0.0


# One compile per shape instead of one per primitive (eager dispatch is slow here).
kl_jit = jax.jit(L.topm_tail_reverse_kl, static_argnums=2)


def f32(x):
    return np.asarray(x, np.float32)


# ------------------------------------------------------------------- plain top-M + tail KL


@pytest.mark.parametrize("scale,m", [(3.0, 5), (1.0, 20)])
def test_kl_matches_numpy_random(scale, m):
    rng = np.random.default_rng(0)
    s = f32(rng.normal(size=(2, 3, 64)) * scale)
    t = f32(rng.normal(size=(2, 3, 64)) * scale)
    got = kl_jit(jnp.asarray(s), jnp.asarray(t), m)
    assert got.shape == (2, 3) and got.dtype == jnp.float32
    assert_kl_close(got, s, t, m)


def test_kl_near_one_hot_and_huge_ranges():
    rng = np.random.default_rng(1)
    v = 48
    t = f32(rng.normal(size=(4, v)))
    t[np.arange(4), [0, 5, 9, 47]] += 60.0  # teacher top-1 mass ~ 1 - 1e-25: tail clamped
    s = f32(rng.normal(size=(4, v)))
    s[1, 5] += 60.0  # one student row one-hot on the same token, one on another
    s[2, 3] += 60.0
    got = np.asarray(kl_jit(jnp.asarray(s), jnp.asarray(t), 4))
    assert_kl_close(got, s, t, 4)
    assert got[1] < 1e-5 < got[2]

    huge_s = f32(rng.normal(size=(3, 5, v)) * 1e4)
    huge_t = f32(rng.normal(size=(3, 5, v)) * 1e4)
    got = np.asarray(kl_jit(jnp.asarray(huge_s), jnp.asarray(huge_t), 6))
    assert np.all(np.isfinite(got))
    assert_kl_close(got, huge_s, huge_t, 6)


def test_kl_bf16_inputs():
    rng = np.random.default_rng(2)
    s = jnp.asarray(rng.normal(size=(2, 4, 40)) * 4, jnp.bfloat16)
    t = jnp.asarray(rng.normal(size=(2, 4, 40)) * 4, jnp.bfloat16)
    got = kl_jit(s, t, 7)
    assert got.dtype == jnp.float32
    assert_kl_close(got, np.asarray(s.astype(jnp.float32)), np.asarray(t.astype(jnp.float32)), 7)


def test_kl_gradients_match_finite_differences():
    rng = np.random.default_rng(3)
    s = rng.normal(size=(2, 9)) * 2
    t = rng.normal(size=(2, 9)) * 2
    w = np.array([0.7, -1.3])

    def f_np(s_, t_):
        return float(np.sum(w * np_kl(s_, t_, 3)))

    gs, gt = jax.jit(jax.grad(
        lambda a, b: jnp.sum(jnp.asarray(w, jnp.float32) * L.topm_tail_reverse_kl(a, b, 3)),
        argnums=(0, 1),
    ))(jnp.asarray(f32(s)), jnp.asarray(f32(t)))
    h = 1e-6
    for x, g, which in ((s, gs, 0), (t, gt, 1)):
        num = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[i] += h
            xm[i] -= h
            args_p = (xp, t) if which == 0 else (s, xp)
            args_m = (xm, t) if which == 0 else (s, xm)
            num[i] = (f_np(*args_p) - f_np(*args_m)) / (2 * h)
        np.testing.assert_allclose(np.asarray(g), num, rtol=1e-3, atol=2e-5)
    assert np.abs(np.asarray(gt)).max() > 1e-3  # the teacher really receives gradient


# ------------------------------------------------------------------------- aggregations


def test_masked_means_and_empty_rows():
    rng = np.random.default_rng(4)
    x = f32(rng.normal(size=(4, 6)))
    mask = np.zeros((4, 6), np.float32)
    mask[0, :5] = 1
    mask[1, 2] = 1
    mask[3, 1:] = 1  # row 2 fully masked
    x_bad = x.copy()
    x_bad[2] = np.nan  # garbage where unsupervised must not leak
    x_bad[0, 5] = np.inf
    got_tok = L.masked_token_mean(jnp.asarray(x_bad), jnp.asarray(mask))
    got_roll = L.rollout_mean(jnp.asarray(x_bad), jnp.asarray(mask.astype(bool)))
    np.testing.assert_allclose(float(got_tok), np_masked_mean(x, mask), rtol=1e-6)
    np.testing.assert_allclose(float(got_roll), np_rollout_mean(x, mask), rtol=1e-6)
    assert abs(float(got_tok) - float(got_roll)) > 1e-3  # the two weightings differ here

    empty = jnp.zeros((4, 6))
    for fn in (L.masked_token_mean, L.rollout_mean, L.nll_token_mean):
        val, grad = jax.value_and_grad(fn)(jnp.asarray(x), empty)
        assert float(val) == 0.0 and np.all(np.isfinite(np.asarray(grad)))
    np.testing.assert_allclose(
        float(L.nll_token_mean(jnp.asarray(x), jnp.asarray(mask))), -np_masked_mean(x, mask),
        rtol=1e-6,
    )
    with pytest.raises(ValueError, match="mask"):
        L.masked_token_mean(jnp.zeros((2, 3)), jnp.zeros((2, 4)))


def test_weighted_token_mean_matches_numpy():
    rng = np.random.default_rng(5)
    x = f32(rng.normal(size=(3, 7)))
    w = np.zeros((3, 7), np.float32)
    w[0, :4] = 1.0
    w[0, 2] = 10.0  # one up-weighted token
    w[2, 3:] = rng.uniform(0.5, 3.0, size=4)
    x_bad = x.copy()
    x_bad[1] = np.nan  # unsupervised row
    got = float(L.weighted_token_mean(jnp.asarray(x_bad), jnp.asarray(w)))
    np.testing.assert_allclose(got, float((x * w).sum() / w.sum()), rtol=1e-6)
    ones = (w > 0).astype(np.float32)
    np.testing.assert_allclose(float(L.weighted_token_mean(jnp.asarray(x), jnp.asarray(ones))),
                               float(L.masked_token_mean(jnp.asarray(x), jnp.asarray(ones))), rtol=1e-6)
    val, grad = jax.value_and_grad(L.weighted_token_mean)(jnp.asarray(x), jnp.zeros((3, 7)))
    assert float(val) == 0.0 and np.all(np.isfinite(np.asarray(grad)))


def test_privilege_delta_matches_numpy():
    rng = np.random.default_rng(5)
    t = f32(rng.normal(size=(3, 5)))
    s = f32(rng.normal(size=(3, 5)))
    mask = np.array([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]], np.float32)
    adv = f32([0.5, -1.0, -0.25])
    big, per, n = L.privilege_delta(*map(jnp.asarray, (t, s, mask, adv)))
    n_np = mask.sum(1)
    d = t - s
    per_np = np.array([adv[i] * d[i][mask[i] > 0].mean() if n_np[i] else 0.0 for i in range(3)])
    np.testing.assert_allclose(np.asarray(n), n_np)
    np.testing.assert_allclose(np.asarray(per), per_np, rtol=1e-6)
    np.testing.assert_allclose(float(big), (n_np * per_np).sum() / n_np.sum(), rtol=1e-6)

    gt, gs = jax.grad(lambda a, b: L.privilege_delta(a, b, jnp.asarray(mask), jnp.asarray(adv))[0],
                      argnums=(0, 1))(jnp.asarray(t), jnp.asarray(s))
    np.testing.assert_allclose(np.asarray(gs), 0.0)  # student log-prob is stop-gradient
    np.testing.assert_allclose(np.asarray(gt), mask * adv[:, None] / n_np.sum(), rtol=1e-6)


def test_dual_update_anchor_advantages():
    for beta, m, d, eta in [(0.0, 0.05, 0.01, 0.5), (0.3, 0.05, 0.9, 0.5), (0.1, 0.0, 0.02, 2.0)]:
        np.testing.assert_allclose(
            float(L.dual_update(beta, m, d, eta)), max(0.0, beta + eta * (m - d)), rtol=1e-6
        )
    np.testing.assert_allclose(np.asarray(L.advantages_from_rewards(jnp.array([0.0, 0.25, 1.0]))),
                               [-1.0, -0.5, 1.0])
    rng = np.random.default_rng(6)
    c, c0 = f32(rng.normal(size=(2, 4, 3))), f32(rng.normal(size=(2, 4, 3)))
    val, (gc, gc0) = jax.value_and_grad(L.anchor_loss, argnums=(0, 1))(jnp.asarray(c), jnp.asarray(c0))
    np.testing.assert_allclose(float(val), np.mean((c - c0) ** 2), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gc), 2 * (c - c0) / c.size, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gc0), 0.0)


# ------------------------------------------------------------------ chunked == plain


def _plain_stats(sh, shead, th, thead, targets, m):
    s_logits, t_logits = sh @ shead, th @ thead
    tgt = targets[..., None]
    return {
        "kl": L.topm_tail_reverse_kl(s_logits, t_logits, m),
        "student_logp": jnp.take_along_axis(jax.nn.log_softmax(s_logits), tgt, -1)[..., 0],
        "teacher_logp": jnp.take_along_axis(jax.nn.log_softmax(t_logits), tgt, -1)[..., 0],
    }


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_matches_plain_values_and_grads(tied):
    rng = np.random.default_rng(7)
    b, s, d, v, m = 2, 13, 8, 40, 5
    sh, th = (jnp.asarray(f32(rng.normal(size=(b, s, d)))) for _ in range(2))
    shead = jnp.asarray(f32(rng.normal(size=(d, v))))
    thead = shead if tied else jnp.asarray(f32(rng.normal(size=(d, v))))
    targets = jnp.asarray(rng.integers(0, v, size=(b, s)), jnp.int32)
    w = [jnp.asarray(f32(rng.normal(size=(b, s)))) for _ in range(3)]

    def scalar(stats):
        return sum(jnp.sum(wi * stats[k]) for wi, k in zip(w, ("kl", "student_logp", "teacher_logp")))

    def chunked(sh, shead, th, thead):
        st = L.chunked_distill_stats(sh, shead, th, thead, targets, top_m=m, chunk_size=4)
        return scalar(st), st

    def plain(sh, shead, th, thead):
        st = _plain_stats(sh, shead, th, thead, targets, m)
        return scalar(st), st

    if tied:  # one shared head array: its gradient sums both paths
        fc = jax.value_and_grad(lambda a, h, c: chunked(a, h, c, h), argnums=(0, 1, 2), has_aux=True)
        fp = jax.value_and_grad(lambda a, h, c: plain(a, h, c, h), argnums=(0, 1, 2), has_aux=True)
        args = (sh, shead, th)
    else:
        fc = jax.value_and_grad(chunked, argnums=(0, 1, 2, 3), has_aux=True)
        fp = jax.value_and_grad(plain, argnums=(0, 1, 2, 3), has_aux=True)
        args = (sh, shead, th, thead)
    (vc, stc), gc = jax.jit(fc)(*args)
    (vp, stp), gp = jax.jit(fp)(*args)
    for k in ("kl", "student_logp", "teacher_logp"):
        assert stc[k].shape == (b, s)
        np.testing.assert_allclose(np.asarray(stc[k]), np.asarray(stp[k]), rtol=1e-5, atol=1e-5)
    mass = np.exp(np.take_along_axis(
        np_log_softmax(np.asarray(th @ thead, np.float64)),
        np.argsort(-np.asarray(th @ thead), -1)[..., :m], -1)).sum(-1)
    np.testing.assert_allclose(np.asarray(stc["teacher_topm_mass"]), mass, rtol=1e-5)
    np.testing.assert_allclose(float(vc), float(vp), rtol=1e-5)
    for a, bb in zip(gc, gp):
        assert float(jnp.abs(bb).max()) > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(bb), rtol=1e-4, atol=1e-5)


def test_chunked_token_logp_and_bf16_compute():
    rng = np.random.default_rng(8)
    b, s, d, v = 2, 11, 8, 32
    h = jnp.asarray(f32(rng.normal(size=(b, s, d))))
    w = jnp.asarray(f32(rng.normal(size=(d, v))))
    tgt = jnp.asarray(rng.integers(0, v, size=(b, s)), jnp.int32)
    wt = jnp.asarray(f32(rng.normal(size=(b, s))))

    def ref(h, w):
        lp = jnp.take_along_axis(jax.nn.log_softmax(h @ w), tgt[..., None], -1)[..., 0]
        return jnp.sum(wt * lp), lp

    def chk(h, w, dtype=jnp.float32):
        lp = L.chunked_token_logp(h, w, tgt, chunk_size=3, compute_dtype=dtype)
        return jnp.sum(wt * lp), lp

    (_, lp_c), g_c = jax.value_and_grad(chk, argnums=(0, 1), has_aux=True)(h, w)
    (_, lp_p), g_p = jax.value_and_grad(ref, argnums=(0, 1), has_aux=True)(h, w)
    np.testing.assert_allclose(np.asarray(lp_c), np.asarray(lp_p), rtol=1e-5, atol=1e-5)
    for a, bb in zip(g_c, g_p):
        np.testing.assert_allclose(np.asarray(a), np.asarray(bb), rtol=1e-4, atol=1e-5)

    # bf16 matmul inputs: by default the head accumulates in fp32 (the release), so the result
    # tracks the exact logits of the bf16-rounded inputs; logits_dtype=bf16 tracks the
    # bf16-rounded logits. Log-softmax is fp32 either way.
    h16, w16 = (np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64) for x in (h, w))
    pick = lambda logits: np.take_along_axis(np_log_softmax(logits), np.asarray(tgt)[..., None], -1)[..., 0]  # noqa: E731
    lp16 = L.chunked_token_logp(h, w, tgt, chunk_size=4, compute_dtype=jnp.bfloat16)
    assert lp16.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp16), pick(h16 @ w16), rtol=1e-5, atol=1e-5)
    lp_rounded = L.chunked_token_logp(h, w, tgt, chunk_size=4, compute_dtype=jnp.bfloat16, logits_dtype=jnp.bfloat16)
    logits16 = np.asarray(jnp.dot(h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)).astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(lp_rounded), pick(logits16.astype(np.float64)), rtol=1e-4, atol=1e-4)


def test_bad_inputs_raise_clear_errors():
    x = jnp.zeros((1, 3, 4))
    head = jnp.zeros((4, 10))
    tgt = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="top_m"):
        L.topm_tail_reverse_kl(jnp.zeros((2, 5)), jnp.zeros((2, 5)), top_m=5)
    with pytest.raises(ValueError, match="chunk_size"):
        L.chunked_token_logp(x, head, tgt, chunk_size=0)
    with pytest.raises(ValueError, match="D"):
        L.chunked_distill_stats(x, jnp.zeros((5, 10)), x, head, tgt, top_m=2)
    with pytest.raises(ValueError, match="targets"):
        L.chunked_token_logp(x, head, tgt.astype(jnp.float32))
    with pytest.raises(ValueError, match="composer_kl_weighting"):
        L.composer_kl_grad_scale(jnp.ones((1, 3)), "per_token")
    with pytest.raises(ValueError, match="group_size"):
        L.group_advantages(jnp.zeros(6), group_size=4)


# ------------------------------------------------------------- fused objective gradients


@pytest.mark.parametrize("weighting", ["rollout_mean", "token_mean"])
def test_fused_objective_splits_gradients(weighting):
    rng = np.random.default_rng(9)
    b, s, d0, d, v, m, kz = 3, 7, 5, 6, 30, 4, 4
    x = jnp.asarray(f32(rng.normal(size=(b, s, d0))))
    z = jnp.asarray(f32(rng.normal(size=(kz, d0))))
    w0 = jnp.asarray(f32(rng.normal(size=(d0, d))))
    head0 = jnp.asarray(f32(rng.normal(size=(d, v))))
    c0 = jnp.asarray(f32(rng.normal(size=(d0, d)) * 0.5))
    theta = {"w": w0 + 0.3 * jnp.asarray(f32(rng.normal(size=(d0, d)))),
             "head": head0 + 0.3 * jnp.asarray(f32(rng.normal(size=(d, v))))}
    phi = {"c": c0 + 0.2 * jnp.asarray(f32(rng.normal(size=(d0, d))))}
    targets = jnp.asarray(rng.integers(0, v, size=(b, s)), jnp.int32)
    mask = jnp.asarray([[1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 0, 0, 0, 0], [0] * 7], jnp.float32)
    adv = jnp.asarray([0.6, -1.0, 0.2])
    beta, margin, lam = 0.7, 0.05, 0.2

    student_h = lambda th: jnp.tanh(x @ th["w"])  # noqa: E731
    latents = lambda ph: z @ ph["c"]  # noqa: E731
    teacher_h = lambda ph: jnp.tanh(x @ w0 + jnp.mean(latents(ph), 0))  # noqa: E731

    def fused(th, ph):
        return L.lopd_objective(
            student_h(th), th["head"], teacher_h(ph), head0, targets, mask, adv, beta,
            latents(ph), z @ c0,
            loss=LossConfig(margin=margin, anchor_weight=lam, composer_kl_weighting=weighting, top_m=m,
                            logits_chunk=3,
                            composer_margin_weighting="token_mean"),  # the rollout-mean margin: test_margin_weighting
        )

    (val, metrics), (g_th, g_ph) = jax.jit(jax.value_and_grad(fused, argnums=(0, 1), has_aux=True))(theta, phi)

    def kl_tok(th, ph):
        return L.topm_tail_reverse_kl(student_h(th) @ th["head"], teacher_h(ph) @ head0, m)

    def delta(th, ph):
        lp = lambda h, w: jnp.take_along_axis(jax.nn.log_softmax(h @ w), targets[..., None], -1)[..., 0]  # noqa: E731
        return L.privilege_delta(lp(teacher_h(ph), head0), lp(student_h(th), th["head"]), mask, adv)[0]

    def composer_ref(ph, agg):
        return agg(kl_tok(theta, ph), mask) - beta * delta(theta, ph) + lam * L.anchor_loss(latents(ph), z @ c0)

    agg = L.rollout_mean if weighting == "rollout_mean" else L.masked_token_mean
    other = L.masked_token_mean if weighting == "rollout_mean" else L.rollout_mean

    @jax.jit
    def references(th, ph):
        ref_th = jax.grad(lambda t_: L.masked_token_mean(kl_tok(t_, ph), mask))(th)
        ref_ph = jax.grad(lambda p_: composer_ref(p_, agg))(ph)
        wrong_ph = jax.grad(lambda p_: composer_ref(p_, other))(ph)
        kl = kl_tok(th, ph)
        scalars = (L.masked_token_mean(kl, mask), agg(kl, mask), delta(th, ph),
                   L.anchor_loss(latents(ph), z @ c0))
        return ref_th, ref_ph, wrong_ph, scalars

    ref_th, ref_ph, wrong_ph, scalars = references(theta, phi)
    kl_mean, kl_agg, big_delta, anchor = map(float, scalars)
    np.testing.assert_allclose(float(val), kl_mean + beta * (margin - big_delta) + lam * anchor, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["delta"]), big_delta, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["distill_kl"]), kl_mean, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["composer_kl"]), kl_agg, rtol=1e-5)
    assert float(metrics["supervised_tokens"]) == 7 and float(metrics["supervised_rollouts"]) == 2
    for k in theta:
        np.testing.assert_allclose(np.asarray(g_th[k]), np.asarray(ref_th[k]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g_ph["c"]), np.asarray(ref_ph["c"]), rtol=1e-4, atol=1e-6)
    # The two weightings give clearly different composer gradients on this mask.
    assert np.abs(np.asarray(wrong_ph["c"]) - np.asarray(ref_ph["c"])).max() > 1e-3


# ---------------------------------------------------------------------------- GRPO pieces


def test_group_advantages_matches_numpy():
    r = f32([[1, 0, 0, 1], [0.5, 0.5, 0.5, 0.5], [0.2, 0.9, 0.4, 0.0]])
    ref = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(L.group_advantages(jnp.asarray(r))), ref, rtol=1e-5, atol=1e-6)
    flat = L.group_advantages(jnp.asarray(r.reshape(-1)), group_size=4)
    np.testing.assert_allclose(np.asarray(flat), ref.reshape(-1), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(flat)[4:8] == 0.0)  # constant group -> zero advantage, no NaN
    ref0 = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(L.group_advantages(jnp.asarray(r), ddof=0)), ref0, rtol=1e-5, atol=1e-6)


def test_ppo_clip_loss_matches_numpy():
    rng = np.random.default_rng(10)
    old = f32(rng.normal(size=(3, 6)) - 2)
    new = old + f32(rng.uniform(-0.6, 0.6, size=(3, 6)))  # ratios inside and outside [0.8, 1.2]
    adv = f32([1.5, -0.7, 0.3])
    mask = np.ones((3, 6), np.float32)
    mask[2, 3:] = 0
    eps = 0.2
    ratio = np.exp(new.astype(np.float64) - old)
    a = adv[:, None]
    unclipped, clipped = ratio * a, np.clip(ratio, 1 - eps, 1 + eps) * a
    per = -np.minimum(unclipped, clipped)
    n = mask.sum()
    ref_val = (per * mask).sum() / n
    ref_grad = np.where(unclipped <= clipped, -ratio * a, 0.0) * mask / n

    val, (g_new, g_old) = jax.value_and_grad(L.ppo_clip_loss, argnums=(0, 1))(
        jnp.asarray(new), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), eps)
    np.testing.assert_allclose(float(val), ref_val, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g_new), ref_grad, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(g_old), 0.0)
    frac = L.ppo_clip_fraction(jnp.asarray(new), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), eps)
    np.testing.assert_allclose(float(frac), ((clipped < unclipped) * mask).sum() / n, rtol=1e-6)
    assert 0.0 < float(frac) < 1.0

"""The fused LM head + weighted NLL (lopd_jax.method.linear_nll) against a NumPy reference, and the
warm-up's two loss paths (fused on one device, chunked when sharded) against each other."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from lopd_jax.method import losses
from lopd_jax.method.linear_nll import weighted_linear_nll
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.method.losses_kl import chunked_token_logp
from models.config import named_config
from models.decoder import Decoder
from models.partitioning import Rules
from lopd_jax.settings.sections import StepConfig
from train import warmup

B, S, D, V = 2, 7, 8, 11


def _case(seed=0):
    rs = np.random.RandomState(seed)
    hidden = rs.randn(B, S, D).astype(np.float32)
    head = (rs.randn(D, V) * 0.7).astype(np.float32)
    targets = rs.randint(0, V, (B, S)).astype(np.int32)
    weights = np.array([[1, 0, 2.5, 1, -1, 1, 0.5], [0, 1, 1, 1, 3, 0, 1]], np.float32)
    return hidden, head, targets, weights


def _numpy_reference(hidden, head, targets, weights):
    """loss, logp, d loss/d hidden, d loss/d head in float64."""
    h, w = hidden.astype(np.float64), head.astype(np.float64)
    logits = h @ w
    m = logits.max(-1, keepdims=True)
    lse = m[..., 0] + np.log(np.exp(logits - m).sum(-1))
    logp = np.take_along_axis(logits, targets[..., None], -1)[..., 0] - lse
    wt = np.where(weights > 0, weights, 0.0).astype(np.float64)
    coef = wt / wt.sum()
    loss = float(np.sum(coef * -logp))
    softmax = np.exp(logits - lse[..., None])
    d_logits = coef[..., None] * (softmax - np.eye(V)[targets])
    return loss, logp, d_logits @ w.T, np.einsum("bsd,bsv->dv", h, d_logits)


@pytest.mark.parametrize("chunk", [3, 7, 64])
def test_loss_logp_and_gradients_match_numpy(chunk):
    hidden, head, targets, weights = _case()
    ref_loss, ref_logp, ref_dh, ref_dw = _numpy_reference(hidden, head, targets, weights)

    def f(h, w):
        loss, logp = weighted_linear_nll(h, w, jnp.asarray(targets), jnp.asarray(weights), chunk_size=chunk)
        return 3.0 * loss, logp  # a non-unit cotangent reaches the saved gradients

    (loss, logp), (dh, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(hidden, head)
    np.testing.assert_allclose(float(loss), 3.0 * ref_loss, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(logp), ref_logp, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dh), 3.0 * ref_dh, atol=1e-5)
    np.testing.assert_allclose(np.asarray(dw), 3.0 * ref_dw, atol=1e-5)
    # Without differentiation only the forward runs; same values.
    loss2, logp2 = jax.jit(f)(hidden, head)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(logp2), np.asarray(logp), atol=1e-6)


def test_logp_output_carries_no_gradient_and_zero_weights_give_zero():
    hidden, head, targets, weights = _case(1)
    g = jax.grad(lambda h: jnp.sum(weighted_linear_nll(h, head, targets, weights)[1]))(hidden)
    assert not np.any(np.asarray(g))
    zero = np.zeros_like(weights)
    loss, dh = jax.value_and_grad(lambda h: weighted_linear_nll(h, head, targets, zero)[0])(hidden)
    assert float(loss) == 0.0 and not np.any(np.asarray(dh))


def test_agrees_with_the_chunked_logp_path_in_bf16():
    hidden, head, targets, weights = _case(2)

    def fused(h, w):
        return weighted_linear_nll(h, w, targets, weights, chunk_size=4, compute_dtype=jnp.bfloat16)[0]

    def chunked(h, w):
        logp = chunked_token_logp(h, w, targets, chunk_size=4, compute_dtype=jnp.bfloat16)
        return losses.weighted_token_mean(-logp, weights)

    a, ga = jax.value_and_grad(fused, argnums=(0, 1))(hidden, head)
    b, gb = jax.value_and_grad(chunked, argnums=(0, 1))(hidden, head)
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    # Autodiff through the bf16 cast rounds the hidden-state gradient to bf16; the fused
    # path keeps it in fp32. They agree to bf16 precision.
    for x, y in zip(ga, gb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=4e-3)


def test_bad_inputs_name_the_problem():
    hidden, head, targets, weights = _case()
    with pytest.raises(ValueError, match="matching D"):
        weighted_linear_nll(hidden, head.T, targets, weights)
    with pytest.raises(ValueError, match="weights"):
        weighted_linear_nll(hidden, head, targets, weights[:, :3])
    with pytest.raises(ValueError, match="targets"):
        weighted_linear_nll(hidden, head, targets.astype(np.float32), weights)
    with pytest.raises(ValueError, match="chunk_size"):
        weighted_linear_nll(hidden, head, targets, weights, chunk_size=0)


def _warmup_system(n_devices):
    cfg = named_config("tiny_qwen3", dtype="float32", param_dtype="float32")
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    mesh = Mesh(np.array(jax.devices()[:n_devices]).reshape(n_devices), ("data",))
    system = SimpleNamespace(rules=Rules(mesh), step_cfg=StepConfig(loss=LossConfig(logits_chunk=5)),
                             model_cfg=cfg, backbone=lambda p, lora: nnx.merge(graphdef, p))
    return system, params, cfg


def test_warmup_loss_is_fused_on_one_device_and_equal_to_the_sharded_path():
    one, params, cfg = _warmup_system(1)
    two, _, _ = _warmup_system(2)
    rs = np.random.RandomState(3)
    tokens = rs.randint(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    batch = {"tokens": tokens, "attention_mask": np.ones_like(tokens),
             "loss_mask": (rs.rand(2, 12) > 0.3).astype(np.float32) * 1.5}

    def run(system):
        fn = lambda p: warmup.sft_loss(system, p, None, batch)  # noqa: E731
        (loss, metrics), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params)
        return loss, metrics, grads, str(jax.make_jaxpr(lambda p: fn(p)[0])(params))

    l1, m1, g1, jaxpr1 = run(one)
    l2, m2, g2, jaxpr2 = run(two)
    assert "custom_vjp" in jaxpr1 and "custom_vjp" not in jaxpr2
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-6)
    np.testing.assert_allclose(float(m1["nll"]), float(m2["nll"]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)

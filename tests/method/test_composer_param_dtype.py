"""``composer.param_dtype``: the compressor in bfloat16 as the release keeps it (its parameters
and AdamW moments), the backbone's dtype by default."""

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from configs.miniature import CONFIG
from lopd_jax.method.composer import make_compressor
from train.system import adamw


def _compressor(param_dtype):
    composer = dataclasses.replace(CONFIG.composer, param_dtype=param_dtype)
    return make_compressor(CONFIG.model_config(), composer, nnx.Rngs(0))


def test_compressor_param_dtype_follows_the_setting_and_the_release_step_rounds_away():
    default = nnx.state(_compressor(None), nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(default)} == {jnp.dtype(CONFIG.model_config().jnp_param_dtype)}
    comp = _compressor("bfloat16")
    params = nnx.state(comp, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    d = CONFIG.model_config().hidden_size
    out = comp(jnp.ones((2, 5, d), jnp.float32), jnp.ones((2, 5), bool))
    assert out.shape[-1] == d and bool(jnp.all(jnp.isfinite(out)))
    # the release's step: AdamW at lr 1e-5 on bfloat16 weights, moments in bfloat16 too
    opt = adamw(1e-5, CONFIG.steps.composer_clip, CONFIG.steps.weight_decay)
    state = opt.init(params)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 1e-3, p.dtype), params)
    upd, state = opt.update(grads, state, params)
    new = optax.apply_updates(params, upd)
    assert {x.dtype for x in jax.tree.leaves(new)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(state[1][0].mu)} == {jnp.dtype(jnp.bfloat16)}
    big = [p for p in jax.tree.leaves(params) if p.size > 1000]
    unchanged = sum(int(jnp.sum(n == p)) for n, p in zip([x for x in jax.tree.leaves(new) if x.size > 1000], big))
    assert unchanged > 0.5 * sum(p.size for p in big)  # most updates of lr 1e-5 round away in bfloat16

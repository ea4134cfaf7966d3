"""benchmarks/composer_precision.py: AdamW at the paper's composer lr moves float32 weights
by what it asks and rounds most bfloat16 updates away."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import composer_precision


def test_bfloat16_rounds_away_most_updates_at_the_paper_lr():
    k1, k2 = jax.random.split(jax.random.key(0))
    phi = {"compressor": {"w": 0.05 * jax.random.normal(k1, (64, 64))},
           "lora": {"a": 0.05 * jax.random.normal(k2, (64, 8))}}
    f32 = composer_precision.measure(phi, 1e-5, 3, jnp.float32)
    bf16 = composer_precision.measure(phi, 1e-5, 3, jnp.bfloat16)
    for r in f32:  # float32 applies what AdamW asks (about lr per element: 1e-5 / 0.05 of each weight)
        assert r["applied"] == pytest.approx(r["asked"], rel=1e-3) and r["rounded_away"] < 0.01
        assert 5e-5 < r["asked"] < 5e-4
    for r in bf16:  # bfloat16's spacing near 0.05 is 2.4e-4: only the smallest weights move
        assert r["rounded_away"] > 0.8 and r["applied"] < 0.5 * r["asked"]
    big = composer_precision.measure(phi, 1e-2, 1, jnp.bfloat16)[0]  # at lr 1e-2 every update lands
    assert big["rounded_away"] < 0.05

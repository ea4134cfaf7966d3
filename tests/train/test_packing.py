"""Packed training steps equal the padded steps on the same trajectories: LOPD (latents
spliced per segment, top-M, margin with beta != 0, anchor with phi != phi0), GRPO (groups
across segments and rows), the text-distillation step (a context block per segment), the
composer cold start and the warm-up; on one device and LOPD on a 2 x 4 mesh. The plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lopd_jax.planning.length_model import sample_lengths
from lopd_jax.planning.pack_plan import packed_real_fraction, plan_packed_passes
from lopd_jax.settings.length_config import LengthConfig
from tests.train.test_length_buckets import (B, COMPOSER, LAYOUT, LENGTHS, S, _backbone, _batch, _check_lopd, _close_trees,
                                 grpo_batch, lopd)  # noqa: F401  (lopd: the padded LOPD step's fixture)
from tests.train.test_length_buckets_text import EMA_DECAY, _check_metrics, _text_distill_inputs
from tests.train.test_length_buckets_warmup import _pass_sums, padded  # noqa: F401  (padded: a fixture)
from train import mesh as mesh_lib
from train.bucketed_steps import (BucketedColdStartStep, BucketedGRPOStep, BucketedLOPDStep, BucketedTextStep,
                                  with_group_advantages)
from train.packed_batches import packed_batch
from train.steps import cold_start_loss, grpo_loss
from train.system import LOPDSystem
from train.text_steps import text_distill_loss
from lopd_jax.method.loss_config import LossConfig
from lopd_jax.settings.sections import MeshConfig, StepConfig

ROW = (S,)  # packed rows of the cap (32 tokens)
SHARD_TOKENS = 2 * S  # two packed rows per shard and pass


def _pack(np_batch, shards=1, splice=LAYOUT):
    pb = packed_batch(np_batch, ROW, SHARD_TOKENS, shards, splice)
    members = sorted(i for p in pb.plan for r in p.rows for i in r)
    assert members == list(range(B))  # every trajectory once, whole
    assert any(len(r) > 1 for p in pb.plan for r in p.rows)  # rows really hold several
    assert pb.padded_tokens() < B * S
    return pb


# ----------------------------------------------------------------------------- the plan


def test_plan_packs_whole_trajectories_balanced_over_shards():
    lengths = sample_lengths(LengthConfig(), 64, 4096, seed=3, scale=0.1)
    buckets = (512, 1024, 2048, 4096)
    plan = plan_packed_passes(lengths, buckets, 8192, 4)
    assert sorted(i for p in plan for r in p.rows for i in r) == list(range(64))
    for p in plan:
        assert len(p.rows) % 4 == 0 and p.seq * len(p.rows) // 4 <= 8192
        assert all(sum(lengths[i] for i in r) <= p.seq for r in p.rows)
        assert p.segments >= max(len(r) for r in p.rows) and p.segments & (p.segments - 1) == 0
        per_shard = np.asarray([sum(lengths[i] for r in p.rows[s::4] for i in r) for s in range(4)])
        assert per_shard.max() - per_shard.min() <= max(lengths)  # tokens balanced over the shards
    assert plan_packed_passes(lengths, buckets, 8192, 4) == plan  # deterministic
    assert packed_real_fraction(plan, lengths) > 0.8
    with pytest.raises(ValueError, match="exceeds"):
        plan_packed_passes([5000], buckets, 4096, 1)


def test_packed_rows_layout():
    """Tokens, segment ids, the unpack index and the teacher rows of a packed pass."""
    np_batch = _batch()
    pb = _pack(np_batch)
    mb = pb.passes[0]
    assert "insert_at" not in mb  # the teacher rows hold each segment's block already
    for r, members in enumerate(pb.plan[0].rows):
        off = 0
        for k, i in enumerate(members):
            n = LENGTHS[i]
            np.testing.assert_array_equal(mb["tokens"][r, off:off + n], np_batch["tokens"][i, :n])
            assert (mb["segment_ids"][r, off:off + n] == k + 1).all() and mb["loss_mask"][r, off] == 0
            np.testing.assert_array_equal(mb["unpack_index"][r, k, :n], np.arange(off, off + n))
            assert mb["row_index"][r, k] == i
            # the teacher sees this segment's block at its own insertion point
            t = mb["teacher_tokens"][r][mb["teacher_align"][r, off:off + n]]
            np.testing.assert_array_equal(t, np_batch["tokens"][i, :n])
            off += n
        assert (mb["segment_ids"][r, off:] == 0).all()
    assert mb["exp_tokens"].shape[:2] == mb["row_index"].shape


# ----------------------------------------------------------------------------- LOPD


def test_packed_lopd_equals_padded(lopd):  # noqa: F811
    system, state, frozen, np_batch, want_g, want_m = lopd
    pb = _pack(np_batch)
    step = BucketedLOPDStep(system, state)
    _check_lopd(step.accumulate(state, frozen, pb.put(system)), want_g, want_m, system.step_cfg.loss.margin)


def test_packed_lopd_on_a_2x4_mesh_equals_padded(lopd):  # noqa: F811
    """8 batch shards (data 2 x fsdp 4): every pass a multiple of 8 packed rows."""
    system1, state, frozen, np_batch, want_g, want_m = lopd
    mesh = mesh_lib.make_mesh(MeshConfig(data=2, fsdp=4, tensor=1), jax.devices()[:8])
    system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, system1.step_cfg, rules=mesh_lib.rules_for(mesh))
    pb = packed_batch(np_batch, ROW, SHARD_TOKENS, 8, LAYOUT)
    assert all(len(p.rows) % 8 == 0 for p in pb.plan)
    s = mesh_lib.put(state, system.state_shardings(state))
    f = mesh_lib.put(frozen, system.frozen_shardings())
    acc = BucketedLOPDStep(system, s).accumulate(s, f, pb.put(system))
    _check_lopd(jax.device_get(acc), want_g, want_m, system.step_cfg.loss.margin)


def test_packed_lopd_with_tensor_parallelism_equals_padded(lopd):  # noqa: F811
    """The paper configs' layout in small: fsdp 2 x tensor 2 (heads, MLP columns and the
    vocabulary split; 2 batch shards, so each holds several trajectories per packed row)."""
    system1, state, frozen, np_batch, want_g, want_m = lopd
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), jax.devices()[:4])
    system = LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, system1.step_cfg, rules=mesh_lib.rules_for(mesh))
    assert system.batch_shards(8) == 2
    pb = packed_batch(np_batch, ROW, SHARD_TOKENS, 2, LAYOUT)
    assert max(len(set(int(x) for x in r[r > 0])) for p in pb.passes for r in np.asarray(p["segment_ids"])) > 1
    s = mesh_lib.put(state, system.state_shardings(state))
    f = mesh_lib.put(frozen, system.frozen_shardings())
    acc = BucketedLOPDStep(system, s).accumulate(s, f, pb.put(system))
    _check_lopd(jax.device_get(acc), want_g, want_m, system.step_cfg.loss.margin)


# ----------------------------------------------------------------------------- other steps


@pytest.fixture(scope="module")
def system():
    return LOPDSystem.create(_backbone(), COMPOSER, LAYOUT, StepConfig(loss=LossConfig(logits_chunk=8, top_m=5)))


def test_packed_grpo_equals_padded(system):
    state, frozen = system.init_state()
    np_batch = grpo_batch()
    batch = {k: jnp.asarray(v) for k, v in np_batch.items()}
    (_, want_m), want_g = jax.jit(jax.value_and_grad(
        lambda sp: grpo_loss(system, sp, state, frozen, batch, 4), has_aux=True))(state["student"])
    pb = _pack(with_group_advantages(np_batch, 4), splice=None)
    acc = BucketedGRPOStep(system, state, group_size=4).accumulate(state, frozen, pb.put(system))
    got = dict(acc["metrics"])
    got["ratio_max_dev"] = got.pop("ratio_max_dev_max")
    for k in want_m:
        np.testing.assert_allclose(got[k], want_m[k], rtol=1e-5, atol=1e-7, err_msg=k)
    _close_trees(acc["grads"][0], want_g)


def test_packed_text_distill_equals_padded(system):
    """SDFT's form (an EMA teacher), a context block of its own length per segment, a row
    left out (``row_weight`` 0), a row without supervised tokens."""
    state, frozen, np_batch, batch = _text_distill_inputs(system, _batch(1))
    (_, want_m), want_g = jax.jit(jax.value_and_grad(
        lambda sp: text_distill_loss(system, sp, state, frozen, batch, True), has_aux=True))(state["student"])
    pb = _pack(np_batch, splice=None)
    assert "teacher_slot" not in pb.passes[0] and pb.passes[0]["teacher_tokens"].shape[1] > S
    acc = BucketedTextStep(system, state, EMA_DECAY).accumulate(state, frozen, pb.put(system))
    _check_metrics(acc["metrics"], want_m)
    _close_trees(acc["grads"][0], want_g)


def test_packed_cold_start_equals_padded(system):
    state = system.init_cold_start_state(seed=3)
    frozen = system.initial_params()[0]
    np_batch = {k: v for k, v in _batch(4).items() if k != "rewards"}
    batch = {k: jnp.asarray(v) for k, v in np_batch.items()}
    _, sub = jax.random.split(state["rng"])
    (_, want_m), want_g = jax.jit(jax.value_and_grad(
        lambda cp: cold_start_loss(system, cp, frozen, batch, sub), has_aux=True))(state["composer"])
    acc = BucketedColdStartStep(system, state).accumulate(state, frozen, _pack(np_batch).put(system))
    _check_metrics(acc["metrics"], want_m)
    _close_trees(acc["grads"][0], want_g)


def test_packed_warmup_equals_padded(padded):
    system, params, lora0, np_batch, want_loss, _, want_g = padded
    loss, grads = _pass_sums(system, params, lora0, _pack(np_batch, splice=None))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    _close_trees(grads, want_g)

"""Orbax checkpoints: bitwise round trip, resharding onto another mesh, keep-last-k,
metadata, crash safety, preemption flag."""

import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from train.checkpoint import (Checkpointer, CheckpointError, abstract_tree, clear_preemption,
                              install_preemption_handler, preemption_agreed, preemption_requested)
from lopd_jax.settings.sections import MeshConfig
from train.mesh import make_mesh

pytestmark = pytest.mark.timeout(60)


def _state(mesh, seed=0):
    """A small pytree shaped like the LOPD state: params, optax states, PRNG keys, scalars.

    Built on one device, then placed: 2-D leaves over (fsdp, tensor), the rest replicated.
    """
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    params = {"embed": jax.random.normal(k[0], (16, 8)),
              "layers": {"w": jax.random.normal(k[1], (8, 8), jnp.bfloat16),
                         "b": jnp.arange(8, dtype=jnp.float32)}}
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt_state = opt.init(params)
    _, opt_state = opt.update(jax.tree.map(jnp.ones_like, params), opt_state, params)  # non-trivial mu / nu
    state = {"step": jnp.asarray(7, jnp.int32), "beta": jnp.asarray(0.25, jnp.float32),
             "rng": jax.random.PRNGKey(seed + 1), "key": jax.random.key(seed + 2),
             "student": params, "student_opt": opt_state}
    w2, rep = NamedSharding(mesh, P("fsdp", "tensor")), NamedSharding(mesh, P())
    return jax.tree.map(lambda x: jax.device_put(x, w2 if x.ndim == 2 else rep), state)


def _assert_bitwise(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip_reshard_and_metadata(tmp_path):
    mesh8 = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    state = _state(mesh8)
    host_copy = jax.device_get(jax.tree.map(
        lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x, state))
    meta = {"stage": "lopd", "step": 7, "data": {"next_index": 3}, "grain": b"\x00\xffstate",
            "bank": "gs://b/bank", "np": np.int64(5), "pair": (1, 2.5)}
    ck = Checkpointer(tmp_path / "ck", every_steps=5, keep=3, async_save=True)
    assert ck.latest_step() is None
    assert not ck.save(7, state, meta)           # not a multiple of every_steps
    assert ck.save(7, state, meta, force=True)
    # the device-to-host copy is done when save returns: deleting the buffers is safe
    for leaf in jax.tree.leaves(state["student"]):
        leaf.delete()
    ck.wait()
    assert ck.latest_step() == 7

    # restore onto a different mesh: fsdp=4 x tensor=2
    mesh42 = make_mesh(MeshConfig(data=1, fsdp=4, tensor=2))
    target = _state(mesh42, seed=9)
    abstract = abstract_tree(target)
    restored, meta2 = Checkpointer(tmp_path / "ck").restore(7, abstract)
    assert meta2 == {"stage": "lopd", "step": 7, "data": {"next_index": 3}, "grain": b"\x00\xffstate",
                     "bank": "gs://b/bank", "np": 5, "pair": [1, 2.5]}
    assert restored["student"]["embed"].sharding.spec == P("fsdp", "tensor")
    assert restored["student"]["embed"].sharding.mesh.shape == mesh42.shape
    assert isinstance(restored["student_opt"][1][0], optax.ScaleByAdamState)
    assert jnp.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    as_data = jax.tree.map(lambda x: jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x,
                           restored)
    _assert_bitwise(jax.device_get(as_data), host_copy)
    assert Checkpointer(tmp_path / "ck").read_metadata()["grain"] == b"\x00\xffstate"
    ck.close()


def test_keep_last_k_and_existing_step(tmp_path):
    mesh = make_mesh(MeshConfig(fsdp=8))
    state = {"x": jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("fsdp"))), "n": jnp.int32(0)}
    with Checkpointer(tmp_path, every_steps=2, keep=2, async_save=False) as ck:
        for step in range(1, 9):
            state = {"x": state["x"] + 1, "n": jnp.int32(step)}
            ck.save(step, state, {"step": step})
        assert not ck.save(8, state, force=True)  # already saved: not rewritten
        assert ck.all_steps() == [6, 8]
        assert not ck.should_save(8) and ck.should_save(10) and not ck.should_save(9)
        restored, meta = ck.restore(abstract_state=abstract_tree(state))
    assert meta == {"step": 8} and int(restored["n"]) == 8
    np.testing.assert_array_equal(np.asarray(restored["x"]), np.arange(16.0) + 8)
    with pytest.raises(CheckpointError, match="available"):
        Checkpointer(tmp_path).restore(4, abstract_tree(state))


def test_partial_step_is_not_picked_up(tmp_path):
    d = tmp_path / "ck"
    state = {"x": jnp.arange(4.0)}
    with Checkpointer(d, async_save=False) as ck:
        ck.save(1, state, {"stage": "a"})
    # a crash mid-save leaves orbax's temporary directory (as seen after os._exit during an async save) ...
    shutil.copytree(d / "1", d / "2.orbax-checkpoint-tmp")
    # ... and a step directory whose items never arrived (e.g. on a store without rename)
    (d / "3").mkdir()
    (d / "3" / "state").mkdir()
    ck = Checkpointer(d, async_save=False)
    assert ck.latest_step() == 1 and ck.all_steps() == [1]
    _, meta = ck.restore(None, abstract_tree(state))
    assert meta == {"stage": "a"}
    assert ck.save(2, {"x": jnp.arange(4.0) * 2}, {"stage": "b"}, force=True)  # the step can be redone
    ck.wait()
    assert ck.latest_step() == 2
    assert not (d / "2.orbax-checkpoint-tmp").exists()  # stale temp dir cleaned up
    ck.close()


def test_empty_directory_and_bad_metadata(tmp_path):
    ck = Checkpointer(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        ck.restore()
    with pytest.raises(TypeError, match=r"metadata\.arr"):
        ck.save(0, {"x": jnp.zeros(2)}, {"arr": np.zeros(3)})
    ck.close()


def test_preemption_flag():
    clear_preemption()
    before = signal.getsignal(signal.SIGTERM)
    restore = install_preemption_handler()
    try:
        assert not preemption_requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption_requested() and preemption_agreed()
    finally:
        restore()
        clear_preemption()
    assert signal.getsignal(signal.SIGTERM) is before and not preemption_requested()

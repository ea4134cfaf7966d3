"""Paged attention (models/paged_attention.py) against dense attention, for decode and for
mixed prefill + decode rows, with and without a sliding window; JAX's TPU kernels against
the same pool: the decode kernel ``paged_attention`` run in TPU interpret mode, the ragged
kernel's own reference (its interpreter run fails in JAX 0.10.2, see docs/engine.md), and
both kernels AOT-compiled for a v5p topology, bare and as the dispatched attention of the
paged decoder step on an inference mesh (data x tensor)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from models.attention import plain_attention
from models.config import named_config
from models.decoder import Decoder
from models.paged_attention import (attend, combine_kv, paged_attention, ragged_kernel_attention, resolve_backend,
                                    write_kv)
from models.layer import layer_weights
from lopd_jax.rollout.paged_step import empty_pools, paged_forward, paged_forward_scan
from tests.paths import ROOT

B, KV, G, hd, PS, NP, PPS = 3, 2, 2, 16, 4, 24, 6
LENS = np.asarray([9, 3, 17])  # tokens per row after the call


def _setup(q_lens, seed=0, bf16_values=False):
    """A random history per row written into shuffled pages, and row-padded queries for
    the last ``q_lens[b]`` tokens of each row. Returns the pool, table, dense k / v, q, q_pos.
    ``bf16_values``: keys / values rounded to bfloat16 (still stored in float32)."""
    rs = np.random.RandomState(seed)
    T = PPS * PS
    k = rs.randn(B, T, KV, hd).astype(np.float32)
    v = rs.randn(B, T, KV, hd).astype(np.float32)
    if bf16_values:
        k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (k, v))
    table = rs.permutation(NP)[:B * PPS].reshape(B, PPS).astype(np.int32)
    pool = jnp.zeros((NP, PS, 2 * KV, hd), jnp.float32)
    pos = np.broadcast_to(np.arange(T), (B, T))
    pool = write_kv(pool, jnp.asarray(k), jnp.asarray(v), jnp.asarray(table), jnp.asarray(pos),
                    jnp.asarray(pos < LENS[:, None]))
    S = max(q_lens)
    q = rs.randn(B, S, KV, G, hd).astype(np.float32)
    q_pos = (LENS - np.asarray(q_lens))[:, None] + np.arange(S)[None]
    return pool, table, k, v, q, q_pos


@pytest.mark.parametrize("q_lens", [(1, 1, 1), (4, 1, 3)], ids=["decode", "mixed"])
@pytest.mark.parametrize("window", [0, 3])
def test_paged_attention_equals_dense(q_lens, window):
    pool, table, k, v, q, q_pos = _setup(q_lens)
    T = k.shape[1]
    k_pos = np.broadcast_to(np.arange(T), (B, T))
    dense = plain_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_pos), jnp.asarray(k_pos),
                            jnp.asarray(k_pos < LENS[:, None]), window, 0.25)
    for n in (PPS, 5):  # the whole table, or just the pages the longest row uses
        out = paged_attention(jnp.asarray(q), pool, jnp.asarray(table), jnp.asarray(LENS), jnp.asarray(q_pos),
                              window, 0.25, num_pages=n)
        valid = np.arange(q.shape[1])[None] < np.asarray(q_lens)[:, None]
        np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(dense)[valid], atol=1e-5)
    # the pool really holds each row's keys in its own pages (a wrong table changes the result)
    bad = paged_attention(jnp.asarray(q), pool, jnp.asarray(table[::-1]), jnp.asarray(LENS), jnp.asarray(q_pos),
                          window, 0.25)
    assert not np.allclose(np.asarray(bad), np.asarray(dense), atol=1e-3)


def test_combine_kv_interleaves_as_the_ragged_kernel_reads():
    k, v = jnp.ones((2, 3, 4)), 2 * jnp.ones((2, 3, 4))
    kv = combine_kv(k, v)
    assert kv.shape == (2, 6, 4) and (kv[:, 0::2] == 1).all() and (kv[:, 1::2] == 2).all()


def test_ragged_kernel_reference_equals_paged_path():
    """The ragged kernel's contract (its reference implementation: packed queries, pages of
    interleaved k / v, ``cu_q_lens``, ``sliding_window``) gives our path's values."""
    q_lens = np.asarray([4, 1, 3])
    pool, table, _, _, q, q_pos = _setup(tuple(q_lens), seed=1)
    ours = paged_attention(jnp.asarray(q), pool, jnp.asarray(table), jnp.asarray(LENS), jnp.asarray(q_pos), 3, 0.25)
    packed = np.concatenate([q[b, :q_lens[b]] for b in range(B)]).reshape(-1, KV * G, hd)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    ref = ref_ragged_paged_attention(jnp.asarray(packed), pool, jnp.asarray(LENS, jnp.int32), jnp.asarray(table),
                                     jnp.asarray(cu), jnp.asarray([B], jnp.int32), sm_scale=0.25, sliding_window=3)
    ours_packed = np.concatenate([np.asarray(ours)[b, :q_lens[b]] for b in range(B)]).reshape(-1, KV * G, hd)
    np.testing.assert_allclose(ours_packed, np.asarray(ref), atol=1e-5)
    # the engine's wrapper packs row-padded queries for the kernel and unpacks its output
    wrapped = ragged_kernel_attention(jnp.asarray(q), pool, jnp.asarray(table), jnp.asarray(LENS),
                                      jnp.asarray(q_lens), 3, 0.25, kernel=ref_ragged_paged_attention)
    valid = np.arange(q.shape[1])[None] < q_lens[:, None]
    np.testing.assert_allclose(np.asarray(wrapped)[valid], np.asarray(ours)[valid], atol=1e-5)
    assert (np.asarray(wrapped)[~valid] == 0).all()


def _jax_kernel(q, pool, kv_lens, table, cu, num_seqs, *, sm_scale, sliding_window):
    """The ragged kernel's contract (packed queries, ``cu_q_lens``) in jittable JAX: a
    stand-in that lets the kernel path's plumbing (packing, ``shard_map``, local page ids)
    run under jit on CPU, where the reference's Python loop over rows cannot."""
    B = table.shape[0]
    n = q.shape[0]
    row = jnp.clip(jnp.searchsorted(cu, jnp.arange(n), side="right") - 1, 0, B - 1)
    q_pos = kv_lens[row] - (cu[row + 1] - jnp.arange(n))
    KV = pool.shape[2] // 2
    qr = q.reshape(n, 1, KV, -1, q.shape[-1])
    return paged_attention(qr, pool, table[row], kv_lens[row], q_pos[:, None], sliding_window or 0,
                           sm_scale).reshape(q.shape)


def _forward_case(name="tiny_olmo3", ps=4, pages_per_row=8):
    """A tiny model (2 Olmo-3 layers: sliding window 8, full), a history of 3 rows prefilled through the XLA path, and a mixed next
    call (row 0: 3 new tokens, row 1: decode, row 2: idle). Page ids are a permutation in
    which row ``b`` owns pages of the ``b``-th quarter of the pool (what a data-sharded
    kernel path needs). Returns ``(model, layers, pools, table, call)``."""
    cfg = named_config(name)
    cfg = cfg.replace(num_layers=2, layer_types=("sliding_attention", "full_attention"))  # one of each window
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    layers = layer_weights(model, False)
    rows, NPG = 4, 4 * pages_per_row
    rs = np.random.RandomState(0)
    table = np.stack([b * pages_per_row + rs.permutation(pages_per_row) for b in range(rows)]).astype(np.int32)
    pools = empty_pools(cfg, NPG, ps, jnp.float32)
    hist = np.asarray([13, 6, 9, 0])
    T = int(hist.max())
    ids = rs.randint(1, cfg.vocab_size, (rows, T)).astype(np.int32)
    pos = np.broadcast_to(np.arange(T), (rows, T)).astype(np.int32)
    _, pools = jax.jit(lambda pools: paged_forward(  # jitted: eager dispatch of every op is slow here
        model, layers, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(pos < hist[:, None]), jnp.asarray(hist),
        pools, jnp.asarray(table), pages_per_row, backend="xla"))(pools)
    n = np.asarray([3, 1, 0, 0])
    S = 3
    ids2 = rs.randint(1, cfg.vocab_size, (rows, S)).astype(np.int32)
    pos2 = (hist[:, None] + np.arange(S)[None]).astype(np.int32)
    call = (jnp.asarray(ids2), jnp.asarray(pos2), jnp.asarray(np.arange(S)[None] < n[:, None]),
            jnp.asarray(hist + n))
    return model, layers, pools, table, call, n


def test_dispatch_resolves_by_platform_and_head_dim():
    assert resolve_backend("auto") == "xla" and resolve_backend("auto", head_dim=128) == "xla"  # CPU here
    assert resolve_backend("kernel") == "kernel" and resolve_backend("xla") == "xla"
    with pytest.raises(ValueError, match="backend 'splash' is not one of"):
        resolve_backend("splash")
    # the real kernel needs head_dim % 128 == 0; forcing it on another is refused before tracing it
    pool, table, k, v, q, q_pos = _setup((1, 1, 1))
    with pytest.raises(ValueError, match="head_dim a multiple of 128.*got 16"):
        attend(jnp.asarray(q), jnp.asarray(k[:, :1]), jnp.asarray(v[:, :1]), pool, jnp.asarray(table),
               jnp.asarray(q_pos), jnp.ones((B, 1), bool), jnp.asarray(LENS), 0, 0.25, PPS, backend="kernel")


def test_kernel_path_of_the_paged_decoder_equals_the_xla_path():
    """The decoder step with attention dispatched to the kernel path (here the kernel's own
    reference, eagerly: it needs concrete lengths), Olmo-3's sliding window through the
    kernel's ``sliding_window``, equals the pure-JAX path on the rows' real tokens, and
    both write the same pages (to fp32 rounding)."""
    model, layers, pools, table, (ids, pos, valid, lens), n = _forward_case()
    args = (model, layers, ids, pos, valid, lens)
    h_x, p_x = jax.jit(lambda pools: paged_forward(*args, pools, jnp.asarray(table), 8, backend="xla"))(pools)
    h_k, p_k = paged_forward(*args, pools, jnp.asarray(table), 8, backend="kernel", kernel=ref_ragged_paged_attention)
    v = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(h_k)[v], np.asarray(h_x)[v], atol=1e-5)
    for a, b in zip(p_k, p_x):  # later layers' keys carry the earlier layers' rounding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_kernel_path_under_shard_map_on_an_inference_mesh():
    """On a data 2 x tensor 2 mesh the kernel path runs per shard (rows and pages over
    data, KV heads over tensor, global page ids shifted to the shard's own) inside one jit;
    with a jittable stand-in for the kernel it equals the XLA path."""
    model, layers, pools, table, (ids, pos, valid, lens), n = _forward_case()
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    pool_sh = NamedSharding(mesh, P("data", None, "tensor", None))
    pools_s = tuple(jax.device_put(p, pool_sh) for p in pools)

    @jax.jit
    def run(pools, table, ids, pos, valid, lens):
        return paged_forward(model, layers, ids, pos, valid, lens, pools, table, 8, backend="kernel", mesh=mesh,
                             kernel=_jax_kernel)

    h_k, p_k = run(pools_s, jnp.asarray(table), ids, pos, valid, lens)
    h_x, p_x = paged_forward(model, layers, ids, pos, valid, lens, pools, jnp.asarray(table), 8, backend="xla")
    v = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(h_k)[v], np.asarray(h_x)[v], atol=1e-5)
    for a, b in zip(p_k, p_x):  # later layers' keys carry the earlier layers' rounding
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_scanned_decoder_on_stacked_pools_equals_the_unrolled_one():
    """The scan over layers on one stacked pool (each layer's pages through a flat view,
    windows 8 and 0 chosen per layer) equals the unrolled forward: on the
    XLA path, and on the kernel path under shard_map (data 2 x tensor 2) with the stand-in."""
    model, layers, pools, table, (ids, pos, valid, lens), n = _forward_case()
    h_x, p_x = paged_forward(model, layers, ids, pos, valid, lens, pools, jnp.asarray(table), 8, backend="xla")
    want = np.stack([np.asarray(p) for p in p_x])
    v = np.asarray(valid)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    stacked = jnp.stack(pools)
    sharded = jax.device_put(stacked, NamedSharding(mesh, P(None, "data", None, "tensor", None)))
    for pool, kw in ((stacked, {"backend": "xla"}), (sharded, {"backend": "kernel", "mesh": mesh,
                                                              "kernel": _jax_kernel})):
        h, p = jax.jit(lambda st: paged_forward_scan(model, ids, pos, valid, lens, st, jnp.asarray(table), 8,
                                                     **kw))(pool)
        np.testing.assert_allclose(np.asarray(h)[v], np.asarray(h_x)[v], atol=1e-5)
        np.testing.assert_allclose(np.asarray(p), want, atol=1e-5)


def test_tpu_decode_kernel_in_interpret_mode_equals_paged_path():
    """The decode kernel reads keys / values as bfloat16 (its ``_maybe_dequantize`` casts
    unquantized pages to bf16; the engine's pool is bf16 on TPU), so the values here are
    bf16-representable; then it equals the pure-JAX path to fp32 rounding."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged_attention

    pool, table, _, _, q, q_pos = _setup((1, 1, 1), seed=2, bf16_values=True)
    ours = paged_attention(jnp.asarray(q), pool, jnp.asarray(table), jnp.asarray(LENS), jnp.asarray(q_pos), 0, 0.25)
    k_pages = pool[:, :, 0::2].transpose(2, 0, 1, 3)  # [KV, pages, page_size, hd]
    v_pages = pool[:, :, 1::2].transpose(2, 0, 1, 3)
    with pltpu.force_tpu_interpret_mode():
        out = tpu_paged_attention(jnp.asarray(q[:, 0].reshape(B, KV * G, hd)) * 0.25, k_pages, v_pages,
                                  jnp.asarray(LENS, jnp.int32), jnp.asarray(table), pages_per_compute_block=2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ours)[:, 0].reshape(B, KV * G, hd), atol=1e-5)


AOT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    from lopd_jax.programs.compile_check import topology_devices
    from models.paged_attention import ragged_kernel_attention
    devs, _, _ = topology_devices("v5p-8")
    mesh = Mesh(np.asarray(devs), ("data",))
    n, KV, G, hd, ps, pps = len(devs), 8, 4, 128, 64, 16
    B, NP = 8 * n, 256 * n
    spec = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(mesh, P("data")))
    def ragged(q, pool, table, lens, qlens):  # mixed prefill + decode, Olmo-3's window
        return ragged_kernel_attention(q, pool, table, lens, qlens, 4096, 0.088, num_kv_pages_per_block=8,
                                       num_queries_per_block=16)
    def decode(q, k, v, lens, table):
        return paged_attention(q, k, v, lens, table, pages_per_compute_block=4)
    sm = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))
    d = P("data")
    c1 = sm(ragged, (d,) * 5, d).lower(
        spec((B, 4, KV, G, hd), jnp.bfloat16), spec((NP, ps, 2 * KV, hd), jnp.bfloat16), spec((B, pps), jnp.int32),
        spec((B,), jnp.int32), spec((B,), jnp.int32)).compile()
    kv = jax.ShapeDtypeStruct((KV, NP, ps, hd), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "data")))
    c2 = sm(decode, (d, P(None, "data"), P(None, "data"), d, d), d).lower(
        spec((B, KV * G, hd), jnp.bfloat16), kv, kv, spec((B,), jnp.int32), spec((B, pps), jnp.int32)).compile()
    for c in (c1, c2):
        assert "tpu_custom_call" in c.as_text(), "no Mosaic kernel in the compiled program"
    print("AOT OK", c1.memory_analysis().temp_size_in_bytes, c2.memory_analysis().temp_size_in_bytes)

    # the paged decoder step (2 Olmo-3 layers: sliding + full) with attention dispatched by
    # the mesh's platform, on an inference mesh data 2 x tensor 2
    from flax import nnx
    from jax.sharding import AxisType
    from models.config import named_config
    from models.decoder import Decoder
    from models.layer import layer_weights
    from lopd_jax.rollout.paged_step import paged_forward
    cfg = named_config("olmo3_7b", dtype="bfloat16", param_dtype="bfloat16")
    cfg = cfg.replace(num_layers=2, layer_types=("sliding_attention", "full_attention"))
    m2 = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=devs)
    gd, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    rep = NamedSharding(m2, P())
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), state)
    rows, W, pages = 8, 4, 64
    pool = jax.ShapeDtypeStruct((pages, 64, 2 * cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16,
                                sharding=NamedSharding(m2, P("data", None, "tensor", None)))
    r = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=NamedSharding(m2, P("data")))
    def step(params, pools, ids, pos, valid, lens, table):
        m = nnx.merge(gd, params)
        return paged_forward(m, layer_weights(m, False), ids, pos, valid, lens, pools, table, W, mesh=m2)
    c3 = jax.jit(step, donate_argnums=(1,)).lower(params, (pool, pool), r((rows, 1), jnp.int32),
                                                   r((rows, 1), jnp.int32), r((rows, 1), jnp.bool_),
                                                   r((rows,), jnp.int32), r((rows, W), jnp.int32)).compile()
    n = c3.as_text().count('custom_call_target="tpu_custom_call"')
    assert n >= 2, f"{n} Mosaic kernels in the paged decoder step, expected one per layer"
    # the scan over layers on stacked pools: one layer body, a kernel per window (switch)
    from lopd_jax.rollout.paged_step import paged_forward_scan
    stacked = jax.ShapeDtypeStruct((2, pages, 64, 2 * cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16,
                                   sharding=NamedSharding(m2, P(None, "data", None, "tensor", None)))
    def scan_step(params, pools, ids, pos, valid, lens, table):
        return paged_forward_scan(nnx.merge(gd, params), ids, pos, valid, lens, pools, table, W, mesh=m2)
    c4 = jax.jit(scan_step, donate_argnums=(1,)).lower(params, stacked, r((rows, 1), jnp.int32),
                                                       r((rows, 1), jnp.int32), r((rows, 1), jnp.bool_),
                                                       r((rows,), jnp.int32), r((rows, W), jnp.int32)).compile()
    n4 = c4.as_text().count('custom_call_target="tpu_custom_call"')
    assert n4 == 2, f"{n4} Mosaic kernels in the scanned step, expected 2 (sliding and full)"
    print("AOT decoder step OK", n, n4)
""")


@pytest.mark.process
def test_tpu_kernels_aot_compile_for_v5p():
    pytest.importorskip("libtpu")
    root = ROOT
    env = {**os.environ, "PYTHONPATH": root, "JAX_PLATFORMS": ""}
    r = subprocess.run([sys.executable, "-c", AOT], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "AOT decoder step OK" in r.stdout, r.stderr[-3000:]

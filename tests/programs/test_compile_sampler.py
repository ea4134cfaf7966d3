"""python -m lopd_jax.compile_sampler: sizes the engine from the run config (slots, the page
pool from the simulated live tokens), compiles one process's engine decode call on its
inference layout (as :class:`lopd_jax.rollout.engine.Engine` builds it from the ``engine`` section)
and the reshard, and reports memory and the roofline. On a CPU topology (tiny config with
``engine.devices=0``: a 4 x 2 mesh; about 10 s per compile, unrolled and scanned layers)
and, with libtpu, for v5p-8 with the TPU kernel in the step (1 qwen3_8b layer, 8 slots;
on a TPU topology the reshard's device order matters)."""

import json
import os
import subprocess
import sys

import pytest

from lopd_jax.programs import compile_sampler
from configs import load_config
from models.config import named_config
from lopd_jax.planning.engine_schedule import pool_pages
from tests.paths import ROOT


def test_tiny_on_cpu_sizes_and_compiles_the_engine(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = compile_sampler.main(["--config=tiny", "--topology=cpu:8", "--episodes_per_slot=4", f"--json={out}",
                               "engine.devices=0", "engine.tensor=0"])
    assert rc == 0
    r = json.loads(out.read_text())
    cfg = load_config("tiny")
    s = r["sizing"]
    assert s["slots"] == cfg.engine.slots and s["in_flight"] == 2 * cfg.engine.slots  # one process; 0 = 2 x slots
    assert s["pages"] == s["pages_rule"] == pool_pages(s["engine_sim"]["live_tokens_p99"], s["in_flight"],
                                                         cfg.engine.page_size, cfg.rollout.caps.max_total_tokens)
    assert (r["data"], r["tensor"], r["engine_devices"], r["dtype"]) == (4, 2, 8, "float32")
    assert r["decode_steps_per_call"] == cfg.engine.decode_chunk and r["pages_compiled"] == s["pages"]
    # the pools are the call's in-place outputs: exactly the pool's bytes per chip (KV heads over tensor)
    kv, hd, L = 2, 24, 2  # tiny_qwen3
    pool = r["pages_compiled"] * cfg.engine.page_size * 2 * kv * hd * 4 * L / r["tensor"]
    assert r["per_chip_gib"]["aliased"] * 2**30 == pytest.approx(pool)
    assert r["fits"] and r["attention_kernels"] == 0  # CPU: the pure-JAX path
    assert "decode call per chip GiB" in capsys.readouterr().out
    # the scan over layers on one stacked pool: the same pool, updated in place
    assert compile_sampler.main(["--config=tiny", "--topology=cpu:8", "--episodes_per_slot=4", "--layers_impl=scan",
                                 f"--json={out}", "engine.devices=0", "engine.tensor=0"]) == 0
    s = json.loads(out.read_text())
    assert s["layers_impl"] == "scan" and s["per_chip_gib"]["aliased"] * 2**30 == pytest.approx(pool)


def test_the_analytic_estimate_that_refuses_a_pool_before_compiling():
    """The pool / weight estimate (checked before compiling) of one v5p-32 host's engine
    (4 chips, tensor 4) agrees with the compiled qwen3_8b figure for the rule's pool
    (docs/engine.md: 44.99 GiB per chip for 40,953 pages over the slice, 10,239 per host), and
    refuses Olmo-3 7B's pool at the same size (32 KV heads: 3.6x the KV bytes); the paper
    configs' engine.num_pages fit."""
    q = compile_sampler.estimate_gib(named_config("qwen3_8b"), 10_239, 128, tensor=4, chips=16)
    assert abs(q["pool"] - 44.99) < 0.01 and q["total"] < 95
    assert q["weights"] == pytest.approx(2 * named_config("qwen3_8b").num_params() / 4 / 2**30)
    assert q["max_pages"] > 10_239
    o = compile_sampler.estimate_gib(named_config("olmo3_7b"), 10_239, 128, tensor=4, chips=16)
    assert o["pool"] == pytest.approx(q["pool"] * 32 * 32 / (8 * 36)) and o["total"] > 95 > o["pool"] / 2
    cap = compile_sampler.estimate_gib(named_config("olmo3_7b"), o["max_pages"], 128, tensor=4, chips=16)
    assert 0.85 * 95 < cap["total"] <= 0.9 * 95
    for name, chips, hbm in (("qwen3_8b", 16, 95), ("olmo3_7b", 16, 95), ("qwen3_4b", 64, 16)):  # v5p-32, v5e-64
        cfg = load_config(name)
        e = compile_sampler.estimate_gib(cfg.model_config(), cfg.engine.num_pages, cfg.engine.page_size,
                                         tensor=4, chips=chips, hbm=hbm)
        assert e["total"] <= 0.9 * hbm, (name, e)


@pytest.mark.process
def test_qwen3_8b_layers_on_v5p_8_with_the_kernel(tmp_path, capsys):
    pytest.importorskip("libtpu")
    root = ROOT
    out = tmp_path / "r.json"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="")
    cmd = [sys.executable, "-m", "lopd_jax.compile_sampler", "--config=qwen3_8b", "--topology=v5p-8", "--layers=1",
           "--episodes_per_slot=2", f"--json={out}", "engine.slots=8"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["chips"] == 4 and r["tensor"] == 4 and r["attention_kernels"] == 1  # one kernel per layer
    assert r["sizing"]["slots"] == 8 and r["fits"]
    d = r["decode_step"]
    assert d["bound_us_per_token"] <= d["engine_us_per_token"] < d["static_us_per_token"]
    assert "engine / bound" in proc.stdout

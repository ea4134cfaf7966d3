"""The AOT compile check runs for the tiny config on a small TPU topology (libtpu, no chips)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _has_libtpu():
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_libtpu(), reason="libtpu not installed (pip install -r requirements-tpu.txt)")
def test_compile_check_tiny_on_v5p_8(tmp_path):
    out = tmp_path / "report.json"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="")
    cmd = [sys.executable, "-m", "lopd_jax.compile_check", "--model=tiny_qwen3", "--topology=v5p-8",
           "--batch=4", "--seq=128", "--exp_len=32", "--latents=4", "--depth=2", "--block=64",
           "--logits_chunk=64", "--skip_flops", f"--json={out}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["chips"] == 4 and report["fits"]
    assert 0 < report["per_chip_gib"]["total"] < 1.0
    assert report["model_flops"] > 0
    assert "per chip GiB" in proc.stdout


def test_compile_check_rejects_unknown_topology():
    from lopd_jax.compile_check import topology_devices

    with pytest.raises(SystemExit, match="unknown topology"):
        topology_devices("v9x-8")


def test_model_flops_scale_with_tokens():
    from lopd_jax.compile_check import model_flops
    from lopd_jax.composer import ComposerConfig
    from models.config import named_config

    cfg = named_config("qwen3_8b")
    a = model_flops(cfg, ComposerConfig(), 1, 4096, 1024, 100)["total"]
    b = model_flops(cfg, ComposerConfig(), 2, 4096, 1024, 100)["total"]
    assert abs(b / a - 2) < 1e-9
    # 8B-class: ~6 N per student token dominates; N ~ 7e9 non-embedding parameters
    assert 6 * 6e9 * 4096 < a < 6 * 6e9 * 4096 * 4

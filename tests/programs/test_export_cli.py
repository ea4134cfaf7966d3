"""``python -m lopd_jax.export``: restore the run's student, write HF files; transformers parity."""

import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.paths import ROOT
from tests.train.test_train_e2e import _env, ensure_full_run


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return ensure_full_run(tmp_path_factory)


@pytest.mark.process
def test_export_cli_matches_run_export_and_transformers_logits(full_run, tmp_path):
    workdir, _ = full_run
    out = str(tmp_path / "hf")
    proc = subprocess.run([sys.executable, "-m", "lopd_jax.export", f"--workdir={workdir}", f"--out={out}"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    a = load_file(os.path.join(workdir, "export", "model.safetensors"))
    b = load_file(os.path.join(out, "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    import torch
    import transformers

    from lopd_jax.programs.export import restore_student
    ctx, student, frozen = restore_student(workdir)  # in-process, onto the test's 8-device mesh
    model = ctx.student_model(student, frozen)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok.encode("Book room 101 for Ana, then report the free rooms.", add_special_tokens=False)
    assert ids == ctx.tokenizer.encode("Book room 101 for Ana, then report the free rooms.", add_special_tokens=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    ours = np.asarray(model(np.asarray([ids], np.int32)))[0]
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.process
def test_export_cli_errors_on_a_non_run_dir(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lopd_jax.export", f"--workdir={tmp_path}", f"--out={tmp_path}/o"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "config.json" in proc.stderr

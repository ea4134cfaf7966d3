"""The README's quickstart commands, run verbatim from a directory other than the repository root.

The commands are read from the README's block between ``<!-- quickstart -->`` and
``<!-- /quickstart -->``, so the README cannot drift from what works. Each runs as
written, relative workdir included, with the tiny run shortened by dotted overrides
appended to the train command (and fewer tasks to the evaluations, which take the
shortened run's episode caps from it). JAX_PLATFORMS is
left unset, as a new user's shell has it: the output must carry no libtpu TPU-detection
noise and must start by saying which devices and processes the run uses.
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The file holding the quickstart block (the README once the draft is merged into it).
README = os.path.join(ROOT, "README.md")
SHORT = ["stages.warmup_steps=3", "stages.warmup_batch=4", "stages.cold_start_steps=2", "stages.cold_start_batch=2",
         "stages.lopd_steps=2", "stages.eval_tasks=2", "stages.eval_every=0", "env.tasks_per_step=2",
         "env.kwargs.n_train_per_family=1", "env.kwargs.n_heldout_per_family=1", "bank.min_reward=0.0",
         "checkpoint.every_steps=1", "composer.max_experience_tokens=64", "rollout.max_env_steps=2",
         "rollout.max_turn_tokens=32"]
# the evaluations take the (shortened) run's episode caps themselves: only fewer tasks here
EVAL_SHORT = ["--num_tasks=2"]
# what libtpu prints when it looks for a TPU on a host without one
TPU_NOISE = re.compile(r"libtpu|TPU accelerator type|host bounds|worker hostname|TPU_WORKER_HOSTNAMES|^E0000"
                       r"|PyTorch was not found", re.M | re.I)


def quickstart_commands(path: str = README) -> list[str]:
    """The shell commands of the marked quickstart block (comments and blank lines dropped)."""
    with open(path) as f:
        text = f.read()
    m = re.search(r"<!-- quickstart -->\s*```(?:bash|sh)?\n(.*?)```\s*<!-- /quickstart -->", text, re.S)
    assert m, f"{path} has no ```bash block between <!-- quickstart --> and <!-- /quickstart -->"
    return [ln.split(" #")[0].strip() for ln in m.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _env():
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    env.pop("JAX_PLATFORMS", None)  # as a new user's shell has it: the programs choose
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "force_host_platform_device_count" not in f)
    return env


@pytest.mark.skipif(__import__("lopd_jax.startup").startup.tpu_visible(), reason="checks a CPU-only host")
def test_readme_quickstart_runs_verbatim(tmp_path):
    commands = quickstart_commands()
    programs = [shlex.split(c)[2] for c in commands]
    assert programs[0] == "lopd_jax.train" and "lopd_jax.export" in programs and "lopd_jax.evaluate" in programs
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    outputs = []
    for command in commands:
        argv = shlex.split(command)
        assert argv[:2] == ["python", "-m"], f"quickstart commands are python -m programs: {command}"
        extra = {"lopd_jax.train": SHORT, "lopd_jax.evaluate": EVAL_SHORT}.get(argv[2], [])
        proc = subprocess.run([sys.executable, *argv[1:], *extra], cwd=cwd, env=_env(), capture_output=True,
                              text=True, timeout=900)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{command}\n{out[-4000:]}"
        noise = TPU_NOISE.findall(out)
        assert not noise, f"{command} printed TPU-detection noise: {noise}\n{out[:3000]}"
        outputs.append((argv, proc.stdout, proc.stderr))

    argv, stdout, stderr = outputs[0]
    workdir = cwd / [a.split("=", 1)[1] for a in argv if a.startswith("--workdir=")][0]
    first = stderr.strip().splitlines()[0]
    assert re.match(r"\[lopd\] devices: 1 x cpu \(cpu; 1 local\), process 0 of 1", first), first
    assert re.search(r"held-out reward before: [\d.]+", stdout)
    assert re.search(r"held-out reward after: [\d.]+ \(before [\d.]+\)", stdout)
    assert f"plot: {workdir / 'plot.png'}" in stdout and (workdir / "plot.png").is_file()
    assert f"export (Hugging Face checkpoint of the student): {workdir / 'export'}" in stdout
    assert (workdir / "export" / "config.json").is_file()
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["workdir"] == str(workdir)  # relative workdir made absolute (Orbax needs it)
    assert (workdir / "checkpoints" / "lopd").is_dir()
    for argv, stdout, stderr in outputs[1:]:
        if argv[2] == "lopd_jax.export":
            out = [a.split("=", 1)[1] for a in argv if a.startswith("--out=")][0]
            assert (cwd / out / "config.json").is_file() and list((cwd / out).glob("*.safetensors"))
        else:  # evaluate prints its metrics as JSON, and the run's caps and its progress to stderr
            metrics = json.loads(stdout[stdout.index("{"):])
            assert 0.0 <= metrics["mean_reward"] <= 1.0
            assert "max_steps 2, max_turn_tokens 32, max_total_tokens 512" in stderr, stderr[-2000:]
            assert re.search(r"evaluate: 100%.*2/2", stderr), stderr[-2000:]


def test_quickstart_block_is_found(tmp_path):
    """The parser reads only the marked block, without comments."""
    p = tmp_path / "R.md"
    p.write_text("```bash\npython -m other\n```\n<!-- quickstart -->\n```bash\n# a comment\n"
                 "python -m lopd_jax.train --config=tiny --workdir=w  # trailing\n\npython -m lopd_jax.export\n```\n"
                 "<!-- /quickstart -->\n")
    assert quickstart_commands(str(p)) == ["python -m lopd_jax.train --config=tiny --workdir=w",
                                           "python -m lopd_jax.export"]

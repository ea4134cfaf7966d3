"""The README's quickstart commands, run verbatim from a directory other than the repository
root, in a fresh virtual environment that holds only the runtime install the README names.

The test venv has packages the runtime does not (torch brings jinja2, for one), so a
session fixture makes a new venv and runs ``pip install -c constraints.txt -e <repo>``
in it (from pip's cache: about a minute); the quickstart's ``python`` is that venv's.
The commands are read from the README's block between ``<!-- quickstart -->`` and
``<!-- /quickstart -->``, so the README cannot drift from what works. Each runs as
written, relative workdir included, with the tiny run shortened by dotted overrides
appended to the train command (and fewer tasks to the evaluations, which take the
shortened run's episode caps from it). JAX_PLATFORMS is
left unset, as a new user's shell has it: the output must carry no libtpu TPU-detection
noise and must start by saying which devices and processes the run uses. Around the
block, in the same workdir: a mistyped key first (exit 2, nothing written), and after the
run a changed key (refused with the key and the way on, nothing changed), then the same
command with ``--allow_config_change``. A second test adds the ``tpu`` extra to the same
venv and resolves ``compile_check --config=qwen3_8b --topology=v5p-32 --dry_run`` (and
olmo3_7b there, qwen3_4b on v5e-64).
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from lopd_jax.settings.run_config import CONFIG_FILE
from tests.paths import ROOT
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


@pytest.fixture(scope="module")
def runtime_python(tmp_path_factory):
    """The python of a new venv holding ``pip install -c constraints.txt -e <repo>`` only."""
    venv = tmp_path_factory.mktemp("runtime") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    proc = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c",
                           os.path.join(ROOT, "constraints.txt"), "-e", ROOT],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return python


def _env(python=None):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)  # the installed package, not the checkout on the path
    env.pop("VIRTUAL_ENV", None)
    if python:  # as an activated venv: its bin first on PATH
        env["PATH"] = os.path.dirname(python) + os.pathsep + env.get("PATH", "")
    env.pop("JAX_PLATFORMS", None)  # as a new user's shell has it: the programs choose
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "force_host_platform_device_count" not in f)
    return env


@pytest.mark.process
@pytest.mark.skipif(__import__("lopd_jax.io.startup").io.startup.tpu_visible(), reason="checks a CPU-only host")
@pytest.mark.timeout(1800)
def test_readme_quickstart_runs_verbatim(tmp_path, runtime_python):
    commands = quickstart_commands()
    programs = [shlex.split(c)[2] for c in commands]
    assert programs[0] == "lopd_jax.train" and "lopd_jax.export" in programs and "lopd_jax.evaluate" in programs
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()

    def run(argv):
        return subprocess.run([runtime_python, *argv[1:]], cwd=cwd, env=_env(runtime_python), capture_output=True,
                              text=True, timeout=900)

    train_argv = shlex.split(commands[0]) + SHORT
    typo = run(train_argv + ["stages.lopd_stesp=2"])  # a mistyped key: exit 2, nothing written
    workdir = cwd / [a.split("=", 1)[1] for a in train_argv if a.startswith("--workdir=")][0]
    assert typo.returncode == 2 and "did you mean lopd_steps" in typo.stderr, typo.stderr[-2000:]
    assert not workdir.exists() and not list(cwd.iterdir())
    outputs = []
    for command in commands:
        argv = shlex.split(command)
        assert argv[:2] == ["python", "-m"], f"quickstart commands are python -m programs: {command}"
        extra = {"lopd_jax.train": SHORT, "lopd_jax.evaluate": EVAL_SHORT}.get(argv[2], [])
        proc = run(argv + extra)
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
            assert re.search(r"evaluate: (100%.*)?2/2", stderr), stderr[-2000:]

    # the same workdir with a changed key: refused with the key, both values and the way on
    saved = (workdir / CONFIG_FILE).read_bytes()
    refused = run(train_argv + ["bank.min_reward=0.5"])
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "bank.min_reward: saved 0.0, now 0.5" in refused.stderr
    assert "--allow_config_change=bank.min_reward" in refused.stderr and "another workdir" in refused.stderr
    assert (workdir / CONFIG_FILE).read_bytes() == saved
    allowed = run(train_argv + ["bank.min_reward=0.5", "--allow_config_change=bank.min_reward"])
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert json.loads((workdir / CONFIG_FILE).read_text())["bank"]["min_reward"] == 0.5


def test_quickstart_block_is_found(tmp_path):
    """The parser reads only the marked block, without comments."""
    p = tmp_path / "R.md"
    p.write_text("```bash\npython -m other\n```\n<!-- quickstart -->\n```bash\n# a comment\n"
                 "python -m lopd_jax.train --config=tiny --workdir=w  # trailing\n\npython -m lopd_jax.export\n```\n"
                 "<!-- /quickstart -->\n")
    assert quickstart_commands(str(p)) == ["python -m lopd_jax.train --config=tiny --workdir=w",
                                           "python -m lopd_jax.export"]


@pytest.mark.process
@pytest.mark.timeout(1200)
def test_tpu_extra_resolves_the_paper_configs_for_a_slice(tmp_path, runtime_python):
    """``pip install -c constraints.txt -e ".[tpu]"`` on top of the runtime, then the README's
    compile check as a dry run: config, tokenizer (Qwen3's built-in one; Olmo-3's stated
    placeholder), mesh and the v5p-32 topology from libtpu, with no weights and no data."""
    proc = subprocess.run([runtime_python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c",
                           os.path.join(ROOT, "constraints.txt"), "-e", f"{ROOT}[tpu]"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    slices = {"qwen3_8b": ("v5p-32", 16, 95.0, {"data": 1, "fsdp": 4, "tensor": 4}),
              "olmo3_7b": ("v5p-32", 16, 95.0, {"data": 1, "fsdp": 4, "tensor": 4}),
              "qwen3_4b": ("v5e-64", 64, 16.0, {"data": 1, "fsdp": 32, "tensor": 2})}
    for config, (topology, chips, hbm, mesh) in slices.items():
        note = config == "olmo3_7b"
        out = tmp_path / f"{config}.json"
        proc = subprocess.run([runtime_python, "-m", "lopd_jax.compile_check", f"--config={config}",
                               f"--topology={topology}", "--dry_run", f"--json={out}"], cwd=tmp_path,
                              env=_env(runtime_python), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        report = json.loads(out.read_text())
        assert report["dry_run"] and report["chips"] == chips and report["hbm_gib"] == hbm
        assert report["mesh"] == mesh and report["seq"] == 40960
        assert report["latent_block_tokens"] > 96 and report["model_flops"] > 1e17
        assert "resolved, not compiled" in proc.stdout
        assert ("no built-in olmo3 tokenizer" in proc.stderr) == note, proc.stderr[-2000:]

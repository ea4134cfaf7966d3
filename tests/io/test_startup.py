"""Start-up of the programs: the JAX platform default and path resolution (no JAX needed)."""

import os

import pytest

from lopd_jax.io.paths import resolve_path
from lopd_jax.io.startup import configure_platform, gpu_visible, tpu_visible
from tests.paths import ROOT


def _host(tmp_path, *files, vendor=None):
    for f in files:
        p = tmp_path / f
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("")
    if vendor:
        d = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
    return str(tmp_path)


@pytest.mark.parametrize("files,vendor,tpu", [
    ((), None, False),
    (("dev/accel0",), None, True),                 # v4 / v5p TPU VM
    (("dev/vfio/0", "dev/vfio/vfio"), None, True),  # v5e / v6e TPU VM
    (("dev/vfio/vfio",), None, False),              # the vfio control file alone is not a TPU
    ((), "0x1ae0", True),                           # Google PCI device
    ((), "0x8086", False),
])
def test_tpu_detection(tmp_path, files, vendor, tpu):
    assert tpu_visible(_host(tmp_path, *files, vendor=vendor)) is tpu


def test_cpu_host_defaults_to_cpu(tmp_path):
    env = {}
    assert configure_platform(env, root=_host(tmp_path)) == "cpu"
    assert env == {"JAX_PLATFORMS": "cpu", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}


@pytest.mark.parametrize("files,env", [
    (("dev/accel0",), {}),                  # TPU VM: JAX must find the TPU
    (("dev/nvidia0",), {}),                 # GPU host: JAX picks its GPU plugin
    ((), {"JAX_PLATFORMS": ""}),            # the user's choice, even empty, wins
    ((), {"JAX_PLATFORMS": "tpu"}),
])
def test_platform_left_alone(tmp_path, files, env):
    root = _host(tmp_path, *files)
    before = dict(env, TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    assert configure_platform(env, root=root) is None and env == before
    assert gpu_visible(root) is ("dev/nvidia0" in files)


def test_resolve_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_path("workdirs/x") == str(tmp_path / "workdirs" / "x")
    assert resolve_path("./x") == str(tmp_path / "x")
    assert resolve_path("~/x") == str(tmp_path / "home" / "x")
    assert resolve_path("/abs/x") == "/abs/x"
    assert resolve_path("gs://bucket/run") == "gs://bucket/run"
    assert resolve_path(None) is None


def test_train_config_paths_made_absolute(tmp_path, monkeypatch):
    """``--workdir`` and path overrides of ``lopd_jax.train`` resolve against the current
    directory (Orbax refuses relative checkpoint paths); gs:// stays as written."""
    from lopd_jax.programs.train import resolve_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bank").mkdir()
    cfg = resolve_config(["--config=tiny", "--workdir=runs/a", "checkpoint.directory=./ck", "bank.path=bank"])
    assert cfg.workdir == str(tmp_path / "runs" / "a") and cfg.checkpoint_dir == str(tmp_path / "ck")
    assert cfg.bank.path == str(tmp_path / "bank")
    cfg = resolve_config(["--config=tiny", "--workdir=gs://bucket/runs/a"])
    assert cfg.workdir == "gs://bucket/runs/a" and cfg.checkpoint_dir == "gs://bucket/runs/a/checkpoints"
    assert os.path.isabs(resolve_config(["--config=tiny"]).workdir)


def test_every_command_line_is_the_launchers():
    """Each ``python -m lopd_jax.X`` program's ``main`` is the launcher's for its body
    ``lopd_jax.programs.X`` (a program added later must be too), reading ``--topology``
    first where the body takes it; the console scripts ``lopd-X`` are these ``main``s."""
    import importlib
    import inspect
    import pathlib
    import tomllib

    from lopd_jax.programs.launcher import command

    pkg = pathlib.Path(ROOT) / "lopd_jax"
    names = [p.stem for p in sorted(pkg.glob("*.py")) if '__name__ == "__main__"' in p.read_text()]
    assert len(names) >= 10, names
    for name in names:
        main = importlib.import_module(f"lopd_jax.{name}").main
        assert main.__code__ is command(name).__code__, f"lopd_jax/{name}.py: main is not the launcher's"
        body = (pkg / "programs" / f"{name}.py").read_text()
        topology = '"--topology"' in body
        assert inspect.getclosurevars(main).nonlocals == {"name": name, "topology": topology}, name
    with open(pathlib.Path(ROOT) / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert sorted(scripts.values()) == sorted(f"lopd_jax.{n}:main" for n in names)


@pytest.mark.process
def test_launcher_configures_the_platform_before_jax():
    """The launcher picks the JAX platform before the program's body imports JAX, so no CPU
    run prints libtpu's TPU-detection errors."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import lopd_jax.programs.launcher as launcher\n"
            "seen = []\n"
            "launcher.configure_platform = lambda: seen.append('jax' in sys.modules)\n"
            "try:\n"
            "    launcher.launch('export', ['--help'])\n"
            "except SystemExit as e:\n"
            "    assert e.code == 0, e.code\n"
            "assert seen == [False] and 'jax' in sys.modules, seen\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: python -m lopd_jax.export" in proc.stdout


@pytest.mark.process
def test_command_lines_import_no_jax():
    """Importing a ``lopd_jax/*.py`` command line loads no JAX (its body in
    ``lopd_jax/programs/`` does, once ``main`` has configured the platform)."""
    import pathlib
    import subprocess
    import sys

    pkg = pathlib.Path(ROOT) / "lopd_jax"
    names = [p.stem for p in sorted(pkg.glob("*.py")) if '__name__ == "__main__"' in p.read_text()]
    code = ("import importlib, sys\n"
            f"for n in {names!r}:\n"
            "    importlib.import_module('lopd_jax.' + n)\n"
            "    assert 'jax' not in sys.modules, n + ' imports JAX before configuring it'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=pkg.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_prepare_topology(monkeypatch):
    """The compile checks' ``--topology`` before JAX starts: a TPU topology (or none: the
    default is one) leaves the platform to the TPU plugin; ``cpu:N`` with JAX already
    loaded (as here) leaves XLA_FLAGS alone, since the flag could no longer apply."""
    from lopd_jax.io.startup import prepare_topology

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    prepare_topology(["--config=tiny", "--topology=cpu:4"])
    assert "JAX_PLATFORMS" not in os.environ
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    prepare_topology(["--config=tiny"])
    assert os.environ["JAX_PLATFORMS"] == ""

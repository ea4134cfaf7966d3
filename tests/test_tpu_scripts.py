"""The Cloud TPU scripts without a slice: a fake ``gcloud`` on PATH runs each ssh command
in a local directory per worker, so the settings (tpu_scripts/slice.env, the environment)
and run.sh's launch-and-wait are checked as a user runs them."""

import base64
import importlib.util
import os
import re
import stat
import subprocess
import sys

import pytest
from tests.paths import ROOT


SCRIPTS = os.path.join(ROOT, "tpu_scripts")
# a standalone script (stdlib only, run where gcloud runs), loaded from its file
_spec = importlib.util.spec_from_file_location("worker_status", os.path.join(SCRIPTS, "worker_status.py"))
ws = sys.modules["worker_status"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ws)

FAKE_GCLOUD = r"""#!/usr/bin/env bash
# records each call; ssh runs --command in every fake worker's home, one after the other
echo "$*" >> "$FAKE_GCLOUD_LOG"
case "$*" in
  *"tpu-vm ssh"*)
    for a in "$@"; do case "$a" in --command=*) cmd="${a#--command=}" ;; esac; done
    k=0
    for home in $FAKE_WORKERS; do
      (cd "$home" && HOME="$home" LOPD_WORKER=$k bash -c "$cmd") || exit $?
      k=$((k + 1))
    done ;;
  *"tpu-vm scp"*) for home in $FAKE_WORKERS; do cp "$5" "$home/${6#*:}"; done ;;
  *"queued-resources describe"*) echo ACTIVE ;;
esac
"""


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def slice_env(tmp_path):
    """A fake gcloud on PATH, two worker homes holding the scripts, and the environment
    for the tpu_scripts (no slice settings: slice.env's defaults apply)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "gcloud", FAKE_GCLOUD)
    homes = []
    for k in range(2):
        code = tmp_path / f"worker{k}" / "lopd-jax"
        code.mkdir(parents=True)
        os.symlink(SCRIPTS, code / "tpu_scripts")
        homes.append(str(tmp_path / f"worker{k}"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("PROJECT", "ZONE", "TPU_NAME", "ACCELERATOR_TYPE", "QUEUED_RESOURCE_ID", "LOPD_VENV",
                        "DATA_URL") and not k.endswith("_WAIT_S")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.log"),
               FAKE_WORKERS=" ".join(homes), POLL_S="0.5", TRAIN_WAIT_S="300",
               EXPORT_WAIT_S="300", STOP_GRACE_S="30")
    return env, tmp_path


def _run(script, env, *args, timeout=300):
    return subprocess.run(["bash", os.path.join(SCRIPTS, script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _venv(tmp_path, python_text=None):
    """A worker venv whose ``python`` is this interpreter on the checkout, or a script."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _executable(venv / "bin" / "python", python_text or f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "activate").write_text(
        f'export PATH="{venv}/bin:$PATH" PYTHONPATH="{ROOT}" JAX_PLATFORMS=cpu\n')
    return str(venv)


@pytest.mark.process
def test_every_script_parses():
    for name in sorted(os.listdir(SCRIPTS)):
        if name.endswith((".sh", ".env")):
            proc = subprocess.run(["bash", "-n", os.path.join(SCRIPTS, name)], capture_output=True, text=True)
            assert proc.returncode == 0, (name, proc.stderr)


@pytest.mark.process
def test_settings_come_from_slice_env_and_the_environment(slice_env):
    env, tmp = slice_env
    log = tmp / "gcloud.log"
    proc = _run("teardown.sh", env)  # PROJECT is empty in slice.env: refused before any gcloud call
    assert proc.returncode == 2 and "PROJECT is not set" in proc.stderr and "slice.env" in proc.stderr
    assert not log.exists()
    proc = _run("create.sh", {**env, "PROJECT": "proj-a"})
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert "queued-resources create lopd-v5p-32-qr --project=proj-a --zone=us-east5-a --node-id=lopd-v5p-32 " \
           "--accelerator-type=v5p-32 --runtime-version=v2-alpha-tpuv5" in calls[0]
    log.unlink()
    proc = _run("teardown.sh", {**env, "PROJECT": "proj-a", "TPU_NAME": "mine", "ZONE": "us-central2-b"})
    assert proc.returncode == 0, proc.stderr
    assert log.read_text().split() == ["compute", "tpus", "queued-resources", "delete", "mine-qr",
                                       "--project=proj-a", "--zone=us-central2-b", "--force", "--quiet"]


def _report(index, status, log):
    return f"LOPD-WORKER {index} {'-' if status is None else status} {base64.b64encode(log.encode()).decode()}"


def _devices(p, n):
    return f"[lopd] devices: 16 x TPU v5 (tpu; 4 local), process {p} of {n}\n"


def test_worker_status_reads_the_lines_the_programs_print():
    """The patterns match what the programs print: describe_devices' line and loop's progress line."""
    from lopd_jax.io.startup import describe_devices

    assert ws.DEVICES.search("[lopd] " + describe_devices() + "\n")
    with open(os.path.join(ROOT, "train", "loop.py")) as f:
        assert ws.BUILT[len("[lopd] "):] in f.read()


def test_worker_status_decisions_on_fake_logs():
    parse, decide = ws.parse, ws.decide
    err = "Traceback ...\nerror: unknown config 'qwen3-8b'; known configs: [...]\n"
    code, msg = decide(parse("\n".join(_report(i, 2, err) for i in range(4))), "started")
    assert code == ws.EXIT_FAILED and msg.startswith("worker 0 exited with status 2 (workers 1, 2, 3 failed too): "
                                                     "error: unknown config") and "the end of worker 0's log" in msg
    joined = [_report(i, None, _devices(i, 4)) for i in range(4)]
    code, msg = decide(parse("\n".join(joined)), "started")  # joined, model not yet built
    assert code == ws.EXIT_PENDING and msg.startswith("0/4 workers under way")
    built = _devices(0, 4) + "[lopd] starting run in gs://b/r\n[lopd] built the model and system in 80.1s on 16 device(s)\n"
    code, msg = decide(parse("\n".join([_report(0, None, built)] + joined[1:])), "started")
    assert (code, msg) == (ws.EXIT_OK, "all 4 workers are under way")
    code, msg = decide(parse("\n".join([_report(0, None, built), joined[1], _report(2, None, "")])), "started")
    assert code == ws.EXIT_PENDING and "1 worker(s) not reporting" in msg and "worker 2: (no output yet)" in msg
    code, msg = decide(parse("noise from gcloud\n" + "\n".join([_report(0, None, built), _report(1, 1, "boom\n")])),
                       "started")
    assert code == ws.EXIT_FAILED and msg.startswith("worker 1 exited with status 1: boom")
    code, msg = decide(parse("\n".join([_report(0, 0, "wrote x\n"), _report(1, None, "")])), "exited")
    assert code == ws.EXIT_PENDING and msg.startswith("1/2 workers exited")
    assert decide(parse("\n".join(_report(i, 0, "") for i in range(2))), "exited")[0] == ws.EXIT_OK
    assert decide([], "started")[0] == ws.EXIT_PENDING


@pytest.mark.process
def test_run_sh_reports_the_first_workers_error_when_every_worker_exits_2(slice_env):
    """The real trainer on each fake worker with a misspelt config: run.sh fails with the error."""
    env, tmp = slice_env
    env = {**env, "PROJECT": "p", "LOPD_VENV": _venv(tmp)}
    proc = _run("run.sh", env, "--config=qwen3-8b", "--workdir=workdirs/x")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    # whichever worker's exit the first poll sees is reported
    assert re.search(r"worker [01] exited with status 2[^:]*: error: unknown config 'qwen3-8b'", proc.stderr)
    assert "the end of worker" in proc.stderr and proc.stdout.count("started python -m lopd_jax.train") == 2


@pytest.mark.process
def test_run_sh_returns_once_every_worker_is_under_way(slice_env):
    """Each worker's program prints the lines of a started run and keeps running."""
    env, tmp = slice_env
    fake = ("#!/usr/bin/env bash\n"
            "i=$LOPD_WORKER\n"
            "echo \"[lopd] devices: 8 x cpu (cpu; 4 local), process $i of 2\"\n"
            "if [ $i = 0 ]; then echo '[lopd] built the model and system in 1.0s on 8 device(s)'; fi\n"
            "echo \"args: $*\"\n"
            "sleep 2\n")
    env = {**env, "PROJECT": "p", "LOPD_VENV": _venv(tmp, fake)}
    proc = _run("run.sh", env, "--config=qwen3_8b", "--workdir=gs://b/runs/r 1", "stages.lopd_steps=2")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "all 2 workers" in proc.stdout
    log = (tmp / "worker1" / "lopd-jax" / "logs" / "train-worker-1.log").read_text()
    assert "args: -m lopd_jax.train --config=qwen3_8b --workdir=gs://b/runs/r 1 stages.lopd_steps=2" in log
    shown = _run("logs.sh", env, "train", "5")
    assert shown.returncode == 0 and "logs/train-worker-0.log" in shown.stdout and "process 1 of 2" in shown.stdout
    assert _run("stop.sh", env).returncode == 0
    # any other program is waited for until every worker exits
    proc = _run("run.sh", env, "--program=export", "--workdir=gs://b/runs/r", "--out=gs://b/e")
    assert proc.returncode == 0 and "all 2 workers exited 0" in proc.stdout, (proc.stdout, proc.stderr)
    assert "args: -m lopd_jax.export --workdir=gs://b/runs/r --out=gs://b/e" in \
        (tmp / "worker0" / "lopd-jax" / "logs" / "export-worker-0.log").read_text()


# a program that keeps going until stopped: joins the run (process 0 builds the model), then
# waits; SIGTERM ends it as the trainer's preemption handler does (EXIT_ON_TERM=0: ignored)
LONG_RUNNING = ("#!/usr/bin/env bash\n"
                "i=$LOPD_WORKER\n"
                "if [ \"${EXIT_ON_TERM:-1}\" = 1 ]; then trap 'echo \"[fake] worker $i: SIGTERM\"; exit 0' TERM; "
                "else trap '' TERM; fi\n"
                "if [ \"$FAIL_WORKER\" = $i ]; then echo 'error: boom on this worker'; exit 1; fi\n"
                "if [ \"$QUIET\" != 1 ]; then\n"
                "  echo \"[lopd] devices: 8 x cpu (cpu; 4 local), process $i of 2\"\n"
                "  if [ $i = 0 ]; then echo '[lopd] built the model and system in 1.0s on 8 device(s)'; fi\n"
                "fi\n"
                "echo \"args: $*\"\n"
                "sleep 300 & wait $!\n")


def _pid(tmp, k):
    """The pid of worker k's running program (from worker.sh's pid file), or None."""
    path = tmp / f"worker{k}" / "lopd-jax" / "logs" / f"worker-{k}.pid"
    return int(path.read_text().split()[0]) if path.exists() else None


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def long_running(slice_env):
    """slice_env with LONG_RUNNING as every worker's python; stops whatever is left at the end."""
    env, tmp = slice_env
    env = {**env, "PROJECT": "p", "LOPD_VENV": _venv(tmp, LONG_RUNNING)}
    yield env, tmp
    _run("stop.sh", {**env, "STOP_GRACE_S": "0"})


@pytest.mark.process
def test_a_second_start_is_refused_and_stop_sh_stops_every_worker(long_running):
    env, tmp = long_running
    proc = _run("run.sh", env, "--config=tiny", "--workdir=w")
    assert proc.returncode == 0 and "all 2 workers are under way" in proc.stdout, (proc.stdout, proc.stderr)
    pids = [_pid(tmp, k) for k in range(2)]
    assert all(pids) and all(_alive(p) for p in pids)
    # run.sh again: refused before any worker starts anything
    again = _run("run.sh", env, "--config=tiny", "--workdir=w")
    assert again.returncode == 2 and "started python" not in again.stdout, (again.stdout, again.stderr)
    assert "error: worker 0: python -m lopd_jax.train is already running here" in again.stderr
    assert "./tpu_scripts/stop.sh" in again.stderr.splitlines()[-1]
    # worker.sh itself refuses, with one line naming the stop script
    code = tmp / "worker1" / "lopd-jax"
    direct = subprocess.run(["bash", "tpu_scripts/worker.sh", "start", "export", "--out=x"], cwd=code,
                            env={**env, "LOPD_WORKER": "1"}, capture_output=True, text=True, timeout=60)
    assert direct.returncode == 2 and direct.stdout == "" and len(direct.stderr.splitlines()) == 1
    assert re.match(rf"error: worker 1: python -m lopd_jax.train is already running here \(pid {pids[1]}, "
                    r"log .*train-worker-1.log\); stop it first with ./tpu_scripts/stop.sh", direct.stderr)
    assert not (code / "logs" / "export-worker-1.log").exists() and _pid(tmp, 1) == pids[1]
    # stop.sh: SIGTERM on every worker, each program exits, nothing is left running
    stopped = _run("stop.sh", env)
    assert stopped.returncode == 0, stopped.stderr
    for k in range(2):
        assert f"worker {k}: stopped python -m lopd_jax.train (pid {pids[k]}): exited after SIGTERM" in stopped.stdout
        assert not _alive(pids[k]) and _pid(tmp, k) is None
        assert f"[fake] worker {k}: SIGTERM" in (tmp / f"worker{k}" / "lopd-jax" / "logs"
                                                 / f"train-worker-{k}.log").read_text()
    assert _run("stop.sh", env).stdout.count("nothing running") == 2
    # a program that ignores SIGTERM is killed after STOP_GRACE_S
    env = {**env, "EXIT_ON_TERM": "0", "STOP_GRACE_S": "1"}
    assert _run("run.sh", env, "--config=tiny", "--workdir=w").returncode == 0
    pids = [_pid(tmp, k) for k in range(2)]
    stopped = _run("stop.sh", env)
    assert stopped.stdout.count("killed (SIGKILL) after 1 s") == 2, stopped.stdout
    assert not any(_alive(p) for p in pids)


@pytest.mark.process
def test_run_sh_stops_every_worker_when_one_fails(long_running):
    env, tmp = long_running
    proc = _run("run.sh", {**env, "FAIL_WORKER": "1"}, "--config=tiny", "--workdir=w")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "worker 1 exited with status 1: error: boom on this worker" in proc.stderr
    assert "stopping every worker's program" in proc.stderr
    assert re.search(r"worker 0: stopped python -m lopd_jax.train \(pid \d+\): exited after SIGTERM", proc.stderr)
    assert _pid(tmp, 0) is None and "[fake] worker 0: SIGTERM" in \
        (tmp / "worker0" / "lopd-jax" / "logs" / "train-worker-0.log").read_text()
    # nothing is left running, so the same command starts again
    assert _run("run.sh", env, "--config=tiny", "--workdir=w").returncode == 0


@pytest.mark.process
def test_each_program_has_its_own_wait_and_run_sh_says_the_workers_keep_going(long_running):
    env, tmp = long_running
    env = {**env, "QUIET": "1", "TRAIN_WAIT_S": "300", "EXPORT_WAIT_S": "2"}
    proc = _run("run.sh", env, "--program=export", "--out=x")  # never exits: the export wait runs out
    assert proc.returncode == 3 and "error" not in proc.stdout + proc.stderr, (proc.stdout, proc.stderr)
    assert "still going after 2 s (EXPORT_WAIT_S)" in proc.stdout
    assert "./tpu_scripts/logs.sh export" in proc.stdout and "./tpu_scripts/stop.sh" in proc.stdout
    assert all(_alive(_pid(tmp, k)) for k in range(2))  # the workers keep going
    assert _run("stop.sh", env).returncode == 0
    proc = _run("run.sh", {**env, "TRAIN_WAIT_S": "2", "EXPORT_WAIT_S": "300"}, "--config=tiny", "--workdir=w")
    assert proc.returncode == 3 and "still going after 2 s (TRAIN_WAIT_S)" in proc.stdout, (proc.stdout, proc.stderr)


@pytest.mark.process
def test_slice_env_sets_no_venv_and_data_sh_copies_the_bucket_to_every_worker(slice_env):
    env, tmp = slice_env
    shown = subprocess.run(["bash", "-c", "unset VENV; source tpu_scripts/slice.env; echo \"${VENV-unset} $ZONE\""],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert shown.stdout == "unset us-east5-a\n", shown
    env = {**env, "PROJECT": "p"}
    proc = _run("data.sh", env)
    assert proc.returncode == 2 and "DATA_URL is not set" in proc.stderr
    proc = _run("data.sh", {**env, "DATA_URL": "gs://b/data/"})
    assert proc.returncode == 0, proc.stderr
    calls = (tmp / "gcloud.log").read_text().splitlines()
    assert calls.count("storage rsync --recursive gs://b/data lopd-jax/data") == 2
    assert all((tmp / f"worker{k}" / "lopd-jax" / "data").is_dir() for k in range(2))

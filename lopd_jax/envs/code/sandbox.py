"""Run untrusted, model-generated Python in a separate, confined process.

:func:`run_python` writes the program into a fresh temporary directory and starts
:mod:`lopd_jax.envs.code.sandbox_launcher` in its own session / process group. The launcher
applies whatever the OS permits, in order: pids and memory cgroups
(:mod:`lopd_jax.envs.code.sandbox_memory`), namespaces (no network, own PIDs, a read-only mount
namespace with ``hidden_paths`` covered), capabilities dropped, rlimits, and a best-effort Python
audit-hook prelude; each layer is recorded in ``SandboxResult.enforced`` so a caller sees what
was really in force. The parent enforces the wall-clock timeout and the output cap, kills the
process group and every process left in the cgroup, and deletes the temporary directory.

The layers, what each blocks and what remains without root or user namespaces:
``docs/sandbox.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

from lopd_jax.envs.code.sandbox_launcher import REPORT_PREFIX
from lopd_jax.envs.code.sandbox_memory import cgroup_pids, make_memory_cgroup, oom_killed, remove_cgroup

_LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
_CGROUP_PREFIX = "lopd_sandbox_"
_WARNED_HIDDEN: list[bool] = []


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits for one sandboxed run.

    ``timeout_s`` is wall-clock; ``cpu_time_s`` (default: ``timeout_s`` rounded up) is
    RLIMIT_CPU; ``memory_bytes`` is RLIMIT_AS per process; ``max_processes`` caps processes
    (and threads, under the cgroup); ``max_output_bytes`` caps each of stdout / stderr;
    ``max_file_bytes`` is RLIMIT_FSIZE. ``memory_total_bytes`` (default: ``memory_bytes``)
    bounds the resident memory of *all* the run's processes together, swap off, with a
    memory cgroup (cgroup v2 ``memory.max`` + ``memory.swap.max = 0``, else cgroup v1
    ``memory.limit_in_bytes`` + ``memory.memsw.limit_in_bytes``); where neither is
    writable only the per-process RLIMIT_AS applies and one warning says so.
    ``hidden_paths`` are files / directories the program must not read (the task data
    with the expected outputs): inside the mount namespace each is covered by an empty
    read-only tmpfs (directory) or ``/dev/null`` (file); ``enforced["hidden_paths"]`` says
    whether that worked (never under ``"basic"`` isolation). ``isolation`` is ``"auto"``
    (every layer the OS allows) or ``"basic"`` (no namespaces: cgroup where available,
    capabilities dropped, rlimits, the prelude and process-group killing - what an
    unprivileged host gets).
    ``python`` is the interpreter for the program (default: this one).
    """

    timeout_s: float = 10.0
    cpu_time_s: float | None = None
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    max_output_bytes: int = 1 << 20
    max_file_bytes: int = 64 << 20
    memory_total_bytes: int | None = None
    hidden_paths: tuple[str, ...] = ()
    isolation: str = "auto"
    python: str = ""

    def __post_init__(self) -> None:
        """Validate every field; raise ValueError naming the bad one and the fix."""
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if self.cpu_time_s is not None and not self.cpu_time_s > 0:
            raise ValueError(f"cpu_time_s must be > 0 or None, got {self.cpu_time_s!r}")
        for name in ("memory_bytes", "max_processes", "max_output_bytes", "max_file_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.memory_total_bytes is not None and (
                not isinstance(self.memory_total_bytes, int) or self.memory_total_bytes < 64 << 20):
            raise ValueError(f"memory_total_bytes must be None or an int >= 64 MiB, got "
                             f"{self.memory_total_bytes!r}")
        if self.memory_bytes < 64 << 20:
            raise ValueError(f"memory_bytes={self.memory_bytes} is below 64 MiB; the "
                             "interpreter cannot start with less - raise it")
        if isinstance(self.hidden_paths, str) or not all(
                isinstance(p, str) for p in self.hidden_paths):
            raise ValueError(f"hidden_paths must be a tuple of path strings, got "
                             f"{self.hidden_paths!r}")
        if self.isolation not in ("auto", "basic"):
            raise ValueError(f"isolation must be 'auto' or 'basic', got {self.isolation!r}")


@dataclasses.dataclass
class SandboxResult:
    """Outcome of one run.

    ``status`` is one of ``ok`` (exit code 0), ``timeout`` (wall clock or CPU limit),
    ``memory`` (MemoryError / allocation refused), ``output_limit`` (killed for writing too
    much) or ``error`` (anything else: non-zero exit, exception, killed by a signal).
    ``returncode`` is the program's exit code, or ``-signal`` when a signal ended it, or
    ``None`` when it was killed before it reported. ``enforced`` names each isolation layer
    and whether it was in force.
    """

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    wall_time_s: float
    enforced: dict[str, bool] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the program exited with status 0 within every limit."""
        return self.status == "ok"


# ---------------------------------------------------------------------------------------
# Parent side.


def _find_pids_cgroup_root() -> str | None:
    """A writable cgroup directory with the pids controller, or None."""
    if os.geteuid() != 0:
        return None
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = fields[4]
        if tail[0] == "cgroup" and "pids" in tail[2].split(","):
            return point
        if tail[0] == "cgroup2":
            try:
                with open(os.path.join(point, "cgroup.subtree_control")) as f:
                    if "pids" in f.read().split():
                        return point
            except OSError:
                continue
    return None


_CGROUP_ROOT: list[str | None] = []
_RUN_IDS = itertools.count()


def _make_cgroup(max_processes: int) -> str | None:
    """Create a child pids cgroup limited to ``max_processes`` tasks; None if impossible."""
    if not _CGROUP_ROOT:
        _CGROUP_ROOT.append(_find_pids_cgroup_root())
    root = _CGROUP_ROOT[0]
    if root is None:
        return None
    path = os.path.join(root, f"{_CGROUP_PREFIX}{os.getpid()}_{next(_RUN_IDS)}_{time.monotonic_ns()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(max_processes))
    except OSError:
        try:
            os.rmdir(path)
        except OSError:
            pass
        return None
    return path


def _kill_everything(proc, cgroup: str | None, mem_cgroup: str | None = None) -> None:
    """SIGKILL the launcher's process group and every task in the cgroups, then reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if cgroup or mem_cgroup:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            pids = (cgroup_pids(cgroup) if cgroup else []) + (
                cgroup_pids(mem_cgroup) if mem_cgroup else [])
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)
    try:
        proc.wait(timeout=5.0)
    except Exception:  # the launcher is SIGKILLed above; this only guards a stuck kernel
        pass


def _read_streams(proc, deadline: float, cap: int) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout/stderr until EOF, the deadline or the cap; returns (out, err, timed_out,
    over_cap). Does not kill anything."""

    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    timed_out = over_cap = False
    try:
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(remaining, 0.5)):
                fd = key.fd
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                buf += chunk[: cap + 1 - len(buf)]
                if len(buf) > cap:
                    over_cap = True
            if over_cap:
                break
    finally:
        sel.close()
    out, err = bufs[proc.stdout.fileno()], bufs[proc.stderr.fileno()]
    return bytes(out[:cap]), bytes(err[:cap]), timed_out, over_cap


def _parse_report(raw: bytes) -> dict:
    """Merge the launcher's report lines (start-up facts first, the exit status last)."""
    merged: dict = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith(REPORT_PREFIX):
            try:
                merged.update(json.loads(line[len(REPORT_PREFIX):]))
            except ValueError:
                pass
    return merged


def run_python(code: str, stdin: str = "", config: SandboxConfig | None = None) -> SandboxResult:
    """Run ``code`` as a Python program in the sandbox and return what happened.

    ``stdin`` is fed to the program's standard input. Never raises for anything the program
    does; raises TypeError for a non-string ``code``.
    """

    if not isinstance(code, str) or not isinstance(stdin, str):
        raise TypeError("run_python(code, stdin) takes two strings, got "
                        f"{type(code).__name__} and {type(stdin).__name__}")
    cfg = config or SandboxConfig()
    workdir = tempfile.mkdtemp(prefix="lopd_sbx_")
    cgroup = _make_cgroup(cfg.max_processes)
    memory = make_memory_cgroup(cfg.memory_total_bytes or cfg.memory_bytes)
    mem_path = memory[1] if memory else None
    report_r, report_w = os.pipe()
    start = time.monotonic()
    proc = None
    try:
        stdin_path = _write_program(workdir, code, stdin)
        launch = _launch_spec(cfg, workdir, cgroup, mem_path, report_w)
        proc = _start_launcher(workdir, stdin_path, launch, report_w)
        os.close(report_w)
        report_w = -1
        out, err, timed_out, over_cap = _await_program(proc, start, cfg)
        _kill_everything(proc, cgroup, mem_path)
        wall = time.monotonic() - start
        report = _parse_report(_read_pending(report_r))
        stdout = out.decode("utf-8", "replace")
        stderr = err.decode("utf-8", "replace")
        result = _classify(report, stdout, stderr, wall, timed_out, over_cap, cgroup)
        _apply_memory_cgroup(result, memory, mem_path)
        _warn_hidden_paths_uncovered(cfg, result)
        return result
    finally:
        _clean_up(proc, cgroup, mem_path, (report_r, report_w), workdir)


def _write_program(workdir: str, code: str, stdin: str) -> str:
    """Write ``main.py`` and the stdin file into ``workdir``; return the stdin file's path."""
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
        f.write(code)
    stdin_path = os.path.join(workdir, ".stdin")
    with open(stdin_path, "w", encoding="utf-8") as f:
        f.write(stdin)
    return stdin_path


def _launch_spec(cfg: SandboxConfig, workdir: str, cgroup: str | None, mem_path: str | None,
                 report_w: int) -> dict:
    """The launcher's JSON argument: limits, isolation, cgroups, report fd and hidden paths."""
    cpu = cfg.cpu_time_s if cfg.cpu_time_s is not None else cfg.timeout_s
    return {
        "workdir": workdir, "python": cfg.python or sys.executable,
        "cpu_s": max(1, int(-(-cpu // 1))), "memory": cfg.memory_bytes,
        "nproc": cfg.max_processes, "fsize": cfg.max_file_bytes,
        "namespaces": cfg.isolation == "auto", "cgroup": cgroup, "report_fd": report_w,
        "memory_cgroup": mem_path,
        "hidden": [os.path.realpath(p) for p in cfg.hidden_paths],
    }


def _start_launcher(workdir: str, stdin_path: str, launch: dict, report_w: int) -> subprocess.Popen:
    """Start the launcher in its own session with a minimal environment, stdin from ``stdin_path``."""
    env = {"HOME": workdir, "TMPDIR": workdir, "PATH": "/usr/local/bin:/usr/bin:/bin",
           "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    with open(stdin_path, "rb") as stdin_f:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-B", _LAUNCHER,
             json.dumps(launch)],
            stdin=stdin_f, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=workdir, env=env, pass_fds=(report_w,), start_new_session=True)


def _await_program(proc, start: float, cfg: SandboxConfig) -> tuple[bytes, bytes, bool, bool]:
    """Read the output until exit, the deadline or the cap; (stdout, stderr, timed_out, over_cap)."""
    out, err, timed_out, over_cap = _read_streams(
        proc, start + cfg.timeout_s, cfg.max_output_bytes)
    if not (timed_out or over_cap):
        try:
            proc.wait(timeout=max(0.0, start + cfg.timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    return out, err, timed_out, over_cap


def _read_pending(fd: int) -> bytes:
    """Whatever is already in the pipe ``fd`` (up to 64 KiB), without blocking."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return b""


def _apply_memory_cgroup(result: SandboxResult, memory, mem_path: str | None) -> None:
    """Record whether the memory cgroup was in force and report its OOM kill as ``memory``."""
    joined = result.enforced.pop("memory_cgroup_joined", False)
    result.enforced["cgroup_memory"] = bool(mem_path and joined)
    if oom_killed(memory) and result.status in ("error", "ok"):
        result.status = "memory"


def _warn_hidden_paths_uncovered(cfg: SandboxConfig, result: SandboxResult) -> None:
    """Warn once per process when ``hidden_paths`` were asked for but could not be covered."""
    if cfg.hidden_paths and not result.enforced.get("hidden_paths") and not _WARNED_HIDDEN:
        _WARNED_HIDDEN.append(True)
        # stacklevel 3: point at run_python's caller, as when this lived in run_python.
        warnings.warn("sandbox: hidden_paths could not be covered (no mount namespace: "
                      f"{result.enforced}); the program can read the task data on disk",
                      RuntimeWarning, stacklevel=3)


def _clean_up(proc, cgroup: str | None, mem_path: str | None, fds: tuple[int, int], workdir: str) -> None:
    """Close the pipes, kill whatever is left, remove both cgroups and the work directory."""
    if proc is not None:
        for stream in (proc.stdout, proc.stderr):
            if stream:
                stream.close()
        if proc.returncode is None:
            _kill_everything(proc, cgroup, mem_path)
    for fd in fds:
        if fd >= 0:
            os.close(fd)
    remove_cgroup(cgroup)
    remove_cgroup(mem_path)
    shutil.rmtree(workdir, ignore_errors=True)


def _classify(report: dict, stdout: str, stderr: str, wall: float, timed_out: bool,
              over_cap: bool, cgroup: str | None) -> SandboxResult:
    enforced = dict(report.get("enforced", {}))
    enforced["cgroup_pids"] = cgroup is not None and enforced.get("cgroup_joined", False)
    enforced.pop("cgroup_joined", None)
    rc = report.get("returncode")
    if report.get("setup_error"):
        stderr = f"sandbox setup failed: {report['setup_error']}\n" + stderr
    if over_cap:
        status = "output_limit"
    elif timed_out or rc == -signal.SIGXCPU:
        status = "timeout"
    elif rc == 0:
        status = "ok"
    elif "MemoryError" in stderr[-4000:] or "Cannot allocate memory" in stderr[-4000:]:
        status = "memory"
    else:
        status = "error"
    return SandboxResult(status, stdout, stderr, rc, wall, enforced)

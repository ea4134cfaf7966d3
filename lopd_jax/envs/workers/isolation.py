"""Run untrusted dataset code in a worker subprocess, one request at a time, with timeouts.

:class:`Worker` starts ``python -I`` on this file in its own session and a fresh temporary
directory and talks to it over a pipe, one JSON object per line; inside, a handler object
(``"package.module:ClassName"``) answers each request. Every request has a wall-clock
timeout; a worker that times out, crashes, hits a resource limit or writes garbage is
killed with its process group and the caller gets :class:`WorkerTimeout` /
:class:`WorkerCrashed`, never a hang. Inside the worker, :class:`ResourceLimits` are
applied before any dataset code runs, fds 0/1 are redirected so ``print`` or ``input``
cannot corrupt the protocol, and ``lopd_jax`` is a bare namespace package so its
``__init__`` (which may import JAX) never runs.

This is fault isolation (hangs, crashes, memory blow-ups, stray output), not a security
sandbox: the worker runs as the same user with the same file-system access.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import weakref
from typing import Any

# computed here, not imported: this file also runs as a bare script (``-I``) before the
# project is on sys.path
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_MAX_REPLY_BYTES = 16 * 1024 * 1024
_LIVE: "weakref.WeakSet[Worker]" = weakref.WeakSet()


class WorkerError(Exception):
    """The worker could not answer (base class)."""


class WorkerTimeout(WorkerError):
    """A request did not finish within its timeout; the worker was killed."""


class WorkerCrashed(WorkerError):
    """The worker died, was killed by a resource limit, or broke the protocol."""


@dataclasses.dataclass(frozen=True)
class ResourceLimits:
    """Per-worker limits applied with :func:`resource.setrlimit` (``None`` = unlimited).

    ``cpu_seconds`` is the worker's total CPU time over its life (one episode); it backs
    up the per-request wall-clock timeout against busy loops.
    """

    memory_bytes: int | None = 2 * 1024**3
    cpu_seconds: int | None = 120
    file_size_bytes: int | None = 16 * 1024**2
    open_files: int | None = 256

    def as_dict(self) -> dict[str, int | None]:
        """The limits as a plain dict (sent to the worker)."""
        return dataclasses.asdict(self)


class Worker:
    """A worker subprocess running one handler; see the module docstring.

    Args:
        handler: ``"package.module:ClassName"`` of the handler class (importable from the
            repository root); its ``handle(request: dict) -> dict`` answers requests.
        limits: resource limits for the worker.
        start_timeout_s: how long to wait for the worker to import the handler.
    """

    def __init__(self, handler: str, limits: ResourceLimits = ResourceLimits(),
                 start_timeout_s: float = 10.0):
        """Start the worker and wait until its handler is ready."""
        if ":" not in handler:
            raise ValueError(f"handler must look like 'package.module:ClassName', got {handler!r}")
        self.handler = handler
        self._buf = b""
        self._workdir = tempfile.mkdtemp(prefix="lopd_worker_")
        self._stderr = tempfile.TemporaryFile()
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR")}
        env["HOME"] = self._workdir
        cmd = [sys.executable, "-I", os.path.abspath(__file__), "--worker", _REPO_ROOT,
               handler, json.dumps(limits.as_dict())]
        self.proc: subprocess.Popen | None = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            cwd=self._workdir, env=env, start_new_session=True, close_fds=True)
        _LIVE.add(self)
        ready = self._receive(time.monotonic() + start_timeout_s, "start-up")
        if not ready.get("ready"):
            self.kill()
            raise WorkerCrashed(f"worker failed to start its handler {handler}: "
                                f"{ready.get('error', ready)}")

    @property
    def alive(self) -> bool:
        """Whether the worker process is running."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The worker's process id (``None`` once it is gone)."""
        return self.proc.pid if self.proc is not None else None

    def _stderr_tail(self, n: int = 600) -> str:
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - n))
            return self._stderr.read().decode("utf-8", "replace").strip()
        except (OSError, ValueError):
            return ""

    def _died(self, what: str) -> WorkerCrashed:
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                code = None
        if code is not None and code < 0:
            how = f"killed by signal {signal.Signals(-code).name}"
            if -code == signal.SIGXCPU:
                how += " (CPU time limit)"
        else:
            how = f"exited with code {code}"
        tail = self._stderr_tail()
        self.kill()
        return WorkerCrashed(f"worker {how} during {what}" + (f"; stderr: {tail}" if tail else ""))

    def _receive(self, deadline: float, what: str) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise WorkerTimeout(f"{what} did not finish in time; the worker was killed")
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise self._died(what)
            self._buf += chunk
            if len(self._buf) > _MAX_REPLY_BYTES:
                self.kill()
                raise WorkerCrashed(f"reply to {what} exceeded {_MAX_REPLY_BYTES} bytes")
        line, _, self._buf = self._buf.partition(b"\n")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError as e:
            self.kill()
            raise WorkerCrashed(f"worker sent a malformed reply to {what}: {e}") from None
        if not isinstance(reply, dict):
            self.kill()
            raise WorkerCrashed(f"worker sent a non-object reply to {what}")
        return reply

    def request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request and return the handler's reply (kills the worker on failure)."""
        if not self.alive:
            raise WorkerCrashed("the worker is not running (it was stopped earlier)")
        assert self.proc is not None and self.proc.stdin is not None
        what = f"request {message.get('op', '?')!r}"
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died(what) from None
        return self._receive(time.monotonic() + timeout_s, what)

    def kill(self) -> None:
        """Kill the worker's whole process group and reap it. Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered
                pass
            for stream in (proc.stdin, proc.stdout):
                try:
                    if stream is not None:
                        stream.close()
                except OSError:
                    pass
        _LIVE.discard(self)
        try:
            self._stderr.close()
        except OSError:
            pass
        shutil.rmtree(self._workdir, ignore_errors=True)

    close = kill

    def __del__(self) -> None:
        try:
            self.kill()
        except Exception:
            pass


@atexit.register
def _kill_all() -> None:
    """Kill every live worker when the interpreter exits (registered with ``atexit``)."""
    for worker in list(_LIVE):
        worker.kill()


# ---------------------------------------------------------------------------------------
# Worker side.


def _apply_limits(limits: dict[str, int | None]) -> None:
    def cap(kind: int, value: int | None) -> None:
        if value is None:
            return
        soft, hard = resource.getrlimit(kind)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(kind, (value, hard if kind != resource.RLIMIT_CPU else value + 1))

    cap(resource.RLIMIT_AS, limits.get("memory_bytes"))
    cap(resource.RLIMIT_CPU, limits.get("cpu_seconds"))
    cap(resource.RLIMIT_FSIZE, limits.get("file_size_bytes"))
    cap(resource.RLIMIT_NOFILE, limits.get("open_files"))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _worker_main(repo_root: str, handler_spec: str, limits_json: str) -> None:

    # Private protocol descriptors; dataset code sees /dev/null as stdin, stderr as stdout.
    proto_in = os.fdopen(os.dup(0), "rb")
    proto_out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)

    def send(obj: dict[str, Any]) -> None:
        proto_out.write(json.dumps(obj, default=str).encode() + b"\n")
        proto_out.flush()

    sys.path.insert(0, repo_root)
    for name, sub in (("lopd_jax", "lopd_jax"), ("lopd_jax.envs", "lopd_jax/envs")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [os.path.join(repo_root, sub)]
        sys.modules[name] = pkg
    try:
        _apply_limits(json.loads(limits_json))
        module_name, cls_name = handler_spec.split(":", 1)
        handler = getattr(importlib.import_module(module_name), cls_name)()
    except BaseException as e:  # report start-up failures instead of dying silently
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return
    send({"ready": True})
    for line in proto_in:
        try:
            request = json.loads(line)
            reply = handler.handle(request)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # SystemExit from dataset code included
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        send(reply)


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--worker":
    _worker_main(sys.argv[2], sys.argv[3], sys.argv[4])

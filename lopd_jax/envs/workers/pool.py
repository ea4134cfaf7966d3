"""A small pool of idle :class:`lopd_jax.envs.workers.isolation.Worker` processes per handler.

Starting a worker costs an interpreter start plus the handler's imports (~0.3 s); an
environment that needs a fresh *state* per episode, not a fresh *process*, takes one from
:func:`acquire` at reset and gives it back with :func:`release` when the episode ends. The
handler's ``init`` request must reset every piece of episode state. A worker that timed
out or crashed is dead (``Worker`` kills it) and is never pooled again. Thread-safe.
"""

from __future__ import annotations

import threading

from lopd_jax.envs.workers.isolation import ResourceLimits, Worker, WorkerError

MAX_IDLE_PER_HANDLER = 16
_idle: dict[tuple[str, ResourceLimits], list[Worker]] = {}
_lock = threading.Lock()
_handlers: set[str] = set()


def acquire(handler: str, limits: ResourceLimits, start_timeout_s: float = 15.0) -> Worker:
    """An idle live worker of ``handler`` with ``limits``, or a newly started one."""
    key = (handler, limits)
    with _lock:
        _handlers.add(handler)
        idle = _idle.setdefault(key, [])
        while idle:
            worker = idle.pop()
            if worker.alive:
                return worker
    return Worker(handler, limits, start_timeout_s)


def release(worker: Worker | None, limits: ResourceLimits) -> None:
    """Return ``worker`` to the pool (killed instead when dead or the pool is full)."""
    if worker is None:
        return
    if not worker.alive:
        worker.kill()
        return
    with _lock:
        idle = _idle.setdefault((worker.handler, limits), [])
        if len(idle) < MAX_IDLE_PER_HANDLER:
            idle.append(worker)
            return
    worker.kill()


def prestart(handler: str, limits: ResourceLimits, start_timeout_s: float = 15.0) -> None:
    """Start one worker in the background and pool it (after a kill, so that the next
    :func:`acquire` does not wait for an interpreter start)."""

    with _lock:
        _handlers.add(handler)

    def start() -> None:
        try:
            release(Worker(handler, limits, start_timeout_s), limits)
        except WorkerError:
            pass

    threading.Thread(target=start, name="lopd-worker-prestart", daemon=True).start()


def is_pool_worker(cmdline: list[str]) -> bool:
    """Whether a process command line is a worker of a pooled handler (idle, in use or
    being pre-started): leak checks of other components skip these."""
    with _lock:
        handlers = set(_handlers)
    return "--worker" in cmdline and any(h in cmdline for h in handlers)

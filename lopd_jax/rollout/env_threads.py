"""Threads that run environment steps for the engine, and can give up on a hung one.

An engine keeps one pool for all its runs (:meth:`lopd_jax.rollout.engine.Engine.close`
ends it). A Python thread cannot be killed, so a step that runs past its deadline is
*abandoned*: the engine stops waiting for it, :meth:`EnvThreads.abandon` starts a replacement
thread so the pool keeps its width, and the stuck thread (a daemon: it never blocks
interpreter exit) exits on its own once its step returns. Closing the environment (e.g.
killing its worker process, :mod:`lopd_jax.envs.workers`) is what frees a thread stuck in a
step for good.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable

__all__ = ["EnvThreads", "submit_inline"]


def submit_inline(fn: Callable, *args) -> concurrent.futures.Future:
    """``fn(*args)`` right here, as a finished future (what a pool would deliver)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()
    try:
        fut.set_result(fn(*args))
    except Exception as exc:  # delivered through the future, as a pool would
        fut.set_exception(exc)
    return fut


class EnvThreads:
    """``workers`` daemon threads taking ``fn(*args)`` jobs in submission order.

    ``abandoned``: steps given up on so far; ``started``: threads started in all.
    """

    def __init__(self, workers: int, name: str = "env-step"):
        if workers < 1:
            raise ValueError(f"EnvThreads needs at least one worker, got {workers}")
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._lock = threading.Lock()
        self.started = 0
        self.abandoned = 0
        self._closed = False
        self._given_up: set[concurrent.futures.Future] = set()  # abandoned while running: their thread exits after
        for _ in range(workers):
            self._start()

    def _start(self) -> None:
        with self._lock:
            self.started += 1
            n = self.started
        threading.Thread(target=self._work, name=f"{self._name}-{n}", daemon=True).start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 -- delivered to the engine, which ends the episode
                fut.set_exception(exc)
            with self._lock:
                if fut in self._given_up:  # a replacement took this thread's place
                    self._given_up.discard(fut)
                    return

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Queue ``fn(*args)``; its future."""
        if self._closed:
            raise RuntimeError("EnvThreads is closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((fut, fn, args))
        return fut

    def abandon(self, fut: concurrent.futures.Future, count: bool = True) -> None:
        """Stop counting on ``fut``'s thread: a queued job is cancelled; a running one keeps
        its thread (which exits once the job returns), and a replacement thread keeps the
        pool's width. ``count``: add it to :attr:`abandoned` (a step given up on)."""
        if fut.cancel():
            return
        self.abandoned += count
        with self._lock:
            if fut.done():  # it returned meanwhile: its thread is back in the pool
                return
            self._given_up.add(fut)
        self._start()

    def close(self) -> None:
        """Let every thread exit when it is idle (one stop mark per thread ever started;
        an abandoned thread exits once its step returns); never waits."""
        self._closed = True
        with self._lock:
            n = self.started
        for _ in range(n):
            self._jobs.put(None)

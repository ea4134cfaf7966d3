"""Progress a user sees on any terminal: plain lines at a bounded interval.

A tqdm bar with ``dynamic_ncols`` draws nothing on a terminal that reports width 0, and in a
log file (not a terminal) its carriage-return updates pile up on one line. :func:`bar_mode`
says which display a stream gets: a live bar (a terminal with a width), a fixed-width bar (a
terminal that reports width 0) or plain lines (anything else). :class:`LineProgress` writes
those plain lines, at least every ``every`` seconds while updates arrive; :class:`Heartbeat`
tells a waiting loop when its next line is due. Both take a clock, so tests drive them.
A program whose work runs in child processes that log to files follows them: :func:`run_position`
reads a run's newest ``metrics.jsonl`` record, :func:`run_and_follow` runs a command into a log
and prints a line about it every ``INTERVAL_S``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Collection, Literal, Sequence, TextIO

INTERVAL_S = 30.0  # the longest a long program stays silent
FIXED_NCOLS = 100  # the bar's width on a terminal that reports none


def bar_mode(stream: Any) -> Literal["dynamic", "fixed", "lines"]:
    """``dynamic`` for a terminal with a width, ``fixed`` for a terminal that reports width 0
    (or none), ``lines`` for anything that is not a terminal (a file, a pipe, a buffer)."""
    try:
        if not stream.isatty():
            return "lines"
        return "dynamic" if os.get_terminal_size(stream.fileno()).columns > 0 else "fixed"
    except (AttributeError, OSError, ValueError):
        return "lines"


def format_seconds(s: float) -> str:
    """``s`` as ``42s``, ``3m05s`` or ``1h02m``."""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta(done: float, total: float, elapsed: float) -> str:
    """The time left at the pace so far (``?`` before any progress)."""
    if done <= 0 or elapsed <= 0:
        return "?"
    return format_seconds(elapsed * max(0.0, total - done) / done)


class Heartbeat:
    """``due()`` is True at most once per ``every`` seconds of ``clock``, the first time right
    away (``at_once``) or after ``every`` seconds."""

    def __init__(self, every: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 at_once: bool = True):
        self.every, self.clock = every, clock
        self._last: float | None = None if at_once else clock()

    def due(self) -> bool:
        """Whether a line is due now (and, if so, restart the interval)."""
        now = self.clock()
        if self._last is not None and now - self._last < self.every:
            return False
        self._last = now
        return True


class LineProgress:
    """``desc: n/total unit (rate, ETA) k=v ...`` lines: on the first update, then whenever
    ``every`` seconds have passed since the last line, and on :meth:`close`."""

    def __init__(self, total: int, desc: str, *, initial: int = 0, unit: str = "step",
                 file: TextIO | None = None, every: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.desc, self.unit, self.n, self.initial = total, desc, unit, initial, initial
        self.file, self.clock = file, clock
        self.postfix: dict[str, Any] = {}
        self._start = clock()
        self._beat = Heartbeat(every, clock)
        self._closed = False

    @property
    def elapsed(self) -> float:
        """Seconds since the start."""
        return self.clock() - self._start

    def line(self) -> str:
        """The current line."""
        done, elapsed = self.n - self.initial, self.elapsed
        pace = f"{elapsed / done:.2f} s/{self.unit}" if done > 0 else "first " + self.unit
        text = (f"{self.desc}: {self.n}/{self.total} {self.unit}s ({pace}, "
                f"elapsed {format_seconds(elapsed)}, ETA {eta(done, self.total - self.initial, elapsed)})")
        return text + "".join(f" {k}={v}" for k, v in self.postfix.items())

    def update(self, n: int = 1) -> None:
        """Advance by ``n``; write a line when one is due."""
        self.n += n
        if self._beat.due():
            self._write()

    def close(self) -> None:
        """Write the last line (once)."""
        if not self._closed:
            self._closed = True
            self._write()

    def _write(self) -> None:
        print(self.line(), file=self.file or sys.stderr, flush=True)


class Pulse:
    """``with Pulse(describe):`` prints ``describe(elapsed seconds)`` when the block starts
    (``at_once``) and every ``every`` seconds while it runs, from a background thread: for one
    long step (a first compile) or a loop whose own lines may come further apart."""

    def __init__(self, describe: Callable[[float], str], every: float = INTERVAL_S, *, at_once: bool = True,
                 file: TextIO | None = None):
        self.describe, self.every, self.at_once, self.file = describe, every, at_once, file
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _say(self, elapsed: float) -> None:
        print(self.describe(elapsed), file=self.file or sys.stderr, flush=True)

    def _beat(self, t0: float) -> None:
        while not self._stop.wait(self.every):
            self._say(time.monotonic() - t0)

    def __enter__(self) -> "Pulse":
        t0 = time.monotonic()
        if self.at_once:
            self._say(0.0)
        self._thread = threading.Thread(target=self._beat, args=(t0,), name="lopd-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def run_position(run_dir: str, skip_stages: Collection[str] = ()) -> tuple[str, int]:
    """``(stage, step)`` of the newest record in ``run_dir/metrics.jsonl`` whose stage is not in
    ``skip_stages`` (``("", 0)`` before the first); a line still being written is skipped."""
    stage, step = "", 0
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for ln in f:
                try:
                    r = json.loads(ln)
                except ValueError:
                    continue
                if isinstance(r, dict) and r.get("stage") not in skip_stages:
                    stage, step = str(r.get("stage", "")), int(r.get("step") or 0)
    except OSError:
        pass
    return stage, step


def describe_run(run_dir: str, label: str, steps: int, stage: str = "lopd") -> Callable[[float], str]:
    """``describe(elapsed)`` for :func:`run_and_follow` of a training run in ``run_dir``: its
    newest stage and step and, in stage ``stage`` of ``steps`` steps, the ETA at the pace
    since that stage was first seen."""
    seen: list[float] = []  # (elapsed, step) when ``stage`` was first seen: the pace counts from there

    def describe(elapsed: float) -> str:
        now, step = run_position(run_dir)
        line = f"{label}: " + (f"{now} step {step}" if now else "starting") + f", {format_seconds(elapsed)}"
        if now == stage:
            seen[:] = seen or [elapsed, step]
            line += f"; {stage} {step}/{steps}, ETA {eta(step - seen[1], steps - seen[1], elapsed - seen[0])}"
        return line

    return describe


def run_and_follow(cmd: Sequence[str], log: str, describe: Callable[[float], str], *, cwd: str | None = None,
                   env: dict | None = None, every: float = INTERVAL_S, poll_s: float = 2.0,
                   file: TextIO | None = None) -> int:
    """Run ``cmd`` with its output appended to file ``log``; every ``every`` seconds while it runs
    print ``describe(elapsed seconds)``. Returns its exit status."""
    beat, t0 = Heartbeat(every, at_once=False), time.monotonic()
    with open(log, "a") as f:
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    return proc.wait(timeout=poll_s)
                except subprocess.TimeoutExpired:
                    if beat.due():
                        print(describe(time.monotonic() - t0), file=file or sys.stderr, flush=True)
        finally:
            if proc.poll() is None:  # interrupted: the child stops with its parent
                proc.terminate()
                proc.wait()


__all__ = ["INTERVAL_S", "FIXED_NCOLS", "bar_mode", "format_seconds", "eta", "Heartbeat", "LineProgress", "Pulse", "run_position", "describe_run", "run_and_follow"]

"""lopd_jax.io.progress: plain progress lines at a bounded interval on any stream, the bar's
mode on a terminal that reports width 0, and following a child process."""

import fcntl
import io
import os
import select
import struct
import sys
import termios
import time

from lopd_jax.io import progress
from lopd_jax.io.progress import Heartbeat, LineProgress, Pulse, bar_mode, eta, run_and_follow, run_position


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_line_progress_writes_at_most_every_interval_and_at_close():
    clock, buf = FakeClock(), io.StringIO()
    p = LineProgress(10, "lopd", file=buf, every=30, clock=clock)
    clock.t += 5
    p.update(1)  # the first update: a line at once
    clock.t += 20
    p.update(1)  # 20 s later: not yet
    clock.t += 10
    p.postfix["reward"] = "0.5"
    p.update(1)  # 30 s after the last line: one
    p.close()
    p.close()  # once
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert lines[0].startswith("lopd: 1/10 steps (5.00 s/step")
    assert "3/10" in lines[1] and "ETA 1m22s" in lines[1] and lines[1].endswith("reward=0.5")


def test_heartbeat_and_eta():
    clock = FakeClock()
    beat = Heartbeat(30, clock)
    assert beat.due() and not beat.due()
    clock.t += 29.9
    assert not beat.due()
    clock.t += 0.1
    assert beat.due()
    assert not Heartbeat(30, clock, at_once=False).due()
    assert eta(0, 10, 5) == "?" and eta(5, 10, 50) == "50s" and eta(1, 100, 60) == "1h39m"


def _pty(columns: int):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return master, os.fdopen(slave, "w")


def _read_all(master: int) -> str:
    """Everything written to the terminal so far (a pty hands it over in pieces)."""
    chunks = []
    while select.select([master], [], [], 0.5)[0]:
        chunk = os.read(master, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def test_bar_mode_of_a_terminal_without_a_width_and_of_a_file():
    assert bar_mode(io.StringIO()) == "lines"
    master, tty = _pty(0)
    try:
        assert bar_mode(tty) == "fixed"
        fcntl.ioctl(tty.fileno(), termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        assert bar_mode(tty) == "dynamic"
    finally:
        tty.close()
        os.close(master)


def test_training_progress_shows_on_a_terminal_of_width_0():
    from train.metrics import Progress

    master, tty = _pty(0)
    try:
        with Progress(10, "lopd", enabled=True, file=tty) as p:
            for _ in range(4):
                p.update(1, reward=0.5)
        tty.flush()
        shown = _read_all(master)
    finally:
        tty.close()
        os.close(master)
    assert "lopd" in shown and "4/10" in shown and "reward=0.5" in shown


def test_progress_off_a_terminal_is_plain_lines_even_between_updates():
    from train.metrics import Progress

    buf = io.StringIO()
    with Progress(10, "lopd", enabled=True, file=buf, every=0.05) as p:
        p.update(1)
        time.sleep(0.3)  # a long step: the pulse still writes
    lines = buf.getvalue().splitlines()
    assert "\r" not in buf.getvalue() and len(lines) >= 3 and all(ln.startswith("lopd: 1/10") for ln in lines)


def test_pulse_says_what_a_long_step_does():
    buf = io.StringIO()
    with Pulse(lambda t: f"compiling, {t:.1f}s", every=0.05, file=buf):
        time.sleep(0.3)
    lines = buf.getvalue().splitlines()
    assert lines[0] == "compiling, 0.0s" and len(lines) >= 3


def test_run_and_follow_reports_a_child_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = ("import json, time, sys\n"
              "for s in range(1, 4):\n"
              "    open(sys.argv[1], 'a').write(json.dumps({'stage': 'lopd', 'step': s}) + '\\n')\n"
              "    time.sleep(0.15)\n"
              "print('done')\n")
    buf, log = io.StringIO(), str(tmp_path / "run.log")
    code = run_and_follow([sys.executable, "-c", script, str(run_dir / "metrics.jsonl")], log,
                          progress.describe_run(str(run_dir), "[test] run", 3), every=0.1, poll_s=0.02, file=buf)
    assert code == 0 and open(log).read() == "done\n"
    lines = buf.getvalue().splitlines()
    assert lines and all(ln.startswith("[test] run: ") for ln in lines)
    assert any("lopd step" in ln for ln in lines)
    assert run_position(str(run_dir)) == ("lopd", 3)
    assert run_position(str(run_dir), skip_stages=("lopd",)) == ("", 0)

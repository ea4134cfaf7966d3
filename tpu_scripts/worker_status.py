"""Decide, from every worker's log, whether a program launched by run.sh is under way.

    tpu_ssh 'bash tpu_scripts/worker.sh report train' | python3 tpu_scripts/worker_status.py --until=started

Reads the ``LOPD-WORKER <i> <exit status or -> <base64 log tail>`` lines that
``worker.sh report`` prints on each worker (other lines are ignored) and exits

* 0 when every worker is under way (``--until=started``: each printed its device line,
  i.e. joined the N-process run, and process 0 printed that the model and system are
  built on every device; ``--until=exited``: each exited 0), or exited 0;
* 1 when a worker exited non-zero: its error line and the end of its log are printed;
* 3 while neither holds: one line saying which workers are still pending.

Standard library only: it runs where gcloud runs, outside the project's environment.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import re
import sys

# the lines lopd_jax programs print (lopd_jax/io/startup.py: describe_devices, train/loop.py)
DEVICES = re.compile(r"^\[lopd\] devices: .*process (\d+) of (\d+)\s*$", re.M)
BUILT = "[lopd] built the model and system"
TAIL_LINES = 40
EXIT_OK, EXIT_FAILED, EXIT_PENDING = 0, 1, 3


@dataclasses.dataclass
class Worker:
    """One worker's report: its index, exit status (None while running) and log tail."""

    index: int
    status: int | None
    log: str

    @property
    def process(self) -> tuple[int, int] | None:
        """(process index, process count) from the device line, or None before it."""
        m = DEVICES.search(self.log)
        return (int(m.group(1)), int(m.group(2))) if m else None


def parse(text: str) -> list[Worker]:
    """The workers' reports in ``text`` (one per worker index, the last line wins), by index."""
    found: dict[int, Worker] = {}
    for line in text.splitlines():
        parts = line.strip().split(" ")
        if len(parts) < 3 or parts[0] != "LOPD-WORKER" or not parts[1].isdigit():
            continue
        status = None if parts[2] == "-" else int(parts[2])
        log = base64.b64decode(parts[3]).decode("utf-8", "replace") if len(parts) > 3 else ""
        found[int(parts[1])] = Worker(int(parts[1]), status, log)
    return [found[i] for i in sorted(found)]


def error_line(log: str) -> str:
    """The line that says why a program stopped: the last ``error:`` / ``stopped:`` line,
    else the last line of the log."""
    lines = [ln for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith(("error:", "stopped:")):
            return ln
    return lines[-1] if lines else "(empty log)"


def decide(workers: list[Worker], until: str) -> tuple[int, str]:
    """(exit code, message) for the reports (see the module docstring)."""
    if not workers:
        return EXIT_PENDING, "no worker has reported yet"
    failed = [w for w in workers if w.status not in (None, 0)]
    if failed:
        w = failed[0]
        tail = "\n".join(w.log.splitlines()[-TAIL_LINES:])
        others = "" if len(failed) == 1 else f" (workers {', '.join(str(f.index) for f in failed[1:])} failed too)"
        return EXIT_FAILED, (f"worker {w.index} exited with status {w.status}{others}: {error_line(w.log)}\n"
                             f"--- the end of worker {w.index}'s log ---\n{tail}")
    expected = max([len(workers)] + [w.process[1] for w in workers if w.process])
    if until == "exited":
        done = [w for w in workers if w.status == 0]
    else:
        main = [w for w in workers if w.process and w.process[0] == 0]
        going = bool(main) and (BUILT in main[0].log or main[0].status == 0)
        done = [w for w in workers if w.status == 0 or (w.process is not None and going)]
    if len(done) == expected:
        verb = "exited 0" if until == "exited" else "are under way"
        return EXIT_OK, f"all {expected} workers {verb}"
    waiting = [w for w in workers if w not in done]
    last = {w.index: (w.log.strip().splitlines() or ["(no output yet)"])[-1][:160] for w in waiting}
    missing = expected - len(workers)
    note = f"; {missing} worker(s) not reporting" if missing > 0 else ""
    return EXIT_PENDING, (f"{len(done)}/{expected} workers {'exited' if until == 'exited' else 'under way'}{note}; "
                          + "; ".join(f"worker {i}: {s}" for i, s in last.items()))


def main(argv=None) -> int:
    """Read the reports from stdin, print the decision, return its exit code."""
    p = argparse.ArgumentParser(prog="python3 tpu_scripts/worker_status.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--until", choices=("started", "exited"), default="started",
                   help="started: every worker joined and the model is built; exited: every worker exited 0")
    args = p.parse_args(argv)
    code, message = decide(parse(sys.stdin.read()), args.until)
    print(message, file=sys.stderr if code == EXIT_FAILED else sys.stdout, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

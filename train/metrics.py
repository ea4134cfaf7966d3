"""Metrics: JSONL records, TensorBoard scalars, console progress, and the run plot.

:class:`MetricsWriter` writes one JSON line per record to ``<workdir>/metrics.jsonl``
(``step``, ``stage``, ``time``, ``elapsed``, then the metrics) and the numeric values as
TensorBoard scalars ``<stage>/<name>`` under ``<workdir>/tb``. On a ``gs://`` workdir the
JSONL file is an :class:`lopd_jax.io.files.AppendFile` and the event files are written
locally and copied at every flush (tensorboardX's own gs:// writer re-uploads its objects
at garbage collection). Only process 0 writes. :class:`Progress` is a tqdm bar for a stage
of known length; :func:`plot_run` draws the paper's Figure 4 layout (mean reward, Delta,
beta against cumulative rollouts) from the metric names ``reward_mean``, ``delta``,
``beta`` and ``rollouts``.
"""

from __future__ import annotations

import io
import json
import math
import numbers
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Iterable, Mapping

import jax
import numpy as np
from tqdm import tqdm

from lopd_jax.io import files, progress
from lopd_jax.io.paths import is_url

METRICS_FILE = "metrics.jsonl"


def _scalar(v: Any) -> Any:
    """A JSON value for ``v``: Python scalars pass, numpy / jax 0-d arrays become numbers."""
    if isinstance(v, (bool, str)) or v is None:
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        return float(v)
    if hasattr(v, "shape") and hasattr(v, "dtype"):
        arr = np.asarray(v)
        if arr.ndim == 0:
            return arr.item()
        raise ValueError(f"metric arrays must be scalars, got shape {arr.shape}; reduce it first.")
    if isinstance(v, (list, tuple)):
        return [_scalar(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _scalar(x) for k, x in v.items()}
    raise TypeError(f"metric value of type {type(v).__name__} is not JSON-serializable.")


class MetricsWriter:
    """JSONL + TensorBoard (+ console) writer for one run directory.

    Args:
      workdir: run directory (created); the JSONL file is appended to, so a resumed
        run continues the same file.
      tensorboard: also write TensorBoard event files under ``<workdir>/tb``.
      console: print one short line per record (through ``tqdm.write``, so progress
        bars stay intact).
      enabled: default ``jax.process_index() == 0``; a disabled writer does nothing.
    """

    def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True, console: bool = False,
                 enabled: bool | None = None, filename: str = METRICS_FILE):
        self.workdir = str(workdir)
        self.enabled = jax.process_index() == 0 if enabled is None else enabled
        self.path = files.join(self.workdir, filename)
        self.console = console
        self._start = time.time()
        self._file = None
        self._tb = None
        self._tb_scratch = None  # gs:// workdirs: the local directory of the event files
        if self.enabled:
            files.makedirs(self.workdir)
            self._file = files.AppendFile(self.path)  # local: line-buffered, a crash loses no record
            if tensorboard:
                from tensorboardX import SummaryWriter  # only with TensorBoard logging
                logdir = files.join(self.workdir, "tb")
                if is_url(logdir):
                    self._tb_scratch = tempfile.mkdtemp(prefix="lopd_tb-")
                    logdir = self._tb_scratch
                self._tb = SummaryWriter(logdir=logdir)

    def write(self, step: int, stage: str, metrics: Mapping[str, Any]) -> dict[str, Any] | None:
        """Record ``metrics`` for ``step`` of ``stage``; returns the record (None if disabled)."""
        if not self.enabled:
            return None
        clash = {"step", "stage", "time", "elapsed"} & set(metrics)
        if clash:
            raise ValueError(f"metric names {sorted(clash)} are reserved for the record header; rename them.")
        now = time.time()
        record = {"step": int(step), "stage": str(stage), "time": now, "elapsed": now - self._start}
        record.update({str(k): _scalar(v) for k, v in metrics.items()})
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k not in ("step", "stage", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{stage}/{k}", v, global_step=int(step), walltime=now)
        if self.console:
            tqdm.write(format_line(record), file=sys.stderr)
        return record

    def flush(self) -> None:
        """Push buffered records to storage (local JSONL lines are written at once; a
        ``gs://`` JSONL object is rewritten) and TensorBoard events."""
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()
            self._upload_tb()

    def close(self) -> None:
        """Flush and close the files."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
            self._upload_tb()
        if self._tb_scratch is not None:
            shutil.rmtree(self._tb_scratch, ignore_errors=True)
            self._tb_scratch = None

    def _upload_tb(self) -> None:
        """gs:// workdirs: copy the local event files to ``<workdir>/tb`` (whole files)."""
        if self._tb_scratch is None:
            return
        for name in sorted(os.listdir(self._tb_scratch)):
            with open(os.path.join(self._tb_scratch, name), "rb") as f:
                files.write_bytes(files.join(self.workdir, "tb", name), f.read())

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def format_line(record: Mapping[str, Any], keys: Iterable[str] | None = None) -> str:
    """``[stage step] k=v ...`` with 4 significant digits (``keys`` picks and orders)."""
    skip = {"step", "stage", "time", "elapsed"}
    keys = [k for k in (keys or record) if k not in skip and k in record]
    parts = []
    for k in keys:
        v = record[k]
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return f"[{record.get('stage', '?')} {record.get('step', '?')}] " + " ".join(parts)


def read_metrics(path: str | os.PathLike, stage: str | None = None) -> list[dict[str, Any]]:
    """Records of a metrics JSONL file (optionally one stage's), in file order, as the run
    that survived wrote them: a run killed after its last checkpoint redoes the steps
    since, so a record of step k supersedes the earlier records of its stage with step
    >= k (the lost attempt's).

    A torn last line (a crash mid-write) is ignored; a bad line elsewhere is an error.
    """
    lines = files.read_text(os.fspath(path)).split("\n")
    out: list[dict[str, Any]] = []
    last: dict[Any, int] = {}  # stage -> its latest step kept
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i >= len(lines) - 2:
                break
            raise ValueError(f"{path}:{i + 1} is not a JSON record: {line[:80]!r}") from None
        if stage is None or rec.get("stage") == stage:
            step, name = rec.get("step"), rec.get("stage")
            if isinstance(step, int):
                if step <= last.get(name, step - 1):  # a rewind: drop the lost attempt's records
                    out = [r for r in out if not (r.get("stage") == name and isinstance(r.get("step"), int)
                                                  and r["step"] >= step)]
                last[name] = step
            out.append(rec)
    return out


class Progress:
    """A progress display for a stage of ``total`` steps (rate and ETA included).

    ``update(n, **postfix)`` advances and shows a few metrics; disabled on processes
    other than 0 unless ``enabled`` says otherwise. ``initial`` resumes mid-stage. On a
    terminal it is a tqdm bar (a fixed width when the terminal reports width 0); elsewhere (a
    log file, a pipe) plain lines at least every ``every`` seconds, also while one step runs
    (:mod:`lopd_jax.io.progress`).
    """

    def __init__(self, total: int, desc: str, *, initial: int = 0, unit: str = "step",
                 enabled: bool | None = None, file=None, every: float = progress.INTERVAL_S):
        enabled = jax.process_index() == 0 if enabled is None else enabled
        file = file or sys.stderr
        mode = progress.bar_mode(file)
        self._lines = (progress.LineProgress(total, desc, initial=initial, unit=unit, file=file, every=every)
                       if enabled and mode == "lines" else None)
        # plain lines also between updates: a step longer than the interval still shows its stage
        self._pulse = (progress.Pulse(lambda _: self._lines.line(), every, at_once=False, file=file).__enter__()
                       if self._lines is not None else None)
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, file=file, smoothing=0.1,
                         disable=not enabled or self._lines is not None, dynamic_ncols=mode == "dynamic",
                         ncols=None if mode == "dynamic" else progress.FIXED_NCOLS)

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Advance by ``n`` steps; ``postfix`` metrics are shown beside the bar."""
        shown = {k: (f"{_scalar(v):.4g}" if isinstance(_scalar(v), float) else v) for k, v in postfix.items()}
        if self._lines is not None:
            self._lines.postfix.update(shown)
            self._lines.update(n)
            return
        if postfix:
            self._bar.set_postfix(shown, refresh=False)
        self._bar.update(n)

    @property
    def n(self) -> int:
        """Steps done."""
        return self._lines.n if self._lines is not None else self._bar.n

    def rate(self) -> float | None:
        """Steps per second so far (None before the first update)."""
        if self._lines is not None:
            elapsed, done = self._lines.elapsed, self._lines.n - self._lines.initial
        else:
            elapsed = self._bar.format_dict.get("elapsed") or 0.0
            done = self._bar.n - self._bar.initial
        return done / elapsed if elapsed > 0 and done > 0 else None

    def close(self) -> None:
        """Finish the bar (or write the last line)."""
        if self._pulse is not None:
            self._pulse.__exit__(None, None, None)
        if self._lines is not None:
            self._lines.close()
        self._bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- plot


def _x_axis(records: list[dict[str, Any]], rollouts_key: str):
    """``(rows, x)``: one record per step in step order and its x = cumulative rollouts
    (or the step when none are logged)."""
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:  # a resumed run may repeat steps: the last record of a step wins
        by_step[int(r["step"])] = r
    rows = [by_step[s] for s in sorted(by_step)]
    if any(rollouts_key in r for r in rows):
        return rows, np.cumsum([float(r.get(rollouts_key, 0) or 0) for r in rows])
    return rows, np.array([float(r["step"]) for r in rows])


def _series(records: list[dict[str, Any]], key: str, rollouts_key: str):
    """(x, y) for ``key``: x = cumulative rollouts (or step when none are logged)."""
    rows, x = _x_axis(records, rollouts_key)
    y = np.array([float(r[key]) if isinstance(r.get(key), (int, float)) else math.nan for r in rows])
    keep = ~np.isnan(y)
    return x[keep], y[keep]


def _held_out_series(path, records, eval_stages, reward_key: str, rollouts_key: str):
    """(x, y) of the held-out evaluations on the training records' x axis, or None."""
    evals = {int(r["step"]): float(r[reward_key]) for r in read_metrics(path)
             if r.get("stage") in eval_stages and isinstance(r.get(reward_key), (int, float))}
    if not evals or not records:
        return None
    rows, x = _x_axis(records, rollouts_key)
    done = {int(r["step"]): float(v) for r, v in zip(rows, x)}
    done[0] = 0.0
    pts = sorted((done[s], y) for s, y in evals.items() if s in done)
    return (np.array([p[0] for p in pts]), np.array([p[1] for p in pts])) if pts else None


PLAIN_DELTA_KEY = "delta_vs_plain_teacher"
SHARE_KEYS = ("composer_grad_share_distill", "composer_grad_share_margin", "composer_grad_share_anchor")


def plot_run(metrics_jsonl: str | os.PathLike, out_png: str | os.PathLike, *, stage: str | None = "lopd",
             reward_key: str = "reward_mean", delta_key: str = "delta", beta_key: str = "beta",
             rollouts_key: str = "rollouts", margin: float | None = None, title: str | None = None,
             eval_stages: tuple[str, ...] = ("eval_before", "eval", "eval_after")) -> str:
    """Figure 4 layout: reward, Delta and beta against cumulative rollouts, then each loss
    term's share of the composer's gradient; returns the path.

    Stacked panels sharing the x axis. ``margin`` draws the target m on the Delta panel,
    beside Delta against the teacher without latents when the run logged it. The held-out evaluations (records of ``eval_stages``, logged at LOPD step s)
    join the reward panel as a second line at the rollouts done by step s. Metrics absent
    from the file are left out; none present is an error.
    """
    import matplotlib  # heavy: only the plot needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use('Agg'): no display needed

    records = read_metrics(metrics_jsonl, stage)
    panels = [(reward_key, "mean reward"), (delta_key, "Δ (privilege margin)"), (beta_key, "β (dual variable)"),
              (SHARE_KEYS[0], "share of the\ncomposer's gradient")]
    series = [(k, label, *_series(records, k, rollouts_key)) for k, label in panels]
    series = [s for s in series if len(s[2])]
    if not series:
        raise ValueError(f"{metrics_jsonl} has no {[k for k, _ in panels]} values"
                         f"{f' for stage {stage!r}' if stage else ''}; nothing to plot.")
    has_rollouts = any(rollouts_key in r for r in records)
    fig, axes = plt.subplots(len(series), 1, sharex=True, figsize=(6.4, 2.2 * len(series) + 0.6), squeeze=False)
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple")
    held_out = _held_out_series(metrics_jsonl, records, eval_stages, reward_key, rollouts_key)
    for ax, (key, label, x, y), color in zip(axes[:, 0], series, colors):
        ax.plot(x, y, color=color, lw=1.5, marker="o" if len(x) < 40 else None, ms=3,
                label="rollouts (sampled)" if key == reward_key and held_out else None)
        if key == reward_key and held_out:
            ax.plot(*held_out, color="tab:red", lw=1.5, marker="s", ms=4, label="held-out (greedy)")
            ax.legend(loc="best", fontsize=8)
        if key == delta_key:
            plain = _series(records, PLAIN_DELTA_KEY, rollouts_key)
            if len(plain[0]):
                ax.lines[-1].set_label("vs the student")
                ax.plot(*plain, color="tab:brown", lw=1.2, ls="-.", label="vs the teacher without latents")
            if margin is not None:
                ax.axhline(margin, color="gray", ls="--", lw=1, label=f"m = {margin:g}")
            if len(plain[0]) or margin is not None:
                ax.legend(loc="best", fontsize=8)
        if key == SHARE_KEYS[0]:
            ax.lines[-1].set_label("distillation")
            for k, c, name in zip(SHARE_KEYS[1:], ("tab:red", "tab:gray"), ("margin", "anchor")):
                ax.plot(*_series(records, k, rollouts_key), color=c, lw=1.5, label=name)
            ax.set_ylim(-0.02, 1.02)
            ax.legend(loc="best", fontsize=8)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("rollouts (cumulative trajectories)" if has_rollouts else "step")
    run_dir = os.fspath(metrics_jsonl).rstrip("/").rsplit("/", 1)[0] if is_url(os.fspath(metrics_jsonl)) \
        else os.path.dirname(os.path.abspath(metrics_jsonl))
    fig.suptitle(title or f"{run_dir.rstrip('/').rsplit('/', 1)[-1]}{f' - {stage}' if stage else ''}")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    files.write_bytes(os.fspath(out_png), buf.getvalue())  # local or gs://
    return str(out_png)


__all__ = ["MetricsWriter", "Progress", "read_metrics", "format_line", "plot_run", "METRICS_FILE"]

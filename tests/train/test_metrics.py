"""Metrics: JSONL round trip, TensorBoard events, progress bar, the reward/Delta/beta plot."""

import glob
import io
import json
import struct

import jax.numpy as jnp
import numpy as np
import pytest

from train.metrics import MetricsWriter, Progress, format_line, plot_run, read_metrics

pytestmark = pytest.mark.timeout(60)


def _tb_scalars(logdir):
    """{(tag, step): value} from tensorboardX event files (TFRecord framing)."""
    from tensorboardX.proto import event_pb2
    out = {}
    for path in glob.glob(f"{logdir}/events.out.tfevents.*"):
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos:pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out[(v.tag, ev.step)] = v.simple_value
    return out


def _lopd_records(writer, n=12, start=0):
    for s in range(start, n):
        writer.write(s, "lopd", {"reward_mean": 0.3 + 0.02 * s, "delta": 0.1 - 0.005 * s,
                                 "beta": max(0.0, 0.01 * (s - 4)), "rollouts": 32})


def test_records_round_trip_and_tensorboard(tmp_path):
    with MetricsWriter(tmp_path, enabled=True) as w:
        r0 = w.write(0, "cold_start", {"loss": jnp.float32(2.5), "tokens": np.int64(128), "ok": True,
                                       "note": "x", "per_family": {"a": 0.5}})
        w.write(1, "cold_start", {"loss": 2.25})
        w.write(0, "lopd", {"reward_mean": 0.5, "delta": float("nan")})
        with pytest.raises(ValueError, match="reserved"):
            w.write(2, "lopd", {"step": 3})
        with pytest.raises(ValueError, match="scalars"):
            w.write(2, "lopd", {"v": np.zeros(3)})
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["stage"]) for r in recs] == [(0, "cold_start"), (1, "cold_start"), (0, "lopd")]
    assert recs[0] == r0 and recs[0]["loss"] == 2.5 and recs[0]["tokens"] == 128
    assert recs[0]["per_family"] == {"a": 0.5} and recs[0]["elapsed"] >= 0 and recs[0]["time"] > 1e9
    assert np.isnan(recs[2]["delta"])
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", stage="cold_start")] == [0, 1]
    scalars = _tb_scalars(tmp_path / "tb")
    assert scalars[("cold_start/loss", 0)] == 2.5 and scalars[("cold_start/loss", 1)] == 2.25
    assert scalars[("lopd/reward_mean", 0)] == 0.5 and ("cold_start/note", 0) not in scalars
    # a resumed run appends; a torn last line from a crash is skipped
    with MetricsWriter(tmp_path, enabled=True, tensorboard=False) as w:
        w.write(1, "lopd", {"reward_mean": 0.6})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "sta')
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", stage="lopd")] == [0, 1]
    assert format_line(recs[1]) == "[cold_start 1] loss=2.25"


def test_a_resumed_runs_redone_steps_supersede_the_lost_attempts(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(tmp_path, enabled=True, tensorboard=False) as w:
        w.write(0, "eval_before", {"reward_mean": 0.5})
        for step in (1, 2, 3):  # killed after step 3; the last checkpoint was step 1
            w.write(step, "lopd", {"attempt": 1})
    with MetricsWriter(tmp_path, enabled=True, tensorboard=False) as w:
        for step in (2, 3, 4):
            w.write(step, "lopd", {"attempt": 2})
        w.write(4, "eval_after", {"reward_mean": 0.75})
    recs = read_metrics(path)
    assert [(r["stage"], r["step"], r.get("attempt")) for r in recs] == [
        ("eval_before", 0, None), ("lopd", 1, 1), ("lopd", 2, 2), ("lopd", 3, 2), ("lopd", 4, 2), ("eval_after", 4, None)]
    assert [r["step"] for r in read_metrics(path, "lopd")] == [1, 2, 3, 4]


def test_disabled_writer_writes_nothing(tmp_path):
    w = MetricsWriter(tmp_path / "run", enabled=False)
    assert w.write(0, "lopd", {"a": 1.0}) is None
    w.close()
    assert not (tmp_path / "run").exists()


def test_progress_bar():
    buf = io.StringIO()
    with Progress(10, "lopd", enabled=True, file=buf) as p:
        for _ in range(4):
            p.update(1, reward=jnp.float32(0.5))
        assert p.n == 4 and p.rate() > 0
    text = buf.getvalue()
    assert "lopd" in text and "4/10" in text and "reward=0.5" in text


def test_plot_run(tmp_path):
    with MetricsWriter(tmp_path, enabled=True, tensorboard=False) as w:
        w.write(0, "cold_start", {"loss": 1.0})
        _lopd_records(w, n=8)
        _lopd_records(w, n=12, start=6)  # resumed at step 6: steps 6, 7 repeated
    out = plot_run(tmp_path / "metrics.jsonl", tmp_path / "plots" / "run.png", margin=0.05)
    import matplotlib.image as mpimg
    img = mpimg.imread(out)
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 300
    assert np.asarray(img[..., :3]).std() > 0.05  # not a blank canvas
    # three panels with one point per unique step; x is cumulative rollouts
    from train.metrics import _series
    x, y = _series(read_metrics(tmp_path / "metrics.jsonl", "lopd"), "reward_mean", "rollouts")
    np.testing.assert_allclose(x, 32 * np.arange(1, 13))
    np.testing.assert_allclose(y, 0.3 + 0.02 * np.arange(12))
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_run(tmp_path / "metrics.jsonl", tmp_path / "x.png", stage="cold_start")
    json.dumps(read_metrics(tmp_path / "metrics.jsonl"))


def test_plot_run_places_held_out_evaluations_at_their_rollouts(tmp_path):
    from train.metrics import _held_out_series
    with MetricsWriter(tmp_path, enabled=True, tensorboard=False) as w:
        w.write(0, "eval_before", {"reward_mean": 0.25})
        for s in range(1, 9):  # as the loop logs them: step s after s updates
            w.write(s, "lopd", {"reward_mean": 0.3, "delta": 0.1, "beta": 0.0, "rollouts": 32})
        w.write(4, "eval", {"reward_mean": 0.5})
        w.write(8, "eval_after", {"reward_mean": 0.75})
    path = tmp_path / "metrics.jsonl"
    x, y = _held_out_series(path, read_metrics(path, "lopd"), ("eval_before", "eval", "eval_after"),
                            "reward_mean", "rollouts")
    np.testing.assert_allclose(x, [0, 4 * 32, 8 * 32])
    np.testing.assert_allclose(y, [0.25, 0.5, 0.75])
    assert plot_run(path, tmp_path / "run.png", margin=0.05).endswith("run.png")
    assert _held_out_series(path, read_metrics(path, "lopd"), ("nothing",), "reward_mean", "rollouts") is None


def test_plot_run_draws_the_margin_metrics(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    from train.metrics import SHARE_KEYS
    with MetricsWriter(tmp_path, enabled=True, tensorboard=False) as w:
        for s in range(6):
            w.write(s + 1, "lopd", {"reward_mean": 0.3, "delta": 0.01 * s, "beta": 0.1, "rollouts": 8,
                                    "delta_vs_plain_teacher": 0.02 * s,
                                    **dict(zip(SHARE_KEYS, (0.6, 0.3, 0.1)))})
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figure to inspect it
    plot_run(tmp_path / "metrics.jsonl", tmp_path / "run.png", margin=0.05)
    axes = figs[0].axes
    assert len(axes) == 4
    assert [t.get_text() for t in axes[1].get_legend().get_texts()][:2] == ["vs the student",
                                                                         "vs the teacher without latents"]
    assert [t.get_text() for t in axes[3].get_legend().get_texts()] == ["distillation", "margin", "anchor"]
    np.testing.assert_allclose(axes[3].lines[1].get_ydata(), 0.3)

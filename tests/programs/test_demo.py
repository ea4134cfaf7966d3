"""The demo's shipped starting point (``data/demo/start``, :mod:`lopd_jax.demo`): it is what its
recorded command makes, it is small, it loads, and its theta0 reads the privileged hint.

Costs: the config and round-trip checks are file reads (well under a second); the load
test builds the miniature's run context, restores theta0, phi0 and the bank and scores 8
oracle demonstrations with and without the hint (one small compile): the three took 68 s
together on the 2-core machine under a load average of about 20.
"""

import filecmp
import json
import os

import jax
import numpy as np

from lopd_jax.programs import demo
from lopd_jax.programs.composer_eval import load_composer_run
from lopd_jax.programs.premise import oracle_logprob
from lopd_jax.settings.run_config import check_resume, load_run_config
from lopd_jax.programs.train import resolve_config

START = demo.START_DIR


def _ledger(path):
    with open(os.path.join(path, "stages.json")) as f:
        return json.load(f)


def test_start_is_what_its_command_makes():
    config, overrides = demo.start_args(START)
    made = resolve_config([f"--config={config}", f"--workdir={START}", *overrides])
    # every key but those a resumed run may change (lengths, layout, the rollout engine's
    # slots and pages: RESUME_MUTABLE), so the demo's runs resume it under that command
    check_resume(load_run_config(START), made)
    ledger = _ledger(START)
    assert sorted(ledger) == sorted(demo.PREFIX_STAGES) and all(v["done"] for v in ledger.values())
    assert ledger["bank"]["path"] == "bank"
    for stage, steps in (("warmup", made.stages.warmup_steps), ("cold_start", made.stages.cold_start_steps)):
        assert os.listdir(os.path.join(START, "checkpoints", stage)) == [str(steps)]
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(START) for f in fs)
    assert size < 5 * 2 ** 20, f"the starting point is {size / 2 ** 20:.1f} MiB"
    with open(os.path.join(START, "premise.json")) as f:
        rows = json.load(f)["rows"]
    # the premise LOPD needs, as measured when the starting point was made
    assert rows["base + composer"]["reward"] > rows["base"]["reward"] + 0.2
    assert rows["base + oracle text"]["reward"] > rows["base"]["reward"] + 0.2
    assert rows["base"]["reward"] == ledger["eval_before"]["reward_mean"]


def test_pack_of_an_unpacked_start_is_the_start(tmp_path):
    run_dir, again = str(tmp_path / "run"), str(tmp_path / "again")
    demo.unpack(START, run_dir)
    assert _ledger(run_dir)["bank"]["path"] == os.path.join(os.path.abspath(run_dir), "bank")
    demo.pack(run_dir, again, *demo.start_args(START))
    cmp = filecmp.dircmp(START, again)
    stack, differ = [cmp], []
    while stack:
        c = stack.pop()
        _, mismatch, errors = filecmp.cmpfiles(c.left, c.right, c.common_files, shallow=False)
        differ += mismatch + errors + c.left_only + c.right_only
        stack += c.subdirs.values()
    assert differ == []


def test_start_loads_and_its_theta0_reads_the_hint(tmp_path):
    run_dir = str(tmp_path / "run")
    demo.unpack(START, run_dir)
    run = load_composer_run(run_dir, "cold_start")
    ledger = _ledger(run_dir)
    assert (run.stage, run.step) == ("cold_start", run.ctx.cfg.stages.cold_start_steps)
    assert len(run.bank) == ledger["bank"]["entries"] > 0
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves((run.frozen, run.composer)))
    # teacher-forced: the oracle tokens are far likelier with the hint in the prompt (a random
    # or wrongly restored theta0 shows no such gap)
    lp = oracle_logprob(run, run.ctx.source.tasks("heldout")[:8])
    assert lp["base + oracle text"] > lp["base"] + 0.01, lp
    # and with the cold-start composer's latents (LOPD's teacher), whose greedy reward beats base
    assert lp["base + composer"] > lp["base"], lp


def test_demo_prints_its_runs_progress(tmp_path, capsys):
    """While its runs work, the demo prints a line on each (stage and step from its metrics),
    the LOPD steps done of all and an ETA, at the heartbeat's interval."""
    import concurrent.futures
    import time

    from lopd_jax.io.progress import Heartbeat

    def lopd_run(run_dir):
        os.makedirs(run_dir)
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"stage": "cold_start", "step": 40}) + "\n")  # the copied start: not progress
            for step in range(1, 5):
                f.write(json.dumps({"stage": "lopd", "step": step}) + "\n")
                f.flush()
                time.sleep(0.1)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = {"premise": pool.submit(time.sleep, 0.2), 0: pool.submit(lopd_run, str(tmp_path / "seed0"))}
        demo.wait_with_progress(str(tmp_path), jobs, 4, Heartbeat(every=0.05), poll_s=0.01)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) >= 3 and all(ln.startswith("[demo ") and "LOPD steps " in ln for ln in lines), lines
    assert any("seed0 lopd step" in ln and "ETA " in ln for ln in lines), lines
    assert "cold_start" not in "".join(lines)
    line = demo.progress_line(str(tmp_path), jobs, 4, 10.0)
    assert "premise done, seed0 done; LOPD steps 4/4, ETA 0s" in line

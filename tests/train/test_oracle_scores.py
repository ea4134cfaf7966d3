"""train.oracle_scores: the arms' primary metric, the policy's teacher-forced probability of
the oracle call's hidden-rule argument, against a NumPy reference over the full logits,
and on 2 processes against 1."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import portpicker
import pytest
from flax import nnx

from configs import load_config
from lopd_jax.envs.synthetic.env import oracle_argument
from lopd_jax.settings.overrides import apply_overrides
from train.oracle_scores import KEY, argument_span, oracle_argument_probs
from train.run_context import RunContext
from train.stage_loop import evaluate_policy
from train.warmup import demonstration
from tests.paths import ROOT


@pytest.fixture(scope="module")
def ctx():
    return RunContext(apply_overrides(load_config("miniature"), ["stages.eval_tasks=8", "env.tasks_per_step=4"]))


def _params(ctx):
    frozen, lora0, _ = ctx.system.initial_params()
    return ctx.policy_params(frozen, frozen) if not ctx.student_lora else ctx.policy_params(lora0, frozen)


def test_span_is_the_hub_value(ctx):
    for task in ctx.eval_tasks[:4]:
        _, name, value = oracle_argument(task)
        demo = demonstration(ctx, task)
        lo, hi = argument_span(ctx.fmt, task, demo)
        assert name == "hub" and ctx.fmt.tokenizer.decode(list(demo.tokens[lo:hi])).strip() == value
        assert demo.mask[lo:hi].all()  # generated (assistant) tokens


def test_probabilities_match_a_numpy_reference(ctx):
    params = _params(ctx)
    tasks = ctx.eval_tasks[:6]  # a full chunk of 4 and a padded one of 2
    got = oracle_argument_probs(ctx, params, tasks)
    model = nnx.merge(ctx.system.backbone_def, params)
    want = []
    for task in tasks:
        demo = demonstration(ctx, task)
        lo, hi = argument_span(ctx.fmt, task, demo)
        logits = np.asarray(model(demo.tokens[None], attention_mask=np.ones((1, len(demo.tokens)), bool)),
                            np.float64)[0]
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        want.append(float(np.exp(sum(logp[i - 1, demo.tokens[i]] for i in range(lo, hi)))))
    np.testing.assert_allclose(got, want, rtol=1e-4)
    assert all(0.0 < p < 1.0 for p in got)


def test_undefined_without_a_hidden_rule():
    ctx = RunContext(apply_overrides(load_config("tiny"), ["stages.eval_tasks=4"]))
    assert any(oracle_argument(t) is None for t in ctx.eval_tasks)
    assert oracle_argument_probs(ctx, _params(ctx), ctx.eval_tasks) is None


def test_evaluation_records_it_per_task(ctx):
    ev = evaluate_policy(ctx, _params(ctx))
    probs = ev["per_task"][KEY]
    assert len(probs) == len(ev["per_task"]["reward"]) == 8
    assert ev[KEY] == pytest.approx(np.mean(probs))
    assert probs[:6] == pytest.approx(oracle_argument_probs(ctx, _params(ctx), ctx.eval_tasks[:6]), rel=1e-6)


@pytest.mark.process
def test_two_processes_give_the_one_process_probabilities(ctx, tmp_path):
    """2 processes x 2 CPU devices (``tests/train/multihost_oracle_worker.py``, jax.distributed
    on localhost): the policy's parameters span both processes, and each process gets
    every task's probability, equal to this single process's (8 devices)."""
    root = ROOT
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=root)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=2"])
    port, out = portpicker.pick_unused_port(), str(tmp_path / "probs.json")
    worker = os.path.join(root, "tests", "train", "multihost_oracle_worker.py")
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, worker, f"localhost:{port}", "2", str(i), out], cwd=root, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(f"\n2 processes x 2 devices: {time.perf_counter() - t0:.1f}s")
    assert [p.returncode for p in procs] == [0, 0], "\n".join(x[-3000:] for x in logs)
    tasks = ctx.eval_tasks[:6]
    want = oracle_argument_probs(ctx, _params(ctx), tasks)
    for i in range(2):
        got = json.load(open(f"{out}.p{i}"))
        assert (got["processes"], got["devices"]) == (2, 4)
        assert got["task_ids"] == [t.task_id for t in tasks]
        np.testing.assert_allclose(got["probs"], want, rtol=1e-5)

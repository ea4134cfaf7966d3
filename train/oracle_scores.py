"""The arms' primary metric on hidden-rule task families: the policy's probability of the
oracle tool call's hidden-rule argument (``dispatch.ship``: the hub of ``ship_order``),
teacher-forced on the oracle demonstration with the plain prompt.

Greedy held-out reward is all-or-nothing per customer; this probability moves with every
step of learning the rule, so arm contrasts over it have far narrower intervals
(docs/statistics.md). :func:`train.stage_loop.evaluate_policy` records it per task as
``oracle_arg_prob`` beside the reward, and ``benchmarks.rank_arms`` compares arms on it.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lopd_jax.core.types import Task
from lopd_jax.envs.synthetic.env import ENV_ID, oracle_argument, oracle_turns
from lopd_jax.method.losses_kl import chunked_token_logp
from lopd_jax.rollout.episodes import training_arrays
from train import mesh as mesh_lib
from train.distributed import local_copy, replicated_array
from train.warmup import demonstration

KEY = "oracle_arg_prob"


def _turn_starts(mask: np.ndarray) -> list[int]:
    """First index of each run of supervised (generated) tokens: one run per assistant turn."""
    m = np.asarray(mask) > 0
    return [i for i in range(len(m)) if m[i] and (i == 0 or not m[i - 1])]


def argument_span(fmt, task: Task, demo) -> tuple[int, int] | None:
    """``[lo, hi)`` token positions of the hidden-rule argument's value in ``demo`` (the
    oracle demonstration of ``task``): the tokens whose decoded characters overlap the
    value's characters in its turn, so any tokenizer's merges are covered. None when the
    task's family has no hidden rule."""
    arg = oracle_argument(task)
    if arg is None:
        return None
    turn, name, value = arg
    raw = oracle_turns(task)[turn].raw
    key_at = raw.find(f'"{name}"')
    start = raw.find(f'"{value}"', key_at) + 1 if key_at >= 0 else 0
    if start <= 0:
        raise ValueError(f"task {task.task_id!r}: the oracle call's {name}={value!r} is not in its rendered turn "
                         f"{raw!r}")
    end = start + len(value)
    ids = fmt.encode(raw)  # as train.warmup encodes the demonstration turn
    ends = [len(fmt.tokenizer.decode(ids[:k + 1])) for k in range(len(ids))]  # characters after token k
    lo = next(k for k in range(len(ids)) if ends[k] > start)
    hi = next(k for k in range(len(ids)) if ends[k] >= end) + 1
    base = _turn_starts(demo.mask)[turn]
    return base + lo, base + hi


def _row_logprob_fn(system):
    """jit: ``(params, tokens, attention_mask, span_mask) -> [B]`` sum of log pi(token) over
    each row's masked positions, the backbone built from a flat policy dict. With a mesh
    the output is replicated, so every process holds every row's score."""

    def fn(params, tokens, attention_mask, span):
        model = nnx.merge(system.backbone_def, params)
        hidden = model(tokens, attention_mask=attention_mask.astype(bool), return_hidden=True)
        logp = chunked_token_logp(hidden[:, :-1], model.lm_head_kernel(), tokens[:, 1:],
                                  chunk_size=system.step_cfg.loss.logits_chunk,
                                  compute_dtype=system.model_cfg.jnp_dtype)
        return jnp.sum(jnp.where(span[:, 1:] > 0, logp, 0.0), axis=-1)

    return jax.jit(fn, out_shardings=mesh_lib.replicated(system.rules))


def oracle_argument_probs(ctx, params, tasks: Sequence[Task]) -> list[float] | None:
    """Per task, exp(sum of the policy's log-probs of the hidden-rule argument's tokens),
    teacher-forced on the task's oracle demonstration (its plain prompt). None when any
    task is not a synthetic hidden-rule task (the metric is undefined there).

    On a pod every process calls it with the same ``tasks`` (the evaluation's held-out
    list, the same everywhere) and gets the same list back: each process builds every row,
    the rows go in as replicated global arrays on the policy's mesh, and the replicated
    scores are read from a local device -- the numbers of one process."""
    if not tasks or any(t.env_id != ENV_ID or oracle_argument(t) is None for t in tasks):
        return None
    demos = [demonstration(ctx, t) for t in tasks]
    spans = [argument_span(ctx.fmt, t, d) for t, d in zip(tasks, demos)]
    B = ctx.cfg.env.tasks_per_step
    length = -(-max(len(d.tokens) for d in demos) // 128) * 128
    score = getattr(ctx, "_oracle_arg_score", None)
    if score is None:
        score = ctx._oracle_arg_score = _row_logprob_fn(ctx.system)
    out = []
    for i in range(0, len(demos), B):
        n = len(demos[i:i + B])
        rows = demos[i:i + B] + demos[:1] * (B - n)  # a full chunk: one compiled shape (padding rows dropped)
        arrays = training_arrays(rows, length=length)
        span = np.zeros_like(arrays["tokens"])
        for r, (lo, hi) in enumerate(spans[i:i + n]):
            span[r, lo:hi] = 1
        rep = mesh_lib.replicated(ctx.system.rules)
        sums = local_copy(score(params, *(replicated_array(x, rep) for x in
                                          (arrays["tokens"], arrays["attention_mask"], span))))
        out += [float(np.exp(s)) for s in sums[:n]]
    return out


"""Privileged text context (lopd_jax.envs.privileged), the hinted warm-up pool and the premise
check CLI (python -m lopd_jax.premise) on a shortened tiny config."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lopd_jax.envs.synthetic.env import SyntheticTaskSource, oracle_turns
from lopd_jax.envs.privileged import FRAMING_AFTER, FRAMING_BEFORE, HintedTaskSource, hint_block, with_hint
from tests.paths import ROOT


SHORT = ["stages.warmup_steps=3", "stages.warmup_batch=4", "stages.cold_start_steps=2", "stages.cold_start_batch=2",
         "stages.eval_tasks=2", "stages.eval_every=0", "env.tasks_per_step=2", "env.kwargs.n_train_per_family=1",
         "env.kwargs.n_heldout_per_family=1", "bank.min_reward=0.0", "composer.max_experience_tokens=64",
         "rollout.max_env_steps=2", "rollout.max_turn_tokens=32", "stages.warmup_hint_fraction=0.5"]


def test_hinted_source_prefixes_the_first_user_message_and_keeps_the_reward():
    src = SyntheticTaskSource(n_train_per_family=1, n_heldout_per_family=1)
    hinted = HintedTaskSource(src)
    for task in src.tasks("heldout")[:3]:
        plain, _ = src.make_env().reset(task)
        env = hinted.make_env()
        messages, tools = env.reset(task)
        assert messages[0] == plain[0]
        assert messages[1]["content"] == (f"{FRAMING_BEFORE}\n{src.oracle_hint(task)}\n{FRAMING_AFTER}\n\n"
                                          + task.instruction)
        for turn in oracle_turns(task):
            result = env.step(turn)
        assert result.done and result.reward == 1.0 and env.stats.tool_calls >= 1
        assert env.check_results()[0][1]  # the wrapped environment's methods stay reachable
    with pytest.raises(ValueError, match="no user message"):
        with_hint([{"role": "system", "content": "x"}], "hint")
    assert hint_block("H", "B", "A") == "B\nH\nA\n\n"


def _pool_ctx(src, tok, hint_fraction, hint_token_weight=1.0):
    """The slice of a run context that :func:`train.warmup.warmup_pool` reads."""
    from types import SimpleNamespace

    from lopd_jax.chat.formats import make_chat_format

    stages = SimpleNamespace(warmup_hint_fraction=hint_fraction, warmup_hint_token_weight=hint_token_weight)
    return SimpleNamespace(fmt=make_chat_format("qwen3", tok), source=src, train_tasks=src.tasks("train"),
                           cfg=SimpleNamespace(seed=0, stages=stages))


def test_warmup_pool_adds_hinted_demonstrations():
    from lopd_jax.chat.tokenizers import tiny_tokenizer
    from train.warmup import warmup_pool

    src = SyntheticTaskSource(n_train_per_family=2, n_heldout_per_family=1)
    tok = tiny_tokenizer("qwen3")
    ctx = _pool_ctx(src, tok, 0.5)
    pool = warmup_pool(ctx)
    n = len(ctx.train_tasks)
    assert len(pool) == n + 9 and len({d.task.task_id for d in pool[n:]}) == 9
    for demo in pool[n:]:
        plain = next(d for d in pool[:n] if d.task.task_id == demo.task.task_id)
        text = tok.decode([int(i) for i in demo.tokens[demo.insert_at:]], skip_special_tokens=False)
        assert text.startswith(hint_block(src.oracle_hint(demo.task)) + demo.task.instruction)
        assert not demo.mask[:demo.insert_at + len(tok.encode(hint_block(src.oracle_hint(demo.task))))].any()
        # the supervised (assistant) tokens are the plain demonstration's
        np.testing.assert_array_equal(demo.tokens[demo.mask == 1], plain.tokens[plain.mask == 1])
    ctx.cfg.stages.warmup_hint_fraction = 0.0
    assert len(warmup_pool(ctx)) == n


def test_warmup_pool_uses_the_sources_separate_warmup_tasks():
    from lopd_jax.chat.tokenizers import tiny_tokenizer
    from train.warmup import warmup_pool

    src = SyntheticTaskSource(n_train_per_family=4, n_heldout_per_family=2, families=["dispatch"],
                              n_warmup_per_family=6)
    ctx = _pool_ctx(src, tiny_tokenizer("qwen3"), 1.0)
    pool = warmup_pool(ctx)
    assert len(pool) == 12 and {d.task.task_id for d in pool} == {t.task_id for t in src.warmup_tasks()}
    assert not {d.task.instruction for d in pool} & {t.instruction for t in src.tasks("train")}


def test_hint_token_weight_scales_only_the_tokens_the_hint_supplies():
    from lopd_jax.chat.tokenizers import tiny_tokenizer
    from train.warmup import warmup_pool

    src = SyntheticTaskSource(n_train_per_family=4, n_heldout_per_family=2, families=["dispatch"],
                              n_warmup_per_family=6)
    tok = tiny_tokenizer("qwen3")
    unweighted = warmup_pool(_pool_ctx(src, tok, 1.0))
    weighted = warmup_pool(_pool_ctx(src, tok, 1.0, hint_token_weight=10.0))
    for a, b in zip(unweighted[:6], weighted[:6]):  # plain copies untouched
        np.testing.assert_array_equal(a.mask, b.mask)
    for a, b in zip(unweighted[6:], weighted[6:]):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        up = b.mask == 10.0
        # exactly the hub's city token, in the call and in the final answer
        words = [tok.decode([int(t)]) for t in b.tokens[up]]
        assert len(words) == 2 and words[0] == words[1]
        assert f'"hub": "{words[0]}"' in src.oracle_hint(b.task) and words[0] not in b.task.instruction
        np.testing.assert_array_equal(b.mask[~up], a.mask[~up])
        assert a.mask[up].tolist() == [1, 1]


@pytest.mark.process
def test_premise_cli_prints_three_rows(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform" not in f)
    workdir = str(tmp_path / "run")
    missing = subprocess.run([sys.executable, "-m", "lopd_jax.premise", f"--workdir={workdir}"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
    assert missing.returncode == 2 and "no finished cold start" in missing.stderr
    proc = subprocess.run([sys.executable, "-m", "lopd_jax.premise", "--config=tiny", f"--workdir={workdir}", *SHORT],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.load(open(os.path.join(workdir, "premise.json")))
    assert list(out["rows"]) == ["base", "base + oracle text", "base + composer"] and out["tasks"] == 9
    assert out["no_tool_baseline"] == 0.0
    for name, row in out["rows"].items():
        assert f"| {name} | {row['reward']:.4f} |" in proc.stdout and row["episodes"] == 9
        assert 0.0 <= row["reward"] <= 1.0
    assert out["rows"]["base"]["reward_gap"] == 0.0


def test_miniature_config_and_hint_fraction_validation():
    from lopd_jax.settings.config import StagesSection
    from lopd_jax.settings.errors import ConfigError
    from configs import load_config
    from lopd_jax.settings.overrides import from_dict, to_dict

    cfg = load_config("miniature")
    assert cfg.stages.warmup_hint_fraction == 1.0 and cfg.env.kwargs["families"] == ["dispatch"]
    assert cfg.env.kwargs["n_warmup_per_family"] > 0 and cfg.bank.min_reward == 1.0
    assert from_dict(to_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="warmup_hint_fraction"):
        StagesSection(warmup_hint_fraction=1.5)


def test_premise_workdir_defaults_to_the_configs(capsys):
    """``--config`` without ``--workdir`` uses the config's workdir (as ``lopd_jax.train``); with
    neither, one line says what to pass. Set-up errors only: nothing runs."""
    from lopd_jax.programs.premise import main

    assert main([]) == 2
    assert "pass --workdir=W" in capsys.readouterr().err
    assert main(["--config=tiny", "stages.lopd_stesp=1"]) == 2  # resolved as train resolves it
    assert "did you mean lopd_steps" in capsys.readouterr().err

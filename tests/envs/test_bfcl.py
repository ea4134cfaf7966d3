"""BFCL multi-turn environment: ground-truth replay, tool hold-out, robustness."""

import os
import random

import pytest

pytest.importorskip("bfcl_eval", reason="bfcl-eval is not installed; install it with "
                                        "`make bfcl`")

from lopd_jax.envs.bfcl.env import BFCLTaskSource, ground_truth_turns  # noqa: E402
from lopd_jax.core.types import AssistantTurn, ToolCall  # noqa: E402
from tests.paths import ROOT


def _text(s="Done."):
    return AssistantTurn(raw=s, content=s)


def _calls(*calls):
    return AssistantTurn(raw="", content="", tool_calls=list(calls))


def _replay(env, task, skip_turns=()):
    """Play the ground truth one call per step; plain text closes each user turn."""
    env.reset(task)
    result = None
    for i, calls in enumerate(ground_truth_turns(task)):
        if i not in skip_turns:
            for call in calls:
                result = env.step(_calls(call))
                assert not result.done
        result = env.step(_text())
    assert result.done and result.observation == []
    return result


@pytest.fixture(scope="module")
def base():
    return BFCLTaskSource(["base"])


def test_ground_truth_replay_scores_one(base):
    tasks = base.tasks("heldout")
    assert len(tasks) == 200
    perfect = [_replay(base.make_env(), t).reward == 1.0 for t in tasks]
    fraction = sum(perfect) / len(tasks)
    print(f"multi_turn_base ground-truth replay: {sum(perfect)}/{len(tasks)} = {fraction:.3f}")
    assert fraction >= 0.95


def test_skipping_a_turn_lowers_the_reward(base):
    task = base.all_tasks()[0]
    n_turns = len(task.payload["ground_truth"])
    r = _replay(base.make_env(), task, skip_turns=(0,))
    assert r.reward <= (n_turns - 1) / n_turns
    assert r.info["turn_results"][0] is False
    all_mode = BFCLTaskSource(["base"], reward_mode="all", limit=1)
    assert _replay(all_mode.make_env(), all_mode.all_tasks()[0], skip_turns=(0,)).reward == 0.0


def test_multi_turn_flow_sends_next_user_question(base):
    task = base.all_tasks()[0]
    env = base.make_env()
    messages, tools = env.reset(task)
    assert messages[0]["role"] == "system" and messages[1]["role"] == "user"
    assert {t["function"]["name"] for t in tools} >= {"cd", "mv", "post_tweet"}
    r = env.step(_text("I cannot do that."))
    assert not r.done and r.observation[0]["role"] == "user"
    assert r.observation[0]["content"] == task.payload["question"][1][0]["content"]


def test_miss_func_holds_tools_back_until_their_turn():
    src = BFCLTaskSource(["miss_func"], limit=1)
    task = src.all_tasks()[0]
    held_turn, names = next(iter(task.payload["missed_function"].items()))
    env = src.make_env()
    _, tools = env.reset(task)
    assert not set(names) & {t["function"]["name"] for t in tools}
    r = env.step(_calls(ToolCall(names[0], {})))
    assert r.observation[0]["content"].startswith("Error: unknown tool")
    for _ in range(int(held_turn)):
        r = env.step(_text())
    assert "I have updated some more functions" in r.observation[0]["content"]
    assert set(names) <= {t["function"]["name"] for t in r.info["tools"]}
    assert set(names) <= {t["function"]["name"] for t in env.tools}


def test_random_and_malformed_calls_never_crash():
    src = BFCLTaskSource(list(("base", "miss_func", "miss_param", "long_context")), limit=6)
    rng = random.Random(0)
    junk = [None, 3, -1.5, "", "x" * 50, [], [1, "a"], {}, {"k": [None]}, True]
    for task in src.all_tasks():
        env = src.make_env()
        _, tools = env.reset(task)
        names = [t["function"]["name"] for t in tools] + ["no_such_tool", "__init__",
                                                          "_load_scenario"]
        done = False
        for _ in range(40):
            kind = rng.random()
            if kind < 0.15:
                turn = _text()
            elif kind < 0.25:
                turn = AssistantTurn(raw="<tool_call>{oops", content="",
                                     parse_errors=["invalid JSON: {oops"])
            else:
                name = rng.choice(names)
                schema = next((t for t in env.tools if t["function"]["name"] == name), None)
                props = list(schema["function"]["parameters"]["properties"]) if schema else []
                args = {p: rng.choice(junk) for p in props if rng.random() < 0.7}
                if rng.random() < 0.2:
                    args["unexpected"] = 1
                turn = _calls(ToolCall(name, args))
            result = env.step(turn)
            assert 0.0 <= result.reward <= 1.0
            for msg in result.observation:
                assert msg["role"] in ("tool", "user") and isinstance(msg["content"], str)
            if result.done:
                done = True
                break
        reward = result.reward if done else env.finish()
        assert 0.0 <= reward <= 1.0
        assert env.stats.errors > 0


def test_finish_counts_unreached_turns_as_failed(base):
    task = base.all_tasks()[0]
    env = base.make_env()
    env.reset(task)
    for call in ground_truth_turns(task)[0]:
        env.step(_calls(call))
    n_turns = len(task.payload["ground_truth"])
    assert env.finish() == pytest.approx(1 / n_turns)
    with pytest.raises(RuntimeError):
        env.step(_text())


def test_bad_category_is_rejected():
    with pytest.raises(ValueError, match="unknown BFCL categories"):
        BFCLTaskSource(["parallel"])


def test_api_call_over_its_time_limit_is_an_error_and_the_state_survives():
    """square_root(precision=1e9) used to hang the process; now the worker is killed at the
    call's time limit, the model reads an error, and the next call sees the earlier state
    (rebuilt on a fresh worker by replay)."""
    import time

    src = BFCLTaskSource(["base"])
    task = next(t for t in src.all_tasks()
                if set(t.payload["involved_classes"]) == {"GorillaFileSystem", "MathAPI"})
    env = src.make_env()
    env.call_timeout_s, env.step_timeout_s = 1.0, 2.0
    env.reset(task)
    r = env.step(_calls(ToolCall("mkdir", {"dir_name": "lopd_probe"})))
    assert not r.observation[0]["content"].startswith("Error"), r.observation
    start = time.monotonic()
    r = env.step(_calls(ToolCall("square_root", {"number": 1e9, "precision": 10**9}),
                        ToolCall("square_root", {"number": 1e9, "precision": 10**9})))
    assert time.monotonic() - start < 4.0
    assert "time limit call_timeout_s=1" in r.observation[0]["content"]
    assert "step_timeout_s=2" in r.observation[1]["content"] or (
        "time limit" in r.observation[1]["content"])
    r = env.step(_calls(ToolCall("ls", {})))
    assert "lopd_probe" in r.observation[0]["content"], r.observation
    assert env.stats.tool_exceptions == 2
    env.close()


def test_install_hint_names_the_pinned_release():
    """The error a user sees without bfcl-eval names the release the Makefile pins."""
    import re

    from lopd_jax.envs.bfcl.env import INSTALL_HINT

    with open(os.path.join(ROOT, "Makefile")) as f:
        pin = re.search(r"^BFCL_EVAL := (\S+)$", f.read(), re.M).group(1)
    assert pin in INSTALL_HINT and "make bfcl" in INSTALL_HINT

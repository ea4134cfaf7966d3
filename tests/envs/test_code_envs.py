"""HumanEval and TACO code environments graded in the sandbox."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lopd_jax.envs.code.env import (HumanEvalTaskSource, TacoTaskSource, extract_code,
                                reference_answer)
from lopd_jax.core.types import AssistantTurn, ToolCall
from tests.paths import FIXTURES

FIXTURES = os.path.join(FIXTURES, "taco")
TACO_FILES = [os.path.join(FIXTURES, "stdin.jsonl"), os.path.join(FIXTURES, "fncall.jsonl")]


def _answer(env, task, text):
    env.reset(task)
    return env.step(AssistantTurn(raw=text, content=text))


@pytest.fixture(scope="module")
def humaneval():
    return HumanEvalTaskSource(heldout_fraction=1.0)


def test_all_humaneval_canonical_solutions_pass(humaneval):
    tasks = humaneval.tasks("heldout")
    assert len(tasks) == 164 and humaneval.tasks("train") == []

    def grade(task):
        return task.task_id, _answer(humaneval.make_env(), task, reference_answer(task))

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(grade, tasks))
    elapsed = time.monotonic() - start
    print(f"164 HumanEval canonical solutions graded in {elapsed:.1f} s")
    failed = [(tid, r.info["feedback"]) for tid, r in results if r.reward != 1.0]
    assert failed == []
    assert all(r.done for _, r in results)


def test_humaneval_wrong_and_hacky_solutions_fail(humaneval):
    task = next(t for t in humaneval.all_tasks() if t.task_id == "HumanEval/0")
    env = humaneval.make_env()
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    r = _answer(env, task, wrong)
    assert r.done and r.reward == 0.0 and "AssertionError" in r.info["feedback"]
    early_exit = "```python\nimport sys\nsys.exit(0)\n```"
    assert _answer(env, task, early_exit).reward == 0.0
    hard_exit = ("```python\nimport os\ndef has_close_elements(numbers, threshold):\n"
                 "    os._exit(0)\n```")
    assert _answer(env, task, hard_exit).reward == 0.0


def test_humaneval_body_completion_is_accepted(humaneval):
    task = next(t for t in humaneval.all_tasks() if t.task_id == "HumanEval/0")
    body = "```python\n" + task.payload["canonical_solution"] + "```"
    assert extract_code(body, "has_close_elements") is not None
    assert _answer(humaneval.make_env(), task, body).reward == 1.0


def test_no_code_block_scores_zero_with_feedback(humaneval):
    task = humaneval.all_tasks()[0]
    r = _answer(humaneval.make_env(), task, "I think you should loop over pairs.")
    assert r.done and r.reward == 0.0 and r.observation == []
    assert "No ```python code block" in r.info["feedback"]


def test_tool_calls_get_an_error_observation_and_retries_feed_back(humaneval):
    task = next(t for t in humaneval.all_tasks() if t.task_id == "HumanEval/0")
    env = HumanEvalTaskSource.make_env(humaneval)
    env.max_attempts = 2
    env.reset(task)
    r = env.step(AssistantTurn(raw="", content="", tool_calls=[ToolCall("run", {})]))
    assert not r.done and r.observation[0]["role"] == "tool"
    assert r.observation[0]["content"].startswith("Error:")
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    r = env.step(AssistantTurn(raw=wrong, content=wrong))
    assert not r.done and r.observation[0]["role"] == "user"
    assert "Tests failed" in r.observation[0]["content"]
    right = reference_answer(task)
    r = env.step(AssistantTurn(raw=right, content=right))
    assert r.done and r.reward == 1.0 and r.info["attempt"] == 2


def test_extract_code_variants():
    assert extract_code("```python\nx = 1\n```") == "x = 1\n"
    assert extract_code("a\n```py\nx = 2\n```\nthen\n```python\ny = 3\n```") == "y = 3\n"
    assert extract_code("```python\ndef f():\n    return 1\n```\n```python\nprint(f())\n```",
                        entry_point="f").startswith("def f")
    assert extract_code("```python\nz = 4\n") == "z = 4\n"  # unclosed (truncated)
    assert extract_code("```\nu = 5\n```") == "u = 5\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\n\n```") is None
    assert extract_code(None) is None


@pytest.fixture(scope="module")
def taco():
    return TacoTaskSource(TACO_FILES, heldout_fraction=0.0)


def test_taco_fixtures_pass_with_reference_code(taco):
    tasks = taco.tasks("train")
    kinds = {t.task_id: t.payload["tests"]["fn_name"] for t in tasks}
    assert kinds == {"stdin_sum": None, "stdin_sort": None, "fn_gcd": "gcd",
                     "fn_two_sum": "twoSum"}
    for task in tasks:
        r = _answer(taco.make_env(), task, reference_answer(task))
        assert r.reward == 1.0, (task.task_id, r.info["feedback"])


WRONG = {
    "stdin_sum": "```python\nimport sys\nfor line in sys.stdin:\n    a, b = map(int, line.split())"
                 "\n    print(a - b)\n```",
    "stdin_sort": "```python\nn = int(input())\nprint(input())\nprint('2.000')\n```",
    "fn_gcd": "```python\ndef gcd(a, b):\n    return min(a, b)\n```",
    "fn_two_sum": "```python\nclass Solution:\n    def twoSum(self, nums, target):\n"
                  "        return [0, 1]\n```",
}


def test_taco_fixtures_fail_with_wrong_code(taco):
    for task in taco.tasks("train"):
        r = _answer(taco.make_env(), task, WRONG[task.task_id])
        assert r.done and r.reward == 0.0, task.task_id
        assert "wrong answer" in r.info["feedback"], r.info["feedback"]


def test_taco_time_limit_and_crash(taco):
    task = next(t for t in taco.all_tasks() if t.task_id == "stdin_sum")
    env = taco.make_env()
    env.per_test_s = 1
    r = _answer(env, task, "```python\nwhile True:\n    pass\n```")
    assert r.reward == 0.0 and "time limit" in r.info["feedback"]
    r = _answer(env, task, "```python\nraise ValueError('boom')\n```")
    assert r.reward == 0.0 and "boom" in r.info["feedback"]


def test_taco_bad_records_are_rejected(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "input_output": "{\\"inputs\\": [\\"1\\"]}"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        TacoTaskSource(str(bad))
    with pytest.raises(FileNotFoundError):
        TacoTaskSource(str(tmp_path / "missing.jsonl"))

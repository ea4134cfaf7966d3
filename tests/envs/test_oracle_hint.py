"""oracle_hint(task): each task source's reference solution / oracle hint as text."""

import json
import os
import re

import pytest

from lopd_jax.envs.base import TaskSource
from lopd_jax.envs.code.env import TacoTaskSource, reference_answer
from lopd_jax.envs.envscaler import EnvScalerTaskSource
from lopd_jax.envs.synthetic.env import SyntheticTaskSource, oracle_calls
from lopd_jax.core.types import AssistantTurn, ToolCall
from tests.paths import FIXTURES



def _calls_in(hint: str) -> list[ToolCall]:
    blocks = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", hint, re.S)
    return [ToolCall(d["name"], d["arguments"]) for d in map(json.loads, blocks)]


def test_synthetic_hint_replays_to_full_reward():
    src = SyntheticTaskSource(n_train_per_family=1, n_heldout_per_family=1, seed=3)
    for task in src.tasks("heldout"):
        hint = src.oracle_hint(task)
        calls, answer = oracle_calls(task)
        assert _calls_in(hint) == calls and hint.endswith("\n" + answer)
        env = src.make_env()
        env.reset(task)
        for call in _calls_in(hint):
            assert not env.step(AssistantTurn(raw="", content="", tool_calls=[call])).done
        result = env.step(AssistantTurn(raw=answer, content=answer))
        assert result.done and result.reward == 1.0, task.task_id


def test_envscaler_hint_lists_the_checklist():
    fix = os.path.join(FIXTURES, "envscaler")
    src = EnvScalerTaskSource(os.path.join(fix, "train.json"),
                              os.path.join(fix, "heldout.jsonl"), os.path.join(fix, "env_items.json"))
    task = src.tasks("train")[0]
    hint = src.oracle_hint(task)
    items = [c["check_item"] for c in task.payload["scenario"]["checklist_with_func"]]
    assert items and hint.splitlines()[1:] == [f"- {i}" for i in items]


def test_code_hint_is_the_reference_solution_or_a_clear_error(tmp_path):
    src = TacoTaskSource(os.path.join(FIXTURES, "taco", "stdin.jsonl"), heldout_fraction=0.0)
    task = src.tasks("train")[0]
    assert src.oracle_hint(task) == reference_answer(task) and "```python" in src.oracle_hint(task)
    bare = task.__class__(**{**task.__dict__, "payload": {**task.payload, "solutions": []}})
    with pytest.raises(ValueError, match="no reference solution"):
        src.oracle_hint(bare)


def test_sources_without_hints_say_so():
    class NoHint(TaskSource):
        env_id = "nohint"

        def tasks(self, split):
            return []

        def make_env(self):
            raise AssertionError

    task = SyntheticTaskSource(1, 1).tasks("train")[0]
    with pytest.raises(NotImplementedError, match="NoHint.*no oracle hint"):
        NoHint().oracle_hint(task)


def test_bfcl_hint_lists_ground_truth_per_turn():
    pytest.importorskip("bfcl_eval")
    from lopd_jax.envs.bfcl.env import BFCLTaskSource

    src = BFCLTaskSource(["base"], limit=1)
    task = src.all_tasks()[0]
    lines = src.oracle_hint(task).splitlines()
    assert len(lines) == len(task.payload["ground_truth"])
    assert all(line.startswith(f"Turn {i + 1}: ") for i, line in enumerate(lines))
    assert task.payload["ground_truth"][0][0] in lines[0]

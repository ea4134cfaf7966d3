"""EnvScaler-format scenarios run in isolated worker processes."""

import json
import os
import time

import psutil
import pytest

from lopd_jax.envs import registry
from lopd_jax.envs.workers import pool as worker_pool
from lopd_jax.envs.envscaler import EnvScalerTaskSource, load_scenarios
from lopd_jax.envs.workers.isolation import ResourceLimits, Worker, WorkerCrashed
from lopd_jax.core.types import AssistantTurn, ToolCall
from tests.paths import FIXTURES

FIX = os.path.join(FIXTURES, "envscaler")
ENV_ITEMS = os.path.join(FIX, "env_items.json")
ORACLE = {  # the exact correct calls for each fixture scenario
    "lib_checkout_001": [ToolCall("get_book", {"book_id": "B1"}),
                         ToolCall("checkout_book", {"book_id": "B1", "member_id": "M1"})],
    "home_temp_001": [ToolCall("set_temperature", {"device_id": "T1", "value": 21.5})],
    "lib_return_001": [ToolCall("return_book", {"book_id": "B2"})],
}
FAST = dict(call_timeout_s=2.0, start_timeout_s=4.0, score_timeout_s=2.0)


def calls(*c):
    return AssistantTurn(raw="", content="", tool_calls=list(c))


def answer(text="Task Completed"):
    return AssistantTurn(raw=text, content=text)


def _pool_worker(p):
    try:
        return worker_pool.is_pool_worker(p.cmdline())
    except psutil.Error:
        return False


def no_children():
    kids = [k for k in psutil.Process().children(recursive=True)  # pooled BFCL workers
            if not _pool_worker(k)]
    return [k for k in kids if k.status() != psutil.STATUS_ZOMBIE] == [] and kids == []


@pytest.fixture(scope="module")
def source():
    return EnvScalerTaskSource(os.path.join(FIX, "train.json"),
                               os.path.join(FIX, "heldout.jsonl"), ENV_ITEMS)


def test_loading_splits_and_registry(source):
    train, heldout = source.tasks("train"), source.tasks("heldout")
    assert [t.task_id for t in train] == ["lib_checkout_001", "home_temp_001"]
    assert [t.task_id for t in heldout] == ["lib_return_001"]
    assert [t.family for t in train + heldout] == ["env_library", "env_smarthome",
                                                  "env_library/return"]
    assert all(t.env_id == "envscaler" for t in train + heldout)
    assert train[0].instruction == "Lend the book Dune (B1) to member M1."
    via = registry.get_task_source("envscaler", heldout_path=os.path.join(
        FIX, "heldout.jsonl"), env_items_path=ENV_ITEMS)
    assert [t.task_id for t in via.tasks("heldout")] == ["lib_return_001"]
    assert via.tasks("train") == []


def test_bad_records_fail_with_clear_errors(tmp_path):
    good = json.load(open(os.path.join(FIX, "train.json")))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(good))
    with pytest.raises(ValueError, match="no env_class_code and env_id 'env_library'"):
        load_scenarios(str(path))
    path.write_text(json.dumps([{k: v for k, v in good[0].items() if k != "task"}]))
    with pytest.raises(ValueError, match=r"record 0: missing field\(s\) \['task'\]"):
        load_scenarios(str(path), json.load(open(ENV_ITEMS)))
    path.write_text(json.dumps([{**good[0], "checklist_with_func": []}]))
    with pytest.raises(ValueError, match="checklist_with_func must be a non-empty list"):
        load_scenarios(str(path), json.load(open(ENV_ITEMS)))
    with pytest.raises(ValueError, match="needs train_path and/or heldout_path"):
        EnvScalerTaskSource()


def test_oracle_gets_full_reward_and_no_process_is_left(source):
    for task in source.tasks("train") + source.tasks("heldout"):
        env = source.make_env()
        messages, tools = env.reset(task)
        assert [m["role"] for m in messages] == ["system", "user"]
        assert messages[1]["content"] == task.instruction
        assert "# Environment Information" in messages[0]["content"]
        pid = env._worker.pid
        assert psutil.pid_exists(pid)
        for call in ORACLE[task.task_id]:
            result = env.step(calls(call))
            assert not result.done
            assert not result.observation[0]["content"].startswith("Error"), result.observation
        result = env.step(answer())
        assert result.done and result.reward == 1.0, env.check_results
        assert all(r["result"] is True for r in env.check_results)
        assert not psutil.pid_exists(pid) and no_children()


def test_schemas_come_from_the_dataset_or_the_class(source):
    env = source.make_env()
    _, lib_tools = env.reset(source.tasks("train")[0])
    lib = {t["function"]["name"]: t["function"] for t in lib_tools}
    assert sorted(lib) == ["checkout_book", "get_book", "return_book"]
    assert lib["checkout_book"]["description"] == "Lend a book to a member."
    assert lib["checkout_book"]["parameters"]["properties"]["member_id"] == {
        "type": "string", "description": "The member's id."}
    _, home_tools = env.reset(source.tasks("train")[1])  # tools listed in env_items.json
    assert home_tools == json.load(open(ENV_ITEMS))["env_smarthome"]["tools"]
    env.close()
    assert no_children()


def test_plain_text_answer_ends_the_episode(source):
    env = source.make_env()
    env.reset(source.tasks("train")[1])  # T1 -> 21.5; T2 unchanged
    result = env.step(answer("I cannot do that."))
    assert result.done and result.observation == []
    assert result.reward == pytest.approx(0.5)  # only "T2 unchanged" holds
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(answer())
    assert no_children()


def test_bad_calls_are_error_observations_and_the_episode_goes_on(source):
    env = source.make_env()
    env.reset(source.tasks("train")[1])
    result = env.step(AssistantTurn(raw="", content="", parse_errors=["no JSON object"],
                                    tool_calls=[
        ToolCall("explode", {}),
        ToolCall("set_temperature", {"device_id": "T1"}),
        ToolCall("set_temperature", {"device_id": "T1", "value": "warm"}),
        ToolCall("get_device", {"device_id": "T9"}),  # raises KeyError in dataset code
    ]))
    contents = [o["content"] for o in result.observation]
    assert all(c.startswith("Error: ") for c in contents), contents
    assert "unknown tool 'explode'" in contents[1]
    assert "missing required argument(s) ['value']" in contents[2]
    assert "must be of type number, got str" in contents[3]
    assert "KeyError" in contents[4] and "unknown device T9" in contents[4]
    assert result.info["stats"]["errors"] == 5
    result = env.step(calls(ToolCall("set_temperature", {"device_id": "T1", "value": 40})))
    assert "between 10 and 30" in result.observation[0]["content"]  # dataset's own message
    result = env.step(calls(*ORACLE["home_temp_001"]))
    assert result.observation[0]["content"] == "{'success': True}"  # EnvScaler's str(result)
    assert env.step(answer()).reward == 1.0


def test_finish_scores_and_stops_the_worker(source):
    env = source.make_env()
    env.reset(source.tasks("train")[0])
    env.step(calls(ORACLE["lib_checkout_001"][1]))
    pid = env._worker.pid
    assert env.finish() == 1.0
    assert not psutil.pid_exists(pid) and no_children()
    assert env.finish() == 1.0  # idempotent once ended


BROKEN = os.path.join(FIX, "tasks_broken.json")


@pytest.fixture(scope="module")
def broken():
    src = EnvScalerTaskSource(BROKEN, env_items_path=ENV_ITEMS, **FAST)
    return {t.task_id: t for t in src.tasks("train")}, src


@pytest.mark.parametrize("task_id", ["broken_import_hang", "broken_import_raise"])
def test_class_source_that_hangs_or_raises_at_import(broken, task_id):
    tasks, src = broken
    env = src.make_env()
    t0 = time.monotonic()
    env.reset(tasks[task_id])
    assert time.monotonic() - t0 < FAST["start_timeout_s"] + 3.0
    result = env.step(calls(ToolCall("ping", {})))
    content = result.observation[0]["content"]
    assert not result.done and content.startswith("Error: the environment failed to start")
    assert ("did not finish in time" if "hang" in task_id else "dataset code is broken") in content
    assert env.step(answer()).reward == 0.0
    assert env.check_results[0]["result"] is None
    assert no_children()


def test_tool_call_that_hangs_is_killed_within_the_timeout(broken):
    tasks, src = broken
    env = src.make_env()
    env.reset(tasks["broken_method_hang"])
    pid = env._worker.pid
    t0 = time.monotonic()
    result = env.step(calls(ToolCall("wait_forever", {}),
                            ToolCall("set_temperature", {"device_id": "T1", "value": 20})))
    assert time.monotonic() - t0 < FAST["call_timeout_s"] + 3.0
    first, second = (o["content"] for o in result.observation)
    assert "'wait_forever' stopped the environment" in first and "did not finish" in first
    assert second == first  # later calls cannot run on the lost state
    assert not psutil.pid_exists(pid) and no_children()
    assert env.step(answer()).reward == 0.0


def test_failing_and_hanging_checks(broken):
    tasks, src = broken
    env = src.make_env()
    env.reset(tasks["broken_check"])
    env.step(calls(ToolCall("set_temperature", {"device_id": "T1", "value": 20})))
    assert env.step(answer()).reward == pytest.approx(1 / 3)
    assert [r["result"] for r in env.check_results] == [True, None, None]
    assert "KeyError" in env.check_results[1]["error"]
    assert "not bool" in env.check_results[2]["error"]
    env.reset(tasks["broken_check_hang"])
    env.step(calls(ToolCall("set_temperature", {"device_id": "T1", "value": 20})))
    t0 = time.monotonic()
    assert env.step(answer()).reward == 0.0
    assert time.monotonic() - t0 < FAST["score_timeout_s"] + 3.0
    assert no_children()


CRASHY = '''import os, sys
class Crashy:
    def __init__(self, init_config):
        self.n = 0
    def chatty(self) -> str:
        print("noise on stdout " * 100)
        sys.stdout.flush()
        os.write(1, b"raw noise on fd 1\\n")
        return "still fine"
    def ask(self) -> str:
        return input("type something: ")
    def hog(self) -> str:
        self.blob = bytearray(8 * 1024 ** 3)
        return "allocated"
    def fork_sleeper(self) -> str:
        import subprocess
        subprocess.Popen(["sleep", "60"])
        return "spawned"
    def bump(self) -> int:
        self.n += 1
        return self.n
    def die(self) -> str:
        os._exit(3)
'''


def test_worker_survives_stray_output_and_memory_and_dies_cleanly_on_crash(tmp_path):
    scen = {"task_id": "crashy", "env_id": "crashy", "env_class_name": "Crashy",
            "env_class_code": CRASHY, "init_config": {}, "task": "Bump twice.",
            "checklist_with_func": [{"check_item": "n is 2",
                                     "check_func": "def check_func(s):\n    return s['n'] == 2"}]}
    (tmp_path / "s.json").write_text(json.dumps([scen]))
    src = EnvScalerTaskSource(str(tmp_path / "s.json"), **FAST,
                              limits=ResourceLimits(memory_bytes=1024**3))
    task = src.tasks("train")[0]
    env = src.make_env()
    env.reset(task)
    obs = env.step(calls(ToolCall("chatty", {}), ToolCall("ask", {}), ToolCall("hog", {}),
                         ToolCall("bump", {}), ToolCall("fork_sleeper", {}),
                         ToolCall("bump", {}))).observation
    contents = [o["content"] for o in obs]
    assert contents[0] == "still fine"
    assert contents[1].startswith("Error: EOFError")  # stdin is /dev/null, not the pipe
    assert contents[2].startswith("Error: MemoryError")  # address-space limit
    assert contents[3:] == ["1", "spawned", "2"]
    assert env.step(answer()).reward == 1.0
    assert no_children()  # the grandchild died with the worker's process group

    env.reset(task)
    pid = env._worker.pid
    result = env.step(calls(ToolCall("die", {}), ToolCall("bump", {})))
    assert "exited with code 3" in result.observation[0]["content"]
    assert "stopped the environment" in result.observation[1]["content"]
    assert env.step(answer()).reward == 0.0
    assert not psutil.pid_exists(pid) and no_children()


def test_worker_rejects_bad_handlers():
    with pytest.raises(WorkerCrashed, match="ModuleNotFoundError"):
        Worker("lopd_jax.envs.no_such_module:Handler", start_timeout_s=5.0)
    with pytest.raises(ValueError, match="module:ClassName"):
        Worker("no_colon")
    assert no_children()

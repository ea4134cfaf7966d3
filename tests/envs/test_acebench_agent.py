"""ACEBench agent categories: upstream rows replayed through our scenarios, wrong actions,
the simulated user, upstream's checker quirks and malformed data.

``tests/fixtures/acebench/`` holds six rows of ACEBench's real English agent data
(``data_all/data_en/data_agent_{multi_step,multi_turn}.json`` and their
``possible_answer`` files, github.com/ACEBench/ACEBench commit e6db74b, MIT licence),
byte for byte: multi-step 2 and 19, multi-turn 0, 7 (its ground truth spells a class
``Reminderpi``), 20 and 25 (the airline). Their ground truths were written by upstream, so
they are an oracle independent of our code. About 1 s in all.
"""

import json
import os
import shutil

import pytest

from lopd_jax.envs.acebench.env import ACEBenchTaskSource
from lopd_jax.envs.acebench.agent import (MAX_MESSAGES, ACEBenchAgentEnvironment, check_end_state,
                                          load_agent_category, parse_agent_calls, process_accuracy)
from lopd_jax.envs.acebench.scenarios import build_instances, end_state, execute
from lopd_jax.core.types import AssistantTurn, ToolCall
from tests.paths import FIXTURES as PATHS_FIXTURES

FIXTURES = os.path.join(PATHS_FIXTURES, "acebench")


def _turn(text):
    return AssistantTurn(raw=text, content=text)


class ScriptedUser:
    """A user simulator that answers with fixed lines and records what it saw."""

    def __init__(self, lines=("ok",)):
        self.lines, self.seen = list(lines), []

    def __call__(self, chat):
        self.seen.append([dict(m) for m in chat])
        return self.lines.pop(0) if len(self.lines) > 1 else self.lines[0]


@pytest.fixture(scope="module")
def tasks():
    return {t.task_id: t for c in ("agent_multi_step", "agent_multi_turn") for t in load_agent_category(FIXTURES, c)}


def _stones(task):
    s = task.payload["mile_stone"]
    return s[0] if s and isinstance(s[0], list) else s


def replay(task, messages, user=None):
    env = ACEBenchAgentEnvironment(user or ScriptedUser())
    env.reset(task)
    result = None
    for m in messages:
        result = env.step(_turn(m))
        if result.done:
            break
    reward = result.reward if result is not None and result.done else env.finish()
    return env, reward


def test_ground_truth_replays_pass_end_state_and_milestones(tasks):
    assert sorted(tasks) == ["agent_multi_step_19", "agent_multi_step_2", "agent_multi_turn_0",
                             "agent_multi_turn_20", "agent_multi_turn_25", "agent_multi_turn_7"]
    for task in tasks.values():
        env, reward = replay(task, _stones(task))
        assert reward == 1.0, (task.task_id, env.verdict)
        assert env.stats.as_dict()["end_state_passed"] == 1 and env.stats.as_dict()["process_accuracy"] == 1.0
        # the milestones themselves are found in order among the executed messages
        assert process_accuracy(env.milestones, task.payload["mile_stone"]) == 1.0 or task.task_id in (
            "agent_multi_turn_7",)  # its 2nd milestone ends in a space: not a call, it goes to the user


def test_a_finished_episode_is_graded_through_finish_conversation(tasks):
    task = tasks["agent_multi_step_2"]
    env = ACEBenchAgentEnvironment()
    env.reset(task)
    for m in _stones(task):
        assert not env.step(_turn(m)).done
    result = env.step(_turn("finish conversation"))
    assert result.done and result.reward == 1.0 and result.info["verdict"]["valid"]


@pytest.mark.parametrize("how", ["wrong_argument", "missing_step", "nothing_done", "wrong_api"])
def test_wrong_actions_fail(tasks, how):
    task = tasks["agent_multi_turn_0"]
    stones = _stones(task)
    messages = {"wrong_argument": stones[:-1] + [stones[-1].replace("lunch", "dinner")],
                "missing_step": stones[:2] + stones[3:],  # the oldest message is not deleted: inbox full
                "nothing_done": ["I cannot help."],
                "wrong_api": stones[:-1] + [stones[-1].replace("send_message", "send_mail")]}[how]
    env, reward = replay(task, messages)
    assert reward == 0.0 and not env.verdict["valid"]
    process = env.stats.as_dict()["process_accuracy"]
    assert process == {"wrong_argument": 0.75, "missing_step": 0.5, "nothing_done": 0.0, "wrong_api": 0.75}[how]
    if how == "nothing_done":
        assert env.verdict["error_type"] == "wrong number of class"
    else:
        assert any("inbox" in e for e in env.verdict["errors"])


def test_airline_wrong_cabin_and_wrong_password_fail(tasks):
    task = tasks["agent_multi_turn_20"]
    booking = _stones(task)[1]
    _, reward = replay(task, [_stones(task)[0], booking.replace("Economy Class", "Business Class")])
    assert reward == 0.0
    env = ACEBenchAgentEnvironment(ScriptedUser())
    env.reset(task)
    obs = env.step(_turn(booking.replace("password456", "nope"))).observation
    assert obs[0]["content"] == "execution:[\"Error during execution: 'membership_level'\"]"  # as upstream
    assert env.finish() == 0.0 and env.verdict["error_type"] == "wrong number of class"  # no clean execution


def test_execution_messages_and_routing(tasks):
    """Multi-step: results as ``execution result:[...]``, text that is not a call gets
    upstream's reply; multi-turn: ``execution:[...]``, text goes to the simulated user."""
    step = ACEBenchAgentEnvironment()
    step.reset(tasks["agent_multi_step_2"])
    obs = step.step(_turn("[turn_on_wifi()]")).observation
    assert obs == [{"role": "user", "content": "execution result:[{'status': True, 'message': "
                                               "'Wi-Fi has been turned on'}]"}]
    assert step.step(_turn("Which user?")).observation[0]["content"].startswith(
        "execution result:Please do not ask me any questions")
    native = AssistantTurn(raw="", content="", tool_calls=[ToolCall("login_food_platform", {
        "username": "Jack", "password": "password654"})])  # no text: the native call, rendered as upstream's
    assert "successfully logged in" in step.step(native).observation[0]["content"]
    assert step.milestones[-1] == "[login_food_platform(username='Jack', password='password654')]"
    user = ScriptedUser(["I am Grace, hello", "Send it to Frank"])
    turn = ACEBenchAgentEnvironment(user)
    messages, tools = turn.reset(tasks["agent_multi_turn_0"])
    assert tools == [] and messages[1]["content"].endswith("Conversation history 1..t:\nuser:I am Grace, hello\n")
    assert "Instruction: Your name is Grace" in user.seen[0][0]["content"]
    assert user.seen[0][1] == {"role": "user", "content": "Is there anything you need help with today?"}
    assert "Sending Text Messages" in messages[0]["content"]  # upstream's phone rules follow the agent prompt
    reply = turn.step(_turn("Who should receive it?")).observation
    assert reply == [{"role": "user", "content": "user:Send it to Frank"}]
    assert user.seen[1][-1] == {"role": "user", "content": "Who should receive it?"}
    assert turn.step(_turn("[turn_on_wifi()]")).observation[0]["content"].startswith("execution:[{'status': True")
    # the simulated user ends the conversation; the end state is graded (incomplete: 0)
    turn.user = ScriptedUser(["finish conversation"])
    result = turn.step(_turn("Done."))
    assert result.done and result.reward == 0.0


def test_the_message_cap_ends_the_episode(tasks):
    env = ACEBenchAgentEnvironment()
    env.reset(tasks["agent_multi_step_2"])
    steps = 0
    while True:
        steps += 1
        if env.step(_turn("[turn_on_wifi()]")).done:
            break
    assert steps == MAX_MESSAGES // 2  # agent and execution messages alternate


def test_upstream_checker_quirks():
    state = [{"BaseApi": {"wifi": True, "logged_in": True}}, {"MessageApi": {"inbox": {"1": {"m": "a"}, "7": "x"}}}]
    # a dict attribute: only the expected keys are compared (extra keys pass)
    assert check_end_state(state, [{"BaseApi": {"wifi": True, "logged_in": True}},
                                   {"MessageApi": {"inbox": {"1": {"m": "a"}}}}])["valid"]
    # a ground-truth class named like no class (upstream's "Reminderpi") is not checked ...
    assert check_end_state(state, [{"BaseApi": {"wifi": True, "logged_in": True}},
                                   {"MessageAPI": {"inbox": {}}}])["valid"]
    # ... but the number of classes must match, and a wrong scalar fails
    assert check_end_state(state[:1], [{"BaseApi": {"wifi": True}}, {"MessageApi": {}}])["error_type"] == \
        "wrong number of class"
    bad = check_end_state(state, [{"BaseApi": {"wifi": False, "logged_in": True}}, {"MessageApi": {"inbox": {}}}])
    assert not bad["valid"] and "attributes(wifi)" in bad["errors"][0]
    assert process_accuracy(["[a()]", "[b()]"], [["[b()]"], ["[a()]", "[c()]"]]) == 1.0
    assert process_accuracy(["[b()]", "[a()]"], ["[a()]", "[b()]"]) == 0.5  # in order


def test_scenarios_follow_upstream():
    objs = build_instances(["BaseApi", "MessageApi", "FoodPlatform"], {"BaseApi": {"wifi": False, "logged_in": False}})
    assert [o.wifi for o in objs.values()] == [False, False, False]
    results, failed = execute(objs, [{"turn_on_wifi": {}}], stop_on_error=False)
    assert not failed and [o.wifi for o in objs.values()] == [True, True, True]  # every class that has it
    results, failed = execute(objs, [{"delete_message": {"message_id": 1}}, {"nope": {}},
                                     {"get_all_message_times_with_ids": {}}], stop_on_error=False)
    assert failed and results[0]["status"] is False  # not logged in
    assert results[1].startswith("Error during execution") and results[2]["status"] is False
    execute(objs, [{"login_device": {}}], stop_on_error=False)
    results, _ = execute(objs, [{"get_all_message_times_with_ids": {}}, {"check_balance": {"user_name": "Eve"}}],
                         stop_on_error=True)
    assert results == [{"1": "2024-06-09", "2": "2024-03-09", "3": "2023-12-05", "4": "2024-09-09",
                        "5": "2024-06-06", "6": "2024-01-15"}, 500.0]  # through JSON, as upstream
    state = end_state(objs)
    assert list(state[1]["MessageApi"]["inbox"]) == ["1", "2", "3", "4", "5", "6"]
    assert state[2] == {"FoodPlatform": {"users": state[2]["FoodPlatform"]["users"], "logged_in_users": [],
                                         "orders": []}}
    with pytest.raises(ValueError, match="unknown ACEBench scenario class"):
        build_instances(["Finance"], {})


def test_parse_agent_calls():
    assert parse_agent_calls("[send_message(sender_name='Eve', receiver_name='Frank', message='hi')]") == [
        {"send_message": {"sender_name": "Eve", "receiver_name": "Frank", "message": "hi"}}]
    assert parse_agent_calls(" login_device()") == [{"login_device": {}}]  # brackets added, as upstream
    assert parse_agent_calls("[a(x=1), b(y=[{'p': 'q'}])]") == [{"a": {"x": 1}}, {"b": {"y": [{"p": "q"}]}}]
    for bad in ("finish conversation", "[f(x='it's')]", "[]", "[__import__('os').system('true')]x"):
        with pytest.raises(ValueError):
            parse_agent_calls(bad)


def _copy(tmp_path):
    folder = tmp_path / "acebench"
    shutil.copytree(FIXTURES, folder)
    return folder


@pytest.mark.parametrize("which,edit,needle", [
    ("q", lambda r: r.pop("initial_config"), "missing field 'initial_config'"),
    ("q", lambda r: r.update(involved_classes=["Finance"]), "field 'involved_classes'"),
    ("q", lambda r: r.update(function="docs"), "field 'function' must be list"),
    ("q", lambda r: r.update(id="agent_multi_step_99"), "has no 'ground_truth' row"),
    ("a", lambda r: r.update(ground_truth=[{"BaseApi": 1}]), "field 'ground_truth'"),
    ("a", lambda r: r.update(mile_stone=[1, 2]), "field 'mile_stone'"),
    ("a", lambda r: r.pop("mile_stone"), "missing field 'mile_stone'"),
])
def test_malformed_data_names_the_file_and_field(tmp_path, which, edit, needle):
    folder = _copy(tmp_path)
    path = folder / ("data_agent_multi_step.json" if which == "q" else "possible_answer/data_agent_multi_step.json")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    edit(rows[1])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as e:
        load_agent_category(str(folder), "agent_multi_step")
    assert f"{path}:2" in str(e.value) and needle in str(e.value)


def test_bad_json_missing_files_and_no_user(tmp_path):
    folder = _copy(tmp_path)
    (folder / "data_agent_multi_turn.json").write_text("{not json\n")
    with pytest.raises(ValueError, match=r"data_agent_multi_turn.json:1: not a JSON object"):
        load_agent_category(str(folder), "agent_multi_turn")
    with pytest.raises(FileNotFoundError, match="github.com/ACEBench/ACEBench"):
        load_agent_category(str(tmp_path), "agent_multi_step")
    with pytest.raises(ValueError, match="needs a simulated user"):
        ACEBenchTaskSource(FIXTURES, categories=("agent_multi_turn",))
    source = ACEBenchTaskSource(FIXTURES, categories=("agent_multi_step", "agent_multi_turn"), limit=1,
                                user=ScriptedUser())
    assert [t.task_id for t in source.tasks("heldout")] == ["agent_multi_step_2", "agent_multi_turn_0"]
    env = source.make_env()  # the ACEBench environment hands agent episodes over
    env.reset(source.tasks("heldout")[0])
    assert env.step(_turn("[turn_on_wifi()]")).observation[0]["content"].startswith("execution result:")
    assert env.finish() == 0.0 and env.stats.as_dict()["process_accuracy"] == pytest.approx(1 / 3, abs=1e-3)

"""ACEBench normal / special: upstream-format fixtures, AST grading, malformed data, hostile
answers, and the suite row."""

import json
import os
import shutil
import re
import time
import types

import pytest

from lopd_jax.programs import eval_suite
from lopd_jax.envs.acebench import env as acebench
from lopd_jax.envs.acebench.env import (NORMAL_CATEGORIES, SPECIAL_CATEGORIES, ACEBenchTaskSource,
                                    AnswerFormatError, decode_calls, grade, load_category)
from lopd_jax.core.types import AssistantTurn, ToolCall
from tests.paths import FIXTURES

TIME = "The current time is 2024-06-11 16:00."

ECLIPSE = {"name": "NightSkyAnalysis_performEclipseAnalysis",
           "description": "Analyzes the occurrence of solar eclipses.",
           "parameters": {"type": "object", "properties": {
               "dateRange": {"description": "Range of dates.", "type": "object", "properties": {
                   "startDate": {"type": "string"}, "endDate": {"type": "string"}},
                   "required": ["startDate", "endDate"]},
               "location": {"type": "object", "properties": {"latitude": {"type": "number"},
                                                             "longitude": {"type": "number"}}},
               "eclipseType": {"type": "string", "enum": ["total", "annular", "partial"]}},
               "required": ["dateRange", "location"]}}
ALERTS = {"name": "AIErrorTracker_configureAlerts", "description": "Configures alerts.",
          "parameters": {"type": "object", "properties": {
              "errorTypes": {"type": "array", "items": {"type": "string"}},
              "alertChannels": {"type": "array", "items": {"type": "object", "properties": {
                  "channelType": {"type": "string"}, "recipient": {"type": "string"}}}},
              "retries": {"type": "integer"}, "verbose": {"type": "boolean"}},
              "required": ["errorTypes"]}}
PRESS = {"name": "branding_createPressRelease", "description": "Creates a press release.",
         "parameters": {"type": "object", "properties": {
             "title": {"type": "string"}, "author": {"type": "string"}},
             "required": ["title", "author"]}}
ENGAGE = {"name": "branding_evaluateMediaEngagement", "description": "Media engagement.",
          "parameters": {"type": "object", "properties": {"pressReleaseId": {"type": "string"}},
                         "required": ["pressReleaseId"]}}
LEGACY = {"name": "legacy_lookup", "description": "An upstream doc with 'arguments'.",
          "arguments": {"type": "object", "properties": {}}, "results": {}, "tags": []}

ECLIPSE_TRUTH = {ECLIPSE["name"]: {"dateRange": {"startDate": "2023-01-01", "endDate": "2028-01-01"},
                                   "location": {"latitude": 37.9838, "longitude": 23.7275},
                                   "eclipseType": "total"}}
ALERTS_TRUTH = {ALERTS["name"]: {"errorTypes": ["critical"], "retries": 3, "verbose": True,
                                 "alertChannels": [{"channelType": "email", "recipient": "a@b.com"},
                                                   {"channelType": "sms", "recipient": "+123"}]}}


def _rows(category):
    """(question rows, answer rows) for ``category`` as upstream writes them."""
    q = lambda i, text, fns, **kw: {"id": f"{category}_{i}", "question": f"user: {text}\n",  # noqa: E731
                                    "function": fns, "time": TIME, **kw}
    if category == "normal_preference":
        rows = [{"id": f"{category}_0", "question": "user: Alerts for critical errors please.\n",
                 "function": [ALERTS, LEGACY], "profile": "{'basic_features': {'UserName': 'Ann'}}"}]
        return rows, [{"id": f"{category}_0", "ground_truth": ALERTS_TRUTH}]
    if category.startswith("normal_multi_turn"):
        rows, answers = [], []
        for conv in range(2):
            for item, (fns, truth) in enumerate([
                    ([PRESS, ENGAGE], {PRESS["name"]: {"title": f"Launch {conv}", "author": "John Doe"}}),
                    ([PRESS, ENGAGE], {ENGAGE["name"]: {"pressReleaseId": f"PR-{conv}"}})]):
                rid = f"{category}_{conv}_{item}"
                rows.append({"id": rid, "question": "user: Create it.\nsystem: Details?\nuser: Go.\n",
                             "function": fns, "time": TIME})
                answers.append({"id": rid, "ground_truth": truth})
        return rows, answers
    if category == "normal_single_turn_parallel_function":
        truth = {**ECLIPSE_TRUTH, **ALERTS_TRUTH}
        return [q(0, "Eclipses and alerts.", [ECLIPSE, ALERTS])], [{"id": f"{category}_0", "ground_truth": truth}]
    if category == "normal_atom_bool":  # a list of alternative answers, and a repeated API (_1/_2)
        truth = [{PRESS["name"] + "_1": {"title": "A", "author": "X"}, PRESS["name"] + "_2": {"title": "B", "author": "Y"}},
                 {PRESS["name"]: {"title": "AB", "author": "XY"}}]
        return [q(0, "Two releases.", [PRESS])], [{"id": f"{category}_0", "ground_truth": truth}]
    if category == "special_incomplete":
        return ([q(0, "Analyze the eclipse.", [ECLIPSE, ALERTS])],
                [{"id": f"{category}_0", "ground_truth": {ECLIPSE["name"]: ["dateRange", "location"]}}])
    if category == "special_error_param":
        return ([q(0, "Alert me with ID 1234WrongID.", [ALERTS])],
                [{"id": f"{category}_0", "ground_truth": {"errorTypes": ["1234WrongID"]}}])
    if category == "special_irrelevant":
        return ([q(0, "Bake me a cake.", [ECLIPSE])],
                [{"id": f"{category}_0", "ground_truth": "Due to the limitations of the function, I cannot solve this problem."}])
    return ([q(0, "When is the next eclipse in Athens?", [ECLIPSE, LEGACY])],
            [{"id": f"{category}_0", "ground_truth": ECLIPSE_TRUTH}])


def write_fixture(folder):
    """Every normal and special category in upstream's layout under ``folder``."""
    os.makedirs(os.path.join(folder, "possible_answer"), exist_ok=True)
    for c in NORMAL_CATEGORIES + SPECIAL_CATEGORIES:
        rows, answers = _rows(c)
        for path, data in ((os.path.join(folder, f"data_{c}.json"), rows),
                           (os.path.join(folder, "possible_answer", f"data_{c}.json"), answers)):
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in data)


def render(option):
    """A possible answer as the call text the prompt asks for."""
    calls = [f"{re.sub(r'_[0-9]+$', '', k)}(" + ", ".join(f"{p}={v!r}" for p, v in params.items()) + ")"
             for k, params in option.items()]
    return "[" + ", ".join(calls) + "]"


def reference(task):
    """The correct answer text of ``task`` in the format its prompt asks for."""
    truth, cat = task.payload["ground_truth"], task.payload["category"]
    if cat == "special_irrelevant":
        return '["Due to the limitations of the function, I cannot solve this problem."]'
    if cat == "special_incomplete":
        (name, missing), = truth.items()
        return f'["Missing necessary parameters ({", ".join(missing)}) for the api ({name})"]'
    if cat == "special_error_param":
        return "[" + ", ".join(f'"There is incorrect value ({v[0]}) for the parameters ({k}) in the conversation history."'
                               for k, v in truth.items()) + "]"
    return render(truth[0] if isinstance(truth, list) else truth)


def _turn(text):
    return AssistantTurn(raw=f"<think>hmm</think>{text}", content=text)


@pytest.fixture()
def source(tmp_path):
    write_fixture(str(tmp_path))
    return ACEBenchTaskSource(str(tmp_path))


def _by_id(source):
    return {t.task_id: t for t in source.tasks("heldout")}


def test_reference_answers_pass_every_category(source):
    tasks = source.tasks("heldout")
    assert {t.payload["category"] for t in tasks} == set(NORMAL_CATEGORIES + SPECIAL_CATEGORIES)
    assert len(tasks) == 12 + 3 + 6  # two multi-turn categories of 2 conversations x 2 rows
    assert source.tasks("train") == []
    for task in tasks:
        with source.make_env() as env:
            messages, tools = env.reset(task)
            assert tools == [] and [m["role"] for m in messages] == ["system", "user"]
            assert messages[1]["content"].startswith("Conversation history 1..t:\nuser: ")
            result = env.step(_turn(reference(task)))
            assert result.done and result.reward == 1.0, (task.task_id, result.info["verdict"])
    pref = _by_id(source)["normal_preference_0"].payload["system"]
    assert "Character Profile:\n{'basic_features'" in pref and "'AIErrorTracker_configureAlerts'" in pref
    special = _by_id(source)["special_incomplete_0"].payload["system"]
    assert TIME in special and "Missing necessary parameters (key1, key2, ...)" in special
    # the second alternative of a list-valued answer also passes; whitespace is ignored
    t = _by_id(source)["normal_atom_bool_0"]
    assert grade(t, _turn("[branding_createPressRelease( title = 'AB' ,author='XY')]"))["valid"]


def _eclipse(**change):
    params = {**ECLIPSE_TRUTH[ECLIPSE["name"]], **change}
    return render({ECLIPSE["name"]: {k: v for k, v in params.items() if v is not None}})


@pytest.mark.parametrize("text, error_type", [
    (_eclipse(eclipseType="annular"), "value_error:string"),                       # wrong value
    (_eclipse(dateRange=None), "lack_args"),                                       # missing required
    (_eclipse(dateRange={"startDate": "2023-01-01", "endDate": "2029-01-01"}), "value_error"),  # nested
    (_eclipse(dateRange={"startDate": "2023-01-01"}), "value_error"),              # nested key missing
    (_eclipse(extra="x"), "addition_args"),                                        # unknown param
    (_eclipse(eclipseType=5), "type_error"),                                       # wrong type
    (_eclipse().replace("NightSkyAnalysis_performEclipseAnalysis", "NightSky_other"), "function_mismatch"),
    ("[]", "wrong functions number"),
    (_eclipse()[:-1] + ", legacy_lookup()]", "wrong functions number"),
    ("I think the eclipse is in 2027.", "wrong_output_format"),
])
def test_wrong_normal_answers_fail(source, text, error_type):
    task = _by_id(source)["normal_single_turn_single_function_0"]
    verdict = grade(task, _turn(text))
    assert not verdict["valid"] and verdict["error_type"] == error_type, verdict


def test_lists_dicts_parallel_calls_and_scalars(source):
    ids = _by_id(source)
    par = ids["normal_single_turn_parallel_function_0"]
    good = render({**ALERTS_TRUTH, **ECLIPSE_TRUTH})  # order of calls does not matter
    assert grade(par, _turn(good))["valid"]
    alerts = ALERTS_TRUTH[ALERTS["name"]]
    for bad in ({"errorTypes": ["critical", "minor"]},                                  # list value
                {"alertChannels": alerts["alertChannels"][:1]},                          # list of dicts: count
                {"alertChannels": [alerts["alertChannels"][0], {"channelType": "sms", "recipient": "+999"}]}):
        text = render({**ECLIPSE_TRUTH, ALERTS["name"]: {**alerts, **bad}})
        assert not grade(par, _turn(text))["valid"], bad
    # as upstream's checker, top-level numbers and booleans are type-checked only ...
    wrong_scalars = render({**ECLIPSE_TRUTH, ALERTS["name"]: {**alerts, "retries": 7, "verbose": False}})
    assert grade(par, _turn(wrong_scalars))["valid"]
    assert not grade(par, _turn(render({**ECLIPSE_TRUTH, ALERTS["name"]: {**alerts, "retries": "7"}})))["valid"]
    # ... and strict_scalars compares them too
    assert not grade(par, _turn(wrong_scalars), strict_scalars=True)["valid"]
    assert grade(par, _turn(good), strict_scalars=True)["valid"]
    # a repeated API must be called as many times as the answer lists it
    rep = ids["normal_atom_bool_0"]
    assert grade(rep, _turn("[branding_createPressRelease(title='A', author='X'), "
                            "branding_createPressRelease(title='B', author='Y')]"))["valid"]
    assert not grade(rep, _turn("[branding_createPressRelease(title='A', author='X')]"))["valid"]
    assert not grade(rep, _turn("[branding_createPressRelease(title='A', author='X'), "
                                "branding_createPressRelease(title='C', author='Y')]"))["valid"]


def test_native_tool_calls_are_graded_when_there_is_no_text(source):
    task = _by_id(source)["normal_single_turn_single_function_0"]
    args = ECLIPSE_TRUTH[ECLIPSE["name"]]
    ok = AssistantTurn(raw="", content="", tool_calls=[ToolCall(ECLIPSE["name"], dict(args))])
    assert grade(task, ok)["valid"]
    bad = AssistantTurn(raw="", content="", tool_calls=[ToolCall(ECLIPSE["name"], {**args, "eclipseType": "partial"})])
    assert not grade(task, bad)["valid"]


def test_special_answers(source):
    ids = _by_id(source)
    inc, err, irr = ids["special_incomplete_0"], ids["special_error_param_0"], ids["special_irrelevant_0"]
    name = ECLIPSE["name"]
    for text, kind in [(f'["Missing necessary parameters (dateRange) for the api ({name})"]', "error_correction"),
                       ('["Missing necessary parameters (dateRange, location) for the api (other)"]', "error_correction"),
                       ('["Please give the dates and location."]', "error_detection"),
                       (_eclipse(), "error_detection")]:
        v = grade(inc, _turn(text))
        assert not v["valid"] and v["error_type"] == kind, (text, v)
    assert not grade(err, _turn('["There is incorrect value (1234) for the parameters (errorTypes)"]'))["valid"]
    assert not grade(err, _turn('["The value 1234WrongID is incorrect"]'))["valid"]
    assert not grade(irr, _turn(_eclipse()))["valid"]
    assert not grade(irr, _turn("I cannot do that."))["valid"]


def test_multi_turn_conversations_count_only_when_every_turn_passes():
    rows = [{"task_id": f"normal_multi_turn_user_switch_{c}_{i}", "category": "normal_multi_turn_user_switch",
             "passed": [p]} for c, i, p in [(0, 0, True), (0, 1, True), (1, 0, True), (1, 1, False)]]
    rows += [{"task_id": "special_irrelevant_0", "category": "special_irrelevant", "passed": [True, False]}]
    out = acebench.aggregate(rows)
    assert out == {"normal_multi_turn_user_switch": 50.0, "special_irrelevant": 50.0, "normal": 50.0,
                   "special": 50.0, "normal_special": 50.0}
    assert acebench.aggregate_counts(rows)["normal_multi_turn_user_switch"] == 2


def test_malformed_data_names_the_file_and_field(tmp_path):
    write_fixture(str(tmp_path))
    cat = "normal_atom_enum"
    qpath, apath = tmp_path / f"data_{cat}.json", tmp_path / "possible_answer" / f"data_{cat}.json"
    good_q, good_a = qpath.read_text(), apath.read_text()

    def expect(path, text, *needles):
        path.write_text(text)
        with pytest.raises(ValueError) as e:
            load_category(str(tmp_path), cat)
        for needle in (str(path),) + needles:
            assert needle in str(e.value), str(e.value)
        qpath.write_text(good_q)
        apath.write_text(good_a)

    row = json.loads(good_q)
    expect(qpath, json.dumps({k: v for k, v in row.items() if k != "function"}) + "\n", ":1", "'function'")
    expect(qpath, json.dumps({**row, "question": ["x"]}) + "\n", "'question'", "str")
    expect(qpath, json.dumps({**row, "function": [{"description": "no name"}]}) + "\n", "'function'[0]", "'name'")
    expect(qpath, json.dumps({k: v for k, v in row.items() if k != "time"}) + "\n", "'time'")
    expect(qpath, "{not json\n", ":1")
    expect(qpath, json.dumps({**row, "id": "other_7"}) + "\n", "'other_7'", "ground_truth")
    expect(apath, json.dumps({"id": row["id"]}) + "\n", "'ground_truth'")
    expect(apath, json.dumps({"id": row["id"], "ground_truth": {"f": 3}}) + "\n", "'ground_truth'")
    os.remove(apath)
    with pytest.raises(FileNotFoundError, match="github.com/ACEBench/ACEBench"):
        load_category(str(tmp_path), cat)
    with pytest.raises(ValueError, match="unknown ACEBench category"):
        load_category(str(tmp_path), "agent_multi_turn")


HOSTILE = [
    "[" + "NightSkyAnalysis_performEclipseAnalysis(eclipseType='total')," * 40_000 + "]",  # huge
    "[" * 5_000 + "]" * 5_000,                                                             # deep nesting
    "\x00\xff\ufffd garbage ]]][[ ((( '''",
    "[NightSkyAnalysis_performEclipseAnalysis(eclipseType=__import__('os').system('touch PWNED'))]",
    "[NightSkyAnalysis_performEclipseAnalysis(eclipseType=9**9**9**9)]",
    "[NightSkyAnalysis_performEclipseAnalysis(eclipseType=1e308*1e308)]",
    "[NightSkyAnalysis_performEclipseAnalysis(eclipseType=(lambda: 1)())]",
    "[NightSkyAnalysis_performEclipseAnalysis(eclipseType=" + "9" * 5000 + ")]",
    "[NightSkyAnalysis_performEclipseAnalysis(**{'a': 1}), 3]",
    "[NightSkyAnalysis_performEclipseAnalysis(dateRange={[1]: 2})]",
]


@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_answers_fail_without_crashing(source, text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    for task_id in ("normal_single_turn_single_function_0", "special_incomplete_0"):
        task = _by_id(source)[task_id]
        with source.make_env() as env:
            env.reset(task)
            result = env.step(AssistantTurn(raw=text, content=text))
        assert result.done and result.reward == 0.0
    assert time.perf_counter() - start < 5.0
    assert not os.path.exists(tmp_path / "PWNED")


def test_decode_calls():
    assert decode_calls("[a.b(x=1,y=[1,-2.5],z={'k':(1,2)}),c()]") == [
        {"a.b": {"x": 1, "y": [1, -2.5], "z": {"k": (1, 2)}}}, {"c": {}}]
    assert decode_calls("[f(x=2*3-1, y=d[0], z=g(w=1))]") == [{"f": {"x": 5, "y": "d[0]", "z": {"g": {"w": 1}}}}]
    for bad in ("f(x=1)", "[1]", "[f(x=1)", "[f(x=1/0)]"):
        with pytest.raises(AnswerFormatError):
            decode_calls(bad)


def _oracle_roll(answer):
    """Roll each task through its environment: normal / special tasks answer once; agent
    tasks replay their milestones (the first alternative), then finish."""
    def roll(tasks, sample, make_env, caps, name):
        out = []
        for task in tasks:
            with make_env() as env:
                env.reset(task)
                if task.payload["category"].startswith("agent"):
                    stones = task.payload["mile_stone"]
                    result = None
                    for m in (stones[0] if isinstance(stones[0], list) else stones):
                        result = env.step(_turn(m))
                    reward = result.reward if result.done else env.finish()
                else:
                    reward = env.step(_turn(answer(task))).reward
                out.append(types.SimpleNamespace(reward=reward, env_stats=env.stats.as_dict()))
        return out
    return roll


AGENT_FIXTURES = os.path.join(FIXTURES, "acebench")


def test_suite_row(tmp_path):
    """Costs about 1 s: 21 normal / special rows and 6 agent rows through their environments."""
    bench = next(b for b in eval_suite.BENCHMARKS if b.name.startswith("ACEBench"))
    args = types.SimpleNamespace(data_dir=str(tmp_path), suite_limit=None, suite_samples=1, max_steps=None,
                                 max_turn_tokens=None, max_total_tokens=None)
    missing = eval_suite.run_benchmark(bench, _oracle_roll(reference), args)
    assert missing["status"] == "not run" and missing["missing_file"].endswith(
        os.path.join("acebench", "data_agent_multi_step.json"))
    assert "github.com/ACEBench/ACEBench" in missing["reason"]
    write_fixture(str(tmp_path / "acebench"))
    row = eval_suite.run_benchmark(bench, _oracle_roll(reference), args)
    assert row["status"] == "partial" and row["score"] is None and "agent_multi_step and agent_multi_turn" in row["reason"]
    assert row["problems"] == 21 and row["normal_special_score"] == 100.0
    assert row["user_simulator"] == "none"
    assert set(row["per_category"].values()) == {100.0}
    assert row["category_counts"]["normal_multi_turn_user_adjust"] == 2 and row["category_counts"]["special"] == 3
    limited = eval_suite.run_benchmark(bench, _oracle_roll(reference), types.SimpleNamespace(**{**vars(args), "suite_limit": 1}))
    assert limited["problems"] == 17 and limited["category_counts"]["normal_multi_turn_user_switch"] == 1  # whole conversations
    wrong = eval_suite.run_benchmark(bench, _oracle_roll(lambda t: "[]"), args)
    assert wrong["per_category"]["normal"] == 0.0 and wrong["per_category"]["special"] == 0.0
    report = {"suite": "tool_use", "model": "m", "wall_s": 1.0, "rows": [row],
              "decoding": {"temperature": 0, "top_p": 1, "top_k": 0, "enable_thinking": True,
                           "max_turn_tokens": 8, "max_total_tokens": 16, "samples_per_problem": 1}}
    md = eval_suite.render_markdown(report)
    assert "| ACEBench (multi-step/turn avg) | - | - | 21 |" in md and "partial: the paper's ACEBench cell" in md
    assert "normal_special 100.0 (n=17)" in md
    # the agent categories fill the Table 1 cell: their mean end-to-end accuracy
    for name in os.listdir(AGENT_FIXTURES):
        if name.endswith(".json"):
            shutil.copy(os.path.join(AGENT_FIXTURES, name), tmp_path / "acebench" / name)
    for name in os.listdir(os.path.join(AGENT_FIXTURES, "possible_answer")):
        shutil.copy(os.path.join(AGENT_FIXTURES, "possible_answer", name), tmp_path / "acebench" / "possible_answer")
    no_user = eval_suite.run_benchmark(bench, _oracle_roll(reference), args)
    assert no_user["status"] == "partial" and "agent_multi_turn" in no_user["reason"]
    assert no_user["per_category"]["agent_multi_step"] == 100.0
    user = lambda chat: "ok"  # noqa: E731
    user.name = "scripted"
    full = eval_suite.run_benchmark(bench, _oracle_roll(reference), args, user=user)
    assert full["status"] == "ok" and full["score"] == 100.0 and full["problems"] == 27
    assert full["per_category"]["agent_multi_turn"] == 100.0 and full["category_counts"]["agent"] == 6
    assert full["process_accuracy"] == {"agent_multi_step": 100.0, "agent_multi_turn": 100.0}
    assert full["user_simulator"] == "scripted"
    md = eval_suite.render_markdown({**report, "rows": [full]})
    assert "| ACEBench (multi-step/turn avg) | 100.0 | - | 27 |" in md and "user simulator: scripted" in md
    wrong = eval_suite.run_benchmark(bench, _oracle_roll(lambda t: "[]"), args, user=lambda chat: "ok")
    assert wrong["score"] == 100.0  # the agent replays are right, the normal answers wrong
    assert wrong["per_category"]["normal"] == 0.0

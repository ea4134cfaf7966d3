"""LiveCodeBench code_generation_lite: release-format fixtures, windows, hostile code."""

import base64
import json
import os
import pickle
import zlib

import pytest

from lopd_jax.envs.code.livecodebench import (LiveCodeBenchTaskSource, decode_private_tests, grade,
                                         stdout_matches)
from lopd_jax.core.types import AssistantTurn


def _blob(tests) -> str:
    """Private tests as the release stores them: base64(zlib(pickle(json string)))."""
    return base64.b64encode(zlib.compress(pickle.dumps(json.dumps(tests)))).decode()


def _row(qid, date, difficulty, platform, public, private, starter="", metadata=None):
    return {"question_title": f"Problem {qid}", "question_content": f"Solve problem {qid}.",
            "platform": platform, "question_id": qid, "contest_id": "c1", "contest_date": date,
            "starter_code": starter, "difficulty": difficulty,
            "public_test_cases": json.dumps(public), "private_test_cases": _blob(private),
            "metadata": json.dumps(metadata or {})}


def _stdin(i, o):
    return {"input": i, "output": o, "testtype": "stdin"}


def _fn(i, o):
    return {"input": i, "output": o, "testtype": "functional"}


ROWS = [
    _row("abc001_a", "2024-11-02T00:00:00", "easy", "atcoder", [_stdin("1 2\n", "3\n")],
         [_stdin("5 7\n", "12\n"), _stdin("100 -1\n", "99\n")]),
    _row("cf2001_b", "2025-03-15T00:00:00", "medium", "codeforces",
         [_stdin("3\n1 2 3\n", "6\n2.0000000000\n")],
         [_stdin("2\n1 2\n", "3\n1.5\n"), _stdin("1\n7\n", "7\n7.0\n")]),
    _row("3401", "2025-01-10T00:00:00", "hard", "leetcode", [_fn("[1, 2]\n3", "[4, 5]")],
         [_fn("[]\n1", "[]"), _fn("[0, -1, 9]\n-2", "[-2, -3, 7]")],
         starter="class Solution:\n    def addAll(self, nums: List[int], k: int) -> List[int]:\n        ",
         metadata={"func_name": "addAll"}),
    _row("old_one", "2023-06-01T00:00:00", "easy", "atcoder", [_stdin("4\n", "4\n")], []),
]
SOLUTIONS = {
    "abc001_a": "a, b = map(int, input().split())\nprint(a + b)\n",
    "cf2001_b": ("import sys\ndef main():\n    n = int(input())\n    xs = list(map(int, input().split()))\n"
                 "    print(sum(xs))\n    print('%.10f' % (sum(xs) / n))\n"
                 "if __name__ == '__main__':\n    main()\n"),
    "3401": ("class Solution:\n    def addAll(self, nums: List[int], k: int) -> List[int]:\n"
             "        return tuple(x + k for x in nums)\n"),
    "old_one": "print(input())\n",
}


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    d = tmp_path_factory.mktemp("lcb")
    (d / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    (d / "test2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[2:]))
    return d


def _answer(code):
    return f"Here it is.\n```python\n{code}```"


def test_reference_solutions_pass_and_windows_select_by_date(release):
    everything = LiveCodeBenchTaskSource(str(release))
    assert [t.task_id for t in everything.all_tasks()] == ["abc001_a", "cf2001_b", "3401", "old_one"]
    for task in everything.all_tasks():
        with everything.make_env() as env:
            env.reset(task)
            result = env.step(AssistantTurn(raw="", content=_answer(SOLUTIONS[task.task_id])))
            assert result.reward == 1.0, (task.task_id, result.info["feedback"])
    assert [t.task_id for t in LiveCodeBenchTaskSource(str(release), window="v5").all_tasks()] == [
        "abc001_a", "3401"]
    assert [t.task_id for t in LiveCodeBenchTaskSource(str(release), window="v6").all_tasks()] == [
        "cf2001_b"]
    assert everything.all_tasks()[2].family == "livecodebench/hard"


def test_wrong_answers_fail(release):
    source = LiveCodeBenchTaskSource(str(release))
    task = {t.task_id: t for t in source.all_tasks()}
    # right first line, wrong second line
    wrong_line = ("n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs))\n"
                  "print(sum(xs) // n + 0.5)\n")
    reward, feedback, _, _ = grade(task["cf2001_b"].payload, wrong_line, source.sandbox)
    assert reward == 0.0 and "wrong answer" in feedback
    extra_line = "a, b = map(int, input().split())\nprint(a + b)\nprint()\nprint(0)\n"
    assert grade(task["abc001_a"].payload, extra_line, source.sandbox)[0] == 0.0
    off_by_one = ("class Solution:\n    def addAll(self, nums, k):\n        return [x + k + 1 for x in nums]\n")
    assert grade(task["3401"].payload, off_by_one, source.sandbox)[0] == 0.0
    assert stdout_matches("1.50\n 3 \n", "1.5\n3") and not stdout_matches("1.5 x", "1.5 y")


def test_hostile_programs_do_not_pass(release):
    source = LiveCodeBenchTaskSource(str(release))
    task = {t.task_id: t for t in source.all_tasks()}
    always_equal = ("class E(list):\n    def __eq__(self, o):\n        return True\n"
                    "class Solution:\n    def addAll(self, nums, k):\n        return E()\n")
    early_exit = "import os\nos._exit(0)\n"
    fake = "import os\nos.write(1, b'\\nLOPD_RESULTS {\"results\": []}\\n')\nos._exit(0)\n"
    for code in (always_equal, early_exit, fake):
        assert grade(task["3401"].payload, code, source.sandbox)[0] == 0.0, code
    stdin_exit = "import sys\nsys.exit(0)\n"
    assert grade(task["abc001_a"].payload, stdin_exit, source.sandbox)[0] == 0.0
    thief = ("import glob, json, base64, zlib, pickle\n"
             f"rows = [json.loads(l) for f in glob.glob({str(release)!r} + '/*.jsonl') for l in open(f)]\n"
             "tests = json.loads(pickle.loads(zlib.decompress(base64.b64decode(rows[0]['private_test_cases']))))\n"
             "import sys\ndata = sys.stdin.read()\n"
             "print(next(t['output'] for t in tests if t['input'] == data))\n")
    from lopd_jax.envs.code.sandbox import run_python
    probe = run_python(f"open({str(release / 'test.jsonl')!r}).read()", config=source.sandbox)
    if probe.enforced.get("hidden_paths"):
        assert grade(task["abc001_a"].payload, thief, source.sandbox)[0] == 0.0


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/lopd_lcb_pickle_ran",))


@pytest.mark.parametrize("change, message", [
    (lambda r: r.pop("difficulty"), "missing field 'difficulty'"),
    (lambda r: r.update(private_test_cases="%%% not base64 %%%"), "'private_test_cases' is neither"),
    (lambda r: r.update(private_test_cases=base64.b64encode(zlib.compress(pickle.dumps([1, 2]))).decode()),
     "holds a list, not a JSON string"),
    (lambda r: r.update(private_test_cases=base64.b64encode(zlib.compress(pickle.dumps(_Boom()))).decode()),
     "does not hold a plain string"),
    (lambda r: r.update(metadata="{}"), "'func_name'"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, change, message):
    rows = json.loads(json.dumps(ROWS))
    change(rows[2])
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if os.path.exists("/tmp/lopd_lcb_pickle_ran"):
        os.remove("/tmp/lopd_lcb_pickle_ran")
    with pytest.raises(ValueError, match=rf"test.jsonl:3: .*{message}"):
        LiveCodeBenchTaskSource(str(path))
    assert not os.path.exists("/tmp/lopd_lcb_pickle_ran")
    assert decode_private_tests(json.dumps([_stdin("1", "1")]), "x") == [_stdin("1", "1")]


def test_corpus_gets_upstreams_verdicts():
    """Every idiom of the parity corpus as LiveCodeBench's grader (28fef95) judges it: its
    stdin stand-in (open(0), sys.stdin.buffer.readline, iteration and readlines fail or
    differ there), global in helpers, SystemExit ignored, 50,000-digit ints, __main__
    handling, `class Solution` in the text."""
    from benchmarks.grader_parity import expected_verdicts, load_corpus, ours_lcb
    corpus, expected = load_corpus(), expected_verdicts()["lcb"]
    got = ours_lcb(corpus)
    wrong = [(f"{q} {i}", v) for (q, i, _), v in zip(corpus["lcb"], got) if v != expected[f"{q} {i}"]]
    assert len(got) == len(expected) >= 80 and not wrong, wrong
    for idiom, verdict in (("p_sum open0_read", False), ("p_sum global_in_helper", False),
                           ("p_sum sys_exit_1_after_output", True), ("p_pow print_big_int", True),
                           ("f_two main_block_reads_input", True), ("p_sum for_line_in_stdin", False)):
        assert expected[idiom] is verdict, idiom

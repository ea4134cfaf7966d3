"""EvalPlus (HumanEval+ / MBPP+): release-format fixtures, upstream comparison, hostile code."""

import gzip
import json

import pytest

from lopd_jax.envs.code.evalplus import (EvalPlusTaskSource, expected_outputs, grade, load_problems, output_matches,
                                    time_limits)
from lopd_jax.core.types import AssistantTurn

# Rows in the exact layout of HumanEvalPlus-v0.1.10.jsonl.gz / MbppPlus-v0.2.0.jsonl.gz.
HE_ROWS = [
    {"task_id": "HumanEval/2",
     "prompt": "\n\ndef truncate_number(number: float) -> float:\n    \"\"\" Given a positive floating "
               "point number, return its decimal part.\n    >>> truncate_number(3.5)\n    0.5\n    \"\"\"\n",
     "canonical_solution": "\n    return number % 1.0\n",
     "entry_point": "truncate_number",
     "contract": "\n    assert number > 0, \"invalid inputs\" # $_CONTRACT_$\n",
     "base_input": [[3.5], [1.33], [123.456]],
     "atol": 1e-06,
     "plus_input": [[999.99999], [0.04], [1e-05]]},
    {"task_id": "HumanEval/32",
     "prompt": "import math\n\n\ndef poly(xs: list, x: float):\n    return sum([coeff * math.pow(x, i) "
               "for i, coeff in enumerate(xs)])\n\n\ndef find_zero(xs: list):\n    \"\"\" Find x such "
               "that poly(x) = 0. \"\"\"\n",
     "canonical_solution": "\n    begin, end = -1., 1.\n    while poly(xs, begin) * poly(xs, end) > 0:\n"
                           "        begin *= 2.0\n        end *= 2.0\n    while end - begin > 1e-10:\n"
                           "        center = (begin + end) / 2.0\n        if poly(xs, center) * poly(xs, begin) > 0:\n"
                           "            begin = center\n        else:\n            end = center\n    return begin\n",
     "entry_point": "find_zero", "contract": "", "atol": 1e-06,
     "base_input": [[[-10, -2]], [[1, 2]]], "plus_input": [[[-3, -6, -7, 7]]]},
    {"task_id": "HumanEval/12",
     "prompt": "from typing import List, Optional\n\n\ndef longest(strings: List[str]) -> Optional[str]:\n"
               "    \"\"\" Return the longest string, the first one if several. \"\"\"\n",
     "canonical_solution": "\n    if not strings:\n        return None\n\n    maxlen = max(len(x) for x in strings)\n"
                           "    for s in strings:\n        if len(s) == maxlen:\n            return s\n",
     "entry_point": "longest", "contract": "", "atol": 0,
     "base_input": [[[]], [["x", "y", "z"]]], "plus_input": [[["abc", "xyz", "pq"]], [["a", "bb", "cc"]]]},
]
MBPP_ROWS = [
    {"task_id": "Mbpp/2",
     "prompt": "\"\"\"\nWrite a function to find the shared elements from the given two lists.\n"
               "assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))\n\"\"\"\n",
     "canonical_solution": "\ndef similar_elements(test_tup1, test_tup2):\n"
                           "  return tuple(set(test_tup1) & set(test_tup2))\n",
     "entry_point": "similar_elements", "contract": "", "atol": 0,
     "base_input": [[[3, 4, 5, 6], [5, 7, 4, 10]], [[1, 2, 3, 4], [5, 4, 3, 7]]],
     "plus_input": [[[11, 12, 14, 13], [17, 15, 14, 13]]]},
    {"task_id": "Mbpp/17",
     "prompt": "\"\"\"\nWrite a function that returns the perimeter of a square given its side length.\n"
               "assert square_perimeter(10)==40\n\"\"\"\n",
     "canonical_solution": "\ndef square_perimeter(a):\n  return 4*a\n",
     "entry_point": "square_perimeter", "contract": "", "atol": 0,
     "base_input": [[10], [5], [4]], "plus_input": [[2.5], [-3]]},
]


def _write(path, rows, gz=True):
    data = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(data)
    else:
        path.write_text(data)
    return str(path)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalplus")
    return (EvalPlusTaskSource(_write(d / "HumanEvalPlus.jsonl.gz", HE_ROWS)),
            EvalPlusTaskSource(_write(d / "MbppPlus.jsonl", MBPP_ROWS, gz=False)))


def _grade(source, task_id, code):
    task = next(t for t in source.all_tasks() if t.task_id == task_id)
    return grade(task.payload, code, source.sandbox)


def _episode(source, task, answer):
    with source.make_env() as env:
        env.reset(task)
        result = env.step(AssistantTurn(raw=answer, content=answer))
        return result.reward, env.stats.as_dict()


def test_canonical_solutions_pass_base_and_plus(sources):
    for source in sources:
        for task in source.all_tasks():
            reward, stats = _episode(source, task, source.oracle_hint(task))
            if task.task_id == "HumanEval/32":  # evalplus 0.3.1 fails every find_zero answer
                assert reward == 0.0 and stats["base_passed"] == stats["plus_passed"] == 0
                continue
            assert reward == 1.0 and stats["base_passed"] == stats["plus_passed"] == 1, task.task_id
    mbpp = sources[1].all_tasks()[0].payload
    assert mbpp["dataset"] == "mbpp" and isinstance(mbpp["base_input"][0][0], tuple)


def test_float_tolerance_and_plus_only_failures(sources):
    he, mbpp = sources
    close = "def truncate_number(number):\n    return number % 1.0 + 5e-7\n"
    far = "def truncate_number(number):\n    return number % 1.0 + 1e-4\n"
    assert _grade(he, "HumanEval/2", close)[0] == 1.0
    reward, feedback, _, verdicts = _grade(he, "HumanEval/2", far)
    assert reward == 0.0 and verdicts == {"base_passed": 0, "plus_passed": 0}, feedback
    # right on every base input, wrong on a plus input: base passes, plus does not
    ints_only = "def square_perimeter(a):\n    return 4 * a if isinstance(a, int) else 0\n"
    reward, feedback, _, verdicts = _grade(mbpp, "Mbpp/17", ints_only)
    assert reward == 0.0 and verdicts == {"base_passed": 1, "plus_passed": 0}, feedback
    assert "plus input" in feedback
    # a set-equal MBPP task accepts any order; find_zero accepts any root within atol
    assert _grade(mbpp, "Mbpp/2", "def similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n")[0] == 1.0
    assert output_matches([[-10, -2]], -5.0, -4.9, 1e-6, "humaneval", "find_zero")
    assert not output_matches([[-10, -2]], -4.9, -5.0, 1e-6, "humaneval", "find_zero")
    assert not output_matches([1], 1, 1.5, 0, "humaneval", "f") and output_matches([1], (1,), (1,), 0, "mbpp", "f")


def test_hostile_programs_do_not_pass(sources):
    he = sources[0]
    always_equal = ("class E:\n    def __eq__(self, o):\n        return True\n"
                    "def longest(strings):\n    return E()\n")
    early_exit = "import sys\ndef longest(strings):\n    sys.exit(0)\n"
    hard_exit = "import os\nos._exit(0)\n"
    fake_line = ("import os\nos.write(1, b'\\nLOPD_RESULTS {\"results\": []}\\n')\nos._exit(0)\n"
                 "def longest(strings):\n    return None\n")
    for code in (always_equal, early_exit, hard_exit, fake_line):
        reward, feedback, _, verdicts = _grade(he, "HumanEval/12", code)
        assert reward == 0.0 and verdicts["base_passed"] == 0, (code, feedback)


def test_reading_the_data_file_gets_nothing(sources, tmp_path):
    he = sources[0]
    task = next(t for t in he.all_tasks() if t.task_id == "HumanEval/12")
    thief = ("import gzip, json\n"
             f"rows = [json.loads(l) for l in gzip.open({he.path!r}, 'rt')]\n"
             "row = [r for r in rows if r['entry_point'] == 'longest'][0]\n"
             "exec(row['prompt'] + row['canonical_solution'])\n")
    reward, feedback, status, _ = grade(task.payload, thief, he.sandbox)
    from lopd_jax.envs.code.sandbox import SandboxConfig, run_python
    probe = run_python(f"open({he.path!r}, 'rb').read()", config=he.sandbox)
    if not probe.enforced.get("hidden_paths"):
        pytest.skip("this host cannot hide paths (no mount namespace)")
    assert reward == 0.0, feedback


@pytest.mark.parametrize("change, field", [
    (lambda r: r.pop("plus_input"), "plus_input"),
    (lambda r: r.update(atol="0"), "atol"),
    (lambda r: r.update(base_input=[1, 2]), "base_input"),
    (lambda r: r.update(contract=3), "contract"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, change, field):
    rows = json.loads(json.dumps(HE_ROWS))
    change(rows[1])
    path = _write(tmp_path / "HumanEvalPlus.jsonl", rows, gz=False)
    with pytest.raises(ValueError, match=rf"HumanEvalPlus.jsonl:2: .*'{field}'"):
        load_problems(path)
    (tmp_path / "bad.jsonl").write_text(json.dumps(HE_ROWS[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a JSON line"):
        load_problems(str(tmp_path / "bad.jsonl"))


SLOW_ROW = {"task_id": "HumanEval/0", "prompt": "\n\ndef add_one(x: int) -> int:\n    \"\"\" x + 1 \"\"\"\n",
            "canonical_solution": "\n    import time\n    if x == 7:\n        time.sleep(0.5)\n    return x + 1\n",
            "entry_point": "add_one", "contract": "", "atol": 0, "base_input": [[1], [7]], "plus_input": [[3]]}


def test_time_limits_are_per_input(tmp_path):
    """Each input gets max(1 s, 4 x the canonical solution's time on it): a solution slow
    (1.3 s) where the canonical one is fast fails there; as slow where the canonical one
    takes 0.5 s (limit >= 2 s) it passes. About 5 s (sleeps)."""
    source = EvalPlusTaskSource(_write(tmp_path / "HumanEvalPlus.jsonl", [SLOW_ROW], gz=False))
    task = source.all_tasks()[0]
    ref = expected_outputs(task.payload, source.sandbox)
    assert ref["outputs"] == [2, 8, 4] and ref["ref_times"][1] >= 0.5 > ref["ref_times"][0]
    limits = time_limits(ref["ref_times"])
    assert limits[0] == limits[2] == 1.0 and limits[1] >= 2.0
    slow_here = "def add_one(x):\n    import time\n    if x == {}:\n        time.sleep(1.3)\n    return x + 1\n"
    reward, feedback, _, verdicts = grade(task.payload, slow_here.format(3), source.sandbox)
    assert reward == 0.0 and verdicts == {"base_passed": 1, "plus_passed": 0}, feedback
    assert "time limit exceeded (1 s for this test)" in feedback
    reward, feedback, _, _ = grade(task.payload, slow_here.format(7), source.sandbox)
    assert reward == 1.0, feedback


def test_mbpp_special_oracles_581_and_558():
    """Upstream's newer MBPP+ oracles: surface_Area within atol of the pyramid formula with
    a perpendicular height; digit_distance_nums on zero-padded digits."""
    # base 3, height 4: round(9 + 4 * 3 * sqrt(1.5**2 + 16) / 2) = 35; a slant-height reading gives 33
    assert output_matches([3, 4], 35, 33, 0, "mbpp", "surface_Area")
    assert output_matches([3, 4], 33, 33, 0, "mbpp", "surface_Area")
    assert not output_matches([3, 4], 36, 33, 0, "mbpp", "surface_Area")
    assert not output_matches([3, 4], 35, 33, 0, "humaneval", "surface_Area")  # MBPP only
    # 123 vs 56 -> 123 vs 056: 1 + 3 + 3 = 7; zip without padding would give 4 + 4 = 8
    assert output_matches([123, 56], 7, 8, 0, "mbpp", "digit_distance_nums")
    assert output_matches([123, 56], 8, 8, 0, "mbpp", "digit_distance_nums")
    assert not output_matches([123, 56], 9, 8, 0, "mbpp", "digit_distance_nums")
    assert not output_matches([123, 56], "7", 8, 0, "mbpp", "digit_distance_nums")


def test_corpus_gets_upstreams_verdicts():
    """Every idiom of the parity corpus (base and plus verdicts) as evalplus 0.3.1 grades it:
    Counter / defaultdict answers to a Counter reference, "output not none" tasks, the
    tolerance carried across inputs, base and plus in separate runs, __main__ blocks that
    never run, guarded builtins (open, exit), swallowed input()."""
    from benchmarks.grader_parity import expected_verdicts, load_corpus, ours_evalplus
    corpus, expected = load_corpus(), expected_verdicts()["evalplus"]
    got = ours_evalplus(corpus)
    wrong = [(f"{t} {i}", v, expected[f"{t} {i}"]) for (t, i, _), v in zip(corpus["evalplus"], got)
             if v != expected[f"{t} {i}"]]
    assert len(got) == len(expected) >= 60 and not wrong, wrong
    assert expected["Mbpp/88 defaultdict"] == [True, True] and expected["HumanEval/901 module_call_counter"] == [True, True]
    assert expected["HumanEval/900 int_off_by_one_after_float"] == [True, False]


def test_uncomparable_reference_is_a_grader_error(tmp_path):
    row = {"task_id": "HumanEval/7", "prompt": "def f(x):\n", "entry_point": "f", "atol": 0, "contract": "",
           "canonical_solution": "    class Opaque:\n        pass\n    return Opaque()\n",
           "base_input": [[1]], "plus_input": []}
    source = EvalPlusTaskSource(_write(tmp_path / "HumanEvalPlus.jsonl", [row], gz=False))
    reward, feedback, status, verdicts = grade(source.all_tasks()[0].payload, "def f(x):\n    return 1\n",
                                               source.sandbox)
    assert reward == 0.0 and status == "grader_error" and verdicts["grader_error"] == 1
    assert "HumanEval/7" in feedback and "cannot be compared" in feedback

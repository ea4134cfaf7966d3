"""The pieces of out-of-sandbox grading: wire format, strict equality, HumanEval rounds."""

import math

import pytest

from lopd_jax.envs.code.checker import strict_equal
from lopd_jax.envs.code.grading import call_match, evaluate_code, stdout_match
from lopd_jax.envs.code.sandbox import SandboxConfig
from lopd_jax.envs.workers.wire import wire_decode, wire_encode

CONFIG = SandboxConfig(timeout_s=5.0)


def test_wire_round_trip_keeps_types():
    value = [None, True, 0, -7, 2 ** 80, 1.5, math.inf, "é", b"\x00\xff", 1 + 2j,
             (1, (2,)), {"a": [1], 3: (4,)}, {1, 2}, frozenset({"x"}), []]
    back = wire_decode(wire_encode(value))
    assert back == value
    assert [type(x) for x in back] == [type(x) for x in value]
    nan = wire_decode(wire_encode(float("nan")))
    assert isinstance(nan, float) and math.isnan(nan)


def _nested(depth: int) -> list:
    value: list | int = 0
    for _ in range(depth):
        value = [value]
    return value


def test_wire_refuses_subclasses_objects_huge_ints_and_deep_nesting():
    for bad in [type("I", (int,), {})(1), type("S", (str,), {})("x"), object(),
                iter([1, 2]), 10 ** 5000, _nested(500)]:
        with pytest.raises((TypeError, ValueError)):
            wire_encode(bad)


@pytest.mark.parametrize("bad", [{"t": 1}, {"zz": []}, {"a": [], "b": []}, {"d": [[1]]}])
def test_wire_decode_rejects_malformed(bad):
    with pytest.raises(ValueError):
        wire_decode(bad)


def test_strict_and_taco_equality():
    assert strict_equal(1, 1.0) and not strict_equal(True, 1) and not strict_equal([True], [1])
    assert not strict_equal((1,), [1]) and strict_equal({"a": (1,)}, {"a": (1,)})
    assert call_match((1, 2), [1, 2]) and call_match(6, [6]) and not call_match(True, 1)
    assert call_match(0.1 + 0.2, 0.3) and not call_match(0.31, 0.3)
    assert stdout_match("3\n7  \n", "3\n7\n") and stdout_match("1.0000001", "1.0")


def _payload(test: str) -> dict:
    return {"kind": "humaneval", "entry_point": "f", "prompt": 'def f(x):\n    """Doc."""\n',
            "test": test}


def test_humaneval_inputs_that_depend_on_outputs_take_another_round():
    test = "def check(candidate):\n    y = candidate(1)\n    assert candidate(y) == 4\n"
    reward, feedback, _ = evaluate_code(_payload(test), "def f(x):\n    return 2 * x\n",
                                        CONFIG)
    assert reward == 1.0, feedback
    reward, feedback, _ = evaluate_code(_payload(test), "def f(x):\n    return x + 1\n",
                                        CONFIG)
    assert reward == 0.0 and "AssertionError" in feedback


def test_humaneval_call_that_raises_fails_only_when_the_test_makes_it():
    test = ("def check(candidate):\n    assert candidate(2) == 1\n"
            "    assert candidate(0) == 'zero', str(candidate(0))\n")
    code = "def f(x):\n    return 'zero' if x == 0 else 2 // x\n"
    assert evaluate_code(_payload(test), code, CONFIG)[0] == 1.0
    reward, feedback, _ = evaluate_code(_payload(test), "def f(x):\n    return 2 // x\n",
                                        CONFIG)
    assert reward == 0.0 and "ZeroDivisionError" in feedback

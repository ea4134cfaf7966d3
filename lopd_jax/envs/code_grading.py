"""Grading programs for the code environments: HumanEval check programs, the TACO harness.

:func:`evaluate_code` builds the program for a task payload and the model's code, runs it
in :mod:`lopd_jax.envs.sandbox`, and returns (reward, feedback, sandbox result). A pass
needs exit status 0 *and* a per-run random marker printed after the last test, so a
program that exits early with status 0 (``sys.exit(0)`` / ``os._exit(0)``) fails.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from lopd_jax.envs.sandbox import SandboxConfig, SandboxResult, run_python




def _pass_marker() -> str:
    return "LOPD_ALL_TESTS_PASSED_" + secrets.token_hex(8)


def humaneval_program(payload: dict[str, Any], code: str, marker: str) -> str:
    """The check program for one HumanEval problem and the model's code."""
    entry = payload["entry_point"]
    defines = re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(entry)}\s*\(", code, re.M)
    if defines:
        body = payload["prompt"] + "\n    pass\n\n" + code
    else:  # a completion of the prompt's function body
        body = payload["prompt"] + code
    return (f"{body}\n\n{payload['test']}\n\ncheck({entry})\n"
            f"print({marker!r})\n")


# The TACO harness runs inside the sandbox. CODE, TESTS, FN_NAME, PER_TEST_S, MARKER are
# substituted as Python literals.
_TACO_HARNESS = r'''
import json, os, signal, sys, tempfile
CODE = __CODE__
TESTS = __TESTS__
FN_NAME = __FN_NAME__
PER_TEST_S = __PER_TEST_S__
MARKER = __MARKER__

def _lines(s):
    out = [line.rstrip() for line in str(s).strip().splitlines()]
    return out

def _tokens_match(got, want):
    a, b = str(got).split(), str(want).split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if abs(fx - fy) > 1e-6 * max(1.0, abs(fy)):
            return False
    return True

def _stdout_match(got, want):
    if isinstance(want, list):
        want = "\n".join(str(w) for w in want)
    return _lines(got) == _lines(want) or _tokens_match(got, want)

def _fail(i, why):
    print(json.dumps({"failed_test": i, "why": why[:2000]}))
    sys.exit(1)

def _run_stdin_test(i, data):
    if isinstance(data, list):
        data = "\n".join(str(x) for x in data) + "\n"
    inp = tempfile.TemporaryFile()
    inp.write(str(data).encode()); inp.seek(0)
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(inp.fileno(), 0); os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)  # over time: killed, not catchable
        signal.alarm(PER_TEST_S)
        code = 0
        try:
            exec(compile(CODE, "solution.py", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback; traceback.print_exc(); code = 1
        try:
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.seek(0); err.seek(0)
    got = out.read().decode("utf-8", "replace"); errs = err.read().decode("utf-8", "replace")
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        _fail(i, "time limit exceeded" if sig == signal.SIGALRM else f"killed by signal {sig}")
    if os.WEXITSTATUS(status) != 0:
        _fail(i, "runtime error:\n" + errs[-1500:])
    return got

def _normalize(v):
    if isinstance(v, tuple):
        v = list(v)
    if isinstance(v, list):
        return [_normalize(x) for x in v]
    return v

def _call_match(got, want):
    got = _normalize(got)
    if got == want:
        return True
    if isinstance(want, list) and len(want) == 1 and got == want[0]:
        return True
    if isinstance(got, float) and isinstance(want, (int, float)) and not isinstance(want, bool):
        return abs(got - want) <= 1e-6 * max(1.0, abs(want))
    return False

def main():
    tests = TESTS
    if FN_NAME is None:
        for i, (inp, want) in enumerate(zip(tests["inputs"], tests["outputs"])):
            got = _run_stdin_test(i, inp)
            if not _stdout_match(got, want):
                _fail(i, f"wrong answer\ninput:\n{str(inp)[:500]}\nexpected:\n"
                         f"{str(want)[:500]}\ngot:\n{got[:500]}")
    else:
        import copy
        env = {"__name__": "solution"}
        signal.alarm(PER_TEST_S)
        exec(compile(CODE, "solution.py", "exec"), env)
        signal.alarm(0)
        if "Solution" in env and hasattr(env["Solution"], FN_NAME):
            fn = getattr(env["Solution"](), FN_NAME)
        elif FN_NAME in env:
            fn = env[FN_NAME]
        else:
            _fail(0, f"the code defines no function {FN_NAME!r} (nor a Solution class "
                     "with that method)")
        for i, (args, want) in enumerate(zip(tests["inputs"], tests["outputs"])):
            args = args if isinstance(args, list) else [args]
            signal.alarm(PER_TEST_S)
            got = fn(*copy.deepcopy(args))
            signal.alarm(0)
            if not _call_match(got, want):
                _fail(i, f"wrong answer for arguments {str(args)[:500]}: expected "
                         f"{str(want)[:300]}, got {str(got)[:300]}")
    print(MARKER)

def _alarm(signum, frame):
    raise TimeoutError("time limit exceeded")

signal.signal(signal.SIGALRM, _alarm)
main()
'''


def taco_program(payload: dict[str, Any], code: str, marker: str, per_test_s: int) -> str:
    """The harness program for one TACO problem and the model's code."""
    tests = payload["tests"]
    subs = {"__CODE__": repr(code), "__TESTS__": repr(json.loads(json.dumps(
        {"inputs": tests["inputs"], "outputs": tests["outputs"]}))),
        "__FN_NAME__": repr(tests.get("fn_name")), "__PER_TEST_S__": repr(int(per_test_s)),
        "__MARKER__": repr(marker)}
    program = _TACO_HARNESS
    for key, value in subs.items():
        program = program.replace(key, value, 1)
    return program


def evaluate_code(payload: dict[str, Any], code: str,
                  config: SandboxConfig | None = None, per_test_s: int = 4
                  ) -> tuple[float, str, SandboxResult]:
    """Run ``code`` against the task ``payload``'s tests in the sandbox.

    Returns (reward 1.0 or 0.0, feedback text for the model, the sandbox result).
    """
    marker = _pass_marker()
    kind = payload.get("kind")
    if kind == "humaneval":
        program = humaneval_program(payload, code, marker)
    elif kind == "taco":
        program = taco_program(payload, code, marker, per_test_s)
    else:
        raise ValueError(f"unknown code task kind {kind!r}; expected 'humaneval' or 'taco'")
    result = run_python(program, config=config or SandboxConfig())
    passed = result.status == "ok" and marker in result.stdout
    if passed:
        return 1.0, "All tests passed.", result
    if result.status == "ok":
        why = "the program exited before all tests ran"
    elif result.status == "timeout":
        why = "time limit exceeded"
    elif result.status == "memory":
        why = "memory limit exceeded"
    elif result.status == "output_limit":
        why = "the program printed too much output"
    else:
        why = _failure_text(result)
    return 0.0, f"Tests failed: {why}", result


def _failure_text(result: SandboxResult) -> str:
    for line in reversed(result.stdout.splitlines()):
        if line.startswith('{"failed_test"'):
            try:
                info = json.loads(line)
                return f"test {info['failed_test']}: {info['why']}"
            except ValueError:
                break
    tail = result.stderr.strip().splitlines()[-12:]
    return "\n".join(tail)[-1500:] or f"exit code {result.returncode}"

"""Programs that run *inside* the code sandbox: they hold inputs only, never expected outputs.

A sandboxed program (:func:`call_program`, :func:`stdin_program`, and the upstream-faithful
ones of :mod:`.lcb_harness` and :mod:`.evalplus_harness`, all built on
:func:`common_prelude`) runs the model's code on the test inputs and prints one
``RESULTS_PREFIX`` + JSON line, values in the plain-data wire format of
:mod:`lopd_jax.envs.workers.wire`. It knows no pass marker and no expected output: the
verdict is computed outside the sandbox. Whatever the code does to the harness it can at
most report *some* outputs; the trusted side decodes plain built-in data only, so no
custom ``__eq__`` survives.

Result entries, one per input in order: ``{"ok": <wire value>}`` (a return value, or a
captured standard output string, ``"truncated": true`` when over the cap) or ``{"exc":
"text"}``; a run stops at a time-out and, unless told otherwise, at the first exception.
Set-up failures (the code does not compile, defines no entry point) are ``{"error": "text"}``.
"""

from __future__ import annotations

import json
from typing import Any

from lopd_jax.envs.workers import wire

RESULTS_PREFIX = "LOPD_RESULTS "

with open(wire.__file__, encoding="utf-8") as _f:
    _WIRE_SOURCE = _f.read()

_COMMON = r'''
import json as _json, os as _os, signal as _signal, sys as _sys
_OUT = _os.dup(1)
_PREFIX = __PREFIX__
_PER_CALL_S = __PER_CALL_S__

def _emit(obj):
    try:
        _sys.stdout.flush(); _sys.stderr.flush()
    except BaseException:
        pass
    data = ("\n" + _PREFIX + _json.dumps(obj) + "\n").encode()
    while data:
        data = data[_os.write(_OUT, data):]
    _os._exit(0)

def _describe(e):
    if isinstance(e, SystemExit):
        return "the program exited (SystemExit %r) instead of returning" % (e.code,)
    try:
        return ("%s: %s" % (type(e).__name__, e))[:1500]
    except BaseException:
        return type(e).__name__

_LIMIT_TEXT = ["%d s per test" % _PER_CALL_S]

def _on_alarm(signum, frame):
    raise TimeoutError("time limit exceeded (%s)" % _LIMIT_TEXT[0])

def reliability_guard(code, builtin_names):
    # what upstream's reliability_guard disables (LiveCodeBench and EvalPlus alike, bar the
    # builtins named); numpy is loaded first, as it is in upstream's grading process
    import builtins, shutil, subprocess
    if any(name in code for name in ("numpy", "scipy", "pandas")):
        try:
            import numpy
        except ImportError:
            pass
    for name in builtin_names:
        setattr(builtins, name, None)
    for name in ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid",
                 "fork", "forkpty", "killpg", "rename", "renames", "truncate", "replace", "unlink",
                 "fchmod", "fchown", "chmod", "chown", "chroot", "lchflags", "lchmod", "lchown",
                 "getcwd", "chdir"):
        setattr(_os, name, None)
    shutil.rmtree = shutil.move = shutil.chown = None
    subprocess.Popen = None
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
        _sys.modules[name] = None

def plain_value(v, _depth=0):
    # dict / list / tuple subclasses (Counter, defaultdict, namedtuple) as their base type,
    # numpy scalars as Python scalars; anything else unchanged (the wire then refuses it)
    if _depth > 100:
        return v
    d = _depth + 1
    if isinstance(v, dict):
        return {k: plain_value(x, d) for k, x in v.items()}
    if isinstance(v, list):
        return [plain_value(x, d) for x in v]
    if isinstance(v, tuple):
        return tuple(plain_value(x, d) for x in v)
    if type(v).__module__ == "numpy" and getattr(v, "ndim", None) == 0:
        return v.item()
    return v
'''

_CALLS = r'''
_SOURCE = __SOURCE__
_ENTRY = __ENTRY__
_CLASS = __CLASS__
_CALL_LIST = _json.loads(__CALLS__)
_STOP_ON_EXC = __STOP__
_LIMITS = _json.loads(__LIMITS__)
_TIMED = __TIMED__
import time as _time
_signal.signal(_signal.SIGALRM, _on_alarm)
_ns = {"__name__": "__main__"}
try:
    _signal.alarm(_PER_CALL_S)
    exec(compile(_SOURCE, "solution.py", "exec"), _ns)
    _signal.alarm(0)
    if _CLASS and isinstance(_ns.get(_CLASS), type) and hasattr(_ns[_CLASS], _ENTRY):
        _fn = getattr(_ns[_CLASS](), _ENTRY)
    elif callable(_ns.get(_ENTRY)):
        _fn = _ns[_ENTRY]
    else:
        _emit({"error": "the code defines no function %r" % (_ENTRY,) + (
            " (nor a %s class with that method)" % _CLASS if _CLASS else "")})
except BaseException as e:
    _signal.alarm(0)
    _emit({"error": "the code failed before the tests ran: " + _describe(e)})
_results = []
for _i, (_args, _kwargs) in enumerate(_CALL_LIST):
    try:
        _a, _k = wire_decode(_args), wire_decode(_kwargs)
        if _LIMITS is None:
            _signal.alarm(_PER_CALL_S)
        else:
            _LIMIT_TEXT[0] = "%.3g s for this test" % _LIMITS[_i]
            _signal.setitimer(_signal.ITIMER_REAL, _LIMITS[_i])
        _t0 = _time.perf_counter()
        _value = _fn(*_a, **_k)
        _dt = _time.perf_counter() - _t0
        _signal.setitimer(_signal.ITIMER_REAL, 0)
        _results.append({"ok": wire_encode(_value)})
        if _TIMED:
            _results[-1]["t"] = _dt
    except BaseException as e:
        _signal.setitimer(_signal.ITIMER_REAL, 0)
        _results.append({"exc": _describe(e)})
        if isinstance(e, TimeoutError):
            _results[-1]["timeout"] = True
            break
        if _STOP_ON_EXC:
            break
_emit({"results": _results})
'''

_STDIN = r'''
import tempfile as _tempfile
_SOURCE = __SOURCE__
_INPUTS = _json.loads(__INPUTS__)
_CAP = __CAP__

def _run_one(data):
    inp = _tempfile.TemporaryFile(); inp.write(data.encode()); inp.seek(0)
    out = _tempfile.TemporaryFile(); err = _tempfile.TemporaryFile()
    pid = _os.fork()
    if pid == 0:
        _os.dup2(inp.fileno(), 0); _os.dup2(out.fileno(), 1); _os.dup2(err.fileno(), 2)
        _os.close(_OUT)
        _signal.signal(_signal.SIGALRM, _signal.SIG_DFL)  # over time: killed, not catchable
        _signal.alarm(_PER_CALL_S)
        code = 0
        try:
            exec(compile(_SOURCE, "solution.py", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback; traceback.print_exc(); code = 1
        try:
            _sys.stdout.flush(); _sys.stderr.flush()
        finally:
            _os._exit(code)
    _, status = _os.waitpid(pid, 0)
    out.seek(0); err.seek(0)
    got = out.read(_CAP + 1); errs = err.read(1 << 16).decode("utf-8", "replace")
    if _os.WIFSIGNALED(status):
        sig = _os.WTERMSIG(status)
        return {"exc": "time limit exceeded (%d s per test)" % _PER_CALL_S
                if sig == _signal.SIGALRM else "killed by signal %d" % sig}
    if _os.WEXITSTATUS(status) != 0:
        return {"exc": "runtime error:\n" + errs[-1500:]}
    entry = {"ok": got[:_CAP].decode("utf-8", "replace")}
    if len(got) > _CAP:
        entry["truncated"] = True
    return entry

_results = []
for _data in _INPUTS:
    _r = _run_one(_data)
    _results.append(_r)
    if "exc" in _r:
        break
_emit({"results": _results})
'''


def fill(template: str, subs: dict[str, Any]) -> str:
    """``template`` with each placeholder key replaced (once) by its value."""
    for key, value in subs.items():
        template = template.replace(key, value, 1)
    return template


def common_prelude(per_call_s: int) -> str:
    """The wire code and the shared helpers every sandbox program starts with."""
    return _WIRE_SOURCE + fill(_COMMON, {"__PREFIX__": repr(RESULTS_PREFIX),
                                          "__PER_CALL_S__": repr(int(per_call_s))})


def call_program(source: str, entry: str, calls: list, per_call_s: int,
                 method_class: str | None = None, stop_on_exception: bool = True,
                 time_limits: list[float] | None = None, timed: bool = False) -> str:
    """A program that runs ``source`` and calls ``entry`` once per ``calls`` item.

    ``calls`` holds ``[wire args list, wire kwargs dict]`` pairs; with ``method_class``
    (TACO's ``Solution``) the entry is that class's method when the code defines it. The
    run stops at the first exception (``stop_on_exception``) or time-out (always; the
    entry then has ``"timeout": true``). Each call may take ``per_call_s`` seconds, or
    ``time_limits[i]`` (float seconds, one per call: EvalPlus's per-input limits) when
    given; ``timed`` adds each successful call's run time, ``"t"`` in seconds (the
    reference timings of trusted code; a candidate's own report is never trusted).
    """
    if time_limits is not None and len(time_limits) != len(calls):
        raise ValueError(f"time_limits has {len(time_limits)} entries for {len(calls)} calls")
    limits = None if time_limits is None else [float(x) for x in time_limits]
    return common_prelude(per_call_s) + fill(_CALLS, {
        "__SOURCE__": repr(source), "__ENTRY__": repr(entry),
        "__CLASS__": repr(method_class), "__CALLS__": repr(json.dumps(calls)),
        "__STOP__": repr(bool(stop_on_exception)), "__LIMITS__": repr(json.dumps(limits)),
        "__TIMED__": repr(bool(timed))})


def stdin_program(source: str, inputs: list[str], per_call_s: int, cap_bytes: int) -> str:
    """A program that runs ``source`` once per input (fresh forked process, real fds 0/1/2)
    and reports each run's standard output (at most ``cap_bytes``)."""
    return common_prelude(per_call_s) + fill(_STDIN, {
        "__SOURCE__": repr(source), "__INPUTS__": repr(json.dumps(inputs)),
        "__CAP__": repr(int(cap_bytes))})


def parse_results(stdout: str) -> dict[str, Any] | None:
    """The last results line of a harness run, or None when there is none / it is invalid.

    Never raises: the line is untrusted (the model's code could have printed it).
    """
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULTS_PREFIX):
            try:
                obj = json.loads(line[len(RESULTS_PREFIX):])
            except (ValueError, RecursionError):
                return None
            return obj if isinstance(obj, dict) else None
    return None


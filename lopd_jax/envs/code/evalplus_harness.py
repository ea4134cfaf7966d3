"""The sandboxed program that runs EvalPlus code the way upstream's evaluator runs it.

Upstream (``evalplus/eval/__init__.py`` ``unsafe_execute`` and ``evalplus/gen/util.py``
``trusted_exec``, see :mod:`.evalplus` for the pin) runs the base inputs and the plus
inputs in two separate processes. A candidate is ``exec``'d into an empty namespace
(``__name__`` is then ``'builtins'``: a ``__main__`` block never runs) after
``reliability_guard`` has set ``open``, ``exit``, ``quit``, ``help`` and many ``os`` /
``shutil`` / ``subprocess`` functions to None, with standard output and error swallowed and
standard input raising ``IOError``; each call has its own time limit. The reference
solution runs unguarded on deep copies of the inputs; on the "output not none" tasks its
outputs become ``output is not None``. :func:`evalplus_program` reports outputs only (a
candidate's non-bool output on those tasks as ``output is not None``, which gives the same
verdict) plus each output's type name (upstream's tolerance check compares types).
"""

from __future__ import annotations

import json

from lopd_jax.envs.code.harness import common_prelude, fill

_PROGRAM = r'''
import builtins as _builtins, contextlib as _contextlib, copy as _copy, io as _io, time as _time
_CODE = __CODE__
_ENTRY = __ENTRY__
_INPUTS = _json.loads(__INPUTS__)
_LIMITS = _json.loads(__LIMITS__)
_REFERENCE = __REFERENCE__
_NOT_NONE = __NOT_NONE__


class TimeoutException(Exception):
    pass


_CURRENT = [0.0]


def _timeout(signum, frame):
    raise TimeoutException("time limit exceeded (%.3g s for this test)" % _CURRENT[0])


class _WriteOnly(_io.StringIO):
    def read(self, *args, **kwargs):
        raise IOError
    def readline(self, *args, **kwargs):
        raise IOError
    def readlines(self, *args, **kwargs):
        raise IOError
    def readable(self, *args, **kwargs):
        return False


@_contextlib.contextmanager
def _swallow():
    stream = _WriteOnly()
    saved = (_sys.stdout, _sys.stderr, _sys.stdin)
    _sys.stdout = _sys.stderr = _sys.stdin = stream
    try:
        yield
    finally:
        _sys.stdout, _sys.stderr, _sys.stdin = saved


def _report(value):
    kind = type(value)
    entry = {"ty": kind.__module__ + "." + kind.__qualname__}
    entry["ok"] = wire_encode(plain_value(value))
    return entry


def _reference():
    namespace = {}
    exec(_CODE, namespace)
    fn = namespace[_ENTRY]
    results = []
    for args in _INPUTS:
        args = _copy.deepcopy(wire_decode(args))
        t0 = _time.time()
        value = fn(*args)
        dt = _time.time() - t0
        results.append(dict(_report(value is not None if _NOT_NONE else value), t=dt))
    return results


def _candidate():
    reliability_guard(_CODE, ("exit", "quit", "open", "help"))
    namespace = {}
    try:
        with _swallow():
            exec(_CODE, namespace)
            fn = namespace[_ENTRY]
    except BaseException as e:
        _emit({"error": "the code failed before the tests ran: " + _describe(e)})
    _signal.signal(_signal.SIGALRM, _timeout)
    results = []
    for i, args in enumerate(_INPUTS):
        try:
            args = wire_decode(args)
            _CURRENT[0] = _LIMITS[i]
            _signal.setitimer(_signal.ITIMER_REAL, _LIMITS[i])
            try:
                with _swallow():
                    value = fn(*args)
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
            if _NOT_NONE and not isinstance(value, bool):
                value = value is not None
            results.append(_report(value))
        except BaseException as e:
            results.append({"exc": _describe(e)})
            break
    return results


try:
    _results = _reference() if _REFERENCE else _candidate()
except BaseException as e:
    _emit({"error": _describe(e)})
_emit({"results": _results})
'''


def evalplus_program(code: str, entry_point: str, inputs: list, *, reference: bool,
                     not_none: bool, time_limits: list[float] | None = None) -> str:
    """The sandbox program for one part (base or plus) of one problem.

    ``inputs``: wire-encoded argument lists. ``reference``: run trusted code unguarded and
    time each call (``"t"``, seconds); else run a candidate with ``time_limits`` (seconds,
    one per input). ``not_none``: an "output not none" task. Each entry has ``"ok"`` (the
    output) and ``"ty"`` (its type's name), or ``"exc"``; the run stops at an exception.
    """
    if not reference and (time_limits is None or len(time_limits) != len(inputs)):
        raise ValueError("a candidate run needs one time limit per input")
    per_call_s = 60 if reference else int(max(time_limits or [1.0])) + 1
    return common_prelude(per_call_s) + fill(_PROGRAM, {
        "__CODE__": repr(code), "__ENTRY__": repr(entry_point),
        "__INPUTS__": repr(json.dumps(inputs)),
        "__LIMITS__": repr(json.dumps([float(x) for x in time_limits or []])),
        "__REFERENCE__": repr(bool(reference)), "__NOT_NONE__": repr(bool(not_none))})

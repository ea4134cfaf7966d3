"""The sandboxed program that runs a LiveCodeBench answer the way upstream's grader runs it.

Upstream (``lcb_runner/evaluation/testing_util.py``, see :mod:`.livecodebench` for the pin)
runs every test of one answer in one process, in-process: standard-input programs have a
trailing ``if __name__ == '__main__':`` block inlined, their imports hoisted after
``IMPORT_STRING`` and every other statement moved into one function called once per test,
with ``sys.stdin`` replaced by a stand-in, ``sys.stdout`` by a string buffer and
``SystemExit`` ignored; functional programs run as module ``tmp_sol`` (``Solution()`` when
the text holds ``class Solution``). Python's integer-to-text limit is 50,000 digits there.
:func:`lcb_program` reproduces those semantics in our sandbox (the real file descriptor 0
is empty, as upstream's worker's is) and reports outputs only (see
:mod:`.harness`); comparing them happens outside.
"""

from __future__ import annotations

import json

from lopd_jax.envs.code.harness import common_prelude, fill

INT_MAX_STR_DIGITS = 50_000

_PROGRAM = r'''
import ast as _ast, builtins as _builtins, io as _io, types as _types
from unittest import mock as _mock
_CODE = __CODE__
_IMPORTS = __IMPORTS__
_FN = __FN__
_INPUTS = _json.loads(__INPUTS__)
_CAP = __CAP__
if hasattr(_sys, "set_int_max_str_digits"):
    _sys.set_int_max_str_digits(__DIGITS__)
reliability_guard(_CODE, ("quit", "help"))

class TimeoutException(Exception):
    pass

def _timeout(signum, frame):
    raise TimeoutException("time limit exceeded (%d s per test)" % _PER_CALL_S)

_signal.signal(_signal.SIGALRM, _timeout)


class _StdinBytes:
    # upstream's stand-in: read() gives every byte, readline() the first line every time
    def __init__(self, text):
        self._data = text.encode("utf-8")
    def read(self, *args):
        return self._data
    def readline(self, *args):
        return self._data.split(b"\n")[0] + b"\n"


class _Stdin:
    # read() and readlines() see the whole text (readlines without line ends); readline()
    # and anything else go to a StringIO; no __iter__, so `for line in sys.stdin` fails
    def __init__(self, text):
        self._text = text
        self._stream = _io.StringIO(text)
        self.buffer = _StdinBytes(text)
    def read(self, *args):
        return self._text
    def readline(self, *args):
        return self._stream.readline(*args)
    def readlines(self, *args):
        return self._text.split("\n")
    def __getattr__(self, name):
        return getattr(self._stream, name)


def _inline_main(code):
    try:
        tree = _ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, _ast.If) and _ast.unparse(last.test).strip() == "__name__ == '__main__'":
            code = _ast.unparse(tree.body[:-1]) + "\n" + _ast.unparse(last.body)
    except BaseException:
        pass
    return code


def _as_function(code):
    try:
        tree = _ast.parse(code)
        imports = [s for s in tree.body if isinstance(s, (_ast.Import, _ast.ImportFrom))]
        others = [s for s in tree.body if not isinstance(s, (_ast.Import, _ast.ImportFrom))]
        fn = _ast.FunctionDef(name="wrapped_function", args=_ast.arguments(
            posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[]),
            body=others, decorator_list=[], lineno=-1)
        return _IMPORTS + "\n" + _ast.unparse(imports) + "\n" + _ast.unparse(fn)
    except Exception:
        return code


def _load(source, name):
    module = _types.ModuleType("tmp_sol", "")
    _signal.alarm(_PER_CALL_S)
    try:
        exec(source, module.__dict__)
        holder = module.Solution() if "class Solution" in source else module
    except BaseException as e:
        _signal.alarm(0)
        _emit({"error": "the code failed before the tests ran: " + _describe(e)})
    _signal.alarm(0)
    fn = getattr(holder, name, None)
    if fn is None:
        _emit({"error": "the code defines no %r" % (name,)})
    return fn


def _run_stdin():
    fn = _load(_as_function(_inline_main(_CODE)), "wrapped_function")
    results = []
    for text in _INPUTS:
        out = _io.StringIO()
        out.close = lambda x: 1
        saved = (_sys.stdout, _sys.stdin, _builtins.open)
        # upstream also patches read / readline / readlines on the stdin object in place
        # before swapping it out, so code holding it (`from sys import stdin`) reads the test
        lines = iter(text.split("\n"))
        patched = {"read": lambda *a, _t=text: _t, "readline": lambda *a, _l=lines: next(_l),
                   "readlines": lambda *a, _t=text: _t.split("\n")}
        for name, value in patched.items():
            setattr(saved[1], name, value)
        _sys.stdout, _sys.stdin = out, _Stdin(text)
        _builtins.open = _mock.mock_open(read_data=text)
        failure = None
        _signal.alarm(_PER_CALL_S)
        try:
            fn()
        except SystemExit:
            pass
        except BaseException as e:
            failure = e
        finally:
            _signal.alarm(0)
            _sys.stdout, _sys.stdin, _builtins.open = saved
            for name in patched:
                saved[1].__dict__.pop(name, None)
        if failure is not None:
            results.append({"exc": _describe(failure)})
            break
        got = out.getvalue()
        results.append({"ok": got[:_CAP]} if len(got) <= _CAP else {"ok": got[:_CAP], "truncated": True})
    _emit({"results": results})


def _run_calls():
    fn = _load(_IMPORTS + "\n\n" + _CODE, _FN)
    results = []
    for args in _INPUTS:
        _signal.alarm(_PER_CALL_S)
        try:
            value = fn(*wire_decode(args))
            _signal.alarm(0)
            if isinstance(value, tuple):
                value = list(value)
            results.append({"ok": wire_encode(plain_value(value))})
        except BaseException as e:
            _signal.alarm(0)
            results.append({"exc": _describe(e)})
            break
    _emit({"results": results})


_run_stdin() if _FN is None else _run_calls()
'''


def lcb_program(code: str, imports: str, fn_name: str | None, inputs: list, per_test_s: int,
                cap_chars: int) -> str:
    """The sandbox program for one answer: ``inputs`` are the tests' standard-input texts
    (``fn_name`` None) or wire-encoded argument lists; each test's captured output (at
    most ``cap_chars``) or return value comes back, stopping at the first exception."""
    return common_prelude(per_test_s) + fill(_PROGRAM, {
        "__CODE__": repr(code), "__IMPORTS__": repr(imports), "__FN__": repr(fn_name),
        "__INPUTS__": repr(json.dumps(inputs)), "__CAP__": repr(int(cap_chars)),
        "__DIGITS__": repr(INT_MAX_STR_DIGITS)})

"""ACEBench answer grading: upstream's ``decode_ast`` and ``model_eval/checker.py``
re-implemented (our code; see :mod:`lopd_jax.envs.acebench.env` for the rules and
``docs/evaluation.md`` for the upstream files matched).

:func:`decode_calls` parses ``[f(a=1), g(b='x')]`` with :mod:`ast` (never ``eval``);
:func:`check_normal` / :func:`check_call` compare decoded calls with one possible answer;
:func:`grade` grades one assistant turn of a task (normal or special) and never raises
for anything the model wrote.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any, Sequence

from lopd_jax.core.types import AssistantTurn, Task

MAX_ANSWER_CHARS = 200_000  # longer answers are graded as failed, unparsed
MAX_NUMBER = 1e15  # bound of arithmetic in answers (upstream evaluates BinOps)


class _NoValue:
    """The type upstream maps "enum" to (``enumerate``): no decoded value has it."""


# Upstream's doc type -> Python type (``PYTHON_TYPE_MAPPING``); "enum" matches no value.
_TYPES: dict[str, Any] = {
    "string": str, "integer": int, "float": float, "boolean": bool, "array": list,
    "tuple": list, "dict": dict, "any": str, "list": list, "object": dict,
    "objectArray": list, "list(string)": list, "list(enum)": list, "int": int,
    "enum": _NoValue, "number": int}
_NESTED = ("array", "tuple", "list(string)", "list(enum)", "object", "objectArray")
_STRIP = re.compile(r"[ ,./\-_*^]")


def normalize(text: str) -> str:
    """Upstream's ``standardize_string``: drop `` ,./-_*^``, lower-case, ``'`` -> ``"``."""
    return _STRIP.sub("", text).lower().replace("'", '"')


class AnswerFormatError(ValueError):
    """The answer is not a list of function calls with literal keyword arguments."""


# ---------------------------------------------------------------------------------------
# Parsing the model's answer.

def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _number(x: Any) -> Any:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not abs(x) <= MAX_NUMBER:
        raise AnswerFormatError("arithmetic needs small numbers")
    return x


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def _value(node: ast.AST) -> Any:
    """A literal argument value, resolved as upstream's ``resolve_ast_by_type`` does, except
    that arithmetic is limited to + - * / on numbers (no ``eval``) and lambdas are refused."""
    if isinstance(node, ast.Constant):
        return "..." if node.value is Ellipsis else node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        x = _number(_value(node.operand))
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.List):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_value(v) for v in node.elts)
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise AnswerFormatError("'**' inside a dict literal")
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _value(k)
            try:
                out[key] = _value(v)
            except TypeError:
                raise AnswerFormatError("unhashable dict key") from None
        return out
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _number(_value(node.left)), _number(_value(node.right))
        try:
            return _number(_BINOPS[type(node.op)](a, b))
        except ZeroDivisionError:
            raise AnswerFormatError("division by zero") from None
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _call(node)
    if isinstance(node, ast.Subscript):
        return ast.unparse(node)
    raise AnswerFormatError(f"unsupported value {type(node).__name__}")


def _call(node: ast.Call) -> dict[str, dict[str, Any]]:
    return {_dotted(node.func): {kw.arg: _value(kw.value) for kw in node.keywords}}


def decode_calls(text: str) -> list[dict[str, dict[str, Any]]]:
    """``[f(a=1), g.h(b='x')]`` -> ``[{"f": {"a": 1}}, {"g.h": {"b": "x"}}]``.

    Upstream's ``ast_parse``: the text is one bracketed list (or tuple) of calls; only
    keyword arguments are kept. AnswerFormatError for anything else, including text over
    :data:`MAX_ANSWER_CHARS` and nesting too deep to parse.
    """
    if len(text) > MAX_ANSWER_CHARS:
        raise AnswerFormatError(f"answer longer than {MAX_ANSWER_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval").body
        if not isinstance(tree, (ast.List, ast.Tuple, ast.Set)):
            raise AnswerFormatError("the answer must be a bracketed list of calls")
        out = []
        for elem in tree.elts:
            if not isinstance(elem, ast.Call):
                raise AnswerFormatError(f"list element {type(elem).__name__} is not a call")
            out.append(_call(elem))
        return out
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as e:
        if isinstance(e, AnswerFormatError):
            raise
        raise AnswerFormatError(f"not Python ({type(e).__name__})") from None


# ---------------------------------------------------------------------------------------
# Checking calls against the possible answers.

def _fail(error_type: str, error: str) -> dict[str, Any]:
    return {"valid": False, "error_type": error_type, "error": error}


_OK = {"valid": True, "error_type": "", "error": ""}


def _type_ok(value: Any, expected: Any, truth: Any, nested: Any) -> tuple[bool, bool]:
    """(valid, is_variable) as upstream's ``type_checker``: a value of the doc's type is
    valid; for nested types the items are type-checked only against list-valued answers;
    a value of the answer's own type (or equal to it) is valid but is not value-checked."""
    truth_type = None if truth == "" else type(truth)
    is_variable = truth_type is not None and truth_type is not expected
    if value == "true":
        value = True
    elif value == "false":
        value = False
    if type(value) is expected:
        if nested is None:
            return True, is_variable
        for item in truth if isinstance(truth, (list, dict, str)) else ():
            if not isinstance(item, list) or all(
                    _type_ok(v, nested, item, None)[0] for v in value):
                return True, is_variable
        nested_failed = True
    else:
        nested_failed = False
    if truth_type is not None and (type(value) is truth_type or truth == value):
        return not nested_failed, True
    return False, False


def _dict_ok(value: Any, truth: dict) -> bool:
    if not isinstance(value, dict) or len(value) != len(truth):
        return False
    for key, given in value.items():
        given = True if given == "true" else False if given == "false" else given
        if key not in truth:
            return False
        expected = truth[key]
        if isinstance(expected, dict):
            if not _dict_ok(given, expected):
                return False
            continue
        g = normalize(given) if isinstance(given, str) else given
        e = normalize(expected) if isinstance(expected, str) else expected
        if str(e) not in str(g):
            return False
    return True


def _norm_items(xs: Sequence) -> list:
    return [normalize(x) if isinstance(x, str) else x for x in xs]


def check_call(doc: dict, name: str, params: dict, truth: dict,
               strict_scalars: bool = False) -> dict[str, Any]:
    """One call ``name(**params)`` against one expected call (``truth``: param -> value)
    under the API doc ``doc``, as upstream's ``simple_function_checker``."""
    spec = doc.get("parameters")
    if not isinstance(spec, dict):
        return _fail("wrong_param", f"the doc of {doc.get('name')!r} has no 'parameters'")
    if params == {} or spec == {}:
        return _OK if params == spec == {} else _fail("wrong_param", "empty parameters")
    props = spec.get("properties") if isinstance(spec.get("properties"), dict) else {}
    if truth == props:
        return _OK
    if truth == {}:
        return _fail("wrong_param", "the answer expects no parameters")
    if doc["name"] != name:
        return _fail("wrong_function_name", f"expected {doc['name']}, got {name}")
    for p in spec.get("required", []):
        if p not in params:
            return _fail("lack_args", f"lack required_params: {p}")
    for p, value in params.items():
        if p not in props or p not in truth:
            return _fail("addition_args", f"addition params: {p}")
        detail = props[p] if isinstance(props[p], dict) else {}
        kind = detail.get("type")
        if kind not in _TYPES:
            return _fail("type_error", f"unknown doc type {kind!r} for {p}")
        expected, nested = _TYPES[kind], None
        if kind in _NESTED:
            items = detail.get("items")
            inner = items.get("type") if isinstance(items, dict) else None
            if inner is None:
                inner = "string" if "string" in kind else "enum" if "enum" in kind else "dict"
            if inner not in _TYPES:
                return _fail("type_error", f"unknown item type {inner!r} for {p}")
            nested = _TYPES[inner]
        if kind == "tuple" and isinstance(value, tuple):
            value = list(value)
        if kind == "float" and type(value) is int:
            value = float(value)
        valid, is_variable = _type_ok(value, expected, truth[p], nested)
        if not valid:
            return _fail("type_error", f"wrong type for parameter ({p}) of api ({name})")
        want = truth[p]
        if is_variable:
            continue
        if expected is dict:
            if not isinstance(want, dict) or not _dict_ok(value, want):
                return _fail("value_error", f"wrong value for parameter ({p}) of api ({name})")
        elif expected is list and nested is dict:
            if not isinstance(want, list) or len(value) != len(want) or not all(
                    isinstance(w, dict) and _dict_ok(v, w) for v, w in zip(value, want)):
                return _fail("value_error:list_dict", f"wrong value for parameter ({p}) of api ({name})")
        elif expected is str:
            if not isinstance(want, str) or normalize(want) not in normalize(value):
                return _fail("value_error:string", f"wrong value for parameter ({p}) of api ({name})")
        elif expected is list:
            if not isinstance(want, list) or _norm_items(value) != _norm_items(want):
                return _fail("value_error:list/tuple", f"wrong value for parameter ({p}) of api ({name})")
        elif strict_scalars and not (value == want and type(value) is type(want)
                                     or isinstance(value, float) and isinstance(want, (int, float))
                                     and math.isclose(value, want)):
            return _fail("value_error:scalar", f"wrong value for parameter ({p}) of api ({name})")
    return _OK


def _find_doc(functions: list, key: str) -> dict | None:
    """Upstream's ``find_description``: the first doc whose name is a substring of ``key``."""
    return next((f for f in functions if f["name"] in key), None)


def check_normal(functions: list, calls: list, truth: dict, strict_scalars: bool = False) -> dict:
    """Decoded ``calls`` against one possible answer (``{api(_n): {param: value}}``), as
    upstream's ``normal_checker``."""
    if len(calls) != len(truth):
        return _fail("wrong functions number", "the number of functions does not match the answer")
    expected = [(key, re.sub(r"_\d+$", "", key), params) for key, params in truth.items()]
    given = [next(iter(c)) for c in calls]
    want_names = [name for _, name, _ in expected]
    if sorted(given) != sorted(want_names):
        return _fail("function_mismatch", f"called {sorted(given)}, expected {sorted(want_names)}")
    for key, name, params in expected:
        doc = _find_doc(functions, key)
        if doc is None:
            return _fail("wrong_function", f"no doc for {key!r} among the candidate functions")
        results = [check_call(doc, name, c[name], params, strict_scalars)
                   for c in calls if next(iter(c)) == name]
        passing = next((r for r in results if r["valid"]), None)
        if passing is None:
            return results[-1] if results else _fail("wrong_function", f"{name} not called")
    return _OK


def _calls_from_turn(turn: AssistantTurn) -> tuple[str, list | None]:
    text = turn.content or ""
    if not text.strip() and turn.tool_calls:
        calls = [{c.name: dict(c.arguments)} for c in turn.tool_calls if isinstance(c.arguments, dict)]
        return json.dumps(calls, default=str)[:2000], calls
    return text, None


def grade(task: Task, turn: AssistantTurn, strict_scalars: bool = False) -> dict[str, Any]:
    """The verdict on one answer: ``{"valid", "error_type", "error"}``; never raises for
    anything the model wrote."""
    category, truth = task.payload["category"], task.payload["ground_truth"]
    text, native = _calls_from_turn(turn)
    if category.startswith("special"):
        return grade_special(category, truth, text)
    if native is None:
        try:
            calls = decode_calls("".join(text.split()))
        except AnswerFormatError as e:
            return _fail("wrong_output_format", f"Invalid syntax. Failed to decode AST. {e}")
    else:
        calls = native
    first = None
    for option in truth if isinstance(truth, list) else [truth]:
        try:
            result = check_normal(task.payload["functions"], calls, option, strict_scalars)
        except (TypeError, ValueError, RecursionError) as e:  # odd shapes from the answer
            result = _fail("wrong_output_format", f"{type(e).__name__}")
        if result["valid"]:
            return result
        first = first or result
    return first


def grade_special(category: str, truth: Any, text: str) -> dict[str, Any]:
    """A special-category answer (raw text) as upstream's ``special_eval``."""
    if category == "special_irrelevant":
        return (_OK if "the limitations of the function" in text
                else _fail("error_detection", "did not point out the limitations of the function"))
    phrase = ("Missing necessary parameters" if category == "special_incomplete"
              else "There is incorrect value")
    for name, values in truth.items():
        if phrase not in text:
            return _fail("error_detection", f"missing {phrase!r}")
        if category == "special_incomplete" and name not in text:
            return _fail("error_correction", f"did not name the api {name}")
        for v in values:
            if v not in text:
                return _fail("error_correction", f"did not name {v!r}")
    return _OK

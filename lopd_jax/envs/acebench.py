"""ACEBench (English): the normal and special categories, read from upstream's data files
and graded as upstream's checker grades them.

Data (github.com/ACEBench/ACEBench, ``data_all/data_en/``): ``data_<category>.json`` holds
one JSON object per line with ``id``, ``question`` (the dialogue so far, ``user: ...`` /
``system: ...`` lines), ``function`` (the candidate API docs) and ``time`` (``profile`` for
``normal_preference``); ``possible_answer/data_<category>.json`` holds ``id`` and
``ground_truth`` per line: for the normal categories a dict ``{api_name: {param: value}}``
(a repeated API is keyed ``name_1``, ``name_2``) or a list of such alternatives; for
``special_incomplete`` ``{api_name: [missing params]}``; for ``special_error_param``
``{param: [wrong values]}``; for ``special_irrelevant`` a string.

Episode: one assistant turn. The system prompt and the user prompt are upstream's
(:mod:`lopd_jax.envs.acebench_prompts`); no tools are offered: the answer is text such as
``[ApiName(key1='v', key2=2)]``. The visible answer (``turn.content``: thinking removed) is
graded; when it is empty and the turn carries native tool calls, those are graded as
upstream grades a function-calling model's calls (``decode_ast`` for "FC" models).
Reward 1.0 when the answer is correct, else 0.0; the verdict (``error_type``, ``error``)
is in ``StepResult.info["verdict"]``.

Grading (our implementation of upstream's ``eval_main.py`` / ``model_eval/checker.py``):

* normal: all whitespace is removed from the answer, which is parsed with :mod:`ast` as a
  list of calls with keyword arguments (:func:`decode_calls`; never ``eval``); the number of
  calls and the multiset of API names must equal the answer's; each expected call must be
  matched by a same-named call that passes :func:`check_call`: required params present, no
  param outside the doc or the answer, the doc's type, and the value - strings compared
  after upstream's normalisation (lower case, `` ,./-_*^`` removed) with the expected one a
  substring of the given one, lists element-wise, dicts key by key (nested values compared
  as ``str(expected) in str(given)``), lists of dicts item by item. As upstream, top-level
  numbers and booleans are type-checked only (``strict_scalars=True`` also compares them);
* special: the raw answer must contain ``Missing necessary parameters`` plus the API name
  and every missing param (incomplete), ``There is incorrect value`` plus every wrong value
  (error_param), or ``the limitations of the function`` (irrelevant);
* ``normal_multi_turn_*``: each row is one task; :func:`aggregate` scores a conversation
  (``..._<conv>_<item>``) 1 only when all its rows pass, as upstream's
  ``multiplt_turn_accuracy``.

The agent categories (``data_agent_multi_step.json``, ``data_agent_multi_turn.json``) need
upstream's scenario classes and a simulated user; they are not implemented here.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
from typing import Any, Sequence

from lopd_jax.envs import acebench_prompts as prompts
from lopd_jax.envs.base import Environment, TaskSource, check_split
from lopd_jax.types import AssistantTurn, Message, StepResult, Task, ToolSchema

ENV_ID = "acebench"
NORMAL_CATEGORIES = (
    "normal_single_turn_single_function", "normal_single_turn_parallel_function",
    "normal_multi_turn_user_adjust", "normal_multi_turn_user_switch", "normal_similar_api",
    "normal_preference", "normal_atom_bool", "normal_atom_enum", "normal_atom_number",
    "normal_atom_list", "normal_atom_object_deep", "normal_atom_object_short")
SPECIAL_CATEGORIES = ("special_incomplete", "special_error_param", "special_irrelevant")
AGENT_CATEGORIES = ("agent_multi_step", "agent_multi_turn")
UPSTREAM = "https://github.com/ACEBench/ACEBench/tree/main/data_all/data_en"
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
# Data files.

def _read_lines(path: str) -> list[tuple[int, dict[str, Any]]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found; upstream publishes it at {UPSTREAM}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: not a JSON object")
            rows.append((n, row))
    return rows


def _need(row: dict, field: str, kind: type | tuple, where: str) -> Any:
    if field not in row:
        raise ValueError(f"{where}: missing field {field!r}")
    if not isinstance(row[field], kind):
        raise ValueError(f"{where}: field {field!r} must be {getattr(kind, '__name__', kind)}, "
                         f"got {type(row[field]).__name__}")
    return row[field]


def _check_functions(functions: list, where: str) -> None:
    for i, fn in enumerate(functions):
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}: field 'function'[{i}] needs a string 'name'")
        if not isinstance(fn.get("parameters", fn.get("arguments")), dict):
            raise ValueError(f"{where}: field 'function'[{i}] ({fn['name']}) needs a "
                             f"'parameters' object")


def _check_truth(truth: Any, category: str, where: str) -> None:
    field = "ground_truth"
    if category == "special_irrelevant":
        if not isinstance(truth, str):
            raise ValueError(f"{where}: field {field!r} must be a string for {category}")
        return
    if category in ("special_incomplete", "special_error_param"):
        if not isinstance(truth, dict) or not all(
                isinstance(v, list) and all(isinstance(x, str) for x in v) for v in truth.values()):
            raise ValueError(f"{where}: field {field!r} must map names to lists of strings")
        return
    options = truth if isinstance(truth, list) else [truth]
    if not options or not all(isinstance(o, dict) and all(isinstance(v, dict) for v in o.values())
                              for o in options):
        raise ValueError(f"{where}: field {field!r} must be {{api: {{param: value}}}} "
                         f"or a non-empty list of those")


def load_category(data_dir: str, category: str) -> list[Task]:
    """The tasks of one ACEBench category from ``data_dir`` (upstream's ``data_en`` folder:
    ``data_<category>.json`` and ``possible_answer/data_<category>.json``).

    FileNotFoundError names a missing file and where upstream publishes it; ValueError
    names ``file:line`` and the field of a malformed row, before anything runs.
    """
    if category not in NORMAL_CATEGORIES + SPECIAL_CATEGORIES:
        raise ValueError(f"unknown ACEBench category {category!r}; known: "
                         f"{list(NORMAL_CATEGORIES + SPECIAL_CATEGORIES)}")
    qpath = os.path.join(data_dir, f"data_{category}.json")
    apath = os.path.join(data_dir, "possible_answer", f"data_{category}.json")
    questions, answers = _read_lines(qpath), _read_lines(apath)
    truth_by_id: dict[str, Any] = {}
    for n, row in answers:
        where = f"{apath}:{n}"
        rid = _need(row, "id", str, where)
        if "ground_truth" not in row:
            raise ValueError(f"{where}: missing field 'ground_truth'")
        _check_truth(row["ground_truth"], category, where)
        truth_by_id[rid] = row["ground_truth"]
    context_field = "profile" if category == "normal_preference" else "time"
    tasks = []
    for n, row in questions:
        where = f"{qpath}:{n}"
        rid = _need(row, "id", str, where)
        question = _need(row, "question", str, where)
        functions = _need(row, "function", list, where)
        _check_functions(functions, where)
        context = _need(row, context_field, str, where)
        if rid not in truth_by_id:
            raise ValueError(f"{where}: id {rid!r} has no 'ground_truth' row in {apath}")
        template = (prompts.SPECIAL_SYSTEM if category.startswith("special")
                    else prompts.PREFERENCE_SYSTEM if category == "normal_preference"
                    else prompts.NORMAL_SYSTEM)
        system = template.format(**{context_field: context, "function": functions})
        tasks.append(Task(task_id=rid, env_id=ENV_ID, instruction=question, family=category,
                          payload={"category": category, "system": system,
                                   "user": prompts.USER.format(question=question),
                                   "functions": functions, "ground_truth": truth_by_id[rid]}))
    return tasks


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


def conversation_of(task_id: str) -> str:
    """``normal_multi_turn_user_adjust_3_1`` -> ``normal_multi_turn_user_adjust_3``."""
    return task_id.rsplit("_", 1)[0]


def aggregate(per_task: list[dict[str, Any]]) -> dict[str, float]:
    """Per-category accuracy (0-100) from ``{"task_id", "category", "passed": [bool] * n}``
    (pass@1 estimate = mean over samples); the multi-turn categories count a conversation
    as passed only when every row of it passes (upstream's end-to-end accuracy), and
    ``normal`` / ``special`` / ``normal_special`` are the unweighted category means."""
    cats: dict[str, dict[str, list[float]]] = {}
    for t in per_task:
        rate = sum(t["passed"]) / len(t["passed"])
        group = conversation_of(t["task_id"]) if "multi_turn" in t["category"] else t["task_id"]
        cats.setdefault(t["category"], {}).setdefault(group, []).append(rate)
    out = {c: round(100.0 * sum(min(v) for v in groups.values()) / len(groups), 2)
           for c, groups in sorted(cats.items())}
    for name, prefix in (("normal", "normal_"), ("special", "special_")):
        xs = [v for c, v in out.items() if c.startswith(prefix)]
        if xs:
            out[name] = round(sum(xs) / len(xs), 2)
    if "normal" in out and "special" in out:
        out["normal_special"] = round((out["normal"] + out["special"]) / 2, 2)
    return out


def aggregate_counts(per_task: list[dict[str, Any]]) -> dict[str, int]:
    """The number of graded units behind each :func:`aggregate` entry: rows, or
    conversations for the multi-turn categories; the summaries sum their categories."""
    units: dict[str, set] = {}
    for t in per_task:
        group = conversation_of(t["task_id"]) if "multi_turn" in t["category"] else t["task_id"]
        units.setdefault(t["category"], set()).add(group)
    out = {c: len(g) for c, g in sorted(units.items())}
    for name, prefix in (("normal", "normal_"), ("special", "special_")):
        if any(c.startswith(prefix) for c in units):
            out[name] = sum(v for c, v in out.items() if c.startswith(prefix))
    if "normal" in out and "special" in out:
        out["normal_special"] = out["normal"] + out["special"]
    return out


class ACEBenchEnvironment(Environment):
    """One ACEBench normal / special episode: one answer, graded (module docstring)."""

    env_id = ENV_ID

    def __init__(self, strict_scalars: bool = False):
        """``strict_scalars``: also compare top-level number / boolean values (upstream
        only checks their type)."""
        super().__init__()
        self.strict_scalars = strict_scalars

    def reset(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        """The task's system and user prompts; no tools (the answer is call text)."""
        if task.env_id != ENV_ID:
            raise ValueError(f"ACEBenchEnvironment got a {task.env_id!r} task")
        self.task, self.done = task, False
        self.stats = type(self.stats)()
        return ([{"role": "system", "content": task.payload["system"]},
                 {"role": "user", "content": task.payload["user"]}], [])

    def step(self, turn: AssistantTurn) -> StepResult:
        """Grade the answer; the episode ends."""
        self._begin_step()
        try:
            verdict = grade(self.task, turn, self.strict_scalars)
        except Exception as e:  # a grader bug must not crash the rollout: a failed answer
            verdict = _fail("grader_error", f"{type(e).__name__}: {e}")
        self.done = True
        return StepResult([], True, 1.0 if verdict["valid"] else 0.0,
                          {"verdict": verdict, "stats": self.stats.as_dict()})

    def finish(self) -> float:
        """No answer was given: 0."""
        self.done = True
        return 0.0


class ACEBenchTaskSource(TaskSource):
    """ACEBench's normal and special categories from ``data_dir`` (``data_en``); all are
    held out. ``limit`` keeps the first N rows of each category, or the first N whole
    conversations of a multi-turn category (smoke runs)."""

    env_id = ENV_ID

    def __init__(self, data_dir: str, categories: Sequence[str] = NORMAL_CATEGORIES + SPECIAL_CATEGORIES,
                 limit: int | None = None, strict_scalars: bool = False):
        """Load every category now (errors before anything runs)."""
        self.strict_scalars = strict_scalars
        self._tasks = []
        for c in categories:
            tasks = load_category(data_dir, c)
            if limit is not None and "multi_turn" in c:
                kept = list(dict.fromkeys(conversation_of(t.task_id) for t in tasks))[:limit]
                tasks = [t for t in tasks if conversation_of(t.task_id) in kept]
            self._tasks += tasks if limit is None or "multi_turn" in c else tasks[:limit]

    def tasks(self, split: str) -> list[Task]:
        """Every loaded task for ``heldout``; none for ``train``."""
        return list(self._tasks) if check_split(split) == "heldout" else []

    def make_env(self) -> Environment:
        """A fresh :class:`ACEBenchEnvironment`."""
        return ACEBenchEnvironment(self.strict_scalars)

    def oracle_hint(self, task: Task) -> str:
        """The possible answer(s), as JSON."""
        return json.dumps(task.payload["ground_truth"], ensure_ascii=False)

"""Explicit limits on tool calls between the model's text and the environments.

Everything here returns an error *text* instead of raising, so the parsers
(:mod:`lopd_jax.chat.qwen3`, :mod:`lopd_jax.chat.olmo3`) and the environments
(:mod:`lopd_jax.envs.base`) can turn any input into a parse-error observation. Each error
names the limit it hit (its constant and value), so the model reads what to change:

* ``MAX_CALL_CHARS``: characters in one tool-call block (and in one call's arguments,
  as compact JSON);
* ``MAX_JSON_DEPTH``: nesting of brackets/braces in one call;
* ``MAX_NUMBER_DIGITS``: digits in one number literal (Python refuses to convert integers
  beyond 4,300 digits, and huge numbers make tools slow; hex/binary literals count by
  their decimal size);
* ``MAX_CALLS_PER_TURN``: tool calls in one assistant turn.
"""

from __future__ import annotations

import json
from typing import Any

MAX_CALL_CHARS = 65536
MAX_JSON_DEPTH = 32
MAX_NUMBER_DIGITS = 100
MAX_CALLS_PER_TURN = 64

_MAX_INT_BITS = int(MAX_NUMBER_DIGITS * 3.3219280948873626)  # log2(10)


class LimitError(ValueError):
    """A call exceeds one of the limits; the message names the limit."""


def nesting_depth(text: str) -> int:
    """Deepest bracket nesting of ``text`` (``[{(``), outside JSON/Python string literals."""
    depth = best = 0
    quote = None
    escaped = False
    for ch in text:
        if quote is not None:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
            best = max(best, depth)
        elif ch in "]})":
            depth = max(0, depth - 1)
    return best


def text_limit_error(text: str, where: str) -> str | None:
    """Error text when a call's source text is too long or too deeply nested, else None."""
    if len(text) > MAX_CALL_CHARS:
        return (f"{where}: the call is {len(text)} characters long; the limit is "
                f"MAX_CALL_CHARS={MAX_CALL_CHARS}")
    depth = nesting_depth(text)
    if depth > MAX_JSON_DEPTH:
        return (f"{where}: the call is nested {depth} levels deep; the limit is "
                f"MAX_JSON_DEPTH={MAX_JSON_DEPTH}")
    return None


def _number_error(text: str) -> LimitError:
    return LimitError(f"a number has more than MAX_NUMBER_DIGITS={MAX_NUMBER_DIGITS} digits "
                      f"({text[:20]}...)")


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise _number_error(text)
    return int(text)


def _parse_float(text: str) -> float:
    if sum(c.isdigit() for c in text) > MAX_NUMBER_DIGITS:
        raise _number_error(text)
    return float(text)


def load_json(text: str, where: str) -> tuple[Any, str | None]:
    """``json.loads`` under the limits: (value, None) or (None, error text). Never raises."""
    error = text_limit_error(text, where)
    if error:
        return None, error
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float), None
    except LimitError as e:
        return None, f"{where}: {e}"
    except json.JSONDecodeError as e:
        return None, (f"{where}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
                      f"{text.strip()[:80]!r}")
    except (ValueError, RecursionError, MemoryError, TypeError) as e:
        return None, f"{where}: cannot read the JSON ({type(e).__name__}: {str(e)[:200]})"


def value_limit_error(value: Any, where: str, _depth: int = 0) -> str | None:
    """Error text when a decoded value breaks the depth or number limits, else None."""
    if _depth > MAX_JSON_DEPTH:
        return (f"{where}: the arguments are nested more than MAX_JSON_DEPTH="
                f"{MAX_JSON_DEPTH} levels deep")
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > _MAX_INT_BITS:
            return (f"{where}: an integer has more than MAX_NUMBER_DIGITS="
                    f"{MAX_NUMBER_DIGITS} digits")
        return None
    items = value.values() if isinstance(value, dict) else (
        value if isinstance(value, (list, tuple)) else ())
    for item in items:
        error = value_limit_error(item, where, _depth + 1)
        if error:
            return error
    return None


def arguments_limit_error(arguments: Any, where: str) -> str | None:
    """All limits for one call's decoded arguments (depth, numbers, compact JSON size)."""
    try:
        error = value_limit_error(arguments, where)
        if error:
            return error
        size = len(json.dumps(arguments, ensure_ascii=False, default=str))
    except (ValueError, TypeError, RecursionError) as e:
        return f"{where}: the arguments cannot be encoded as JSON ({type(e).__name__})"
    if size > MAX_CALL_CHARS:
        return (f"{where}: the arguments are {size} characters as JSON; the limit is "
                f"MAX_CALL_CHARS={MAX_CALL_CHARS}")
    return None

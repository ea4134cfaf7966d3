"""Olmo-3's chat format: ChatML turns, ``<function_calls>`` with Python-style calls.

Established from Olmo-3-7B-Instruct's chat template (see
:data:`lopd_jax.chat.templates.OLMO3_CHAT_TEMPLATE`): a default system turn when the
conversation has none, tool schemas as a JSON list in ``<functions>...</functions>``,
assistant calls as ``name(key=<json value>, ...)`` lines (several calls newline-separated in
one ``<function_calls>`` block, written right after the visible content), and every tool
result in its own ``environment`` turn. Turns end with ``<|im_end|>``; the final answer may
end with ``<|endoftext|>`` (the template closes the last assistant turn with the EOS token),
so both stop generation.
"""

from __future__ import annotations

import ast
import json
from typing import Any, Sequence

from lopd_jax.chat.base import (ChatFormat, call_from_json, message_text, scan_blocks,
                                split_thinking, tojson)
from lopd_jax.chat.call_limits import (MAX_NUMBER_DIGITS, arguments_limit_error, load_json,
                                  text_limit_error)
from lopd_jax.chat.templates import (OLMO3_DEFAULT_SYSTEM, OLMO3_NO_FUNCTIONS,
                                     OLMO3_WITH_FUNCTIONS)
from lopd_jax.core.types import AssistantTurn, Message, ToolCall, ToolSchema

_PARSE_ERRORS = (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError)
MAX_INT_BITS = int(MAX_NUMBER_DIGITS * 3.3219280948873626)
_NAMED_CONSTANTS = {"true": True, "false": False, "null": None,
                    "True": True, "False": False, "None": None}


def _literal(node: ast.AST) -> Any:
    """A JSON-compatible value from a literal expression (JSON and Python spellings)."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, complex)):
        if isinstance(node.value, int) and not isinstance(node.value, bool) and (
                node.value.bit_length() > MAX_INT_BITS):
            raise ValueError(f"an integer has more than MAX_NUMBER_DIGITS={MAX_NUMBER_DIGITS} "
                             "digits")
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_CONSTANTS:
        return _NAMED_CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise ValueError("dict keys must be strings")
            out[key] = _literal(v)
        return out
    raise ValueError(f"not a literal value: {ast.unparse(node)!r}")


def _dotted_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _statement_text(lines: list[str], stmt: ast.stmt) -> str:
    """The start of a statement's source (for error snippets; ``ast.get_source_segment``
    is quadratic in the source length)."""
    try:
        line = lines[stmt.lineno - 1].encode("utf-8")[stmt.col_offset:]
    except (IndexError, AttributeError):
        return ""
    return line.decode("utf-8", "replace")[:200]


def _call_from_statement(stmt: ast.stmt, lines: list[str], where: str) -> tuple[ToolCall | None, str | None]:
    text = _statement_text(lines, stmt)
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return None, f"{where}: not a function call: {text[:80]!r}"
    call = stmt.value
    name = _dotted_name(call.func)
    if name is None:
        return None, f"{where}: cannot read a function name from {text[:80]!r}"
    if call.args:
        return None, (f"{where}: {name}(...) has positional arguments; write every argument "
                      "as key=value")
    arguments = {}
    for kw in call.keywords:
        if kw.arg is None:
            return None, f"{where}: {name}(...) uses **-unpacking; write key=value arguments"
        try:
            arguments[kw.arg] = _literal(kw.value)
        except (ValueError, RecursionError) as e:
            return None, f"{where}: argument {kw.arg!r} of {name}: {e}"
    error = arguments_limit_error(arguments, where)
    if error:
        return None, error
    return ToolCall(name=name, arguments=arguments), None


def parse_function_calls(body: str, where: str = "<function_calls> block") -> tuple[list[ToolCall], list[str]]:
    """Calls in one ``<function_calls>`` body: Python-style lines, or a JSON object/list.

    Every malformed line becomes an error message; well-formed lines still parse. Never
    raises; over-limit blocks (:mod:`lopd_jax.chat.call_limits`) are errors naming the limit.
    """
    source = body.strip()
    if not source:
        return [], [f"{where}: empty block"]
    error = text_limit_error(source, where)
    if error:
        return [], [error]
    if source[0] in "[{":
        obj, error = load_json(source, where)
        if error is not None and "MAX_" in error:  # a limit, not just another syntax
            return [], [error]
        if error is None:
            calls, errors = [], []
            for k, item in enumerate(obj if isinstance(obj, list) else [obj]):
                call, error = call_from_json(item, f"{where}, JSON call {k + 1}")
                (errors.append(error) if error else calls.append(call))
            return calls, errors
    try:
        chunks = [(source, ast.parse(source).body)]
    except _PARSE_ERRORS:
        chunks = []
        for line in source.splitlines():
            if line.strip():
                try:
                    chunks.append((line.strip(), ast.parse(line.strip()).body))
                except _PARSE_ERRORS as e:
                    chunks.append((line.strip(), e))
    calls, errors = [], []
    for text, parsed in chunks:
        lines = text.splitlines()
        if isinstance(parsed, Exception):
            why = parsed.msg if isinstance(parsed, SyntaxError) else (
                f"{type(parsed).__name__}: {str(parsed)[:120]}")
            errors.append(f"{where}: not a valid call ({why}): {text[:80]!r}")
            continue
        for stmt in parsed:
            try:
                call, error = _call_from_statement(stmt, lines, where)
            except Exception as e:  # anything unexpected in a statement: a parse error
                call, error = None, f"{where}: cannot read the call ({type(e).__name__})"
            (errors.append(error) if error else calls.append(call))
    return calls, errors


def format_function_call(call: dict) -> str:
    """``name(key=<json>, ...)`` for one OpenAI-style tool-call entry, as the template does."""
    function = call.get("function") or call
    args = function.get("arguments") or {}
    if isinstance(args, str):
        args = json.loads(args)
    return function["name"] + "(" + ", ".join(f"{k}={tojson(v)}" for k, v in args.items()) + ")"


class Olmo3ChatFormat(ChatFormat):
    """Olmo-3 Instruct chat format (official template; no ``<think>`` added to the prompt).

    ``default_system`` is the identity sentence of the default system turn (Olmo-3: "You
    are a helpful function-calling AI assistant. "; Olmo-3.1 uses a longer one).
    """

    family = "olmo3"
    end_of_turn_token = "<|im_end|>"
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    fallback_latent_token = "<|pad|>"
    format_tokens = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<function_calls>",
                     "</function_calls>", "<functions>", "</functions>")

    def __init__(self, tokenizer: Any, *, enable_thinking: bool = False,
                 latent_token: str | None = None, default_system: str = OLMO3_DEFAULT_SYSTEM,
                 use_tokenizer_template: bool = False):
        self.default_system = default_system
        super().__init__(tokenizer, enable_thinking=enable_thinking, latent_token=latent_token,
                         use_tokenizer_template=use_tokenizer_template)

    def generation_prompt(self, enable_thinking: bool | None = None) -> str:
        """The assistant header that generation continues from (the same with thinking on or
        off: the official Instruct template has no ``enable_thinking`` switch)."""
        return "<|im_start|>assistant\n"

    def _turns(self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None,
               *, final_eos: bool) -> str:
        out = []
        for i, message in enumerate(messages):
            role = message.get("role")
            content = message_text(message)
            if role == "system":
                out.append("<|im_start|>system\n" + content)
                if tools is not None:
                    out.append("<functions>" + tojson(list(tools)) + "</functions>")
                elif message.get("functions") is not None:
                    out.append(" <functions>" + str(message["functions"]) + "</functions>")
                out.append("<|im_end|>\n")
            elif role == "user":
                out.append("<|im_start|>user\n" + content + "<|im_end|>\n")
            elif role == "assistant":
                out.append("<|im_start|>assistant\n" + content)
                if message.get("function_calls") is not None:
                    out.append("<function_calls>" + str(message["function_calls"]) + "</function_calls>")
                elif message.get("tool_calls") is not None:
                    out.append("<function_calls>" + "\n".join(
                        format_function_call(c) for c in message["tool_calls"]) + "</function_calls>")
                last = final_eos and i == len(messages) - 1
                out.append(self.tokenizer.eos_token if last else "<|im_end|>\n")
            elif role in ("tool", "environment"):
                out.append("<|im_start|>environment\n" + content + "<|im_end|>\n")
            else:
                raise ValueError(f"Olmo-3 chat format: unknown role {role!r}; use system, user, "
                                 "assistant, tool or environment")
        return "".join(out)

    def render(self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None,
               *, add_generation_prompt: bool = False,
               enable_thinking: bool | None = None) -> str:
        """The conversation exactly as Olmo-3's chat template renders it."""
        if not messages:
            raise ValueError("render needs at least one message")
        head = ""
        if not any(m.get("role") == "system" for m in messages):
            head = "<|im_start|>system\n" + self.default_system
            if not tools:
                head += OLMO3_NO_FUNCTIONS + "<|im_end|>\n"
            else:
                head += (OLMO3_WITH_FUNCTIONS + "<functions>" + tojson(list(tools))
                         + "</functions><|im_end|>\n")
        text = head + self._turns(messages, tools, final_eos=True)
        if add_generation_prompt:
            text += self.generation_prompt(enable_thinking)
        return text

    def render_observation(self, messages: Sequence[Message], *,
                           enable_thinking: bool | None = None) -> str:
        """``\\n`` + one ``environment`` turn per tool result (user turns as is) + prompt."""
        return (self.turn_separator + self._turns(messages, None, final_eos=False)
                + self.generation_prompt(enable_thinking))

    def parse_assistant(self, text: str) -> AssistantTurn:
        """Thinking, visible content and ``<function_calls>`` calls of one generated turn."""
        thinking, rest = split_thinking(text)
        outside, bodies, errors = scan_blocks(rest, "<function_calls>", "</function_calls>")
        calls = []
        for k, body in enumerate(bodies):
            found, errs = parse_function_calls(body, f"<function_calls> block {k + 1}")
            calls.extend(found)
            errors.extend(errs)
        return AssistantTurn(raw=text, content=outside.strip(), tool_calls=calls,
                             parse_errors=errors, thinking=thinking)

"""Qwen3's chat format: ChatML turns, ``<tool_call>`` JSON blocks, ``<think>`` reasoning.

The renderer mirrors :data:`lopd_jax.chat.templates.QWEN3_CHAT_TEMPLATE` (Qwen3's own
template) line for line; tests check it against ``tokenizer.apply_chat_template``.

Token-in-token-out caveat: Qwen3's template re-renders *earlier* assistant turns
differently from how they were generated in two cases — an intermediate turn with empty
reasoning loses its ``<think>\\n\\n</think>\\n\\n`` prefix (so with thinking off, a
multi-turn rollout is not a prefix of the template's rendering of the finished
conversation), and turns before the last real user query lose their reasoning. The rollout
keeps the ids the model actually saw and generated; this format never re-renders history.
"""

from __future__ import annotations

from typing import Sequence

from lopd_jax.chat.base import (ChatFormat, json_call_blocks, message_text,
                                split_thinking, tojson)
from lopd_jax.core.types import AssistantTurn, Message, ToolSchema

_TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query."
                "\n\nYou are provided with function signatures within <tools></tools> XML "
                "tags:\n<tools>")
_TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name "
                "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
                "</tool_call><|im_end|>\n")


def _is_tool_response_text(content: str) -> bool:
    return content.startswith("<tool_response>") and content.endswith("</tool_response>")


class Qwen3ChatFormat(ChatFormat):
    """Qwen3 (0.6B-8B hybrid-thinking checkpoints) chat format.

    Thinking off (default) puts an empty ``<think>\\n\\n</think>\\n\\n`` after the generation
    prompt, as the template's ``enable_thinking=False`` does; thinking on leaves the model
    to open its own ``<think>`` block.
    """

    family = "qwen3"
    end_of_turn_token = "<|im_end|>"
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    fallback_latent_token = "<|vision_pad|>"
    format_tokens = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>",
                     "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                     "</think>")

    def generation_prompt(self, enable_thinking: bool | None = None) -> str:
        """The assistant header that generation continues from."""
        return "<|im_start|>assistant\n" + ("" if self._thinking(enable_thinking)
                                            else "<think>\n\n</think>\n\n")

    @staticmethod
    def _tool_call_text(call: dict) -> str:
        call = call.get("function") or call
        args = call.get("arguments", {})
        args_text = args if isinstance(args, str) else tojson(args)
        return '<tool_call>\n{"name": "' + call["name"] + '", "arguments": ' + args_text + "}\n</tool_call>"

    def _assistant_text(self, message: Message, *, index: int, last: bool,
                        last_query_index: int) -> str:
        content = message_text(message)
        reasoning = message.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = ""
            if "</think>" in content:
                reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
        if index > last_query_index and (last or reasoning):
            text = ("<|im_start|>assistant\n<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
                    + content.lstrip("\n"))
        else:
            text = "<|im_start|>assistant\n" + content
        for k, call in enumerate(message.get("tool_calls") or []):
            if (k == 0 and content) or k > 0:
                text += "\n"
            text += self._tool_call_text(call)
        return text + "<|im_end|>\n"

    def _turns(self, messages: Sequence[Message], first_index: int,
               last_query_index: int) -> str:
        """Render ``messages`` as the template's message loop does (``loop.first`` at
        ``first_index == 0``)."""
        out = []
        n = len(messages)
        for i, message in enumerate(messages):
            role = message.get("role")
            index = first_index + i
            content = message_text(message)
            if role == "user" or (role == "system" and index > 0):
                out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
            elif role == "assistant":
                out.append(self._assistant_text(message, index=index, last=i == n - 1,
                                                last_query_index=last_query_index))
            elif role == "tool":
                if i == 0 or messages[i - 1].get("role") != "tool":
                    out.append("<|im_start|>user")
                out.append("\n<tool_response>\n" + content + "\n</tool_response>")
                if i == n - 1 or messages[i + 1].get("role") != "tool":
                    out.append("<|im_end|>\n")
            elif role != "system":
                raise ValueError(f"Qwen3 chat format: unknown role {role!r}; use system, user, "
                                 "assistant or tool")
        return "".join(out)

    def render(self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None,
               *, add_generation_prompt: bool = False,
               enable_thinking: bool | None = None) -> str:
        """The conversation exactly as Qwen3's chat template renders it."""
        if not messages:
            raise ValueError("render needs at least one message")
        head = []
        first_is_system = messages[0].get("role") == "system"
        if tools:
            head.append("<|im_start|>system\n")
            if first_is_system:
                head.append(message_text(messages[0]) + "\n\n")
            head.append(_TOOLS_INTRO)
            for tool in tools:
                head.append("\n" + tojson(tool))
            head.append(_TOOLS_OUTRO)
        elif first_is_system:
            head.append("<|im_start|>system\n" + message_text(messages[0]) + "<|im_end|>\n")
        last_query_index = len(messages) - 1
        for index in range(len(messages) - 1, -1, -1):
            m = messages[index]
            if (m.get("role") == "user" and isinstance(m.get("content"), str)
                    and not _is_tool_response_text(m["content"])):
                last_query_index = index
                break
        text = "".join(head) + self._turns(messages, 0, last_query_index)
        if add_generation_prompt:
            text += self.generation_prompt(enable_thinking)
        return text

    def render_observation(self, messages: Sequence[Message], *,
                           enable_thinking: bool | None = None) -> str:
        """``\\n`` + tool/user turns (consecutive tool results share one user turn) + prompt."""
        return (self.turn_separator + self._turns(messages, 1, -1)
                + self.generation_prompt(enable_thinking))

    def parse_assistant(self, text: str) -> AssistantTurn:
        """Thinking, visible content and ``<tool_call>`` JSON calls of one generated turn.

        Never raises: a malformed or over-limit block (:mod:`lopd_jax.chat.call_limits`) is a
        parse error naming what was wrong.
        """
        thinking, rest = split_thinking(text)
        outside, calls, errors = json_call_blocks(rest)
        return AssistantTurn(raw=text, content=outside.strip(), tool_calls=calls,
                             parse_errors=errors, thinking=thinking)

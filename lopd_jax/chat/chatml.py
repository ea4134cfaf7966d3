"""Plain ChatML, the chat format of the Llama family's SmolLM2 instruct models.

SmolLM2-135M-Instruct's template knows only roles and text
(``<|im_start|>{role}\\n{content}<|im_end|>\\n``, with a default SmolLM system turn) and has no
tool convention, so this format adds one inside the text: tool schemas go into the system turn
as a ``<tools>`` list with the instruction to answer with ``<tool_call>{...}</tool_call>``,
an assistant's calls are appended to its text as such blocks, tool results are ``tool`` turns.
:meth:`ChatMLChatFormat.plain_messages` performs that rewrite; rendering is then the template's
own (``tests/chat/test_chat_template_parity.py``). ``<tool_call>`` is ordinary text in SmolLM2's
vocabulary; the latent slot falls back to ``<empty_output>``. Details: ``docs/smollm2.md``.
"""

from __future__ import annotations

from typing import Sequence

from lopd_jax.chat.base import ChatFormat, json_call_blocks, message_text, tojson
from lopd_jax.core.types import AssistantTurn, Message, ToolSchema

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
"""The system text SmolLM2's template inserts when the first message is not a system one."""

TOOLS_INTRO = ("You can call functions. Their signatures are given within <tools></tools> "
               "XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nTo call a function, answer with a JSON object with the function "
               "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
               "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
ROLES = ("system", "user", "assistant", "tool")


def tool_call_text(call: dict) -> str:
    """One call (``{"name", "arguments"}``, or the HF ``{"function": {...}}`` form) as a block."""
    call = call.get("function") or call
    args = call.get("arguments", {})
    args_text = args if isinstance(args, str) else tojson(args)
    return '<tool_call>\n{"name": "' + call["name"] + '", "arguments": ' + args_text + "}\n</tool_call>"


class ChatMLChatFormat(ChatFormat):
    """SmolLM2's ChatML, with tool calls as ``<tool_call>`` JSON blocks in the text.

    No thinking mode (``enable_thinking`` is accepted and ignored: the template has none).
    """

    family = "llama"
    end_of_turn_token = "<|im_end|>"
    stop_tokens = ("<|im_end|>", "<|endoftext|>")
    fallback_latent_token = "<empty_output>"
    format_tokens = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

    @staticmethod
    def plain_messages(messages: Sequence[Message],
                       tools: Sequence[ToolSchema] | None = None) -> list[dict[str, str]]:
        """``messages`` as role/content pairs the plain template renders: tool schemas in
        the system turn, each assistant turn's calls as ``<tool_call>`` blocks in its text."""
        out = []
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in ROLES:
                raise ValueError(f"ChatML chat format: unknown role {role!r} in message {i}; use one of {ROLES}")
            content = message_text(m)
            if role == "assistant" and m.get("tool_calls"):
                calls = "\n".join(tool_call_text(c) for c in m["tool_calls"])
                content = content + "\n" + calls if content else calls
            out.append({"role": role, "content": content})
        if tools:
            if out and out[0]["role"] == "system":
                system, rest = out[0]["content"], out[1:]
            else:
                system, rest = DEFAULT_SYSTEM, out
            schemas = "".join("\n" + tojson(t) for t in tools)
            out = [{"role": "system", "content": system + "\n\n" + TOOLS_INTRO + schemas + TOOLS_OUTRO}, *rest]
        return out

    def generation_prompt(self) -> str:
        """The assistant header that generation continues from."""
        return "<|im_start|>assistant\n"

    @staticmethod
    def _turns(messages: Sequence[dict[str, str]]) -> str:
        return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)

    def render(self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None,
               *, add_generation_prompt: bool = False,
               enable_thinking: bool | None = None) -> str:
        """The conversation as SmolLM2's template renders :meth:`plain_messages`."""
        if not messages:
            raise ValueError("render needs at least one message")
        plain = self.plain_messages(messages, tools)
        head = "" if plain[0]["role"] == "system" else f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
        return head + self._turns(plain) + (self.generation_prompt() if add_generation_prompt else "")

    def render_observation(self, messages: Sequence[Message], *,
                           enable_thinking: bool | None = None) -> str:
        """``\\n`` + the tool / user turns + the next generation prompt."""
        return self.turn_separator + self._turns(self.plain_messages(messages)) + self.generation_prompt()

    def prompt_ids(self, messages: Sequence[Message],
                   tools: Sequence[ToolSchema] | None = None, *,
                   enable_thinking: bool | None = None) -> list[int]:
        """Ids of the conversation and the generation prompt; with the checkpoint's template,
        that template applied to :meth:`plain_messages` (it has no ``tools`` argument)."""
        messages, tools = self.escape_content(list(messages)), self.escape_content(list(tools)) if tools else None
        if self.use_tokenizer_template:
            text = self.tokenizer.apply_chat_template(self.plain_messages(messages, tools), tokenize=False,
                                                      add_generation_prompt=True)
            return self.encode_rendered(text)
        return self.encode_rendered(self.render(messages, tools, add_generation_prompt=True))

    def parse_assistant(self, text: str) -> AssistantTurn:
        """Visible content and ``<tool_call>`` JSON calls of one generated turn.

        Never raises: a malformed or over-limit block (:mod:`lopd_jax.chat.call_limits`) is a
        parse error naming what was wrong.
        """
        outside, calls, errors = json_call_blocks(text)
        return AssistantTurn(raw=text, content=outside.strip(), tool_calls=calls, parse_errors=errors)

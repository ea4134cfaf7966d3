"""The chat-format interface shared by every model family, and the pieces around it.

"Token in, token out" (docs/method.md, "Rollout"): a rollout keeps one list of token ids per
trajectory plus a supervision mask. The sampler appends exactly the ids the model generated
(mask 1, including the end-of-turn id); a :class:`ChatFormat` supplies the ids of
everything else (mask 0): the prompt up to the first generation prompt
(:meth:`ChatFormat.prompt_ids`) and, after each generated turn, the separator, the
observation turns and the next generation prompt (:meth:`ChatFormat.observation_ids`).
Decoded text is only parsed (:meth:`ChatFormat.parse_assistant`), never re-tokenized.

The latent splice (docs/method.md, "Teacher sequence") needs the framing ids around the latent slots
(:meth:`ChatFormat.framing_ids`) and the token index where the first user message's
content starts (:meth:`ChatFormat.insertion_point`).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
from typing import Any, ClassVar, Sequence

from lopd_jax.chat.call_limits import MAX_CALLS_PER_TURN, arguments_limit_error, load_json
from lopd_jax.chat.tokenizers import LATENT_TOKEN, validate_tokenizer
from lopd_jax.method.composer import LatentFraming
from lopd_jax.core.text import clean_text, content_ids, control_tokens
from lopd_jax.core.types import AssistantTurn, Message, ToolCall, ToolSchema

_ESC = "\ue000"  # private-use marks of an escaped control string inside content (ChatFormat.escape_content)
_ESC_SELF = "\ue001"
_ESC_BASE = 0xF0000  # one supplementary private-use code point per control token (65,534 of them)

@dataclasses.dataclass(frozen=True)
class LatentBlock:
    """Token ids of one inserted block: ``before_ids + [slot_id] * num_slots + after_ids``.

    Its length ``L_ins`` is fixed, so teacher position ``j + L_ins`` predicts the same
    token as student position ``j`` for every ``j`` at or after the insertion point.
    """

    before_ids: tuple[int, ...]
    slot_id: int
    num_slots: int
    after_ids: tuple[int, ...]

    @property
    def ids(self) -> list[int]:
        """The whole block."""
        return [*self.before_ids, *([self.slot_id] * self.num_slots), *self.after_ids]

    @property
    def length(self) -> int:
        """``L_ins``: how far the block shifts every later position."""
        return len(self.before_ids) + self.num_slots + len(self.after_ids)

    @property
    def slot_start(self) -> int:
        """Offset of the first latent slot inside the block."""
        return len(self.before_ids)

    def splice(self, ids: Sequence[int], insertion_point: int) -> list[int]:
        """``ids`` with the block inserted at ``insertion_point`` (a list-level reference)."""
        if not 0 <= insertion_point <= len(ids):
            raise ValueError(f"insertion_point {insertion_point} outside [0, {len(ids)}]")
        return [*ids[:insertion_point], *self.ids, *ids[insertion_point:]]


@dataclasses.dataclass
class TokenTrajectory:
    """One trajectory's token ids and supervision mask, built turn by turn.

    ``mask[i]`` is 1 exactly on ids the policy generated (added with
    :meth:`add_generated`), 0 on everything the chat format or environment supplied.
    """

    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)

    def add_context(self, ids: Sequence[int]) -> None:
        """Append non-generated ids (prompt, observations): mask 0."""
        self.ids.extend(int(i) for i in ids)
        self.mask.extend([0] * len(ids))

    def add_generated(self, ids: Sequence[int]) -> None:
        """Append ids the policy sampled, end-of-turn id included: mask 1."""
        self.ids.extend(int(i) for i in ids)
        self.mask.extend([1] * len(ids))

    def __len__(self) -> int:
        return len(self.ids)


def split_thinking(text: str) -> tuple[str, str]:
    """Split ``text`` into (thinking, rest) at the first ``</think>``.

    The thinking is what follows the last ``<think>`` before it (or the start of the text,
    when the generation prompt already opened the block), stripped of newlines. An unclosed
    ``<think>`` makes the whole remainder thinking; text without tags has no thinking.
    """
    close = text.find("</think>")
    if close == -1:
        opened = text.find("<think>")
        if opened == -1:
            return "", text
        return text[opened + len("<think>"):].strip("\n"), text[:opened]
    head = text[:close]
    opened = head.rfind("<think>")
    before = head[:opened] if opened != -1 else ""
    thinking = head[opened + len("<think>"):] if opened != -1 else head
    return thinking.strip("\n"), before + text[close + len("</think>"):]


def _snippet(text: str, limit: int = 80) -> str:
    text = text.strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")


def scan_blocks(text: str, open_tag: str, close_tag: str) -> tuple[str, list[str], list[str]]:
    """Cut ``open_tag ... close_tag`` blocks out of ``text``.

    Returns (the text outside the blocks, the block bodies in order, errors for an unclosed
    block or a stray closing tag). An unclosed block swallows the rest of the text.
    """
    outside, bodies, errors = [], [], []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        stray = text.find(close_tag, pos)
        if stray != -1 and (start == -1 or stray < start):
            errors.append(f"stray {close_tag} with no opening {open_tag}")
            outside.append(text[pos:stray])
            pos = stray + len(close_tag)
            continue
        if start == -1:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        reopened = text.find(open_tag, body_start)
        if end == -1 or (reopened != -1 and reopened < end):
            stop = len(text) if end == -1 else reopened
            errors.append(f"unclosed {open_tag} block (no {close_tag} before "
                          f"{'the end of the turn' if end == -1 else 'the next ' + open_tag}): "
                          f"{_snippet(text[body_start:stop])}")
            if end == -1:
                break
            pos = reopened
            continue
        bodies.append(text[body_start:end])
        pos = end + len(close_tag)
    return "".join(outside), bodies, errors


def call_from_json(obj: Any, where: str) -> tuple[ToolCall | None, str | None]:
    """Validate one decoded ``{"name": str, "arguments": {...}}`` object.

    A missing ``arguments`` means no arguments; anything else malformed yields an error
    message (prefixed with ``where``) instead of a call.
    """
    if not isinstance(obj, dict):
        return None, (f"{where}: a call must be a JSON object with 'name' and 'arguments', "
                      f"got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f"{where}: missing or empty 'name' string in {_snippet(_dumps(obj))}"
    if len(name) > 256:
        return None, f"{where}: the tool name is {len(name)} characters long (at most 256)"
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        return None, (f"{where}: 'arguments' of {name.strip()[:80]!r} must be a JSON object, "
                      f"got {type(arguments).__name__} {_snippet(_dumps(arguments))}")
    error = arguments_limit_error(arguments, where)
    if error:
        return None, error
    return ToolCall(name=name.strip(), arguments=arguments), None


def json_call_blocks(text: str, open_tag: str = "<tool_call>",
                     close_tag: str = "</tool_call>") -> tuple[str, list[ToolCall], list[str]]:
    """The JSON calls in ``open_tag {"name": ..., "arguments": {...}} close_tag`` blocks of ``text``.

    Returns (the text outside the blocks, the valid calls in order, an error per empty,
    unclosed or malformed block); the Qwen3 and ChatML formats write calls this way.
    """
    outside, bodies, errors = scan_blocks(text, open_tag, close_tag)
    calls = []
    for k, body in enumerate(bodies):
        where = f"{open_tag} block {k + 1}"
        if not body.strip():
            errors.append(f"{where}: empty block")
            continue
        obj, error = load_json(body, where)
        if error is None:
            call, error = call_from_json(obj, where)
        if error:
            errors.append(error)
        else:
            calls.append(call)
    return outside, calls, errors


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, default=str)
    except (ValueError, TypeError, RecursionError):
        return f"<{type(value).__name__}>"


def limit_calls(turn: AssistantTurn) -> AssistantTurn:
    """``turn`` with at most ``MAX_CALLS_PER_TURN`` calls (one parse error for the rest)."""
    if len(turn.tool_calls) <= MAX_CALLS_PER_TURN:
        return turn
    extra = len(turn.tool_calls) - MAX_CALLS_PER_TURN
    errors = [*turn.parse_errors, f"{len(turn.tool_calls)} tool calls in one turn; the limit "
              f"is MAX_CALLS_PER_TURN={MAX_CALLS_PER_TURN}, so the last {extra} were not run"]
    return dataclasses.replace(turn, tool_calls=turn.tool_calls[:MAX_CALLS_PER_TURN],
                               parse_errors=errors)


def tojson(value: Any) -> str:
    """JSON text as ``transformers`` chat templates write it (``tojson``: no ASCII escaping)."""
    return json.dumps(value, ensure_ascii=False)


def message_text(message: Message, field: str = "content") -> str:
    """A message's text field; ``None`` / missing is empty, anything else not a str is an error."""
    value = message.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"message {field} must be a str (got {type(value).__name__} in a "
                        f"{message.get('role')!r} message); join multi-part content into text")
    return value


class ChatFormat(abc.ABC):
    """How one model family turns messages into token ids and generated text into calls.

    Subclasses render text exactly as the family's chat template does; this base class
    tokenizes it with the checkpoint's own ``transformers`` tokenizer and adds the
    token-in-token-out helpers. ``enable_thinking`` is the default for every call that
    takes it; ``latent_token`` overrides the latent-slot placeholder (default: the
    tokenizer's ``<|latent|>`` if it has one, else the family's fallback).
    ``use_tokenizer_template``: render prompts with the tokenizer's own chat template
    through ``transformers`` (``apply_chat_template`` with ``tools`` and
    ``enable_thinking``) instead of the hand-written renderer -- what runs with a real
    checkpoint (``model.hf_path``) do; the renderers serve tokenizer-less tiny runs.
    """

    family: ClassVar[str]
    end_of_turn_token: ClassVar[str]
    stop_tokens: ClassVar[tuple[str, ...]]
    user_header: ClassVar[str] = "<|im_start|>user\n"
    turn_separator: ClassVar[str] = "\n"
    fallback_latent_token: ClassVar[str]
    format_tokens: ClassVar[tuple[str, ...]]

    def __init__(self, tokenizer: Any, *, enable_thinking: bool = False,
                 latent_token: str | None = None, use_tokenizer_template: bool = False):
        self.tokenizer = tokenizer
        self.enable_thinking = bool(enable_thinking)
        self.use_tokenizer_template = bool(use_tokenizer_template)
        if self.use_tokenizer_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"use_tokenizer_template needs a tokenizer with a chat_template; "
                             f"{type(tokenizer).__name__} has none (use the checkpoint's tokenizer files).")
        if latent_token is None:
            latent_token = (LATENT_TOKEN if LATENT_TOKEN in tokenizer.get_vocab()
                            else self.fallback_latent_token)
        self.latent_token = latent_token
        validate_tokenizer(tokenizer, self)
        vocab = tokenizer.get_vocab()
        self.end_of_turn_id: int = vocab[self.end_of_turn_token]
        self.stop_ids: tuple[int, ...] = tuple(vocab[t] for t in self.stop_tokens)
        self.latent_id: int = vocab[self.latent_token]
        self._control = control_tokens(tokenizer)  # every added token that is not plain text
        self._control_ids = {t: int(tokenizer.convert_tokens_to_ids(t)) for t in self._control}
        self._control_marks = {t: _ESC + chr(_ESC_BASE + k) for k, t in enumerate(self._control)}
        content_ids(tokenizer, "")  # builds the content encoder now: a tokenizer that spells one fails here
        self._control_re = re.compile("|".join(re.escape(t) for t in self._control)) if self._control else None
        self._escaped_re = re.compile(re.escape(_ESC) + "(.)", re.DOTALL)
        self._user_header_ids = self.encode(self.user_header)

    # ---- what each family defines -------------------------------------------------
    @abc.abstractmethod
    def render(self, messages: Sequence[Message], tools: Sequence[ToolSchema] | None = None,
               *, add_generation_prompt: bool = False,
               enable_thinking: bool | None = None) -> str:
        """The conversation as the family's chat template renders it."""

    @abc.abstractmethod
    def render_observation(self, messages: Sequence[Message], *,
                           enable_thinking: bool | None = None) -> str:
        """Text after a closed assistant turn: separator, observation turns, next prompt."""

    @abc.abstractmethod
    def parse_assistant(self, text: str) -> AssistantTurn:
        """Parse one generated assistant turn (without its end-of-turn token)."""

    # ---- shared -------------------------------------------------------------------
    @property
    def required_tokens(self) -> tuple[str, ...]:
        """Tokens the tokenizer must hold as single ids for this format."""
        return (*self.format_tokens, self.latent_token)

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Ids the format closes a turn with (``(end_of_turn_id,)``); sampling stops on any
        of :attr:`stop_ids`, which also holds the end-of-text id."""
        return (self.end_of_turn_id,)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Text forms of the stop ids (for samplers that stop on strings)."""
        return self.stop_tokens

    def _thinking(self, enable_thinking: bool | None) -> bool:
        return self.enable_thinking if enable_thinking is None else bool(enable_thinking)

    def encode(self, text: str) -> list[int]:
        """Token ids of the format's own *framing* text, or of text standing for the model's
        own generation (an oracle demonstration's turn), no BOS/EOS added: its control strings
        become control ids, so a written ``<tool_call>`` is a real call. Outside text goes
        through :meth:`encode_text`."""
        return list(self.tokenizer.encode(clean_text(text), add_special_tokens=False))

    def encode_text(self, text: str) -> list[int]:
        """Token ids of *content* (tool results, tasks, files, experiences): every added token
        that is not plain text stays ordinary text in it, special or not (``<|im_end|>``,
        ``<tool_call>``, ``<think>``), lone surrogates are escaped
        (:func:`lopd_jax.core.text.content_ids`)."""
        return content_ids(self.tokenizer, text)

    def escape_content(self, value: Any) -> Any:
        """``value`` (messages, tool schemas: nested dicts / lists / strings) with every
        control string (:func:`lopd_jax.core.text.control_tokens`: each added token that is
        not plain text) inside a string replaced by a private-use mark and lone surrogates
        escaped, so that a rendering of it holds control strings only where the format
        itself wrote them; :meth:`encode_rendered` turns the marks back into text."""
        if isinstance(value, str):
            value = clean_text(value)
            if _ESC in value:
                value = value.replace(_ESC, _ESC + _ESC_SELF)
            if self._control_re is not None:
                value = self._control_re.sub(lambda m: self._control_marks[m.group()], value)
            return value
        if isinstance(value, dict):
            return {self.escape_content(k): self.escape_content(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape_content(v) for v in value]
        return value

    def _unescape(self, text: str) -> str:
        def back(m: re.Match) -> str:
            code = m.group(1)
            if code == _ESC_SELF:
                return _ESC
            k = ord(code) - _ESC_BASE
            return self._control[k] if 0 <= k < len(self._control) else m.group()
        return self._escaped_re.sub(back, text) if _ESC in text else text

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a rendering of :meth:`escape_content`'d messages: each control string in
        ``text`` is the format's framing (its control id); the text between them is encoded
        with special-token parsing off after the escaped content is restored. On text with
        no escaped content this equals the tokenizer's own encoding of ``text``."""
        if self._control_re is None:
            return self.encode_text(self._unescape(text))
        ids, pos = [], 0
        for m in self._control_re.finditer(text):
            if m.start() > pos:
                ids += self.encode_text(self._unescape(text[pos:m.start()]))
            ids.append(self._control_ids[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self.encode_text(self._unescape(text[pos:]))
        return ids

    def prompt_ids(self, messages: Sequence[Message],
                   tools: Sequence[ToolSchema] | None = None, *,
                   enable_thinking: bool | None = None) -> list[int]:
        """Ids of the rendered conversation ending with the assistant generation prompt
        (content never yields control ids: :meth:`escape_content`)."""
        messages, tools = self.escape_content(list(messages)), self.escape_content(list(tools)) if tools else None
        if self.use_tokenizer_template:
            text = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], tools=tools, tokenize=False,
                add_generation_prompt=True, enable_thinking=self._thinking(enable_thinking))
            return self.encode_rendered(text)
        return self.encode_rendered(self.render(messages, tools, add_generation_prompt=True,
                                                enable_thinking=enable_thinking))

    def observation_ids(self, messages: Sequence[Message], *,
                        enable_thinking: bool | None = None,
                        turn_closed: bool = True) -> list[int]:
        """Ids to append after a generated turn: separator, observations, next prompt.

        ``turn_closed=False`` is for a turn cut off before its end-of-turn id (token cap):
        the end-of-turn id is then supplied here (mask 0, it was not generated).
        """
        if not messages:
            raise ValueError("observation_ids needs at least one observation message; an "
                             "empty observation means the episode is done")
        for m in messages:
            if m.get("role") == "assistant":
                raise ValueError("observation messages must not contain assistant turns: "
                                 "append the ids the policy generated instead")
        ids = self.encode_rendered(self.render_observation(self.escape_content(list(messages)),
                                                           enable_thinking=enable_thinking))
        return ids if turn_closed else [self.end_of_turn_id, *ids]

    def decode_generated(self, ids: Sequence[int]) -> str:
        """Text of generated ids, trailing stop ids removed, tags kept for parsing."""
        ids = list(ids)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def parse_generated(self, ids: Sequence[int]) -> AssistantTurn:
        """:meth:`parse_assistant` of :meth:`decode_generated`; never raises.

        At most ``MAX_CALLS_PER_TURN`` calls are kept (:func:`limit_calls`); an unexpected
        failure inside the parser becomes a parse error (the turn's text is its content).
        """
        text = self.decode_generated(ids)
        try:
            turn = self.parse_assistant(text)
        except Exception as e:  # a parser bug must not stop a rollout: the model reads it
            return AssistantTurn(raw=text, content=text.strip(), parse_errors=[
                f"the turn could not be parsed ({type(e).__name__}); write each tool call "
                "as the format's tool-call block with a JSON object"])
        return limit_calls(turn)

    def assistant_message(self, turn: AssistantTurn) -> Message:
        """The assistant message dict (HF convention) for a parsed turn."""
        message: Message = {"role": "assistant", "content": turn.content}
        if turn.thinking:
            message["reasoning_content"] = turn.thinking
        if turn.tool_calls:
            message["tool_calls"] = [c.to_message_field() for c in turn.tool_calls]
        return message

    def framing_ids(self, framing: LatentFraming | None = None) -> LatentBlock:
        """Ids of the latent block: framing text before, ``num_slots`` slots, text after."""
        framing = framing or LatentFraming()
        return LatentBlock(before_ids=tuple(self.encode(framing.before)), slot_id=self.latent_id,
                           num_slots=framing.num_slots, after_ids=tuple(self.encode(framing.after)))

    def insertion_point(self, prompt_ids: Sequence[int]) -> int:
        """Index in ``prompt_ids`` where the first user message's content starts."""
        header = self._user_header_ids
        n = len(header)
        for i in range(len(prompt_ids) - n + 1):
            if list(prompt_ids[i:i + n]) == header:
                return i + n
        raise ValueError(
            f"no first-user-turn header {self.user_header!r} (ids {header}) found in the "
            "prompt ids: the prompt needs a user message, and its content must not begin "
            "with whitespace that the tokenizer merges into the header's newline")

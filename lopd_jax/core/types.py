"""Plain data types shared by chat formatting, environments and the rollout loop.

Messages are plain dicts in the OpenAI / Hugging Face chat convention so they can be fed
to ``tokenizer.apply_chat_template`` unchanged::

    {"role": "system" | "user" | "assistant" | "tool", "content": str,
     "tool_calls": [{"type": "function", "function": {"name": str, "arguments": dict}}]}

Tool schemas are OpenAI-style function specs::

    {"type": "function", "function": {"name": str, "description": str,
                                      "parameters": <JSON schema object>}}
"""

from __future__ import annotations

import dataclasses
from typing import Any

Message = dict[str, Any]
ToolSchema = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: function name and JSON-decoded keyword arguments."""

    name: str
    arguments: dict[str, Any]

    def to_message_field(self) -> dict[str, Any]:
        """The entry this call takes in an assistant message's ``tool_calls`` list."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class AssistantTurn:
    """What the model produced in one assistant turn, parsed.

    ``raw`` is the decoded text exactly as generated (without the end-of-turn token);
    ``content`` is the visible answer text with tool-call blocks (and any thinking block)
    removed; ``tool_calls`` are the well-formed calls in order; ``parse_errors`` describes
    every malformed call block (bad JSON, missing name, non-dict arguments, ...).
    """

    raw: str
    content: str
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)
    parse_errors: list[str] = dataclasses.field(default_factory=list)
    thinking: str = ""


@dataclasses.dataclass
class StepResult:
    """The environment's answer to one assistant turn.

    ``observation`` holds the messages appended before the next assistant turn (usually
    ``role="tool"`` messages, one per call, or a ``role="user"`` message); empty when
    ``done``. ``reward`` is in [0, 1] and meaningful when ``done`` (0 otherwise).
    """

    observation: list[Message]
    done: bool
    reward: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Task:
    """One task of an environment family.

    ``task_id`` is unique within the family; ``family`` names its structural family
    (tasks of one family are solved the same way, so retrieving one helps the other);
    ``instruction`` is the user-facing task text; ``payload`` carries whatever the
    environment needs to rebuild the task deterministically.
    """

    task_id: str
    env_id: str
    instruction: str
    family: str = ""
    payload: dict[str, Any] = dataclasses.field(default_factory=dict)

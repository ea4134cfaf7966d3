"""Text that is content, not markup: safe to tokenize whatever it holds.

Tool results, tasks, user messages, files and bank experiences are *content*: a control
string in them (``<|im_end|>``, ``<|im_start|>``, ...) must stay ordinary text, never become
the chat format's control id, and a lone surrogate (e.g. a tool echoing the JSON escape
``"\\udcff"``) must not stop the tokenizer. :func:`content_ids` encodes content with the
tokenizer's special-token parsing off; :func:`clean_text` escapes what UTF-8 cannot hold;
:func:`control_tokens` lists the strings a tokenizer would otherwise turn into special ids.
"""

from __future__ import annotations

from typing import Any

__all__ = ["clean_text", "content_ids", "control_tokens"]


def clean_text(text: str) -> str:
    """``text`` with every lone surrogate written as its backslash escape (``\\udcff``), so
    it is valid UTF-8; text that already is comes back unchanged (the same object)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def content_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of content ``text`` (no BOS/EOS): control strings in it are encoded as
    ordinary text (``split_special_tokens``), lone surrogates escaped (:func:`clean_text`)."""
    return list(tokenizer.encode(clean_text(text), add_special_tokens=False, split_special_tokens=True))


def control_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The strings ``tokenizer`` encodes as special ids when special-token parsing is on
    (its added tokens marked special), longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {t.content for t in added.values() if getattr(t, "special", False)}
    found |= {t for t in getattr(tokenizer, "all_special_tokens", ()) if t}
    return tuple(sorted(found, key=lambda s: (-len(s), s)))

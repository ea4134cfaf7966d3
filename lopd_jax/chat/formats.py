"""Chat formats by family, chosen by configuration: ``make_chat_format("qwen3", tokenizer)``.

The interface and token-in-token-out helpers live in :mod:`lopd_jax.chat.base`; the families in
:mod:`lopd_jax.chat.qwen3`, :mod:`lopd_jax.chat.olmo3` and :mod:`lopd_jax.chat.chatml`. A rollout::

    fmt = make_chat_format(cfg.chat_format, tokenizer, enable_thinking=False)
    traj.add_context(fmt.prompt_ids(messages, tools))
    while True:
        generated = sample(traj.ids, stop_ids=fmt.stop_ids); traj.add_generated(generated)
        result = env.step(fmt.parse_generated(generated))
        if result.done:
            break
        closed = bool(generated) and generated[-1] in fmt.stop_ids
        traj.add_context(fmt.observation_ids(result.observation, turn_closed=closed))
"""

from __future__ import annotations

from typing import Any

from lopd_jax.chat.base import ChatFormat
from lopd_jax.chat.chatml import ChatMLChatFormat
from lopd_jax.chat.olmo3 import Olmo3ChatFormat
from lopd_jax.chat.qwen3 import Qwen3ChatFormat

CHAT_FORMATS: dict[str, type[ChatFormat]] = {
    Qwen3ChatFormat.family: Qwen3ChatFormat,
    Olmo3ChatFormat.family: Olmo3ChatFormat,
    ChatMLChatFormat.family: ChatMLChatFormat,
}
"""Registered chat formats by family name (the ``chat_format`` config value)."""


def make_chat_format(family: str, tokenizer: Any, **options: Any) -> ChatFormat:
    """The chat format registered as ``family``, bound to ``tokenizer``.

    ``options`` go to the format's constructor (``enable_thinking``, ``latent_token``, ...).
    """
    try:
        cls = CHAT_FORMATS[family]
    except KeyError:
        raise ValueError(f"unknown chat format {family!r}; choose one of "
                         f"{sorted(CHAT_FORMATS)}") from None
    return cls(tokenizer, **options)


__all__ = ["CHAT_FORMATS", "make_chat_format"]

"""Text that is content, not markup: safe to tokenize whatever it holds.

Tool results, tasks, user messages, schemas, hints, files and bank experiences are *content*
(outside text): a structural string in them (``<|im_end|>``, ``<|im_start|>``, but also the
non-special added tokens ``<tool_call>``, ``</tool_response>``, ``<think>``,
``<function_calls>``, FIM tags...) must stay ordinary text, never become the tokenizer's id for
it, and a lone surrogate (e.g. a tool echoing the JSON escape ``"\\udcff"``) must not stop the
tokenizer. :func:`control_tokens` lists every added token that is not plain text (special or
not); :func:`content_ids` encodes content with none of them matched; :func:`clean_text`
escapes what UTF-8 cannot hold.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

__all__ = ["clean_text", "content_ids", "control_tokens", "plain_text_token"]


def clean_text(text: str) -> str:
    """``text`` with every lone surrogate written as its backslash escape (``\\udcff``), so
    it is valid UTF-8; text that already is comes back unchanged (the same object)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def plain_text_token(token: Any) -> bool:
    """Whether an added token (a ``tokenizers.AddedToken``) is plain text rather than
    structure: a non-special token made of whitespace only (Gemma-style ``"\\n\\n"`` runs),
    which outside text may keep as its id, as the tokenizer's own encoding does."""
    return not getattr(token, "special", False) and token.content.isspace()


def control_tokens(tokenizer: Any) -> tuple[str, ...]:
    """Every added token of ``tokenizer`` that is not plain text (:func:`plain_text_token`):
    special-flagged or not (Qwen3's ``<tool_call>`` and ``<think>``, its FIM tags, Olmo-3's
    ``<function_calls>``, latent placeholders), plus its named special tokens; longest first."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {t.content for t in added.values() if t.content and not plain_text_token(t)}
    found |= {t for t in getattr(tokenizer, "all_special_tokens", ()) if t}
    return tuple(sorted(found, key=lambda s: (-len(s), s)))


def content_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of content ``text`` (no BOS/EOS): every control string in it
    (:func:`control_tokens`) is encoded as ordinary text pieces, never as its added id; lone
    surrogates are escaped (:func:`clean_text`). Text without control strings encodes as
    ``tokenizer.encode(text, add_special_tokens=False)`` does."""
    return _content_encoder(tokenizer)(clean_text(text))


_ENCODERS: "weakref.WeakKeyDictionary[Any, tuple[int, Callable[[str], list[int]]]]" = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()


def _content_encoder(tokenizer: Any) -> Callable[[str], list[int]]:
    """The content encoder of ``tokenizer``, built once per tokenizer (again if tokens are added)."""
    size = len(tokenizer)
    cached = _ENCODERS.get(tokenizer)
    if cached is not None and cached[0] == size:
        return cached[1]
    with _ENCODERS_LOCK:
        cached = _ENCODERS.get(tokenizer)
        if cached is None or cached[0] != size:
            cached = (size, _build_content_encoder(tokenizer, control_tokens(tokenizer)))
            _ENCODERS[tokenizer] = cached
        return cached[1]


def _build_content_encoder(tokenizer: Any, control: tuple[str, ...]) -> Callable[[str], list[int]]:
    """A fast tokenizer's pipeline copied with every control token flagged special and
    special-token matching off: ``split_special_tokens`` extended to the non-special
    structural tokens, which ``transformers`` alone would still match. Tokenizers without a
    ``tokenizers`` backend already match no added token at all under ``split_special_tokens``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        encode = lambda s: list(tokenizer.encode(s, add_special_tokens=False, split_special_tokens=True))  # noqa: E731
    else:
        copy = _pipeline_copy(backend, set(control))
        copy.encode_special_tokens = True
        encode = lambda s: list(copy.encode(s, add_special_tokens=False).ids)  # noqa: E731
    _check_neutral(tokenizer, control, encode)
    return encode


def _pipeline_copy(backend: Any, control: set[str]) -> Any:
    """A ``tokenizers.Tokenizer`` with ``backend``'s model, normalizer and pre-tokenizer and its
    added tokens re-added in id order (as loading a ``tokenizer.json`` does), those in
    ``control`` flagged special; the model is shared, so the copy costs no time or memory."""
    from tokenizers import AddedToken  # the fast tokenizer's own library

    added = sorted(backend.get_added_tokens_decoder().items())
    copy = type(backend)(backend.model)
    for part in ("normalizer", "pre_tokenizer"):
        if getattr(backend, part) is not None:
            setattr(copy, part, getattr(backend, part))
    for _, t in added:
        special = t.special or t.content in control
        token = AddedToken(t.content, special=special, lstrip=t.lstrip, rstrip=t.rstrip,
                           normalized=t.normalized, single_word=t.single_word)
        (copy.add_special_tokens if special else copy.add_tokens)([token])
    moved = [(t.content, i, copy.token_to_id(t.content)) for i, t in added if copy.token_to_id(t.content) != i]
    if moved:  # loading a tokenizer.json re-adds its tokens the same way, so this is not expected
        raise RuntimeError(f"copying {type(backend).__name__}'s pipeline moved added tokens (content, id, new id): "
                           f"{moved[:5]}; report this tokenizer")
    return copy


def _check_neutral(tokenizer: Any, control: tuple[str, ...], encode: Callable[[str], list[int]]) -> None:
    """Raise if the model itself spells a control token from its plain text (then no
    encoding of outside text can keep that token's id out)."""
    ids = {int(i): t for t in control for i in [tokenizer.convert_tokens_to_ids(t)] if i is not None}
    leaks = sorted({ids[i] for t in control for i in encode(t) if i in ids})
    if leaks:
        raise ValueError(
            f"tokenizer {type(tokenizer).__name__} encodes the added token(s) {leaks} from their plain text, "
            "so outside text holding them would become structure. Fix: remove those strings from the "
            "tokenizer's BPE merges / vocabulary (only the added token should map to that id).")

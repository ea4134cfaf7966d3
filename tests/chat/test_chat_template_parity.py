"""The reconstructed Qwen3 chat template renders exactly as the official one (release parity
item 12), and checkpoint runs render prompts through the tokenizer's own template.

tests/fixtures/qwen3_official_chat_template.jinja is the ``chat_template`` of Qwen3's
hybrid-thinking checkpoints (Qwen/Qwen3-0.6B ... 8B ``tokenizer_config.json``, first
release). Both templates are rendered by transformers' jinja (``apply_chat_template``) on
tool-use conversations, with thinking on and off, with and without the generation prompt.
"""

from pathlib import Path

import pytest

from lopd_jax.chat.qwen3 import Qwen3ChatFormat
from lopd_jax.chat.templates import QWEN3_CHAT_TEMPLATE
from lopd_jax.chat.tokenizers import qwen3_tokenizer
from tests.chat.test_chat import OBS1, OBS2, QWEN_GEN, SYSTEM, TOOLS, USER
from tests.paths import FIXTURES

OFFICIAL = (Path(FIXTURES) / "qwen3_official_chat_template.jinja").read_text()


def _assistant(text):
    """An assistant message from generated text (tool calls split out, content a string)."""
    fmt_text, _, _ = text.partition("<tool_call>")
    calls = []
    for block in text.split("<tool_call>\n")[1:]:
        import json
        call = json.loads(block.split("\n</tool_call>")[0])
        calls.append({"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}})
    msg = {"role": "assistant", "content": fmt_text.rstrip("\n")}
    if calls:
        msg["tool_calls"] = calls
    return msg


CONVERSATIONS = {
    "prompt": [SYSTEM, USER],
    "no_system": [USER],
    "tool_turns": [SYSTEM, USER, _assistant(QWEN_GEN[0]), *OBS1, _assistant(QWEN_GEN[1]), *OBS2],
    "finished": [SYSTEM, USER, _assistant(QWEN_GEN[0]), *OBS1, _assistant(QWEN_GEN[1]), *OBS2,
                 _assistant(QWEN_GEN[2])],
    "reasoning_field": [USER, {"role": "assistant", "content": "Checking.", "reasoning_content": "Two cities.",
                               "tool_calls": _assistant(QWEN_GEN[1])["tool_calls"]}, *OBS2],
    "second_query": [SYSTEM, USER, _assistant(QWEN_GEN[2]), {"role": "user", "content": "And Berlin?"}],
}


@pytest.fixture(scope="module")
def tok():
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def fmt(tok):
    return Qwen3ChatFormat(tok)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_reconstructed_template_renders_as_official(tok, fmt, name):
    msgs = CONVERSATIONS[name]
    finished = name == "finished"
    for thinking in (True, False):
        for tools in (TOOLS, None):
            kw = dict(tools=tools, tokenize=False, add_generation_prompt=not finished, enable_thinking=thinking)
            official = tok.apply_chat_template(msgs, chat_template=OFFICIAL, **kw)
            ours = tok.apply_chat_template(msgs, chat_template=QWEN3_CHAT_TEMPLATE, **kw)
            assert ours == official, (thinking, tools is not None)
            assert fmt.render(msgs, tools, add_generation_prompt=not finished, enable_thinking=thinking) == official
            if not finished:
                assert official.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))


def test_checkpoint_template_prompts(tok, fmt):
    """A checkpoint run renders prompts with the tokenizer's own template (here: the official one)."""
    saved = tok.chat_template
    try:
        tok.chat_template = OFFICIAL
        ckpt = Qwen3ChatFormat(tok, use_tokenizer_template=True)
        msgs = CONVERSATIONS["prompt"]
        for thinking in (True, False):
            ids = ckpt.prompt_ids(msgs, TOOLS, enable_thinking=thinking)
            text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True,
                                           enable_thinking=thinking)
            assert ids == tok.encode(text, add_special_tokens=False)
            assert ids == fmt.prompt_ids(msgs, TOOLS, enable_thinking=thinking)
        tok.chat_template = OFFICIAL.replace("# Tools", "# Functions")  # another checkpoint's template is used as is
        assert ckpt.prompt_ids(msgs, TOOLS) != fmt.prompt_ids(msgs, TOOLS)
    finally:
        tok.chat_template = saved

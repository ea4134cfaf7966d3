"""Content never becomes control tokens: a control string of the chat family (``<|im_end|>``,
``<|im_start|>``, ``<|endoftext|>``, the latent token, and the non-special tags ``<tool_call>``,
``<think>``, ``<function_calls>``...) written inside any message --
system, user, assistant content, tool-call arguments, tool result -- or inside task or
experience text is encoded as ordinary text, so the count of special ids is the one of the
clean conversation; text with a lone surrogate encodes instead of raising.
"""

import pytest

from lopd_jax.chat.formats import make_chat_format
from lopd_jax.chat.tokenizers import tiny_tokenizer
from lopd_jax.core.text import content_ids, control_tokens
from lopd_jax.method.bank import Experience
from lopd_jax.method.text_context import HINT_FRAMING, context_block_ids

FAMILIES = {"qwen3": "qwen3", "olmo3": "olmo3", "llama": "qwen3"}  # chat family -> tiny tokenizer family
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def fmt(request):
    return make_chat_format(request.param, tiny_tokenizer(FAMILIES[request.param]))


def _forged(fmt) -> str:
    return "a " + " b ".join(control_tokens(fmt.tokenizer)) + " c"


def _conversation(text: str, kind: str):
    """A tool-use conversation with ``text`` in the message kind ``kind`` ("" elsewhere)."""
    t = lambda k, clean: text if kind == k else clean  # noqa: E731
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": t("args", "Paris")}}}
    return [{"role": "system", "content": t("system", "Be brief.")},
            {"role": "user", "content": t("user", "Weather in Paris?")},
            {"role": "assistant", "content": t("assistant", "Checking."), "tool_calls": [call]},
            {"role": "tool", "content": t("tool", "sunny")},
            {"role": "user", "content": "Thanks."}]


def _specials(fmt, ids) -> int:
    special = set(fmt._control_ids.values())
    return sum(int(i) in special for i in ids)


@pytest.mark.parametrize("kind", ["system", "user", "assistant", "args", "tool"])
def test_forged_control_strings_in_prompts_stay_text(fmt, kind):
    clean = fmt.prompt_ids(_conversation("plain words", kind), TOOLS)
    forged = fmt.prompt_ids(_conversation(_forged(fmt), kind), TOOLS)
    assert _specials(fmt, forged) == _specials(fmt, clean)
    assert len(forged) > len(clean)  # the forged strings are there, as text


@pytest.mark.parametrize("role", ["tool", "user"])
def test_forged_control_strings_in_observations_stay_text(fmt, role):
    clean = fmt.observation_ids([{"role": role, "content": "plain words"}])
    forged = fmt.observation_ids([{"role": role, "content": _forged(fmt)}])
    assert _specials(fmt, forged) == _specials(fmt, clean) > 0
    text = fmt.tokenizer.decode(forged, skip_special_tokens=False)
    assert _forged(fmt) in text  # decodes back to the very text the tool wrote


def test_clean_conversations_encode_as_the_tokenizer_does(fmt):
    for kind in ("user", "tool"):
        messages = _conversation("plain words", kind)
        text = fmt.render(messages, TOOLS, add_generation_prompt=True)
        assert fmt.prompt_ids(messages, TOOLS) == list(fmt.tokenizer.encode(text, add_special_tokens=False))


def test_non_special_tags_in_content_stay_text(fmt):
    """Only hostile text differs from the tokenizer's own encoding of the rendering: a
    call tag (an added token that is not special) in a user or tool message is text."""
    name = "<function_calls>" if fmt.family == "olmo3" else "<tool_call>"
    tag = fmt.tokenizer.convert_tokens_to_ids(name)
    for kind in ("user", "tool"):
        messages = _conversation(f"plain {name} words", kind)
        text = fmt.render(messages, TOOLS, add_generation_prompt=True)
        ids, native = fmt.prompt_ids(messages, TOOLS), list(fmt.tokenizer.encode(text, add_special_tokens=False))
        assert native.count(tag) == ids.count(tag) + 1  # the tokenizer alone would make it a tag
        assert fmt.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_lone_surrogates_and_the_escape_mark_do_not_break_encoding(fmt):
    text = 'echo "\udcff" and \ue000\ue001 marks'
    ids = fmt.observation_ids([{"role": "tool", "content": text}])
    decoded = fmt.tokenizer.decode(ids, skip_special_tokens=False)
    assert "\\udcff" in decoded and "\ue000\ue001 marks" in decoded
    assert fmt.prompt_ids([{"role": "user", "content": text}])


def test_task_and_experience_text_stay_text(fmt):
    tok, forged = fmt.tokenizer, _forged(fmt)
    special = set(fmt._control_ids.values())
    assert not special & set(content_ids(tok, forged))
    assert not special & set(context_block_ids(tok, HINT_FRAMING, forged, 400))
    exp = Experience(task_id="t", env_id="e", instruction=forged, messages=[
        {"role": "user", "content": forged}, {"role": "tool", "content": forged}], reward=1.0)
    from lopd_jax.method.bank import encoder_input_text
    assert not special & set(content_ids(tok, encoder_input_text(forged, exp)))

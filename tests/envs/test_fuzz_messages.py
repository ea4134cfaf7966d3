"""Seeded fuzz: malformed assistant messages through the rollout's host pipeline.

Each message is tokenized with a tiny Qwen3 or Olmo-3 tokenizer and goes exactly where a
generated turn goes in ``lopd_jax/rollout/episodes.py``: ``fmt.parse_generated(ids)`` ->
``env.step(turn)`` -> ``fmt.observation_ids(result.observation)`` (or ``env.reset`` of the
next task when the episode ended). Over the synthetic, BFCL, EnvScaler and code
environments no step may raise, and every step must finish within 5 s. The messages mix
deep nesting, numbers beyond Python's 4,300-digit limit, hex / binary literals, huge
arguments, unclosed / stray / nested tags, wrong argument types, random token ids and a
few programs, plus BFCL calls that used to hang (``square_root(precision=1e9)``).
"""

import os
import random
import time

import pytest

from lopd_jax.chat.olmo3 import Olmo3ChatFormat
from lopd_jax.chat.qwen3 import Qwen3ChatFormat
from lopd_jax.envs.code.env import HumanEvalTaskSource
from lopd_jax.envs.envscaler import EnvScalerTaskSource
from lopd_jax.envs.code.sandbox import SandboxConfig
from lopd_jax.envs.synthetic.env import SyntheticTaskSource
from lopd_jax.chat.tokenizers import tiny_tokenizer
from tests.paths import FIXTURES

MESSAGES = {"synthetic": 570, "bfcl": 320, "envscaler": 110, "code": 100}
STEP_LIMIT_S = 5.0
MAX_MESSAGE_CHARS = 100_000  # ~25k tokens: a generation cap; longer texts only time decode
ENVSCALER_FIX = os.path.join(FIXTURES, "envscaler")

_NAMES = ["deposit", "withdraw", "transfer", "get_balance", "ls", "cd", "mv", "post_tweet",
          "square_root", "power", "add", "get_book", "checkout_book", "set_temperature",
          "", " ", "x" * 300, "__init__", "_load_scenario", "a.b.c", "名前", "\u0000"]
_SCALARS = [None, True, False, 0, -1, 1.5, float("nan"), "", "x", "é", [], {}, [1, "a"],
            {"k": [None]}, 10 ** 30]


def _value(rng: random.Random) -> str:
    """A JSON-ish value text, often hostile."""
    kind = rng.randrange(12)
    if kind == 0:
        d = rng.choice([40, 200, 1000, 3000])
        return "[" * d + "]" * d
    if kind == 1:
        return "9" * rng.choice([101, 4301, 6000])
    if kind == 2:
        return "-" + "1" * 5000 + ".5e3"
    if kind == 3:
        return rng.choice(["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1e-999"])
    if kind == 4:
        return '"' + "y" * rng.choice([10, 66000]) + '"'
    if kind == 5:
        return '{"a": ' * 50 + "1" + "}" * 50
    if kind == 6:
        return '"\\ud800"'
    return repr(rng.choice(_SCALARS)).replace("'", '"').replace("None", "null") \
        .replace("True", "true").replace("False", "false").replace("nan", "NaN")


def _python_value(rng: random.Random) -> str:
    """An Olmo-3 call argument text, often hostile."""
    return rng.choice([
        "0x" + "f" * 5000, "0b" + "1" * 3000, "0o" + "7" * 2000, "9" * 5000,
        "(" * 300 + "1" + ")" * 300, "[" * 150 + "]" * 150, "lambda: 0", "__import__('os')",
        "f'{1}'", "{1: 2}", "{**{}}", "1j", "b'x'", "...", "not True", "-(-1)", "[*x]",
        "'" + "z" * 66000 + "'", "x := 1", "[i for i in range(10**9)]", "10**10**10",
        _value(rng)])


def _qwen_message(rng: random.Random, names: list[str]) -> str:
    name = rng.choice(names + _NAMES)
    kind = rng.randrange(14)
    if kind == 0:
        return "<tool_call>" + _value(rng) + "</tool_call>"
    if kind == 1:
        return '<tool_call>{"name": "' + name + '", "arguments": ' + _value(rng) + "}</tool_call>"
    if kind == 2:
        return '<tool_call>{"name": "' + name + '", "arguments": {"amount": ' + _value(rng) \
            + ', "account": ' + _value(rng) + "}}</tool_call>"
    if kind == 3:
        return "<tool_call>" + '{"name": "' + name + '"'  # unclosed
    if kind == 4:
        return "</tool_call>" * rng.randrange(1, 4) + "stray" + "<tool_call>" * 2
    if kind == 5:
        return "<think>" + "<tool_call>" * 3 + "hmm</think><tool_call>{}</tool_call>"
    if kind == 6:
        n = rng.choice([70, 300])
        return "".join('<tool_call>{"name": "%s", "arguments": {}}</tool_call>' % name
                       for _ in range(n))
    if kind == 7:
        return '<tool_call>{"name": ' + _value(rng) + ', "arguments": {}}</tool_call>'
    if kind == 8:
        return '<tool_call>{"name": "square_root", "arguments": {"number": 1e9, ' \
               '"precision": ' + rng.choice(["1000000000", "1e9", "99999999"]) + "}}</tool_call>"
    if kind == 9:
        return '<tool_call>{"name": "power", "arguments": {"base": 10, "exponent": 10000000}}' \
               "</tool_call>"
    if kind == 10:
        return "".join(rng.choice("{}[]\":,<>/tool_call\\ \n") for _ in range(rng.randrange(1, 400)))
    if kind == 11:
        return "Done." if rng.random() < 0.5 else ""
    return '<tool_call>{"name": "' + name + '", "arguments": {"' + rng.choice(
        ["account", "amount", "src", "x", ""]) + '": ' + _value(rng) + "}}</tool_call>"


def _olmo_message(rng: random.Random, names: list[str]) -> str:
    name = rng.choice(names + ["f", "a.b", "1x", "print"])
    kind = rng.randrange(10)
    if kind == 0:
        return f"<function_calls>{name}(x={_python_value(rng)})</function_calls>"
    if kind == 1:
        return f"<function_calls>{name}({_python_value(rng)})</function_calls>"
    if kind == 2:
        return "<function_calls>" + _value(rng) + "</function_calls>"
    if kind == 3:
        return "<function_calls>" + "\n".join(
            f"{name}(amount={_python_value(rng)})" for _ in range(rng.randrange(1, 80))) \
            + "</function_calls>"
    if kind == 4:
        return "<function_calls>square_root(number=1e9, precision=1000000000)</function_calls>"
    if kind == 5:
        return f"<function_calls>{name}(**{{}}) ; import os; os._exit(1)</function_calls>"
    if kind == 6:
        return "<function_calls>" + "(" * 5000 + "</function_calls>"
    if kind == 7:
        return "<function_calls>" + name + "(" + ", ".join(
            f"k{i}=1" for i in range(3000)) + ")</function_calls>"
    if kind == 8:
        return "</function_calls><function_calls><function_calls>x(</function_calls>"
    return "All done." if rng.random() < 0.5 else ""


def _code_message(rng: random.Random) -> str:
    if rng.random() < 0.92:  # parse-level junk: fails before any code runs
        return rng.choice(["<tool_call>" + _value(rng) + "</tool_call>",
                           "<function_calls>f(x=0x" + "f" * 4000 + ")</function_calls>",
                           "no code here", "``` python", "```\n   \n```", "<think>```"])
    return "```python\n" + rng.choice([
        "def has_close_elements(numbers, threshold):\n    return 10 ** 100000\n",
        "import os\nos._exit(0)\n", "while True:\n    pass\n",
        "def has_close_elements(numbers, threshold):\n    return [[[]]] * 10**6\n",
        "x = " + "[" * 500 + "]" * 500 + "\n", "print('LOPD_RESULTS {}')\n"]) + "```"


_ENCODED: dict[tuple[int, str], list[int]] = {}


def _encode(fmt, text: str) -> list[int]:
    """Ids of ``text``, tokenized in 1,000-character chunks (cached: the long runs repeat).

    Concatenated chunk ids decode to exactly ``text`` (byte-level BPE), which is all the
    pipeline sees; a sampler may emit any such id sequence.
    """
    ids: list[int] = []
    for i in range(0, len(text), 1000):
        key = (id(fmt), text[i:i + 1000])
        if key not in _ENCODED:
            _ENCODED[key] = fmt.encode(key[1])
        ids += _ENCODED[key]
    return ids


def _random_ids(rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randrange(1, 300))]


@pytest.fixture(scope="module")
def formats():
    return [Qwen3ChatFormat(tiny_tokenizer("qwen3")), Olmo3ChatFormat(tiny_tokenizer("olmo3"))]


def _sources():
    out = {"synthetic": SyntheticTaskSource(n_train_per_family=2, n_heldout_per_family=1),
           "envscaler": EnvScalerTaskSource(
               os.path.join(ENVSCALER_FIX, "train.json"),
               env_items_path=os.path.join(ENVSCALER_FIX, "env_items.json"),
               call_timeout_s=1.0, start_timeout_s=4.0, score_timeout_s=2.0),
           "code": HumanEvalTaskSource(sandbox=SandboxConfig(timeout_s=1.5))}
    try:
        from lopd_jax.envs.bfcl.env import BFCLTaskSource

        out["bfcl"] = BFCLTaskSource(["base", "miss_func"], limit=4)
    except ImportError:
        pass
    return out


def test_malformed_messages_never_crash_and_every_step_is_fast(formats):
    rng = random.Random(1234)
    sources = _sources()
    plan = dict(MESSAGES)
    if "bfcl" not in sources:  # bfcl-eval is optional: its share goes to the synthetic env
        plan["synthetic"] += plan.pop("bfcl")
    total, crashes, slowest, resets = 0, [], (0.0, ""), 0
    start, per_env = time.monotonic(), {}
    for env_id, n in plan.items():
        env_start = time.monotonic()
        source = sources[env_id]
        tasks = source.tasks("train") or source.tasks("heldout")
        env = None
        for i in range(n):
            fmt = formats[i % 2]
            if env is None or env.done:
                if env is not None:
                    env.close()
                env = source.make_env()
                if env_id == "bfcl":  # short limits keep the test fast; defaults 2 s / 3 s
                    env.call_timeout_s, env.step_timeout_s = 0.3, 0.6
                if env_id == "code":
                    env.per_test_s = 1
                _, tools = env.reset(tasks[resets % len(tasks)])
                resets += 1
                names = [t["function"]["name"] for t in tools]
            if env_id == "code":
                text = _code_message(rng)
            elif isinstance(fmt, Qwen3ChatFormat):
                text = _qwen_message(rng, names)
            else:
                text = _olmo_message(rng, names)
            text = text[:MAX_MESSAGE_CHARS]
            try:
                ids = (_random_ids(rng, len(fmt.tokenizer)) if rng.random() < 0.08
                       else _encode(fmt, text.encode("utf-8", "replace").decode("utf-8")))
            except Exception:  # the tokenizer, not the pipeline: regenerate as random ids
                ids = _random_ids(rng, len(fmt.tokenizer))
            ids = ids + [fmt.end_of_turn_id]
            t0 = time.monotonic()
            try:
                turn = fmt.parse_generated(ids)
                result = env.step(turn)
                if not result.done and result.observation:
                    fmt.observation_ids(result.observation)
            except Exception as e:  # noqa: BLE001 - exactly what the test counts
                crashes.append((env_id, type(e).__name__, str(e)[:200], text[:120]))
                env.close()
                env = None
            dt = time.monotonic() - t0
            total += 1
            if dt > slowest[0]:
                slowest = (dt, f"{env_id}: {text[:80]!r}")
        if env is not None:
            env.close()
        per_env[env_id] = round(time.monotonic() - env_start, 1)
    elapsed = time.monotonic() - start
    print(f"\nfuzz: {total} messages over {sorted(plan)}, {len(crashes)} crashes, "
          f"slowest step {slowest[0]:.2f} s ({slowest[1]}), {resets} episodes, "
          f"{elapsed:.1f} s in all {per_env}")
    assert total >= 1000
    assert crashes == []
    assert slowest[0] < STEP_LIMIT_S, slowest


def test_parse_errors_name_the_limits(formats):
    """The issue's crashing inputs become parse errors that name the limit they hit, and a
    ToolCall built elsewhere with an over-limit argument is an error observation."""
    qwen, olmo = formats
    cases = [
        (qwen, "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>", "MAX_JSON_DEPTH=32"),
        (qwen, '<tool_call>{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>",
         "MAX_NUMBER_DIGITS=100"),
        (olmo, "<function_calls>f(x=0x" + "f" * 5000 + ")</function_calls>",
         "MAX_NUMBER_DIGITS=100"),
        (olmo, "<function_calls>f(x=0b" + "1" * 400 + ")</function_calls>",
         "MAX_NUMBER_DIGITS=100"),
        (olmo, "<function_calls>f(x=" + "[" * 1000 + "]" * 1000 + ")</function_calls>",
         "MAX_JSON_DEPTH=32"),
        (qwen, '<tool_call>{"name": "f", "arguments": {"x": "' + "y" * 70000 + '"}}</tool_call>',
         "MAX_CALL_CHARS=65536"),
        (qwen, '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 70,
         "MAX_CALLS_PER_TURN=64"),
    ]
    for fmt, text, limit in cases:
        turn = fmt.parse_generated(_encode(fmt, text) + [fmt.end_of_turn_id])
        assert any(limit in e for e in turn.parse_errors), (limit, turn.parse_errors[:2])
        assert len(turn.tool_calls) <= 64
    from lopd_jax.envs.base import call_key
    from lopd_jax.core.types import AssistantTurn, ToolCall

    huge = ToolCall("deposit", {"account": "alice", "amount": 10 ** 5000})
    assert call_key(huge).startswith("deposit")
    source = SyntheticTaskSource(n_train_per_family=1, n_heldout_per_family=1)
    env = source.make_env()
    env.reset(source.tasks("train")[0])
    result = env.step(AssistantTurn(raw="", content="", tool_calls=[huge]))
    assert "MAX_NUMBER_DIGITS=100" in result.observation[0]["content"]

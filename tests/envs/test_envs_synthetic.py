"""Synthetic tool-use family, the shared environment API helpers, and the registry."""

import pytest

from lopd_jax.envs import registry
from lopd_jax.envs.base import (EpisodeStats, Toolbox, ToolError, parse_docstring,
                                tool_schema_from_function, validate_arguments)
from lopd_jax.envs.synthetic.env import (SyntheticTaskSource, oracle_calls, oracle_turns,
                                     render_tool_call)
from lopd_jax.envs.synthetic.domains import DOMAINS, FAMILIES, Bank
from lopd_jax.core.types import AssistantTurn, ToolCall


@pytest.fixture(scope="module")
def source():
    return SyntheticTaskSource(n_train_per_family=12, n_heldout_per_family=6, seed=0)


def calls_turn(*calls, parse_errors=()):
    return AssistantTurn(raw="", content="", tool_calls=list(calls),
                         parse_errors=list(parse_errors))


def answer_turn(text):
    return AssistantTurn(raw=text, content=text)


def run(source, task, turns):
    env = source.make_env()
    env.reset(task)
    observations = []
    for turn in turns:
        result = env.step(turn)
        observations += result.observation
        if result.done:
            return result, observations, env
    raise AssertionError("episode did not end")


def first(source, family, split="train"):
    return next(t for t in source.tasks(split) if t.family == family)


def test_oracle_gets_full_reward_on_both_splits_of_every_family(source):
    seen_domains = set()
    for split in ("train", "heldout"):
        tasks = source.tasks(split)
        assert {t.family for t in tasks} == set(FAMILIES)
        for task in tasks:
            result, obs, env = run(source, task, oracle_turns(task))
            assert result.reward == 1.0, (task.task_id, env.check_results())
            assert not any(o["content"].startswith("Error") for o in obs), obs
            assert all(o["role"] == "tool" for o in obs)
            stats = result.info["stats"]
            assert stats["errors"] == 0 and stats["tool_calls"] == len(oracle_calls(task)[0])
            assert 1 <= stats["tool_calls"] <= 3
            seen_domains.add(task.payload["domain"])
    assert seen_domains == set(DOMAINS)


def test_splits_are_disjoint_and_generation_is_deterministic(source):
    train, heldout = source.tasks("train"), source.tasks("heldout")
    assert len(train) == 12 * len(FAMILIES) and len(heldout) == 6 * len(FAMILIES)
    assert not {t.instruction for t in train} & {t.instruction for t in heldout}
    assert len({t.task_id for t in train + heldout}) == len(train) + len(heldout)
    again = SyntheticTaskSource(n_train_per_family=12, n_heldout_per_family=6, seed=0)
    assert [(t.task_id, t.instruction, t.payload) for t in again.tasks("train")] == \
        [(t.task_id, t.instruction, t.payload) for t in train]
    # A smaller request is a prefix of a larger one (stable task lists).
    small = SyntheticTaskSource(n_train_per_family=4, n_heldout_per_family=2, seed=0)
    fam = "bank.transfer_report"
    assert [t.payload for t in small.tasks("train") if t.family == fam] == \
        [t.payload for t in train if t.family == fam][:4]
    other = SyntheticTaskSource(n_train_per_family=12, n_heldout_per_family=6, seed=1)
    assert [t.instruction for t in other.tasks("train")] != [t.instruction for t in train]
    # Same task, same turns -> same messages, observations and reward.
    task = first(source, "hotel.free_on_floor")
    env_a, env_b = source.make_env(), source.make_env()
    assert env_a.reset(task) == env_b.reset(task)
    runs = [run(source, task, oracle_turns(task))[:2] for _ in range(2)]
    assert runs[0][0].reward == runs[1][0].reward and runs[0][1] == runs[1][1]


def test_wrong_policies_get_the_expected_partial_reward(source):
    t = first(source, "bank.transfer_report")
    calls, _ = oracle_calls(t)
    result, _, _ = run(source, t, [calls_turn(c) for c in calls] + [answer_turn("Done.")])
    assert result.reward == pytest.approx(3 / 4)  # balances right, answer lacks the number

    t = first(source, "bank.deposit")
    p = t.payload["params"]
    wrong = ToolCall("deposit", {"account": p["account"], "amount": p["amount"] + 10})
    result, _, _ = run(source, t, [calls_turn(wrong), answer_turn("Done.")])
    assert result.reward == 0.0  # wrong balance: no goal check passes ("nothing else changed" is a guard)
    result, _, _ = run(source, t, [answer_turn("I will not.")])
    assert result.reward == 0.0

    t = first(source, "hotel.move_guest")
    p = t.payload["params"]
    book_only = ToolCall("book_room", {"room": p["to_room"], "guest": p["guest"]})
    result, _, env = run(source, t, [calls_turn(book_only), answer_turn("Done.")])
    assert result.reward == pytest.approx(2 / 3)  # old room still held
    assert [ok for _, ok in env.check_results()] == [False, True, True]

    t = first(source, "shop.restock_two")
    p = t.payload["params"]
    one = ToolCall("restock", {"item": p["item1"], "quantity": p["quantity1"]})
    result, _, _ = run(source, t, [calls_turn(one), answer_turn("Done.")])
    assert result.reward == pytest.approx(2 / 3)


def test_no_tool_policy_scores_zero_and_conditional_no_ops_need_the_lookup(source):
    for split in ("train", "heldout"):
        for t in source.tasks(split):
            result, _, _ = run(source, t, [answer_turn("Done.")])
            assert result.reward == 0.0, t.task_id
            # reading the state only is not progress either
            env = source.make_env()
            env.reset(t)
            reads = [c for c in oracle_calls(t)[0] if c.name in ("get_balance", "check_stock", "list_free_rooms")]
            for c in reads:
                env.step(calls_turn(c))
            p = t.payload["params"]
            noop_right = (t.family == "bank.withdraw_if_enough" and p["initial"][p["account"]] < p["amount"]) or (
                t.family == "shop.restock_below" and p["initial"][p["item"]] >= p["threshold"])
            reward = env.step(answer_turn(oracle_calls(t)[1])).reward
            assert reward == (1.0 if noop_right else 0.0) or t.family in (
                "bank.transfer_report", "shop.sell_report", "hotel.free_on_floor"), (t.task_id, reward)
    from lopd_jax.method.eval_stats import no_tool_baseline

    assert no_tool_baseline(source.make_env, source.tasks("heldout")) == 0.0
    with pytest.raises(ValueError, match="at least one task"):
        no_tool_baseline(source.make_env, [])
    # a withdraw attempt that fails inside the tool also looks the balance up
    t = next(t for t in source.tasks("train") if t.family == "bank.withdraw_if_enough"
             and t.payload["params"]["initial"][t.payload["params"]["account"]] < t.payload["params"]["amount"])
    p = t.payload["params"]
    result, _, env = run(source, t, [calls_turn(ToolCall("withdraw", {"account": p["account"], "amount": p["amount"]})),
                                     answer_turn("Not enough.")])
    assert result.reward == 1.0 and env.check_results()[-1] == (f"looked up {p['account']}'s balance", True)


def test_finish_scores_the_current_state(source):
    t = first(source, "bank.transfer_report")
    env = source.make_env()
    env.reset(t)
    for c in oracle_calls(t)[0]:
        assert not env.step(calls_turn(c)).done
    assert env.finish() == pytest.approx(3 / 4)  # no answer was given
    with pytest.raises(RuntimeError, match="after the episode ended"):
        env.step(answer_turn("late"))


def test_malformed_unknown_and_bad_calls_give_error_observations(source):
    t = first(source, "bank.deposit")
    p = t.payload["params"]
    acct = p["account"]
    env = source.make_env()
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(answer_turn("hi"))
    env.reset(t)
    bad = [
        ToolCall("launch_rocket", {}),                                  # unknown tool
        ToolCall("deposit", {"account": acct}),                         # missing argument
        ToolCall("deposit", {"account": acct, "amount": 5, "memo": 1}),  # unknown argument
        ToolCall("deposit", {"account": acct, "amount": "5"}),          # wrong type
        ToolCall("deposit", {"account": acct, "amount": True}),         # bool is not int
        ToolCall("deposit", {"account": "zed", "amount": 5}),           # tool raises ToolError
        ToolCall("withdraw", {"account": acct, "amount": 10**6}),       # insufficient funds
        ToolCall("deposit", ["not", "a", "dict"]),                      # non-object arguments
        ToolCall("deposit", {"account": acct, "amount": -5}),           # invalid value
    ]
    result = env.step(calls_turn(*bad, parse_errors=["unterminated JSON object"]))
    assert not result.done
    contents = [o["content"] for o in result.observation]
    assert len(contents) == len(bad) + 1
    assert all(c.startswith("Error: ") for c in contents), contents
    assert "malformed tool call: unterminated JSON" in contents[0]
    assert "unknown tool 'launch_rocket'" in contents[1] and "deposit" in contents[1]
    assert "missing required argument(s) ['amount']" in contents[2]
    assert "unknown argument(s) ['memo']" in contents[3]
    assert "must be of type integer, got str" in contents[4]
    assert "must be of type integer, got bool" in contents[5]
    assert "no account named 'zed'" in contents[6]
    assert "has only" in contents[7]
    assert "must be a JSON object" in contents[8]
    assert "positive" in contents[9]
    stats = result.info["stats"]
    assert stats == {**stats, "errors": 10, "parse_errors": 1, "unknown_tools": 1,
                     "invalid_arguments": 5, "tool_exceptions": 3, "tool_calls": 9}
    # State untouched by all of that: the oracle still earns full reward afterwards.
    for turn in oracle_turns(t):
        result = env.step(turn)
    assert result.done and result.reward == 1.0
    assert result.info["stats"]["turns"] == 3


def test_repeated_identical_calls_are_counted(source):
    t = first(source, "shop.sell_report")
    env = source.make_env()
    env.reset(t)
    check = ToolCall("check_stock", {"item": t.payload["params"]["item"]})
    env.step(calls_turn(check, check))
    result = env.step(calls_turn(check))
    assert result.info["stats"]["repeated_calls"] == 2
    assert result.observation[0]["content"] == str(t.payload["params"]["initial"][
        t.payload["params"]["item"]])
    env.reset(t)
    assert env.stats == EpisodeStats()


def test_schemas_from_signatures_and_docstrings():
    schemas = {s["function"]["name"]: s["function"] for s in Toolbox(Bank({"a": 1})).schemas}
    assert sorted(schemas) == ["deposit", "get_balance", "transfer", "withdraw"]
    tr = schemas["transfer"]
    assert tr["description"] == "Move money from one account to another."
    assert tr["parameters"]["required"] == ["source", "target", "amount"]
    assert tr["parameters"]["properties"]["amount"] == {"type": "integer",
                                                        "description": "how much to move."}

    def f(a: int, b: "list[str]", c: float | None = None, *rest, **extra):
        """Summary line
        continues here.

        Args:
            a (int): first
                and more.
            b: second.

        Returns:
            nothing.
        """

    schema = tool_schema_from_function(f)["function"]
    assert schema["description"] == "Summary line continues here."
    props = schema["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "first and more."}
    assert props["b"] == {"type": "array", "items": {"type": "string"}, "description": "second."}
    assert props["c"] == {"type": ["number", "null"]}
    assert schema["parameters"]["required"] == ["a", "b"]
    assert "additionalProperties" not in schema["parameters"]  # **extra accepts more
    assert parse_docstring(None) == ("", {})
    assert validate_arguments(tool_schema_from_function(f), {"a": 1, "b": ["x"], "z": 0}) is None
    assert "items" not in props["a"]
    err = validate_arguments(tool_schema_from_function(f), {"a": 1, "b": ["x", 2]})
    assert err == "argument 'b'[1] must be of type string, got int 2"
    assert validate_arguments(tool_schema_from_function(f), {"a": 1, "b": [], "c": None}) is None
    enum = {"function": {"name": "g", "parameters": {"properties": {"m": {"enum": ["x", "y"]}}}}}
    assert "must be one of ['x', 'y']" in validate_arguments(enum, {"m": "z"})
    pyish = {"function": {"name": "h", "parameters": {"properties": {"n": {"type": "int"}}}}}
    assert "must be of type integer" in validate_arguments(pyish, {"n": "1"})
    assert validate_arguments(pyish, {"n": 1}) is None


def test_toolbox_call_raises_tool_errors_for_bad_calls():
    box = Toolbox(Bank({"ann": 10}))
    assert box.call("get_balance", {"account": "ann"}) == "10"
    with pytest.raises(ToolError, match="unknown tool 'nope'"):
        box.call("nope", {})
    with pytest.raises(ToolError, match="missing required"):
        box.call("deposit", {"account": "ann"})


def test_oracle_turns_render_qwen_tool_calls(source):
    t = first(source, "hotel.free_on_floor")
    turns = oracle_turns(t)
    assert [len(x.tool_calls) for x in turns] == [1, 1, 0]
    assert turns[0].raw == render_tool_call(turns[0].tool_calls[0])
    assert turns[0].raw.startswith("<tool_call>\n{\"name\": \"list_free_rooms\"")
    assert turns[-1].content == turns[-1].raw and turns[-1].content.startswith("Room ")


def test_bad_configuration_errors_are_clear():
    with pytest.raises(ValueError, match="unknown synthetic family or domain 'space'"):
        SyntheticTaskSource(families=["space"])
    with pytest.raises(ValueError, match="unknown split 'test'"):
        SyntheticTaskSource(n_train_per_family=1).tasks("test")
    only = SyntheticTaskSource(n_train_per_family=2, n_heldout_per_family=1, families=["hotel"])
    assert {t.payload["domain"] for t in only.tasks("train")} == {"hotel"}
    env = only.make_env()
    wrong = only.tasks("train")[0]
    with pytest.raises(ValueError, match="belongs to 'other'"):
        env.reset(type(wrong)(task_id="x", env_id="other", instruction="?"))


def test_registry(monkeypatch):
    src = registry.get_task_source("synthetic", n_train_per_family=2, n_heldout_per_family=1)
    assert isinstance(src, SyntheticTaskSource) and src.env_id == "synthetic"
    assert {"synthetic", "envscaler", "bfcl", "humaneval", "taco"} <= set(
        registry.known_task_sources())
    with pytest.raises(ValueError, match=r"unknown task source 'nope'; known: \[.*'synthetic'"):
        registry.get_task_source("nope")
    monkeypatch.setitem(registry._SOURCES, "ghost", "lopd_jax.envs.no_such_module:Ghost")
    with pytest.raises(ImportError, match="registered as lopd_jax.envs.no_such_module:Ghost"):
        registry.get_task_source("ghost")
    with pytest.raises(ValueError, match="module:ClassName"):
        registry.register_task_source("bad", "no_colon")


def test_schemas_without_descriptions_keep_names_types_and_rewards():
    full = SyntheticTaskSource(n_train_per_family=2, n_heldout_per_family=1, seed=0)
    bare = SyntheticTaskSource(n_train_per_family=2, n_heldout_per_family=1, seed=0, tool_descriptions=False)
    for task in bare.tasks("train"):
        _, tools_full = full.make_env().reset(task)
        _, tools_bare = bare.make_env().reset(task)
        assert "description" not in repr(tools_bare)
        assert len(repr(tools_bare)) < len(repr(tools_full))
        for a, b in zip(tools_full, tools_bare):
            fa, fb = a["function"], b["function"]
            assert fa["name"] == fb["name"]
            assert fa["parameters"]["required"] == fb["parameters"]["required"]
            assert {k: v["type"] for k, v in fa["parameters"]["properties"].items()} == \
                {k: v["type"] for k, v in fb["parameters"]["properties"].items()}
        result, _, _ = run(bare, task, oracle_turns(task))
        assert result.reward == 1.0


# ----------------------------------------------------------------------------- dispatch.ship (opt-in)


@pytest.fixture(scope="module")
def dispatch():
    return SyntheticTaskSource(n_train_per_family=24, n_heldout_per_family=12, seed=0, families=["dispatch"],
                               n_warmup_per_family=40)


def test_dispatch_is_opt_in_and_the_default_families_are_unchanged():
    from lopd_jax.envs.synthetic.domains import ALL_FAMILIES, OPT_IN_FAMILIES

    assert "dispatch.ship" in OPT_IN_FAMILIES and "dispatch.ship" not in FAMILIES
    assert set(ALL_FAMILIES) == set(FAMILIES) | set(OPT_IN_FAMILIES)
    assert SyntheticTaskSource(n_train_per_family=2, n_heldout_per_family=1).families == list(FAMILIES)
    # without separate warm-up tasks the warm-up uses the training tasks
    src = SyntheticTaskSource(n_train_per_family=2, n_heldout_per_family=1)
    assert [t.task_id for t in src.warmup_tasks()] == [t.task_id for t in src.tasks("train")]


def test_dispatch_hidden_rule_is_consistent_across_splits_and_seeded(dispatch):
    from lopd_jax.envs.synthetic.domains import CUSTOMERS, HUBS

    rule = dispatch.hidden_rule("dispatch.ship")
    assert set(rule) == set(CUSTOMERS) and set(rule.values()) == set(HUBS)
    assert all(list(rule.values()).count(h) == len(CUSTOMERS) // len(HUBS) for h in HUBS)  # balanced
    assert dispatch.hidden_rule("bank.deposit") is None
    train, heldout = dispatch.tasks("train"), dispatch.tasks("heldout")
    for t in train + heldout:
        p = t.payload["params"]
        assert p["hub"] == rule[p["customer"]]
        assert p["hub"] not in t.instruction and p["customer"] in t.instruction  # the hub is never stated
    assert not {t.instruction for t in train} & {t.instruction for t in heldout}
    assert {t.payload["params"]["customer"] for t in heldout} <= {t.payload["params"]["customer"] for t in train}
    again = SyntheticTaskSource(n_train_per_family=24, n_heldout_per_family=12, seed=0, families=["dispatch"],
                                n_warmup_per_family=40)
    assert [t.payload for t in again.tasks("train")] == [t.payload for t in train]
    assert [t.payload for t in again.warmup_tasks()] == [t.payload for t in dispatch.warmup_tasks()]
    other = SyntheticTaskSource(n_train_per_family=24, n_heldout_per_family=12, seed=3, families=["dispatch"])
    assert other.hidden_rule("dispatch.ship") != rule


def test_fleet_is_the_dispatch_rule_over_64_customers():
    """``fleet.ship`` (configs/miniature_wide.py): the same tool and hubs, a balanced hidden
    map over 64 customers, the oracle solves every task, and the held-out tasks spread over
    many customer clusters."""
    from lopd_jax.envs.synthetic.domains import FLEET_CUSTOMERS, HUBS

    src = SyntheticTaskSource(n_train_per_family=128, n_heldout_per_family=128, families=["fleet"],
                              tool_descriptions=False, n_warmup_per_family=16)
    assert src.families == ["fleet.ship"] and len(set(FLEET_CUSTOMERS)) == 64
    rule = src.hidden_rule("fleet.ship")
    assert set(rule) == set(FLEET_CUSTOMERS) and all(list(rule.values()).count(h) == 16 for h in HUBS)
    heldout = src.tasks("heldout")
    assert len({src.cluster_key(t) for t in heldout}) >= 48
    for t in heldout[:16] + src.tasks("train")[:16] + src.warmup_tasks():
        p = t.payload["params"]
        result, _, env = run(src, t, oracle_turns(t))
        assert result.reward == 1.0, env.check_results()
        assert p["customer"] in t.instruction and p["hub"] not in t.instruction
    assert all(t.payload["params"]["hub"] == rule[t.payload["params"]["customer"]] for t in heldout)


def test_balanced_heldout_spreads_customers_evenly_and_keeps_the_training_tasks():
    """``balance_heldout``: every customer gets the same number of held-out tasks (the
    unbalanced draw of 16 falls on customers unevenly), the rule still holds, and the
    training tasks are the same as without it, so a prefix's bank and cold start stay valid."""
    from collections import Counter

    kw = dict(n_train_per_family=32, seed=0, families=["dispatch"], tool_descriptions=False)
    plain = SyntheticTaskSource(n_heldout_per_family=16, **kw)
    balanced = SyntheticTaskSource(n_heldout_per_family=64, balance_heldout=True, **kw)
    counts = Counter(balanced.cluster_key(t) for t in balanced.tasks("heldout"))
    assert len(counts) == 8 and set(counts.values()) == {8}
    assert len(set(Counter(plain.cluster_key(t) for t in plain.tasks("heldout")).values())) > 1
    assert [t.payload for t in balanced.tasks("train")] == [t.payload for t in plain.tasks("train")]
    rule = balanced.hidden_rule("dispatch.ship")
    assert all(t.payload["params"]["hub"] == rule[t.payload["params"]["customer"]] for t in balanced.tasks("heldout"))
    uneven = Counter(t.payload["params"]["customer"]
                     for t in SyntheticTaskSource(n_heldout_per_family=12, balance_heldout=True, **kw).tasks("heldout"))
    assert sorted(uneven.values()) == [1] * 4 + [2] * 4  # at most ceil(12 / 8) per customer
    with pytest.raises(ValueError, match="balance_heldout"):
        SyntheticTaskSource(families=["bank"], balance_heldout=True)


def test_smollm2_table_config_differs_from_the_miniature_only_in_its_heldout_set_and_budget(tmp_path):
    """configs/smollm2_table.py shares smollm2_miniature's prefix (training and warm-up tasks,
    map), holds out 8 tasks per customer and trains 128 rollouts per arm."""
    from collections import Counter

    from lopd_jax.envs.registry import get_task_source
    from lopd_jax.programs.train import resolve_config

    table, mini = (resolve_config([f"--config={name}", f"--workdir={tmp_path}"])
                   for name in ("smollm2_table", "smollm2_miniature"))
    src, base = (get_task_source(c.env.source, **c.env.kwargs) for c in (table, mini))
    assert [t.payload for t in src.tasks("train")] == [t.payload for t in base.tasks("train")]
    assert [t.payload for t in src.warmup_tasks()] == [t.payload for t in base.warmup_tasks()]
    assert set(Counter(src.cluster_key(t) for t in src.tasks("heldout")).values()) == {8}
    assert table.stages.eval_tasks == len(src.tasks("heldout")) == 64
    assert table.stages.lopd_steps * table.env.tasks_per_step * table.env.group_size >= 128
    assert (table.model, table.composer, table.steps, table.bank) == (mini.model, mini.composer, mini.steps, mini.bank)


def test_dispatch_warmup_tasks_are_separate_and_their_hub_is_random(dispatch):
    warm = dispatch.warmup_tasks()
    assert len(warm) == 40 and all(t.task_id.startswith("dispatch.ship/warmup/") for t in warm)
    taken = {t.instruction for s in ("train", "heldout") for t in dispatch.tasks(s)}
    assert not {t.instruction for t in warm} & taken
    rule = dispatch.hidden_rule("dispatch.ship")
    off_rule = sum(t.payload["params"]["hub"] != rule[t.payload["params"]["customer"]] for t in warm)
    assert off_rule >= 15  # about 3 in 4 disagree with the rule: the warm-up cannot teach it
    for t in warm:
        result, _, _ = run(dispatch, t, oracle_turns(t))
        assert result.reward == 1.0


def test_dispatch_checks_oracle_and_hint(dispatch):
    from lopd_jax.envs.synthetic.env import oracle_hint
    from lopd_jax.envs.synthetic.domains import HUBS

    for t in dispatch.tasks("train") + dispatch.tasks("heldout"):
        result, obs, env = run(dispatch, t, oracle_turns(t))
        assert result.reward == 1.0 and result.info["stats"]["tool_calls"] == 1, env.check_results()
        p = t.payload["params"]
        hint = oracle_hint(t)
        assert f'"hub": "{p["hub"]}"' in hint and f'"customer": "{p["customer"]}"' in hint
        assert hint.endswith(f'Shipped via "{p["hub"]}".')
        # the wrong hub fails the goal: reward 0 (a guesser is right 1 time in len(HUBS))
        wrong = next(h for h in HUBS if h != p["hub"])
        result, _, env = run(dispatch, t, [calls_turn(ToolCall("ship_order", {"customer": p["customer"],
                                                                              "hub": wrong})), answer_turn("Done.")])
        assert result.reward == 0.0 and [ok for _, ok in env.check_results()] == [False, True]
        # another customer's order: goal fails, guard fails
        other = next(c for c in p["initial"] if c != p["customer"])
        result, _, _ = run(dispatch, t, [calls_turn(ToolCall("ship_order", {"customer": other, "hub": p["hub"]})),
                                         answer_turn("Done.")])
        assert result.reward == 0.0
        result, _, _ = run(dispatch, t, [answer_turn("Done.")])
        assert result.reward == 0.0
    t = dispatch.tasks("train")[0]
    p = t.payload["params"]
    result, obs, _ = run(dispatch, t, [calls_turn(ToolCall("ship_order", {"customer": p["customer"], "hub": "Lima"})),
                                       answer_turn("Done.")])
    assert result.reward == 0.0 and "no hub named" in obs[0]["content"]


def test_calls_only_hint():
    """hint="calls": the oracle hint is the calls alone (the turns hint without its answer
    line), and still solves the task when replayed; an unknown style is refused by name."""
    turns = SyntheticTaskSource(n_train_per_family=8, n_heldout_per_family=4, seed=0, families=["dispatch"])
    calls = SyntheticTaskSource(n_train_per_family=8, n_heldout_per_family=4, seed=0, families=["dispatch"],
                                hint="calls")
    for t in calls.tasks("heldout"):
        full, short = turns.oracle_hint(t), calls.oracle_hint(t)
        p = t.payload["params"]
        assert short == full.rpartition("\n")[0] and short.endswith("</tool_call>")
        assert f'"hub": "{p["hub"]}"' in short and "Shipped via" not in short
    with pytest.raises(ValueError, match="hint='answer'.*'turns'.*'calls'"):
        SyntheticTaskSource(hint="answer")

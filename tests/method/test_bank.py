"""Tests for lopd_jax.method.embedders and lopd_jax.method.bank (admission, linearization, retrieval, IO)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lopd_jax.method.bank import (BankConfig, EmptyBankError, Experience, ExperienceBank, without_clusters,
                           encoder_input_text, linearize)
from lopd_jax.method.embedders import HashingEmbedder
from tests.paths import ROOT


def _call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def make_exp(task_id, instruction, steps, reward=1.0, final="Done.", env_id="toy", **info):
    """An Experience whose trajectory is ``steps`` = [(tool, args, observation), ...]."""
    msgs = [{"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": instruction}]
    for tool, args, obs in steps:
        msgs.append({"role": "assistant", "content": "", "tool_calls": [_call(tool, **args)]})
        msgs.append({"role": "tool", "content": obs})
    msgs.append({"role": "assistant", "content": final})
    return Experience(task_id, env_id, instruction, msgs, reward, info=info)


FAMILIES = {
    "flight": (lambda a, b: f"Book a flight from {a} to {b} next Monday morning",
               [("Paris", "Rome"), ("Oslo", "Madrid"), ("Tokyo", "Seoul")],
               lambda a, b: [("search_flights", {"origin": a, "dest": b}, "3 flights found"),
                             ("book_flight", {"flight_id": 2}, "booking confirmed")]),
    "email": (lambda a, b: f"Send an email to {a} about the {b} meeting",
              [("Alice", "budget"), ("Bob", "hiring"), ("Carol", "roadmap")],
              lambda a, b: [("send_email", {"to": a, "subject": b}, "email sent")]),
    "weather": (lambda a, b: f"What is the weather forecast in {a} for {b}?",
                [("Berlin", "tomorrow"), ("Lima", "Sunday"), ("Cairo", "tonight")],
                lambda a, b: [("get_weather", {"city": a, "day": b}, "sunny, 21C")]),
    "fib": (lambda a, b: f"Write a Python function that returns the {a}th Fibonacci number "
                         f"using {b}",
            [("10", "recursion"), ("25", "iteration"), ("40", "memoization")],
            lambda a, b: [("run_python", {"code": "def fib(n): ..."}, "tests passed")]),
    "sum": (lambda a, b: f"Compute the sum of the numbers {a} and {b} with the calculator",
            [("17", "4"), ("230", "91"), ("5", "5000")],
            lambda a, b: [("calculator", {"expr": f"{a}+{b}"}, str(int(a) + int(b)))]),
}


def family_bank(mode="symmetric", **kw):
    """Bank with two instances of each family; returns (bank, held-out queries)."""
    bank = ExperienceBank(HashingEmbedder(dim=512), retrieval_mode=mode, **kw)
    queries = []
    for fam, (instr, params, traj) in FAMILIES.items():
        for i, (a, b) in enumerate(params[:2]):
            bank.add(make_exp(f"{fam}-{i}", instr(a, b), traj(a, b), family=fam))
        a, b = params[2]
        queries.append((fam, f"{fam}-2", instr(a, b)))
    return bank.build(), queries


# ----------------------------------------------------------------------------- embedder

def test_hashing_embedder_basics():
    emb = HashingEmbedder(dim=256)
    texts = ["Book a flight to Rome", "book a FLIGHT to rome!", "Compute 2 + 2", ""]
    v = emb.embed_documents(texts)
    assert v.shape == (4, 256) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v[:3], axis=1), 1.0, rtol=1e-6)
    assert np.all(v[3] == 0)  # empty text matches nothing
    np.testing.assert_array_equal(v, HashingEmbedder(dim=256).embed_documents(texts))
    assert v[0] @ v[1] > 0.99 and v[0] @ v[2] < 0.3
    with pytest.raises(TypeError, match="list of texts"):
        emb.embed_documents("one string")


def test_query_instruction_prefix():
    plain = HashingEmbedder(dim=256)
    q = ["find the weather in Lima"]
    np.testing.assert_array_equal(plain.embed_queries(q), plain.embed_documents(q))
    inst = HashingEmbedder(dim=256, query_instruction="Retrieve a similar solved task")
    assert inst.format_query("x") == "Instruct: Retrieve a similar solved task\nQuery:x"
    assert not np.array_equal(inst.embed_queries(q), inst.embed_documents(q))


@pytest.mark.process
def test_hashing_is_stable_across_processes():
    code = ("from lopd_jax.method.embedders import HashingEmbedder as H;"
            "print(H(dim=64).embed_documents(['stable hashing test'])[0].tolist())")
    root = ROOT
    outs = [subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                           text=True, check=True, env={**os.environ, "PYTHONHASHSEED": s}
                           ).stdout for s in ("1", "2")]
    assert outs[0] == outs[1]
    here = HashingEmbedder(dim=64).embed_documents(["stable hashing test"])[0]
    np.testing.assert_allclose(json.loads(outs[0]), here, rtol=1e-6)


# ----------------------------------------------------------------------------- admission / text

def test_admission_threshold():
    exps = [make_exp(f"t{i}", f"task {i}", [], reward=r) for i, r in
            enumerate([1.0, 0.99, 0.0, 1.0])]
    bank = ExperienceBank(HashingEmbedder(dim=64))
    assert [bank.add(e) for e in exps] == [True, False, False, True]
    assert len(bank) == 2 and bank.num_offered == 4
    assert ExperienceBank(HashingEmbedder(dim=64), min_reward=0.5).add_many(exps) == 3
    bank.build()
    with pytest.raises(RuntimeError, match="frozen"):
        bank.add(exps[0])


def test_linearize_and_truncation():
    long_obs = "row " * 300  # 1200 chars, 1199 once whitespace is collapsed
    exp = make_exp("t", "Find   the\ncheapest flight", [
        ("search_flights", {"origin": "PAR", "dest": "ROM"}, long_obs),
        ("book_flight", {"flight_id": 7}, "booked\nref ABC"),
    ], final="Booked flight 7.")
    text = linearize(exp, max_obs_chars=40)
    lines = text.split("\n")
    assert lines[0] == "Task: Find the cheapest flight"
    assert len(lines) == 4
    assert lines[1].startswith('Step 1: search_flights({"dest": "ROM", "origin": "PAR"}) -> ')
    obs1 = lines[1].split(" -> ", 1)[1]
    assert obs1.startswith("row row") and "[1159 chars cut]" in obs1
    assert len(obs1.split("...")[0]) == 40
    assert lines[2] == 'Step 2: book_flight({"flight_id": 7}) -> booked ref ABC'
    assert lines[3] == "Step 3: Booked flight 7. -> (end)"
    whole = linearize(exp, max_obs_chars=None)
    assert "chars cut" not in whole and whole.count("row") == 300
    enc = encoder_input_text("Book a train", exp, max_obs_chars=40)
    assert enc == "Task to solve:\nBook a train\n\nReference past trajectory:\n" + text


# ----------------------------------------------------------------------------- retrieval

@pytest.mark.parametrize("mode", ["symmetric", "asymmetric"])
def test_retrieval_finds_same_family(mode):
    bank, queries = family_bank(mode)
    got = bank.retrieve([q for _, _, q in queries], [t for _, t, _ in queries], n_ret=2)
    for (fam, _, _), exps in zip(queries, got):
        assert [e.info["family"] for e in exps] == [fam, fam], (fam, exps)


def test_self_retrieval_filter():
    bank = ExperienceBank(HashingEmbedder(dim=256))
    bank.add(make_exp("a", "Send an email to Alice about the budget", []))
    bank.add(make_exp("a-copy", "Send an email to Alice about the budget", []))  # same text
    bank.add(make_exp("b", "Send an email to Bob about the budget", []))
    bank.add(make_exp("a", "Email Alice regarding budget numbers", []))  # same task id
    bank.add(make_exp("c", "Write an email to Dan about the hiring plan", []))
    bank.build()
    q, tid = ["Send an email to Alice about the budget"], ["a"]
    on = bank.retrieve_indices(q, tid, n_ret=3)[0]
    assert set(on[:2]) == {0, 1}  # exact matches come first when allowed
    strict = ExperienceBank(HashingEmbedder(dim=256), allow_self_retrieval=False)
    strict.add_many(bank.entries)
    strict.build()
    off = strict.retrieve_indices(q, tid, n_ret=3)[0]
    assert list(off) == [2, 4, -1]  # only b and c survive; the third slot is missing (masked)
    # Without task ids only the instruction text identifies the task itself.
    assert 3 in strict.retrieve_indices(q, None, n_ret=3)[0]


def test_self_filter_widens_search_past_many_copies():
    bank = ExperienceBank(HashingEmbedder(dim=256), allow_self_retrieval=False)
    for i in range(20):  # 20 copies crowd out the first n_ret + 10 = 13 candidates
        bank.add(make_exp(f"x{i}", "Reverse the linked list in place", []))
    bank.add(make_exp("y", "Reverse the doubly linked list", []))
    bank.build()
    assert list(bank.retrieve_indices(["Reverse the linked list in place"], ["q"])[0]) == [20, -1, -1]
    lonely = ExperienceBank(HashingEmbedder(dim=64), allow_self_retrieval=False)
    lonely.add(make_exp("only", "Only task", []))
    with pytest.raises(EmptyBankError, match="allow_self_retrieval"):
        lonely.build().retrieve(["Only task"], ["only"])


def test_symmetric_vs_asymmetric():
    refund = make_exp("s1", "Customer support request number 1: help the user with the order",
                      [("refund_order", {"order_id": 1}, "refund issued")])
    track = make_exp("s2", "Customer support request number 2",
                     [("track_package", {"tracking": "ZX9"}, "package in transit")])
    twin = make_exp("s3", "Customer support request number 2",
                    [("cancel_order", {"order_id": 5}, "order cancelled")])
    query = ["Customer support request: help the user track the package in transit"]
    top = {}
    for mode in ("symmetric", "asymmetric"):
        bank = ExperienceBank(HashingEmbedder(dim=512), retrieval_mode=mode)
        bank.add_many([refund, track, twin])
        bank.build()
        top[mode] = bank.retrieve(query, n_ret=1)[0][0].task_id
        v = bank._index.reconstruct_n(0, 3)
        same_instr_equal = np.array_equal(v[1], v[2])
        assert same_instr_equal == (mode == "symmetric")  # trajectories count only if asym.
    assert top == {"symmetric": "s1", "asymmetric": "s2"}


def test_fewer_hits_than_n_ret_mask_or_repeat():
    for mode, expected, idx in (("mask", ["a", "b"], [0, 1, -1]), ("repeat", ["a", "b", "a"], [0, 1, 0])):
        bank = ExperienceBank(HashingEmbedder(dim=128), missing_hits=mode)
        bank.add(make_exp("a", "sort a list of integers", []))
        bank.add(make_exp("b", "parse a date string", []))
        bank.build()
        got = bank.retrieve(["sort integers in a list"], n_ret=3)[0]
        assert [e.task_id for e in got] == expected  # mask (the release): fewer experiences
        assert list(bank.retrieve_indices(["sort integers in a list"], n_ret=3)[0]) == idx


def test_empty_bank_error():
    bank = ExperienceBank(HashingEmbedder(dim=64))
    bank.add(make_exp("t", "task", [], reward=0.0))
    with pytest.raises(EmptyBankError) as err:
        bank.build()
    msg = str(err.value)
    assert "1 rollouts were offered" in msg and "bank_min_reward=1.0" in msg
    assert "Lower bank_min_reward" in msg and "warm up the model" in msg
    with pytest.raises(EmptyBankError):
        bank.retrieve(["task"])


def test_bad_config():
    with pytest.raises(ValueError, match="retrieval_mode"):
        BankConfig(retrieval_mode="hybrid")
    with pytest.raises(ValueError, match="n_ret"):
        BankConfig(n_ret=0)


# ----------------------------------------------------------------------------- save / load

def test_save_load_round_trip(tmp_path):
    bank, queries = family_bank("asymmetric", max_obs_chars=50)
    texts, tids = [q for _, _, q in queries], [t for _, t, _ in queries]
    path = str(tmp_path / "bank")
    bank.save(path)
    assert sorted(os.listdir(path)) == ["entries.jsonl", "index.faiss", "manifest.json"]
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    assert manifest["embedder"]["name"] == "hashing-v1" and manifest["dim"] == 512

    for emb in (None, HashingEmbedder(dim=512)):
        loaded = ExperienceBank.load(path, emb)
        assert loaded.frozen and loaded.config == bank.config
        assert loaded.entries == bank.entries
        np.testing.assert_array_equal(loaded.retrieve_indices(texts, tids),
                                      bank.retrieve_indices(texts, tids))
    with pytest.raises(RuntimeError, match="frozen"):
        loaded.add(bank[0])

    with pytest.raises(ValueError, match="dim 256"):
        ExperienceBank.load(path, HashingEmbedder(dim=256))
    with pytest.raises(ValueError, match="ngram_range"):
        ExperienceBank.load(path, HashingEmbedder(dim=512, ngram_range=(2, 4)))
    with pytest.raises(FileNotFoundError, match="no manifest"):
        ExperienceBank.load(str(tmp_path / "nothing"))


def test_headroom_bank_holds_no_success_of_the_withheld_customers():
    """configs/miniature_headroom.py: a bank built from a success on EVERY training task (the
    oracle demonstrations: any bank the bank stage builds holds a subset of these) and filtered
    as the bank stage filters it has no entry of the withheld customers, keeps every other
    customer's, and retrieves for each withheld customer's held-out task only experiences that
    name another customer's hub -- so phi0's teacher cannot read the right hub from them."""
    from configs.miniature_headroom import CONFIG, WITHHELD_CLUSTERS, WITHHELD_HUBS
    from lopd_jax.envs.synthetic.env import SyntheticTaskSource, oracle_turns

    source = SyntheticTaskSource(**CONFIG.env.kwargs)
    rule = source.hidden_rule("dispatch.ship")
    assert sorted(WITHHELD_CLUSTERS) == sorted(f"dispatch.ship:customer={c}" for c, h in rule.items()
                                               if h in WITHHELD_HUBS)
    train = source.tasks("train")
    exps = [Experience(t.task_id, t.env_id, t.instruction,
                       [{"role": "user", "content": t.instruction},
                        *[{"role": "assistant", "content": turn.content,
                           "tool_calls": [c.to_message_field() for c in turn.tool_calls]} for turn in oracle_turns(t)]],
                       1.0) for t in train]
    kept = without_clusters(exps, [source.cluster_key(t) for t in train], set(CONFIG.bank.withhold_clusters))
    bank = ExperienceBank(HashingEmbedder(dim=CONFIG.bank.embedder_dim), CONFIG.bank_config())
    bank.add_many(kept)
    bank.build()
    task_of = {t.task_id: t for t in train}
    hub = lambda t: t.payload["params"]["hub"]  # noqa: E731
    customer = lambda t: t.payload["params"]["customer"]  # noqa: E731
    assert {source.cluster_key(task_of[e.task_id]) for e in bank.entries} == \
        {source.cluster_key(t) for t in train} - set(WITHHELD_CLUSTERS)  # the others keep theirs
    assert not {hub(task_of[e.task_id]) for e in bank.entries} & set(WITHHELD_HUBS)
    assert not any(h in json.dumps(e.messages) for e in bank.entries for h in WITHHELD_HUBS)
    heldout = [t for t in source.tasks("heldout") if source.cluster_key(t) in WITHHELD_CLUSTERS]
    assert len({customer(t) for t in heldout}) == 4 and len(heldout) >= 20
    for task, got in zip(heldout, bank.retrieve([t.instruction for t in heldout], [t.task_id for t in heldout])):
        assert got and all(hub(task_of[e.task_id]) != hub(task) for e in got)
        assert all(customer(task_of[e.task_id]) != customer(task) for e in got)
    with pytest.raises(ValueError, match="one key each"):
        without_clusters(exps, [], set())


def test_withheld_cluster_keys_are_checked_against_the_training_tasks():
    import dataclasses
    import types

    from configs.miniature_headroom import CONFIG, WITHHELD_CLUSTERS
    from lopd_jax.envs.synthetic.env import SyntheticTaskSource
    from lopd_jax.settings.errors import ConfigError
    from train.bank_stage import withheld_clusters

    source = SyntheticTaskSource(**CONFIG.env.kwargs)
    ctx = types.SimpleNamespace(cfg=CONFIG, source=source, train_tasks=source.tasks("train"))
    assert withheld_clusters(ctx) == set(WITHHELD_CLUSTERS)
    typo = dataclasses.replace(CONFIG, bank=dataclasses.replace(CONFIG.bank, withhold_clusters=("dispatch.ship:bob",)))
    with pytest.raises(ValueError, match="no training task has"):
        withheld_clusters(types.SimpleNamespace(cfg=typo, source=source, train_tasks=ctx.train_tasks))
    with pytest.raises(ConfigError, match="bank.path"):
        dataclasses.replace(CONFIG.bank, path="/some/bank")

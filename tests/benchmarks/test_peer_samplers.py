"""Our side of ``benchmarks.peer_samplers``: the shared weights, the episodes through our
engine, the report, and a peer whose venv is missing (no peer venv is needed here)."""

import json
import os

import numpy as np
import pytest

from benchmarks import peer_samplers as ps
from benchmarks.peers import common


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return ps.tiny_qwen3(str(tmp_path_factory.mktemp("peer") / "qwen3"), layers=1)


def test_weights_carry_rope_theta_and_a_word_tokenizer(weights):
    """Readers of older configs find rope_theta at the top level; word ``<i>`` is id ``i``."""
    import transformers

    with open(os.path.join(weights, "config.json")) as f:
        hf = json.load(f)
    assert hf["rope_theta"] == 1e6
    tok = transformers.AutoTokenizer.from_pretrained(weights)
    ids = [3, 28, 2, 280, 511]
    assert tok.encode(common.text_of(ids)) == ids


def test_ours_runs_the_episodes_as_transformers_generates_them(weights):
    """Every turn has exactly ``new_tokens`` ids, and greedy turn 1 and turn 2 (after the
    reply) equal ``transformers``' greedy continuation of the same context."""
    import torch
    import transformers

    wl = dict(ps.workload(3, 2, 6, 3, 5, seed=1), repeats=1)
    res = ps.run_ours(weights, wl, slots=2, chunk=2)
    assert res["tokens"] == 3 * 2 * 5 and res["seconds"] > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(weights).eval()
    for prompt, turns in zip(wl["prompts"], res["ids"]):
        ctx = list(prompt)
        for t, ids in enumerate(turns):
            with torch.no_grad():
                out = hf.generate(torch.tensor([ctx]), max_new_tokens=5, min_new_tokens=5, do_sample=False)
            assert ids == out[0, len(ctx):].tolist()
            ctx += ids + wl["reply"]


def test_turn_by_turn_grows_the_prompt():
    """A peer without episodes sees prompt, turn 1, reply as its second prompt."""
    seen = []

    def generate(prompts, n):
        seen.append([list(p) for p in prompts])
        return [np.arange(n) + len(p) for p in prompts]

    out = common.turn_by_turn(generate, {"prompts": [[5, 6]], "reply": [9], "turns": 2, "new_tokens": 2})
    assert out == [[[2, 3], [5, 6]]]
    assert seen == [[[5, 6]], [[5, 6, 2, 3, 9]]]


def test_missing_peer_says_how_to_install_and_report_lists_it(weights, tmp_path):
    res = ps.run_peer("tunix", weights, str(tmp_path / "wl.json"), 10, str(tmp_path / "none"))
    assert res["stage"] == "install" and "pip install google-tunix" in res["error"]
    ours = {"peer": "ours", "version": "x", "tokens": 10, "seconds": 2.0, "warmup_seconds": 1.0, "all_seconds": [2.0],
            "multi_turn": "episodes", "ids": [[[1, 2]]]}
    peer = dict(ours, peer="p", seconds=1.0, ids=[[[1, 3]]])
    lines = ps.report([ours, peer, res])
    assert "same ids as ours 0/1" in lines[1] and "2x ours" in lines[1]
    assert "tunix" in lines[2] and "cannot run (stage install)" in lines[2]
    assert lines[-1].endswith("peer/ours tokens/s: p 2x, tunix n/a")

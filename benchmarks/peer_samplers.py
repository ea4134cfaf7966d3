"""Our engine beside the peers' JAX samplers: the same multi-turn episodes, the same tiny
random Qwen3 weights, greedy, on CPU; generated tokens/s for each and its ratio to ours.

Each episode is a prompt of random ids, then ``--turns`` turns of exactly ``--new`` tokens
(no stop ids) with a fixed environment reply appended between turns. **ours**: one
``Engine.run`` over ``EpisodeSpec``s whose ``step`` returns the reply
(``lopd_jax.rollout``), in this process. **peers** (Tunix's ``Sampler``, EasyDeL's
eSurge): each in its own venv under ``.venv-peers/NAME`` as a subprocess
(``benchmarks/peers/NAME.py``); a peer without multi-turn episodes runs each turn as a new
batched generation on the growing prompt. Every side runs the workload once untimed (it
compiles; not eSurge, which compiles in its constructor), then ``--repeats`` times timed
(fewer once they took ``--budget_s``): the median counts. A peer that cannot run
prints why (stage, version, error). Greedy ids are compared with ours per turn
(``same ids``). EasyDeL needs ``pillow`` and ``torch`` beside it (its model classes import
them) and a capped KV budget on CPU (``benchmarks/peers/easydel_esurge.py``).

    python -m benchmarks.peer_samplers                 # after setting up the peers' venvs:
    python3.11 -m venv .venv-peers/tunix && .venv-peers/tunix/bin/pip install google-tunix==0.1.7
    python3.11 -m venv .venv-peers/easydel && .venv-peers/easydel/bin/pip install easydel==0.3.0 pillow torch

Measurements: docs/benchmarks.md, "Peer samplers".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import jax  # noqa: E402
import numpy as np  # noqa: E402

from lopd_jax.rollout.engine import Engine  # noqa: E402
from lopd_jax.rollout.episode_spec import EpisodeSpec  # noqa: E402
from lopd_jax.settings.sections import EngineConfig, SamplingParams  # noqa: E402
from benchmarks.peers import common  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# name: (script under benchmarks/peers, what to pip install into .venv-peers/NAME)
PEERS = {"tunix": ("tunix_sampler.py", "google-tunix==0.1.7"),
         "easydel": ("easydel_esurge.py", "easydel==0.3.0 pillow torch")}
VOCAB = 512


def tiny_qwen3(path: str, seed: int = 0, layers: int = 2) -> str:
    """Save a random tiny Qwen3 (``transformers``, safetensors) and a word-level tokenizer
    whose token ``i`` is the word ``<i>`` (no BOS, pad ``<0>``, EOS ``<2>``) into ``path``; returns ``path``."""
    import torch  # noqa: PLC0415 -- heavy and only needed to write the checkpoint
    import transformers  # noqa: PLC0415
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e6,
        max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=2, pad_token_id=0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # the default init's 0.02 std gives near-constant greedy text
        for w in model.parameters():
            if w.dim() > 1:
                w.normal_(0.0, 0.2)
        # Ids 0-2 (pad, bos, eos) get logit 0, below the greedy pick's: a peer that reads a pad
        # id inside a growing prompt as padding then sees the same context as ours.
        model.lm_head.weight[:3] = 0.0
    model.save_pretrained(path, safe_serialization=True)
    # transformers 5 writes rope_theta only under rope_parameters; readers pinned to older
    # releases (EasyDeL 0.3.0) look for the top-level key and fall back to 10,000.
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    hf["rope_theta"] = hf.get("rope_parameters", {}).get("rope_theta", 1e6)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(VOCAB)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<0>", eos_token="<2>",
                                                unk_token="<0>")
    fast.save_pretrained(path)
    return path


def workload(episodes: int, turns: int, prompt: int, reply: int, new: int, seed: int = 0) -> dict:
    """The episodes: random prompt ids (``prompt`` +- 25%), one fixed reply, turn counts."""
    rs = np.random.RandomState(seed)
    lens = rs.randint(max(1, prompt * 3 // 4), prompt * 5 // 4 + 1, size=episodes)
    return {"prompts": [rs.randint(3, VOCAB, size=n).tolist() for n in lens],
            "reply": rs.randint(3, VOCAB, size=reply).tolist(), "turns": turns, "new_tokens": new}


def episode_specs(wl: dict) -> list[EpisodeSpec]:
    """One ``EpisodeSpec`` per prompt: ``turns`` turns of exactly ``new_tokens``, the reply between."""
    total = max(len(p) for p in wl["prompts"]) + wl["turns"] * (wl["new_tokens"] + len(wl["reply"]))

    def stepper():
        done = [0]

        def step(ids, lps, raws):
            done[0] += 1
            return None if done[0] >= wl["turns"] else wl["reply"]
        return step

    return [EpisodeSpec(p, total, wl["new_tokens"], stepper()) for p in wl["prompts"]]


def run_ours(weights: str, wl: dict, slots: int, chunk: int, page: int = 16) -> dict:
    """Our engine on the workload (``common.timed_runs``: warm-up, then the timed runs); the
    result dict the peer scripts write."""
    from models.hf_import import from_pretrained  # noqa: PLC0415 -- after JAX_PLATFORMS is set above

    model = from_pretrained(weights)
    sp = SamplingParams(temperature=0.0, top_p=1.0)
    cfg = EngineConfig(slots=slots, page_size=page, decode_chunk=chunk, prefill_chunk=128, env_workers=2)
    with Engine(model, stop_ids=(), config=cfg, sampling=sp) as engine:
        params = engine.local_params(Engine.params_of(model))

        def run(w):
            return [[t.tolist() for t in r.turns] for r in engine.run(params, episode_specs(w), jax.random.key(0))]
        res = common.timed_runs(run, wl)
    return {"peer": "ours", "version": "lopd_jax", "multi_turn": "episodes (EpisodeSpec.step returns the reply)",
            **res}


def run_peer(name: str, weights: str, wl_path: str, timeout: float, venvs: str, mem_gb: float = 12) -> dict:
    """Run ``benchmarks/peers/<script>`` in ``<venvs>/<name>`` with at most ``mem_gb`` of
    address space (a peer's allocation error then ends only the peer); its result dict (an
    error dict when it fails)."""
    script, install = PEERS[name]
    python = os.path.join(venvs, name, "bin", "python")
    base = {"peer": name, "version": "?"}
    if not os.path.exists(python):
        return {**base, "stage": "install", "error": (
            f"no venv at {os.path.dirname(os.path.dirname(python))}: create it with "
            f"`python3.11 -m venv {os.path.join(venvs, name)} && {os.path.join(venvs, name, 'bin', 'pip')} "
            f"install {install}`")}
    out = tempfile.NamedTemporaryFile(suffix=f".{name}.json", delete=False).name
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           common.MEM_ENV: str(int(mem_gb * (1 << 30)))}
    # its output goes to a file, not a pipe: a worker process a peer leaves behind keeps a
    # pipe open and the wait would last until the timeout
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc = subprocess.run([python, os.path.join(ROOT, "benchmarks", "peers", script), weights, wl_path, out],
                                  env=env, timeout=timeout, stdout=log, stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            return {**base, "stage": "run", "error": f"timed out after {timeout:.0f} s"}
        try:
            with open(out) as f:
                res = json.load(f)
        except (OSError, ValueError):
            log.seek(0)
            tail = log.read().strip().splitlines()[-8:]
            res = {**base, "stage": "start", "error": f"exit {proc.returncode}, no result: " + " | ".join(tail)}
        finally:
            os.unlink(out)
    return res


def same_ids(ours: dict, res: dict) -> str:
    """How many (episode, turn) greedy id sequences equal ours."""
    pairs = [(a, b) for ea, eb in zip(ours["ids"], res["ids"]) for a, b in zip(ea, eb)]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"


def report(results: list[dict]) -> list[str]:
    """The printed lines: one per side, then the ratio line."""
    ours = results[0]
    rate = ours["tokens"] / ours["seconds"]
    lines, ratios = [], []
    for res in results:
        if "error" in res:
            lines.append(f"{res['peer']:8s} {res.get('version', '?'):10s} cannot run "
                         f"(stage {res.get('stage')}): {res['error']}")
            ratios.append(f"{res['peer']} n/a")
            continue
        r = res["tokens"] / res["seconds"]
        lines.append(f"{res['peer']:8s} {res['version']:10s} {res['tokens']} tokens in {res['seconds']:6.2f} s = "
                     f"{r:8.1f} tok/s, {r / rate:.3g}x ours ({len(res['all_seconds'])} timed, "
                     f"untimed warm-up {res['warmup_seconds']:.1f} s; "
                     f"same ids as ours {same_ids(ours, res)}; multi-turn: {res['multi_turn']})")
        if res is not ours:
            ratios.append(f"{res['peer']} {r / rate:.3g}x")
    lines.append(f"peer samplers: ours {rate:.1f} tok/s; peer/ours tokens/s: " + ", ".join(ratios))
    return lines


def main(argv=None):
    """Build the weights and workload, run every side, print the lines."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--prompt", type=int, default=32, help="mean prompt length")
    p.add_argument("--reply", type=int, default=8, help="environment reply length")
    p.add_argument("--new", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--slots", type=int, default=32, help="our engine's decode rows")
    p.add_argument("--chunk", type=int, default=8, help="our engine's decode steps per device call")
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    p.add_argument("--venvs", default=os.path.join(ROOT, ".venv-peers"))
    p.add_argument("--repeats", type=int, default=5, help="timed runs per side (after one untimed)")
    p.add_argument("--budget_s", type=float, default=20.0, help="no further timed run once a side's took this long")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per peer")
    p.add_argument("--mem_gb", type=float, default=12.0, help="address-space limit of each peer's process")
    args = p.parse_args(argv)

    wl = dict(workload(args.episodes, args.turns, args.prompt, args.reply, args.new), repeats=args.repeats,
              budget_s=args.budget_s)
    print(f"workload: {args.episodes} episodes x {args.turns} turns x {args.new} tokens, prompts ~{args.prompt}, "
          f"reply {args.reply}; greedy; tiny random Qwen3 (2 layers, hidden 64, vocab {VOCAB}); "
          f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        weights = tiny_qwen3(os.path.join(tmp, "qwen3"))
        wl_path = os.path.join(tmp, "workload.json")
        with open(wl_path, "w") as f:
            json.dump(wl, f)
        results = [run_ours(weights, wl, args.slots, args.chunk)]
        print(report(results)[0], flush=True)
        for name in args.peers:
            results.append(run_peer(name, weights, wl_path, args.timeout, args.venvs, args.mem_gb))
            print(report(results)[-2], flush=True)
    print(report(results)[-1])
    return results


if __name__ == "__main__":
    main(sys.argv[1:])

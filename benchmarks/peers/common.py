"""What every peer script shares (stdlib and numpy only: it runs in the peer's own venv).

A peer script is called as ``python benchmarks/peers/NAME.py WEIGHTS WORKLOAD OUT``:
``WEIGHTS`` is the tiny Qwen3 checkpoint (config.json, model.safetensors, tokenizer.json),
``WORKLOAD`` the episodes' JSON (:func:`benchmarks.peer_samplers.workload`), ``OUT`` the
JSON it writes: ``{"peer", "version", "tokens", "seconds", "all_seconds",
"warmup_seconds", "ids", "multi_turn"}``, or ``{"peer", "version", "error", "stage"}`` when a stage failed.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
import traceback
from importlib import metadata

MEM_ENV = "PEER_MEM_BYTES"  # the address-space limit a peer process sets on itself


def load_workload(path: str) -> dict:
    """The workload dict: ``prompts`` (ids per episode), ``reply`` (the environment's ids
    appended after every turn but the last), ``turns``, ``new_tokens`` (per turn),
    ``repeats`` (timed runs) and ``budget_s`` (no further timed run once they took this long)."""
    with open(path) as f:
        return json.load(f)


def text_of(ids) -> str:
    """The tiny checkpoint's tokenizer text for ``ids`` (word ``<i>`` per id, spaces between)."""
    return " ".join(f"<{int(i)}>" for i in ids)


def version_of(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``"not installed"``."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def turn_by_turn(generate, wl: dict) -> list[list[list[int]]]:
    """Run the workload as one new generation per turn on the growing prompt.

    ``generate(prompts, new_tokens)`` returns the generated ids of each prompt. Returns
    per episode the ids of each turn."""
    contexts = [list(p) for p in wl["prompts"]]
    out: list[list[list[int]]] = [[] for _ in contexts]
    for turn in range(wl["turns"]):
        gens = generate(contexts, wl["new_tokens"])
        for i, ids in enumerate(gens):
            ids = [int(t) for t in ids]
            out[i].append(ids)
            contexts[i] += ids
            if turn + 1 < wl["turns"]:
                contexts[i] += wl["reply"]
    return out


def timed_runs(run, wl: dict, warmup: bool = True) -> dict:
    """One untimed warm-up run (it compiles; skipped when not ``warmup``), then up to
    ``wl["repeats"]`` timed runs of the same workload, stopping early once the timed runs
    took ``wl["budget_s"]``; the median's seconds and the last run's ids."""
    t0 = time.perf_counter()
    if warmup:
        run(wl)
    warm = time.perf_counter() - t0
    times: list[float] = []
    while len(times) < wl.get("repeats", 1) and sum(times) < wl.get("budget_s", float("inf")):
        t0 = time.perf_counter()
        ids = run(wl)
        times.append(time.perf_counter() - t0)
    return {"tokens": sum(len(t) for ep in ids for t in ep), "seconds": statistics.median(times),
            "all_seconds": times, "warmup_seconds": warm, "ids": ids}


def main(peer: str, dist: str, multi_turn: str, setup, argv=None, warmup: bool = True) -> int:
    """Limit the process's address space to ``$PEER_MEM_BYTES`` (when set), parse the three
    paths, build the peer's runner with ``setup(weights, workload)``
    (which returns ``run(workload) -> ids per episode per turn``), time it
    (:func:`timed_runs`), write OUT.
    A stage's exception is written as the result (with its last traceback lines)."""
    weights, wl_path, out_path = (argv if argv is not None else sys.argv[1:])[:3]
    if os.environ.get(MEM_ENV):  # the driver's cap, set here: a fork of its JAX process could deadlock
        resource.setrlimit(resource.RLIMIT_AS, (int(os.environ[MEM_ENV]),) * 2)
    result = {"peer": peer, "version": version_of(dist), "multi_turn": multi_turn}
    stage = "setup"
    try:
        wl = load_workload(wl_path)
        run = setup(weights, wl)
        stage = "run"
        result.update(timed_runs(run, wl, warmup))
    except BaseException as e:  # noqa: BLE001 -- any failure is the peer's result, written for the driver
        tb = traceback.format_exc().strip().splitlines()
        result.update(stage=stage, error=f"{type(e).__name__}: {e}"[:2000], traceback=tb[-12:])
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 1

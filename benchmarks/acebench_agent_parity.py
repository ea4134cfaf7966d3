"""Agreement of :mod:`lopd_jax.envs.acebench.agent` (scenarios, execution, end-state check)
with ACEBench's own code, on the real agent data of an ACEBench checkout you already have
(nothing is downloaded).

For every multi-step and multi-turn agent row it replays three message sequences (the row's
milestones, the milestones without the last one, and with a string argument of the last call
replaced) through our environment and through upstream's execution roles, grades both end
states with upstream's ``agent_checker`` and counts the sequences on which every execution
message, the end state and the verdict agree, and how many milestone replays pass.

    python -m benchmarks.acebench_agent_parity --upstream /path/to/ACEBench

Method and measurements: ``docs/evaluation.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

from lopd_jax.envs.acebench.agent import ACEBenchAgentEnvironment, load_agent_category  # noqa: E402
from lopd_jax.envs.acebench.scenarios import end_state  # noqa: E402
from lopd_jax.core.types import AssistantTurn  # noqa: E402


def variants(stones: list[str]) -> dict[str, list[str]]:
    """The milestones, without the last one, and with the last call's first string changed."""
    out = {"milestones": stones, "missing_step": stones[:-1]}
    changed = re.sub(r"='[^']*'", "='zzqx'", stones[-1], count=1) if stones else ""
    if changed != (stones[-1] if stones else ""):
        out["wrong_argument"] = stones[:-1] + [changed]
    return out


def ours(task, messages: list[str]) -> tuple[list[str], list, bool]:
    """Execution messages, end state and verdict of our environment."""
    env = ACEBenchAgentEnvironment(user=lambda chat: "ok")
    env.reset(task)
    seen = []
    for m in messages:
        result = env.step(AssistantTurn(raw=m, content=m))
        seen += [o["content"] for o in result.observation]
        if result.done:
            break
    if not env.done:
        env.finish()
    state = end_state(env.instances) if env.executed else []
    return seen, state, env.verdict["valid"]


def upstream_eval(result: list, truth: list, agent_checker) -> bool:
    """``eval_main.agent_eval``'s loop for one row, with upstream's ``agent_checker``."""
    if len(truth) != len(result):
        return False
    valid, checker = True, {"valid": True}
    for expected in truth:
        match = next((m for m in result if set(m) == set(expected)), None)
        if match:
            checker = agent_checker(match, expected)
        if not checker["valid"]:
            valid = False
    return valid


def theirs(task, messages: list[str], run: int, mods) -> tuple[list[str], list, bool]:
    """The same through upstream's execution roles and checker."""
    p = task.payload
    multi_turn = p["category"] == "agent_multi_turn"
    role_cls = mods["EXECUTION"] if multi_turn else mods["EXECUTION_STEP"]
    role = role_cls(f"parity{run}", p["initial_config"], p["involved_classes"], task.task_id.split("_")[-1], "en")
    parser = mods["CommonAgent"](None, "", p["functions"], p["involved_classes"], language="en")
    seen, instances = [], []
    for i, m in enumerate(messages):
        if i > 1 and "finish conversation" in m:
            break
        if multi_turn:
            try:
                routed = bool(re.search(r"\[.*\]", m)) and parser.decode_function_list(m) is not None
            except Exception:  # upstream's agent: an unparseable message goes to the user
                routed = False
            if not routed:
                seen.append("user:ok")
                continue
        msg, inst = role.respond([{"message": m}])
        if isinstance(inst, dict) and inst and inst not in instances:
            instances.append(inst)
        seen.append(("execution:" if multi_turn else "execution result:") + str(msg["message"]))
    result = [{name: {k: v for k, v in vars(obj).items() if k in mods["SAVED_CLASS"][name]}}
              for inst in instances for name, obj in inst.items()]
    result = json.loads(json.dumps(result, default=str))
    return seen, result, upstream_eval(result, p["ground_truth"], mods["agent_checker"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="an ACEBench checkout (github.com/ACEBench/ACEBench)")
    args = ap.parse_args()
    sys.path.insert(0, args.upstream)
    from model_eval.checker import agent_checker  # noqa: PLC0415 -- upstream's code, from --upstream
    from model_inference.multi_step.execution_role_step import EXECUTION_STEP  # noqa: PLC0415
    from model_inference.multi_turn.execution_role import EXECUTION  # noqa: PLC0415
    mods = {"agent_checker": agent_checker, "EXECUTION_STEP": EXECUTION_STEP, "EXECUTION": EXECUTION,
            "SAVED_CLASS": {"BaseApi": ["wifi", "logged_in"], "MessageApi": ["inbox"],
                            "ReminderApi": ["reminder_list"], "FoodPlatform": ["users", "logged_in_users", "orders"],
                            "Travel": ["users", "reservations"]}}
    from model_inference.multi_turn.common_agent import CommonAgent  # noqa: PLC0415
    mods["CommonAgent"] = CommonAgent
    data = os.path.join(args.upstream, "data_all", "data_en")
    counts = {"sequences": 0, "messages": 0, "end_state": 0, "verdict": 0, "replay_passes": 0, "rows": 0}
    start, run = time.perf_counter(), 0
    for category in ("agent_multi_step", "agent_multi_turn"):
        for task in load_agent_category(data, category):
            counts["rows"] += 1
            stones = task.payload["mile_stone"]
            stones = stones[0] if stones and isinstance(stones[0], list) else stones
            for name, messages in variants(stones).items():
                run += 1
                a, b = ours(task, messages), theirs(task, messages, run, mods)
                counts["sequences"] += 1
                counts["messages"] += a[0] == b[0]
                counts["end_state"] += a[1] == b[1]
                counts["verdict"] += a[2] == b[2]
                counts["replay_passes"] += name == "milestones" and a[2]
                if a[2] != b[2] or a[1] != b[1]:
                    print(f"disagree: {task.task_id} {name}: ours {a[2]} upstream {b[2]}")
    print(json.dumps(counts))
    print(f"{counts['verdict']} / {counts['sequences']} verdicts agree; end states {counts['end_state']}; "
          f"execution messages {counts['messages']}; the milestones replayed pass {counts['replay_passes']} / "
          f"{counts['rows']} rows ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()

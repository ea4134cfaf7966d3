"""Agreement of :mod:`lopd_jax.envs.acebench.env`'s grader with ACEBench's own checker, on the
real ``data_all/data_en`` files of an ACEBench checkout you already have (nothing is
downloaded).

For every row of the 12 normal categories it grades six answers - the first possible answer
rendered as call text, and five corruptions of it (a param dropped, a string value
replaced, a number changed, the API renamed, an extra param) - with our ``grade`` and with
upstream's ``model_eval.checker.normal_checker`` after upstream's ``decode_ast`` (the
answer's whitespace removed, as ``eval_main.normal_single_turn_eval`` does), and counts
the pairs on which the two verdicts agree. It also prints, per category, how many rows'
rendered possible answer passes (upstream's checker fails some of its own answers: e.g.
strings inside lists nested in dicts lose their spaces), and checks that the reference
answers of the special categories pass ours. Upstream's checker imports only the standard
library; its ``eval`` of arithmetic in answers runs here on our own rendered texts only.

    python -m benchmarks.acebench_parity --upstream /path/to/ACEBench
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import re
import sys
import time

from lopd_jax.envs.acebench import env as acebench  # noqa: E402
from lopd_jax.core.types import AssistantTurn  # noqa: E402


def render(option: dict) -> str:
    """A possible answer (``{api(_n): {param: value}}``) as ``[api(param=value, ...)]``."""
    calls = [f"{re.sub(r'_[0-9]+$', '', k)}(" + ", ".join(f"{p}={v!r}" for p, v in params.items()) + ")"
             for k, params in option.items()]
    return "[" + ", ".join(calls) + "]"


def corrupt(option: dict, how: str, rng: random.Random) -> dict:
    """``option`` with one corruption ``how`` (drop / string / number / name / extra)."""
    opt = copy.deepcopy(option)
    key = rng.choice(list(opt))
    params = opt[key]
    if how == "drop" and params:
        params.pop(rng.choice(list(params)))
    elif how == "string":
        keys = [k for k, v in params.items() if isinstance(v, str)]
        if keys:
            params[rng.choice(keys)] = "zzqx unrelated"
    elif how == "number":
        keys = [k for k, v in params.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if keys:
            k = rng.choice(keys)
            params[k] = params[k] + 7
    elif how == "name":
        opt[key + "Wrong"] = opt.pop(key)
    elif how == "extra":
        params["zz_extra"] = "x"
    return opt


def special_reference(task) -> str:
    """The answer the special prompt asks for."""
    truth, cat = task.payload["ground_truth"], task.payload["category"]
    if cat == "special_irrelevant":
        return '["Due to the limitations of the function, I cannot solve this problem."]'
    if cat == "special_incomplete":
        return "[" + ", ".join(f'"Missing necessary parameters ({", ".join(v)}) for the api ({k})"'
                               for k, v in truth.items()) + "]"
    return "[" + ", ".join(f'"There is incorrect value ({", ".join(v)}) for the parameters ({k}) in the '
                           f'conversation history."' for k, v in truth.items()) + "]"


def main() -> None:
    """Run the comparison and print one JSON summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", required=True, help="an ACEBench checkout (has model_eval/, data_all/)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sys.path.insert(0, args.upstream)
    from model_eval.checker import normal_checker  # upstream's checker
    from model_inference.utils import decode_ast

    def upstream(task, text):
        try:
            calls = decode_ast("model", "".join(text.split()))
        except Exception:
            return False
        if not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            return False
        truth = task.payload["ground_truth"]
        return any(normal_checker(task.payload["functions"], calls, copy.deepcopy(o), task.instruction,
                                  task.payload["category"])["valid"]
                   for o in (truth if isinstance(truth, list) else [truth]))

    data = os.path.join(args.upstream, "data_all", "data_en")
    rng = random.Random(args.seed)
    pairs = agree = 0
    disagreements, canonical, ours_s = [], {}, 0.0
    for cat in acebench.NORMAL_CATEGORIES:
        tasks = acebench.load_category(data, cat)
        passed = 0
        for task in tasks:
            truth = task.payload["ground_truth"]
            first = truth[0] if isinstance(truth, list) else truth
            texts = [render(first)] + [render(corrupt(first, h, rng))
                                       for h in ("drop", "string", "number", "name", "extra")]
            for i, text in enumerate(texts):
                t0 = time.perf_counter()
                mine = acebench.grade(task, AssistantTurn(raw=text, content=text))["valid"]
                ours_s += time.perf_counter() - t0
                theirs = upstream(task, text)
                pairs += 1
                agree += mine == theirs
                if mine != theirs:
                    disagreements.append([task.task_id, i, theirs, mine])
                passed += bool(i == 0 and mine)
        canonical[cat] = f"{passed}/{len(tasks)}"
    special = {}
    for cat in acebench.SPECIAL_CATEGORIES:
        tasks = acebench.load_category(data, cat)
        ok = sum(acebench.grade(t, AssistantTurn(raw="", content=special_reference(t)))["valid"] for t in tasks)
        special[cat] = f"{ok}/{len(tasks)}"
    print(json.dumps({"pairs": pairs, "agree": agree, "disagreements": disagreements[:20],
                      "ours_samples_per_s": round(pairs / ours_s, 1),
                      "rendered_possible_answer_passes": canonical,
                      "special_reference_passes": special}, indent=1))


if __name__ == "__main__":
    main()

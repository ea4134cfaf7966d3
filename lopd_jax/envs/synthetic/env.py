"""Synthetic EnvScaler-style stateful tool-use environment (CPU-friendly, procedurally built).

A task is a short instruction over a small random initial state of one domain (the
families: :mod:`lopd_jax.envs.synthetic.domains`); the tools are the methods of the
domain's state class, tasks need 1-3 calls and use a small vocabulary, so a tiny model can
learn them in minutes. Reward: the fraction of the family's checks that pass, but 0
unless at least one tool call ran and at least one goal check (one the untouched state
fails) passes; reward 1.0 means the task is done (docs/miniature.md, "Reward, success and
the no-tool baseline").

Splits: an instance goes to "heldout" when a hash of its instruction falls in the held-out
bucket, so held-out instructions never occur in training while families, tools and names
are shared. ``oracle_turns(task)`` gives the exact correct assistant turns for tests and
the supervised warm-up.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from typing import Any, Sequence

from lopd_jax.envs.base import TaskSource, Toolbox, ToolUseEnvironment, check_split
from lopd_jax.envs.synthetic.domains import (ALL_DOMAINS, ALL_FAMILIES, DOMAINS, FAMILIES, HIDDEN_RULES, VERIFY,
                                             Family)
from lopd_jax.envs.synthetic.drift import drift_schedule
from lopd_jax.core.types import AssistantTurn, Message, Task, ToolCall, ToolSchema

ENV_ID = "synthetic"
HINT_STYLES = ("turns", "calls")  # what SyntheticTaskSource.oracle_hint shows


def _resolve_families(families: Sequence[str] | None) -> list[str]:
    if families is None:
        return list(FAMILIES)
    out: list[str] = []
    for name in families:
        if name in ALL_FAMILIES:
            out.append(name)
        elif name in ALL_DOMAINS:
            out += [f for f, fam in ALL_FAMILIES.items() if fam.domain == name]
        else:
            raise ValueError(f"unknown synthetic family or domain {name!r}; families: "
                             f"{list(ALL_FAMILIES)}; domains: {list(ALL_DOMAINS)}")
    return list(dict.fromkeys(out))


class SyntheticTaskSource(TaskSource):
    """Seeded, deterministic task lists for the synthetic families.

    Args:
        n_train_per_family: training tasks per family.
        n_heldout_per_family: held-out tasks per family.
        seed: generation seed (also decides which instructions are held out).
        families: family ids and/or domain names to include (default: all).
        heldout_fraction: share of instruction texts reserved for the held-out split.
        tool_descriptions: keep the tools' and parameters' descriptions in the schemas the
            environment shows (False: names and types only -- prompts about a third
            shorter, used by the CPU default to save compute).
        n_warmup_per_family: when > 0, :meth:`warmup_tasks` gives this many separate
            warm-up tasks per family (a seeded stream of their own, instructions disjoint
            from both splits) whose hidden-rule parameters (``HIDDEN_RULES``) are drawn at
            random per task, so a warm-up on them cannot learn the rule; 0: the warm-up uses
            the training tasks.
        hint: what :meth:`oracle_hint` shows: ``"turns"`` (every tool call, then the final
            answer) or ``"calls"`` (the tool calls alone: a model that copies the last lines
            of a note then copies a call, not the answer that ends the episode unshipped).
        drift_every, drift_steps, drift_fraction: the drifting variant
            (:class:`lopd_jax.envs.synthetic.drift.DriftSchedule`): the hidden map changes
            at LOPD steps ``drift_every, 2*drift_every, ...`` or at ``drift_steps``, each
            time for ``drift_fraction`` of its keys; :meth:`at_step` gives the tasks at a
            step. Default: no drift.
        balance_heldout: spread a hidden-rule family's held-out tasks evenly over the rule's
            keys (at most ``ceil(n_heldout_per_family / len(keys))`` per customer), so no
            customer carries more of the held-out score than another; the training tasks do
            not change. Default: the held-out tasks fall on keys as the sampler draws them.

    Families with a hidden rule (``dispatch.ship``: customer -> hub) take the rule's target
    from one seeded map per source, shared by ``train`` and ``heldout`` (:meth:`hidden_rule`).
    """

    env_id = ENV_ID

    def __init__(self, n_train_per_family: int = 48, n_heldout_per_family: int = 16,
                 seed: int = 0, families: Sequence[str] | None = None,
                 heldout_fraction: float = 0.25, tool_descriptions: bool = True,
                 n_warmup_per_family: int = 0, hint: str = "turns", drift_every: int = 0,
                 drift_steps: Sequence[int] | None = None, drift_fraction: float = 0.5,
                 balance_heldout: bool = False):
        """See the class docstring."""
        if hint not in HINT_STYLES:
            raise ValueError(f"hint={hint!r}: choose one of {HINT_STYLES} (the oracle hint's text: "
                             f"'turns' = the calls and the final answer, 'calls' = the calls alone)")
        if n_train_per_family < 0 or n_heldout_per_family < 0 or n_warmup_per_family < 0:
            raise ValueError("n_train_per_family, n_heldout_per_family and n_warmup_per_family must be >= 0")
        if not 0.0 < heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
        self.n = {"train": n_train_per_family, "heldout": n_heldout_per_family}
        self.seed = seed
        self.families = _resolve_families(families)
        self.heldout_fraction = heldout_fraction
        self.tool_descriptions = tool_descriptions
        self.n_warmup = n_warmup_per_family
        self.hint = hint
        self.drift = drift_schedule(drift_every, drift_steps, drift_fraction)
        self.balance_heldout = bool(balance_heldout)
        needs_rule = [name for name, on in (("balance_heldout", self.balance_heldout),
                                            ("drift_every / drift_steps", self.drift.enabled)) if on]
        if needs_rule and not any(f in HIDDEN_RULES for f in self.families):
            raise ValueError(f"{' and '.join(needs_rule)} need a family with a hidden rule "
                             f"({list(HIDDEN_RULES)}); families here: {self.families}")
        self._cache: dict[str, list[Task]] | None = None
        self._warmup: list[Task] | None = None

    def hidden_rule(self, family_id: str) -> dict[str, str] | None:
        """The family's hidden map (e.g. customer -> hub), seeded by this source's seed; None
        for a family without one."""
        rule = HIDDEN_RULES.get(family_id)
        return None if rule is None else rule.draw(random.Random(f"lopd-hidden-rule:{self.seed}:{family_id}"))

    def hidden_rule_at(self, family_id: str, step: int) -> dict[str, str] | None:
        """The family's hidden map in force at LOPD step ``step`` (:meth:`hidden_rule` after
        the drifts so far); None for a family without one."""
        base = self.hidden_rule(family_id)
        if base is None or not self.drift.enabled:
            return base
        return self.drift.rule_at(HIDDEN_RULES[family_id], base, step, seed=self.seed, family_id=family_id)

    def at_step(self, tasks: Sequence[Task], step: int) -> list[Task]:
        """``tasks`` at LOPD step ``step``: without drift unchanged; with drift, each task of a
        hidden-rule family gets the target of the map in force (same id and instruction, so
        retrieval still finds the bank's older successes, whose hints may now be stale)."""
        if not self.drift.enabled:
            return list(tasks)
        maps: dict[str, dict[str, str] | None] = {}
        out = []
        for task in tasks:
            fid = task.payload.get("family")
            if fid not in HIDDEN_RULES:
                out.append(task)
                continue
            if fid not in maps:
                maps[fid] = self.hidden_rule_at(fid, step)
            rule, params = HIDDEN_RULES[fid], dict(task.payload["params"])
            params[rule.target] = maps[fid][params[rule.key]]
            out.append(dataclasses.replace(task, payload={**task.payload, "params": params,
                                                          "drift_index": self.drift.index(step)}))
        return out

    def _split_of(self, instruction: str) -> str:
        digest = hashlib.sha256(f"{self.seed}:{instruction}".encode()).digest()
        u = int.from_bytes(digest[:8], "big") / 2.0**64
        return "heldout" if u < self.heldout_fraction else "train"

    def _generate(self, family: Family) -> dict[str, list[Task]]:
        rng = random.Random(f"lopd-synthetic:{self.seed}:{family.family_id}")
        rule = self.hidden_rule(family.family_id)  # the drawn map; ``spec`` says which params it links
        spec = HIDDEN_RULES.get(family.family_id)
        out: dict[str, list[Task]] = {"train": [], "heldout": []}
        seen: set[str] = set()
        per_key_cap = (-(-self.n["heldout"] // len(spec.keys)) if self.balance_heldout and spec is not None
                       else None)
        per_key: dict[str, int] = {}
        budget = 200 * (self.n["train"] + self.n["heldout"]) + 100
        for _ in range(budget):
            if all(len(out[s]) >= self.n[s] for s in out):
                break
            params = family.sample(rng)
            if rule is not None:
                params[spec.target] = rule[params[spec.key]]
            instruction = family.instruction(params)
            split = self._split_of(instruction)
            signature = json.dumps(params, sort_keys=True)
            if len(out[split]) >= self.n[split] or signature in seen:
                continue
            if split == "heldout" and per_key_cap is not None:
                if per_key.get(params[spec.key], 0) >= per_key_cap:
                    continue
                per_key[params[spec.key]] = per_key.get(params[spec.key], 0) + 1
            seen.add(signature)
            out[split].append(Task(
                task_id=f"{family.family_id}/{split}/{len(out[split]):04d}",
                env_id=ENV_ID, instruction=instruction, family=family.family_id,
                payload={"family": family.family_id, "domain": family.domain,
                         "params": params}))
        for split, tasks in out.items():
            if len(tasks) < self.n[split]:
                raise ValueError(
                    f"family {family.family_id!r} produced only {len(tasks)} unique "
                    f"{split} tasks (asked {self.n[split]}); lower n_{split}_per_family")
        return out

    def tasks(self, split: str) -> list[Task]:
        """Tasks of ``split``, grouped by family in a fixed order."""
        check_split(split)
        if self._cache is None:
            cache: dict[str, list[Task]] = {"train": [], "heldout": []}
            for fid in self.families:
                for s, tasks in self._generate(ALL_FAMILIES[fid]).items():
                    cache[s] += tasks
            self._cache = cache
        return list(self._cache[split])

    def warmup_tasks(self) -> list[Task]:
        """The supervised warm-up's tasks: with ``n_warmup_per_family > 0``, that many per
        family from a stream of their own (instructions that are in neither split; a hidden
        rule's target drawn uniformly per task); otherwise the training tasks."""
        if self.n_warmup <= 0:
            return self.tasks("train")
        if self._warmup is None:
            taken = {t.instruction for s in ("train", "heldout") for t in self.tasks(s)}
            out: list[Task] = []
            for fid in self.families:
                family, rule = ALL_FAMILIES[fid], HIDDEN_RULES.get(fid)
                rng = random.Random(f"lopd-synthetic-warmup:{self.seed}:{fid}")
                seen: set[str] = set()
                n = 0
                for _ in range(200 * self.n_warmup + 100):
                    if n >= self.n_warmup:
                        break
                    params = family.sample(rng)
                    if rule is not None:
                        params[rule.target] = rng.choice(rule.values)
                    instruction = family.instruction(params)
                    signature = json.dumps(params, sort_keys=True)
                    if instruction in taken or signature in seen:
                        continue
                    seen.add(signature)
                    out.append(Task(task_id=f"{fid}/warmup/{n:04d}", env_id=ENV_ID, instruction=instruction,
                                    family=fid, payload={"family": fid, "domain": family.domain, "params": params}))
                    n += 1
                if n < self.n_warmup:
                    raise ValueError(f"family {fid!r} produced only {n} unique warm-up tasks "
                                     f"(asked {self.n_warmup}); lower n_warmup_per_family")
            self._warmup = out
        return list(self._warmup)

    def make_env(self) -> "SyntheticEnvironment":
        """A fresh synthetic environment."""
        return SyntheticEnvironment(tool_descriptions=self.tool_descriptions)

    def oracle_hint(self, task: Task) -> str:
        """The oracle's turns as text (see :func:`oracle_hint`), or its calls alone with
        ``hint="calls"``."""
        return oracle_hint(task, calls_only=self.hint == "calls")

    def cluster_key(self, task: Task) -> str:
        """The hidden rule's key for a family with one (``dispatch.ship:customer=carol``: every
        task of a customer depends on the same hidden hub), else the task id."""
        rule = HIDDEN_RULES.get(task.family)
        params = task.payload.get("params", {})
        return f"{task.family}:{rule.key}={params[rule.key]}" if rule is not None and rule.key in params else task.task_id


def _without_descriptions(schema: Any) -> Any:
    """A copy of a JSON schema without its ``description`` fields."""
    if isinstance(schema, dict):
        return {k: _without_descriptions(v) for k, v in schema.items() if k != "description"}
    if isinstance(schema, list):
        return [_without_descriptions(v) for v in schema]
    return schema


def _family_of(task: Task) -> Family:
    if task.env_id != ENV_ID:
        raise ValueError(f"task {task.task_id!r} belongs to {task.env_id!r}, not {ENV_ID!r}")
    fid = task.payload.get("family")
    if fid not in ALL_FAMILIES or "params" not in task.payload:
        raise ValueError(f"task {task.task_id!r} has no valid synthetic payload "
                         f"(family {fid!r}); build tasks with SyntheticTaskSource")
    return ALL_FAMILIES[fid]


class SyntheticEnvironment(ToolUseEnvironment):
    """One episode of a synthetic task; tools are the domain state's public methods."""

    env_id = ENV_ID

    def __init__(self, tool_descriptions: bool = True):
        """``tool_descriptions=False`` shows schemas without description fields."""
        super().__init__()
        self.tool_descriptions = tool_descriptions

    def _setup(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        self._family = _family_of(task)
        self._params: dict[str, Any] = task.payload["params"]
        self._domain = ALL_DOMAINS[self._family.domain]
        self._state = self._domain.build(json.loads(json.dumps(self._params["initial"])))
        self._toolbox = Toolbox(self._state)
        self._ran: list[tuple[str, Any]] = []  # (name, arguments) of calls that ran
        messages = [{"role": "system", "content": self._domain.system},
                    {"role": "user", "content": task.instruction}]
        schemas = [dict(s) for s in self._toolbox.schemas]
        return messages, schemas if self.tool_descriptions else [_without_descriptions(s) for s in schemas]

    def _invoke(self, name: str, arguments: dict[str, Any]) -> str:
        self._ran.append((name, arguments))  # validated: it runs (it may still raise inside)
        return self._toolbox.call(name, arguments)

    def _checks(self) -> list[tuple[str, Any, bool]]:
        """(description, predicate(state, answer), is_goal) for the task."""
        checks = self._family.checks(self._params)
        initial = dict(self._params["initial"])
        out = [(desc, fn, not fn(initial, "")) for desc, fn in checks]
        if not any(goal for _, _, goal in out) and self._family.family_id in VERIFY:
            desc, lookups = VERIFY[self._family.family_id](self._params)
            out.append((desc, lambda st, ans: any(c in self._ran for c in lookups), True))
        return out

    def check_results(self) -> list[tuple[str, bool]]:
        """Each check's description and whether it passes on the current state."""
        return [(desc, ok) for desc, ok, _ in self._results()]

    def _results(self) -> list[tuple[str, bool, bool]]:
        if self.task is None:
            raise RuntimeError("check_results() called before reset(task)")
        snap = self._domain.snapshot(self._state)
        answer = self.final_answer or ""
        return [(desc, bool(fn(snap, answer)), goal) for desc, fn, goal in self._checks()]

    def _score(self) -> float:
        results = self._results()
        if not self._ran or not any(ok and goal for _, ok, goal in results):
            return 0.0
        return sum(ok for _, ok, _ in results) / len(results)


def render_tool_call(call: ToolCall) -> str:
    """A call in the Qwen3 / Hermes ``<tool_call>`` text form."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def oracle_calls(task: Task) -> tuple[list[ToolCall], str]:
    """The exact correct tool calls for ``task`` and a correct final answer."""
    family = _family_of(task)
    return family.oracle(task.payload["params"])


def oracle_turns(task: Task) -> list[AssistantTurn]:
    """The oracle policy as assistant turns: one tool call per turn, then the answer."""
    calls, answer = oracle_calls(task)
    turns = [AssistantTurn(raw=render_tool_call(c), content="", tool_calls=[c]) for c in calls]
    return turns + [AssistantTurn(raw=answer, content=answer)]


def oracle_argument(task: Task) -> tuple[int, str, str] | None:
    """``(turn, argument name, value)`` of the oracle tool call that carries the task
    family's hidden-rule target (``dispatch.ship``: the ``hub`` of ``ship_order``), the
    argument whose teacher-forced probability measures whether a policy learned the rule;
    None for a family without a hidden rule."""
    rule = HIDDEN_RULES.get(task.family)
    if rule is None:
        return None
    calls, _ = oracle_calls(task)
    for i, call in enumerate(calls):
        if rule.target in call.arguments:
            return i, rule.target, str(call.arguments[rule.target])
    return None


def oracle_hint(task: Task, calls_only: bool = False) -> str:
    """The exact correct assistant turns as one text: each tool call in the ``<tool_call>``
    form the policy writes, one per line block, then the final answer (left out with
    ``calls_only``)."""
    calls, answer = oracle_calls(task)
    return "\n".join([render_tool_call(c) for c in calls] + ([] if calls_only else [answer]))

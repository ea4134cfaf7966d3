"""ACEBench's simulated user for the suite: a model answering through the rollout API.

Upstream simulates the ``agent_multi_turn`` user with ``gpt-4o`` (``common_inference.py``'s
``user_model``); here it is the evaluated policy itself by default, or any Hugging Face
checkpoint (``python -m lopd_jax.evaluate --suite=... --acebench_user_model=PATH``). Each
reply is one greedy assistant turn of :func:`lopd_jax.rollout.episodes.rollout` on a one-step
environment that holds the simulator's chat; the visible answer (thinking removed) is the
user's line. Calls are serialised by a lock: the agents' environments may step in several
threads.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import jax

from lopd_jax.chat.formats import make_chat_format
from lopd_jax.envs.base import Environment
from lopd_jax.core.types import AssistantTurn, Message, StepResult, Task, ToolSchema
from lopd_jax.programs.policy import TINY, load_policy
from lopd_jax.settings.sections import RolloutConfig, SamplingParams
from lopd_jax.rollout.engine import Engine
from lopd_jax.rollout.episodes import rollout


class _ReplyEnvironment(Environment):
    """One turn: the chat of the task's payload, any answer ends the episode."""

    env_id = "acebench_user"

    def reset(self, task: Task) -> tuple[list[Message], list[ToolSchema]]:
        """The simulator's chat so far; no tools."""
        self.done = False
        return list(task.payload["messages"]), []

    def step(self, turn: AssistantTurn) -> StepResult:
        """The reply is in the trajectory's messages; done."""
        self.done = True
        return StepResult([], True, 0.0, {})

    def finish(self) -> float:
        """Cut off: nothing to score."""
        self.done = True
        return 0.0


class RolloutUser:
    """A :data:`lopd_jax.envs.acebench.agent.UserSimulator` backed by a rollout engine (greedy).

    ``name`` is recorded in the report (e.g. ``"policy"`` or the checkpoint path).
    """

    def __init__(self, engine: Engine, params: Any, fmt: Any, name: str, max_turn_tokens: int,
                 max_total_tokens: int, seed: int = 0):
        """``max_turn_tokens`` / ``max_total_tokens``: the caps of each reply."""
        if jax.process_count() > 1:
            raise ValueError("the ACEBench user simulator runs on one process; run the suite on one host "
                             "to grade agent_multi_turn")
        # its own copy: a reply is rolled out while the agent's engine is inside its own run
        self.engine, self.params, self.fmt, self.name = copy.copy(engine), params, fmt, name
        self.config = RolloutConfig(max_env_steps=1, max_turn_tokens=max_turn_tokens,
                                    max_total_tokens=max_total_tokens)
        self.key, self.calls, self.lock = jax.random.key(seed), 0, threading.Lock()

    def __call__(self, messages: list[Message]) -> str:
        """The simulated user's next line for the chat ``messages`` ('' if cut off)."""
        task = Task(task_id=f"user-{self.calls}", env_id=_ReplyEnvironment.env_id, instruction="",
                    payload={"messages": list(messages)})
        with self.lock:
            self.calls += 1
            traj, = rollout(self.engine, self.params, self.fmt, _ReplyEnvironment, [task],
                            jax.random.fold_in(self.key, self.calls), self.config,
                            sampling=SamplingParams(0.0, 1.0, 0))
        last = traj.messages[-1]
        return str(last.get("content") or "") if last.get("role") == "assistant" else ""


def user_simulator(args: Any, engine: Engine, params: Any, fmt: Any) -> RolloutUser:
    """The suite's simulator: ``args.acebench_user_model`` (a checkpoint, or ``tiny``)
    loaded as a second policy, else the evaluated policy (``engine``, ``params``, ``fmt``)."""
    caps = dict(max_turn_tokens=args.max_turn_tokens or 10_000, max_total_tokens=args.max_total_tokens or 40_960)
    path = getattr(args, "acebench_user_model", None)
    if not path:
        return RolloutUser(engine, params, fmt, "policy (the evaluated model)", seed=args.seed, **caps)
    model, tok, family = load_policy(path, seed=args.seed, dtype=args.dtype)
    user_fmt = make_chat_format(family, tok, enable_thinking=args.enable_thinking,
                                use_tokenizer_template=path != TINY and bool(getattr(tok, "chat_template", None)))
    user_engine = Engine(model, stop_ids=user_fmt.stop_ids, pad_id=tok.pad_token_id or 0)
    return RolloutUser(user_engine, Engine.params_of(model), user_fmt, f"checkpoint {path}", seed=args.seed,
                       **caps)

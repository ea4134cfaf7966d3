"""One process of the host-dependent rollout check in ``tests/train/test_multihost.py``.

    python tests/train/multihost_rollout_worker.py ADDRESS NUM_PROCESSES PROCESS_ID OUT.json

Rolls out 8 synthetic tasks (global batch of 8 rows on an 8-device mesh) with the scripted
oracle policy of ``tests/rollout/test_rollout.py``, through an environment that is deliberately
host-dependent: its reward is offset by ``10 * (process_index + 1)`` and its observations
name the host. Each process rolls out only the rows it owns (on its own engine); then the step-batch path is
taken (rewards and token rows of this process -> global arrays with
``make_array_from_process_local_data``), the global arrays are gathered back, and process 0
writes, per row: the owning process the gathered global batch shows, its reward and
whether its ids carry that host's observation marker.
"""

import json
import os
import sys

from train.distributed import initialize  # noqa: E402

initialize(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from lopd_jax.chat.formats import make_chat_format  # noqa: E402
from lopd_jax.envs.synthetic.env import SyntheticTaskSource  # noqa: E402
from lopd_jax.chat.tokenizers import tiny_tokenizer  # noqa: E402
from lopd_jax.core.types import StepResult  # noqa: E402
from tests.rollout.test_rollout import ScriptedLM, oracle_script  # noqa: E402
from train import distributed, mesh as mesh_lib  # noqa: E402
from lopd_jax.rollout.engine import Engine
from lopd_jax.settings.sections import EngineConfig, MeshConfig, RolloutConfig, SamplingParams  # noqa: E402
from lopd_jax.rollout.episodes import rollout, training_arrays  # noqa: E402

ROWS = 8


class HostDependentEnv:
    """A synthetic environment whose reward and observations depend on the host running it."""

    def __init__(self, env):
        self.env = env
        self.stats = env.stats
        self.tag = 10.0 * (jax.process_index() + 1)

    def reset(self, task):
        return self.env.reset(task)

    def step(self, turn):
        r = self.env.step(turn)
        obs = [{**m, "content": f"{m.get('content') or ''} host{jax.process_index()}"} for m in r.observation]
        return StepResult(observation=obs, done=r.done, reward=r.reward + self.tag if r.done else r.reward,
                          info=r.info)

    def finish(self):
        return self.env.finish() + self.tag

    def close(self):
        self.env.close()


def main(out_path: str) -> None:
    fmt = make_chat_format("qwen3", tiny_tokenizer("qwen3"))
    source = SyntheticTaskSource(n_train_per_family=1, n_heldout_per_family=1, seed=3)
    tasks = source.tasks("train")[:ROWS]
    scripts = [oracle_script(fmt, source, t)[0] for t in tasks]
    mesh = mesh_lib.make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))
    rules = mesh_lib.rules_for(mesh)
    model = ScriptedLM(scripts, len(fmt.tokenizer), fmt.end_of_turn_id)
    engine = Engine(model, stop_ids=fmt.stop_ids, sampling=SamplingParams(temperature=0.0),
                    config=EngineConfig(slots=4, page_size=64, decode_chunk=8, prefill_chunk=256, env_workers=0))
    params = jax.device_put(Engine.params_of(model), rules.replicated())
    lo, hi = distributed.row_range(mesh_lib.batch_sharding(rules, 1), ROWS)
    mine = rollout(engine, params, fmt, lambda: HostDependentEnv(source.make_env()), tasks[lo:hi],
                   jax.random.key(0), RolloutConfig(max_env_steps=4, max_turn_tokens=64, max_total_tokens=2048),
                   first_episode=lo)
    # the step-batch path: process-local rows -> global arrays -> gathered back for the check
    arr = training_arrays(mine, length=2048)
    sh1, sh2 = mesh_lib.batch_sharding(rules, 1), mesh_lib.batch_sharding(rules, 2)
    rewards = multihost_utils.process_allgather(distributed.global_array(arr["rewards"], sh1), tiled=True)
    tokens = multihost_utils.process_allgather(distributed.global_array(arr["tokens"], sh2), tiled=True)
    owners = multihost_utils.process_allgather(
        distributed.global_array(np.full(hi - lo, jax.process_index(), np.int32), sh1), tiled=True)
    markers = {p: fmt.encode(f" host{p}") for p in range(jax.process_count())}
    oracle = [oracle_script(fmt, source, t)[2] for t in tasks]

    def has(ids, sub):
        ids = [int(x) for x in ids]
        return any(ids[i:i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))

    if jax.process_index() == 0:
        rows = [{"row": r, "owner": int(owners[r]), "reward": float(rewards[r]), "oracle_reward": float(oracle[r]),
                 "markers": [p for p, m in markers.items() if has(tokens[r], m)]} for r in range(ROWS)]
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "local_rows": [lo, hi]}, f)
    distributed.sync("done")


if __name__ == "__main__":
    main(sys.argv[4])

"""Task pipeline: determinism, per-epoch order, exact resume, multi-host partition."""

import json

import pytest

from lopd_jax.core.types import Task
from train.data import TaskPipeline

pytestmark = pytest.mark.timeout(60)


def _tasks(n=10):
    return [Task(task_id=f"t{i}", env_id="synthetic", instruction=f"do {i}", family=f"f{i % 3}") for i in range(n)]


def _ids(batch):
    return [t.task_id for t in batch]


def test_deterministic_and_epoch_dependent():
    tasks = _tasks(10)
    a = iter(TaskPipeline(tasks, 5, seed=3, process_count=1, process_index=0))
    b = iter(TaskPipeline(tasks, 5, seed=3, process_count=1, process_index=0))
    run_a = [_ids(next(a)) for _ in range(6)]
    assert run_a == [_ids(next(b)) for _ in range(6)]
    epochs = [sum(run_a[2 * e:2 * e + 2], []) for e in range(3)]
    for e in epochs:  # each epoch is a permutation of all tasks ...
        assert sorted(e) == sorted(t.task_id for t in tasks)
    assert len({tuple(e) for e in epochs}) == 3  # ... in a different order per epoch
    assert epochs[0] != [t.task_id for t in tasks]  # shuffled
    other = iter(TaskPipeline(tasks, 5, seed=4, process_count=1, process_index=0))
    assert [_ids(next(other)) for _ in range(2)] != run_a[:2]
    assert all(isinstance(t, Task) for t in next(a))


def test_resume_continues_exactly():
    tasks = _tasks(7)  # batches straddle epoch boundaries
    pipe = TaskPipeline(tasks, 3, seed=0, process_count=1, process_index=0)
    it = iter(pipe)
    for _ in range(4):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert it.step == 4 and it.epoch == 12 // 7
    expected = [_ids(next(it)) for _ in range(5)]
    resumed = iter(TaskPipeline(tasks, 3, seed=0, process_count=1, process_index=0))
    resumed.set_state(state)
    assert [_ids(next(resumed)) for _ in range(5)] == expected
    assert _ids(pipe[4]) == expected[0]  # random access agrees with the iterator
    with pytest.raises(ValueError, match="same task list"):
        iter(TaskPipeline(_tasks(8), 3, seed=0, process_count=1, process_index=0)).set_state(state)
    with pytest.raises(ValueError, match="not a task-iterator state"):
        iter(pipe).set_state({"next_index": 3})


def test_two_processes_partition_each_global_batch():
    tasks = _tasks(12)
    single = iter(TaskPipeline(tasks, 4, seed=1, process_count=1, process_index=0))
    hosts = [iter(TaskPipeline(tasks, 4, seed=1, process_count=2, process_index=p)) for p in range(2)]
    seen = []
    for _ in range(6):  # two epochs
        glob = _ids(next(single))
        local = [_ids(next(h)) for h in hosts]
        assert all(len(x) == 2 for x in local)
        assert not set(local[0]) & set(local[1])
        assert local[0] + local[1] == glob  # contiguous blocks in process order: the global row order
        seen += local[0] + local[1]
    assert sorted(seen[:12]) == sorted(t.task_id for t in tasks)
    # host state counts global steps: it resumes on a different number of hosts
    state = hosts[0].get_state()
    one = iter(TaskPipeline(tasks, 4, seed=1, process_count=1, process_index=0))
    one.set_state(state)
    assert sorted(_ids(next(one))) == sorted(_ids(next(hosts[0])) + _ids(next(hosts[1])))


def test_eval_pass_and_bad_input():
    tasks = _tasks(5)
    ev = TaskPipeline(tasks, 2, shuffle=False, repeat=False, drop_remainder=False, process_count=1, process_index=0)
    assert [_ids(b) for b in ev] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    with pytest.raises(ValueError, match="empty"):
        TaskPipeline([], 2, process_count=1, process_index=0)
    with pytest.raises(ValueError, match="multiple of 2"):
        TaskPipeline(tasks, 3, process_count=2, process_index=0)

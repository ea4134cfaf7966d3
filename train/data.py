"""The task pipeline: B tasks per step from a task list, as a grain dataset.

::

    pipe = TaskPipeline(source.tasks("train"), global_batch=32, seed=cfg.seed)
    it = iter(pipe)
    tasks = next(it)                       # this host's share of the step's B tasks
    meta["data"] = it.get_state()          # JSON; saved with the checkpoint
    it = iter(pipe); it.set_state(meta["data"])   # resume: the same continuation

Order: grain's global shuffle over the whole list, reseeded per epoch (``seed + epoch``),
repeated forever. Multi-host: process ``p`` takes the ``p``-th contiguous block of each
global batch, so the local batches concatenated in process order are the global batch
(:mod:`train.distributed`). The iterator state counts global steps, so it is the same on
every host and stays valid when a run resumes on another number of hosts.
"""

from __future__ import annotations

from typing import Any, Generic, Sequence, TypeVar

import grain
import jax

T = TypeVar("T")

# tasks are cheap Python objects; prefetch threads would only add overhead
_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def task_stream(items: Sequence[T], *, seed: int, shuffle: bool = True, repeat: bool = True) -> grain.MapDataset:
    """The global element stream: ``items`` shuffled by (seed, epoch) and repeated."""
    if len(items) == 0:
        raise ValueError("the task list is empty; check the task source and split names in the config.")
    if not 0 <= seed < 2 ** 32:
        raise ValueError(f"seed={seed} must be in [0, 2**32).")
    ds = grain.MapDataset.source(list(items))
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat() if repeat else ds


class TaskPipeline(Generic[T]):
    """Batches of tasks per step for this process, from a grain ``MapDataset``.

    Args:
      items: the tasks (any sequence; :class:`lopd_jax.core.types.Task` in the loop).
      global_batch: B, tasks per step over all processes (divisible by process_count).
      seed: shuffle seed; epoch ``e`` uses ``seed + e``.
      shuffle / repeat: False / False give one pass in order (evaluation).
      drop_remainder: without repeat, drop a last partial batch.
      process_index / process_count: default ``jax.process_index()`` / ``jax.process_count()``.
    """

    def __init__(self, items: Sequence[T], global_batch: int, *, seed: int = 0, shuffle: bool = True,
                 repeat: bool = True, drop_remainder: bool = True, process_index: int | None = None,
                 process_count: int | None = None):
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if global_batch < 1:
            raise ValueError(f"global_batch={global_batch} must be >= 1.")
        if not 0 <= self.process_index < self.process_count:
            raise ValueError(f"process_index={self.process_index} is outside [0, {self.process_count}).")
        if global_batch % self.process_count:
            raise ValueError(f"global_batch={global_batch} tasks per step do not split over "
                             f"{self.process_count} processes; use a multiple of {self.process_count}.")
        self.num_items = len(items)
        self.global_batch = global_batch
        self.local_batch = global_batch // self.process_count
        self.seed = seed
        stream = task_stream(items, seed=seed, shuffle=shuffle, repeat=repeat)
        lo, hi = self.process_index * self.local_batch, (self.process_index + 1) * self.local_batch
        self.dataset: grain.MapDataset = stream.batch(global_batch, drop_remainder=drop_remainder,
                                                      batch_fn=lambda xs: list(xs)[lo:hi])

    def steps_per_epoch(self) -> float:
        """Global steps per pass over the task list."""
        return self.num_items / self.global_batch

    def epoch_at(self, step: int) -> int:
        """The epoch that the first task of global step ``step`` belongs to."""
        return step * self.global_batch // self.num_items

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, step: int) -> list[T]:
        """This process's batch of global step ``step`` (random access, no iterator)."""
        return self.dataset[step]

    def __iter__(self) -> "TaskIterator[T]":
        return TaskIterator(self)


class TaskIterator(Generic[T]):
    """A checkpointable iterator over a :class:`TaskPipeline` (grain ``DatasetIterator``).

    :meth:`get_state` is a JSON-serializable dict; :meth:`set_state` resumes exactly
    after the last batch returned before it was taken.
    """

    def __init__(self, pipeline: TaskPipeline[T]):
        self.pipeline = pipeline
        self._it = pipeline.dataset.to_iter_dataset(_READ).__iter__()

    def __iter__(self) -> "TaskIterator[T]":
        return self

    def __next__(self) -> list[T]:
        return next(self._it)

    @property
    def step(self) -> int:
        """Global steps consumed so far."""
        return int(self._it.get_state()["next_index"])

    @property
    def epoch(self) -> int:
        """Epoch of the next batch's first task."""
        return self.pipeline.epoch_at(self.step)

    def get_state(self) -> dict[str, Any]:
        """The position plus a fingerprint of the pipeline (checked on resume)."""
        p = self.pipeline
        return {"grain": dict(self._it.get_state()), "num_items": p.num_items, "global_batch": p.global_batch,
                "seed": p.seed}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`get_state`, maybe on another host count)."""
        p = self.pipeline
        try:
            saved = {k: state[k] for k in ("num_items", "global_batch", "seed")}
            inner = dict(state["grain"])
        except (KeyError, TypeError):
            raise ValueError(f"not a task-iterator state: {state!r}; expected the dict get_state() gave.") from None
        now = {"num_items": p.num_items, "global_batch": p.global_batch, "seed": p.seed}
        if saved != now:
            raise ValueError(f"the data iterator was saved for {saved} but this pipeline is {now}; "
                             "resume with the same task list, batch size and seed.")
        self._it.set_state(inner)


__all__ = ["TaskPipeline", "TaskIterator", "task_stream"]

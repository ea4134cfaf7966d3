"""Multi-host helpers: start-up, row ownership, host-local arrays, small cross-host reductions.

A run on N hosts is N cooperating JAX processes (one per host, or several per machine
for local tests). Every process runs the same program; the sampler and the train steps
are single global SPMD programs over the whole mesh. What differs per process is data:
each process owns a contiguous block of every batch's rows (the rows of the batch
sharding that live on its devices), runs only those rows' environments, feeds only
those rows (:func:`global_array`) and reads back only those rows (:func:`local_rows`).
Anything every host must agree on (shapes, "are all rows done", metrics, the bank's
contents) goes through a small collective here (:func:`global_max`,
:func:`allgather_objects`).

On one process every helper degenerates to the obvious single-host operation, so the
same code paths run on a laptop, in the multi-process tests and on a slice.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

ENV_ADDRESS, ENV_NUM, ENV_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"
HEARTBEAT_ENV = "LOPD_HEARTBEAT_SECONDS"
DEFAULT_HEARTBEAT_SECONDS = 30


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, heartbeat_seconds: int | None = None) -> bool:
    """Start the multi-controller runtime when the run is multi-process; returns whether it did.

    Explicit arguments win over the environment variables ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``. Without either, a Cloud TPU VM whose
    ``TPU_WORKER_HOSTNAMES`` lists more than one host initializes with automatic
    detection; anything else is a single-process run (no-op).

    ``heartbeat_seconds`` (default ``$LOPD_HEARTBEAT_SECONDS`` or 30) bounds how long
    the survivors wait for a process that died: the coordination service then reports
    it missing and every other process exits with an error instead of hanging.
    """
    address = coordinator_address or os.environ.get(ENV_ADDRESS) or None
    num = num_processes if num_processes is not None else _int_env(ENV_NUM)
    pid = process_id if process_id is not None else _int_env(ENV_ID)
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if address is None and num is None and pid is None and len(hosts) <= 1:
        return False
    if address is not None or num is not None or pid is not None:
        missing = [n for n, v in (("coordinator_address", address), ("num_processes", num),
                                  ("process_id", pid)) if v is None]
        if missing and len(hosts) <= 1:
            raise ValueError(f"a multi-process launch needs --coordinator_address, --num_processes and "
                             f"--process_id (or {ENV_ADDRESS}, {ENV_NUM}, {ENV_ID}); missing: {missing}.")
        if num is not None and pid is not None and not 0 <= pid < num:
            raise ValueError(f"process_id={pid} is outside [0, num_processes={num}).")
    hb = heartbeat_seconds if heartbeat_seconds is not None else (_int_env(HEARTBEAT_ENV)
                                                                  or DEFAULT_HEARTBEAT_SECONDS)
    if address is not None and jax.config.jax_platforms and "cpu" in jax.config.jax_platforms:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid,
                               heartbeat_timeout_seconds=hb, initialization_timeout=120,
                               shutdown_timeout_seconds=60)
    if address is not None and jax.config.jax_platforms and "cpu" in jax.config.jax_platforms:
        share_cpu_compilation_cache()
    return True


def share_cpu_compilation_cache() -> bool:
    """Give every process of a multi-process CPU run the same persistent-cache keys.

    JAX keys its persistent compilation cache partly on the devices' topology fingerprint,
    and on the CPU client that fingerprint differs between processes of one run. Only
    process 0 writes cache entries, so on CPU every other process missed every entry and
    recompiled every program on every restart (about 80 s per 2-process restart of the
    tiny run, the whole first step). This hashes the global device layout instead: device
    ids, their processes and kinds -- the same on every process, and still different for
    one process with 8 devices and two with 4. TPU and GPU keys are untouched. Returns
    whether the hook was installed (False where this JAX has no such key function; the
    cache then simply stays per-process).
    """
    try:
        from jax._src import cache_key  # private JAX module, absent in some versions
    except ImportError:
        return False
    original = getattr(cache_key, "_hash_accelerator_config", None)
    if original is None or getattr(original, "_lopd_shared", False):
        return original is not None

    def hash_accelerator_config(hash_obj, accelerators):
        devices = list(accelerators.flat)
        if not devices or any(d.platform != "cpu" for d in devices):
            return original(hash_obj, accelerators)
        layout = ";".join(f"{d.id}:{d.process_index}:{d.device_kind}" for d in devices)
        hash_obj.update(layout.encode())

    hash_accelerator_config._lopd_shared = True
    cache_key._hash_accelerator_config = hash_accelerator_config
    return True


def _int_env(name: str) -> int | None:
    v = os.environ.get(name, "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"${name}={v!r} is not an integer.") from None


def multiprocess() -> bool:
    """Whether this run has more than one JAX process."""
    return jax.process_count() > 1


# ----------------------------------------------------------------------------- rows


def row_range(sharding, num_rows: int) -> tuple[int, int]:
    """``[start, stop)``: the rows of a ``num_rows``-row batch that live on this process's
    devices under ``sharding`` (batch-major). Every row has exactly one owning process.

    Raises ValueError when the process's rows are not one contiguous block, or when a
    row is held by several processes (the batch axis must be split across hosts).
    """
    if sharding is None or not multiprocess():
        return 0, num_rows
    idx = sharding.devices_indices_map((num_rows,))
    mine = sorted({_bounds(i[0], num_rows) for d, i in idx.items() if d.process_index == jax.process_index()})
    owners: dict[tuple[int, int], set[int]] = {}
    for d, i in idx.items():
        owners.setdefault(_bounds(i[0], num_rows), set()).add(d.process_index)
    if any(len(p) > 1 for p in owners.values()):
        raise ValueError("the batch rows are replicated across processes; put the batch axis (act_batch -> "
                         "data x fsdp) over all hosts, e.g. mesh.fsdp=-1.")
    start, stop = mine[0][0], mine[-1][1]
    if sum(b - a for a, b in mine) != stop - start:
        raise ValueError(f"process {jax.process_index()} holds non-contiguous rows {mine} of the batch.")
    return start, stop


def _bounds(s: slice, n: int) -> tuple[int, int]:
    a, b, _ = s.indices(n)
    return a, b


def global_array(local: np.ndarray, sharding, global_rows: int | None = None) -> jax.Array:
    """A global batch-major array from this process's rows (``jax.make_array_from_process_local_data``)."""
    local = np.asarray(local)
    if not multiprocess():
        return jax.device_put(local, sharding)
    shape = None if global_rows is None else (global_rows, *local.shape[1:])
    return jax.make_array_from_process_local_data(sharding, local, shape)


def replicated_array(x: np.ndarray, sharding) -> np.ndarray | jax.Array:
    """``x`` (equal on every process) as a global array replicated on ``sharding`` (a
    replicated ``NamedSharding``); ``x`` itself as numpy when ``sharding`` is None (no mesh)."""
    x = np.asarray(x)
    return x if sharding is None else global_array(x, sharding, len(x) if x.ndim else None)


def local_copy(arr) -> np.ndarray:
    """A replicated (or single-process) array as numpy, from this process's own copy."""
    if isinstance(arr, jax.Array) and not arr.is_fully_addressable:
        arr = arr.addressable_data(0)
    return np.asarray(arr)


def local_rows(arr) -> np.ndarray:
    """The rows of a batch-major array that live on this process, as numpy (all rows on one process)."""
    if not multiprocess() or not isinstance(arr, jax.Array) or arr.is_fully_addressable:
        return np.asarray(arr)
    shards: dict[int, Any] = {}
    for s in arr.addressable_shards:
        shards.setdefault(s.index[0].indices(arr.shape[0])[0] if arr.ndim else 0, s.data)
    return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])


# ----------------------------------------------------------------------------- reductions


def global_max(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """Elementwise max over processes of a small int vector (identical result everywhere)."""
    v = np.asarray(values, np.int64).reshape(-1)
    if not multiprocess():
        return v
    return np.asarray(multihost_utils.process_allgather(v.astype(np.int32))).reshape(jax.process_count(), -1).max(0)


def global_any(flag: bool) -> bool:
    """Whether ``flag`` is true on any process."""
    return bool(global_max([int(bool(flag))])[0])


def allgather_objects(obj: Any) -> list[Any]:
    """Every process's ``obj`` (picklable), in process order, on every process.

    The pickles travel as uint8 arrays padded to a power-of-two length (so repeated
    calls reuse a handful of compiled gathers).
    """
    if not multiprocess():
        return [obj]
    data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    n = int(global_max([data.size])[0])
    size = 1 << max(n - 1, 1).bit_length()
    buf = np.zeros(size + 8, np.uint8)
    buf[:8] = np.frombuffer(np.int64(data.size).tobytes(), np.uint8)
    buf[8:8 + data.size] = data
    out = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), -1)
    return [pickle.loads(row[8:8 + int(np.frombuffer(row[:8].tobytes(), np.int64)[0])].tobytes()) for row in out]


def allgather_list(items: Sequence[Any]) -> list[Any]:
    """The concatenation, in process order, of every process's list ``items``."""
    return [x for part in allgather_objects(list(items)) for x in part]


def sync(name: str) -> None:
    """A barrier across processes (no-op on one)."""
    if multiprocess():
        multihost_utils.sync_global_devices(name)


__all__ = ["initialize", "share_cpu_compilation_cache", "multiprocess", "row_range", "global_array", "replicated_array", "local_copy", "local_rows", "global_max", "global_any",
           "allgather_objects", "allgather_list", "sync"]

"""Per-run memory cgroups for the code sandbox: all of a run's processes share one limit.

:func:`make_memory_cgroup` creates a child of this process's own memory cgroup (so the
host's or container's limit still applies above it) and sets the limit with swap off:

* **cgroup v2** (a ``cgroup2`` mount whose cgroup here lists ``memory`` in
  ``cgroup.subtree_control``): ``memory.max``, ``memory.swap.max = 0``,
  ``memory.oom.group = 1`` (an OOM kills the whole run);
* **cgroup v1** (a ``cgroup`` mount with the ``memory`` controller):
  ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (memory + swap, so no
  swap; present when swap accounting is on), ``memory.swappiness = 0``.

When neither is writable (no root, no delegation) it returns None and warns once: the
per-process ``RLIMIT_AS`` is then the only memory bound, so N processes of one run can
together use N times it (the pids limit still caps N). :func:`oom_killed` tells whether
the kernel OOM-killed something in the cgroup (status ``"memory"``).
"""

from __future__ import annotations

import itertools
import os
import time
import warnings

_PREFIX = "lopd_sandbox_mem_"
_PARENT: list[tuple[str, str] | None] = []
_WARNED: list[bool] = []
_IDS = itertools.count()


def _own_cgroup_dirs() -> list[tuple[str, str]]:
    """(version, directory) of this process's cgroup on each memory-capable mount."""
    try:
        with open("/proc/self/cgroup") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return []
    v2_path = next((p for h, c, p in own if h == "0" and c == ""), None)
    v1_path = next((p for h, c, p in own if "memory" in c.split(",")), None)
    out = []
    for line in mounts:
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point = fields[3], fields[4]
        if tail[0] == "cgroup2" and v2_path is not None:
            version, path = "v2", v2_path
        elif tail[0] == "cgroup" and "memory" in tail[2].split(",") and v1_path is not None:
            version, path = "v1", v1_path
        else:
            continue
        rel = path[len(root):] if root != "/" and path.startswith(root) else path
        out.append((version, os.path.join(point, rel.lstrip("/"))))
    return out


def _usable_parent() -> tuple[str, str] | None:
    for version, directory in _own_cgroup_dirs():
        if version == "v2":
            try:
                with open(os.path.join(directory, "cgroup.subtree_control")) as f:
                    if "memory" not in f.read().split():
                        continue
            except OSError:
                continue
        if os.access(directory, os.W_OK):
            return version, directory
    return None


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def make_memory_cgroup(limit_bytes: int) -> tuple[str, str] | None:
    """Create a memory cgroup limited to ``limit_bytes`` (swap off); (version, path) or None.

    The caller moves the run into it (``cgroup.procs``) and removes it afterwards with
    :func:`remove_cgroup`.
    """
    if not _PARENT:
        _PARENT.append(_usable_parent())
    parent = _PARENT[0]
    if parent is not None:
        version, root = parent
        path = os.path.join(root, f"{_PREFIX}{os.getpid()}_{next(_IDS)}_{time.monotonic_ns()}")
        try:
            os.mkdir(path)
        except OSError:
            path = ""
        if path:
            if version == "v2":
                ok = _write(os.path.join(path, "memory.max"), str(limit_bytes))
                _write(os.path.join(path, "memory.swap.max"), "0")  # absent without swap
                _write(os.path.join(path, "memory.oom.group"), "1")
            else:
                ok = _write(os.path.join(path, "memory.limit_in_bytes"), str(limit_bytes))
                _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(limit_bytes))
                _write(os.path.join(path, "memory.swappiness"), "0")
            if ok:
                return version, path
            remove_cgroup(path)
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn("sandbox: no writable memory cgroup (cgroup v2 with the memory "
                      "controller delegated, or cgroup v1 memory, as root): each run's "
                      "memory is bounded per process only (RLIMIT_AS); run as root or "
                      "delegate the memory controller to bound it per run", RuntimeWarning,
                      stacklevel=3)
    return None


def cgroup_pids(path: str) -> list[int]:
    """The process ids in the cgroup (empty when it is gone)."""
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def oom_killed(cgroup: tuple[str, str] | None) -> bool:
    """Whether the kernel OOM-killed a process of the cgroup (reads its OOM counter)."""
    if cgroup is None:
        return False
    version, path = cgroup
    name = "memory.events" if version == "v2" else "memory.oom_control"
    try:
        with open(os.path.join(path, name)) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
    except (OSError, ValueError):
        pass
    return False


def remove_cgroup(path: str | None) -> None:
    """Remove the (empty) cgroup directory ``path`` (memory or pids; None: nothing), retrying
    while its last tasks exit."""
    if not path:
        return
    for _ in range(200):
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)

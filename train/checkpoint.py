"""Orbax checkpoints of the train state plus JSON metadata, and a preemption flag.

One :class:`Checkpointer` per directory wraps ``orbax.checkpoint.CheckpointManager`` with
two items per step: ``state`` (the train-state pytree, saved sharded and restored onto the
shardings the caller asks for) and ``meta`` (stage, step, data-iterator state, anything
the loop passes). Saves are asynchronous: :meth:`Checkpointer.save` returns once the arrays
are off the devices, so the state can be donated to the next step. A crash mid-save
leaves no step that :meth:`latest_step` would pick (Orbax renames a complete step into
place; a step with missing items is skipped). Keep stages with different state layouts
in separate directories (``<workdir>/checkpoints/<stage>``) so one stage's keep-last-k never
deletes another's final checkpoint.

Preemption: :func:`install_preemption_handler` turns SIGTERM into a flag the loop polls
with :func:`preemption_requested` (:func:`preemption_agreed` on multi-host, so all hosts
stop at the same step), then saves with ``force=True`` and exits.
"""

from __future__ import annotations

import base64
import os
import signal
import threading
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from lopd_jax.io.paths import resolve_path

STATE, META = "state", "meta"
_BYTES_TAG = "__bytes_b64__"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, read or written as asked."""


# ----------------------------------------------------------------------------- metadata JSON


def _encode(obj: Any, path: str = "metadata") -> Any:
    """``obj`` made JSON-safe: bytes -> tagged base64, numpy scalars -> Python, tuples -> lists."""
    if isinstance(obj, (bytes, bytearray)):
        return {_BYTES_TAG: base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{path}: JSON object keys must be str, got {bad[:3]}")
        return {k: _encode(v, f"{path}.{k}") for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"{path} is a {type(obj).__name__}, which metadata cannot hold; put arrays in the "
                    "state pytree and keep metadata to JSON values, bytes and numpy scalars.")


def _decode(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_BYTES_TAG}:
            return base64.b64decode(obj[_BYTES_TAG])
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- abstract targets


def abstract_tree(tree: Any, shardings: Any = None) -> Any:
    """``jax.ShapeDtypeStruct`` leaves for ``tree`` (arrays or ShapeDtypeStructs).

    ``shardings`` (a matching tree of Shardings) says where each leaf is restored; None
    keeps each leaf's own sharding, or the first device for leaves without one. With
    several processes a leaf without a global sharding (none, or one on this process's
    devices only, e.g. a scalar made with ``jnp.zeros``) is restored replicated over
    every device: the first device belongs to process 0 alone, and every process must
    restore the same global arrays.
    """
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if jax.process_count() > 1:
        default = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("all",)),
                                             jax.sharding.PartitionSpec())

    def own(x):
        s = getattr(x, "sharding", None)
        if s is None or (jax.process_count() > 1 and s.is_fully_addressable):
            return default
        return s

    def leaf(x, s=None):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s if s is not None else own(x))

    if shardings is None:
        return jax.tree.map(leaf, tree)
    return jax.tree.map(leaf, tree, shardings)


# ----------------------------------------------------------------------------- manager


class Checkpointer:
    """Periodic, asynchronous, keep-last-k checkpoints in ``directory``.

    Args:
      directory: local path or ``gs://`` URL (created if missing).
      every_steps: :meth:`save` without ``force`` writes only steps divisible by this.
      keep: how many of the newest checkpoints to keep (older ones are deleted).
      async_save: write files in a background thread (the device-to-host copy is
        always done before :meth:`save` returns).
    """

    def __init__(self, directory: str | os.PathLike, *, every_steps: int = 1, keep: int = 3,
                 async_save: bool = True):
        if every_steps < 1 or keep < 1:
            raise ValueError(f"every_steps={every_steps} and keep={keep} must both be >= 1.")
        self.directory = resolve_path(directory)  # Orbax needs absolute local paths
        self.every_steps = every_steps
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every_steps, max_to_keep=keep, create=True,
            cleanup_tmp_directories=True, enable_async_checkpointing=async_save)
        self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, META))

    @classmethod
    def from_config(cls, cfg, directory: str | None = None) -> "Checkpointer":
        """A Checkpointer from a :class:`lopd_jax.settings.config.TrainConfig`'s checkpoint section."""
        c = cfg.checkpoint
        return cls(directory or cfg.checkpoint_dir, every_steps=c.every_steps, keep=c.keep,
                   async_save=c.async_save)

    # ----- queries -----
    def _complete(self, step: int) -> bool:
        path = os.path.join(self.directory, str(step))
        if self.directory.startswith("gs://"):  # orbax checks commit_success.txt there
            return True
        return all(os.path.isdir(os.path.join(path, item)) for item in (STATE, META))

    def all_steps(self) -> list[int]:
        """Finalized steps with both items on disk, ascending."""
        return sorted(s for s in self._mgr.all_steps() if self._complete(s))

    def latest_step(self) -> int | None:
        """The newest finalized, complete step, or None when there is none."""
        self.wait()
        steps = self.all_steps()
        return steps[-1] if steps else None

    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` (without force) would write ``step``."""
        return step % self.every_steps == 0 and step not in self._mgr.all_steps()

    # ----- save / restore -----
    def save(self, step: int, state: Any, metadata: dict[str, Any] | None = None, *, force: bool = False) -> bool:
        """Save ``state`` and JSON ``metadata`` as ``step`` (every N-th step, or any with force).

        Returns whether a save was started. A step that already exists is not rewritten.
        """
        if step < 0:
            raise ValueError(f"step={step} must be >= 0.")
        if step in self._mgr.all_steps():
            return False
        if not force and step % self.every_steps:
            return False
        meta = _encode(dict(metadata or {}))
        try:
            return bool(self._mgr.save(step, args=ocp.args.Composite(
                **{STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}), force=True))
        except Exception as e:  # orbax raises assorted types; name the step and directory
            raise CheckpointError(f"saving step {step} to {self.directory} failed: {e}") from e

    def _resolve(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"no complete checkpoint in {self.directory}.")
        else:
            self.wait()
            if step not in self.all_steps():
                raise CheckpointError(f"step {step} is not a complete checkpoint in {self.directory}; "
                                      f"available: {self.all_steps()}")
        return step

    def restore(self, step: int | None = None, abstract_state: Any = None) -> tuple[Any, dict[str, Any]]:
        """``(state, metadata)`` of ``step`` (default: latest).

        ``abstract_state`` is a tree of ``jax.ShapeDtypeStruct`` with the target
        shardings (see :func:`abstract_tree`); arrays are resharded onto them, so the
        mesh may differ from the one that saved. None restores with the saved layout.
        """
        step = self._resolve(step)
        state_args = ocp.args.StandardRestore(abstract_state)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**{STATE: state_args, META: ocp.args.JsonRestore()}))
        except Exception as e:
            raise CheckpointError(self.unreadable(step, e)) from e
        return out[STATE], _decode(out[META])

    def unreadable(self, step: int, error: BaseException) -> str:
        """The message for checkpoint ``step`` that cannot be read: the step, the cause's first
        line, and the way on (move it aside to resume from the previous one; nothing is deleted)."""
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
        cause = cause if len(cause) <= 300 else cause[:300] + " ..."
        earlier = [s for s in self.all_steps() if s < step]
        back = (f"the previous checkpoint, step {earlier[-1]}" if earlier
                else "the start of this stage (there is no earlier checkpoint)")
        path = os.path.join(self.directory, str(step))
        return (f"checkpoint step {step} in {self.directory} cannot be read ({type(error).__name__}: {cause}). "
                f"If it is partial or corrupt (a full disk, an interrupted copy), move it out of the way and "
                f"rerun to resume from {back}: mv {path} {self.directory}-step{step}.unreadable (or delete it). "
                "If the code or config changed the state's layout, restore it with the matching version instead.")

    def read_metadata(self, step: int | None = None) -> dict[str, Any]:
        """Only the JSON metadata of ``step`` (default: latest); reads no arrays."""
        step = self._resolve(step)
        try:
            out = self._mgr.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))
        except Exception as e:
            raise CheckpointError(self.unreadable(step, e)) from e
        return _decode(out[META])

    def wait(self) -> None:
        """Block until in-flight async saves are written (errors surface here)."""
        self._mgr.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._mgr.wait_until_finished()
        self._mgr.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------- preemption

_PREEMPTED = threading.Event()


def install_preemption_handler(signals: tuple[int, ...] = (signal.SIGTERM,)) -> Callable[[], None]:
    """Make ``signals`` set the preemption flag instead of killing the process.

    Call from the main thread. Returns a function that puts the previous handlers back.
    """
    def handler(signum, frame):  # noqa: ARG001  (signal handler signature)
        _PREEMPTED.set()

    previous = {s: signal.signal(s, handler) for s in signals}

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h)
    return restore


def preemption_requested() -> bool:
    """Whether this process received a preemption signal."""
    return _PREEMPTED.is_set()


def preemption_agreed() -> bool:
    """True on every host when any host was signalled (a collective on multi-host:
    call it on all hosts at the same step)."""
    local = _PREEMPTED.is_set()
    if jax.process_count() == 1:
        return local
    return bool(np.any(multihost_utils.process_allgather(np.array(local))))


def request_preemption() -> None:
    """Set the preemption flag from this process (e.g. its Ctrl-C handler): the step loops
    then save and stop at the next step, as on SIGTERM."""
    _PREEMPTED.set()


def clear_preemption() -> None:
    """Reset the preemption flag (tests, or after a handled preemption)."""
    _PREEMPTED.clear()


__all__ = ["Checkpointer", "CheckpointError", "abstract_tree", "install_preemption_handler",
           "preemption_requested", "preemption_agreed", "request_preemption", "clear_preemption"]

"""Run files -- metrics, logs, plots, small JSON, tokenizer files -- on local disk or ``gs://``.

One small layer over :mod:`etils.epath` (which reaches Cloud Storage through ``gcsfs``, as
Orbax does), so every file a run writes goes where its workdir says; local paths are plain
files. Credentials and endpoints come from the standard environment only (Application
Default Credentials on a TPU VM, ``STORAGE_EMULATOR_HOST`` for an emulator).

Appends: Cloud Storage objects cannot be appended to. :class:`AppendFile` keeps a local
file open line-buffered; for a URL it holds the object's text in memory and rewrites the
whole object on :meth:`AppendFile.flush` (at every checkpoint save, at the end of a stage,
and after ``flush_seconds``), so a process killed on ``gs://`` loses at most the lines
since the last upload (docs/pods.md, "gs://").
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import tensorstore as ts
from etils import epath

from lopd_jax.io.paths import is_url


def epath_of(path: str | os.PathLike):
    """``path`` as an :class:`etils.epath.Path` (local or ``gs://``)."""
    return epath.Path(os.fspath(path))


def join(base: str, *parts: str) -> str:
    """``base/part/...`` for a local path or a URL (URLs always use ``/``)."""
    base = os.fspath(base)
    if is_url(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(base, *parts)


def exists(path: str) -> bool:
    """Whether the file (or, locally, the directory) ``path`` exists."""
    return epath_of(path).exists() if is_url(path) else os.path.exists(path)


def makedirs(path: str) -> None:
    """Create the local directory ``path`` (object stores have no directories: a no-op)."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def read_bytes(path: str) -> bytes:
    """The whole file; FileNotFoundError names ``path`` when it is absent."""
    if not exists(path):
        raise FileNotFoundError(f"{path} does not exist.")
    return epath_of(path).read_bytes()


def read_text(path: str) -> str:
    """The whole file as UTF-8 text."""
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
    """Create or replace the file ``path`` (its local parent directory is created)."""
    if not is_url(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    epath_of(path).write_bytes(data)


def write_text(path: str, text: str) -> None:
    """Create or replace the file ``path`` with UTF-8 ``text``."""
    write_bytes(path, text.encode("utf-8"))


def download_dir(url: str, local_dir: str, *, exclude_suffixes: tuple[str, ...] = ()) -> list[str]:
    """Copy the files directly in ``url`` (local or a URL; not its subdirectories) into the
    local directory ``local_dir``, leaving out names ending in ``exclude_suffixes`` (e.g.
    weight shards). Returns the names copied ([] when ``url`` is missing or empty)."""
    src = epath_of(url)
    if not src.is_dir():
        return []
    os.makedirs(local_dir, exist_ok=True)
    got = []
    for f in sorted(src.iterdir(), key=lambda p: p.name):
        if f.is_dir() or f.name.endswith(exclude_suffixes):
            continue
        with open(os.path.join(local_dir, f.name), "wb") as out:
            out.write(f.read_bytes())
        got.append(f.name)
    return got


class AppendFile:
    """A text file that lines are appended to (see the module docstring for ``gs://``).

    Args:
      path: local path or URL; existing content is kept (a resumed run continues it).
      flush_seconds: URLs only: upload on :meth:`write` once this long has passed since
        the last upload.
    """

    def __init__(self, path: str, *, flush_seconds: float = 30.0):
        self.path = os.fspath(path)
        self.remote = is_url(self.path)
        self.flush_seconds = flush_seconds
        if self.remote:
            self._text = read_text(self.path) if exists(self.path) else ""
            self._dirty = False
            self._uploaded = time.monotonic()
            self._file = None
        else:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # line-buffered: a crash loses no line

    def write(self, text: str) -> None:
        """Append ``text`` (usually one or more whole lines)."""
        if not self.remote:
            self._file.write(text)
            return
        self._text += text
        self._dirty = True
        if time.monotonic() - self._uploaded >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Local: flush the OS buffer. URL: upload the whole text if anything was added."""
        if not self.remote:
            if self._file is not None:
                self._file.flush()
            return
        if self._dirty:
            write_text(self.path, self._text)
            self._dirty = False
        self._uploaded = time.monotonic()

    def close(self) -> None:
        """Flush and close."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "AppendFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _kvstore(directory: str):
    url = directory if "://" in directory else "file://" + os.path.abspath(directory)
    return ts.KvStore.open(url.rstrip("/") + "/").result()


def read_json(directory: str, name: str) -> Any | None:
    """JSON file ``name`` in ``directory`` (local or kvstore URL), or None if absent."""
    res = _kvstore(directory).read(name).result()
    return json.loads(bytes(res.value)) if res.state == "value" else None


def write_json(directory: str, name: str, obj: Any) -> None:
    """Write ``obj`` as JSON file ``name`` in ``directory`` (process 0 only)."""
    if jax.process_index() != 0:
        return
    if "://" not in directory:
        os.makedirs(directory, exist_ok=True)
    _kvstore(directory).write(name, json.dumps(obj, indent=2, sort_keys=True).encode()).result()


__all__ = ["AppendFile", "download_dir", "epath_of", "exists", "join", "makedirs", "read_bytes", "read_json",
           "read_text", "write_bytes", "write_json", "write_text"]

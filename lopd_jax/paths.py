"""Paths given on the command line or in a config, made independent of the working directory.

A local path (``workdirs/x``, ``./x``, ``~/x``, ``/abs/x``) becomes absolute -- ``~``
expanded, then joined to the current directory -- so Orbax (which refuses relative
checkpoint paths) and every later ``chdir`` see the same place. A URL with a scheme
(``gs://bucket/run``, ``file://...``) is kept as written.
"""

from __future__ import annotations

import os


def is_url(path: str) -> bool:
    """Whether ``path`` names remote storage (has a ``scheme://``)."""
    return "://" in path


def resolve_path(path: str | os.PathLike | None) -> str | None:
    """``path`` as an absolute local path, or unchanged when it is None or a URL."""
    if path is None:
        return None
    path = os.fspath(path)
    if is_url(path):
        return path
    return os.path.abspath(os.path.expanduser(path))


__all__ = ["is_url", "resolve_path"]

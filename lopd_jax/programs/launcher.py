"""How every command line starts and how its errors end it.

Each command line ``lopd_jax/NAME.py`` (``python -m lopd_jax.NAME``, console script
``lopd-NAME``) is ``main = command("NAME")``: :func:`launch` picks JAX's platform
(:func:`lopd_jax.io.startup.configure_platform`) before anything imports JAX, then imports
the program's body, :mod:`lopd_jax.programs`.NAME, and returns its ``main(argv)``. The
compile checks, which take ``--topology``, first run
:func:`lopd_jax.io.startup.prepare_topology` (``command("NAME", topology=True)``). This
module and :mod:`lopd_jax.io.startup` import no JAX, so importing a command line loads none.

:func:`exit_on_error` is a program's error-to-exit-code map in use: it calls a function and
turns an error of a mapped class into ``error: MESSAGE`` on stderr and that class's exit status.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Mapping, Sequence

from lopd_jax.io.startup import configure_platform, prepare_topology

Main = Callable[[Sequence[str] | None], int]


def launch(name: str, argv: Sequence[str] | None = None, topology: bool = False) -> int:
    """Run program ``name`` (:mod:`lopd_jax.programs`.NAME) on ``argv`` (None: ``sys.argv[1:]``)
    and return its exit status; ``topology``: read ``--topology`` before JAX starts."""
    if topology:
        prepare_topology(argv)
    configure_platform()  # before JAX is imported: no libtpu detection noise on CPU hosts
    program = importlib.import_module(f"lopd_jax.programs.{name}")  # imports JAX
    return program.main(argv)


def command(name: str, topology: bool = False) -> Main:
    """The entry point ``main(argv=None) -> int`` of command line ``lopd_jax/NAME.py``: :func:`launch`."""

    def main(argv: Sequence[str] | None = None) -> int:
        return launch(name, argv, topology)

    main.__doc__ = f"Command-line entry point: :func:`lopd_jax.programs.{name}.main` (its exit codes)."
    main.__module__, main.__qualname__ = f"lopd_jax.{name}", "main"
    return main


# problems a user fixes (a value, a key, a path, a file), named in one line: exit 2 (ConfigError is a ValueError)
EXIT_USER_ERROR = 2
USER_ERROR_EXITS: Mapping[type[BaseException], int] = {
    ValueError: EXIT_USER_ERROR, FileNotFoundError: EXIT_USER_ERROR, NotADirectoryError: EXIT_USER_ERROR,
    IsADirectoryError: EXIT_USER_ERROR, FileExistsError: EXIT_USER_ERROR, PermissionError: EXIT_USER_ERROR}


def check_workdir(path: str, flag: str = "--workdir") -> None:
    """Before any work: ``NotADirectoryError`` naming the fix when local ``path``, or the
    nearest of its parents that exists, is not a directory (it is made when absent)."""
    if "://" in path:
        return
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == os.path.abspath(path) else f"lies under a file, {probe}"
        raise NotADirectoryError(f"{flag}={path} {where}; give a directory (it is made when absent)")


def check_out(path: str, overwrite: bool, flag: str = "--out", kind: str = "directory") -> None:
    """Before any work: ``FileExistsError`` naming the fix when output ``path`` (local or
    ``gs://``) exists and ``overwrite`` is False, or when it is a file where a directory goes."""
    from lopd_jax.io import files  # imports JAX: only when a program checks its output

    if not files.exists(path):
        return
    if kind == "directory" and os.path.isfile(path):
        raise FileExistsError(f"{flag}={path} is a file, not a directory; choose another {flag}")
    if not overwrite:
        raise FileExistsError(f"{flag}={path} exists; pass --overwrite to replace it, or choose another {flag}")


def exit_on_error(exits: Mapping[type[BaseException], int], fn: Callable[..., Any], *args: Any
                  ) -> tuple[Any, int | None]:
    """``(fn(*args), None)``; or, when it raises an error of a class in ``exits`` (the first
    match in its order), ``(None, that class's exit status)`` after printing
    ``error: MESSAGE`` to stderr. Other errors propagate."""
    try:
        return fn(*args), None
    except tuple(exits) as e:
        print(f"error: {e}", file=sys.stderr)
        return None, next(code for cls, code in exits.items() if isinstance(e, cls))

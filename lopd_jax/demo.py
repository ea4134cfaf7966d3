"""The demo (``make demo``): LOPD learning on the CPU miniature, from a shipped starting point.

The command line of :mod:`lopd_jax.programs.demo`, which holds the program: this module
picks JAX's platform (:func:`lopd_jax.io.startup.configure_platform`) before anything
imports JAX, then runs it.
"""

from __future__ import annotations

import sys
from typing import Sequence

from lopd_jax.io.startup import configure_platform


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: :func:`lopd_jax.programs.demo.main` (its exit codes)."""
    configure_platform()  # before JAX is imported: no libtpu detection noise on CPU hosts
    from lopd_jax.programs import demo as program  # after configure_platform: it imports JAX

    return program.main(argv)


if __name__ == "__main__":
    sys.exit(main())

"""Ahead-of-time compile of a run config's LOPD step for a TPU topology, on a CPU host.

The command line of :mod:`lopd_jax.programs.compile_check`, started by :mod:`lopd_jax.programs.launcher`.
"""

import sys

from lopd_jax.programs.launcher import command

main = command("compile_check", topology=True)

if __name__ == "__main__":
    sys.exit(main())

"""Run arms x seeds (x a grid) of one config side by side, resumably, and report them.

The command line of :mod:`lopd_jax.programs.sweep`, started by :mod:`lopd_jax.programs.launcher`.
"""

import sys

from lopd_jax.programs.launcher import command

main = command("sweep")

if __name__ == "__main__":
    sys.exit(main())

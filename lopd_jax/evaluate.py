"""Evaluate a policy on an environment family: success rate, mean reward, Table 3 statistics.

The command line of :mod:`lopd_jax.programs.evaluate`, started by :mod:`lopd_jax.programs.launcher`.
"""

import sys

from lopd_jax.programs.launcher import command

main = command("evaluate")

if __name__ == "__main__":
    sys.exit(main())

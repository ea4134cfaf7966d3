"""The sweep's report: per-run records, the table over seeds and Figures 3-5.

The command line of :mod:`lopd_jax.programs.sweep_report`, started by :mod:`lopd_jax.programs.launcher`.
"""

import sys

from lopd_jax.programs.launcher import command

main = command("sweep_report")

if __name__ == "__main__":
    sys.exit(main())

"""Run one command's ``main(argv)`` on each of several argument lists, in this one process, and
record each call's exit status and any traceback (what a user would have seen) as JSON.

    python -m tests.programs.walk_driver NAME RESULT.json ARGV_JSON

``ARGV_JSON`` is a JSON list of argument lists for ``python -m lopd_jax.NAME``. One process per
command keeps the walk cheap: JAX starts once per command instead of once per call.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import traceback


def call(main, argv: list[str]) -> dict:
    """``{"argv", "code", "traceback", "stderr"}`` of ``main(argv)``."""
    err, tb, code = io.StringIO(), None, None
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's exit 2, or a program's sys.exit
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001  (the walk records every escape)
            tb = traceback.format_exc()
    return {"argv": argv, "code": code, "traceback": tb, "stderr": err.getvalue()[-2000:]}


def main() -> int:
    """Entry point (see the module docstring)."""
    name, out, argvs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    main_fn = importlib.import_module(f"lopd_jax.{name}").main
    results = [call(main_fn, argv) for argv in argvs]
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Print the JAX, jaxlib and libtpu versions of this environment and check them against the lock.

    python tpu_scripts/check_versions.py [--devices]

Exit 0 when jax, jaxlib and libtpu are installed at the versions that ``constraints.txt``
(jax, jaxlib) and ``requirements-tpu.txt`` (libtpu) pin, 1 otherwise, with one line per
package saying what is installed and what is expected. ``tpu_scripts/setup.sh`` runs it
on every worker after the install. ``--devices`` also starts JAX and prints the process
index and the global and local device counts and kinds (on a TPU VM: the chips).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jax", "jaxlib", "libtpu")


def pins(*paths: str) -> dict[str, str]:
    """``name==version`` lines of requirement/constraint files -> ``{name: version}`` (lowercase names)."""
    out: dict[str, str] = {}
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                m = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
                if m:
                    out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def installed(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check(expected: dict[str, str], have: dict[str, str | None]) -> list[str]:
    """Problems (empty when none): a package missing, not at its pin, or jax and jaxlib apart."""
    problems = []
    for name in PACKAGES:
        want, got = expected.get(name), have.get(name)
        if got is None:
            problems.append(f"{name} is not installed (expected {want}): pip install -c constraints.txt -e \".[tpu]\"")
        elif want is not None and got != want:
            problems.append(f"{name} {got} is installed, the lock says {want}: "
                            f"pip install -c constraints.txt -e \".[tpu]\"")
    if have.get("jax") and have.get("jaxlib") and have["jax"] != have["jaxlib"]:
        problems.append(f"jax {have['jax']} and jaxlib {have['jaxlib']} differ")
    return problems


def main(argv=None) -> int:
    """Print the versions; exit 1 on a mismatch (see the module docstring)."""
    p = argparse.ArgumentParser(prog="python tpu_scripts/check_versions.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", action="store_true", help="also start JAX and print the devices")
    args = p.parse_args(argv)
    expected = pins(os.path.join(ROOT, "constraints.txt"), os.path.join(ROOT, "requirements-tpu.txt"))
    have = {name: installed(name) for name in PACKAGES}
    print("  ".join(f"{n} {have[n] or 'missing'} (lock {expected.get(n, '-')})" for n in PACKAGES), flush=True)
    problems = check(expected, have)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return 1
    if args.devices:
        import jax
        devs = jax.devices()
        print(f"process {jax.process_index()} of {jax.process_count()}: {jax.device_count()} devices "
              f"({jax.local_device_count()} local), {devs[0].device_kind}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

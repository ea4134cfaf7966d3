"""Start-up of the command-line programs: pick the JAX platform quietly, then say what runs.

With ``libtpu`` installed, JAX probes for a TPU on every start and, on a machine without
one, prints detection errors that read like failures. So the programs call
:func:`configure_platform` before anything imports JAX: an explicit ``JAX_PLATFORMS``
(even empty) is left alone; a visible TPU or GPU leaves it unset; otherwise it is set to
``cpu``. A TPU counts as visible when the host has the device files the TPU runtime opens
(``/dev/accel*``, ``/dev/vfio/<n>``) or a Google PCI device (vendor 0x1ae0, as JAX's own
check); a GPU when ``/dev/nvidia0`` or ``/dev/kfd`` exists. It also sets
``TRANSFORMERS_NO_ADVISORY_WARNINGS=1`` (unless set): ``transformers`` serves tokenizers
and checkpoint I/O only, and would otherwise warn on every start that PyTorch is missing.

:func:`describe_devices` is the first line a run prints: devices, platform and processes.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import MutableMapping

GOOGLE_PCI_VENDOR = "0x1ae0"


def tpu_visible(root: str = "/") -> bool:
    """Whether this host exposes a TPU (device files or a Google PCI device under ``root``)."""
    j = lambda *p: os.path.join(root, *p)  # noqa: E731
    if glob.glob(j("dev", "accel*")) or [p for p in glob.glob(j("dev", "vfio", "*")) if p[-1].isdigit()]:
        return True
    for vendor in glob.glob(j("sys", "bus", "pci", "devices", "*", "vendor")):
        try:
            with open(vendor) as f:
                if f.read().strip().lower() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return False


def gpu_visible(root: str = "/") -> bool:
    """Whether this host exposes an NVIDIA or AMD GPU device file under ``root``."""
    return any(os.path.exists(os.path.join(root, "dev", n)) for n in ("nvidia0", "kfd"))


def configure_platform(environ: MutableMapping[str, str] | None = None, root: str = "/") -> str | None:
    """Default ``JAX_PLATFORMS=cpu`` on a host with no TPU or GPU (see the module docstring).

    Must run before JAX is imported. Returns the value it set, or None when it left the
    environment alone.
    """
    env = os.environ if environ is None else environ
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if "JAX_PLATFORMS" in env or tpu_visible(root) or gpu_visible(root):
        return None
    env["JAX_PLATFORMS"] = "cpu"
    return "cpu"


def prepare_topology(argv) -> None:
    """Before JAX starts, for the compile checks' ``--topology``: ``cpu:N`` simulates N host
    devices (the XLA flag must precede JAX's start); a TPU topology (the default) lets the TPU
    plugin load, since it compiles for the topology."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--topology", default=None)
    topology = p.parse_known_args(argv)[0].topology
    if topology is None or not topology.startswith("cpu:"):
        os.environ.setdefault("JAX_PLATFORMS", "")  # the TPU plugin compiles for the topology
    elif not topology[4:].isdigit() or int(topology[4:]) < 1:
        return  # not a device count: the program refuses the topology by name
    elif "jax" not in sys.modules:  # cpu:N: simulate N host devices (the flag must precede JAX's start)
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "force_host_platform_device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={topology[4:]}"])


def describe_devices() -> str:
    """One line: how many devices of which kind, this process's index and the process count."""
    import jax  # not at the top: programs import this module to configure JAX first

    devs = jax.devices()
    kinds = sorted({d.device_kind for d in devs})
    return (f"devices: {len(devs)} x {'/'.join(kinds)} ({jax.default_backend()}; {jax.local_device_count()} "
            f"local), process {jax.process_index()} of {jax.process_count()}")


__all__ = ["tpu_visible", "gpu_visible", "configure_platform", "prepare_topology", "describe_devices"]


def host_rss_mb() -> float | None:
    """This process's resident memory in MB (``/proc/self/statm``; on a system without it,
    the peak resident size from ``getrusage``; None where neither exists). Runs record it
    with every training step, so a long run shows whether host memory creeps."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource  # noqa: PLC0415  (not on every platform)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (2**20 if sys.platform == "darwin" else 2**10)
    except (ImportError, OSError):
        return None

"""Start-up of the command-line programs: pick the JAX platform quietly, then say what runs.

With ``libtpu`` installed (the ``tpu`` extra), JAX tries the TPU backend on every start;
on a machine without a TPU that prints libtpu's detection errors ("Failed to find host
bounds", "unexpected worker hostname ...") before falling back to the CPU. They are
harmless but read like failures, so the programs call :func:`configure_platform` before
anything imports JAX:

* ``JAX_PLATFORMS`` already set (even to the empty string): left alone -- the user chose.
* a TPU is visible: left unset, so JAX finds the TPU exactly as it would without us.
* a GPU is visible: left unset (JAX picks its GPU plugin if one is installed).
* otherwise: ``JAX_PLATFORMS=cpu``, so libtpu is never asked to look for chips.

It also sets ``TRANSFORMERS_NO_ADVISORY_WARNINGS=1`` (unless set): the programs use
``transformers`` for tokenizers and checkpoint I/O only, and without PyTorch installed
(the runtime needs none) it would otherwise print "PyTorch was not found. Models won't be
available" on every start.

A TPU counts as visible when the host has TPU device files -- ``/dev/accel*`` (v2-v5p
TPU VMs) or ``/dev/vfio/<n>`` (v5e / v6e TPU VMs) -- or a PCI device of Google's vendor
id 0x1ae0 in ``/sys/bus/pci/devices`` (the check JAX's own ``hardware_utils`` uses).
A GPU counts when ``/dev/nvidia0`` or ``/dev/kfd`` (ROCm) exists. These are the files
the accelerator runtimes themselves open, so a TPU VM is never mistaken for a CPU host.

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

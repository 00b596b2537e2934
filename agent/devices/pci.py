"""The NVIDIA GPUs on the host's PCI bus, from sysfs: what the node has while NVML cannot say.

When the driver is not loaded (a kernel upgrade its module was not rebuilt for, a GPU operator
still installing it) NVML cannot list a single GPU, yet the hardware is there and costs money.
sysfs lists PCI devices whatever driver is bound, so the agent can still show each GPU down
(`gpuledger_gpu_up 0` with the driver's error) and book its time as unobserved.

NVML numbers GPUs in PCI bus order (nvidia-smi(1): "the index ... in PCI Bus ID order"), so
the i-th NVIDIA GPU here is NVML's GPU i. A GPU bound to another driver (vfio-pci: passed
through to a virtual machine) is not one NVML would list, and is left out.
"""

from __future__ import annotations

import os
from pathlib import Path

PCI_VENDOR_NVIDIA = 0x10DE
# PCI base class and subclass of a GPU: a VGA-compatible controller, or a 3D controller (the
# data-centre parts). NVSwitches (0x0680), HDMI audio (0x0403) and USB-C (0x0C03) are not GPUs.
_GPU_CLASSES = frozenset({0x0300, 0x0302})
_NVIDIA_DRIVER = "nvidia"


def nvidia_gpus(sys_root: str | Path = "/sys") -> list[str]:
    """Bus ids, as NVML spells them ("00000000:17:00.0"), of the NVIDIA GPUs under `sys_root`,
    in bus order; [] where sysfs cannot be read (not Linux, or not mounted)."""
    devices = Path(sys_root) / "bus" / "pci" / "devices"
    try:
        # sysfs names ("0000:17:00.0") are fixed-width lower-case hex: sorted as text, in bus order.
        names = sorted(os.listdir(devices))
    except OSError:
        return []
    found = []
    for name in names:
        device = devices / name
        try:
            vendor = int((device / "vendor").read_text().strip(), 16)
            pci_class = int((device / "class").read_text().strip(), 16)
            driver = os.path.basename(os.readlink(device / "driver")) if (device / "driver").is_symlink() else None
        except (OSError, ValueError):
            continue
        if vendor != PCI_VENDOR_NVIDIA or pci_class >> 8 not in _GPU_CLASSES:
            continue
        if driver is not None and driver != _NVIDIA_DRIVER:
            continue
        found.append(nvml_bus_id(name))
    return found


def nvml_bus_id(sysfs_name: str) -> str:
    """sysfs's "0000:17:00.0" as NVML's busId: the domain in eight hex digits, upper case."""
    domain, _, rest = sysfs_name.partition(":")
    return f"{domain.upper():0>8}:{rest.upper()}"

"""The cloud instance type this node runs on, for pricing, read from the firmware."""

from __future__ import annotations

import re
from pathlib import Path

_AWS_INSTANCE = re.compile(r"^[a-z][a-z0-9-]*\.[0-9]*[a-z0-9]+$")


def detect_instance_type(dmi_dir: str | Path = "/sys/devices/virtual/dmi/id") -> str | None:
    """The cloud instance type, where the firmware says it without asking the network: EC2
    writes it as the DMI product name (e.g. "p4d.24xlarge"). Elsewhere: None (set
    pricing.instance_type)."""
    try:
        product = (Path(dmi_dir) / "product_name").read_text().strip()
    except OSError:
        return None
    return product if _AWS_INSTANCE.match(product) else None

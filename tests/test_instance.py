"""The instance type read from the firmware's DMI product name (EC2 writes it there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.devices.instance import detect_instance_type


@pytest.mark.parametrize(
    ("product", "expected"),
    [
        ("p4d.24xlarge\n", "p4d.24xlarge"),
        ("g5.xlarge", "g5.xlarge"),
        # Not an EC2 type: a bare-metal server's product name, and an empty file.
        ("PowerEdge R750xa", None),
        ("", None),
    ],
)
def test_instance_type_comes_from_the_dmi_product_name(tmp_path: Path, product: str, expected: str | None) -> None:
    (tmp_path / "product_name").write_text(product)
    assert detect_instance_type(tmp_path) == expected


def test_no_dmi_directory_means_no_instance_type(tmp_path: Path) -> None:
    assert detect_instance_type(tmp_path / "absent") is None

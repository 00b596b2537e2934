"""Data flows one way. Each module may import only the layers below it, and only
agent/devices/nvml.py imports pynvml."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# module -> the project modules it may import (prefix match). The CLI is the composition root.
ALLOWED: dict[str, tuple[str, ...]] = {
    "agent.units": (),
    "agent.errors": (),
    "agent.model": (),
    "agent.yamlfile": (),
    "agent.attribution.cgroup": (),
    "agent.attribution.recognise": (),
    "agent.accounting.instance": (),
    "agent.attribution.sources.podresources": ("agent.attribution.sources.podresources",),
    "agent.config": (
        "agent.errors",
        "agent.scrub",
        "agent.units",
        "agent.yamlfile",
        "agent.attribution.labels",
        "agent.devices",
    ),
    # The registry: backends are imported only when chosen.
    "agent.devices": ("agent.errors", "agent.devices.backend", "agent.devices.nvml"),
    "agent.devices.backend": ("agent.errors",),
    "agent.devices.nvml": ("agent.errors", "agent.devices.backend"),
    # What the sources find, as plain data; the source protocol; each source; the registry.
    "agent.attribution.facts": ("agent.model",),
    "agent.attribution.sources.base": ("agent.model", "agent.attribution.facts"),
    "agent.attribution.sources.slurm": ("agent.model", "agent.attribution.facts", "agent.attribution.sources.base"),
    "agent.attribution.sources.podlogs": ("agent.model", "agent.attribution.facts", "agent.attribution.sources.base"),
    "agent.attribution.sources.procfs": (
        "agent.errors",
        "agent.model",
        "agent.attribution.facts",
        "agent.attribution.sources.base",
    ),
    "agent.attribution.sources.kubelet": (
        "agent.errors",
        "agent.model",
        "agent.attribution.facts",
        "agent.attribution.sources.base",
        "agent.attribution.sources.podresources",
    ),
    "agent.attribution.sources": ("agent.attribution.sources",),
    # The sampler knows the backend protocol, never a backend.
    "agent.devices.sampler": ("agent.errors", "agent.model", "agent.devices.backend"),
    # attribution is pure: the model, the cgroup parser and the recognisers, nothing that reads
    "agent.attribution.labels": ("agent.model", "agent.attribution.recognise"),
    "agent.attribution.resolve": (
        "agent.model",
        "agent.attribution.cgroup",
        "agent.attribution.facts",
        "agent.attribution.labels",
    ),
    "agent.attribution.gather": (
        "agent.attribution.facts",
        "agent.attribution.labels",
        "agent.attribution.resolve",
        "agent.attribution.sources",
        "agent.errors",
        "agent.model",
    ),
    "agent.accounting.pricing": ("agent.model", "agent.yamlfile"),
    "agent.accounting.cost": ("agent.model", "agent.units"),
    "agent.ledger.store": ("agent.errors", "agent.model"),
    "agent.ledger.sink": ("agent.model", "agent.ledger.store"),
    "agent.ledger.report": ("agent.model", "agent.units", "agent.ledger.store"),
    "agent.pipeline": (
        "agent.errors",
        "agent.devices.backend",
        "agent.model",
        "agent.devices.sampler",
        "agent.attribution.gather",
        "agent.accounting.cost",
        "agent.units",
        "rules",
    ),
    "rules": ("agent.model", "rules"),
    "exporters": ("agent.model", "agent.__init__", "agent", "exporters"),
    # The fake serves the kubelet API from the same generated stubs the agent's client uses.
    "fake_nvml": ("fake_nvml", "agent.units", "agent.yamlfile", "agent.attribution.sources.podresources"),
}
PROJECT = ("agent", "exporters", "fake_nvml", "rules")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def rule_for(module: str) -> tuple[str, ...] | None:
    for prefix in sorted(ALLOWED, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return ALLOWED[prefix]
    return None


def test_no_layer_reaches_backwards() -> None:
    problems = []
    for package in PROJECT:
        for path in (ROOT / package).rglob("*.py"):
            module = module_name(path).removesuffix(".__init__")
            allowed = rule_for(module)
            if allowed is None:
                continue
            for imported in imports_of(path):
                if not imported.startswith(PROJECT):
                    continue
                if imported == "agent" and "agent" in allowed:
                    continue
                if not any(imported == a or imported.startswith(a + ".") for a in allowed):
                    problems.append(f"{module} imports {imported}")
    assert problems == []


def test_only_the_nvml_boundary_imports_pynvml() -> None:
    importers = sorted(
        module_name(path)
        for package in ("agent", "exporters", "rules")
        if (ROOT / package).exists()
        for path in (ROOT / package).rglob("*.py")
        if any(name == "pynvml" or name.startswith("pynvml.") for name in imports_of(path))
    )
    assert importers == ["agent.devices.nvml"]

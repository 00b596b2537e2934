"""Where scenarios come from: a mapping, a built-in name, or a YAML file.

The built-ins ship as package data beside this package (``fake_nvml/scenarios/*.yaml``) so
that ``install("demo")`` works from an installed wheel as well as from a checkout.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agent.yamlfile import YamlFileError, read_yaml
from fake_nvml.scenario.model import Scenario, ScenarioError
from fake_nvml.scenario.parse import parse_scenario

# fake_nvml/scenarios, the directory pyproject's package-data ships, not this package.
SCENARIO_DIR = Path(__file__).parent.parent / "scenarios"


def builtin_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def load_scenario(spec: str | Path | Mapping[str, Any]) -> Scenario:
    """A scenario from a mapping, a built-in name (``demo``) or a path to a YAML file."""
    if isinstance(spec, Mapping):
        return parse_scenario(spec, "scenario")
    text = str(spec)
    path = Path(text)
    if not path.suffix and "/" not in text:
        builtin = SCENARIO_DIR / f"{text}.yaml"
        if not builtin.exists():
            raise ScenarioError(
                f"{text}: no such built-in scenario (built-in: {', '.join(builtin_names())}) and no such file"
            )
        path = builtin
    try:
        raw = read_yaml(path, "scenario")
    except YamlFileError as exc:
        raise ScenarioError(str(exc)) from None
    name = path.stem if path.parent == SCENARIO_DIR else str(path)
    scenario = parse_scenario(raw, path.name)
    if "name" not in scenario.raw:
        scenario = Scenario(
            name, scenario.start, scenario.node, scenario.gpus, scenario.processes,
            scenario.allocations, scenario.faults, scenario.raw,
        )  # fmt: skip
    return scenario

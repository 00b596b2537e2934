"""Scenarios: the YAML that describes a fake node, parsed and validated into frozen data.

One package, four concerns, so each can be read and changed alone: `facts` (what real GPU
models and NVML look like), `model` (the frozen scenario the fake serves from), `parse` (the
reader that turns YAML into it, with one-line errors naming key and entry) and `load`
(built-in names and files). The names below are the ones the rest of the project imports
from ``fake_nvml.scenario``; anything else is reached through its own module.
"""

from __future__ import annotations

from fake_nvml.scenario.facts import ERROR_CODES, MODEL_FACTS
from fake_nvml.scenario.load import SCENARIO_DIR, builtin_names, load_scenario
from fake_nvml.scenario.model import Fault, Gpu, GpuRef, PodRef, Process, Scenario, ScenarioError

__all__ = [
    "ERROR_CODES",
    "MODEL_FACTS",
    "SCENARIO_DIR",
    "Fault",
    "Gpu",
    "GpuRef",
    "PodRef",
    "Process",
    "Scenario",
    "ScenarioError",
    "builtin_names",
    "load_scenario",
]

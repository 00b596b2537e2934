"""The Prometheus exposition: catalogue against output, a golden file, and promtool's lint."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fake_nvml
from agent.model import AgentState
from exporters.catalogue import BY_NAME, CATALOGUE, Kind
from exporters.prometheus import make_registry
from tests.helpers import Rig

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("GPULEDGER_UPDATE_GOLDEN") == "1"  # GPULEDGER_UPDATE_GOLDEN=1 pytest ... rewrites


def simulate(scenario: object, at_s: float) -> AgentState:
    """Polls `scenario` at at_s - 5 and at_s, with attribution, as the daemon would."""
    rig = Rig(scenario, rules=[({"namespace": "^research-"}, {"team": "research"})])
    rig.poll(at_s - 5)
    state = rig.poll(5)
    rig.kubelet.close()
    return state


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


def exposition(state: AgentState) -> str:
    return generate_latest(make_registry(lambda: state)).decode()


def test_demo_exposition_matches_the_golden_file() -> None:
    text = exposition(simulate("demo", 7200))
    golden = GOLDEN / "demo.prom"
    if UPDATE or not golden.exists():
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), "exposition changed: rerun with GPULEDGER_UPDATE_GOLDEN=1 if intended"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (scripts/check installs it)")
def test_promtool_check_metrics_passes_on_the_golden_file() -> None:
    text = (GOLDEN / "demo.prom").read_text()
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (result.stdout + result.stderr).strip() == "", "promtool lint findings"


def _emitted(states: list[AgentState]) -> dict[str, set[str]]:
    """Emitted sample names (with _total for counters) -> label names seen."""
    seen: dict[str, set[str]] = {}
    for state in states:
        for family in text_string_to_metric_families(exposition(state)):
            for sample in family.samples:
                seen.setdefault(sample.name, set()).update(sample.labels)
    return seen


def test_every_emitted_metric_is_catalogued_and_every_catalogued_one_is_emitted() -> None:
    states = [
        simulate("demo", 3600),
        simulate("mig", 600),
        simulate(
            {
                "gpus": [{"count": 2, "nvlink_links": 2}],
                "faults": [
                    {"at": "10s", "gpu": 1, "error": "GPU_IS_LOST"},
                    {"call": "nvmlDeviceGetComputeRunningProcesses", "error": "TIMEOUT"},
                ],
            },
            30,
        ),
    ]
    emitted = _emitted(states)
    catalogued = {spec.name for spec in CATALOGUE}
    assert set(emitted) - catalogued == set(), "emitted but not in the catalogue"
    assert catalogued - set(emitted) == set(), "catalogued but never emitted"
    for name, labels in emitted.items():
        assert labels == set(BY_NAME[name].labels), name


def test_catalogue_names_follow_prometheus_conventions() -> None:
    for spec in CATALOGUE:
        assert spec.name.startswith("gpuledger_")
        assert spec.name.endswith("_total") == (spec.kind is Kind.COUNTER), spec.name
        if spec.unit:
            assert spec.name.removesuffix("_total").endswith(spec.unit), spec.name
        assert "pid" not in spec.labels
        assert spec.help.endswith(".")


def test_lost_gpu_keeps_its_identity_series_and_drops_readings() -> None:
    state = simulate("gpu-lost", 900)
    samples = {
        (s.name, s.labels.get("gpu")): s.value
        for family in text_string_to_metric_families(exposition(state))
        for s in family.samples
    }
    assert samples[("gpuledger_gpu_up", "1")] == 0
    assert samples[("gpuledger_gpu_up", "0")] == 1
    assert ("gpuledger_gpu_power_watts", "1") not in samples
    assert ("gpuledger_gpu_power_watts", "0") in samples
    assert ("gpuledger_gpu_info", "1") in samples


def test_scrape_makes_no_nvml_call() -> None:
    state = simulate("demo", 60)
    node = fake_nvml.installed()
    assert node is not None
    before = sum(node.calls.values())
    for _ in range(5):
        exposition(state)
    assert sum(node.calls.values()) == before

"""The Prometheus exposition: catalogue against output, a golden file, and promtool's lint."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import fake_nvml
from agent.actions import Actions, Trigger
from agent.cli.wiring import rule_specs
from agent.config import ReadingsConfig, Settings
from agent.ledger.sink import LedgerSink
from agent.model import AgentState, Price
from agent.pipeline import Costing
from exporters.catalogue import BY_NAME, CATALOGUE, Kind
from exporters.prometheus import make_registry
from tests.helpers import Rig

GOLDEN = Path(__file__).parent / "golden"
UPDATE = os.environ.get("GPULEDGER_UPDATE_GOLDEN") == "1"  # GPULEDGER_UPDATE_GOLDEN=1 pytest ... rewrites


PRICE = Price(2.745, "test price")


def simulate(
    scenario: object, at_s: float, tmp_path: Path, flush: bool = False, triggers: Sequence[Trigger] = ()
) -> AgentState:
    """The whole pipeline (attribution, cost, the default rules, a ledger, and the actions
    `triggers` if any) polling `scenario` every minute up to at_s - 5, then at at_s, as the
    daemon would have since t=0."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    ledger = LedgerSink(tmp_path / "ledger.db", retention_s=None, clock=lambda: 1_795_300_000.0)
    rig = Rig(
        scenario,
        rules=[({"namespace": "^research-"}, {"team": "research"})],
        costing=Costing(prices=lambda s: {g.uuid: PRICE for g in s.gpus}, energy_per_kwh=0.12, sink=ledger),
        flag_rules=rule_specs(Settings()),
    )
    if triggers:
        rig.pipeline.actions = Actions(triggers)
    rig.run(at_s - 5, 60)
    if flush:
        rig.pipeline.flush_ledger()
    state = rig.poll(at_s - rig.node.clock.now())
    rig.kubelet.close()
    ledger.close()
    return state


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


def health_state(scenario: object, at_s: float) -> AgentState:
    """A poll at at_s of `scenario` (one before it too) by the agent as the settings build it,
    with the opt-in PCIe throughput on."""
    rig = Rig(scenario, settings=Settings(readings=ReadingsConfig(pcie_throughput=True)))
    try:
        rig.poll(at_s - 60)
        return rig.poll(60)
    finally:
        rig.close()


def exposition(state: AgentState) -> str:
    return generate_latest(make_registry(lambda: state)).decode()


def test_demo_exposition_matches_the_golden_file(tmp_path: Path) -> None:
    text = exposition(simulate("demo", 7200, tmp_path))
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


def test_every_emitted_metric_is_catalogued_and_every_catalogued_one_is_emitted(tmp_path: Path) -> None:
    states = [
        simulate("demo", 3600, tmp_path / "demo", flush=True),
        simulate("mig", 600, tmp_path / "mig"),
        simulate(
            {
                "gpus": [{"count": 2, "nvlink_links": 2}],
                "faults": [
                    {"at": "5s", "gpu": 1, "xid": 79},  # the driver-event series
                    {"at": "10s", "gpu": 1, "error": "GPU_IS_LOST"},
                    {"call": "nvmlDeviceGetComputeRunningProcesses", "error": "TIMEOUT"},
                ],
            },
            30,
            tmp_path / "lost",
        ),
        # A process named by its own environment only: the self-reported series.
        simulate(
            {
                "gpus": [{"count": 1}],
                "processes": [{"pid": 300, "gpus": [0], "sm_util": 50, "environ": {"SLURM_JOB_ID": "77"}}],
            },
            30,
            tmp_path / "claim",
        ),
        # A Hopper GPU split in MIG instances: GPM activity per GPU and per instance.
        simulate(
            {
                "gpus": [{"model": "H100-SXM5-80GB", "mig": ["3g.40gb"]}],
                "processes": [{"pid": 302, "gpus": ["0:0"], "sm_util": 50, "sm_active": 20, "tensor": 50}],
            },
            30,
            tmp_path / "gpm",
        ),
        # A job that ends, leaving its GPU idle: the left-by series.
        simulate(
            {"gpus": [{"count": 1}], "processes": [{"pid": 301, "gpus": [0], "end": "15s"}]}, 30, tmp_path / "left"
        ),
        # An action (a dry run) on an idle GPU: the actions' counters.
        simulate(
            {"gpus": [{"count": 1}]},
            3600,
            tmp_path / "act",
            triggers=[Trigger("notify", "idle", "gpu", webhook_url="http://127.0.0.1:9/")],
        ),
        # Hardware trouble and the boards with a fan and with retired pages, PCIe throughput on.
        health_state("health", 3 * 3600),
    ]
    emitted = _emitted(states)
    catalogued = {spec.name for spec in CATALOGUE}
    assert set(emitted) - catalogued == set(), "emitted but not in the catalogue"
    assert catalogued - set(emitted) == set(), "catalogued but never emitted"
    for name, labels in emitted.items():
        assert labels == set(BY_NAME[name].labels), name
    # A registry made with `only` yields exactly those families' samples, as the whole one does.
    only = sorted(catalogued)[::2]
    for state in states:
        whole = make_registry(lambda state=state: state).collect()
        part = make_registry(lambda state=state: state, only=only).collect()
        expected = [(s.name, s.labels, s.value) for m in whole for s in m.samples if s.name in only]
        assert expected, "nothing to compare"
        assert [(s.name, s.labels, s.value) for m in part for s in m.samples] == expected


def test_catalogue_names_follow_prometheus_conventions() -> None:
    for spec in CATALOGUE:
        assert spec.name.startswith("gpuledger_")
        assert spec.name.endswith("_total") == (spec.kind is Kind.COUNTER), spec.name
        if spec.unit:
            assert spec.name.removesuffix("_total").endswith(spec.unit), spec.name
        assert "pid" not in spec.labels
        assert spec.help.endswith(".")


def test_lost_gpu_keeps_its_identity_series_and_drops_readings(tmp_path: Path) -> None:
    state = simulate("gpu-lost", 900, tmp_path)
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


def test_scrape_makes_no_nvml_call(tmp_path: Path) -> None:
    state = simulate("demo", 60, tmp_path)
    node = fake_nvml.installed()
    assert node is not None
    before = sum(node.calls.values())
    for _ in range(5):
        exposition(state)
    assert sum(node.calls.values()) == before

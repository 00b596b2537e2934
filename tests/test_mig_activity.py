"""MIG instances' GPM activity on the slow rhythm (`readings.mig_activity`, issue 11's call budget).

NVML samples one GPU instance per `nvmlGpmMigSampleGet`, and `nvmlGpmMetricsGet` computes from two
samples of one device, so a fully split H100 read every poll costs 14 calls a poll for its
instances' activity alone. By default (`slow`) each instance, and the MIG-enabled GPU's own
activity with them, is sampled once a `readings.slow_interval` (30 s): each figure is the mean over
the last slow span (GPM figures are interval means, so exact for that span), carried into the polls
between, and dropped with the interval it came from. `every_poll` is the exact per-poll mode, `off`
reads no instance activity.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import fake_nvml
from agent.cli.main import main
from agent.cli.record import build_recording_agent, record, write_trace
from agent.config import PricingConfig, ReadingsConfig, Settings, check_config
from agent.model import Activity, AgentState, DeviceReading
from exporters.prometheus import make_registry
from tests.helpers import Rig
from tests.test_gpm import H100_WHOLE_AND_MIG, steady_calls
from tests.test_record import Series, replayed_series, same, series

PRICE = 4.0  # $/GPU-hour, pricing.gpu_hourly
STEP_S = 5.0
# A 3g.40gb instance of an H100 has 3 of its 7 slices x 16 SMs = 48 of its 132 SMs: each is a
# cost unit of 48/132 = 4/11 of the GPU, and 132 - 2 x 48 = 36 SMs (3/11) are held by nobody.
WEIGHT = 48 / 132


@pytest.fixture(autouse=True)
def _uninstall() -> Iterator[None]:
    yield
    fake_nvml.uninstall()


def settings(mig_activity: Any = "slow", node_name: str | None = "rig") -> Settings:
    return Settings(
        node_name=node_name,
        pricing=PricingConfig(gpu_hourly=PRICE),
        readings=ReadingsConfig(mig_activity=mig_activity),
    )


def split_h100(processes: list[dict[str, Any]], faults: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "node": {"hostname": "slow"},
        "gpus": [{"model": "H100-SXM5-80GB", "mig": ["3g.40gb", "3g.40gb"]}],
        "processes": processes,
        "faults": faults or [],
    }


# Instance 0:0's job keeps 40% of its SMs busy until 47 s, then 10%, its kernels running 80% and
# then 20% of the time, half of its SM activity on the tensor cores. Instance 0:1 holds memory only.
CHANGING = split_h100(
    [
        {
            "pid": 1,
            "gpus": ["0:0"],
            "sm_util": [{"at": "0s", "sm_util": 80, "sm_active": 40}, {"at": "47s", "sm_util": 20, "sm_active": 10}],
            "tensor": 50,
            "memory_mib": 20000,
            "slurm_job": "7",
        },
        {"pid": 2, "gpus": ["0:1"], "sm_util": 0, "memory_mib": 8000, "slurm_job": "8"},
    ]
)
STEADY = split_h100(
    [
        {"pid": 1, "gpus": ["0:0"], "sm_util": 70, "sm_active": 35, "memory_mib": 20000, "slurm_job": "7"},
        {"pid": 2, "gpus": ["0:1"], "sm_util": 0, "memory_mib": 8000, "slurm_job": "8"},
    ]
)


def devices(state: AgentState) -> tuple[DeviceReading, DeviceReading, DeviceReading]:
    """The split GPU's parent and its two instances, in slot order."""
    assert state.snapshot is not None
    parent = state.snapshot.gpus[0]
    first, second = state.snapshot.mig_devices(parent.uuid)
    return parent, first, second


def poll_every_5s(rig: Rig, until_s: float) -> dict[float, AgentState]:
    """Polls at 0, 5, ... until_s seconds of scenario time, by the time each was taken at."""
    start = rig.node.clock.now()
    states = {0.0: rig.poll()}
    while (t := rig.node.clock.now() - start) < until_s:
        states[t + STEP_S] = rig.poll(STEP_S)
    return states


def sm_active(activity: Activity | None) -> float | None:
    return None if activity is None else activity.sm_active


# -- the readings ---------------------------------------------------------------------------------


def test_each_instance_carries_the_mean_of_its_last_slow_span_into_the_polls_between() -> None:
    rig = Rig(CHANGING, settings=settings())
    try:
        states = poll_every_5s(rig, 120)
    finally:
        rig.close()
    start = states[0].snapshot.taken_at if states[0].snapshot is not None else 0.0
    by_t = {t: devices(state) for t, state in states.items()}
    # Samples at 0 and 5 s (a first sample is followed by one at the next poll), then each slow
    # interval: 35, 65 and 95 s. Only the first poll reads none, as a first poll does.
    assert sm_active(by_t[0][1].activity) is None
    # 0-5 s and 5-35 s: 40% throughout. 35-65 s: 40% for 12 s (to 47 s), 10% for 18 s:
    # (40 x 12 + 10 x 18) / 30 = 22%. 65-95 s: 10%. Each read at the span's end and carried for
    # the polls after it until the next.
    spans = {5: (0, 0.40), 35: (5, 0.40), 65: (35, 0.22), 95: (65, 0.10)}
    for t in range(5, 125, 5):
        span_end = max(end for end in spans if end <= t)
        span_start, mean = spans[span_end]
        parent, first, second = by_t[t]
        assert first.activity is not None, t
        assert first.activity.sm_active == pytest.approx(mean), t
        # The span it is over, on the backend clock.
        assert (first.activity.since, first.activity.until) == (start + span_start, start + span_end), t
        assert second.activity is not None
        assert second.activity.sm_active == 0.0
        # The GPU's own activity takes the same rhythm: over the same span it is its instances'
        # SM-weighted mean, 48/132 of instance 0's (instance 1 is idle).
        assert parent.activity is not None
        assert (parent.activity.since, parent.activity.until) == (first.activity.since, first.activity.until)
        assert parent.activity.sm_active == pytest.approx(mean * WEIGHT), t
    # The 35-65 s span's other figures are its means too: graphics (80 x 12 + 20 x 18) / 30 = 44%;
    # tensor half the SM activity, 11%; the fake's occupancy 0.5 x and DRAM 0.6 x SM activity.
    span = by_t[85][1].activity
    assert span is not None
    assert span.graphics_active == pytest.approx(0.44)
    assert span.tensor_active == pytest.approx(0.11)
    assert span.sm_occupancy == pytest.approx(0.11)
    assert span.dram_active == pytest.approx(0.132)
    # What /metrics shows is the carried figure.
    parent, first, _ = by_t[85]
    registry = make_registry(lambda: states[85], dcgm_compat=False)
    labels = {"gpu": "0", "uuid": parent.uuid, "mig": "0"}
    assert registry.get_sample_value("gpuledger_mig_sm_active_ratio", labels) == pytest.approx(0.22)


def test_every_poll_reads_each_instance_over_each_poll_interval_as_before() -> None:
    rig = Rig(CHANGING, settings=settings("every_poll"))
    try:
        states = poll_every_5s(rig, 60)
    finally:
        rig.close()
    readings = {t: sm_active(devices(state)[1].activity) for t, state in states.items()}
    assert readings[0] is None  # one sample: no interval yet
    assert all(readings[t] == pytest.approx(0.40) for t in range(5, 50, 5))
    # 45-50 s: 40% for 2 s, 10% for 3 s: (40 x 2 + 10 x 3) / 5 = 22%; then 10%.
    assert readings[50] == pytest.approx(0.22)
    assert readings[55] == readings[60] == pytest.approx(0.10)
    parent = devices(states[50])[0]
    assert parent.activity is not None
    assert parent.activity.sm_active == pytest.approx(0.22 * WEIGHT)


# -- what it costs ----------------------------------------------------------------------------------


def test_a_fully_split_h100_reads_its_instances_only_on_slow_polls() -> None:
    rig = Rig(H100_WHOLE_AND_MIG, settings=settings())
    try:
        rig.poll()
        per_poll = []
        for _ in range(13):
            before = rig.node.calls.copy()
            rig.poll(STEP_S)
            per_poll.append(rig.node.calls - before)
    finally:
        rig.close()
    # The first poll took the first samples and the second poll the next (a first span is one
    # poll long); every sixth poll after (30 s at 5 s polls) one sample per instance and the
    # metrics since the last: 7 of each, plus the MIG GPU's own pair.
    assert [c["nvmlGpmMigSampleGet"] for c in per_poll] == [7, 0, 0, 0, 0, 0] * 2 + [7]
    # GPU 0 (whole) samples every poll; GPU 1 (split) with its instances.
    assert [c["nvmlGpmSampleGet"] for c in per_poll] == [2, 1, 1, 1, 1, 1] * 2 + [2]
    assert [c["nvmlGpmMetricsGet"] for c in per_poll] == [1 + 1 + 7, 1, 1, 1, 1, 1] * 2 + [1 + 1 + 7]


def test_a_fully_split_h100_keeps_to_the_call_budget_by_default() -> None:
    calls = steady_calls(H100_WHOLE_AND_MIG, settings())
    # Six polls 5 s apart (one slow interval). The whole H100 as in test_gpm: 8 a poll and 9 once,
    # 57. The split H100: field values, temperature and the process list each poll (3 x 6 = 18);
    # once, its slow readings (SM clock, performance state, reasons, PCIe generation and width:
    # 5), its instances' memory (7), its own GPM sample and metrics (2) and its instances' (14):
    # 18 + 5 + 7 + 2 + 14 = 46 calls, 7.67 a poll (21.00 every_poll, 7.00 off).
    mig = 3 * 6 + 5 + 7 + 2 + 14
    assert sum(calls.values()) == 57 + mig, dict(calls)
    assert calls["nvmlGpmMigSampleGet"] == 7
    assert calls["nvmlGpmSampleGet"] == 6 + 1
    assert calls["nvmlGpmMetricsGet"] == 6 + 1 + 7
    assert mig / 6 == pytest.approx(7.67, abs=0.005)
    assert mig / 6 <= 10


# -- busy seconds ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "busy_s"),
    [
        # Every poll: the hour's 3600 s x 4/11 of the GPU x 35% SM activity = 458.18 s.
        ("every_poll", 3600 * WEIGHT * 0.35),
        # Slow: the same, as the first span is one poll long (0-5 s) and every interval after has
        # a span's mean: 3600 x 4/11 x 0.35 = 458.18 s.
        ("slow", 3600 * WEIGHT * 0.35),
    ],
)
def test_a_steady_mig_holders_busy_seconds_and_the_gpus_dollars_add_up(mode: str, busy_s: float) -> None:
    rig = Rig(STEADY, settings=settings(mode))
    try:
        state = rig.run(3600, STEP_S)
    finally:
        rig.close()
    by_job = {w.hpc_job: t for (_, _, w), t in state.costs.workloads.items()}
    # Held: 3600 s x 4/11 = 1309.09 s each.
    assert by_job["7"].held_s == pytest.approx(3600 * WEIGHT)
    assert by_job["7"].busy_s == pytest.approx(busy_s)
    assert by_job["8"].busy_s == 0.0
    # $4/h for the hour: each job's instance 4/11 x $4 = $1.4545; the 36 SMs nobody can hold,
    # 3/11 x $4 = $1.0909, idle. Charged + idle + unobserved = $4.
    (gpu,) = state.costs.gpus.values()
    assert by_job["7"].dollars == pytest.approx(PRICE * WEIGHT)
    assert by_job["8"].dollars == pytest.approx(PRICE * WEIGHT)
    assert gpu.idle_dollars == pytest.approx(PRICE * 3 / 11)
    assert gpu.unobserved_dollars == 0.0
    assert by_job["7"].dollars + by_job["8"].dollars + gpu.idle_dollars + gpu.unobserved_dollars == pytest.approx(
        gpu.dollars
    )
    assert gpu.dollars == pytest.approx(PRICE)


@pytest.mark.parametrize(
    ("mode", "busy"),
    [
        # Slow: the span 35-65 s (samples at 0, 5, then every 30 s) was job 1's for 27 s at 60%
        # and job 2's for 3 s at 10%: (60 x 27 + 10 x 3) / 30 = 55%, carried to 90 s.
        ("slow", 0.55),
        # Every poll: job 2's own 10%.
        ("every_poll", 0.10),
    ],
)
def test_a_new_holder_is_credited_with_the_last_spans_mean_until_the_next_slow_sample(mode: str, busy: float) -> None:
    # Job 1 runs on 0:0 until 62 s at 60% SM activity; job 2 from 62 s at 10%.
    spec = split_h100(
        [
            {"pid": 1, "gpus": ["0:0"], "end": "62s", "sm_util": 90, "sm_active": 60, "slurm_job": "1"},
            {"pid": 2, "gpus": ["0:0"], "start": "62s", "sm_util": 20, "sm_active": 10, "slurm_job": "2"},
        ]
    )
    rig = Rig(spec, settings=settings(mode))
    try:
        states = poll_every_5s(rig, 85)
    finally:
        rig.close()

    def job_2(state: AgentState) -> Any:
        return next(t for (_, _, w), t in state.costs.workloads.items() if w.hpc_job == "2")

    # From the poll at 65 s to the one at 85 s job 2 alone held the instance: 20 s x 4/11 held,
    # busy x the instance's SM activity as read: the carried 55% under slow (the trade-off), 10%
    # every poll. 20 x 4/11 x 0.55 = 4.0 s against 20 x 4/11 x 0.10 = 0.73 s.
    held = job_2(states[85]).held_s - job_2(states[65]).held_s
    assert held == pytest.approx(20 * WEIGHT)
    assert job_2(states[85]).busy_s - job_2(states[65]).busy_s == pytest.approx(20 * WEIGHT * busy)


# -- dropped with the interval it came from ----------------------------------------------------------


@pytest.mark.parametrize(
    "fault",
    [
        {"at": "62s", "until": "70s", "gpu": 0, "error": "GPU_IS_LOST"},  # lost (or reset)
        {"at": "62s", "until": "66s", "call": "*", "error": "DRIVER_NOT_LOADED"},  # the driver reloaded
    ],
    ids=["gpu-lost", "driver-reinit"],
)
def test_the_carried_mean_is_dropped_when_the_gpu_or_the_driver_goes_away(fault: dict[str, Any]) -> None:
    rig = Rig(split_h100(STEADY["processes"], [fault]), settings=settings())
    try:
        states = poll_every_5s(rig, 180)
    finally:
        rig.close()
    up = {t: s for t, s in states.items() if s.snapshot is not None and s.snapshot.gpus[0].up}
    assert sm_active(devices(up[60])[1].activity) == pytest.approx(0.35)  # read at 60 s, carried
    back = min(t for t in up if t > 60)
    assert all(t >= 65 for t in up if t > 60)  # down at 65 s
    # Back at `back`: its first sample starts a new span; nothing carried across the outage.
    parent, first, second = devices(up[back])
    assert (parent.activity, first.activity, second.activity) == (None, None, None)
    # The new span is one poll long (its second sample at the next poll), then carried.
    for t in range(int(back) + 5, int(back) + 35, 5):
        first = devices(up[t])[1]
        assert sm_active(first.activity) == pytest.approx(0.35), t
        assert first.activity is not None
        assert first.activity.until - first.activity.since == pytest.approx(STEP_S), t
    slow_span = devices(up[back + 35])[1].activity
    assert slow_span is not None
    assert slow_span.until - slow_span.since == pytest.approx(30)


def test_a_failed_instance_sample_drops_the_carried_mean_and_is_asked_again_next_poll() -> None:
    # NOT_FOUND from nvmlGpmMigSampleGet is what NVML answers for a GPU instance that is gone
    # (the instances destroyed or reconfigured); here it fails the sample at 95 s only (samples
    # at 0 and 5 s, then every 30 s: 35, 65, 95).
    fault = {"at": "93s", "until": "97s", "gpu": 0, "call": "nvmlGpmMigSampleGet", "error": "NOT_FOUND"}
    rig = Rig(split_h100(STEADY["processes"], [fault]), settings=settings())
    try:
        rig.poll()
        readings, calls = {}, {}
        for t in range(5, 160, 5):
            before = rig.node.calls["nvmlGpmMigSampleGet"]
            state = rig.poll(STEP_S)
            calls[t] = rig.node.calls["nvmlGpmMigSampleGet"] - before
            readings[t] = sm_active(devices(state)[1].activity)
        errors = dict(rig.sampler.errors)
    finally:
        rig.close()
    assert readings[85] == pytest.approx(0.35)
    # 95 s: both samples fail (counted), the carried figures go; 100 s asks again at once, which
    # starts a new span, one poll long: a figure again at 105 s, then the next sample at 135 s.
    assert errors[("nvmlGpmMigSampleGet", "NOT_FOUND")] == 2
    assert (calls[90], calls[95], calls[100], calls[105], calls[110], calls[135]) == (0, 2, 2, 2, 0, 2)
    assert [readings[t] for t in (95, 100)] == [None] * 2
    assert all(readings[t] == pytest.approx(0.35) for t in range(105, 160, 5))


def test_snapshot_reads_mig_activity_over_its_last_five_seconds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `snapshot` reads MIG activity over its last two polls, 5 s apart, as the rest of its
    # figures are read (with --at, the slow rhythm would carry the minute polls' span instead).
    scenario = tmp_path / "split.yaml"
    scenario.write_text(yaml.safe_dump(STEADY))
    assert main(["snapshot", "--fake", str(scenario), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    first = next(d for d in found["devices"] if d["gpu"] == "0:0")
    assert first["busy_source"] == "gpm"
    assert first["busy"] == pytest.approx(0.35)
    # The span it is over: the snapshot's two polls, 5 s apart.
    assert first["activity"]["until"] - first["activity"]["since"] == pytest.approx(5.0)
    assert first["activity"]["until"] == found["taken_at"]


# -- configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        ("slow", "slow"),
        ("every_poll", "every_poll"),
        ("off", "off"),
        # Before it was a choice it was a boolean: true (on) is the default, slow; false is off.
        (True, "slow"),
        (False, "off"),
        ("true", "slow"),
        ("False", "off"),
    ],
)
def test_mig_activity_takes_a_mode_or_the_boolean_it_used_to_be(value: Any, mode: str) -> None:
    readings = ReadingsConfig(mig_activity=value)
    assert readings.mig_activity == mode
    assert readings.options().mig_activity == mode
    assert ReadingsConfig().mig_activity == "slow"


@pytest.mark.parametrize(
    ("text", "mode"),
    [
        ("readings: {mig_activity: every_poll}\n", "every_poll"),
        ("readings: {mig_activity: on}\n", "slow"),  # YAML's on and off are booleans
        ("readings: {mig_activity: off}\n", "off"),
        ("readings: {mig_activity: no}\n", "off"),
    ],
)
def test_a_config_file_sets_mig_activity(tmp_path: Path, text: str, mode: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    found, problems = check_config(path)
    assert problems == []
    assert found is not None
    assert found.readings.mig_activity == mode


def test_a_bad_mig_activity_is_one_line_naming_the_key_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("readings: {mig_activity: sometimes}\n")
    assert main(["check-config", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"{path}: readings.mig_activity: expected slow, every_poll, off (or true for slow, false for off), "
        "got 'sometimes'"
    ]
    monkeypatch.setenv("GPULEDGER_READINGS__MIG_ACTIVITY", "2")
    _, problems = check_config(None)
    assert problems == [
        "environment: readings.mig_activity (from GPULEDGER_READINGS__MIG_ACTIVITY): expected slow, every_poll, "
        "off (or true for slow, false for off), got '2'"
    ]


# -- record and replay ----------------------------------------------------------------------------


def test_a_trace_recorded_on_the_slow_rhythm_replays_the_same_span_means(tmp_path: Path) -> None:
    # CHANGING for five minutes, with a second change inside a span (10% -> 70% at 2m13s).
    node = {
        **CHANGING,
        "start": "2026-11-20T18:00:00Z",
        "processes": [
            {
                **CHANGING["processes"][0],
                "sm_util": [
                    {"at": "0s", "sm_util": 80, "sm_active": 40},
                    {"at": "47s", "sm_util": 20, "sm_active": 10},
                    {"at": "2m13s", "sm_util": 90, "sm_active": 70},
                ],
            },
            CHANGING["processes"][1],
        ],
    }
    duration_s = 300.0
    # No node_name: the node's hostname, which MIG uuids derive from, goes into the trace.
    agent, tap = build_recording_agent(settings(node_name=None), node, STEP_S, monotonic=lambda: 0.0)
    polls: list[Series] = []
    try:
        trace = record(agent, tap, duration_s, STEP_S, on_poll=lambda s: polls.append(series(agent, s)))
    finally:
        agent.close()
    path = tmp_path / "trace.yaml"
    write_trace(trace, str(path), "# slow rhythm\n")
    fake_nvml.uninstall()
    # Each row of a slow span holds the span's mean (a row holds until the next), so the replay's
    # samples, at 0 and 5 s and then 30 s apart, read it back: 0-5 s and 5-35 s 40%; 35-65 s 22%
    # (see above); 125-155 s: 10% for 8 s, 70% for 22 s, (10 x 8 + 70 x 22) / 30 = 54%.
    rows = {row["at"]: row for row in yaml.safe_load(path.read_text())["gpus"][0]["readings"]}
    for at, percent in ((0, 40), (5, 40), (30, 40), (35, 22), (60, 22), (125, 54), (150, 54)):
        assert rows[at]["migs"][0]["sm_active"] == pytest.approx(percent), at
        assert rows[at]["sm_active"] == pytest.approx(percent * WEIGHT), at
    replayed = replayed_series(str(path), settings(node_name=None), duration_s, STEP_S)
    assert len(replayed) == len(polls) == 61
    for k, (original, again) in enumerate(zip(polls, replayed, strict=True)):
        problems = same(original, again)
        assert not problems, f"poll {k}: " + "\n".join(problems[:10])
    # The comparison had MIG activity to compare: at 300 s, the 245-275 s span, 70% and 0%.
    last = polls[-1]
    assert sorted(v for (name, _), v in last.items() if name == "gpuledger_mig_sm_active_ratio") == pytest.approx(
        [0.0, 0.70]
    )

"""Right-sizing, worked by hand: the ledger keeps per workload-hour what sizing needs
(sizing_hours, schema 6), and `report --recommend` names the cheapest option in the catalogue
that fits, with what it would save a month (730 h)."""

from __future__ import annotations

import json
import math
import sqlite3
from contextlib import closing
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.accounting import sketch
from agent.accounting.rightsize import (
    ACTION_FEWER,
    ACTION_MIG,
    ACTION_NONE,
    ACTION_SMALLER,
    ACTION_STOP,
    WorkloadSizing,
    recommend,
)
from agent.cli.recommend import load_specs
from agent.ledger.schema import SCHEMA_VERSION
from agent.ledger.sizing import read_sizing, workload_sizing
from agent.ledger.store import Ledger
from agent.model import Charges, GpuCharge, UnitUsage, Workload, WorkloadCharge
from tests.test_cli import gpuledger
from tests.test_ledger_migrations import write_v5_ledger

H = 3600
T0 = 1_795_000_000 // H * H  # the start of an hour
A100 = "A100-SXM4-80GB"
A100_PRICE = 3.430881  # the catalogue's $/GPU-hour (p4de.24xlarge / 8)
T4_PRICE = 0.526
GIB = 2**30
SPECS = load_specs()


def price_of(model: str) -> float | None:
    return {A100: A100_PRICE, "Tesla T4": T4_PRICE, "L4": 0.8048, "A10G": 1.006, "L40S": 1.861}.get(model)


def write_ledger(
    path: Path,
    workload: Workload,
    *,
    hours: int,
    memory_bytes: int,
    busy: float | None,
    units: int = 1,
    mig_profile: str = "",
    from_hour: int = 0,
) -> None:
    """`hours` hours of `workload` holding `units` A100s at the catalogue price from `from_hour`
    hours after T0, every poll (one a minute) reading the same memory and busy figures."""
    with Ledger(path, node="node-a", retention_s=None) as ledger:
        for minute in range(hours * 60):
            start = T0 + from_hour * H + minute * 60.0
            uuids = [f"GPU-{i}" for i in range(units)]
            dollars = A100_PRICE / 60
            ledger.add(
                Charges(
                    start, start + 60.0, "node-a",
                    workloads=tuple(
                        WorkloadCharge(i, u, workload, 60.0, 60.0 * (busy or 0.0), dollars, 0.0, charged_s=60.0)
                        for i, u in enumerate(uuids)
                    ),
                    gpus=tuple(
                        GpuCharge(i, u, A100, A100_PRICE, 60.0, dollars, 0.0, 0.0, 0.0, 0.0, 0.0)
                        for i, u in enumerate(uuids)
                    ),
                    usage=tuple(
                        UnitUsage(workload, u, A100, mig_profile, memory_bytes, 80 * GIB, busy, "nvml") for u in uuids
                    ),
                )
            )  # fmt: skip


def sizing_of(path: Path) -> WorkloadSizing:
    rows, rates = read_sizing(path)
    (usage,) = workload_sizing(rows, rates)
    return usage


INFERENCE = Workload(namespace="serving", pod="embedder-0", container="server")


def test_a_small_inference_workload_on_an_80gb_a100_is_told_to_move_to_a_smaller_gpu(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    write_ledger(path, INFERENCE, hours=24, memory_bytes=6 * GIB, busy=0.15)
    usage = sizing_of(path)
    # Stored: 24 hours x 3600 s held, busy 15% of it; the 6 GiB sits in the memory bucket whose
    # edge is just above it (256 MiB x 2^(37/8) = 6.17 GiB), so p95 is capped by the exact peak.
    assert (usage.units, usage.held_s, usage.peak_memory_bytes) == (1, 24 * 3600.0, 6 * GIB)
    assert usage.mean_busy == pytest.approx(0.15)
    assert usage.p95_busy == pytest.approx(0.15)
    assert usage.p95_memory_bytes == 6 * GIB
    advice = recommend(usage, SPECS, price_of, end=T0 + 24 * H)
    # Needs 6 GiB x 1.2 = 7.2 GiB and 0.15 x 312 TFLOPS x 1.2 = 56.16 TFLOPS. Fits: T4 (16 GiB,
    # 65 TFLOPS, $0.526), L4 ($0.8048), A10G ($1.006), L40S ($1.861), the A100's MIG 2g.20gb
    # (89.1 TFLOPS, $3.430881 x 2/7 = $0.98); not 1g.10gb (312/7 = 44.6 TFLOPS). Cheapest: T4.
    assert (advice.action, advice.option) == (ACTION_SMALLER, "1 x Tesla T4")
    assert advice.dollars_per_hour == pytest.approx(A100_PRICE)  # as the ledger charged it
    # ($3.430881 - $0.526) x 730 h = $2,120.56313 a month
    assert advice.saving_per_month == pytest.approx(2120.56313)
    assert advice.basis.startswith("estimate:")
    assert "56.2 TFLOPS" in advice.basis
    assert "7.2 GiB" in advice.basis
    assert "730 h/month" in advice.basis


def test_where_only_the_a100_is_catalogued_the_same_workload_gets_a_mig_profile(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    write_ledger(path, INFERENCE, hours=24, memory_bytes=6 * GIB, busy=0.15)
    advice = recommend(sizing_of(path), {A100: SPECS[A100]}, price_of, end=T0 + 24 * H)
    assert (advice.action, advice.option) == (ACTION_MIG, f"{A100} MIG 2g.20gb")
    # 2g.20gb: $3.430881 x 2/7 = $0.980252 an hour; saving $3.430881 x 5/7 x 730 = $1,788.95939
    assert advice.option_dollars_per_hour == pytest.approx(A100_PRICE * 2 / 7)
    assert advice.saving_per_month == pytest.approx(1788.95939)


def test_a_workload_that_uses_its_gpu_fully_gets_no_recommendation(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    training = Workload(hpc_job="4242", user="alice")
    write_ledger(path, training, hours=24, memory_bytes=70 * GIB, busy=1.0)
    advice = recommend(sizing_of(path), SPECS, price_of, end=T0 + 24 * H)
    # Needs 84 GiB and 374 TFLOPS: nothing cheaper than its A100 has both.
    assert (advice.action, advice.option, advice.saving_per_month) == (ACTION_NONE, "", 0.0)
    assert "nothing cheaper fits" in advice.basis


def test_an_allocation_idle_for_days_is_told_to_stop(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    forgotten = Workload(namespace="research", pod="notebook-7", container="jupyter")
    write_ledger(path, forgotten, hours=72, memory_bytes=0, busy=0.0)
    advice = recommend(sizing_of(path), SPECS, price_of, end=T0 + 72 * H)
    assert advice.action == ACTION_STOP
    assert advice.option == "stop it: unused for 3.0 days"
    assert advice.unused_days == 3.0
    # All of it saved: $3.430881 x 730 h = $2,504.54313 a month
    assert advice.saving_per_month == pytest.approx(2504.54313)


def test_stopping_saves_what_is_held_now_not_the_most_held_at_once(tmp_path: Path) -> None:
    # An hour on 4 idle A100s, then 71 hours on 1: the most held at once is 4, but stopping it
    # now frees 1 GPU. It was told it would save 4 x $3.430881 x 730 = $10,018.17 a month.
    path = tmp_path / "ledger.db"
    forgotten = Workload(namespace="research", pod="notebook-9", container="jupyter")
    write_ledger(path, forgotten, hours=1, memory_bytes=0, busy=0.0, units=4)
    write_ledger(path, forgotten, hours=71, memory_bytes=0, busy=0.0, from_hour=1)
    usage = sizing_of(path)
    assert (usage.units, usage.units_at_end) == (4, 1)
    advice = recommend(usage, SPECS, price_of, end=T0 + 72 * H)
    assert (advice.action, advice.option) == (ACTION_STOP, "stop it: unused for 3.0 days")
    # 1 x $3.430881 x 730 h = $2,504.54313 a month
    assert advice.dollars_per_hour == pytest.approx(A100_PRICE)
    assert advice.saving_per_month == pytest.approx(2504.54313)
    assert f"1 x {A100} at $3.43" in advice.basis


def test_a_mig_instance_with_no_busy_reading_is_not_told_to_stop(tmp_path: Path) -> None:
    # An A100's MIG instance has no utilization reading without GPM: three days unmeasured show
    # no idleness, so it cannot be sized, not "stop it: unused for 3.0 days" ($1,073.38 a month).
    path = tmp_path / "ledger.db"
    serving = Workload(namespace="serving", pod="mig-0", container="server")
    write_ledger(path, serving, hours=72, memory_bytes=20 * GIB, busy=None, mig_profile="3g.40gb")
    usage = sizing_of(path)
    assert (usage.measured_s, usage.last_used_hour) == (0.0, T0 + 71 * H)
    advice = recommend(usage, SPECS, price_of, end=T0 + 72 * H)
    assert (advice.action, advice.saving_per_month) == (ACTION_NONE, 0.0)
    assert advice.basis == "cannot size: no busy readings"


def test_a_held_mig_instance_costs_its_gpu_price_as_the_ledger_charged_it(tmp_path: Path) -> None:
    # A 3g.40gb of an A100 charged at the config's $2/GPU-hour (not the catalogue's $3.430881),
    # weighted by its 42 of 108 SMs, idle for three days under GPM.
    path = tmp_path / "ledger.db"
    notebook = Workload(namespace="research", pod="nb-0", container="jupyter")
    weight = 42 / 108
    with Ledger(path, node="node-a", retention_s=None) as ledger:
        for minute in range(72 * 60):
            start = T0 + minute * 60.0
            dollars = 2.0 / 60 * weight
            ledger.add(
                Charges(
                    start, start + 60.0, "node-a",
                    workloads=(WorkloadCharge(0, "MIG-0", notebook, 60.0 * weight, 0.0, dollars, 0.0,
                                              charged_s=60.0 * weight),),
                    gpus=(GpuCharge(0, "GPU-0", A100, 2.0, 60.0, 2.0 / 60, 60.0 * (1 - weight),
                                    2.0 / 60 - dollars, 0.0, 0.0, 0.0),),
                    usage=(UnitUsage(notebook, "MIG-0", A100, "3g.40gb", 5 * GIB, 40 * GIB, 0.0, "gpm"),),
                )
            )  # fmt: skip
    advice = recommend(sizing_of(path), SPECS, price_of, end=T0 + 72 * H)
    assert advice.action == ACTION_STOP
    # $2 x 3/7 = $0.857143 an hour, x 730 h = $625.714286 a month (not $3.430881 x 3/7 x 730 = $1,073.38)
    assert advice.dollars_per_hour == pytest.approx(2.0 * 3 / 7)
    assert advice.saving_per_month == pytest.approx(625.714286)


def test_four_lightly_used_gpus_are_told_to_use_fewer(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    trainer = Workload(hpc_job="777", user="bob")
    write_ledger(path, trainer, hours=2, memory_bytes=10 * GIB, busy=0.2, units=4)
    usage = sizing_of(path)
    assert (usage.units, usage.held_s) == (4, 4 * 2 * 3600.0)
    advice = recommend(usage, {A100: SPECS[A100]}, price_of, end=T0 + 2 * H)
    # Needs 4 x 0.2 x 312 x 1.2 = 299.52 TFLOPS (one A100) and 4 x 10 x 1.2 = 48 GiB (one A100).
    assert (advice.action, advice.option) == (ACTION_FEWER, f"1 x {A100}")
    # Three GPUs fewer: 3 x $3.430881 x 730 = $7,513.62939 a month
    assert advice.saving_per_month == pytest.approx(7513.62939)


def test_four_memory_bound_gpus_are_told_to_use_as_many_as_their_memory_needs(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    trainer = Workload(hpc_job="778", user="bob")
    write_ledger(path, trainer, hours=2, memory_bytes=48 * GIB, busy=0.1, units=4)
    advice = recommend(sizing_of(path), {A100: SPECS[A100]}, price_of, end=T0 + 2 * H)
    # Needs 4 x 0.1 x 312 x 1.2 = 149.76 TFLOPS (one A100) but 4 x 48 x 1.2 = 230.4 GiB: three
    # A100s (240 GiB), not one (80 GiB) and so nothing.
    assert (advice.action, advice.option) == (ACTION_FEWER, f"3 x {A100}")
    # One GPU fewer: $3.430881 x 730 = $2,504.54313 a month
    assert advice.saving_per_month == pytest.approx(2504.54313)


def test_the_sketch_reports_the_bucket_edge_above_the_95th_percentile() -> None:
    busy: sketch.Sketch = {}
    sketch.add(busy, sketch.busy_bucket(0.10), 90.0)
    sketch.add(busy, sketch.busy_bucket(0.88), 10.0)
    # 95% of 100 s falls in the 10 s at 88%: reported as that bucket's upper edge, 90%.
    assert sketch.busy_edge(sketch.quantile_bucket(busy, 0.95) or 0) == pytest.approx(0.90)
    # Memory buckets are at most 2^(1/8) = 9.05% wide: 6 GiB reads as at most 6.17 GiB.
    edge = sketch.memory_edge(sketch.memory_bucket(6 * GIB))
    assert 6 * GIB <= edge < 6 * GIB * 2 ** (1 / 8)
    assert sketch.decode(sketch.merge_encoded(sketch.encode({3: 1.5}), sketch.encode({3: 2.0, 5: 1.0}))) == {
        3: 3.5,
        5: 1.0,
    }


def test_flushes_merge_sizing_rows_in_the_file(tmp_path: Path) -> None:
    # Two flushes into the same hour: seconds add, sketches add bucket by bucket, peaks keep the larger.
    path = tmp_path / "ledger.db"
    w = Workload(pod="p", namespace="n")
    with Ledger(path, node="node-a", retention_s=None) as ledger:
        for memory, busy in ((2 * GIB, 0.5), (3 * GIB, 0.25)):
            ledger.add(Charges(T0, T0 + 60.0, "node-a", usage=(UnitUsage(w, "GPU-0", A100, "", memory, None, busy),)))
            assert ledger.flush()
    (row,), _rates = read_sizing(path)
    assert (row.held_s, row.busy_s, row.measured_s, row.peak_memory_bytes) == (120.0, 45.0, 120.0, 3 * GIB)
    assert row.busy_sketch == {10: 60.0, 5: 60.0}
    assert math.fsum(row.memory_sketch.values()) == 120.0


def test_a_version_5_ledger_gains_sizing_hours_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "v5.db"
    write_v5_ledger(path)
    Ledger(path, retention_s=None).close()
    with closing(sqlite3.connect(path)) as conn, conn:
        assert conn.execute("SELECT max(version) FROM schema_version").fetchone() == (SCHEMA_VERSION,)
        assert conn.execute("SELECT count(*) FROM sizing_hours").fetchone() == (0,)  # nothing recorded sizing then
        assert conn.execute("SELECT count(*) FROM workload_hours").fetchone()[0] > 0
    rows, rates = read_sizing(path)
    assert rows == []
    assert rates


def test_report_recommend_prints_json_and_a_table(tmp_path: Path) -> None:
    path = tmp_path / "ledger.db"
    write_ledger(path, INFERENCE, hours=24, memory_bytes=6 * GIB, busy=0.15)
    result = gpuledger("report", "--ledger", str(path), "--recommend", "--format", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["hours_per_month"] == 730
    assert doc["estimate"] is True
    (only,) = doc["workloads"]
    assert (only["action"], only["option"], only["holds"]) == (ACTION_SMALLER, "1 x Tesla T4", f"1 x {A100}")
    assert only["saving_per_month_estimate"] == pytest.approx(2120.56313)
    table = gpuledger("report", "--ledger", str(path), "--recommend")
    assert table.returncode == 0, table.stderr
    assert "serving/embedder-0" in table.stdout
    assert "2120.56" in table.stdout
    assert "730 h/month" in table.stdout


@given(
    st.dictionaries(
        st.integers(0, sketch.MEMORY_BUCKETS),
        st.one_of(st.floats(allow_nan=False), st.integers(0, 10**6), st.just(math.inf)),
        max_size=12,
    )
)
def test_a_sketch_is_stored_as_the_json_encoder_writes_it_and_read_back_as_json_reads_it(
    counts: dict[int, float],
) -> None:
    # encode writes finite floats itself and remembers what it wrote, for decode: both must
    # agree with json to the character and the bit, whatever the sketch holds.
    text = sketch.encode(counts)
    assert text == json.dumps({str(k): counts[k] for k in sorted(counts) if counts[k]}, separators=(",", ":"))
    expected = {int(k): float(v) for k, v in json.loads(text).items()}
    assert repr(sketch.decode(text)) == repr(expected)
    assert sketch.merge_encoded(text, text) == sketch.encode({k: v + v for k, v in expected.items()})

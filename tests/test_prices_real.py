"""Real prices: how a node is bought (on demand, spot, reserved, savings plan, committed use),
a price that changes mid-window, and an instance type that does not match the GPUs, each from
the rules (`resolve_price`, `Price`) to the ledger and `report`, with the arithmetic by hand."""

from __future__ import annotations

import logging
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agent.accounting.pricing import Catalogue, price_schedule, same_model
from agent.config import PricingConfig, Settings, check_config, load_catalogue
from agent.ledger.read import read_usage
from agent.ledger.report import report_from_ledger
from agent.model import AgentState, Price
from tests.helpers import Rig
from tests.test_pricing import TEST_CATALOGUE, UUID, price, write

START = datetime(2026, 11, 20, 18, 0, tzinfo=UTC).timestamp()
HOUR = 3600.0
P4DE = load_catalogue().instance_types["p4de.24xlarge"]  # $27.44705/h for 8 x A100-SXM4-80GB


@pytest.fixture
def catalogue(tmp_path: Path) -> Catalogue:
    return load_catalogue(write(tmp_path, TEST_CATALOGUE))


# -- the rules, on the test catalogue (p4d.24xlarge $24/h for 8 x A100-SXM4-40GB) ---------------


def test_a_spot_node_is_priced_at_its_instance_types_spot_price(catalogue: Catalogue) -> None:
    got = price(catalogue, detected="p4d.24xlarge", purchase="spot", spot_hourly={"p4d.24xlarge": 8.0})
    assert got is not None
    assert got.dollars_per_hour == 1.0  # $8/h spot for the instance / its 8 GPUs
    assert (got.origin, got.purchase) == ("instance", "spot")
    assert got.source == "spot: instance p4d.24xlarge $8/h / 8 GPUs (config pricing.spot_hourly)"


def test_a_spot_node_without_a_spot_price_for_its_type_pays_on_demand_and_says_so(catalogue: Catalogue) -> None:
    got = price(catalogue, detected="p4d.24xlarge", purchase="spot", spot_hourly={"g5.12xlarge": 2.0})
    assert got is not None
    assert got.dollars_per_hour == 3.0  # the on-demand $24/h / 8
    assert got.purchase == "spot"
    assert got.source.startswith("spot without a spot price for p4d.24xlarge: on-demand instance p4d.24xlarge $24/h")


@pytest.mark.parametrize(
    ("terms", "dollars", "origin"),
    [
        ({"purchase": "reserved", "discount": 0.4}, 3.0 * 0.6, "instance"),  # 40% off $24/h / 8 = $1.80
        ({"purchase": "savings_plan", "rate": 2.2}, 2.2, "config"),  # the plan's rate per GPU-hour
        ({"purchase": "committed", "discount": 0.55}, 3.0 * 0.45, "instance"),  # a 3-year CUD: $1.35
        ({"purchase": "spot", "discount": 0.7}, 3.0 * 0.3, "instance"),  # spot as a fraction of on-demand
        ({"purchase": "on_demand", "discount": 0.1}, 3.0 * 0.9, "instance"),  # an enterprise discount
    ],
    ids=["reserved", "savings_plan", "committed", "spot-discount", "on_demand-discount"],
)
def test_a_purchase_option_takes_its_rate_or_its_discount(
    catalogue: Catalogue, terms: dict[str, Any], dollars: float, origin: str
) -> None:
    got = price(catalogue, detected="p4d.24xlarge", **terms)
    assert got is not None
    assert got.dollars_per_hour == pytest.approx(dollars, rel=1e-12)
    assert (got.purchase, got.origin) == (terms["purchase"], origin)
    assert got.source.startswith(f"{terms['purchase']}: ")


def test_a_discount_applies_to_a_configured_price_too(catalogue: Catalogue) -> None:
    got = price(catalogue, gpu_hourly=2.5, purchase="reserved", discount=0.2)
    assert got is not None
    assert got.dollars_per_hour == 2.0  # $2.50 x (1 - 0.2)
    assert got.source == "reserved: 20% off (config pricing.discount) config pricing.gpu_hourly"


def test_an_instance_type_with_other_gpus_is_not_used(catalogue: Catalogue) -> None:
    # A T4 on a node that says it is a p4d.24xlarge (8 x A100 40GB): priced as a T4, spot price and all ignored.
    got = price(
        catalogue, model="Tesla T4", detected="p4d.24xlarge", purchase="spot", spot_hourly={"p4d.24xlarge": 8.0}
    )
    assert got is not None
    assert got.dollars_per_hour == 0.5  # the catalogue's T4, on demand: no spot price for what it really is
    assert got.origin == "catalogue"
    assert got.mismatch == (
        "instance type p4d.24xlarge comes with A100-SXM4-40GB GPUs but NVML reports Tesla T4: priced as Tesla T4"
    )


def test_a_matching_instance_type_reports_no_mismatch(catalogue: Catalogue) -> None:
    got = price(catalogue, detected="p4d.24xlarge")
    assert got is not None
    assert (got.mismatch, got.origin, got.dollars_per_hour) == ("", "instance", 3.0)


def test_a_gpu_whose_model_is_unknown_yet_is_priced_by_its_instance_type(catalogue: Catalogue) -> None:
    # Not identified yet (model ""): nothing says it is not the p4d.24xlarge's A100, so $24/h / 8 = $3.
    got = price(catalogue, model="", detected="p4d.24xlarge")
    assert got is not None
    assert (got.mismatch, got.origin, got.dollars_per_hour) == ("", "instance", 3.0)


def test_one_part_under_two_names_is_one_model() -> None:
    assert same_model("H100-SXM5-80GB", "NVIDIA H100 80GB HBM3")
    assert same_model("a100-sxm4-80gb", "A100 SXM4 80GB")
    assert not same_model("A100-SXM4-80GB", "A100-SXM4-40GB")


def test_the_shipped_scenarios_instance_types_match_their_gpus() -> None:
    import fake_nvml.scenario as scenarios

    shipped = load_catalogue()
    for name in ("demo", "weekend-idle"):
        scenario = scenarios.load_scenario(name)
        listed = shipped.instance_types[scenario.node.instance_type]
        assert {same_model(listed.gpu_model, gpu.model) for gpu in scenario.gpus} == {True}, name


# -- a price history -------------------------------------------------------------------------


def test_a_price_is_charged_piecewise_across_its_changes() -> None:
    later = Price(1.0, "later")
    last = Price(4.0, "last")
    p = Price(2.0, "first", changes=((100.0, later), (200.0, last)))
    # 50 s at $2/h, 100 s at $1/h, 50 s at $4/h: (100 + 100 + 200) / 3600
    assert p.dollars(50.0, 250.0) == pytest.approx((50 * 2.0 + 100 * 1.0 + 50 * 4.0) / 3600, rel=1e-12)
    assert p.dollars(0.0, 100.0) == 100 * 2.0 / 3600  # ends at the change: all before it
    assert (p.at(99.0), p.at(100.0), p.at(250.0)) == (p, later, last)
    assert p.during(0.0, 100.0) == p  # a change at the end is the next interval's
    assert p.during(100.0, 150.0) == later


def test_a_schedule_resolves_each_period(catalogue: Catalogue) -> None:
    config = PricingConfig(
        instance_type="p4d.24xlarge",
        changes=[{"at": "2026-12-01T00:00:00Z", "purchase": "reserved", "discount": 0.5}],
    )
    got = price_schedule(
        config.epochs(), model="A100-SXM4-40GB", uuid=UUID, gpu_count=8, instance_type=None, catalogue=catalogue
    )
    assert got is not None
    change = datetime(2026, 12, 1, tzinfo=UTC).timestamp()
    assert got.dollars_per_hour == 3.0
    assert got.at(change - 1).purchase == "on_demand"
    assert (got.at(change).dollars_per_hour, got.at(change).purchase) == (1.5, "reserved")  # half of $3


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pricing", "problem"),
    [
        ({"purchase": "reserved"}, "pricing: purchase reserved needs its rate or discount"),
        ({"purchase": "spot"}, "pricing: purchase spot needs spot_hourly, a rate or a discount"),
        ({"purchase": "savings_plan", "rate": 2.0, "discount": 0.3}, "pricing: give rate or discount, not both"),
        ({"purchase": "leased"}, "pricing.purchase: Input should be 'on_demand', 'spot', 'reserved',"),
        ({"discount": 1.0}, "pricing.discount: Input should be less than 1"),
        ({"spot_hourly": {"p4d.24xlarge": -1}}, "pricing.spot_hourly.p4d.24xlarge: Input should be greater than"),
        ({"changes": [{"at": "2026-12-01", "gpu_hourly": 2}, {"at": "2026-11-01", "gpu_hourly": 3}]}, "time order"),
        (
            {"changes": [{"at": "2026-12-01", "purchase": "committed"}]},
            "(from pricing.changes at 2026-12-01T00:00:00Z)",
        ),
        ({"changes": [{"at": "soon", "gpu_hourly": 2}]}, "pricing.changes.0.at: "),
        ({"changes": [{"at": "2026-12-01", "instance_type": "p5.48xlarge"}]}, "pricing.changes.0.instance_type: "),
    ],
)
def test_bad_pricing_is_one_line_naming_its_key(tmp_path: Path, pricing: dict[str, Any], problem: str) -> None:
    import json

    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"pricing": pricing}))
    settings, problems = check_config(config)
    assert settings is None
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{config}: ")
    assert problem in problems[0]


# -- end to end: polls, the ledger, report ---------------------------------------------------

# Eight A100 80GB on a p4de.24xlarge: a job on GPUs 0-3 at 90% all along, GPUs 4-7 idle.
NODE = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "spot-node", "instance_type": "p4de.24xlarge"},
    "gpus": [{"model": "A100-SXM4-80GB", "count": 8}],
    "processes": [
        {"pid": 700 + i, "gpus": [i], "sm_util": 90, "memory_mib": 40000, "user": "ana", "uid": 1020, "slurm_job": "77"}
        for i in range(4)
    ],
}


def simulate(tmp_path: Path, hours: float, scenario: dict[str, Any] = NODE, **pricing: Any) -> AgentState:
    rig = Rig(scenario, settings=Settings(pricing=pricing), ledger_path=tmp_path / "ledger.db")
    try:
        return rig.run(hours * HOUR, 60)
    finally:
        rig.close()


def conservation(path: Path, expected_total: float) -> None:
    """Workloads + idle + unobserved is every GPU's price x time: the report's TOTAL and its parts."""
    report = report_from_ledger(path, by=["hpc_job"])
    parts = math.fsum([line.dollars for line in report.lines] + [report.idle.dollars, report.unobserved.dollars])
    assert report.total.dollars == pytest.approx(expected_total, rel=1e-9)
    assert parts == pytest.approx(expected_total, rel=1e-9)


def test_a_spot_node_end_to_end(tmp_path: Path) -> None:
    state = simulate(tmp_path, 3, purchase="spot", spot_hourly={"p4de.24xlarge": 9.6})
    # $9.60/h for the instance, spot, over its 8 GPUs: $1.20 per GPU-hour. Three hours of 8 GPUs:
    # 8 x 3 x 1.20 = $28.80; the job's 4 GPUs $14.40, the 4 idle ones $14.40.
    conservation(tmp_path / "ledger.db", 28.8)
    report = report_from_ledger(tmp_path / "ledger.db", by=["hpc_job"])
    assert {line.key: line.dollars for line in report.lines} == {("77",): pytest.approx(14.4, rel=1e-9)}
    assert report.idle.dollars == pytest.approx(14.4, rel=1e-9)
    rows = read_usage(tmp_path / "ledger.db")
    assert {(r.dollars_per_hour, r.purchase, r.price_source) for r in rows} == {(1.2, "spot", "instance")}
    prices = dict(state.prices)
    assert {(p.dollars_per_hour, p.origin, p.purchase) for p in prices.values() if p} == {(1.2, "instance", "spot")}


def test_a_price_change_mid_window_applies_from_its_time_on(tmp_path: Path) -> None:
    # On demand until 20:00 (t=2h), then reserved at 40% off, for 4 hours.
    simulate(tmp_path, 4, changes=[{"at": "2026-11-20T20:00:00Z", "purchase": "reserved", "discount": 0.4}])
    on_demand = P4DE.dollars_per_hour / 8  # $27.44705 / 8 = $3.43088125 per GPU-hour
    reserved = on_demand * 0.6  # $2.05852875
    # 8 GPUs x 2 h x $3.43088125 + 8 GPUs x 2 h x $2.05852875 = $54.8941 + $32.93646 = $87.83056
    conservation(tmp_path / "ledger.db", 8 * 2 * on_demand + 8 * 2 * reserved)
    assert 8 * 2 * on_demand + 8 * 2 * reserved == pytest.approx(87.83056, rel=1e-9)
    # Each hour's rows record the price they were charged at.
    by_hour = {(r.hour - START) // HOUR: (r.dollars_per_hour, r.purchase) for r in read_usage(tmp_path / "ledger.db")}
    assert by_hour == {
        0: (pytest.approx(on_demand), "on_demand"),
        1: (pytest.approx(on_demand), "on_demand"),
        2: (pytest.approx(reserved), "reserved"),
        3: (pytest.approx(reserved), "reserved"),
    }
    # The job's 4 GPUs: 4 x 2 x on_demand + 4 x 2 x reserved.
    job = report_from_ledger(tmp_path / "ledger.db", by=["hpc_job"]).lines[0]
    assert job.dollars == pytest.approx(4 * 2 * on_demand + 4 * 2 * reserved, rel=1e-9)


def test_a_change_between_two_polls_is_charged_at_its_instant(tmp_path: Path) -> None:
    # Polls every 7 minutes: 18:56 and 19:03 straddle a change at 19:00 to $1/GPU-hour from $2.
    rig = Rig(
        {"gpus": [{"count": 1}], "start": "2026-11-20T18:00:00Z"},
        settings=Settings(
            pricing={"gpu_hourly": 2.0, "changes": [{"at": "2026-11-20T19:00:00Z", "gpu_hourly": 1.0}]},
            accounting={"max_interval": "10m"},  # 7 minutes between polls is still observed time
        ),
    )
    try:
        state = rig.run(2 * HOUR, 7 * 60)
    finally:
        rig.close()
    (totals,) = state.costs.gpus.values()
    # 18 polls, 17 intervals of 7 min: 0 to 119 min. 60 min at $2/h, then 59 min at $1/h:
    # $2 + $0.98333..., exactly, though no poll fell at 19:00.
    assert totals.dollars == pytest.approx(2.0 + 59 / 60, rel=1e-12)
    assert dict(state.prices)[next(iter(dict(state.prices)))] == Price(1.0, "config pricing.gpu_hourly")


def hourly_dollars(path: Path) -> dict[float, float]:
    """TOTAL's dollars of each hour, as `report --since H --until H+1h` gives them, by hours after START."""
    got = {}
    for hour in sorted({r.hour for r in read_usage(path)}):
        report = report_from_ledger(path, by=["hpc_job"], since=hour, until=hour + HOUR)
        got[(hour - START) / HOUR] = report.total.dollars
    return got


def test_an_interval_across_a_change_and_an_hour_puts_each_price_in_its_hour(tmp_path: Path) -> None:
    # As above, the interval 18:56 to 19:03 straddles both the hour and the change to $1 at 19:00:
    # its 4 minutes before 19:00 cost $2/h, its 3 after $1/h, and each hour gets its own, not a
    # 4/7 and 3/7 share of the interval's $11/60.
    rig = Rig(
        {"gpus": [{"count": 1}], "start": "2026-11-20T18:00:00Z"},
        settings=Settings(
            pricing={"gpu_hourly": 2.0, "changes": [{"at": "2026-11-20T19:00:00Z", "gpu_hourly": 1.0}]},
            accounting={"max_interval": "10m"},
        ),
        ledger_path=tmp_path / "ledger.db",
    )
    try:
        rig.run(2 * HOUR, 7 * 60)
    finally:
        rig.close()
    # 18:00-19:00 at $2/h: $2; 19:00-19:59 at $1/h: 59/60 = $0.98333 (not $1.97143 and $1.01190)
    assert hourly_dollars(tmp_path / "ledger.db") == {
        0.0: pytest.approx(2.0, rel=1e-12),
        1.0: pytest.approx(59 / 60, rel=1e-12),
    }
    conservation(tmp_path / "ledger.db", 2.0 + 59 / 60)
    by_hour = {(r.hour - START) // HOUR: r.dollars_per_hour for r in read_usage(tmp_path / "ledger.db")}
    assert by_hour == {0: 2.0, 1: 1.0}


def test_downtime_across_a_change_puts_each_price_in_its_hour(tmp_path: Path) -> None:
    # One idle GPU at $2/h, $1/h from 20:30. The agent runs 18:00-19:00, is down until 22:00,
    # then runs an hour more: its first poll books 19:00-22:00 as unobserved, one charge.
    settings = Settings(pricing={"gpu_hourly": 2.0, "changes": [{"at": "2026-11-20T20:30:00Z", "gpu_hourly": 1.0}]})
    for start in ("2026-11-20T18:00:00Z", "2026-11-20T22:00:00Z"):
        rig = Rig({"gpus": [{"count": 1}], "start": start}, settings=settings, ledger_path=tmp_path / "ledger.db")
        try:
            rig.run(HOUR, 60)
        finally:
            rig.close()
    # 18h: $2 idle. Down: 19h $2; 20h 30 min at $2 + 30 min at $1 = $1.50; 21h $1 (not $1.50
    # each: the downtime's $4.50 over its 3 hours). 22h: $1 idle.
    assert hourly_dollars(tmp_path / "ledger.db") == {
        0.0: pytest.approx(2.0, rel=1e-12),
        1.0: pytest.approx(2.0, rel=1e-12),
        2.0: pytest.approx(1.5, rel=1e-12),
        3.0: pytest.approx(1.0, rel=1e-12),
        4.0: pytest.approx(1.0, rel=1e-12),
    }
    # 2.5 h at $2 + 2.5 h at $1 = $7.50, $4.50 of it unobserved
    conservation(tmp_path / "ledger.db", 2.5 * 2.0 + 2.5 * 1.0)
    report = report_from_ledger(tmp_path / "ledger.db", by=["hpc_job"])
    assert report.unobserved.dollars == pytest.approx(4.5, rel=1e-12)
    assert report.unobserved.gpu_hours_charged == pytest.approx(3.0, rel=1e-12)


def test_a_mismatched_instance_type_is_priced_by_the_gpu(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="gpuledger")
    # The shipped scenarios' old mistake: 80 GB A100s on a p4d.24xlarge, the 40 GB instance.
    scenario = {**NODE, "node": {"hostname": "wrong-node", "instance_type": "p4d.24xlarge"}}
    rig = Rig(scenario, settings=Settings(), ledger_path=tmp_path / "ledger.db")
    try:
        state = rig.run(2 * HOUR, 60)
        text = rig.metrics(state)
    finally:
        rig.close()
    model_price = load_catalogue().gpu_models["A100-SXM4-80GB"].dollars_per_hour  # $3.430881, not p4d's $2.7447
    # 8 GPUs x 2 h x $3.430881 = $54.894096
    conservation(tmp_path / "ledger.db", 8 * 2 * model_price)
    assert 8 * 2 * model_price == pytest.approx(54.894096, rel=1e-9)
    warnings = [r.getMessage() for r in caplog.records if "NVML reports" in r.getMessage()]
    assert warnings == [
        "pricing: instance type p4d.24xlarge comes with A100-SXM4-40GB GPUs but NVML reports A100-SXM4-80GB: "
        "priced as A100-SXM4-80GB (set pricing.instance_type if the detected one is wrong)"
    ]
    mismatch = [line for line in text.splitlines() if line.startswith("gpuledger_gpu_price_mismatch{")]
    assert len(mismatch) == 8
    assert all(line.endswith(" 1.0") for line in mismatch)
    assert 'source="catalogue"' in text
    assert 'purchase="on_demand"' in text


def test_a_configured_instance_type_that_does_not_match_says_to_correct_the_config(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The same mistake made in the config rather than detected: the warning points at the key set.
    caplog.set_level(logging.WARNING, logger="gpuledger")
    scenario = {**NODE, "node": {"hostname": "wrong-node"}}
    rig = Rig(scenario, settings=Settings(pricing={"instance_type": "p4d.24xlarge"}))
    try:
        state = rig.run(60, 60)
    finally:
        rig.close()
    # Priced as the GPUs are, as when detected: 8 GPUs x $3.430881/h, p4d's 40 GB price unused.
    model_price = load_catalogue().gpu_models["A100-SXM4-80GB"].dollars_per_hour
    assert [p.dollars_per_hour for p in dict(state.prices).values()] == [pytest.approx(model_price)] * 8
    warnings = [r.getMessage() for r in caplog.records if "NVML reports" in r.getMessage()]
    assert warnings == [
        "pricing: instance type p4d.24xlarge comes with A100-SXM4-40GB GPUs but NVML reports A100-SXM4-80GB: "
        "priced as A100-SXM4-80GB (pricing.instance_type names it: correct it, or price these GPUs with "
        "pricing.by_model)"
    ]

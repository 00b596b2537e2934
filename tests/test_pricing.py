"""Price per GPU-hour: config overrides, then the instance type, then the GPU model, then none
(PRODUCT.md "Cost arithmetic"); and the shipped catalogue those last two come from."""

from __future__ import annotations

import datetime as dt
import textwrap
from pathlib import Path
from typing import Any

import pytest

from agent.accounting.pricing import Catalogue, resolve_price
from agent.config import PricingConfig, load_catalogue, load_config
from agent.model import Price

REQUIRED_MODELS = [
    "Tesla T4",
    "L4",
    "A10G",
    "L40S",
    "A100-SXM4-40GB",
    "A100-SXM4-80GB",
    "A100 80GB PCIe",
    "A100-PCIE-40GB",
    "H100 80GB HBM3",
    "H100-SXM5-80GB",
    "H100 PCIe",
    "H200",
    "B200",
]

REQUIRED_INSTANCES = {
    "aws": [
        "p4d.24xlarge",
        "p4de.24xlarge",
        "p5.48xlarge",
        "p5e.48xlarge",
        "p5en.48xlarge",
        "g5.xlarge",
        "g5.12xlarge",
        "g5.48xlarge",
        "g6.xlarge",
        "g6.12xlarge",
        "g6.48xlarge",
    ],
    "gcp": [
        "a2-highgpu-1g",
        "a2-highgpu-2g",
        "a2-highgpu-4g",
        "a2-highgpu-8g",
        "a2-ultragpu-8g",
        "a3-highgpu-8g",
        "g2-standard-4",
        "g2-standard-8",
        "g2-standard-48",
    ],
    "azure": ["Standard_ND96asr_v4", "Standard_ND96amsr_A100_v4", "Standard_ND96isr_H100_v5"],
}

# A small catalogue of round numbers, so each rule's arithmetic is plain to see.
TEST_CATALOGUE = """\
gpu_models:
  Tesla T4: {dollars_per_hour: 0.5, source: "test list", read: 2026-01-02}
  A100-SXM4-40GB: {dollars_per_hour: 3.0, source: "test list", read: 2026-01-02}
instance_types:
  p4d.24xlarge:
    {dollars_per_hour: 24.0, gpus: 8, gpu_model: A100-SXM4-40GB, cloud: aws, region: us-east-1,
     source: "test price page", read: 2026-03-04}
  g5.12xlarge:
    {dollars_per_hour: 6.0, gpus: 4, gpu_model: A10G, cloud: aws, region: us-east-1,
     source: "test price page", read: 2026-03-04}
"""

UUID = "GPU-5d2c0000-0000-0000-0000-000000000001"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "prices.yaml"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def catalogue(tmp_path: Path) -> Catalogue:
    return load_catalogue(write(tmp_path, TEST_CATALOGUE))


def price(
    catalogue: Catalogue,
    *,
    model: str = "A100-SXM4-40GB",
    gpu_count: int = 8,
    detected: str | None = None,
    **pricing: Any,
) -> Price | None:
    """`detected` is the node's own instance type; `pricing` the config's pricing section."""
    return resolve_price(
        model=model,
        uuid=UUID,
        gpu_count=gpu_count,
        instance_type=detected,
        pricing=PricingConfig(**pricing),
        catalogue=catalogue,
    )


# -- the shipped catalogue -------------------------------------------------------------------


def test_shipped_catalogue_is_read_once() -> None:
    assert load_catalogue() is load_catalogue()


@pytest.mark.parametrize("model", REQUIRED_MODELS)
def test_shipped_catalogue_prices_every_required_model(model: str) -> None:
    entry = load_catalogue().gpu_models[model]
    assert entry.dollars_per_hour > 0
    assert entry.source.strip()
    assert dt.date(2024, 1, 1) <= entry.read <= dt.date.today()


@pytest.mark.parametrize(
    ("cloud", "instance_type"),
    [(cloud, name) for cloud, names in REQUIRED_INSTANCES.items() for name in names],
)
def test_shipped_catalogue_prices_every_required_instance_type(cloud: str, instance_type: str) -> None:
    entry = load_catalogue().instance_types[instance_type]
    assert entry.cloud == cloud
    assert entry.dollars_per_hour > 0
    assert entry.gpus >= 1
    assert entry.region.strip()
    assert entry.source.strip()
    assert dt.date(2024, 1, 1) <= entry.read <= dt.date.today()


def test_every_shipped_instance_names_a_catalogued_gpu_model() -> None:
    shipped = load_catalogue()
    strays = {name: entry.gpu_model for name, entry in shipped.instance_types.items()}
    assert {name: model for name, model in strays.items() if model not in shipped.gpu_models} == {}


def test_shipped_catalogue_prices_a_p4d_after_the_2025_cut() -> None:
    # AWS cut P4/P5 on-demand prices in June 2025; $32.77 is the old p4d.24xlarge figure.
    shipped = load_catalogue()
    assert shipped.instance_types["p4d.24xlarge"].dollars_per_hour < 32
    assert shipped.instance_types["p5.48xlarge"].dollars_per_hour < 98


# -- which rule wins -------------------------------------------------------------------------

EVERY_RULE: dict[str, Any] = {
    "gpu_hourly": 2.5,
    "by_uuid": {UUID: 3.5},
    "by_model": {"A100-SXM4-40GB": 4.5},
    "instance_type": "p4d.24xlarge",
    "instance_hourly": {"p4d.24xlarge": 40.0},
}


@pytest.mark.parametrize(
    ("switched_off", "dollars", "source"),
    [
        ([], 2.5, "config pricing.gpu_hourly"),
        (["gpu_hourly"], 3.5, f"config pricing.by_uuid[{UUID}]"),
        (["gpu_hourly", "by_uuid"], 4.5, "config pricing.by_model[A100-SXM4-40GB]"),
        (
            ["gpu_hourly", "by_uuid", "by_model"],
            5.0,
            "instance p4d.24xlarge $40/h / 8 GPUs (config pricing.instance_hourly)",
        ),
        (
            ["gpu_hourly", "by_uuid", "by_model", "instance_hourly"],
            3.0,
            "instance p4d.24xlarge $24/h / 8 GPUs (catalogue: test price page, read 2026-03-04)",
        ),
        (
            ["gpu_hourly", "by_uuid", "by_model", "instance_hourly", "instance_type"],
            3.0,
            "GPU model A100-SXM4-40GB $3/h (catalogue: test list, read 2026-01-02)",
        ),
    ],
    ids=["gpu_hourly", "by_uuid", "by_model", "config_instance", "catalogue_instance", "catalogue_model"],
)
def test_each_rule_wins_over_the_ones_after_it(
    catalogue: Catalogue, switched_off: list[str], dollars: float, source: str
) -> None:
    pricing = {key: value for key, value in EVERY_RULE.items() if key not in switched_off}
    assert price(catalogue, **pricing) == Price(dollars, source)


def test_the_configured_instance_type_wins_over_the_detected_one(catalogue: Catalogue) -> None:
    got = price(catalogue, model="A10G", gpu_count=4, detected="p4d.24xlarge", instance_type="g5.12xlarge")
    assert got == Price(1.5, "instance g5.12xlarge $6/h / 4 GPUs (catalogue: test price page, read 2026-03-04)")


def test_the_detected_instance_type_is_priced_from_config_first(catalogue: Catalogue) -> None:
    got = price(catalogue, detected="p4d.24xlarge", instance_hourly={"p4d.24xlarge": 32.0})
    assert got == Price(4.0, "instance p4d.24xlarge $32/h / 8 GPUs (config pricing.instance_hourly)")


def test_an_instance_type_nobody_prices_falls_through_to_the_model(catalogue: Catalogue) -> None:
    got = price(catalogue, detected="x9.mega")
    assert got is not None
    assert got.source.startswith("GPU model A100-SXM4-40GB")


@pytest.mark.parametrize("instance_type", [None, "x9.mega"])
def test_an_unknown_model_without_a_priced_instance_is_unpriced(
    catalogue: Catalogue, instance_type: str | None
) -> None:
    assert price(catalogue, model="Quadro RTX 6000", detected=instance_type) is None


def test_zero_from_config_is_a_price_not_a_gap(catalogue: Catalogue) -> None:
    # An owned, paid-off node may be priced at zero on purpose; that must not fall through.
    assert price(catalogue, gpu_hourly=0.0) == Price(0.0, "config pricing.gpu_hourly")


# -- dividing an instance's price ------------------------------------------------------------


@pytest.mark.parametrize(("gpu_count", "each"), [(8, 5.0), (4, 10.0), (1, 40.0)])
def test_a_configured_instance_price_is_split_over_the_gpus_the_node_has(
    catalogue: Catalogue, gpu_count: int, each: float
) -> None:
    got = price(catalogue, gpu_count=gpu_count, detected="p4d.24xlarge", instance_hourly={"p4d.24xlarge": 40.0})
    assert got is not None
    assert got.dollars_per_hour == each


def test_a_catalogue_instance_price_is_split_over_the_gpus_it_comes_with(catalogue: Catalogue) -> None:
    got = price(catalogue, gpu_count=4, detected="p4d.24xlarge")
    assert got == Price(
        3.0,
        "instance p4d.24xlarge $24/h / 8 GPUs (the catalogue's count; this node shows 4) "
        "(catalogue: test price page, read 2026-03-04)",
    )


def test_the_shipped_p4d_price_per_gpu() -> None:
    got = resolve_price(
        model="A100-SXM4-40GB",
        uuid=UUID,
        gpu_count=8,
        instance_type="p4d.24xlarge",
        pricing=PricingConfig(),
        catalogue=load_catalogue(),
    )
    assert got is not None
    assert got.dollars_per_hour == pytest.approx(21.957642 / 8)
    assert got.source.startswith("instance p4d.24xlarge $21.9576/h / 8 GPUs (catalogue: ")
    assert got.source.endswith(", read 2026-11-09)")


def test_a_node_without_gpus_is_a_caller_error(catalogue: Catalogue) -> None:
    with pytest.raises(ValueError, match="gpu_count"):
        price(catalogue, gpu_count=0)


# -- spelling ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["Tesla T4", "T4", "t4", "NVIDIA Tesla T4", "TESLA  T4"])
def test_model_names_match_as_nvml_and_people_spell_them(catalogue: Catalogue, model: str) -> None:
    got = price(catalogue, model=model)
    assert got is not None
    assert got.source.startswith("GPU model Tesla T4 $0.5/h")


@pytest.mark.parametrize("model", ["a100-sxm4-40gb", "A100 SXM4 40GB", "A100_SXM4_40GB"])
def test_case_and_separators_do_not_matter(catalogue: Catalogue, model: str) -> None:
    got = price(catalogue, model=model)
    assert got is not None
    assert got.dollars_per_hour == 3.0


def test_two_spellings_of_one_model_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"gpu_models\.T4: same model as gpu_models\.Tesla T4"):
        load_catalogue(
            write(
                tmp_path,
                """\
                gpu_models:
                  Tesla T4: {dollars_per_hour: 0.5, source: s, read: 2026-01-02}
                  T4: {dollars_per_hour: 0.6, source: s, read: 2026-01-02}
                instance_types: {}
                """,
            )
        )


def test_config_model_overrides_match_loosely_too(catalogue: Catalogue) -> None:
    assert price(catalogue, model="Tesla T4", by_model={"T4": 0.25}) == Price(0.25, "config pricing.by_model[T4]")


@pytest.mark.parametrize(
    ("key", "model"),
    [("H100-SXM5-80GB", "H100 80GB HBM3"), ("NVIDIA H100 80GB HBM3", "H100-SXM5-80GB")],
)
def test_a_config_model_override_prices_its_part_under_its_other_name(
    catalogue: Catalogue, key: str, model: str
) -> None:
    # PRODUCT.md's `by_model: {H100-SXM5-80GB: 4.0}` on a real SXM5 H100, which NVML names
    # "NVIDIA H100 80GB HBM3": $4/h from the config, not the catalogue's price (here: none).
    assert price(catalogue, model=model, by_model={key: 4.0}) == Price(4.0, f"config pricing.by_model[{key}]")


def test_an_exact_spelling_wins_over_a_looser_one(catalogue: Catalogue) -> None:
    got = price(catalogue, model="Tesla T4", by_model={"T4": 0.25, "Tesla T4": 0.75})
    assert got == Price(0.75, "config pricing.by_model[Tesla T4]")


def test_instance_types_match_ignoring_case(catalogue: Catalogue) -> None:
    got = price(catalogue, detected="P4D.24XLARGE")
    assert got is not None
    assert got.source.startswith("instance p4d.24xlarge $24/h")


# -- a bad catalogue ---------------------------------------------------------------------------

BAD_CATALOGUES = {
    "missing_price": (
        """\
        gpu_models:
          L4: {source: s, read: 2026-01-02}
        instance_types: {}
        """,
        r"gpu_models\.L4: missing dollars_per_hour",
    ),
    "negative_price": (
        """\
        gpu_models: {}
        instance_types:
          g6.xlarge:
            {dollars_per_hour: -0.8, gpus: 1, gpu_model: L4, cloud: aws, region: r, source: s, read: 2026-01-02}
        """,
        r"instance_types\.g6\.xlarge: dollars_per_hour must be a positive number, got -0\.8",
    ),
    "zero_price": (
        """\
        gpu_models:
          L4: {dollars_per_hour: 0, source: s, read: 2026-01-02}
        instance_types: {}
        """,
        r"gpu_models\.L4: dollars_per_hour must be a positive number, got 0",
    ),
    "price_as_text": (
        """\
        gpu_models:
          L4: {dollars_per_hour: "$0.80", source: s, read: 2026-01-02}
        instance_types: {}
        """,
        r"gpu_models\.L4: dollars_per_hour must be a positive number, got '\$0\.80'",
    ),
    "empty_source": (
        """\
        gpu_models:
          L4: {dollars_per_hour: 0.8, source: " ", read: 2026-01-02}
        instance_types: {}
        """,
        r"gpu_models\.L4: source must be non-empty text",
    ),
    "bad_date": (
        """\
        gpu_models:
          L4: {dollars_per_hour: 0.8, source: s, read: last spring}
        instance_types: {}
        """,
        r"gpu_models\.L4: read must be a date as YYYY-MM-DD, got 'last spring'",
    ),
    "unknown_field": (
        """\
        gpu_models:
          L4: {dollars_per_hour: 0.8, source: s, read: 2026-01-02, currency: EUR}
        instance_types: {}
        """,
        r"gpu_models\.L4: unknown field 'currency'",
    ),
    "no_gpus": (
        """\
        gpu_models: {}
        instance_types:
          m5.large:
            {dollars_per_hour: 0.1, gpus: 0, gpu_model: none, cloud: aws, region: r, source: s, read: 2026-01-02}
        """,
        r"instance_types\.m5\.large: gpus must be a whole number of at least 1, got 0",
    ),
    "unknown_cloud": (
        """\
        gpu_models: {}
        instance_types:
          x.large: {dollars_per_hour: 1, gpus: 1, gpu_model: L4, cloud: oci, region: r, source: s, read: 2026-01-02}
        """,
        r"instance_types\.x\.large: cloud must be one of aws, gcp, azure, got 'oci'",
    ),
    "section_missing": ("gpu_models: {}\n", r"instance_types: expected a mapping of entries, got None"),
    "unknown_section": (
        "gpu_models: {}\ninstance_types: {}\nregions: {}\n",
        r"unknown top-level key 'regions'",
    ),
    "not_a_mapping": ("- L4\n- T4\n", r"expected a mapping with gpu_models and instance_types, got list"),
    "not_yaml": ("gpu_models: {L4: [\n", r"prices\.yaml:.*line"),
}


@pytest.mark.parametrize(("text", "message"), BAD_CATALOGUES.values(), ids=BAD_CATALOGUES.keys())
def test_a_bad_catalogue_is_one_line_naming_the_entry(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as caught:
        load_catalogue(path)
    assert str(caught.value).startswith(str(path))
    assert "\n" not in str(caught.value)


def test_a_missing_catalogue_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such price catalogue file"):
        load_catalogue(tmp_path / "absent.yaml")


def test_a_uuid_price_set_by_an_environment_variable_applies(
    catalogue: Catalogue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Variable names are read ignoring case, so this key arrives as "gpu-5d2c...-000000000001";
    # the GPU (UUID above, as NVML spells it) is still priced at the $3.50/h asked for, not the
    # catalogue's $3/h for its model.
    monkeypatch.setenv(f"GPULEDGER_PRICING__BY_UUID__{UUID.upper()}", "3.5")
    pricing = load_config(None).pricing
    got = resolve_price(
        model="A100-SXM4-40GB", uuid=UUID, gpu_count=8, instance_type=None, pricing=pricing, catalogue=catalogue
    )
    assert got == Price(3.5, f"config pricing.by_uuid[{UUID.lower()}]")

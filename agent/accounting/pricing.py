"""What a GPU costs per hour, and why (PRODUCT.md "Cost arithmetic").

The on-demand figure: the config's overrides win; else the instance type's price split over the
node's GPUs; else the shipped catalogue's figure for the GPU model; else the price is unknown
and the caller charges nothing. An instance type the catalogue lists with another GPU model than
the one NVML reports is not used (`Price.mismatch`): the GPU is priced by its own model.

Then how the node is bought (`pricing.purchase`): on_demand as is; spot at the instance type's
spot price (`pricing.spot_hourly`, $/instance-hour); reserved, savings_plan and committed (and
spot without a spot price) at `pricing.rate` ($/GPU-hour) where set, else at `pricing.discount`
off the on-demand figure. A price history (`price_schedule`) is one such price per period.

Pure: it parses a catalogue it is handed (agent.config reads the file) and knows nothing of the
config module: it takes anything shaped like its pricing section (`PricingLike`).
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Protocol, TypeVar

from agent.model import Price

CLOUDS = ("aws", "gcp", "azure")
PURCHASE_OPTIONS = ("on_demand", "spot", "reserved", "savings_plan", "committed")
# Prices' origins, the gpuledger_gpu_price_info{source} label: short and stable.
ORIGINS = ("config", "instance", "catalogue")
# One part under two names: NVML calls the SXM5 H100 "H100 80GB HBM3", scenarios and people
# "H100-SXM5-80GB" (keys as `_model_key` spells them).
_SAME_PART = {"h100 sxm5 80gb": "h100 80gb hbm3"}
# How the source of a spot price that fell back to on-demand begins.
NO_SPOT_PRICE = "spot without a spot price"

_T = TypeVar("_T")


class PricingLike(Protocol):
    """The pricing section of the config (agent.config.PricingConfig), read-only."""

    @property
    def gpu_hourly(self) -> float | None: ...
    @property
    def by_uuid(self) -> Mapping[str, float]: ...
    @property
    def by_model(self) -> Mapping[str, float]: ...
    @property
    def instance_type(self) -> str | None: ...
    @property
    def instance_hourly(self) -> Mapping[str, float]: ...
    @property
    def energy_per_kwh(self) -> float | None: ...
    @property
    def purchase(self) -> str: ...
    @property
    def rate(self) -> float | None: ...
    @property
    def discount(self) -> float | None: ...
    @property
    def spot_hourly(self) -> Mapping[str, float]: ...


@dataclass(frozen=True, slots=True)
class CataloguePrice:
    """$/GPU-hour for one GPU model, where the figure came from and when it was read."""

    dollars_per_hour: float
    source: str
    read: dt.date


@dataclass(frozen=True, slots=True)
class InstancePrice:
    """$/hour for one whole instance type and the GPUs it comes with."""

    dollars_per_hour: float
    gpus: int
    gpu_model: str
    cloud: str
    region: str
    source: str
    read: dt.date


@dataclass(frozen=True)
class Catalogue:
    gpu_models: Mapping[str, CataloguePrice]
    instance_types: Mapping[str, InstancePrice]


def resolve_price(
    *,
    model: str,
    uuid: str,
    gpu_count: int,
    instance_type: str | None,
    pricing: PricingLike,
    catalogue: Catalogue,
) -> Price | None:
    """One GPU's price per hour and the rule that gave it, or None when nothing prices it.

    `gpu_count` is the number of GPUs this node has; `instance_type` the detected (or
    scenario's) one, which `pricing.instance_type` overrides. `model` is "" for a GPU not
    identified yet: nothing says it differs from the instance's, whose price then prices it.
    """
    if gpu_count < 1:
        raise ValueError(f"gpu_count must be at least 1, got {gpu_count}")
    it = pricing.instance_type or instance_type
    listed = _lookup(catalogue.instance_types, it, fuzzy=False) if it else None
    mismatch = ""
    if it and listed is not None and model and not same_model(listed[1].gpu_model, model):
        mismatch = (
            f"instance type {listed[0]} comes with {listed[1].gpu_model} GPUs but NVML reports {model}: "
            f"priced as {model}"
        )
        it = None  # neither its on-demand nor its spot price is this GPU's
    base = _on_demand(model, uuid, gpu_count, it, pricing, catalogue)
    if base is None:
        return None
    price = _purchased(base, it, gpu_count, pricing, catalogue)
    return replace(price, mismatch=mismatch) if mismatch else price


def price_schedule(
    epochs: Sequence[tuple[float | None, PricingLike]],
    *,
    model: str,
    uuid: str,
    gpu_count: int,
    instance_type: str | None,
    catalogue: Catalogue,
) -> Price | None:
    """The GPU's price under each pricing in `epochs` ((from, pricing) in time order, the first
    from None: always), as one `Price` whose `changes` hold the later ones. A period nothing
    prices costs 0; None where no period is priced."""
    found = [
        (start, resolve_price(model=model, uuid=uuid, gpu_count=gpu_count, instance_type=instance_type,
                              pricing=pricing, catalogue=catalogue))
        for start, pricing in epochs
    ]  # fmt: skip
    if not found or all(price is None for _, price in found):
        return None
    priced = [(start, price or Price(0.0, "no price known", origin="config")) for start, price in found]
    (_, first), *later = priced
    changes = tuple((start, price) for start, price in later if start is not None)
    return replace(first, changes=changes) if changes else first


def same_model(a: str, b: str) -> bool:
    """Whether two model names name one GPU part, however spelt."""
    return _part_key(a) == _part_key(b)


def _on_demand(
    model: str, uuid: str, gpu_count: int, it: str | None, pricing: PricingLike, catalogue: Catalogue
) -> Price | None:
    if pricing.gpu_hourly is not None:
        return Price(pricing.gpu_hourly, "config pricing.gpu_hourly", origin="config")
    # A UUID is hex, which NVML prints in lower case and people copy in either; and a key set
    # through GPULEDGER_PRICING__BY_UUID__<UUID> arrives lowercased (variable names are read
    # ignoring case), so an exact match alone left that GPU at another price without a word.
    found_uuid = _lookup(pricing.by_uuid, uuid, fuzzy=False)
    if found_uuid is not None:
        key, dollars = found_uuid
        return Price(dollars, f"config pricing.by_uuid[{key}]", origin="config")
    found_model = _lookup(pricing.by_model, model)
    if found_model is not None:
        key, dollars = found_model
        return Price(dollars, f"config pricing.by_model[{key}]", origin="config")
    if it:
        price = _instance_price(it, gpu_count, pricing, catalogue)
        if price is not None:
            return price
    found = _lookup(catalogue.gpu_models, model)
    if found is not None:
        key, entry = found
        return Price(
            entry.dollars_per_hour,
            f"GPU model {key} {_money(entry.dollars_per_hour)}/h (catalogue: {entry.source}, read {entry.read})",
            origin="catalogue",
        )
    return None


def _purchased(base: Price, it: str | None, gpu_count: int, pricing: PricingLike, catalogue: Catalogue) -> Price:
    """`base`, the on-demand price, as the node is bought."""
    option = pricing.purchase
    if option == "spot" and it:
        spot = _lookup(pricing.spot_hourly, it, fuzzy=False)
        if spot is not None:
            key, dollars = spot
            listed = _lookup(catalogue.instance_types, key, fuzzy=False)
            gpus = listed[1].gpus if listed is not None else gpu_count  # as for the on-demand split
            return Price(
                dollars / gpus,
                f"spot: instance {key} {_money(dollars)}/h / {_gpus(gpus)} (config pricing.spot_hourly)",
                origin="instance",
                purchase=option,
            )
    if pricing.rate is not None:
        return Price(pricing.rate, f"{option}: config pricing.rate {_money(pricing.rate)}/h", origin="config",
                     purchase=option)  # fmt: skip
    if pricing.discount:
        off = f"{pricing.discount * 100:g}%"
        return Price(
            base.dollars_per_hour * (1.0 - pricing.discount),
            f"{option}: {off} off (config pricing.discount) {base.source}",
            origin=base.origin,
            purchase=option,
        )
    if option == "spot":
        # No spot price for this instance type: the on-demand figure, said so.
        return replace(base, source=f"{NO_SPOT_PRICE} for {it or 'this node'}: on-demand {base.source}",
                       purchase=option)  # fmt: skip
    return replace(base, purchase=option)


def _instance_price(it: str, gpu_count: int, pricing: PricingLike, catalogue: Catalogue) -> Price | None:
    configured = _lookup(pricing.instance_hourly, it, fuzzy=False)
    if configured is not None:
        key, dollars = configured
        return Price(
            dollars / gpu_count,
            f"instance {key} {_money(dollars)}/h / {_gpus(gpu_count)} (config pricing.instance_hourly)",
            origin="instance",
        )
    listed = _lookup(catalogue.instance_types, it, fuzzy=False)
    if listed is None:
        return None
    key, entry = listed
    # The catalogue's count is what the price buys; a node showing fewer GPUs (some hidden
    # from the container, or lost) does not make each remaining one dearer.
    split = _gpus(entry.gpus)
    if entry.gpus != gpu_count:
        split += f" (the catalogue's count; this node shows {gpu_count})"
    return Price(
        entry.dollars_per_hour / entry.gpus,
        f"instance {key} {_money(entry.dollars_per_hour)}/h / {split} (catalogue: {entry.source}, read {entry.read})",
        origin="instance",
    )


def _lookup(table: Mapping[str, _T], name: str, *, fuzzy: bool = True) -> tuple[str, _T] | None:
    """`table[name]` under its own key: exact first, then ignoring case, then (if `fuzzy`)
    ignoring "NVIDIA "/"Tesla " prefixes and space/hyphen/underscore differences, then as the
    same part under its other name (`by_model: {H100-SXM5-80GB: ...}` prices what NVML calls
    "H100 80GB HBM3")."""
    if name in table:
        return name, table[name]
    matchers: list[Callable[[str], str]] = [str.casefold]
    if fuzzy:
        matchers += [_model_key, _part_key]
    for normal in matchers:
        wanted = normal(name)
        for key, value in table.items():
            if normal(key) == wanted:
                return key, value
    return None


def _model_key(name: str) -> str:
    """A model name as NVML, scenarios and people spell it alike: "Tesla T4" and "t4" agree."""
    key = re.sub(r"[\s_-]+", " ", name.casefold()).strip()
    for prefix in ("nvidia ", "tesla "):
        key = key.removeprefix(prefix)
    return key


def _part_key(name: str) -> str:
    """`_model_key`, one name for each part `_SAME_PART` knows under two."""
    key = _model_key(name)
    return _SAME_PART.get(key, key)


def _money(dollars: float) -> str:
    return "$" + f"{dollars:.4f}".rstrip("0").rstrip(".")


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


# -- parsing the catalogue file -------------------------------------------------------------

_MODEL_FIELDS = ("dollars_per_hour", "source", "read")
_INSTANCE_FIELDS = ("dollars_per_hour", "gpus", "gpu_model", "cloud", "region", "source", "read")


def parse_catalogue(raw: object, path: str) -> Catalogue:
    """The catalogue in `raw` (a YAML document read from `path`). A bad one raises ValueError,
    one line naming the file and the entry."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: expected a mapping with gpu_models and instance_types, got {type(raw).__name__}")
    # gpu_specs: what right-sizing compares (agent/accounting/rightsize.py parses it).
    unknown = sorted(str(key) for key in raw if key not in ("gpu_models", "instance_types", "gpu_specs"))
    if unknown:
        raise ValueError(f"{path}: unknown top-level key {unknown[0]!r} (expected gpu_models and instance_types)")
    models = {
        name: _model_entry(fields, f"{path}: gpu_models.{name}")
        for name, fields in _section(raw, "gpu_models", path).items()
    }
    seen: dict[str, str] = {}
    for name in models:
        other = seen.setdefault(_model_key(name), name)
        if other != name:
            raise ValueError(f"{path}: gpu_models.{name}: same model as gpu_models.{other}")
    instances = {
        name: _instance_entry(fields, f"{path}: instance_types.{name}")
        for name, fields in _section(raw, "instance_types", path).items()
    }
    return Catalogue(gpu_models=MappingProxyType(models), instance_types=MappingProxyType(instances))


def _section(raw: Mapping[object, object], name: str, path: str) -> dict[str, Mapping[object, object]]:
    section = raw.get(name)
    if not isinstance(section, Mapping):
        raise ValueError(f"{path}: {name}: expected a mapping of entries, got {_shown(section)}")
    entries: dict[str, Mapping[object, object]] = {}
    for key, fields in section.items():
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"{path}: {name}: entry names must be non-empty text, got {_shown(key)}")
        if not isinstance(fields, Mapping):
            raise ValueError(f"{path}: {name}.{key}: expected a mapping of fields, got {_shown(fields)}")
        entries[key] = fields
    return entries


def _model_entry(fields: Mapping[object, object], where: str) -> CataloguePrice:
    _check_fields(fields, _MODEL_FIELDS, where)
    return CataloguePrice(
        dollars_per_hour=_price(fields, where),
        source=_text(fields, "source", where),
        read=_date(fields, where),
    )


def _instance_entry(fields: Mapping[object, object], where: str) -> InstancePrice:
    _check_fields(fields, _INSTANCE_FIELDS, where)
    gpus = fields["gpus"]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"{where}: gpus must be a whole number of at least 1, got {_shown(gpus)}")
    cloud = _text(fields, "cloud", where)
    if cloud not in CLOUDS:
        raise ValueError(f"{where}: cloud must be one of {', '.join(CLOUDS)}, got {cloud!r}")
    return InstancePrice(
        dollars_per_hour=_price(fields, where),
        gpus=gpus,
        gpu_model=_text(fields, "gpu_model", where),
        cloud=cloud,
        region=_text(fields, "region", where),
        source=_text(fields, "source", where),
        read=_date(fields, where),
    )


def _check_fields(fields: Mapping[object, object], expected: tuple[str, ...], where: str) -> None:
    missing = [name for name in expected if name not in fields]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    unknown = sorted(str(name) for name in fields if name not in expected)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (expected {', '.join(expected)})")


def _price(fields: Mapping[object, object], where: str) -> float:
    value = fields["dollars_per_hour"]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: dollars_per_hour must be a positive number, got {_shown(value)}")
    return float(value)


def _text(fields: Mapping[object, object], name: str, where: str) -> str:
    value = fields[name]
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        raise ValueError(f"{where}: {name} must be non-empty text on one line, got {_shown(value)}")
    return value.strip()


def _date(fields: Mapping[object, object], where: str) -> dt.date:
    value = fields["read"]
    if isinstance(value, dt.datetime):
        return value.date()
    if isinstance(value, dt.date):
        return value
    if isinstance(value, str):
        try:
            return dt.date.fromisoformat(value.strip())
        except ValueError:
            pass
    raise ValueError(f"{where}: read must be a date as YYYY-MM-DD, got {_shown(value)}")


def _shown(value: object) -> str:
    """A value for a one-line message: short, and never spanning lines."""
    text = repr(value).replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."

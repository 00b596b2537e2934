"""Configuration: an optional YAML file plus ``GPULEDGER_<SECTION>__<KEY>`` environment variables.

Environment variables win over the file, the file over the defaults; no file is needed. Every
problem is reported with the key it concerns (and the variable, when one set it).
"""

from __future__ import annotations

import datetime
import difflib
import functools
import itertools
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from agent.accounting.pricing import Catalogue, parse_catalogue
from agent.actions.config import CONTEXT_VARIABLES, ActionsConfig
from agent.actions.config import cross_problems as action_problems
from agent.actions.config import host_problems as action_host_problems
from agent.attribution.labels import MATCH_ALIASES, MATCH_FIELDS, SET_FIELDS
from agent.devices import backend_names
from agent.devices.telemetry import GROUPS, MIG_ACTIVITY_MODES, MIG_ACTIVITY_OFF, MIG_ACTIVITY_SLOW, ReadingOptions
from agent.errors import ConfigError
from agent.ledger.pending import DEFAULT_MAX_PENDING_ROWS
from agent.model import WORKLOAD_LABELS
from agent.scrub import escape_control
from agent.units import format_duration, parse_duration, parse_size_bytes
from agent.yamlfile import YamlFileError, read_yaml, undecodable_locs

ENV_PREFIX = "GPULEDGER_"
# The variables Kubernetes adds to every pod for each Service of its namespace (service links):
# a Service named gpuledger (or gpuledger-...) gives GPULEDGER_SERVICE_HOST, GPULEDGER_PORT,
# GPULEDGER_PORT_9835_TCP_ADDR and the like. They set nothing, and are no typo.
_SERVICE_LINK = re.compile(
    r"GPULEDGER(?:_[A-Z0-9_]+)?_(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?"
    r"|PORT(?:_\d+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)"
)

log = logging.getLogger(__name__)


def _not_bool(value: object) -> object:
    """A number that is not a boolean: pydantic reads true as 1, and YAML reads yes, on and true
    as true, so `gpu_hourly: yes` priced every GPU at $1/hour and `utilization_below: on` at 100%."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {value!r} (YAML reads yes, no, on and off as true and false)")
    return value


Duration = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size_bytes)]
Ratio = Annotated[float, BeforeValidator(_not_bool), Field(ge=0.0, le=1.0)]


# The shortest interval between two rounds of work that repeat for ever (polls, kubelet queries,
# driver re-registration): a misplaced unit (`poll_interval: 0.0000001s`) otherwise polled the
# driver non-stop. Sub-second stays allowed: a fake node is polled every 0.2s in tests and demos.
MIN_REPEAT_S = 0.1
# The shortest ledger retention: the ledger keeps hours, and a shorter one is a unit left out.
MIN_RETENTION_S = 86400.0


class _Section(BaseModel):
    # No setting is infinite or NaN: a price of inf passed, and then every charge was refused.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


Purchase = Literal["on_demand", "spot", "reserved", "savings_plan", "committed"]
# A price, $/hour: at most a million, far above any GPU or instance sold, so that a price with
# its exponent mistyped (1e308) is refused rather than overflowing the dollars it multiplies.
Dollars = Annotated[float, BeforeValidator(_not_bool), Field(ge=0, le=1e6, allow_inf_nan=False)]
Discount = Annotated[float, BeforeValidator(_not_bool), Field(ge=0.0, lt=1.0)]
# Purchase options whose price cannot be guessed from the on-demand one: they need a rate or a
# discount (spot may have its price per instance type in spot_hourly instead).
_NEEDS_TERMS = ("reserved", "savings_plan", "committed")


class PriceChange(_Section):
    """From `at` on, these pricing keys have these values (the others keep theirs)."""

    at: datetime.datetime
    gpu_hourly: Dollars | None = None
    by_uuid: dict[str, Dollars] | None = None
    by_model: dict[str, Dollars] | None = None
    instance_hourly: dict[str, Dollars] | None = None
    purchase: Purchase | None = None
    rate: Dollars | None = None
    discount: Discount | None = None
    spot_hourly: dict[str, Dollars] | None = None

    @field_validator("at")
    @classmethod
    def _utc(cls, value: datetime.datetime) -> datetime.datetime:
        return value if value.tzinfo is not None else value.replace(tzinfo=datetime.UTC)


class PricingConfig(_Section):
    gpu_hourly: Dollars | None = None
    by_uuid: dict[str, Dollars] = {}
    by_model: dict[str, Dollars] = {}
    instance_type: str | None = None
    instance_hourly: dict[str, Dollars] = {}
    energy_per_kwh: Dollars | None = None  # $/kWh
    # How this node is bought, and at what terms: `rate` ($/GPU-hour) replaces the price found
    # above, `discount` (0-1) takes that fraction off it; spot takes its price per instance type
    # from spot_hourly ($/instance-hour, like instance_hourly) where listed.
    purchase: Purchase = "on_demand"
    rate: Dollars | None = None
    discount: Discount | None = None
    spot_hourly: dict[str, Dollars] = {}
    # The price history: each change applies from its `at` (UTC unless it says) on.
    changes: list[PriceChange] = []

    @model_validator(mode="after")
    def _terms(self) -> PricingConfig:
        for at, pricing in self.epochs():
            where = "" if at is None else f" (from pricing.changes at {_iso(at)})"
            if pricing.rate is not None and pricing.discount is not None:
                raise ValueError(f"give rate or discount, not both{where}")
            if pricing.purchase in _NEEDS_TERMS and pricing.rate is None and pricing.discount is None:
                raise ValueError(f"purchase {pricing.purchase} needs its rate or discount{where}")
            terms = pricing.rate is not None or pricing.discount is not None or pricing.spot_hourly
            if pricing.purchase == "spot" and not terms:
                raise ValueError(f"purchase spot needs spot_hourly, a rate or a discount{where}")
        return self

    @field_validator("changes")
    @classmethod
    def _in_order(cls, value: list[PriceChange]) -> list[PriceChange]:
        for earlier, later in itertools.pairwise(value):
            if later.at <= earlier.at:
                raise ValueError(f"changes must be in time order: {_iso(later.at.timestamp())} is not after "
                                 f"{_iso(earlier.at.timestamp())}")  # fmt: skip
        return value

    def epochs(self) -> list[tuple[float | None, PricingConfig]]:
        """(from, the pricing in force) for each period: this section from always, then each
        change merged into what was in force before it."""
        base = self.model_copy(update={"changes": []})
        found: list[tuple[float | None, PricingConfig]] = [(None, base)]
        for change in self.changes:
            update = change.model_dump(exclude={"at"}, exclude_none=True)
            if "rate" in update:
                update.setdefault("discount", None)  # a new rate replaces a discount in force
            elif "discount" in update:
                update.setdefault("rate", None)
            found.append((change.at.timestamp(), found[-1][1].model_copy(update=update)))
        return found


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat().replace("+00:00", "Z")


class LedgerConfig(_Section):
    path: str = "/var/lib/gpuledger/ledger.db"
    flush_interval: Duration = Field(default=60.0, ge=1.0)  # a disk write (and fsync) each time
    retention: Duration = Field(default=400 * 86400.0, gt=0)
    # Hourly rows kept in memory while the ledger cannot be written (about 750 bytes each);
    # beyond it the oldest hours are dropped, counted and logged.
    max_pending_rows: Annotated[int, BeforeValidator(_not_bool)] = Field(
        default=DEFAULT_MAX_PENDING_ROWS, ge=1, le=10_000_000
    )

    @field_validator("retention")
    @classmethod
    def _keeps_a_day(cls, value: float) -> float:
        # Rows older than it are deleted at the next flush: `retention: 400`, meant as days, is
        # 400 seconds, and deleted every hour but the current one.
        if value < MIN_RETENTION_S:
            raise ValueError(
                f"at least 1d, got {format_duration(value)} (a bare number is seconds; older rows are deleted)"
            )
        return value


class WatchdogConfig(_Section):
    # A poll waits this long for a driver call before reading that GPU as down (TIMEOUT) and
    # polling the others without it; /healthz fails while any call is stuck.
    # At least 0.1s: a driver call takes milliseconds (PCIe throughput alone 20 ms), and a shorter
    # timeout read every GPU as down (TIMEOUT), booking all their time unobserved.
    call_timeout: Duration = Field(default=15.0, ge=0.1)
    # A call stuck this long ends the process (exit 1, ledger flushed) so that systemd
    # (Restart=on-failure, WatchdogSec=) or the kubelet (liveness probe) starts a fresh one:
    # a thread blocked in the driver cannot be freed from inside.
    exit_after: Duration = Field(default=120.0, gt=0)


class AccountingConfig(_Section):
    # An interval between two polls longer than this is charged to nobody (agent stopped,
    # node suspended): it is counted as unobserved time instead.
    max_interval: Duration = Field(default=300.0, gt=0)
    # A finished workload's cost series stay exported this long after its last charge.
    forget_after: Duration = Field(default=3600.0, gt=0)
    # What "busy" means for busy seconds and the flag rules: GPM's SM activity where the GPU has it
    # (Hopper and later), else NVML's utilization (auto); NVML's utilization only; GPM's only.
    busy_source: Literal["auto", "nvml", "gpm"] = "auto"


class EventsConfig(_Section):
    # Read the driver's events (Xid errors, ECC errors, clock changes) on a thread of their own.
    enabled: bool = True
    # Each wait on the driver lasts at most this long (stopping the agent waits for one).
    # The driver takes it in whole milliseconds: below 1 ms it is 0, an answer at once, and the
    # thread would ask again without pause.
    wait: Duration = Field(default=1.0, ge=0.01, le=10)
    # A GPU or driver that stopped answering is registered again this often.
    retry: Duration = Field(default=30.0, ge=MIN_REPEAT_S)


class AttributionRule(_Section):
    match: dict[str, str]
    set: dict[str, str]

    @field_validator("match")
    @classmethod
    def _patterns_compile(cls, value: dict[str, str]) -> dict[str, str]:
        for key, pattern in value.items():
            if key not in MATCH_FIELDS and key not in MATCH_ALIASES and not key.startswith("env."):
                raise ValueError(f"{key}: unknown field (use {', '.join(MATCH_FIELDS)} or env.KEY)")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"{key}: not a regular expression: {exc}") from None
        return value

    @field_validator("set")
    @classmethod
    def _settable(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if key not in SET_FIELDS:
                raise ValueError(f"{key}: only {' and '.join(SET_FIELDS)} can be set")
        return value


class AttributionConfig(_Section):
    env_allowlist: list[str] = ["SLURM_JOB_ID", "SLURM_JOB_USER", "SLURM_JOB_ACCOUNT", "SLURM_JOB_NAME"]
    per_pid_series: bool = False
    passwd_file: str = "/etc/passwd"
    podresources_socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    slurm_map_dir: str = "/run/gpuledger/jobs"
    pod_logs_dir: str = "/var/log/pods"
    kubelet_interval: Duration = Field(default=10.0, ge=MIN_REPEAT_S)
    kubelet_timeout: Duration = Field(default=2.0, gt=0)
    # While the kubelet does not answer, its last allocations stand for this long; after that a
    # GPU no process holds is booked unobserved (attribution_unavailable), never idle.
    kubelet_stale_after: Duration = Field(default=300.0, gt=0)
    rules: list[AttributionRule] = []
    # A Slurm job's account is its `team` where no rule sets one.
    team_from_account: bool = True


class _RuleBase(_Section):
    enabled: bool = True
    models: list[str] = []  # only GPUs whose model matches one of these globs, e.g. "H100*"
    nodes: list[str] = []  # only nodes whose hostname matches one of these globs


class IdleRule(_RuleBase):
    utilization_below: Ratio = 0.05
    for_: Duration = Field(default=1800.0, alias="for")


class UnderusedRule(_RuleBase):
    utilization_below: Ratio = 0.40
    window: Duration = Field(default=7200.0, gt=0)
    for_: Duration = Field(default=7200.0, alias="for")


class StrandedMemoryRule(_RuleBase):
    memory_above: Size = 2**30
    utilization_below: Ratio = 0.01
    for_: Duration = Field(default=900.0, alias="for")


class CustomRule(_RuleBase):
    """A rule of the user's own: one of the four conditions with its own name and thresholds."""

    name: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")]
    condition: Literal["idle", "allocated_idle", "underused", "stranded_memory"]
    utilization_below: Ratio
    for_: Duration = Field(alias="for")
    window: Duration = Field(default=0.0, validate_default=True)
    memory_above: Size = 0

    @field_validator("window")
    @classmethod
    def _window(cls, value: float, info: ValidationInfo) -> float:
        # A mean over no time is no mean: the rule would never hold, and say nothing of it.
        if info.data.get("condition") == "underused" and value <= 0:
            raise ValueError("an underused rule takes its mean over a window longer than 0, such as 2h")
        return value


class RulesConfig(_Section):
    idle: IdleRule = IdleRule()
    allocated_idle: IdleRule = IdleRule()
    underused: UnderusedRule = UnderusedRule()
    stranded_memory: StrandedMemoryRule = StrandedMemoryRule()
    custom: list[CustomRule] = []

    @field_validator("custom")
    @classmethod
    def _names_unique(cls, value: list[CustomRule]) -> list[CustomRule]:
        names = [rule.name for rule in value]
        for name in names:
            if name in ("idle", "allocated_idle", "underused", "stranded_memory") or names.count(name) > 1:
                raise ValueError(f"rule name {name!r} is taken")
        return value


class ExportersConfig(_Section):
    # Also emit dcgm-exporter's names and labels (DCGM_FI_DEV_*), so dashboards and alerts
    # written for it keep working (exporters/dcgm.py).
    dcgm_compat: bool = False
    # node_exporter textfile-collector output: the full exposition, rewritten atomically after
    # each poll. node_exporter reads only *.prom files.
    textfile_path: str | None = None

    @field_validator("textfile_path")
    @classmethod
    def _prom_suffix(cls, value: str | None) -> str | None:
        if value is not None and not value.endswith(".prom"):
            raise ValueError(f"node_exporter's textfile collector reads only *.prom files, got {value!r}")
        return value


class WorkCounterConfig(_Section):
    """A counter of work (tokens, inferences, training steps) that `gpuledger rules` joins with
    the cost series: dollars per `scale` units. Entries with the same name add up; a name the
    built-in engine counters use replaces them (exporters/promrules.py)."""

    name: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")]
    metric: Annotated[str, Field(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")]
    unit: Annotated[str, Field(pattern=r"^[a-z][a-z ]*$")] = "unit"
    scale: Literal[1, 1000, 1000000, 1000000000] = 1
    # Workload labels the counter shares with gpuledger's series: a list of names both use, or
    # a mapping of gpuledger's label to the counter's (model: model_name).
    join: list[str] | dict[str, str] = ["namespace", "pod"]

    @field_validator("join")
    @classmethod
    def _workload_labels(cls, value: list[str] | dict[str, str]) -> list[str] | dict[str, str]:
        pairs = value.items() if isinstance(value, dict) else ((label, label) for label in value)
        if not value:
            raise ValueError("name at least one label to join on")
        for ours, theirs in pairs:
            if ours not in WORKLOAD_LABELS:
                raise ValueError(f"{ours!r} is not a workload label ({', '.join(WORKLOAD_LABELS)})")
            if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", theirs):
                raise ValueError(f"{theirs!r} is not a label name")
        return value

    def join_pairs(self) -> tuple[tuple[str, str], ...]:
        """(gpuledger label, the counter's label) pairs."""
        if isinstance(self.join, dict):
            return tuple(self.join.items())
        return tuple((label, label) for label in self.join)


MigActivity = Literal["slow", "every_poll", "off"]
assert get_args(MigActivity) == MIG_ACTIVITY_MODES
# The spellings pydantic takes for a boolean (YAML's own true/false/on/off arrive as booleans);
# `off` means the same either way.
_TRUE = frozenset({"true", "1", "yes", "y", "on", "t"})
_FALSE = frozenset({"false", "0", "no", "n", "off", "f"})


def _mig_activity(value: object) -> object:
    """`readings.mig_activity` as one of MIG_ACTIVITY_MODES: it was a boolean before it was a
    choice, and a config written then (or its environment variable) still means what it did."""
    if isinstance(value, bool | int) and value in (0, 1):
        return MIG_ACTIVITY_SLOW if value else MIG_ACTIVITY_OFF
    word = value.strip().lower() if isinstance(value, str) else None
    if word in MIG_ACTIVITY_MODES:
        return word
    if word in _TRUE:
        return MIG_ACTIVITY_SLOW
    if word in _FALSE:
        return MIG_ACTIVITY_OFF
    raise ValueError(f"expected {', '.join(MIG_ACTIVITY_MODES)} (or true for slow, false for off), got {value!r}")


class ReadingsConfig(_Section):
    """Which groups of health readings each poll asks the driver for (agent/devices/telemetry.py).
    Each group is one switch; PCIe throughput is off unless asked for: NVML samples the bus for
    20 ms inside each of its calls."""

    clocks: bool = True  # SM and memory clocks, their maxima, performance state
    fan: bool = True
    throttle: bool = True  # clock-event reasons, violation time per cause
    memory_errors: bool = True  # ECC errors, retired pages, remapped rows
    pcie: bool = True  # link generation and width (current, max), replay counter
    pcie_throughput: bool = False
    nvlink_errors: bool = True  # CRC, replay, recovery errors per link
    nvlink_throughput: bool = True  # bytes per link
    codecs: bool = True  # video encoder and decoder utilization
    memory_utilization: bool = True  # the memory controller's
    # GPM activity of each MIG instance (Hopper and later), two NVML calls per instance each
    # time: `slow` reads it every slow_interval and carries that span's mean into the polls
    # between (a holder's busy seconds then lag by up to one slow interval where its load
    # changes); `every_poll`, exact per poll, 14 calls a poll for a fully split H100; `off`, no
    # busy measure for the instances. true means slow, false off (docs: README).
    mig_activity: Annotated[MigActivity, BeforeValidator(_mig_activity)] = "slow"
    # How often readings that change slowly or only count are read (between, a poll carries the
    # last value): dcgm-exporter's collection interval.
    slow_interval: Duration = Field(default=30.0, gt=0)

    def options(self, *, metrics_text: bool = True) -> ReadingOptions:
        """What a poll reads. Without `metrics_text` (nothing the agent makes is shown as metrics
        text), it reads none of the readings only that text shows: no group, no temperature, no
        NVLink's state. MIG instances' activity, a busy measure, is read as set."""
        groups = frozenset(name for name in GROUPS if getattr(self, name)) if metrics_text else frozenset()
        return ReadingOptions(groups, self.slow_interval, mig_activity=self.mig_activity, exposition=metrics_text)


def parse_listen(value: object) -> tuple[str, int]:
    """(host, port) from "HOST:PORT" ("[::1]:9835" for IPv6; an empty host means every
    address). The config key and the --listen flag both go through here."""
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    # isdigit() alone accepts "²" and other digits int() refuses.
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT such as 0.0.0.0:9835, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _check_listen(value: object) -> str:
    parse_listen(value)
    assert isinstance(value, str)  # parse_listen refuses anything else
    return value


def _check_node_name(value: object) -> object:
    # It is a label value, a ledger key and an action's GPULEDGER_NODE: a NUL there fails every
    # command an action runs, a newline or an escape sequence reaches logs and terminals.
    if isinstance(value, str) and escape_control(value) != value:
        raise ValueError(f"holds a control character ({escape_control(value)}): a node's name is one line of text")
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        populate_by_name=True,
        allow_inf_nan=False,
    )

    # The node's name in the ledger, logs and rule selectors; default the hostname (in a pod,
    # set it from the downward API's spec.nodeName: the chart does).
    node_name: Annotated[str | None, BeforeValidator(_check_node_name)] = None
    # Which device backend reads the GPUs (agent/devices/__init__.py registers them).
    backend: str = "nvml"
    poll_interval: Duration = Field(default=5.0, ge=MIN_REPEAT_S)
    listen: Annotated[str, BeforeValidator(_check_listen)] = "0.0.0.0:9835"
    proc_root: str = "/proc"
    # Where sysfs is: the GPUs on the PCI bus are listed from it while the driver cannot list them.
    sys_root: str = "/sys"
    pricing: PricingConfig = PricingConfig()
    ledger: LedgerConfig = LedgerConfig()
    watchdog: WatchdogConfig = WatchdogConfig()
    accounting: AccountingConfig = AccountingConfig()
    events: EventsConfig = EventsConfig()
    attribution: AttributionConfig = AttributionConfig()
    rules: RulesConfig = RulesConfig()
    exporters: ExportersConfig = ExportersConfig()
    readings: ReadingsConfig = ReadingsConfig()
    actions: ActionsConfig = ActionsConfig()
    # Work counters for `gpuledger rules`, beside the built-in engines' (WorkCounterConfig).
    work: list[WorkCounterConfig] = []
    # TLS and basic auth for the HTTP endpoint, in the exporter-toolkit web-config format
    # (like exporters' --web.config.file); read by exporters/webconfig.py when `run` starts.
    web_config_file: str | None = None

    @field_validator("work")
    @classmethod
    def _work_adds_up(cls, value: list[WorkCounterConfig]) -> list[WorkCounterConfig]:
        # Counters of one name are summed into one unit of work: they must measure it alike.
        first: dict[str, WorkCounterConfig] = {}
        for entry in value:
            same = first.setdefault(entry.name, entry)
            if (same.unit, same.scale, same.join_pairs()) != (entry.unit, entry.scale, entry.join_pairs()):
                raise ValueError(
                    f"{entry.name}: {same.metric} and {entry.metric} add up: give them one unit, scale and join"
                )
        return value

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        if value not in backend_names():
            raise ValueError(f"unknown device backend {value!r} (known: {', '.join(backend_names())})")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values arrive as init arguments; the environment overrides them.
        return (env_settings, init_settings)


def _read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        raw = read_yaml(path, "config")
    except YamlFileError as exc:
        raise ConfigError(str(exc)) from None
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a mapping of settings at the top, got {type(raw).__name__}")
    return raw


def _problems(exc: ValidationError, source: str) -> list[str]:
    lines = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"] if part not in ("function-after", "function-before")]
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(_problem(source, loc, message))
    return lines


def _problem(source: str, loc: list[str], message: str) -> str:
    """One line: the source, the key at `loc` (and the variable that set it, if one did), `message`."""
    key = ".".join(loc).replace("for_", "for")
    env_name = ENV_PREFIX + "__".join(loc).upper().replace("FOR_", "FOR")
    where = f"{key} (from {env_name})" if env_name in os.environ else key
    return escape_control(f"{source}: {where}: {message}")


def _bad_nested_json(section: str) -> str | None:
    """The GPULEDGER_<SECTION>__<KEY> variable, if any, whose key takes a mapping or a list and
    whose value is not JSON: what a SettingsError about <section> was about."""
    info = Settings.model_fields.get(section)
    model = info.annotation if info is not None else None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    prefix = f"{ENV_PREFIX}{section.upper()}__"
    for name, value in sorted(os.environ.items()):
        key = name[len(prefix) :].lower() if name.startswith(prefix) else ""
        sub = model.model_fields.get(key)
        if sub is None or get_origin(sub.annotation) not in (dict, list):
            continue
        try:
            json.loads(value)
        except ValueError:
            return name
    return None


def _variables_problem() -> str | None:
    """A problem where one variable sets a mapping whole (GPULEDGER_PRICING__BY_MODEL='{...}') and
    another a key of it (GPULEDGER_PRICING__BY_MODEL__L4): pydantic-settings keeps whichever it
    meets last, so the other's prices were dropped, depending on the variables' order. (A whole
    section, GPULEDGER_PRICING, does merge with its keys' variables.) Or where a variable sets a
    key whose case matters, which its name cannot carry."""
    paths = {
        tuple(name[len(ENV_PREFIX) :].lower().split("__")): name
        for name in sorted(os.environ)
        if name.upper().startswith(ENV_PREFIX)
    }
    for path, name in sorted(paths.items()):
        if path[:2] == ("actions", "triggers") and len(path) > 4 and path[3] == "env":
            # Its key would be the command's variable name, lowercased (SLURM_CONF as slurm_conf).
            return escape_control(
                f"environment: {name}: the command's variable would be named {'__'.join(path[4:])} (names are "
                f"read lowercased); give actions.triggers.{path[2]}.env whole as JSON in "
                f"{ENV_PREFIX}ACTIONS__TRIGGERS__{path[2].upper()}__ENV"
            )
        inner = [other for other in paths if len(path) >= 2 and len(other) > len(path) and other[: len(path)] == path]
        if inner:
            return escape_control(
                f"environment: {name} and {paths[min(inner)]} both set {'.'.join(path)}: "
                "give it whole (JSON) or key by key, not both"
            )
    return None


def check_config(path: str | Path | None) -> tuple[Settings | None, list[str]]:
    """The settings and every problem found, one line each (empty when the config is good)."""
    source = str(path) if path is not None else "environment"
    problem = _variables_problem()
    if problem is not None:
        return None, [problem]
    try:
        data = dict(_read_yaml(Path(path))) if path is not None else {}
    except ConfigError as exc:
        return None, [str(exc)]
    try:
        settings = Settings(**data)
    except ValidationError as exc:
        return None, _problems(exc, source)
    except SettingsError as exc:
        # A whole section set as one variable (GPULEDGER_PRICING) must hold a JSON object.
        field = re.search(r'field "([^"]+)"', str(exc))
        name = ENV_PREFIX + (field.group(1).upper() if field else "*")
        nested = _bad_nested_json(field.group(1)) if field else None
        if nested is not None:
            return None, [f"environment: {nested}: not JSON (a mapping or list is given as JSON)"]
        return None, [f"environment: {name}: not a JSON object (or set its keys as {name}__KEY)"]
    undecodable = undecodable_locs(settings.model_dump(), [])
    if undecodable:
        return None, [_problem(source, loc, "not UTF-8 text") for loc in undecodable]
    problems = action_problems(settings.actions, rule_conditions(settings.rules), source)
    return (None, problems) if problems else (settings, [])


def rule_conditions(rules: RulesConfig) -> dict[str, tuple[str, bool]]:
    """Each flag rule's name -> (its condition, whether it is enabled)."""
    built_in = ("idle", "allocated_idle", "underused", "stranded_memory")
    found = {name: (name, bool(getattr(rules, name).enabled)) for name in built_in}
    found.update({c.name: (c.condition, c.enabled) for c in rules.custom})
    return found


def host_problems(settings: Settings, source: str = "config") -> list[str]:
    """What `run` would refuse on this host although the settings are well-formed: an output
    directory that does not exist, a ledger path that cannot be a file. `check-config` and `run`
    both ask (and both load the web config file), so a config that passes the one starts the
    other."""
    problems = []
    textfile = settings.exporters.textfile_path
    if textfile and not Path(textfile).parent.is_dir():
        problems.append(f"{source}: exporters.textfile_path: no such directory {Path(textfile).parent}")
    ledger = Path(settings.ledger.path)
    if ledger.is_dir():
        problems.append(f"{source}: ledger.path: {ledger} is a directory, not a file")
    else:
        # run creates the ledger's directory when missing, as systemd's StateDirectory would;
        # what it cannot do is create it under something that is not a directory.
        parent = next((p for p in ledger.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            problems.append(f"{source}: ledger.path: {parent} is not a directory")
    return problems + action_host_problems(settings.actions, source)


def load_config(path: str | Path | None = None) -> Settings:
    """Settings from `path` (optional) and the environment. Raises ConfigError naming each problem;
    logs a warning for each GPULEDGER_* variable that sets nothing (`unknown_variables`)."""
    settings, problems = check_config(path)
    if problems or settings is None:
        raise ConfigError("; ".join(problems))
    for line in unknown_variables():
        log.warning("%s", line)
    return settings


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line for each GPULEDGER_* variable whose first key is no setting (GPULEDGER_POLL_INTERVALL),
    with the nearest one: pydantic-settings reads only the names it knows at the top, so such a
    variable was ignored without a word (a nested one, GPULEDGER_PRICING__GPU_HOURY, is an error
    already). Only a warning: Kubernetes' service links (`_SERVICE_LINK`) and variables other tools
    set must not stop the agent; an action's context (CONTEXT_VARIABLES), which a gpuledger run by
    the action's command inherits, passes unremarked. Names only, never values."""
    found = []
    for name in sorted(os.environ if environ is None else environ):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX) or _SERVICE_LINK.fullmatch(upper) or upper in CONTEXT_VARIABLES:
            continue
        key = upper[len(ENV_PREFIX) :].split("__")[0].lower()
        if key in Settings.model_fields:
            continue
        near = difflib.get_close_matches(key, list(Settings.model_fields), n=1)
        hint = f" (did you mean {ENV_PREFIX}{near[0].upper()}?)" if near else ""
        found.append(escape_control(f"environment: {name}: no such setting, ignored{hint}"))
    return found


# The price catalogue shipped with the package (see agent/accounting/pricing.py for its format).
SHIPPED_CATALOGUE = Path(__file__).parent / "accounting" / "prices.yaml"


def load_catalogue(path: str | Path | None = None) -> Catalogue:
    """The price catalogue at `path`, or the shipped one (read once). A bad file raises
    ValueError, one line naming the file and the entry."""
    if path is None:
        return _shipped_catalogue()
    return parse_catalogue(read_yaml(Path(path), "price catalogue"), str(path))


@functools.cache
def _shipped_catalogue() -> Catalogue:
    return parse_catalogue(read_yaml(SHIPPED_CATALOGUE, "price catalogue"), str(SHIPPED_CATALOGUE))

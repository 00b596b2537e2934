"""Every metric gpuledger emits: name, type, unit, help and labels, in one place.

The collector builds families from these entries only, and a test holds the catalogue
against what a scrape emits, both ways.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from agent.model import WORKLOAD_LABELS


class Kind(Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    INFO = "info"  # a gauge of 1 whose labels carry the facts


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    # Labels present only when a config switch turns them on (per-pid series).
    optional_labels: tuple[str, ...] = ()

    @property
    def family_name(self) -> str:
        """The name prometheus_client wants for a counter family: without `_total`."""
        return self.name.removesuffix("_total") if self.kind is Kind.COUNTER else self.name


DEVICE = ("gpu", "uuid")
WORKLOAD = (*DEVICE, *WORKLOAD_LABELS)

CATALOGUE: tuple[MetricSpec, ...] = (
    MetricSpec(
        "gpuledger_gpu_info",
        Kind.INFO,
        "GPU identity: always 1, the labels carry model, PCI bus id and driver version.",
        ("gpu", "uuid", "model_name", "pci_bus_id", "driver_version"),
    ),
    MetricSpec("gpuledger_gpu_up", Kind.GAUGE, "1 while the GPU is readable, 0 when lost or failing.", DEVICE),
    MetricSpec(
        "gpuledger_gpu_down_reason",
        Kind.GAUGE,
        "1 for a GPU that is down, with why: the NVML error (GPU_IS_LOST, ...), or TIMEOUT for a stuck call.",
        (*DEVICE, "reason"),
    ),
    MetricSpec(
        "gpuledger_gpu_utilization_ratio",
        Kind.GAUGE,
        "Fraction of the last sample period in which a kernel ran on the GPU (NVML GPU utilization).",
        DEVICE,
        "ratio",
    ),
    MetricSpec("gpuledger_gpu_memory_used_bytes", Kind.GAUGE, "Device memory in use.", DEVICE, "bytes"),
    MetricSpec("gpuledger_gpu_memory_total_bytes", Kind.GAUGE, "Device memory in total.", DEVICE, "bytes"),
    MetricSpec("gpuledger_gpu_temperature_celsius", Kind.GAUGE, "GPU core temperature.", DEVICE, "celsius"),
    MetricSpec(
        "gpuledger_gpu_power_watts",
        Kind.GAUGE,
        "Mean power draw of the board since the previous poll, from the energy counter (the driver's own"
        " reading, a 1 s average from Ampere on, where there is no counter or no previous poll).",
        DEVICE,
        "watts",
    ),
    MetricSpec("gpuledger_gpu_power_limit_watts", Kind.GAUGE, "Enforced power limit.", DEVICE, "watts"),
    MetricSpec(
        "gpuledger_gpu_energy_joules_total",
        Kind.COUNTER,
        "Energy the GPU has used since the driver was loaded (NVML energy counter).",
        DEVICE,
        "joules",
    ),
    MetricSpec(
        "gpuledger_gpu_nvlink_up", Kind.GAUGE, "1 when the NVLink link is active, 0 when down.", (*DEVICE, "link")
    ),
    MetricSpec("gpuledger_gpu_processes", Kind.GAUGE, "Compute processes running on the GPU.", DEVICE),
    MetricSpec(
        "gpuledger_mig_info",
        Kind.INFO,
        "A MIG instance of a GPU: always 1; gpu and uuid are the parent GPU's.",
        ("gpu", "uuid", "mig", "mig_uuid", "gpu_instance_id", "profile"),
    ),
    MetricSpec(
        "gpuledger_mig_memory_used_bytes", Kind.GAUGE, "Memory in use on a MIG instance.", (*DEVICE, "mig"), "bytes"
    ),
    MetricSpec("gpuledger_mig_memory_total_bytes", Kind.GAUGE, "Memory of a MIG instance.", (*DEVICE, "mig"), "bytes"),
    # GPU activity (GPM, Hopper and later), over the interval between the last two polls; a MIG
    # instance's over its own SMs. A MIG-enabled GPU's, its own and its instances', by default
    # over the last slow interval (readings.mig_activity: slow), carried into the polls between.
    MetricSpec(
        "gpuledger_gpu_sm_active_ratio",
        Kind.GAUGE,
        "Fraction of the GPU's SMs that had work (at least one warp), averaged over the last poll interval (GPM;"
        " under MIG, by default the last slow interval).",
        DEVICE,
        "ratio",
    ),
    MetricSpec(
        "gpuledger_gpu_sm_occupancy_ratio",
        Kind.GAUGE,
        "Warps resident on the GPU's SMs over the most they can hold, averaged over the last poll interval (GPM;"
        " under MIG, by default the last slow interval).",
        DEVICE,
        "ratio",
    ),
    MetricSpec(
        "gpuledger_gpu_tensor_active_ratio",
        Kind.GAUGE,
        "Fraction of cycles the GPU's tensor pipes were active over the last poll interval (GPM;"
        " under MIG, by default the last slow interval).",
        DEVICE,
        "ratio",
    ),
    MetricSpec(
        "gpuledger_gpu_dram_active_ratio",
        Kind.GAUGE,
        "Fraction of cycles the GPU's memory interface moved data over the last poll interval (GPM;"
        " under MIG, by default the last slow interval).",
        DEVICE,
        "ratio",
    ),
    MetricSpec(
        "gpuledger_mig_sm_active_ratio",
        Kind.GAUGE,
        "Fraction of a MIG instance's SMs that had work, averaged over the last poll interval (GPM;"
        " by default the last slow interval: readings.mig_activity).",
        (*DEVICE, "mig"),
        "ratio",
    ),
    MetricSpec(
        "gpuledger_mig_sm_occupancy_ratio",
        Kind.GAUGE,
        "Warps resident on a MIG instance's SMs over the most they can hold, over the last poll interval (GPM;"
        " by default the last slow interval: readings.mig_activity).",
        (*DEVICE, "mig"),
        "ratio",
    ),
    MetricSpec(
        "gpuledger_mig_tensor_active_ratio",
        Kind.GAUGE,
        "Fraction of cycles a MIG instance's tensor pipes were active over the last poll interval (GPM;"
        " by default the last slow interval: readings.mig_activity).",
        (*DEVICE, "mig"),
        "ratio",
    ),
    MetricSpec(
        "gpuledger_mig_dram_active_ratio",
        Kind.GAUGE,
        "Fraction of cycles a MIG instance's memory interface moved data over the last poll interval (GPM;"
        " by default the last slow interval: readings.mig_activity).",
        (*DEVICE, "mig"),
        "ratio",
    ),
    MetricSpec(
        "gpuledger_gpu_busy_source_info",
        Kind.INFO,
        "What busy seconds and the flag rules take as the GPU's (or MIG instance's, by its uuid) busy figure: "
        "gpm (SM activity) or nvml (utilization); always 1.",
        (*DEVICE, "source"),
    ),
    # Driver events (agent/devices/events.py), counted since the agent started.
    MetricSpec(
        "gpuledger_gpu_xid_errors_total",
        Kind.COUNTER,
        "Xid errors the driver reported for the GPU since the agent started, by Xid code (NVML events).",
        (*DEVICE, "xid"),
    ),
    MetricSpec(
        "gpuledger_gpu_last_xid_timestamp_seconds",
        Kind.GAUGE,
        "When the agent received the GPU's latest Xid error (unix time); the code is the xid label of "
        "gpuledger_gpu_xid_errors_total.",
        DEVICE,
        "seconds",
    ),
    MetricSpec(
        "gpuledger_gpu_events_total",
        Kind.COUNTER,
        "Driver events received for the GPU since the agent started: xid, single_bit_ecc, double_bit_ecc.",
        (*DEVICE, "event"),
    ),
    MetricSpec(
        "gpuledger_gpu_events_up",
        Kind.GAUGE,
        "1 while the agent receives the GPU's driver events, 0 while it cannot (GPU lost, driver away).",
        DEVICE,
    ),
    MetricSpec(
        "gpuledger_workload_gpu_utilization_ratio",
        Kind.GAUGE,
        "SM utilization of the GPU (or MIG instance, by its uuid) due to this workload's processes.",
        WORKLOAD,
        "ratio",
        optional_labels=("pid",),
    ),
    MetricSpec(
        "gpuledger_workload_gpu_memory_used_bytes",
        Kind.GAUGE,
        "GPU memory this workload's processes hold on the GPU (or MIG instance).",
        WORKLOAD,
        "bytes",
        optional_labels=("pid",),
    ),
    MetricSpec(
        "gpuledger_workload_gpu_processes",
        Kind.GAUGE,
        "Processes the workload runs on the GPU; 0 for an allocation that runs nothing.",
        WORKLOAD,
        optional_labels=("pid",),
    ),
    MetricSpec(
        "gpuledger_workload_gpu_allocated",
        Kind.GAUGE,
        "1 when the scheduler (kubelet, Slurm) allocated the GPU to the workload, 0 when it only runs there.",
        WORKLOAD,
        optional_labels=("pid",),
    ),
    MetricSpec(
        "gpuledger_workload_gpu_self_reported",
        Kind.GAUGE,
        "1 when only the process's own environment (SLURM_JOB_ID) names the workload: nothing trusted confirmed it.",
        WORKLOAD,
        optional_labels=("pid",),
    ),
    MetricSpec(
        "gpuledger_gpu_unresolved_processes",
        Kind.GAUGE,
        "Processes on the GPU that procfs could not resolve (exited, other PID namespace, no permission).",
        DEVICE,
    ),
    MetricSpec(
        "gpuledger_workload_gpu_seconds_total",
        Kind.COUNTER,
        "GPU time the workload held the GPU (a MIG instance counts its share of the GPU's SMs).",
        WORKLOAD,
        "seconds",
    ),
    MetricSpec(
        "gpuledger_workload_gpu_charged_seconds_total",
        Kind.COUNTER,
        "GPU time charged to the workload: held time x its share of the GPU (the share that splits "
        "cost), so the workloads' charged time plus idle time is the GPU's observed time.",
        WORKLOAD,
        "seconds",
    ),
    MetricSpec(
        "gpuledger_workload_gpu_busy_seconds_total",
        Kind.COUNTER,
        "GPU time the workload used: held time x its measured SM utilization; 1 - busy/held is waste.",
        WORKLOAD,
        "seconds",
    ),
    MetricSpec(
        "gpuledger_workload_gpu_unmeasured_seconds_total",
        Kind.COUNTER,
        "GPU time charged to the workload whose use nothing measured (its unit has no busy figure, "
        "as a MIG instance without GPM): unknown, neither used nor wasted; busy is a part of the rest.",
        WORKLOAD,
        "seconds",
    ),
    MetricSpec(
        "gpuledger_workload_cost_dollars_total",
        Kind.COUNTER,
        "What the workload's share of the GPU cost: price x weight x time, split by measured use.",
        WORKLOAD,
        "dollars",
    ),
    MetricSpec(
        "gpuledger_workload_energy_joules_total",
        Kind.COUNTER,
        "The workload's share of the GPU's energy counter, split like cost.",
        WORKLOAD,
        "joules",
    ),
    MetricSpec(
        "gpuledger_workload_energy_cost_dollars_total",
        Kind.COUNTER,
        "The workload's energy at pricing.energy_per_kwh (only when that is set).",
        WORKLOAD,
        "dollars",
    ),
    MetricSpec(
        "gpuledger_gpu_cost_dollars_total", Kind.COUNTER, "All cost of the GPU while observed.", DEVICE, "dollars"
    ),
    MetricSpec(
        "gpuledger_gpu_idle_cost_dollars_total",
        Kind.COUNTER,
        "Cost of the GPU while no workload held it (for MIG: of the slices nobody held).",
        DEVICE,
        "dollars",
    ),
    MetricSpec(
        "gpuledger_gpu_idle_seconds_total",
        Kind.COUNTER,
        "Time no workload held the GPU (MIG: weighted by the slices nobody held).",
        DEVICE,
        "seconds",
    ),
    MetricSpec(
        "gpuledger_gpu_idle_energy_joules_total",
        Kind.COUNTER,
        "The GPU's energy while no workload held it (its share of the energy counter), as the ledger's idle row "
        "has it.",
        DEVICE,
        "joules",
    ),
    MetricSpec(
        "gpuledger_gpu_idle_energy_cost_dollars_total",
        Kind.COUNTER,
        "The idle energy at pricing.energy_per_kwh (only when that is set).",
        DEVICE,
        "dollars",
    ),
    MetricSpec(
        "gpuledger_gpu_idle_left_by_seconds_total",
        Kind.COUNTER,
        "Idle time of the GPU by who left it idle: the workload that held it last before each idle stretch "
        "(all workload labels empty where nobody has held it since the agent started). A workload's series "
        "goes once it has added nothing for accounting.forget_after.",
        WORKLOAD,
        "seconds",
    ),
    MetricSpec(
        "gpuledger_gpu_idle_left_by_cost_dollars_total",
        Kind.COUNTER,
        "Idle cost of the GPU by who left it idle (labels as gpuledger_gpu_idle_left_by_seconds_total): "
        "what nobody held, named after the last holder.",
        WORKLOAD,
        "dollars",
    ),
    MetricSpec(
        "gpuledger_gpu_busy_seconds_total",
        Kind.COUNTER,
        "Time the GPU was busy while observed: its utilization averaged over its own samples of each "
        "interval (nvmlDeviceGetSamples) x the interval. Its workloads' busy seconds never add up to more.",
        DEVICE,
        "seconds",
    ),
    MetricSpec(
        "gpuledger_gpu_observed_seconds_total",
        Kind.COUNTER,
        "Time covered by polls close enough together to be charged.",
        DEVICE,
        "seconds",
    ),
    MetricSpec(
        "gpuledger_gpu_unobserved_seconds_total",
        Kind.COUNTER,
        "Time charged to nobody because nobody could see it, by reason: no_poll (agent stopped, node "
        "suspended), the GPU's NVML error (GPU_IS_LOST, TIMEOUT, ...), processes_unreadable.",
        (*DEVICE, "reason"),
        "seconds",
    ),
    MetricSpec(
        "gpuledger_gpu_unobserved_cost_dollars_total",
        Kind.COUNTER,
        "What the GPU cost while unobserved (price x unobserved time), by reason: charged to no workload.",
        (*DEVICE, "reason"),
        "dollars",
    ),
    MetricSpec(
        "gpuledger_gpu_energy_cost_dollars_total",
        Kind.COUNTER,
        "The GPU's energy at pricing.energy_per_kwh (only when that is set).",
        DEVICE,
        "dollars",
    ),
    MetricSpec("gpuledger_gpu_price_dollars_per_hour", Kind.GAUGE, "What the GPU costs per hour.", DEVICE),
    MetricSpec(
        "gpuledger_gpu_price_info",
        Kind.INFO,
        "Where the GPU's price comes from (source: config, instance or catalogue; `snapshot` cites it in "
        "full) and how the node is bought (purchase: on_demand, spot, reserved, savings_plan, committed); always 1.",
        (*DEVICE, "source", "purchase"),
    ),
    MetricSpec(
        "gpuledger_gpu_price_mismatch",
        Kind.GAUGE,
        "1 when the node's instance type comes with another GPU model than the one NVML reports (the GPU is "
        "then priced by its own model), 0 otherwise.",
        DEVICE,
    ),
    MetricSpec("gpuledger_gpu_flag", Kind.GAUGE, "1 while the rule holds for the GPU, 0 otherwise.", (*DEVICE, "rule")),
    MetricSpec(
        "gpuledger_gpu_idle_left_by_timestamp_seconds",
        Kind.GAUGE,
        "While nobody holds the GPU: who held it last (the labels) and when they were last seen on it "
        "(the value, unix seconds): who left it idle.",
        WORKLOAD,
        "seconds",
    ),
    MetricSpec(
        "gpuledger_gpu_flag_seconds",
        Kind.GAUGE,
        "How long the rule's condition has held on the GPU (while the flag is raised; 0 otherwise).",
        (*DEVICE, "rule"),
        "seconds",
    ),
    MetricSpec(
        "gpuledger_workload_flag",
        Kind.GAUGE,
        "1 for each workload holding a GPU flagged allocated_idle or stranded_memory: who to ask.",
        (*WORKLOAD, "rule"),
    ),
    MetricSpec(
        "gpuledger_actions_total",
        Kind.COUNTER,
        "Decisions and outcomes of the configured actions (config actions.triggers), by result: executed, "
        "failed, timeout, dry_run, denied, cooldown, deferred, cancelled.",
        ("action", "result"),
    ),
    MetricSpec("gpuledger_ledger_up", Kind.GAUGE, "1 while the ledger's last flush succeeded, 0 while failing.", ()),
    MetricSpec("gpuledger_ledger_pending_rows", Kind.GAUGE, "Ledger rows waiting for the next flush.", ()),
    MetricSpec(
        "gpuledger_ledger_dropped_rows_total",
        Kind.COUNTER,
        "Pending ledger rows dropped, oldest hours first, past ledger.max_pending_rows while the ledger "
        "could not be written.",
        (),
    ),
    MetricSpec(
        "gpuledger_ledger_dropped_dollars_total",
        Kind.COUNTER,
        "What the dropped ledger rows held (workload, idle and unobserved dollars): cost the ledger will never show.",
        (),
        "dollars",
    ),
    MetricSpec(
        "gpuledger_ledger_corrupt_files_total",
        Kind.COUNTER,
        "Corrupt ledger files found (quick_check at open, or a write meeting a damaged page), moved aside "
        "as <file>.corrupt-<time> and replaced by a fresh ledger.",
        (),
    ),
    MetricSpec(
        "gpuledger_ledger_last_flush_timestamp_seconds",
        Kind.GAUGE,
        "When the ledger last committed a flush (unix time).",
        (),
        "seconds",
    ),
    MetricSpec("gpuledger_kubelet_up", Kind.GAUGE, "1 while the kubelet pod-resources API answers, 0 when not.", ()),
    MetricSpec(
        "gpuledger_kubelet_unmatched_devices",
        Kind.GAUGE,
        "Device ids the kubelet has allocated to pods that no GPU or MIG instance of this node goes by.",
        (),
    ),
    MetricSpec("gpuledger_poll_duration_seconds", Kind.GAUGE, "How long the latest poll of NVML took.", (), "seconds"),
    MetricSpec(
        "gpuledger_last_poll_timestamp_seconds",
        Kind.GAUGE,
        "When the latest successful poll read the GPUs (backend clock, unix time).",
        (),
        "seconds",
    ),
    MetricSpec("gpuledger_polls_total", Kind.COUNTER, "Polls run since the agent started.", ()),
    MetricSpec(
        "gpuledger_poll_failures_total", Kind.COUNTER, "Polls that read nothing (NVML unavailable or an error).", ()
    ),
    MetricSpec(
        "gpuledger_poll_overruns_total",
        Kind.COUNTER,
        "Polls that took longer than the poll interval, or were skipped for it.",
        (),
    ),
    MetricSpec(
        "gpuledger_stage_duration_seconds",
        Kind.GAUGE,
        "How long the pipeline stage (sample, attribute, account, rules, publish) took the last time it ran.",
        ("stage",),
        "seconds",
    ),
    MetricSpec(
        "gpuledger_stage_failures_total",
        Kind.COUNTER,
        "Runs of the pipeline stage that raised (the poll went on with the stage's last good result), and reads in it "
        "given up on at their deadline (a process's /proc files: that process left unresolved).",
        ("stage",),
    ),
    MetricSpec(
        "gpuledger_stage_last_success_timestamp_seconds",
        Kind.GAUGE,
        "When the pipeline stage last ran without failing (backend clock of its poll, unix time).",
        ("stage",),
        "seconds",
    ),
    MetricSpec(
        "gpuledger_nvml_errors_total",
        Kind.COUNTER,
        "NVML calls that failed, by call and NVML error name (NOT_SUPPORTED is learned, not counted).",
        ("call", "error"),
    ),
    MetricSpec("gpuledger_nvml_up", Kind.GAUGE, "1 while NVML is initialised and answering, 0 otherwise.", ()),
    MetricSpec(
        "gpuledger_undiscovered_gpus",
        Kind.GAUGE,
        "GPUs the node has (by NVML's count; while the driver cannot say, by the PCI bus or the ledger) that "
        "discovery has not identified yet: retried with backoff, the agent degraded meanwhile; 0 when all are.",
        (),
    ),
    MetricSpec(
        "gpuledger_build_info",
        Kind.INFO,
        "The agent's version; always 1.",
        ("version", "driver_version", "cuda_driver_version"),
    ),
)

# Clocks, throttling, memory errors and links (exporters/health.py renders them). Counters count
# since the driver loaded unless their help says otherwise.
HEALTH: tuple[MetricSpec, ...] = (
    MetricSpec("gpuledger_gpu_sm_clock_hertz", Kind.GAUGE, "SM clock of the GPU now.", DEVICE, "hertz"),
    MetricSpec("gpuledger_gpu_memory_clock_hertz", Kind.GAUGE, "Memory clock of the GPU now.", DEVICE, "hertz"),
    MetricSpec("gpuledger_gpu_sm_clock_max_hertz", Kind.GAUGE, "The GPU's highest SM clock.", DEVICE, "hertz"),
    MetricSpec("gpuledger_gpu_memory_clock_max_hertz", Kind.GAUGE, "The GPU's highest memory clock.", DEVICE, "hertz"),
    MetricSpec(
        "gpuledger_gpu_fan_speed_ratio",
        Kind.GAUGE,
        "Fan speed as a fraction of its maximum (absent on passively cooled boards).",
        DEVICE,
        "ratio",
    ),
    MetricSpec(
        "gpuledger_gpu_performance_state", Kind.GAUGE, "Performance state: 0 (P0, the most performance) to 15.", DEVICE
    ),
    MetricSpec(
        "gpuledger_gpu_clock_event_reason",
        Kind.GAUGE,
        "1 while the reason holds the GPU's clocks where they are (NVML clocks-event reasons: gpu_idle, "
        "sw_power_cap, sw_thermal_slowdown, hw_slowdown, ...), 0 otherwise.",
        (*DEVICE, "reason"),
    ),
    MetricSpec(
        "gpuledger_gpu_clock_violation_seconds_total",
        Kind.COUNTER,
        "Time the driver held the clocks below what was asked, by cause (power, thermal, sync_boost, "
        "board_limit, low_utilization, reliability, app_clocks, base_clocks).",
        (*DEVICE, "cause"),
        "seconds",
    ),
    MetricSpec(
        "gpuledger_gpu_ecc_errors_total",
        Kind.COUNTER,
        "ECC memory errors since the driver loaded, by type: corrected (single-bit) or uncorrected (double-bit).",
        (*DEVICE, "type"),
    ),
    MetricSpec(
        "gpuledger_gpu_ecc_aggregate_errors_total",
        Kind.COUNTER,
        "ECC memory errors over the board's life (kept in its InfoROM), by type: corrected or uncorrected.",
        (*DEVICE, "type"),
    ),
    MetricSpec(
        "gpuledger_gpu_retired_pages_total",
        Kind.COUNTER,
        "Memory pages retired, by cause: single_bit (repeated corrected errors) or double_bit (before Ampere).",
        (*DEVICE, "cause"),
    ),
    MetricSpec(
        "gpuledger_gpu_retired_pages_pending",
        Kind.GAUGE,
        "1 while a retired page waits for the driver to reload (before Ampere).",
        DEVICE,
    ),
    MetricSpec(
        "gpuledger_gpu_remapped_rows_total",
        Kind.COUNTER,
        "Memory rows remapped to spares, by cause: correctable or uncorrectable errors (Ampere and later).",
        (*DEVICE, "cause"),
    ),
    MetricSpec(
        "gpuledger_gpu_row_remap_pending", Kind.GAUGE, "1 while a row remap waits for the GPU's next reset.", DEVICE
    ),
    MetricSpec(
        "gpuledger_gpu_row_remap_failure",
        Kind.GAUGE,
        "1 when a row could not be remapped (no spare left): the GPU needs service.",
        DEVICE,
    ),
    MetricSpec("gpuledger_gpu_pcie_link_generation", Kind.GAUGE, "PCIe generation the link runs at now.", DEVICE),
    MetricSpec(
        "gpuledger_gpu_pcie_link_generation_max",
        Kind.GAUGE,
        "Highest PCIe generation the GPU and its slot support together.",
        DEVICE,
    ),
    MetricSpec("gpuledger_gpu_pcie_link_width", Kind.GAUGE, "PCIe lanes the link runs with now.", DEVICE),
    MetricSpec("gpuledger_gpu_pcie_link_width_max", Kind.GAUGE, "Most PCIe lanes the link can run with.", DEVICE),
    MetricSpec(
        "gpuledger_gpu_pcie_replays_total", Kind.COUNTER, "PCIe packets the link had to send again (replays).", DEVICE
    ),
    MetricSpec(
        "gpuledger_gpu_pcie_transmit_bytes_per_second",
        Kind.GAUGE,
        "PCIe traffic from the GPU, sampled by the driver (readings.pcie_throughput, off by default).",
        DEVICE,
        "bytes_per_second",
    ),
    MetricSpec(
        "gpuledger_gpu_pcie_receive_bytes_per_second",
        Kind.GAUGE,
        "PCIe traffic to the GPU, sampled by the driver (readings.pcie_throughput, off by default).",
        DEVICE,
        "bytes_per_second",
    ),
    MetricSpec(
        "gpuledger_gpu_nvlink_errors_total",
        Kind.COUNTER,
        "NVLink link errors, by type: crc (flits that failed their CRC), replay (retransmissions), recovery "
        "(link retraining).",
        (*DEVICE, "link", "type"),
    ),
    MetricSpec(
        "gpuledger_gpu_nvlink_transmit_bytes_total",
        Kind.COUNTER,
        "Data the GPU sent over the NVLink link.",
        (*DEVICE, "link"),
        "bytes",
    ),
    MetricSpec(
        "gpuledger_gpu_nvlink_receive_bytes_total",
        Kind.COUNTER,
        "Data the GPU received over the NVLink link.",
        (*DEVICE, "link"),
        "bytes",
    ),
    MetricSpec(
        "gpuledger_gpu_encoder_utilization_ratio",
        Kind.GAUGE,
        "Fraction of time the video encoder was busy.",
        DEVICE,
        "ratio",
    ),
    MetricSpec(
        "gpuledger_gpu_decoder_utilization_ratio",
        Kind.GAUGE,
        "Fraction of time the video decoder was busy.",
        DEVICE,
        "ratio",
    ),
    MetricSpec(
        "gpuledger_gpu_memory_controller_utilization_ratio",
        Kind.GAUGE,
        "Fraction of time device memory was being read or written (NVML memory utilization).",
        DEVICE,
        "ratio",
    ),
)
CATALOGUE += HEALTH

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOGUE}

"""What attribution alone costs per process, and whether that cost holds as a node grows.

    python bench/attribution.py [--repeats N]

Times the pure step, `agent.attribution.resolve.attribute` (facts in, workloads out: no procfs,
no kubelet, no files), on synthetic facts at 256, 512, 1024, 2048 and 4096 processes. Each node
has 8 processes per device and one allocation per device, so devices and allocations grow with
the processes, as on a node cut into many MIG instances:

  even devices  a Slurm job: its 8 processes run in the job's cgroup as 8 different users, so
                8 holdings per device, and the job's allocation marks them allocated
  odd devices   a pod allocated by the kubelet: its 8 processes run in the pod's cgroup, one
                holding, which the pod's allocation marks allocated

Work that is linear in processes + allocations costs the same per process at every size; work
that compares every allocation with every holding grows with the node. The last row is the
largest size's cost per process over the smallest's, against its target.
Timings are wall time (`time.perf_counter`, garbage collection off), the median of --repeats
runs after two untimed ones; only they vary from run to run.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, uninstalled

from agent.attribution.facts import PodAllocation, SlurmAllocation
from agent.attribution.resolve import Inputs, attribute
from agent.model import (
    Attribution,
    DeviceReading,
    NodeInfo,
    ProcessFacts,
    ProcessIdentity,
    ProcessReading,
    Snapshot,
)

SIZES = (256, 512, 1024, 2048, 4096)
PROCESSES_PER_DEVICE = 8
PID_BASE = 100_000
# Linear: the largest node costs at most this many times as much per process as the smallest.
TARGET_RATIO = 1.5


def device_uuid(n: int) -> str:
    return f"GPU-{n:08x}-0000-4000-8000-000000000000"


def pod_uid(n: int) -> str:
    return f"{n:08x}-1111-4111-8111-111111111111"


def synthetic_inputs(processes: int) -> Inputs:
    """A node of `processes` processes, 8 per device, one Slurm job or pod allocated per device."""
    devices: list[DeviceReading] = []
    facts: dict[int, ProcessFacts] = {}
    pod_names: dict[str, tuple[str, str]] = {}
    pods: list[PodAllocation] = []
    jobs: list[SlurmAllocation] = []
    for n in range(processes // PROCESSES_PER_DEVICE):
        readings = []
        for slot in range(PROCESSES_PER_DEVICE):
            pid = PID_BASE + n * PROCESSES_PER_DEVICE + slot
            readings.append(ProcessReading(pid, (1 + slot) * 2**28, 0.01 * (1 + slot)))
            if n % 2 == 0:
                cgroup = f"0::/system.slice/slurmstepd.scope/job_{70000 + n}/step_0/user/task_{slot}\n"
            else:
                uid = pod_uid(n).replace("-", "_")
                cgroup = f"0::/kubepods.slice/kubepods-pod{uid}.slice/cri-containerd-{n:064x}.scope\n"
            cmdline = ("python", "worker.py", "--rank", str(slot))
            facts[pid] = ProcessFacts(ProcessIdentity(pid, 1), 1000 + slot, cmdline, cgroup)
        devices.append(
            DeviceReading(
                index=n, uuid=device_uuid(n), name="NVIDIA A100-SXM4-80GB", up=True, utilization=0.5,
                processes=tuple(readings),
            )
        )  # fmt: skip
        if n % 2 == 0:
            jobs.append(SlurmAllocation(gpu_index=n, gpu_instance_id=None, job=str(70000 + n), user=None))
        else:
            pod_names[pod_uid(n)] = ("research", f"trainer-{n}")
            pods.append(PodAllocation("research", f"trainer-{n}", "main", device_uuid(n)))
    return Inputs(
        snapshot=Snapshot(0.0, NodeInfo("bench"), tuple(devices)),
        processes=facts,
        pod_names=pod_names,
        pod_allocations=pods,
        slurm_allocations=jobs,
        user_names={1000 + slot: f"user{slot}" for slot in range(PROCESSES_PER_DEVICE)},
    )


def check(inputs: Inputs, attribution: Attribution) -> None:
    """Outside the timing: the answer is the one the node's shape implies, or the figure is void."""
    devices = len(inputs.snapshot.devices)
    expected = (devices + 1) // 2 * PROCESSES_PER_DEVICE + devices // 2
    allocated = {h.device_uuid for h in attribution.holdings if h.allocated}
    if len(attribution.holdings) != expected or len(allocated) != devices:
        raise SystemExit(
            f"{devices} devices: {len(attribution.holdings)} holdings (expected {expected}), "
            f"{len(allocated)} devices allocated: the measurement is void"
        )


def time_attribution(inputs: Inputs, repeats: int) -> float:
    """Median seconds of one `attribute` call, after two untimed calls (caches warm)."""
    for _ in range(2):
        check(inputs, attribute(inputs))
    times: list[float] = []
    for _ in range(repeats):
        gc.disable()
        started = time.perf_counter()
        attribute(inputs)
        elapsed = time.perf_counter() - started
        gc.enable()
        times.append(elapsed)
    return statistics.median(times)


def table(rows: Iterable[Iterable[object]], align: str) -> list[str]:
    """Rows as aligned text; `align` gives each column's alignment, "<" or ">"."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(align))]
    return ["  ".join(f"{c:{a}{w}}" for c, a, w in zip(row, align, widths, strict=True)).rstrip() for row in cells]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25, help="timed runs per size (default 25)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    per_process_us: dict[int, float] = {}
    rows: list[tuple[str, ...]] = [("processes", "devices", "allocations", "median ms", "us/process")]
    for size in SIZES:
        inputs = synthetic_inputs(size)
        seconds = time_attribution(inputs, args.repeats)
        per_process_us[size] = seconds * 1e6 / size
        allocations = len(inputs.pod_allocations) + len(inputs.slurm_allocations)
        rows.append(
            (
                str(size),
                str(len(inputs.snapshot.devices)),
                str(allocations),
                f"{seconds * 1000:.2f}",
                f"{per_process_us[size]:.1f}",
            )
        )
    ratio = per_process_us[SIZES[-1]] / per_process_us[SIZES[0]]
    verdict = "PASS" if ratio <= TARGET_RATIO else "MISS"
    print(
        f"attribute() alone on synthetic facts, {PROCESSES_PER_DEVICE} processes and one allocation per device, "
        f"median of {args.repeats} runs"
    )
    print()
    print("\n".join(table(rows, "<>>>>")))
    print()
    ratio_rows = [
        ("ratio", "value", "target", "result"),
        (f"us/process at {SIZES[-1]} / at {SIZES[0]}", f"{ratio:.2f}x", f"<= {TARGET_RATIO:g}x", verdict),
    ]
    print("\n".join(table(ratio_rows, "<>>>")))
    return 0


if __name__ == "__main__":
    sys.exit(main())

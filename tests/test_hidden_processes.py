"""Processes outside NVML's compute list: CUDA MPS clients and graphics processes.

Under MPS, nvmlDeviceGetComputeRunningProcesses lists the MPS server; the clients that run
the work are listed by nvmlDeviceGetMPSComputeRunningProcesses. A process with only a
graphics context (a renderer, a Vulkan job) is listed by nvmlDeviceGetGraphicsRunningProcesses
alone. Read from the compute list only, the clients' time went to the server's owner and a
graphics job's time looked idle.
"""

from __future__ import annotations

from typing import Any

import pynvml
import pytest

import fake_nvml
from agent.model import Price
from agent.pipeline import Costing
from tests.helpers import Rig

PRICE = Price(3.6, "test")  # $3.60 per GPU-hour: $0.001 a second

MPS_AND_GRAPHICS: dict[str, Any] = {
    "gpus": [{"count": 2}],
    "processes": [
        # GPU 0, shared through MPS: the server (root) holds the context the clients run in.
        {
            "pid": 700,
            "gpus": [0],
            "sm_util": 0,
            "memory_mib": 500,
            "uid": 0,
            "user": "root",
            "cmdline": "nvidia-cuda-mps-server",
        },
        {"pid": 701, "gpus": [0], "context": "mps", "sm_util": 60, "memory_mib": 4000, "uid": 1001, "user": "ann"},
        {"pid": 702, "gpus": [0], "context": "mps", "sm_util": 20, "memory_mib": 2000, "uid": 1002, "user": "bob"},
        # GPU 1: a rendering job with a graphics context only.
        {"pid": 710, "gpus": [1], "context": "graphics", "sm_util": 40, "memory_mib": 1000, "uid": 1003, "user": "cat"},
    ],
}


def test_the_fake_lists_mps_clients_and_graphics_processes_where_nvml_does() -> None:
    fake_nvml.install(MPS_AND_GRAPHICS)
    try:
        pynvml.nvmlInit()
        gpu0, gpu1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)

        def pids(processes: list[Any]) -> list[int]:
            return [p.pid for p in processes]

        assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(gpu0)) == [700]
        assert pids(pynvml.nvmlDeviceGetMPSComputeRunningProcesses(gpu0)) == [701, 702]
        assert pids(pynvml.nvmlDeviceGetGraphicsRunningProcesses(gpu0)) == []
        assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(gpu1)) == []
        assert pids(pynvml.nvmlDeviceGetMPSComputeRunningProcesses(gpu1)) == []
        assert [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetGraphicsRunningProcesses(gpu1)] == [
            (710, 1000 * 2**20)
        ]
        pynvml.nvmlShutdown()
    finally:
        fake_nvml.uninstall()


def test_a_process_with_compute_and_graphics_contexts_is_listed_once() -> None:
    scenario = {
        "gpus": [{"count": 1}],
        "processes": [{"pid": 720, "gpus": [0], "context": "compute+graphics", "sm_util": 50, "memory_mib": 3000}],
    }
    rig = Rig(scenario)
    try:
        state = rig.run(60, 60)
    finally:
        rig.close()
    assert state.snapshot is not None
    assert [(p.pid, p.used_memory_bytes) for p in state.snapshot.gpus[0].processes] == [(720, 3000 * 2**20)]


def test_mps_clients_and_a_graphics_job_pay_for_the_gpu_time_they_used() -> None:
    rig = Rig(MPS_AND_GRAPHICS, costing=Costing(prices=lambda s: {g.uuid: PRICE for g in s.gpus}))
    try:
        state = rig.run(180, 60)  # polls at 0, 60, 120, 180: 180 s on each GPU
    finally:
        rig.close()
    dollars = {(gpu, workload.user): totals.dollars for (gpu, _uuid, workload), totals in state.costs.workloads.items()}
    # GPU 0 costs 180 s x $0.001 = $0.18, split by measured SM use among the server (0%) and its
    # clients (60% and 20%): ann 60/80 x $0.18 = $0.135, bob 20/80 x $0.18 = $0.045, root $0.
    assert dollars[(0, "ann")] == pytest.approx(0.135)
    assert dollars[(0, "bob")] == pytest.approx(0.045)
    assert dollars.get((0, "root"), 0.0) == pytest.approx(0.0)
    # GPU 1: cat's rendering job held it all 180 s: $0.18, none of it idle.
    assert dollars[(1, "cat")] == pytest.approx(0.18)
    gpus = {gpu: totals for (gpu, _uuid), totals in state.costs.gpus.items()}
    for gpu in (0, 1):
        charged = sum(d for (g, _user), d in dollars.items() if g == gpu)
        totals = gpus[gpu]
        assert totals.idle_dollars == pytest.approx(0.0)
        assert totals.unobserved_dollars == pytest.approx(0.0)
        # Conservation: charged + idle + unobserved = price x time, $0.001 x 180 s = $0.18.
        assert charged + totals.idle_dollars + totals.unobserved_dollars == pytest.approx(0.18)

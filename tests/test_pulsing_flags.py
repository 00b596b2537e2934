"""A GPU whose work pulses in step with the polls is judged by how busy it was over each interval,
not at the poll's instant.

On a real H200 running half-second bursts of matrix products (scripts/realgpu/README.md), NVML's
utilization read 0% at every reading of nvidia-smi, nvitop and gpuledger alike, while the GPU was
busy half the time. The flag rules read that instant, so such a GPU was flagged allocated-idle
(and an opt-in idle action could have stopped the job)."""

from __future__ import annotations

from typing import Any

from agent.config import Settings
from tests.helpers import Rig

STEP_S = 2.0


def _pulsing() -> dict[str, Any]:
    # An A100 (NVML is its busy source: no GPM) held by one process busy in odd seconds only: at
    # every poll (even seconds) the device's latest sample reads 0%; over each 2 s interval, 50%.
    rows = [{"at": f"{s}s", "sm_util": 100 if s % 2 else 0} for s in range(200)]
    return {
        "gpus": [{"model": "A100-SXM4-80GB"}],
        "processes": [{"pid": 4200, "gpus": [0], "memory_mib": 20000, "sm_util": rows, "cmdline": "python pulse.py"}],
    }


def test_a_gpu_busy_half_of_every_interval_is_not_flagged_idle() -> None:
    settings = Settings.model_validate(
        {"poll_interval": "2s", "rules": {"allocated_idle": {"for": "1m"}, "underused": {"enabled": False}}}
    )
    rig = Rig(_pulsing(), settings=settings)
    try:
        state = rig.run(duration_s=150.0, step_s=STEP_S)
        gpu = state.snapshot.gpus[0] if state.snapshot else None
        assert gpu is not None
        assert gpu.utilization == 0.0  # the instant the poll landed on: idle
        assert gpu.interval_utilization == 0.5  # the interval: busy 1 s of 2
        assert gpu.busy == 0.5
        flags = {labels["rule"]: value for _, labels, value in rig.samples(state, ["gpuledger_gpu_flag"])}
        # 150 s at 0% instant would be past `for: 1m` and flagged; at 50% it is not idle at all.
        assert flags["allocated_idle"] == 0.0
    finally:
        rig.close()

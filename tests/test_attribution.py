"""Attribution: every GPU process and allocation tied to its workload, model and team."""

from __future__ import annotations

import gc
import itertools
import logging
import shutil
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import agent.scrub
from agent.attribution.labels import apply_rules, compile_rules, rule_env_keys
from agent.attribution.recognise import recognise_model
from agent.attribution.sources.kubelet import PodResourcesClient
from agent.attribution.sources.procfs import (
    ANCESTOR_LEVELS,
    Passwd,
    ProcessSource,
    ProcessUnreadable,
    ProcFS,
    parse_stat,
)
from agent.config import Settings
from agent.model import WORKLOAD_LABELS, AgentState, ProcessFacts, ProcessIdentity, Workload
from agent.scrub import REDACTED
from fake_nvml.podresources import FakePodResourcesServer
from tests.helpers import Rig
from tests.test_cli import gpuledger

DEMO_RULES = [
    ({"namespace": "^research-"}, {"team": "research"}),
    ({"account": "^nlp$"}, {"team": "nlp"}),
    ({"namespace": "^serving$"}, {"team": "inference"}),
]
MODEL_RULE = [({"cmdline": "--model[= ]([^ ]+)"}, {"model": "$1"})]


@pytest.fixture
def rig() -> Iterator[Any]:
    made: list[Rig] = []

    def make(*args: Any, **kwargs: Any) -> Rig:
        r = Rig(*args, **kwargs)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def owners(state: AgentState) -> dict[str, list[Workload]]:
    assert state.snapshot is not None
    return {d.label: [h.workload for h in state.attribution.for_device(d.uuid)] for d in state.snapshot.devices}


def workload_series(text: str, name: str) -> dict[tuple[str, ...], float]:
    keys = ("gpu", *WORKLOAD_LABELS)
    return {
        tuple(s.labels[k] for k in keys): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def test_demo_metrics_name_every_workload(rig: Any) -> None:
    r = rig("demo", rules=DEMO_RULES)
    r.poll()
    text = r.metrics(r.poll(5))
    util = workload_series(text, "gpuledger_workload_gpu_utilization_ratio")
    llama = "llama-3-8b"
    expected = {
        ("0", "", "", "", "8812", "", "alice", llama, "nlp"): 0.92,
        ("1", "", "", "", "8812", "", "alice", llama, "nlp"): 0.92,
        ("2", "", "", "", "8812", "", "alice", llama, "nlp"): 0.92,
        ("3", "", "", "", "8812", "", "alice", llama, "nlp"): 0.92,
        ("4", "serving", "vllm-llama-0", "vllm", "", "", "", "meta-llama/Llama-3.1-8B-Instruct", "inference"): 0.55,
        ("4", "", "", "9f2b7c1d4e5a", "", "", "carol", "BAAI/bge-large-en-v1.5", ""): 0.20,
        ("5", "research-nlp", "notebook-7", "jupyter", "", "", "", "", "research"): 0.0,
        ("7", "research-cv", "notebook-3", "jupyter", "", "", "", "", "research"): 0.0,
    }
    assert util == pytest.approx(expected)
    memory = workload_series(text, "gpuledger_workload_gpu_memory_used_bytes")
    assert memory[("5", "research-nlp", "notebook-7", "jupyter", "", "", "", "", "research")] == 30000 * 2**20
    processes = workload_series(text, "gpuledger_workload_gpu_processes")
    allocated = workload_series(text, "gpuledger_workload_gpu_allocated")
    notebook3 = ("7", "research-cv", "notebook-3", "jupyter", "", "", "", "", "research")
    assert processes[notebook3] == 0  # allocated, runs nothing: still holds the GPU
    assert allocated[notebook3] == 1
    assert allocated[("0", "", "", "", "8812", "", "alice", llama, "nlp")] == 1  # the Slurm map file
    assert allocated[("4", "", "", "9f2b7c1d4e5a", "", "", "carol", "BAAI/bge-large-en-v1.5", "")] == 0
    assert "pid=" not in text
    assert "gpuledger_kubelet_up 1.0" in text


def test_per_pid_series_add_a_pid_label_only_when_switched_on(rig: Any) -> None:
    r = rig("demo", per_pid=True)
    text = r.metrics(r.poll())
    pids = {
        s.labels["pid"]
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpuledger_workload_gpu_memory_used_bytes"
    }
    assert {"4101", "5200", "6310", "7001"} <= pids


def test_a_reused_pid_is_reported_with_its_new_owner_from_the_next_poll(rig: Any) -> None:
    r = rig(
        {
            "gpus": [{"count": 1}],
            "processes": [
                {"pid": 700, "gpus": [0], "end": "1m", "sm_util": 50, "slurm_job": "41", "user": "ann", "uid": 2001},
                {
                    "pid": 700,
                    "gpus": [0],
                    "start": "2m",
                    "sm_util": 30,
                    "uid": 2002,
                    "pod": {"namespace": "ml", "name": "trainer-0", "container": "main"},
                    "cmdline": "python train.py --model qwen2-7b",
                },
            ],
        }
    )
    first = owners(r.poll(5))["0"]
    assert first == [Workload(hpc_job="41", user="ann")]
    reads = r.processes.full_reads
    r.poll(60)
    assert r.processes.full_reads == reads  # same process: served from the cache
    second = owners(r.poll(120))["0"]
    assert second == [Workload(namespace="ml", pod="trainer-0", container="main", model="qwen2-7b")]


@pytest.mark.parametrize(
    ("rules", "model_chars"),
    [((), 0), (MODEL_RULE, 0), (MODEL_RULE, 16 * 1024)],
    ids=["recognisers", "rules", "long-model"],
)
def test_finished_tasks_long_cmdlines_are_not_kept(
    rig: Any, rules: Any, model_chars: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job array's tasks, one after another, each with a 32 KiB cmdline (its config in the
    arguments; with `model_chars`, the rule's model label is that long): what is kept of finished
    tasks' cmdlines and labels stays within the long-text memo's bound, not one for each task.
    The memo is cut to 64 KiB here (1 MiB in the agent) so that a dozen tasks tell the two apart."""
    memo_chars = 64 * 1024
    monkeypatch.setattr(agent.scrub._long_texts, "max_chars", memo_chars)
    tasks, cmdline_chars = 12, 32 * 1024
    processes = [
        {
            "pid": 900 + i,
            "gpus": [0],
            "start": f"{60 * i + 1}s",
            "end": f"{60 * i + 45}s",
            "slurm_job": f"77_{i}",
            "cmdline": f"python task.py --model m{i}"
            + "z" * model_chars
            + f" --cfg={i:x}"
            + "y" * (cmdline_chars - model_chars),
        }
        for i in range(tasks)
    ]
    r = rig({"gpus": [{"count": 1}], "processes": processes}, rules=rules)
    r.poll()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        state = r.run(60 * tasks, 30)
        gc.collect()
        kept_bytes = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert owners(state)["0"] == []  # every task has gone
    # Each task's cmdline was read, scrubbed and matched. What stays: at most the memo's 64 KiB of
    # ASCII text, and the last task's facts (which attribution may still hold) with a little
    # more, under 4 cmdlines; keeping every task's would be 12 x 32 KiB, 384 KiB, or more.
    assert kept_bytes < memo_chars + 4 * cmdline_chars


def test_steady_state_polls_read_only_each_process_stat(rig: Any) -> None:
    r = rig("demo")
    r.poll()
    reads = r.processes.full_reads
    assert reads == 7
    for _ in range(5):
        r.poll(5)
    assert r.processes.full_reads == reads


def test_unresolvable_pids_are_counted_and_attributed_as_unknown(rig: Any) -> None:
    r = rig(
        {
            "gpus": [{"count": 2}],
            "processes": [
                {"pid": 10, "gpus": [0], "sm_util": 40, "memory_mib": 100, "user": "ann", "uid": 2001},
                {"pid": 11, "gpus": [1], "sm_util": 60, "memory_mib": 200, "user": "ann", "uid": 2001},
            ],
        }
    )
    r.poll()
    # pid 11 lives in a PID namespace we cannot see: NVML reports it, procfs does not have it
    shutil.rmtree(r.node.proc_root / "11")
    state = r.poll(5)
    assert owners(state)["1"] == [Workload()]
    assert owners(state)["0"] == [Workload(user="ann")]
    text = r.metrics(state)
    assert 'gpuledger_gpu_unresolved_processes{gpu="1"' in text
    unresolved = {
        s.labels["gpu"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gpuledger_gpu_unresolved_processes"
    }
    assert unresolved == {"0": 0.0, "1": 1.0}
    memory = workload_series(text, "gpuledger_workload_gpu_memory_used_bytes")
    assert memory[("1", "", "", "", "", "", "", "", "")] == 200 * 2**20  # not dropped: unknown owner


def test_slurm_allocation_without_a_process_still_holds_its_gpus(rig: Any) -> None:
    r = rig(
        {
            "gpus": [{"count": 2}, {"model": "A100-SXM4-80GB", "mig": ["3g.40gb", "3g.40gb"]}],
            "allocations": [
                {"gpus": [1], "slurm_job": "9911", "user": "bob"},
                {"gpus": ["2:1"], "slurm_job": "9912", "user": "cat"},
            ],
        }
    )
    state = r.poll()
    held = owners(state)
    assert held["1"] == [Workload(hpc_job="9911", user="bob")]
    assert held["0"] == []
    assert held["2:1"] == [Workload(hpc_job="9912", user="cat")]  # a MIG `gpu.gi` map file
    holding = state.attribution.for_device(state.snapshot.mig_devices(state.snapshot.gpus[2].uuid)[1].uuid)[0]  # type: ignore[union-attr]
    assert holding.allocated
    assert holding.sm_util is None  # MIG cannot measure use


def test_kubelet_socket_vanishing_falls_back_to_cgroups(rig: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="agent.attribution.sources.kubelet")
    r = rig("demo")
    assert owners(r.poll())["7"] == [Workload(namespace="research-cv", pod="notebook-3", container="jupyter")]
    r.node.host.server.stop()
    # Past attribution.kubelet_stale_after (5m), when its last allocations stop standing for it.
    for _ in range(3):
        state = r.poll(150)
    assert state.attribution.kubelet_up is False
    # pods with processes are still named, from their cgroup and the kubelet's pod log dirs
    assert owners(state)["5"] == [Workload(namespace="research-nlp", pod="notebook-7", container="")]
    text = r.metrics(state)
    assert "gpuledger_kubelet_up 0.0" in text
    down_lines = [rec for rec in caplog.records if "unavailable" in rec.getMessage()]
    assert len(down_lines) == 1  # one line per change of state, not per poll


def test_a_kubelet_that_never_answers_times_out_and_polling_goes_on(rig: Any) -> None:
    r = rig("demo", kubelet_timeout_s=0.3)
    r.poll()
    r.node.host.server.hang(True)
    started = time.monotonic()
    state = r.poll(5)
    assert time.monotonic() - started < 5
    assert state.attribution.kubelet_up is False
    assert state.snapshot is not None
    assert len(state.snapshot.gpus) == 8
    r.node.host.server.hang(False)
    assert r.poll(5).attribution.kubelet_up is True


def test_pods_time_slicing_a_gpu_pay_for_it_rather_than_idle(rig: Any) -> None:
    r = rig(
        {"start": "2026-11-20T18:00:00Z", "gpus": [{"model": "A100-SXM4-80GB"}]},
        settings=Settings(node_name="rig", pricing={"gpu_hourly": 3.6}),
    )
    uuid = r.node.scenario.gpus[0].uuid
    # A device plugin sharing the GPU by time-slicing hands each pod a replica of it.
    rows = [
        ("ml", "notebook-a", "jupyter", "nvidia.com/gpu", [f"{uuid}::0"]),
        ("ml", "notebook-b", "jupyter", "nvidia.com/gpu", [f"{uuid}::1"]),
    ]
    r.node.host.server.stop()
    with FakePodResourcesServer(lambda: rows, str(r.node.host.podresources_socket)):
        state = r.run(3600.0, 30.0)
    dollars = {w.pod: totals.dollars for (_gpu, _uuid, w), totals in state.costs.workloads.items()}
    idle = sum(g.idle_dollars for g in state.costs.gpus.values())
    unobserved = sum(g.unobserved_dollars for g in state.costs.gpus.values())
    # $3.60/GPU-hour for 1h = $3.60; both notebooks hold the GPU all hour and use none of it
    # (0% each, no memory): split equally, $1.80 each, and nothing of it is idle.
    assert dollars == pytest.approx({"notebook-a": 1.8, "notebook-b": 1.8})
    assert idle == pytest.approx(0.0)
    assert sum(dollars.values()) + idle + unobserved == pytest.approx(3.6)


def test_a_mig_instance_allocated_by_index_is_its_pods(rig: Any) -> None:
    r = rig(
        {"start": "2026-11-20T18:00:00Z", "gpus": [{"model": "A100-SXM4-80GB", "mig": ["3g.40gb", "3g.40gb"]}]},
        settings=Settings(node_name="rig", pricing={"gpu_hourly": 3.6}),
    )
    # A device plugin with deviceIDStrategy=index names a MIG device "<gpu>:<MIG device index>",
    # the index NVML's nvmlDeviceGetMigDeviceHandleByIndex takes (go-nvlib's VisitMigDevices).
    rows = [("ml", "notebook", "jupyter", "nvidia.com/mig-3g.40gb", ["0:1"])]
    r.node.host.server.stop()
    with FakePodResourcesServer(lambda: rows, str(r.node.host.podresources_socket)):
        state = r.run(3600.0, 30.0)
    dollars = {(uuid, w.pod): totals.dollars for (_gpu, uuid, w), totals in state.costs.workloads.items()}
    idle = sum(g.idle_dollars for g in state.costs.gpus.values())
    unobserved = sum(g.unobserved_dollars for g in state.costs.gpus.values())
    # $3.60 for the GPU-hour; a 3g.40gb instance is 42 of the A100's 108 SMs: $3.60 x 42/108 =
    # $1.40 to the notebook on instance 1; instance 0 ($1.40) and the 24 SMs no instance has
    # ($0.80) are idle.
    assert dollars == pytest.approx({(r.node.scenario.gpus[0].mig[1].uuid, "notebook"): 1.4})
    assert idle == pytest.approx(2.2)
    assert sum(dollars.values()) + idle + unobserved == pytest.approx(3.6)


def test_gke_device_ids_name_gpus_and_mig_instances_by_device_node_not_index(rig: Any) -> None:
    # GKE's device plugin names a GPU by its device node, "nvidia<minor>", and a MIG instance by
    # its GPU's node and GPU instance id, "nvidia<minor>/gi<id>". The minor is not the index:
    # here GPU 0 (MIG) is /dev/nvidia1 and GPU 1 is /dev/nvidia0. Neither pod runs anything.
    scenario = {
        "start": "2026-11-20T18:00:00Z",
        "node": {"device_plugin": "gke"},
        "gpus": [{"model": "A100-SXM4-80GB", "mig": ["3g.40gb", "3g.40gb"], "minor": 1}, {"minor": 0}],
        "allocations": [
            {"gpus": [1], "pod": {"namespace": "ml", "name": "notebook", "container": "jupyter"}},
            {"gpus": ["0:1"], "pod": {"namespace": "ml", "name": "mig-notebook", "container": "jupyter"}},
        ],
    }
    r = rig(scenario, settings=Settings(node_name="rig", pricing={"gpu_hourly": 3.6}))
    gpus = r.node.scenario.gpus
    with PodResourcesClient(str(r.node.host.podresources_socket)) as kubelet:  # what the fake kubelet says
        device_ids = sorted(a.device_id for a in kubelet.list_gpu_allocations())
    assert device_ids == ["nvidia0", f"nvidia1/gi{gpus[0].mig[1].gpu_instance_id}"]
    state = r.run(3600.0, 30.0)
    dollars = {(uuid, w.pod): totals.dollars for (_gpu, uuid, w), totals in state.costs.workloads.items()}
    # $3.60 per GPU-hour, one hour of two GPUs = $7.20. GPU 1 (nvidia0) is the notebook's all
    # hour: $3.60. A 3g.40gb instance is 42 of the A100's 108 SMs: $3.60 x 42/108 = $1.40 to the
    # MIG notebook on instance 1; instance 0 ($1.40) and the 24 SMs no instance has ($0.80) are
    # idle: $2.20.
    assert dollars == pytest.approx({(gpus[1].uuid, "notebook"): 3.6, (gpus[0].mig[1].uuid, "mig-notebook"): 1.4})
    assert sum(g.idle_dollars for g in state.costs.gpus.values()) == pytest.approx(2.2)
    assert_conserved(state, {Workload(pod=pod): d for (_uuid, pod), d in dollars.items()}, 7.2)


def test_a_device_id_no_gpu_goes_by_is_logged_once_and_counted(rig: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="agent.attribution.gather")
    r = rig({"gpus": [{"count": 1}]})
    uuid = r.node.scenario.gpus[0].uuid
    # One id is this GPU's; the others name a GPU elsewhere and a device node this node lacks.
    rows = [
        ("ml", "notebook", "jupyter", "nvidia.com/gpu", [uuid, "GPU-elsewhere"]),
        ("ml", "trainer", "main", "nvidia.com/gpu", ["nvidia7"]),
        # an RDMA device of the network operator's is no GPU, and no GPU missing
        ("ml", "trainer", "main", "nvidia.com/rdma_shared_device_a", ["rdma0"]),
    ]
    r.node.host.server.stop()
    with FakePodResourcesServer(lambda: rows, str(r.node.host.podresources_socket)):
        states = [r.poll(15.0) for _ in range(3)]
    assert states[-1].attribution.unmatched_devices == ("GPU-elsewhere", "nvidia7")
    assert ("gpuledger_kubelet_unmatched_devices", {}, 2.0) in r.samples(
        states[-1], {"gpuledger_kubelet_unmatched_devices"}
    )
    told = [m for m in caplog.messages if "no GPU or MIG instance on this node goes by" in m]
    assert len(told) == 2  # once each, however many polls
    assert "'GPU-elsewhere' (to ml/notebook)" in told[0]
    assert "'nvidia7' (to ml/trainer)" in told[1]


def dollars_by_model(state: AgentState) -> dict[str, float]:
    """Every workload's dollars so far, summed per model."""
    found: dict[str, float] = {}
    for (_gpu, _uuid, w), totals in state.costs.workloads.items():
        found[w.model] = found.get(w.model, 0.0) + totals.dollars
    return found


def serving_pod(name: str, container: str, uid: str) -> dict[str, str]:
    """A scenario process's `pod:` in the serving namespace."""
    return {"namespace": "serving", "name": name, "container": container, "uid": uid}


def test_a_jobs_processes_and_gpus_that_name_no_model_are_its_models(rig: Any) -> None:
    pod = serving_pod("vllm-tp", "vllm", "0b6c2f4e-3c1d-4e8a-9f11-2a7d5c9e0b01")
    server = {"sm_util": 50, "memory_mib": 1000, "uid": 1000, "pod": pod}
    r = rig(
        {
            "start": "2026-11-20T18:00:00Z",
            "gpus": [{"model": "A100-SXM4-80GB", "count": 4}],
            "processes": [
                # vLLM with tensor parallelism 2: rank 0 has the flags, the worker it spawns none.
                {**server, "pid": 600, "gpus": [0], "cmdline": "python3 -m vllm.entrypoints.openai.api_server"
                 " --model mistralai/Mistral-7B-v0.3 --tensor-parallel-size 2"},
                {**server, "pid": 601, "gpus": [1], "cmdline": "python3 -c 'from multiprocessing.spawn import"
                 " spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)' --multiprocessing-fork"},
                # A Slurm job on GPUs 2 and 3 that runs on GPU 2 only.
                {"pid": 700, "gpus": [2], "sm_util": 50, "uid": 1001, "user": "bob", "slurm_job": "77",
                 "cmdline": "python train.py --model llama-3-8b"},
            ],
            "allocations": [{"gpus": [2, 3], "slurm_job": "77", "user": "bob"}],
        },
        settings=Settings(node_name="rig", pricing={"gpu_hourly": 3.6}),
    )  # fmt: skip
    state = r.run(3600.0, 30.0)
    dollars = dollars_by_model(state)
    # $3.60 a GPU-hour: each job's two GPUs are its model's, none of it is model ''.
    assert dollars == pytest.approx({"mistralai/Mistral-7B-v0.3": 7.2, "llama-3-8b": 7.2})


def test_renamed_server_workers_take_the_model_their_server_names(rig: Any) -> None:
    # vLLM's V1 engine and SGLang rename their GPU processes with setproctitle (`VLLM::EngineCore`,
    # `VLLM::Worker_TP0`, `sglang::scheduler_TP0`); only the API server, on no GPU, names the model.
    pod = serving_pod("llama-tp2", "vllm", "1c2d3e4f-0000-4000-8000-00000000aa01")
    sglang = serving_pod("qwen", "sglang", "1c2d3e4f-0000-4000-8000-00000000aa02")
    session = "0::/user.slice/user-1000.slice/session-3.scope"
    r = rig(
        {
            "start": "2026-11-20T18:00:00Z",
            "gpus": [{"model": "A100-SXM4-80GB", "count": 5}],
            "processes": [
                {"pid": 800, "gpus": [], "uid": 1000, "pod": pod,
                 "cmdline": "vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 2"},
                {"pid": 801, "gpus": [], "uid": 1000, "pod": pod, "parent": 800, "cmdline": "VLLM::EngineCore"},
                {"pid": 802, "gpus": [0], "sm_util": 50, "uid": 1000, "pod": pod, "parent": 801,
                 "cmdline": "VLLM::Worker_TP0"},
                {"pid": 803, "gpus": [1], "sm_util": 50, "uid": 1000, "pod": pod, "parent": 801,
                 "cmdline": "VLLM::Worker_TP1"},
                # A host shell whose arguments name a model, parent of a process in a container
                # (another cgroup): it lends nothing.
                {"pid": 900, "gpus": [], "uid": 1000, "user": "ann", "cgroup": session,
                 "cmdline": "python launch.py --model host/model"},
                {"pid": 901, "gpus": [2], "sm_util": 50, "uid": 1000, "container_id": "c0ffee" * 10 + "abcd",
                 "parent": 900, "cmdline": "VLLM::EngineCore"},
                # A process whose own command line names a model keeps it, whatever its parent's says.
                {"pid": 950, "gpus": [], "uid": 1000, "cgroup": session, "cmdline": "vllm serve parent/model"},
                {"pid": 951, "gpus": [3], "sm_util": 50, "uid": 1000, "cgroup": session, "parent": 950,
                 "cmdline": "python serve.py --model own/model"},
                # SGLang's scheduler under a server whose model is a URL with credentials: the
                # inherited model is scrubbed like any other.
                {"pid": 960, "gpus": [], "uid": 1000, "pod": sglang, "cmdline": "python3 -m sglang.launch_server"
                 " --model-path https://ann:hunter2@hub.example/Qwen/Qwen2-7B?token=abc --tp 1"},
                {"pid": 961, "gpus": [4], "sm_util": 50, "uid": 1000, "pod": sglang, "parent": 960,
                 "cmdline": "sglang::scheduler_TP0"},
            ],
        },
        settings=Settings(node_name="rig", pricing={"gpu_hourly": 3.6}),
    )  # fmt: skip
    state = r.run(3600.0, 30.0)
    dollars = dollars_by_model(state)
    # $3.60 a GPU-hour for 1h: both tensor-parallel GPUs are the server's model ($7.20; they were
    # model ''), the container's GPU names no model ($3.60), the others one each.
    assert dollars == pytest.approx(
        {
            "meta-llama/Llama-3.1-8B-Instruct": 7.2,
            "": 3.6,
            "own/model": 3.6,
            "https://hub.example/Qwen/Qwen2-7B": 3.6,
        }
    )
    assert "hunter2" not in r.metrics(state)
    # The workers share the server and its engine: each ancestor was read once, the host shell
    # (another cgroup) not at all, and steady polls read no ancestor again.
    assert r.processes.ancestor_reads == 4  # 801, 800, 900 (read, then refused), 960
    r.poll(30)
    assert r.processes.ancestor_reads == 4


def write_family(root: Path, pid: int, ppid: int, cmdline: str, cgroup: str, uid: int = 1000) -> None:
    """One process with its parent's pid in its stat line (field 4)."""
    proc = root / str(pid)
    proc.mkdir(parents=True)
    (proc / "stat").write_text(f"{pid} (x) S {ppid} {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {pid * 10} 0 0\n")
    (proc / "status").write_text(f"Name:\tx\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (proc / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in cmdline.split()))
    (proc / "cgroup").write_text(cgroup)
    (proc / "environ").write_bytes(b"")


def test_the_stat_line_is_read_after_the_last_parenthesis() -> None:
    # A command name may hold spaces and parentheses: setproctitle and prctl(PR_SET_NAME) write any.
    stat = b"4242 (VLLM::W ) (x) S 4100 4242 4242 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 98765 0 0\n"
    assert parse_stat(stat) == (4100, 98765)
    with pytest.raises(ValueError, match="cut short"):
        parse_stat(b"4242 (VLLM::W ) (x) S 4100")


def test_a_model_is_inherited_within_the_cgroup_uid_and_level_bound(tmp_path: Path) -> None:
    cgroup = "0::/system.slice/docker-abc.scope\n"
    # Five levels of plain launchers above a worker: the server at the top is one too far.
    write_family(tmp_path, 10, 1, "vllm serve far/model", cgroup)
    chain = [10, *range(11, 11 + ANCESTOR_LEVELS)]
    for parent, pid in itertools.pairwise(chain):
        write_family(tmp_path, pid, parent, "bash run.sh", cgroup)
    write_family(tmp_path, 20, chain[-1], "VLLM::Worker_TP0", cgroup)
    # Another uid in the same cgroup (sudo, a runtime's helper) lends nothing either.
    write_family(tmp_path, 30, 1, "vllm serve root/model", cgroup, uid=0)
    write_family(tmp_path, 31, 30, "VLLM::EngineCore", cgroup)
    # One level under the server: its model.
    write_family(tmp_path, 40, 1, "vllm serve near/model", cgroup)
    write_family(tmp_path, 41, 40, "VLLM::EngineCore", cgroup)
    source = ProcessSource(ProcFS(tmp_path), Passwd(tmp_path / "passwd"))
    inherited = {pid: f.inherited_model for pid in (20, 31, 41) if (f := source._facts(pid)) is not None}
    assert inherited == {20: None, 31: None, 41: "near/model"}


@pytest.mark.parametrize(
    ("cmdline", "model"),
    [
        ("vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 2", "meta-llama/Llama-3.1-8B-Instruct"),
        (
            "python3 -m vllm.entrypoints.openai.api_server --model mistralai/Mistral-7B-v0.3",
            "mistralai/Mistral-7B-v0.3",
        ),
        # the weights, not the alias the server answers to, in either order
        (
            "python3 -m vllm.entrypoints.openai.api_server --served-model-name llama8b --model meta-llama/Llama-3.1-8B",
            "meta-llama/Llama-3.1-8B",
        ),
        ("vllm serve meta-llama/Llama-3.1-8B --served-model-name llama8b", "meta-llama/Llama-3.1-8B"),
        # the model positional after options: a value-taking option skips its value, a switch none
        ("vllm serve --port 8000 meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
        ("vllm serve --tensor-parallel-size 2 --trust-remote-code --enforce-eager Qwen/Qwen2-7B", "Qwen/Qwen2-7B"),
        ("vllm serve -tp 2 -O3 --no-enable-prefix-caching --dtype=bfloat16 Qwen/Qwen2-7B --port 8000", "Qwen/Qwen2-7B"),
        ("vllm serve --served-model-name llama8b meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
        ("vllm serve --config serve.yaml --port 8000", None),
        # A switch the recogniser does not know takes no option for its value: not "8000" or "2".
        ("vllm serve --some-new-switch --port 8000 meta/M", "meta/M"),
        ("vllm serve --some-new-switch -tp 2 --seed -1 meta/M", "meta/M"),
        ("vllm serve --enable-lora --lora-modules sql=/loras/sql chat=/loras/chat Qwen/Qwen2-7B", "Qwen/Qwen2-7B"),
        # llama.cpp: the GGUF path as given, from -m or --model; a hub repo from -hf
        ("llama-server -m /models/qwen2-7b-q4_k_m.gguf -ngl 99 --port 8080", "/models/qwen2-7b-q4_k_m.gguf"),
        ("/opt/llama.cpp/build/bin/llama-server --port 8080 --model /models/x.gguf", "/models/x.gguf"),
        ("llama-server -hf ggml-org/gemma-3-1b-it-GGUF:Q4_K_M", "ggml-org/gemma-3-1b-it-GGUF:Q4_K_M"),
        ("python3 -m vllm.entrypoints.openai.api_server --served-model-name llama8b", "llama8b"),
        ("text-generation-launcher --model-id bigscience/bloom-560m --port 8080", "bigscience/bloom-560m"),
        # TGI's shards, which hold the GPUs its launcher only starts
        (
            "/opt/conda/bin/python3.11 /opt/conda/bin/text-generation-server serve bigscience/bloom-560m"
            " --uds-path /tmp/text-generation-server-0 --logger-level INFO --json-output",
            "bigscience/bloom-560m",
        ),
        ("tritonserver --model-repository=/models/ensemble-llm", "ensemble-llm"),
        ("tritonserver --model-repository /models --load-model resnet50", "resnet50"),
        # several models, or all of them: the repository, not the first one named
        ("tritonserver --model-repository=/models/prod --load-model=resnet50 --load-model=bert", "prod"),
        ("tritonserver --model-repository=/models/prod --model-control-mode=explicit --load-model=*", "prod"),
        ("python3 -m sglang.launch_server --model-path Qwen/Qwen2-7B-Instruct --port 30000", "Qwen/Qwen2-7B-Instruct"),
        ("ollama run llama3.1:8b", "llama3.1:8b"),
        # A local directory, with or without its trailing slash, is one model (it was two rows).
        ("vllm serve /models/llama-3-8b/ --port 8000", "/models/llama-3-8b"),
        ("python3 -m vllm.entrypoints.openai.api_server --model=/models/llama-3-8b/", "/models/llama-3-8b"),
        ("torchrun --nproc_per_node 8 train.py --model llama-3-8b --lr 2e-5", "llama-3-8b"),
        ("accelerate launch finetune.py --model_name_or_path google/gemma-2-9b", "google/gemma-2-9b"),
        ("deepspeed --num_gpus 8 train.py --model-id tiiuae/falcon-7b", "tiiuae/falcon-7b"),
        ("python run_clm.py --model_name_or_path=gpt2 --do_train", "gpt2"),
        ("python train.py --epochs 3", None),
        ("/usr/bin/python -m ipykernel_launcher -f kernel.json", None),
        ("", None),
    ],
)
def test_model_recognisers(cmdline: str, model: str | None) -> None:
    assert recognise_model(cmdline.split()) == model
    assert recognise_model([cmdline]) == model  # a cmdline given as one string


def test_rules_first_match_wins_per_field_and_fill_groups() -> None:
    # the labelling rules themselves, without a host
    rules = compile_rules(
        [
            ({"cmdline": r"--config configs/(\w+)\.yaml"}, {"model": "$1"}),
            ({"namespace": "^research-(.*)$"}, {"team": "research-$1"}),
            ({"namespace": "^research-"}, {"team": "never", "model": "never"}),
            ({"env.TEAM": "(.+)"}, {"team": "$1"}),
        ]
    )
    w = apply_rules(
        Workload(namespace="research-cv", pod="p"), ("python", "train.py", "--config", "configs/yolo.yaml"), None, rules
    )
    assert (w.model, w.team) == ("yolo", "research-cv")
    plain = apply_rules(Workload(user="ann"), ("python", "x.py", "--model", "bert-base"), None, rules)
    assert (plain.model, plain.team) == ("bert-base", "")  # no rule: the recogniser names it
    assert rule_env_keys(rules) == {"TEAM"}


def test_a_rules_group_cannot_lift_a_secret_out_of_its_context() -> None:
    # `--password=([^ ]+)` would capture a bare "hunter2" that no later scrub can tell from a team
    # name: rules match the cmdline and environment already scrubbed.
    rules = compile_rules(
        [
            ({"cmdline": "--password=([^ ]+)"}, {"team": "$1"}),
            ({"env.DB": "password=(.+)"}, {"model": "$1"}),
        ]
    )
    facts = ProcessFacts(ProcessIdentity(1, 1), 0, (), "", env=(("DB", "password=hunter3"),))
    w = apply_rules(Workload(user="ann"), ("python", "x.py", "--password=hunter2"), facts, rules)
    assert (w.team, w.model) == (REDACTED, REDACTED)


def test_a_rule_on_a_secret_variable_cannot_lift_its_value() -> None:
    # A rule naming env.HF_TOKEN puts HF_TOKEN on the allowlist; its bare value ("hunter4", no
    # token shape) carried nothing a scrub could recognise, and $1 made it the team label.
    rules = compile_rules([({"env.HF_TOKEN": "(.+)"}, {"team": "$1"}), ({"env.PGPASSWORD": "(.+)"}, {"model": "$1"})])
    env = (("HF_TOKEN", "hunter4"), ("PGPASSWORD", "hunter5 with spaces"))
    facts = ProcessFacts(ProcessIdentity(1, 1), 0, (), "", env=env)
    w = apply_rules(Workload(user="ann"), ("python", "x.py"), facts, rules)
    assert (w.team, w.model) == (REDACTED, REDACTED)
    # An ordinary variable keeps its value.
    team = compile_rules([({"env.TEAM": "(.+)"}, {"team": "$1"})])
    plain = ProcessFacts(ProcessIdentity(1, 1), 0, (), "", env=(("TEAM", "nlp"),))
    assert apply_rules(Workload(user="ann"), ("python", "x.py"), plain, team).team == "nlp"


@pytest.mark.parametrize("team_from_account", [True, False])
@pytest.mark.parametrize("account", [None, "", "nlp"])
@pytest.mark.parametrize(
    "cmdline", [(), ("python", "x.py", "--model", "bert-base"), ("python", "x.py"), ("vllm", "serve", "m/llama")]
)
def test_without_rules_the_labels_are_those_the_rules_path_gives(
    cmdline: tuple[str, ...], account: str | None, team_from_account: bool
) -> None:
    # With no rules configured apply_rules answers from a memo of (workload, cmdline, team), the
    # same object each time; a rule that never matches takes the general path to the same labels.
    never = compile_rules([({"cmdline": "(?!)"}, {"model": "never", "team": "never"})])
    w = Workload(hpc_job="4242", user="bob")
    fast = apply_rules(w, cmdline, None, (), account, team_from_account)
    assert fast == apply_rules(w, cmdline, None, never, account, team_from_account)
    assert fast is apply_rules(
        Workload(hpc_job="4242", user="bob"), list(cmdline), None, (), account, team_from_account
    )
    assert fast.team == ((account or "") if team_from_account else "")


def write_proc(root: Path, pid: int, comm: str, start_ticks: int, cgroup: str, environ: bytes = b"") -> None:
    """One process as procfs shows it: stat (field 22: start time), status, cmdline, cgroup, environ."""
    proc = root / str(pid)
    proc.mkdir(parents=True)
    (proc / "stat").write_text(f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start_ticks} 0 0\n")
    (proc / "status").write_text("Name:\tpython\nUid:\t1000\t1000\t1000\t1000\n")
    (proc / "cmdline").write_bytes(b"python\0train.py\0")
    (proc / "cgroup").write_text(cgroup)
    (proc / "environ").write_bytes(environ)


# Mallory (uid 1012) owns the subtree systemd delegates to her (user@1012.service): she can mkdir
# any name there and move her processes in. She names Bob's Slurm job (GPU 1), Bob's user slice
# (GPU 2) and the serving pod's uid (GPU 4) in it; Bob's job really runs on GPU 0, the pod on 3.
VICTIM_POD_UID = "0b6c2f4e-1111-4222-8333-944445555666"
MALLORY_TREE = "0::/user.slice/user-1012.slice/user@1012.service"
DELEGATED_CLAIMS = {
    "start": "2026-11-20T18:00:00Z",
    "node": {"hostname": "spoof-node"},
    "gpus": [{"model": "A100-SXM4-80GB", "count": 5}],
    "processes": [
        {"pid": 700, "gpus": [0], "sm_util": 50, "uid": 1010, "user": "bob", "slurm_job": "4242"},
        {
            "pid": 720,
            "gpus": [1],
            "sm_util": 90,
            "uid": 1012,
            "user": "mallory",
            "cgroup": f"{MALLORY_TREE}/slurmstepd.scope/job_4242/step_0/user/task_0",
        },
        {
            "pid": 721,
            "gpus": [2],
            "sm_util": 90,
            "uid": 1012,
            "user": "mallory",
            "cgroup": f"{MALLORY_TREE}/app.slice/user-1010.slice/user@1010.service/run.scope",
        },
        {
            "pid": 730,
            "gpus": [3],
            "sm_util": 40,
            "uid": 1000,
            "user": "svc",
            "pod": {"namespace": "serving", "name": "api-0", "container": "api", "uid": VICTIM_POD_UID},
        },
        {
            "pid": 722,
            "gpus": [4],
            "sm_util": 90,
            "uid": 1012,
            "user": "mallory",
            "cgroup": f"{MALLORY_TREE}/kubepods.slice/kubepods-pod{VICTIM_POD_UID.replace('-', '_')}.slice/run.scope",
        },
    ],
    "allocations": [{"gpus": [0], "slurm_job": "4242", "user": "bob"}],
}


def test_a_cgroup_a_user_made_in_her_own_delegated_tree_bills_nobody_else() -> None:
    r = Rig(DELEGATED_CLAIMS, settings=Settings(node_name="spoof-node", pricing={"gpu_hourly": 2.0}))
    try:
        state = r.run(3600.0, 60.0)
    finally:
        r.close()
    held = owners(state)
    assert held["0"] == [Workload(hpc_job="4242", user="bob")]
    assert held["3"] == [Workload(namespace="serving", pod="api-0", container="api")]
    # Each of Mallory's processes is hers, whatever her cgroup's names say.
    for gpu in ("1", "2", "4"):
        assert held[gpu] == [Workload(user="mallory")], gpu
    dollars: dict[Workload, float] = {}
    for (_gpu, _uuid, workload), totals in state.costs.workloads.items():
        dollars[workload] = dollars.get(workload, 0.0) + totals.dollars
    # $2/GPU-hour for 1h: Bob's job pays for GPU 0 alone ($2), the pod for GPU 3 ($2), Mallory
    # for GPUs 1, 2 and 4 (3 x $2 = $6); every GPU was held all hour, so nothing is idle or
    # unobserved, and the $10 of 5 GPUs x 1h x $2 are all charged.
    assert dollars == pytest.approx(
        {
            Workload(hpc_job="4242", user="bob"): 2.0,
            Workload(namespace="serving", pod="api-0", container="api"): 2.0,
            Workload(user="mallory"): 6.0,
        }
    )
    idle = sum(g.idle_dollars for g in state.costs.gpus.values())
    unobserved = sum(g.unobserved_dollars for g in state.costs.gpus.values())
    assert sum(dollars.values()) + idle + unobserved == pytest.approx(5 * 1 * 2.0)


def dollars_by_workload(state: AgentState) -> dict[Workload, float]:
    """Every workload's dollars so far, summed over its GPUs."""
    found: dict[Workload, float] = {}
    for (_gpu, _uuid, workload), totals in state.costs.workloads.items():
        found[workload] = found.get(workload, 0.0) + totals.dollars
    return found


def assert_conserved(state: AgentState, dollars: dict[Workload, float], expected: float) -> None:
    """Charged + idle + unobserved is the price of every GPU over the whole time."""
    idle = sum(g.idle_dollars for g in state.costs.gpus.values())
    unobserved = sum(g.unobserved_dollars for g in state.costs.gpus.values())
    assert sum(dollars.values()) + idle + unobserved == pytest.approx(expected)


def test_another_users_process_on_a_mapped_gpu_is_not_billed_to_the_job() -> None:
    # Bob's job 4242 is allocated GPUs 0 and 1 (the prolog's map files) and runs on GPU 1 alone.
    # Mallory, logged in outside Slurm (her session's cgroup), runs on GPU 0 at 90%, her
    # environment claiming the job too. No cgroup puts her process in the job: it is hers.
    scenario = {
        "start": "2026-11-20T18:00:00Z",
        "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
        "processes": [
            {
                "pid": 720,
                "gpus": [0],
                "sm_util": 90,
                "uid": 1012,
                "user": "mallory",
                "environ": {"SLURM_JOB_ID": "4242"},
            },
            {"pid": 700, "gpus": [1], "sm_util": 50, "uid": 1010, "user": "bob", "slurm_job": "4242"},
        ],
        "allocations": [{"gpus": [0, 1], "slurm_job": "4242", "user": "bob", "account": "physics"}],
    }
    r = Rig(scenario, settings=Settings(pricing={"gpu_hourly": 3.6}))
    try:
        state = r.run(3600.0, 60.0)
    finally:
        r.close()
    job, mallory = Workload(hpc_job="4242", user="bob", team="physics"), Workload(user="mallory")
    assert owners(state)["0"] == [mallory, job]
    dollars = dollars_by_workload(state)
    # $3.60/GPU-hour for 1h. GPU 0: Mallory at 90%, the job's allocation using none of it, split
    # by utilization: 0.9/0.9 x $3.60 = $3.60 hers, $0 the job's. GPU 1: the job alone, $3.60.
    # (It was $7.20 to Bob's job, Mallory's hour included.) 2 GPUs x 1h x $3.60 = $7.20 in all.
    assert dollars == pytest.approx({job: 3.6, mallory: 3.6})
    assert_conserved(state, dollars, 2 * 1 * 3.6)


def test_an_array_tasks_processes_and_allocation_are_one_job_known_by_its_array_name(rig: Any) -> None:
    # Array task 1234_7 has job id 1235 of its own: slurmd's cgroup says job_1235, the prolog's
    # map files say "1235=1234_7" for its GPUs 0 and 1. It runs on GPU 0 only.
    r = rig(
        {
            "start": "2026-11-20T18:00:00Z",
            "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
            "processes": [
                {"pid": 800, "gpus": [0], "sm_util": 60, "uid": 1010, "user": "alice",
                 "cgroup": "/system.slice/slurmstepd.scope/job_1235/step_batch/user/task_0"},
            ],
            "allocations": [{"gpus": [0, 1], "slurm_job": "1235=1234_7", "user": "alice"}],
        },
        settings=Settings(node_name="rig", pricing={"gpu_hourly": 3.6}),
    )  # fmt: skip
    state = r.run(3600.0, 60.0)
    task = Workload(hpc_job="1234_7", user="alice")
    assert owners(state) == {"0": [task], "1": [task]}
    dollars = dollars_by_workload(state)
    # $3.60/GPU-hour for 1h, both GPUs the task's: 2 x 1h x $3.60 = $7.20, none of it to a
    # job "1235" beside it (it was GPU 0's $3.60 to "1235", GPU 1 idle).
    assert dollars == pytest.approx({task: 7.2})
    assert_conserved(state, dollars, 2 * 1 * 3.6)


def slinky_cgroup(pod_uid: str, container: str, job: str) -> str:
    """A Slurm step's cgroup as slurmd builds it inside its pod's container (Slinky)."""
    return (
        f"0::/kubepods.slice/kubepods-pod{pod_uid.replace('-', '_')}.slice/cri-containerd-{container}.scope/"
        f"system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n"
    )


def test_a_slurm_job_inside_a_pod_is_billed_only_where_its_gpus_map_file_names_it(rig: Any) -> None:
    # Slinky: slurmd runs in pod slinky/worker-0, which the kubelet allocated GPU 0; the prolog
    # mapped GPU 0 to job 1234 (alice) and GPU 1 to job 999, which runs nothing. Alice's step
    # runs on GPU 0 in slurmd's own cgroup tree. Pod ml/miner-0, on GPU 2, made a job_999 tree
    # of its own: GPU 2's map names no job, so that name is the pod's claim, and it stays the pod's.
    slurmd = {"namespace": "slinky", "name": "worker-0", "container": "slurmd",
              "uid": "5a1b2c3d-0000-4000-8000-00000000c001"}  # fmt: skip
    miner = {"namespace": "ml", "name": "miner-0", "container": "main", "uid": "5a1b2c3d-0000-4000-8000-00000000c002"}
    r = rig(
        {
            "start": "2026-11-20T18:00:00Z",
            "gpus": [{"model": "A100-SXM4-80GB", "count": 3}],
            "processes": [
                {"pid": 800, "gpus": [0], "sm_util": 80, "uid": 1010, "user": "alice", "pod": slurmd,
                 "cgroup": slinky_cgroup(slurmd["uid"], "ab" * 32, "1234")},
                {"pid": 810, "gpus": [2], "sm_util": 90, "uid": 1012, "user": "mallory", "pod": miner,
                 "cgroup": slinky_cgroup(miner["uid"], "cd" * 32, "999")},
            ],
            "allocations": [
                {"gpus": [0], "pod": slurmd},
                {"gpus": [2], "pod": miner},
                {"gpus": [0], "slurm_job": "1234", "user": "alice"},
                {"gpus": [1], "slurm_job": "999", "user": "bob"},
            ],
        },
        settings=Settings(node_name="rig", pricing={"gpu_hourly": 3.6}),
    )  # fmt: skip
    state = r.run(3600.0, 60.0)
    job, pod = Workload(hpc_job="1234", user="alice"), Workload(namespace="slinky", pod="worker-0", container="slurmd")
    other_job, spoofer = Workload(hpc_job="999", user="bob"), Workload(namespace="ml", pod="miner-0", container="main")
    held = owners(state)
    assert sorted(held["0"]) == sorted([job, pod])
    assert held["1"] == [other_job]
    assert held["2"] == [spoofer]
    dollars = dollars_by_workload(state)
    # $3.60/GPU-hour for 1h. GPU 0: the job at 80%, slurmd's pod allocation using none of it:
    # 0.8/0.8 x $3.60 = $3.60 the job's, $0 the pod's (it was all the pod's). GPU 1: job 999's
    # allocation alone, $3.60. GPU 2: the miner pod, $3.60, none of it job 999's.
    # 3 GPUs x 1h x $3.60 = $10.80 in all.
    assert dollars == pytest.approx({job: 3.6, pod: 0.0, other_job: 3.6, spoofer: 3.6})
    assert_conserved(state, dollars, 3 * 1 * 3.6)


def test_a_slurm_job_inside_a_docker_container_is_billed_only_where_its_gpus_map_file_names_it(rig: Any) -> None:
    # Slurm run in Docker (the slurm-docker-cluster shape): slurmd's container builds job 77's
    # cgroup inside its own, and the prolog mapped GPU 0 to job 77. Another container, on GPU 1,
    # made a job_77 tree of its own too (privileged, its cgroup writable): GPU 1's map names no
    # job, so that name is the container's claim, and its GPU time stays the container's.
    slurmd, other = "5e" * 32, "6f" * 32

    def in_container(container: str) -> str:
        return f"/system.slice/docker-{container}.scope/system.slice/slurmstepd.scope/job_77/step_0/user/task_0"

    r = rig(
        {
            "start": "2026-11-20T18:00:00Z",
            "gpus": [{"model": "A100-SXM4-80GB", "count": 2}],
            "processes": [
                {"pid": 820, "gpus": [0], "sm_util": 60, "uid": 1010, "user": "alice", "cgroup": in_container(slurmd)},
                {"pid": 830, "gpus": [1], "sm_util": 90, "uid": 1012, "user": "mallory", "cgroup": in_container(other)},
            ],
            "allocations": [{"gpus": [0], "slurm_job": "77", "user": "alice"}],
        },
        settings=Settings(node_name="rig", pricing={"gpu_hourly": 3.6}),
    )
    state = r.run(3600.0, 60.0)
    job, container = Workload(hpc_job="77", user="alice"), Workload(container=other[:12], user="mallory")
    assert owners(state) == {"0": [job], "1": [container]}
    dollars = dollars_by_workload(state)
    # $3.60/GPU-hour for 1h, each GPU held by one workload all hour: GPU 0 job 77's, $3.60;
    # GPU 1 the other container's, $3.60 (it was job 77's, under mallory). 2 x 1h x $3.60 = $7.20.
    assert dollars == pytest.approx({job: 3.6, container: 3.6})
    assert_conserved(state, dollars, 2 * 1 * 3.6)


def test_a_process_of_a_pod_the_kubelet_no_longer_lists_is_not_billed_to_the_pod_now_allocated(rig: Any) -> None:
    # A pod that was deleted left a process running on GPU 0 (its uid named by no log directory,
    # no kubelet row). The GPU is now allocated to serving/vllm-1, whose own uid the kubelet's log
    # directories name: the leftover process is not vllm-1's.
    gone = "7d1e2f3a-0000-4000-8000-00000000dead"
    pod = serving_pod("vllm-1", "vllm", "1c2d3e4f-0000-4000-8000-00000000aa02")
    r = rig(
        {
            "start": "2026-11-20T18:00:00Z",
            "gpus": [{"model": "A100-SXM4-80GB"}],
            "processes": [
                {"pid": 900, "gpus": [0], "sm_util": 90, "uid": 1000, "cmdline": "python serve.py",
                 "cgroup": f"/kubepods.slice/kubepods-pod{gone.replace('-', '_')}.slice/"
                 f"cri-containerd-{'ab' * 32}.scope"},
            ],
            "allocations": [{"gpus": [0], "pod": pod}],
        },
        settings=Settings(node_name="rig", pricing={"gpu_hourly": 3.6}),
    )  # fmt: skip
    state = r.run(3600.0, 60.0)
    leftover = Workload(pod=f"uid-{gone}")
    allocated = Workload(namespace="serving", pod="vllm-1", container="vllm")
    assert sorted(owners(state)["0"]) == sorted([leftover, allocated])
    dollars = dollars_by_workload(state)
    # $3.60/GPU-hour for 1h, split by utilization: the leftover process at 90%, vllm-1's
    # allocation at 0%: 0.9/0.9 x $3.60 = $3.60 the leftover's, $0 vllm-1's (it was all vllm-1's).
    assert dollars == pytest.approx({leftover: 3.6, allocated: 0.0})
    assert_conserved(state, dollars, 1 * 1 * 3.6)


def test_a_static_pod_is_named_from_its_log_directory(rig: Any) -> None:
    # A static pod's uid is the kubelet's 32-hex hash of its manifest, not a UUID; its log
    # directory is /var/log/pods/<namespace>_<name>_<hash> all the same. It shares GPU 0 with a
    # pod of the API server, so the kubelet's list alone cannot say whose the process is.
    static = {"namespace": "kube-system", "name": "llm-node1", "container": "llm",
              "uid": "4f9a6a2c7cfa9d3e5a3c1e2d4b5f6a7b"}  # fmt: skip
    other = serving_pod("vllm-2", "vllm", "1c2d3e4f-0000-4000-8000-00000000aa03")
    r = rig(
        {
            "start": "2026-11-20T18:00:00Z",
            "gpus": [{"model": "A100-SXM4-80GB"}],
            "processes": [
                {"pid": 910, "gpus": [0], "sm_util": 60, "uid": 1000, "pod": static},
                {"pid": 911, "gpus": [0], "sm_util": 30, "uid": 1000, "pod": other},
            ],
        },
        settings=Settings(node_name="rig", pricing={"gpu_hourly": 3.6}),
    )
    state = r.run(3600.0, 60.0)
    named = Workload(namespace="kube-system", pod="llm-node1", container="llm")
    serving = Workload(namespace="serving", pod="vllm-2", container="vllm")
    dollars = dollars_by_workload(state)
    # $3.60/GPU-hour for 1h split by utilization 60:30: 60/90 x $3.60 = $2.40 and 30/90 x $3.60
    # = $1.20 (the static pod's was under pod "uid-4f9a...").
    assert dollars == pytest.approx({named: 2.4, serving: 1.2})
    assert_conserved(state, dollars, 1 * 1 * 3.6)


def test_the_environment_allowlist_keeps_secrets_out(tmp_path: Path) -> None:
    environ = b"SLURM_JOB_ID=77\0HF_TOKEN=hf_secret\0AWS_SECRET_ACCESS_KEY=abc\0PATH=/bin\0"
    write_proc(tmp_path, 42, "python (x)", 12345, "0::/user.slice/user-1000.slice/session-1.scope\n", environ)
    procfs = ProcFS(tmp_path, env_allowlist={"SLURM_JOB_ID"})
    facts = procfs.facts(procfs.identity(42))
    assert facts.identity.start_ticks == 12345  # a ')' in the command name does not shift fields
    assert facts.uid == 1000
    assert facts.cmdline == ("python", "train.py")
    assert facts.env == (("SLURM_JOB_ID", "77"),)
    assert "hf_secret" not in repr(facts)


class _NoPtrace(ProcFS):
    """procfs as an agent without CAP_SYS_PTRACE sees it: other users' environ is denied."""

    def _read(self, pid: int, name: str) -> bytes:
        if name == "environ":
            raise ProcessUnreadable(f"pid {pid}: permission denied")
        return super()._read(pid, name)


def test_without_privilege_environments_are_skipped_quietly(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_proc(tmp_path, 43, "python", 500, "0::/system.slice/slurmstepd.scope/job_5/step_0/user/task_0\n")
    caplog.set_level(logging.INFO, logger="agent.attribution.sources.procfs")
    procfs = _NoPtrace(tmp_path, env_allowlist={"SLURM_JOB_ID"})
    for _ in range(3):
        facts = procfs.facts(procfs.identity(43))
    assert facts.env == ()
    assert facts.cgroup.endswith("task_0\n")
    assert len([r for r in caplog.records if "cannot read process environments" in r.getMessage()]) == 1


CANARY = "canary-7f3a9c1e-never-leaves-the-process"


def test_a_secret_in_a_process_environment_appears_nowhere(tmp_path: Path) -> None:
    import os
    import signal
    import socket
    import subprocess
    import sys
    import urllib.request

    scenario = tmp_path / "canary.yaml"
    scenario.write_text(
        "gpus: [{count: 2}]\n"
        "processes:\n"
        "  - {pid: 300, gpus: [0], sm_util: 50, memory_mib: 1000, uid: 1000, user: ann,\n"
        "     cmdline: 'python serve.py --model tiny-llm',\n"
        f"     environ: {{HF_TOKEN: {CANARY}, SLURM_JOB_ID: '4242', MODEL_TEAM: {CANARY}}}}}\n"
    )
    config = tmp_path / "config.yaml"
    config.write_text(
        "attribution:\n  per_pid_series: true\n  rules:\n    - {match: {env.MODEL_TEAM: '^nomatch$'}, set: {team: x}}\n"
    )
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "GPULEDGER_POLL_INTERVAL": "0.2s"}

    sim = gpuledger(
        "--debug", "simulate", str(scenario), "--for", "10m", "--config", str(config),
        "--metrics-out", str(out_dir / "metrics.prom"), env=env, timeout=120,
    )  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    snap = gpuledger(
        "--debug", "snapshot", "--fake", str(scenario), "--json", "--config", str(config), env=env, timeout=120
    )
    assert snap.returncode == 0, snap.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_file = out_dir / "daemon.log"
    with log_file.open("w") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "agent", "--debug", "run", "--fake", str(scenario), "--config", str(config),
             "--listen", f"127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT, cwd=repo, env=env,
        )  # fmt: skip
        try:
            scraped = ""
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and 'hpc_job="4242"' not in scraped:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                        scraped = response.read().decode()
                except OSError:
                    time.sleep(0.1)
        finally:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=15)
    assert 'hpc_job="4242"' in scraped  # the allowlisted key did its job
    assert 'model="tiny-llm"' in scraped
    written = [p.read_text(errors="replace") for p in out_dir.rglob("*") if p.is_file()]
    for name, text in [("metrics", scraped), ("simulate output", sim.stdout + sim.stderr),
                       ("snapshot output", snap.stdout + snap.stderr), *(("file", t) for t in written)]:  # fmt: skip
        assert CANARY not in text, f"the canary leaked into the {name}"
    assert "HF_TOKEN" not in scraped


@pytest.mark.parametrize("scenario", ["demo", "mig"])
def test_the_one_pass_indexes_agree_with_the_per_device_lookups(rig: Any, scenario: str) -> None:
    """`Attribution.by_device` and `Snapshot.migs_by_parent`, which accounting and the rules use,
    give per device what `for_device` and `mig_devices` give one device at a time."""
    r = rig(scenario)
    r.poll()
    state = r.poll(60)
    snapshot, attribution = state.snapshot, state.attribution
    assert snapshot is not None
    assert attribution.holdings
    held = attribution.by_device()
    assert held == {d.uuid: attribution.for_device(d.uuid) for d in snapshot.devices if attribution.for_device(d.uuid)}
    migs = snapshot.migs_by_parent()
    assert migs == {g.uuid: snapshot.mig_devices(g.uuid) for g in snapshot.gpus if snapshot.mig_devices(g.uuid)}
    assert bool(migs) == (scenario == "mig")

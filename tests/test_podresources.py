"""The kubelet pod-resources client against the fake kubelet's real gRPC server on a unix socket."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.attribution.sources.kubelet import KubeletUnavailable, PodDeviceAllocation, PodResourcesClient
from agent.attribution.sources.podresources import api_pb2
from fake_nvml.podresources import AllocationRow, FakePodResourcesServer, pod_resources

GPU0 = "GPU-5d2c6a1e-0000-4000-8000-000000000000"
GPU1 = "GPU-5d2c6a1e-0000-4000-8000-000000000001"
GPU2 = "GPU-5d2c6a1e-0000-4000-8000-000000000002"
MIG_A = "MIG-0b6c2f4e-1111-5000-9000-00000000000a"
MIG_B = "MIG-0b6c2f4e-1111-5000-9000-00000000000b"

BUSY_NODE: list[AllocationRow] = [
    ("research", "notebook-7", "jupyter", "nvidia.com/gpu", [GPU0, GPU1]),
    ("research", "notebook-7", "jupyter", "example.com/fpga", ["fpga-0"]),
    ("research", "notebook-7", "sidecar", "nvidia.com/mig-3g.40gb", [MIG_A]),
    ("serving", "vllm-llama-0", "vllm", "nvidia.com/mig-3g.40gb", [MIG_B]),
    ("serving", "vllm-llama-0", "vllm", "intel.com/sriov_netdevice", ["0000:3b:02.1"]),
    ("serving", "vllm-llama-0", "vllm", "nvidia.com/gpu", [GPU2]),
]


class Node:
    """What the fake kubelet serves; tests change `rows` while it runs."""

    def __init__(self, rows: list[AllocationRow]) -> None:
        self.rows = rows

    def allocations(self) -> list[AllocationRow]:
        return list(self.rows)


@pytest.fixture
def socket_path(tmp_path: Path) -> str:
    # A unix socket path must fit in sun_path (108 bytes on Linux): keep the file name short.
    return str(tmp_path / "kubelet.sock")


@pytest.fixture
def node() -> Node:
    return Node(list(BUSY_NODE))


@pytest.fixture
def kubelet(node: Node, socket_path: str) -> Iterator[FakePodResourcesServer]:
    server = FakePodResourcesServer(node.allocations, socket_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(socket_path: str) -> Iterator[PodResourcesClient]:
    with PodResourcesClient(socket_path, timeout_s=2.0) as c:
        yield c


def fake_kubelet_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("fake-kubelet")]


def test_busy_node_lists_every_nvidia_device_per_container(
    kubelet: FakePodResourcesServer, client: PodResourcesClient
) -> None:
    assert client.list_gpu_allocations() == [
        PodDeviceAllocation("research", "notebook-7", "jupyter", "nvidia.com/gpu", GPU0),
        PodDeviceAllocation("research", "notebook-7", "jupyter", "nvidia.com/gpu", GPU1),
        PodDeviceAllocation("research", "notebook-7", "sidecar", "nvidia.com/mig-3g.40gb", MIG_A),
        PodDeviceAllocation("serving", "vllm-llama-0", "vllm", "nvidia.com/mig-3g.40gb", MIG_B),
        PodDeviceAllocation("serving", "vllm-llama-0", "vllm", "nvidia.com/gpu", GPU2),
    ]


def test_empty_node_lists_nothing(node: Node, kubelet: FakePodResourcesServer, client: PodResourcesClient) -> None:
    node.rows = []
    assert client.list_gpu_allocations() == []


def test_node_with_only_other_devices_lists_nothing(
    node: Node, kubelet: FakePodResourcesServer, client: PodResourcesClient
) -> None:
    node.rows = [("net", "router-0", "router", "intel.com/sriov_netdevice", ["0000:3b:02.1"])]
    assert client.list_gpu_allocations() == []


def test_allocations_follow_the_node_between_calls(
    node: Node, kubelet: FakePodResourcesServer, client: PodResourcesClient
) -> None:
    assert len(client.list_gpu_allocations()) == 5
    node.rows = [("batch", "train-0", "main", "nvidia.com/gpu", [GPU1])]
    assert client.list_gpu_allocations() == [PodDeviceAllocation("batch", "train-0", "main", "nvidia.com/gpu", GPU1)]


def test_missing_socket_names_the_path(socket_path: str, client: PodResourcesClient) -> None:
    with pytest.raises(KubeletUnavailable, match="no such socket") as caught:
        client.list_gpu_allocations()
    assert socket_path in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_regular_file_is_not_a_socket(socket_path: str, client: PodResourcesClient) -> None:
    Path(socket_path).write_text("")
    with pytest.raises(KubeletUnavailable, match="not a unix socket"):
        client.list_gpu_allocations()


def test_socket_nobody_listens_on_is_unavailable(socket_path: str, client: PodResourcesClient) -> None:
    # What a kubelet killed with SIGKILL leaves behind: the socket file, no listener.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(socket_path)
    with pytest.raises(KubeletUnavailable, match="UNAVAILABLE") as caught:
        client.list_gpu_allocations()
    assert socket_path in str(caught.value)
    assert "\n" not in str(caught.value)
    assert caught.value.__cause__ is not None  # the gRPC error, chained


def test_kubelet_restart_mid_run(node: Node, socket_path: str, client: PodResourcesClient) -> None:
    first = FakePodResourcesServer(node.allocations, socket_path)
    first.start()
    try:
        assert len(client.list_gpu_allocations()) == 5
    finally:
        first.stop()
    assert not Path(socket_path).exists()
    with pytest.raises(KubeletUnavailable, match=socket_path):
        client.list_gpu_allocations()

    node.rows = [("batch", "train-0", "main", "nvidia.com/gpu", [GPU0])]
    with FakePodResourcesServer(node.allocations, socket_path):
        # The same client reconnects at once: no reconnect backoff carried over from the old socket.
        assert client.list_gpu_allocations() == [
            PodDeviceAllocation("batch", "train-0", "main", "nvidia.com/gpu", GPU0)
        ]
    assert fake_kubelet_threads() == []


def test_kubelet_that_never_answers_times_out(kubelet: FakePodResourcesServer, socket_path: str) -> None:
    with PodResourcesClient(socket_path, timeout_s=0.3) as client:
        kubelet.hang(True)
        started = time.monotonic()
        with pytest.raises(KubeletUnavailable, match=r"no answer within 0\.3s") as caught:
            client.list_gpu_allocations()
        elapsed = time.monotonic() - started
        assert 0.2 < elapsed < 5.0
        assert socket_path in str(caught.value)

        kubelet.hang(False)
        assert len(client.list_gpu_allocations()) == 5


def test_stopping_a_hanging_kubelet_releases_its_callers(kubelet: FakePodResourcesServer, socket_path: str) -> None:
    kubelet.hang(True)
    outcome: list[BaseException | None] = []

    def call() -> None:
        with PodResourcesClient(socket_path, timeout_s=60.0) as client:
            try:
                client.list_gpu_allocations()
                outcome.append(None)
            except KubeletUnavailable as exc:
                outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.2)  # let the call reach the server
    started = time.monotonic()
    kubelet.stop()
    assert time.monotonic() - started < 5.0
    caller.join(timeout=5.0)
    assert not caller.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], KubeletUnavailable)
    assert fake_kubelet_threads() == []


def test_client_can_be_closed_and_used_again(kubelet: FakePodResourcesServer, socket_path: str) -> None:
    client = PodResourcesClient(socket_path)
    try:
        assert len(client.list_gpu_allocations()) == 5
        client.close()
        client.close()
        assert len(client.list_gpu_allocations()) == 5
    finally:
        client.close()


def test_fake_groups_rows_into_pods_containers_and_resources() -> None:
    pods = pod_resources(
        [
            ("ns", "p", "a", "nvidia.com/gpu", [GPU0]),
            ("ns", "q", "a", "nvidia.com/gpu", [GPU2]),
            ("ns", "p", "b", "nvidia.com/gpu", [GPU1]),
            ("ns", "p", "a", "nvidia.com/gpu", [MIG_A]),
            ("other", "p", "a", "nvidia.com/gpu", [MIG_B]),
        ]
    )
    assert [(p.namespace, p.name, [c.name for c in p.containers]) for p in pods] == [
        ("ns", "p", ["a", "b"]),
        ("ns", "q", ["a"]),
        ("other", "p", ["a"]),
    ]
    first = pods[0].containers[0]
    assert [(d.resource_name, list(d.device_ids)) for d in first.devices] == [("nvidia.com/gpu", [GPU0, MIG_A])]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2), encoded by hand."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def test_wire_format_is_the_kubelets() -> None:
    # Field numbers from k8s.io/kubelet/pkg/apis/podresources/v1/api.proto, encoded without the
    # generated code: ListPodResourcesResponse.pod_resources=1; PodResources name=1,
    # namespace=2, containers=3; ContainerResources name=1, devices=2;
    # ContainerDevices resource_name=1, device_ids=2.
    devices = _field(1, b"nvidia.com/gpu") + _field(2, GPU0.encode()) + _field(2, MIG_A.encode())
    container = _field(1, b"vllm") + _field(2, devices)
    pod = _field(1, b"vllm-llama-0") + _field(2, b"serving") + _field(3, container)
    decoded = api_pb2.ListPodResourcesResponse.FromString(_field(1, pod))

    (pod_msg,) = decoded.pod_resources
    assert (pod_msg.namespace, pod_msg.name) == ("serving", "vllm-llama-0")
    (container_msg,) = pod_msg.containers
    assert container_msg.name == "vllm"
    (devices_msg,) = container_msg.devices
    assert devices_msg.resource_name == "nvidia.com/gpu"
    assert list(devices_msg.device_ids) == [GPU0, MIG_A]
    assert api_pb2.DESCRIPTOR.package == "v1"
    assert api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"].full_name == "v1.PodResourcesLister"


def test_relative_socket_path(kubelet: FakePodResourcesServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with PodResourcesClient("kubelet.sock") as client:
        assert len(client.list_gpu_allocations()) == 5

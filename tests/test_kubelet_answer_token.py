"""A kubelet in the agent's own process (the fake node's) says when its answer changes, and the
kubelet source asks it again only then; a real kubelet, which cannot, is asked every time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.attribution.facts import PodAllocation
from agent.attribution.sources.kubelet import KubeletSource, PodDeviceAllocation
from fake_nvml.podresources import AllocationRow, FakePodResourcesServer

GPU0 = "GPU-5d2c6a1e-0000-4000-8000-000000000000"
GPU1 = "GPU-5d2c6a1e-0000-4000-8000-000000000001"
NOTEBOOK: AllocationRow = ("research", "notebook-7", "jupyter", "nvidia.com/gpu", [GPU0])
SERVING: AllocationRow = ("serving", "vllm-0", "vllm", "nvidia.com/gpu", [GPU1])


class Node:
    """What the fake kubelet serves; tests change `rows` while it runs."""

    def __init__(self) -> None:
        self.rows: list[AllocationRow] = [NOTEBOOK]

    def allocations(self) -> list[AllocationRow]:
        return list(self.rows)


@pytest.fixture
def node() -> Node:
    return Node()


@pytest.fixture
def kubelet(node: Node, tmp_path: Path) -> Iterator[FakePodResourcesServer]:
    server = FakePodResourcesServer(node.allocations, str(tmp_path / "kubelet.sock"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def counted(source: KubeletSource) -> list[int]:
    """How many List calls `source` makes from now on (one entry per call)."""
    calls: list[int] = []
    client = source._client
    listing: Callable[[], list[PodDeviceAllocation]] = client.list_gpu_allocations

    def list_gpu_allocations() -> list[PodDeviceAllocation]:
        calls.append(1)
        return listing()

    client.list_gpu_allocations = list_gpu_allocations  # type: ignore[method-assign]
    return calls


def test_an_unchanged_answer_is_kept_and_a_changed_one_fetched(node: Node, kubelet: FakePodResourcesServer) -> None:
    source = KubeletSource(kubelet.socket_path, answer_token=kubelet.answer_token)
    calls = counted(source)
    for _ in range(3):
        source.refresh()
    assert len(calls) == 1
    assert source.up is True
    assert source.allocations() == (PodAllocation("research", "notebook-7", "jupyter", GPU0),)
    node.rows = [NOTEBOOK, SERVING]
    source.refresh()
    source.refresh()
    assert len(calls) == 2
    assert source.allocations() == (
        PodAllocation("research", "notebook-7", "jupyter", GPU0),
        PodAllocation("serving", "vllm-0", "vllm", GPU1),
    )
    source.close()


def test_a_kubelet_that_stops_or_hangs_is_asked(node: Node, kubelet: FakePodResourcesServer) -> None:
    source = KubeletSource(kubelet.socket_path, timeout_s=0.3, answer_token=kubelet.answer_token)
    calls = counted(source)
    source.refresh()
    kubelet.hang(True)
    source.refresh()  # asked, and it never answers
    assert (len(calls), source.up) == (2, False)
    kubelet.hang(False)
    source.refresh()
    assert (len(calls), source.up) == (3, True)
    kubelet.stop()
    source.refresh()
    assert (len(calls), source.up) == (4, False)
    source.refresh()  # still down: asked again, as the kubelet may be back
    assert (len(calls), source.up) == (5, False)
    kubelet.start()  # the same rows as before it stopped: asked all the same, it was down
    source.refresh()
    source.refresh()
    assert (len(calls), source.up) == (6, True)
    assert source.allocations() == (PodAllocation("research", "notebook-7", "jupyter", GPU0),)
    source.close()


def test_a_removed_socket_changes_the_token(kubelet: FakePodResourcesServer) -> None:
    before = kubelet.answer_token()
    Path(kubelet.socket_path).unlink()
    assert kubelet.answer_token() != before


def test_without_a_token_the_kubelet_is_asked_every_time(kubelet: FakePodResourcesServer) -> None:
    source = KubeletSource(kubelet.socket_path)
    calls = counted(source)
    for _ in range(3):
        source.refresh()
    assert len(calls) == 3
    assert source.up is True
    source.close()

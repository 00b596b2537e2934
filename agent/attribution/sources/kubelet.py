"""The one module that speaks gRPC to the kubelet: its pod-resources v1 API on a unix socket.

The kubelet answers ``List`` with every pod's containers and the device-plugin devices each was
handed. The NVIDIA device plugin reports its devices by UUID ("GPU-..." for a whole GPU,
"MIG-..." for a MIG instance), which is how an allocation is tied to a GPU. Everything above
this module sees `PodDeviceAllocation` rows and `KubeletUnavailable`, never a grpc or protobuf
type. `KubeletSource` is the attribution source built on the client: the allocations, refreshed
on their own schedule and cached, never fetched on a poll.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

# gRPC's C core logs connection events (a kubelet restarting sends GOAWAY) straight to stderr
# at INFO; the agent reports the kubelet's state itself, once per change.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc

from agent.attribution.facts import HostFacts, PodAllocation
from agent.attribution.sources.base import AttributionSource, Refresher, SourceOptions
from agent.attribution.sources.podresources import api_pb2, api_pb2_grpc
from agent.errors import GpuledgerError
from agent.model import Snapshot

log = logging.getLogger(__name__)

NVIDIA_RESOURCE_PREFIX = "nvidia.com/"

# The kubelet's pod-resources server sends up to 16 MiB (podresources.DefaultMaxMsgSize), more
# than gRPC's default 4 MiB receive limit; a node with many pods would otherwise fail to list.
_MAX_RECEIVE_BYTES = 16 * 1024 * 1024
_CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", _MAX_RECEIVE_BYTES),
    # Channels to the same target share subchannels through a process-wide pool, so a channel
    # re-created after the kubelet restarted could inherit the old subchannel's reconnect backoff
    # and fail at once with UNAVAILABLE. A pool per channel makes re-creating it a fresh start.
    ("grpc.use_local_subchannel_pool", 1),
]


class KubeletUnavailable(GpuledgerError):
    """The kubelet's pod-resources API cannot be read: the socket is missing or refuses
    connections, the call timed out, or the kubelet answered with a gRPC error."""

    def __init__(self, socket_path: str, reason: str) -> None:
        self.socket_path = socket_path
        self.reason = reason
        super().__init__(f"kubelet pod-resources socket {socket_path}: {reason}")


@dataclass(frozen=True, slots=True)
class PodDeviceAllocation:
    """One device that the kubelet has allocated to one container."""

    namespace: str
    pod: str
    container: str
    resource_name: str  # e.g. nvidia.com/gpu, nvidia.com/mig-3g.40gb
    device_id: str  # as the device plugin reports it: a GPU UUID ("GPU-...") or MIG UUID ("MIG-...")


class PodResourcesClient:
    """A client of the kubelet's pod-resources API at ``socket_path``.

    The channel is opened on first use and dropped after any failure, so the next call
    reconnects from scratch (the kubelet restarts, and recreates its socket, on every upgrade).
    Thread-safe; `close` releases the channel and the client may still be used afterwards.
    """

    def __init__(self, socket_path: str, timeout_s: float = 2.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: api_pb2_grpc.PodResourcesListerStub | None = None

    def list_gpu_allocations(self) -> list[PodDeviceAllocation]:
        """Every NVIDIA device (resource ``nvidia.com/...``) allocated to a container, one row per
        device id, in the kubelet's order. Raises `KubeletUnavailable`."""
        response = self._list()
        return [
            PodDeviceAllocation(
                namespace=pod.namespace,
                pod=pod.name,
                container=container.name,
                resource_name=devices.resource_name,
                device_id=device_id,
            )
            for pod in response.pod_resources
            for container in pod.containers
            for devices in container.devices
            if devices.resource_name.startswith(NVIDIA_RESOURCE_PREFIX)
            for device_id in devices.device_ids
        ]

    def close(self) -> None:
        with self._lock:
            self._drop_channel()

    def __enter__(self) -> PodResourcesClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _list(self) -> api_pb2.ListPodResourcesResponse:
        with self._lock:
            self._check_socket()
            try:
                if self._channel is None or self._stub is None:
                    # "unix://" takes an absolute path only; "unix:" would take a relative one.
                    target = "unix://" + os.path.abspath(self.socket_path)
                    self._channel = grpc.insecure_channel(target, options=_CHANNEL_OPTIONS)
                    self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
                response: api_pb2.ListPodResourcesResponse = self._stub.List(
                    api_pb2.ListPodResourcesRequest(), timeout=self.timeout_s
                )
            except grpc.RpcError as exc:
                self._drop_channel()
                raise KubeletUnavailable(self.socket_path, _describe_rpc_error(exc, self.timeout_s)) from exc
            except (OSError, ValueError) as exc:
                self._drop_channel()
                raise KubeletUnavailable(self.socket_path, _one_line(str(exc) or type(exc).__name__)) from exc
            return response

    def _check_socket(self) -> None:
        """gRPC would only say "failed to connect to all addresses": name the actual problem."""
        try:
            mode = os.stat(self.socket_path).st_mode
        except FileNotFoundError as exc:
            self._drop_channel()
            raise KubeletUnavailable(self.socket_path, "no such socket (is the kubelet running?)") from exc
        except OSError as exc:
            self._drop_channel()
            raise KubeletUnavailable(self.socket_path, _one_line(exc.strerror or str(exc))) from exc
        if not stat.S_ISSOCK(mode):
            self._drop_channel()
            raise KubeletUnavailable(self.socket_path, "not a unix socket")

    def _drop_channel(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            channel.close()


def _describe_rpc_error(exc: grpc.RpcError, timeout_s: float) -> str:
    # Errors raised by a call are also grpc.Call objects; anything else has only its text.
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else None
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer within {timeout_s:g}s"
    name = code.name if code is not None else type(exc).__name__
    return _one_line(f"{name}: {details}" if details else name)


def _one_line(text: str) -> str:
    return " ".join(text.split())


_NO_TOKEN = object()  # no answer token: the kubelet is asked every time


class KubeletSource(AttributionSource):
    """The kubelet's GPU allocations, fetched by its refresher (on a schedule) and cached; each
    poll reads the cache.

    A node without the socket is a node without Kubernetes: quiet, and no health series.
    Once the socket has been seen, losing it is an outage: logged once per change of state.

    An outage does not make the allocations nobody's. The kubelet restarts on every upgrade,
    and a GPU handed to a notebook that runs nothing on it is held all the same: the last
    allocations it gave stand for `stale_after_s` (of the polls' clock) after its last answer.
    Past that, or when it has never answered, the allocations are unknown: each poll says so
    (`HostFacts.allocations_known`), and a GPU no process holds is then booked as unobserved
    (attribution_unavailable), not idle. A pod that ended during the outage is billed for at
    most `stale_after_s` more.

    `answer_token` is for a kubelet in this process (`SourceOptions.kubelet_answer_token`): while
    the token it gives equals the one taken just before the last answer, that answer is what
    asking again would bring, so it is kept and the call is not made. A fake node's kubelet
    changes its allocations a few times a day of scenario time, and `simulate` refreshes them
    every 10 scenario seconds: a gRPC round trip each would cost more than the rest of a poll.
    """

    def __init__(
        self,
        socket_path: str,
        timeout_s: float = 2.0,
        interval_s: float = 10.0,
        stale_after_s: float = 300.0,
        answer_token: Callable[[], object] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self._client = PodResourcesClient(socket_path, timeout_s=timeout_s)
        self._lock = threading.Lock()
        self._allocations: tuple[PodAllocation, ...] = ()
        self._up: bool | None = None
        self._seen_socket = False
        self._answered_at: float | None = None  # the last poll that found a fresh answer (poll clock)
        self._stale = False  # the last allocations are past standing in for the kubelet
        self._answer_token = answer_token
        self._answered_token: object = _NO_TOKEN  # the token taken before the last answer

    @classmethod
    def from_options(cls, options: SourceOptions) -> KubeletSource:
        return cls(
            options.podresources_socket or "",
            options.kubelet_timeout_s,
            options.kubelet_interval_s,
            options.kubelet_stale_after_s,
            options.kubelet_answer_token,
        )

    @property
    def up(self) -> bool | None:
        return self._up

    def allocations(self) -> tuple[PodAllocation, ...]:
        return self._allocations

    def gather(self, snapshot: Snapshot, found: HostFacts) -> HostFacts:
        up = self._up
        if up is None:
            return found  # no kubelet on this node (or not asked yet)
        allocations = self._allocations
        now = snapshot.taken_at
        if up:
            self._answered_at = now
            self._stale = False
        elif self._answered_at is None or now - self._answered_at > self.stale_after_s:
            if not self._stale:
                log.warning(
                    "kubelet pod-resources silent %s: its allocations are not known, so GPUs no process holds "
                    "are booked as unobserved, not idle, until it answers",
                    "since the start" if self._answered_at is None else f"for over {self.stale_after_s:g}s",
                )
            self._stale = True
        return replace(
            found,
            pod_allocations=(*found.pod_allocations, *(() if self._stale else allocations)),
            kubelet_up=up,
            allocations_known=found.allocations_known and not self._stale,
        )

    def refreshers(self) -> Iterable[Refresher]:
        return (Refresher("kubelet", self.interval_s, self.refresh),)

    def refresh(self) -> None:
        if not self.socket_path or (not self._seen_socket and not os.path.exists(self.socket_path)):
            return
        self._seen_socket = True
        # Taken before the call: a change while the call is under way then shows next time.
        token = self._answer_token() if self._answer_token is not None else _NO_TOKEN
        if token is not _NO_TOKEN and self._up and token == self._answered_token:
            return  # the same answer as last time, says the kubelet in this process
        self._answered_token = _NO_TOKEN
        try:
            rows = self._client.list_gpu_allocations()
        except KubeletUnavailable as exc:
            if self._up is not False:
                log.warning(
                    "kubelet pod-resources unavailable (%s): its last allocations stand for up to %gs",
                    exc,
                    self.stale_after_s,
                )
            self._up = False
            return
        allocations = tuple(PodAllocation(r.namespace, r.pod, r.container, r.device_id, r.resource_name) for r in rows)
        with self._lock:
            self._allocations = allocations
        if self._up is not True:
            log.info("kubelet pod-resources answering at %s", self.socket_path)
        self._up = True
        self._answered_token = token

    def close(self) -> None:
        self._client.close()

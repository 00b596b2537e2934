"""A fake kubelet: the pod-resources v1 API served by a real gRPC server on a unix socket.

The agent's production client (`agent.attribution.sources.kubelet.PodResourcesClient`) talks to it exactly as it
talks to ``/var/lib/kubelet/pod-resources/kubelet.sock``: same service, same messages, same
transport. The allocations come from a callable, so they follow the scenario clock.

    server = FakePodResourcesServer(lambda: [("serving", "vllm-0", "vllm", "nvidia.com/gpu", ["GPU-..."])],
                                    "/tmp/node/kubelet.sock")
    server.start()
    ...
    server.stop()          # the socket file is gone afterwards, as when the kubelet stops
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

# gRPC's C core logs connection events straight to stderr at INFO; keep the fake as quiet as
# the agent's client (agent/attribution/sources/kubelet.py sets the same).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc

from agent.attribution.sources.podresources import api_pb2, api_pb2_grpc

# (namespace, pod, container, resource_name, device_ids)
AllocationRow = tuple[str, str, str, str, list[str]]

_WORKERS = 4
_SUN_PATH_BYTES = 108  # sockaddr_un.sun_path on Linux, with its terminating NUL


class FakePodResourcesServer:
    """Serves ``allocations()`` as the kubelet's ``PodResourcesLister`` on ``socket_path``.

    `start` and `stop` may alternate any number of times (a kubelet restart); `hang(True)`
    makes ``List`` and ``Get`` answer nothing until the caller's deadline, `hang(False)` or `stop`.
    """

    def __init__(self, allocations: Callable[[], list[AllocationRow]], socket_path: str) -> None:
        self.socket_path = socket_path
        self._allocations = allocations
        self._cond = threading.Condition()
        self._hanging = False
        self._stopping = False
        self._server: grpc.Server | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._cached: tuple[list[AllocationRow], api_pb2.ListPodResourcesResponse] | None = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        """Listen on the socket. A stale socket file left by a killed server is replaced."""
        with self._cond:
            if self._server is not None:
                raise RuntimeError(f"fake kubelet already serving on {self.socket_path}")
            self._stopping = False
        if len(os.fsencode(self.socket_path)) >= _SUN_PATH_BYTES:
            # grpc only says "Failed to bind"; the kernel's limit on a socket path is the reason.
            raise RuntimeError(
                f"fake kubelet socket path is longer than {_SUN_PATH_BYTES - 1} bytes: {self.socket_path}"
            )
        os.makedirs(os.path.dirname(os.path.abspath(self.socket_path)), exist_ok=True)
        executor = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="fake-kubelet")
        server = grpc.server(executor)
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), server)
        try:
            # grpc unlinks a stale unix socket before binding, but not a regular file.
            server.add_insecure_port("unix:" + self.socket_path)
            server.start()
        except RuntimeError as exc:
            server.stop(None).wait()
            executor.shutdown(wait=True)
            raise RuntimeError(f"fake kubelet cannot listen on {self.socket_path}: {exc}") from exc
        with self._cond:
            self._server, self._executor = server, executor

    def stop(self) -> None:
        """Stop serving: in-flight calls are cancelled (hanging ones released), every worker thread
        has ended and the socket file is gone when this returns. Stopping twice is harmless."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            server, executor = self._server, self._executor
            self._server = self._executor = None
        if server is None or executor is None:
            return
        server.stop(None).wait()
        # grpc.server does not own the executor it was given: without this its threads outlive it.
        executor.shutdown(wait=True)
        # grpc removes the socket on shutdown; make sure, since "no socket" is what clients test for.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    def hang(self, hanging: bool) -> None:
        """While True, calls are accepted but never answered (the client's deadline expires)."""
        with self._cond:
            self._hanging = hanging
            self._cond.notify_all()

    def __enter__(self) -> FakePodResourcesServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def answer_token(self) -> object:
        """What the answer to ``List`` depends on now: serving or not, hanging or not, the
        socket file there or not, and the allocations. Two equal tokens mean the same answer,
        which a client in the same process may keep rather than ask again (the agent's kubelet
        source, through `SourceOptions.kubelet_answer_token`)."""
        with self._cond:
            serving, hanging = self._server is not None and not self._stopping, self._hanging
        return serving, hanging, os.path.exists(self.socket_path), self._allocations()

    def _wait_while_hanging(self, context: grpc.ServicerContext) -> bool:
        """Block while hanging. True: answer the call; False: it ended meanwhile (deadline or
        cancel), so nobody reads the answer. A call caught by `stop` fails with UNAVAILABLE, as
        one does when the kubelet goes down: an empty answer would read as "nothing allocated"."""

        def wake() -> None:
            with self._cond:
                self._cond.notify_all()

        with self._cond:
            hanging = self._hanging
        if hanging and context.add_callback(wake):  # False: the call has already terminated
            with self._cond:
                self._cond.wait_for(lambda: not self._hanging or self._stopping or not context.is_active())
        with self._cond:
            stopping = self._stopping
        if stopping:
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake kubelet is stopping")
        return bool(context.is_active())

    def _list_response(self) -> api_pb2.ListPodResourcesResponse:
        """The answer to List now. The allocations change far less often than the agent asks
        (it refreshes every few seconds), so the answer built for the same rows is reused."""
        rows = self._allocations()
        with self._cond:
            cached = self._cached
        if cached is not None and cached[0] == rows:
            return cached[1]
        response = api_pb2.ListPodResourcesResponse(pod_resources=pod_resources(rows))
        with self._cond:
            self._cached = (rows, response)
        return response


def pod_resources(rows: Iterable[AllocationRow]) -> list[api_pb2.PodResources]:
    """Group rows as the kubelet does: one PodResources per pod, one ContainerResources per
    container, one ContainerDevices per resource name; first-seen order throughout."""
    pods: dict[tuple[str, str], dict[str, dict[str, list[str]]]] = {}
    for namespace, pod, container, resource_name, device_ids in rows:
        devices = pods.setdefault((namespace, pod), {}).setdefault(container, {})
        devices.setdefault(resource_name, []).extend(device_ids)
    return [
        api_pb2.PodResources(
            name=pod,
            namespace=namespace,
            containers=[
                api_pb2.ContainerResources(
                    name=container,
                    devices=[
                        api_pb2.ContainerDevices(resource_name=resource_name, device_ids=device_ids)
                        for resource_name, device_ids in resources.items()
                    ],
                )
                for container, resources in containers.items()
            ],
        )
        for (namespace, pod), containers in pods.items()
    ]


class _Servicer(api_pb2_grpc.PodResourcesListerServicer):
    """``List`` and ``Get``. ``GetAllocatableResources`` stays UNIMPLEMENTED: the fake knows
    what is allocated, not every device a device plugin advertises."""

    def __init__(self, fake: FakePodResourcesServer) -> None:
        self._fake = fake

    def List(
        self, request: api_pb2.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.ListPodResourcesResponse:
        if not self._fake._wait_while_hanging(context):
            return api_pb2.ListPodResourcesResponse()  # the call is over; nobody reads this
        return self._fake._list_response()

    def Get(
        self, request: api_pb2.GetPodResourcesRequest, context: grpc.ServicerContext
    ) -> api_pb2.GetPodResourcesResponse:
        if not self._fake._wait_while_hanging(context):
            return api_pb2.GetPodResourcesResponse()
        for pod in self._fake._list_response().pod_resources:
            if pod.name == request.pod_name and pod.namespace == request.pod_namespace:
                return api_pb2.GetPodResourcesResponse(pod_resources=pod)
        # The kubelet answers an unknown pod with a plain Go error, which gRPC sends as UNKNOWN.
        context.set_code(grpc.StatusCode.UNKNOWN)
        context.set_details(f"pod {request.pod_name} in namespace {request.pod_namespace} not found")
        return api_pb2.GetPodResourcesResponse()

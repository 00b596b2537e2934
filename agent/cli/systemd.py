"""systemd's notify protocol (sd_notify(3)): READY=1 once serving, WATCHDOG=1 while healthy,
STOPPING=1 on the way out. Under `Type=notify` with `WatchdogSec=`, systemd restarts an agent
that stops reporting healthy, as the kubelet's liveness probe on /healthz does in a pod.

A dozen lines over a datagram socket rather than a dependency: the protocol is one
`KEY=VALUE` datagram to the socket named in $NOTIFY_SOCKET, and the libraries that wrap it
(systemd-python) need libsystemd headers to build.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(state: str) -> bool:
    """Send `state` to the service manager; False (and nothing sent) outside systemd."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # an abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # Never waiting: a manager that stops reading fills its queue, and a blocking send
            # would then hold the agent for good (STOPPING=1 on the way out included). A state
            # that cannot be delivered now is dropped, as a lost datagram would be.
            sock.sendto(state.encode(), socket.MSG_DONTWAIT, address)
    except OSError as exc:
        log.warning("cannot notify systemd at %s: %s", address, exc.strerror or exc)
        return False
    return True


def watchdog_interval_s() -> float | None:
    """How often to send WATCHDOG=1: half systemd's WatchdogSec, or None when it set none."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6 / 2

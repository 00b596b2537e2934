"""Exit codes and the argument checks more than one command shares."""

from __future__ import annotations

from agent.errors import BadInputError
from agent.units import parse_duration

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2


def duration_arg(value: str, option: str) -> float:
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise BadInputError(f"gpuledger: {option}: {exc}") from None


def parse_listen(value: str, option: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise BadInputError(f"gpuledger: {option}: expected HOST:PORT such as 0.0.0.0:9835, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)

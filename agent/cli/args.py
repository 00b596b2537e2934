"""Exit codes and the argument checks more than one command shares."""

from __future__ import annotations

import math

from agent.config import parse_listen as parse_listen_value
from agent.errors import BadInputError
from agent.ledger.report import parse_time
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
    try:
        return parse_listen_value(value)
    except ValueError as exc:
        raise BadInputError(f"gpuledger: {option}: {exc}") from None


def positive_finite(value: float, option: str) -> float:
    """A rate or factor such as --fake-speed: argparse's float() takes "nan" and "inf" too."""
    if not math.isfinite(value) or value <= 0:
        raise BadInputError(f"gpuledger: {option}: must be a finite number above 0, got {value:g}")
    return value


def time_arg(text: str | None, option: str, now: float) -> float | None:
    """--since / --until as unix seconds (None where not given); bad input names the option, an
    empty value too (`--since "$START"` with START unset must not mean "from the beginning")."""
    if text is None:
        return None
    try:
        return parse_time(text, now)
    except ValueError as exc:
        raise BadInputError(f"gpuledger: {option}: {exc}") from None

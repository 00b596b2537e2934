"""Durations and sizes as people write them in configs and scenarios ("90s", "1h30m", "1GiB"),
and the kilowatt-hours energy is priced in."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_DURATION_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
# Bounds that no real setting reaches: past them a value is a typo or a fuzzer, and taking it
# would overflow datetime arithmetic or hang a loop that steps through it.
MAX_DURATION_S = 100 * 365.25 * 86400  # 100 years
MAX_SIZE_BYTES = 2**60  # 1 EiB

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_FACTOR = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_duration(value: object) -> float:
    """Seconds from a number (taken as seconds) or a string such as "90s", "15m", "1h30m", "2d".

    Raises ValueError with the offending text; callers add where it came from.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s or 2h, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"duration must not be negative, got {value!r}")
        # float() of an int past 1e308 raises OverflowError: anything past the bound is refused first.
        return _bounded_duration(float(value) if value <= MAX_DURATION_S else math.inf, value)
    if not isinstance(value, str):
        raise ValueError(f"expected a duration like 30s or 2h, got {value!r}")
    text = value.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return _bounded_duration(float(text), value)
    pos = 0
    total = 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_SECONDS[match.group(2)]
        pos = match.end()
    if pos == 0 or pos != len(text):
        raise ValueError(f"expected a duration like 30s or 2h, got {value!r}")
    return _bounded_duration(total, value)


def _bounded_duration(seconds: float, value: object) -> float:
    if not math.isfinite(seconds) or seconds > MAX_DURATION_S:
        raise ValueError(f"duration must be finite and at most 100 years, got {_short(value)}")
    return seconds


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def parse_size_bytes(value: object) -> int:
    """Bytes from a number (taken as bytes) or a string such as "1GiB", "512MiB", "2GB"."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size like 1GiB, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {_short(value)}")
        size = float(value) if value <= MAX_SIZE_BYTES else math.inf
    elif isinstance(value, str) and (match := _SIZE.match(value)):
        unit = (match.group(2) or "b").lower()
        size = float(match.group(1)) * _SIZE_FACTOR[unit]
    else:
        raise ValueError(f"expected a size like 1GiB or 512MiB, got {_short(value)}")
    if not size <= MAX_SIZE_BYTES:  # also catches inf and nan
        raise ValueError(f"size must be at most 1EiB, got {_short(value)}")
    return int(size)


JOULES_PER_KWH = 3.6e6  # 1 kWh = 1000 W x 3600 s


def joules_to_kwh(joules: float) -> float:
    return joules / JOULES_PER_KWH


def add_known(a: float | None, b: float | None) -> float | None:
    """a + b, where None is a figure nothing measured (energy without a counter): a sum counts
    the measured parts and stays None while nothing was measured, never 0."""
    if a is None:
        return b
    return a if b is None else a + b


def scaled(value: float | None, factor: float) -> float | None:
    """value x factor; None (not measured) stays None."""
    return None if value is None else value * factor


def format_duration(seconds: float) -> str:
    """The shortest exact-ish human form: 90 -> "1m30s", 7200 -> "2h"."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    remaining = round(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, remaining = divmod(remaining, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts) or "0s"


def iso_time(t: float) -> str:
    """`t` (unix seconds) as 2026-11-27T18:00:00Z."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")

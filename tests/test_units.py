from __future__ import annotations

import pytest

from agent.units import format_duration, parse_duration, parse_size_bytes


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("15m", 900), ("36h", 129600), ("2d", 172800), ("1h30m", 5400), ("250ms", 0.25), (45, 45), ("7", 7)],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "5x", "1h 30m", "-5s", -1, True, None, "h"])
def test_bad_durations_say_what_they_got(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(("text", "size"), [("1GiB", 2**30), ("512MiB", 2**29), ("2GB", 2 * 10**9), (1024, 1024)])
def test_sizes(text: object, size: int) -> None:
    assert parse_size_bytes(text) == size


@pytest.mark.parametrize("text", ["big", "1 GiB x", -1, 1.5])
def test_bad_sizes(text: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size_bytes(text)


def test_format_duration_round_trips() -> None:
    for seconds in (1, 59, 90, 3600, 5400, 86400 + 7):
        assert parse_duration(format_duration(seconds)) == seconds

"""Fixed-bucket histograms for right-sizing's percentiles: cheap, bounded and mergeable. Pure.

A sketch maps a bucket index to the unit-seconds spent in that bucket. Buckets are fixed, so
two sketches (two hours, two nodes) merge by adding counts, and a workload-hour holds at most
`BUSY_BUCKETS` + `MEMORY_BUCKETS` numbers however often it was polled.

Precision: a percentile is reported as the upper edge of the bucket it falls in, so it is never
below the true value and at most one bucket above it:

- busy (0-1): 21 buckets, 0 exactly, then (0, 5%], (5%, 10%], ... (95%, 100%]: at most 5
  percentage points high.
- memory: bucket 0 is up to 256 MiB, then eight buckets per doubling up to 1 TiB (each edge
  2^(1/8) = 1.0905 times the one before): at most 9.05% high; capped by the exact peak.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping

Sketch = dict[int, float]

BUSY_STEP = 0.05
BUSY_BUCKETS = 21
MEMORY_BASE_BYTES = 256 * 2**20
MEMORY_PER_DOUBLING = 8
MEMORY_BUCKETS = 12 * MEMORY_PER_DOUBLING + 1  # up to 256 MiB x 2^12 = 1 TiB


# The ledger buckets every holding's busy and memory reading at every poll, and a steady
# workload's readings repeat: remembered, a bucket is one lookup in C instead of a log, a round
# and a ceil. Bounded, for readings that never repeat.
@functools.lru_cache(maxsize=4096)
def busy_bucket(busy: float) -> int:
    """The bucket of a busy fraction: 0 for exactly 0, else ceil(busy / 5%), at most 20."""
    # Rounded first so that 0.15 (0.15 / 0.05 = 2.9999999999999996) falls in (10%, 15%].
    return min(max(math.ceil(round(busy / BUSY_STEP, 9)), 0), BUSY_BUCKETS - 1)


def busy_edge(bucket: int) -> float:
    """The upper edge of a busy bucket."""
    return bucket * BUSY_STEP


@functools.lru_cache(maxsize=4096)  # see busy_bucket
def memory_bucket(memory_bytes: float) -> int:
    if memory_bytes <= MEMORY_BASE_BYTES:
        return 0
    index = math.ceil(round(MEMORY_PER_DOUBLING * math.log2(memory_bytes / MEMORY_BASE_BYTES), 9))
    return min(index, MEMORY_BUCKETS - 1)


def memory_edge(bucket: int) -> float:
    """The upper edge of a memory bucket, in bytes."""
    return float(MEMORY_BASE_BYTES * 2.0 ** (bucket / MEMORY_PER_DOUBLING))


def add(sketch: Sketch, bucket: int, seconds: float) -> None:
    sketch[bucket] = sketch.get(bucket, 0.0) + seconds


def merge(into: Sketch, other: Mapping[int, float]) -> None:
    for bucket, seconds in other.items():
        add(into, bucket, seconds)


def quantile_bucket(sketch: Mapping[int, float], q: float) -> int | None:
    """The bucket holding the q-quantile (0-1) of the time; None for an empty sketch."""
    total = math.fsum(sketch.values())
    if total <= 0:
        return None
    wanted = q * total
    seen = 0.0
    for bucket in sorted(sketch):
        seen += sketch[bucket]
        if seen >= wanted - 1e-9 * total:
            return bucket
    return max(sketch)


# json.dumps with separators makes an encoder at each call; this one is made once.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


# The sketches this process encoded lately, by their text, as `decode` gives them back: a flush
# merges each sizing row's new sketch (encoded just before) into the stored one (encoded by the
# flush before), so that decoding both is a lookup. Bounded.
_ENCODED: dict[str, Sketch] = {}
_ENCODED_LIMIT = 4096


def encode(sketch: Mapping[int, float]) -> str:
    """As stored in the ledger: a JSON object, bucket -> unit-seconds, buckets in order."""
    kept = {k: sketch[k] for k in sorted(sketch) if sketch[k]}
    text = _format(kept)
    if text is None:
        text = _ENCODER.encode({str(k): v for k, v in kept.items()})
    if len(_ENCODED) >= _ENCODED_LIMIT:
        _ENCODED.clear()
    # What json.loads of the text would give: int keys (str(k) read back), float values (a
    # float's repr reads back as the same float).
    _ENCODED[text] = {int(k): float(v) for k, v in kept.items()}
    return text


def _format(sketch: Mapping[int, float]) -> str | None:
    """What the JSON encoder writes for a sketch of int buckets and finite floats, written
    directly (a flush encodes two per sizing row, and the encoder's machinery costs more than
    the text): its float is repr's, and a bucket's digits need no escaping. None for anything
    else (an int or a float subclass's value, an infinity, a NaN): the encoder writes those."""
    parts = []
    for bucket, seconds in sketch.items():
        if type(bucket) is not int or type(seconds) is not float or not math.isfinite(seconds):
            return None
        parts.append(f'"{bucket}":{seconds!r}')
    return "{" + ",".join(parts) + "}"


def decode(text: str | None) -> Sketch:
    if not text:
        return {}
    known = _ENCODED.get(text)
    if known is not None:
        return dict(known)  # a copy: callers add to it
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"not a sketch: {text[:40]!r}")
    return {int(k): float(v) for k, v in raw.items()}


def merge_encoded(a: str | None, b: str | None) -> str:
    """Two stored sketches added (SQLite calls this to merge a flush into a stored row)."""
    merged = decode(a)
    for bucket, seconds in decode(b).items():  # merge(merged, ...), inline: this runs per row and flush
        merged[bucket] = merged.get(bucket, 0.0) + seconds
    return encode(merged)

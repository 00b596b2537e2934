"""`gpuledger export`: the ledger's hourly rows as CSV or Parquet, for a warehouse.

The schema is stable (README lists it): columns are only ever added at the end, never renamed,
reordered or given another meaning. Every row names its node and nothing names the file it came
from, so the exports of many nodes concatenate into one table without clashes; a row is unique
by (hour, node, uuid, kind, the workload labels, the left_by labels, account).

    hour                 start of the UTC hour (CSV: 2026-11-20T18:00:00Z; Parquet: timestamp[ms, UTC])
    node                 the node the ledger records
    gpu                  GPU index (a MIG instance: its GPU's)
    uuid                 the GPU's UUID, or the MIG instance's
    kind                 workload | idle (held by nobody) | unobserved (seen by nobody)
    namespace pod container hpc_job unit user model team
                         the workload's labels; empty on idle and unobserved rows
    left_by_namespace ... left_by_team
                         on an idle row, the labels of the workload that held the GPU last
                         (empty where nobody is known to); empty (Parquet: null) on the others
    dollars              cost in the hour
    gpu_hours_charged    the row's share of the GPU's time (rows of a GPU-hour add up to 1 per GPU)
    gpu_hours_held       time held (a shared GPU counts once per holder)
    gpu_hours_used       held time x measured utilization; empty (null) where unobserved, and
                         where none of the row's time had a busy figure (gpu_hours_unmeasured)
    energy_kwh           the row's share of the GPU's energy counter (an unobserved row's: what
                         the counter counted that no holder could be charged); empty (null) on
                         an unobserved row without any (the counter was not read either) and
                         where no counter measured it (a GPU without one)
    energy_dollars       energy_kwh at pricing.energy_per_kwh; empty (null) where none was set
    gpu_hours_unmeasured the part of gpu_hours_charged whose use nothing measured (a MIG instance
                         without GPM): neither used nor idle; 0 on idle and unobserved rows
    account              the Slurm account a job's row is billed to (`report --by account`); empty
                         on the others, and where none was known (a job whose account became known
                         within an hour has a row of each)

A CSV text cell that starts with `=`, `+`, `-`, `@`, a tab or a carriage return (a label users
named so) starts with a `'`, as in `report --format csv`, so that a spreadsheet never runs it as a
formula; Parquet holds it as it is.

Like `report`, export opens ledgers read-only and refuses two files that record one node over
overlapping periods (they would count that time twice).
"""

from __future__ import annotations

import csv
import importlib
import io
import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from agent.errors import BadInputError
from agent.ledger.files import is_sqlite_file
from agent.ledger.pending import HOUR_S
from agent.ledger.read import UsageRow, read_ledger
from agent.ledger.report import check_overlaps, csv_text, measured_seconds
from agent.model import WORKLOAD_LABELS, Workload
from agent.units import iso_time, joules_to_kwh

FORMATS = ("csv", "parquet")
LEFT_BY_COLUMNS = tuple(f"left_by_{name}" for name in WORKLOAD_LABELS)
NUMBER_COLUMNS = (
    "dollars", "gpu_hours_charged", "gpu_hours_held", "gpu_hours_used", "energy_kwh", "energy_dollars",
    "gpu_hours_unmeasured",
)  # fmt: skip
COLUMNS = ("hour", "node", "gpu", "uuid", "kind", *WORKLOAD_LABELS, *LEFT_BY_COLUMNS, *NUMBER_COLUMNS, "account")

Record = dict[str, Any]
_LABELS = (*WORKLOAD_LABELS, *LEFT_BY_COLUMNS, "account")


def records(rows: Iterable[UsageRow]) -> list[Record]:
    """One record per ledger row, with the columns of COLUMNS (None: unknown), sorted by hour,
    node, GPU, kind and labels (a warehouse loads by time range; a diff of two exports reads)."""
    out = [_record(row) for row in rows]
    out.sort(key=lambda r: (r["hour"], r["node"], r["gpu"], r["uuid"], r["kind"], *(r[c] or "" for c in _LABELS)))
    return out


def _record(row: UsageRow) -> Record:
    kind = "unobserved" if row.unobserved else "idle" if row.idle else "workload"
    # Empty labels on an idle row: nobody is known to have held the GPU (or the ledger is older
    # than left_by); no labels (null) on the other kinds, which nobody left.
    left: Workload | None = row.left_by if row.idle else None
    return {
        "hour": row.hour,
        "node": row.node,
        "gpu": row.gpu,
        "uuid": row.uuid,
        "kind": kind,
        **row.workload.label_dict(),
        **dict(zip(LEFT_BY_COLUMNS, _left_by_values(left), strict=True)),
        "dollars": row.dollars,
        "gpu_hours_charged": row.charged_s / HOUR_S,
        "gpu_hours_held": row.held_s / HOUR_S,
        "gpu_hours_used": None if row.unobserved or not _use_measured(row) else row.busy_s / HOUR_S,
        "energy_kwh": None if row.joules is None or (row.unobserved and not row.joules) else joules_to_kwh(row.joules),
        "energy_dollars": row.energy_dollars,
        "gpu_hours_unmeasured": row.unmeasured_s / HOUR_S,
        "account": row.account,
    }


def _use_measured(row: UsageRow) -> bool:
    """Whether any of the row's use was measured (or nothing was charged to it)."""
    return not row.charged_s > 0 or measured_seconds(row.charged_s, row.unmeasured_s) > 0


def _left_by_values(left: Workload | None) -> tuple[str | None, ...]:
    return left.labels() if left is not None else (None,) * len(LEFT_BY_COLUMNS)


def read_records(
    paths: Sequence[str | Path], *, since: float | None = None, until: float | None = None
) -> list[Record]:
    """The records of every ledger's hours overlapping [since, until). LedgerError for a file
    that cannot be read; ValueError for two files that record one node over overlapping periods."""
    if since is not None and until is not None and since >= until:
        raise ValueError(f"--since ({iso_time(since)}) must be before --until ({iso_time(until)})")
    contents = [read_ledger(path, since=since, until=until) for path in paths]
    check_overlaps([c.info for c in contents])
    return records(row for c in contents for row in c.rows)


def write_csv(rows: Sequence[Record], out: IO[str]) -> None:
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    for record in rows:
        writer.writerow([_csv_cell(column, record[column]) for column in COLUMNS])


def _csv_cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if column == "hour":
        return iso_time(value)
    if isinstance(value, str):
        return csv_text(value)
    if isinstance(value, float):
        return repr(value)  # the shortest text that reads back as the same float
    return str(value)


def parquet_schema() -> Any:
    """The Parquet schema (pyarrow), column for column as COLUMNS."""
    pa = _pyarrow()
    text = [pa.field(name, pa.string(), nullable=False) for name in ("node", "uuid", "kind", *WORKLOAD_LABELS)]
    fields = {f.name: f for f in text}
    return pa.schema(
        [
            # Parquet has no seconds unit: milliseconds (pyarrow would coerce to them anyway).
            pa.field("hour", pa.timestamp("ms", tz="UTC"), nullable=False),
            fields["node"],
            pa.field("gpu", pa.int32(), nullable=False),
            fields["uuid"],
            fields["kind"],
            *(fields[name] for name in WORKLOAD_LABELS),
            *(pa.field(name, pa.string()) for name in LEFT_BY_COLUMNS),
            pa.field("dollars", pa.float64(), nullable=False),
            pa.field("gpu_hours_charged", pa.float64(), nullable=False),
            pa.field("gpu_hours_held", pa.float64(), nullable=False),
            pa.field("gpu_hours_used", pa.float64()),
            pa.field("energy_kwh", pa.float64()),
            pa.field("energy_dollars", pa.float64()),
            pa.field("gpu_hours_unmeasured", pa.float64(), nullable=False),
            pa.field("account", pa.string(), nullable=False),
        ]
    )


def write_parquet(rows: Sequence[Record], out: IO[bytes]) -> None:
    stamped = [r | {"hour": datetime.fromtimestamp(r["hour"], UTC)} for r in rows]
    table = _pyarrow().Table.from_pylist(stamped, schema=parquet_schema())
    _pyarrow("pyarrow.parquet").write_table(table, out)


def _pyarrow(module: str = "pyarrow") -> Any:
    """pyarrow, the optional extra `gpuledger[parquet]` (imported only when Parquet is asked for)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise BadInputError(
            "gpuledger: export --format parquet needs pyarrow: pip install 'gpuledger[parquet]', or use --format csv"
        ) from None


def write(rows: Sequence[Record], fmt: str, path: str) -> None:
    """Write `rows` in `fmt` to `path` ("-": standard output), a file whole or not at all: a
    temporary file beside it, renamed over it once complete."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    if path == "-":
        if fmt == "csv":
            write_csv(rows, sys.stdout)
            return
        raise BadInputError("gpuledger: export: Parquet is binary: give --out FILE")
    target = Path(path)
    with replacing(target) as handle:
        if fmt == "csv":
            text = io.TextIOWrapper(handle, encoding="utf-8", newline="")
            write_csv(rows, text)
            text.flush()
            text.detach()  # the binary file stays open for replacing to close
        else:
            write_parquet(rows, handle)


@contextmanager
def replacing(target: Path, option: str = "--out") -> Iterator[IO[bytes]]:
    """A temporary file beside `target`, synced and renamed over it when the block succeeds and
    removed when it fails, so that a reader sees the old file or the new one, never half of either
    (nor, after a power cut, an empty file where the old one was).

    A symlink is written through (its target is replaced; the link stays). Anything else that
    is not a regular file is refused (BadInputError, naming `option`) before anything is
    written: renaming over a device, a FIFO or a socket would destroy it (`--out /dev/full`
    once replaced the device with a file), and its reader would never see the output. So is an
    SQLite database: a ledger, which no output may replace."""
    real = Path(os.path.realpath(target))
    if real.exists() and not real.is_file():
        kind = "a directory" if real.is_dir() else "not a regular file"
        raise BadInputError(f"gpuledger: {option}: {target} is {kind}: name a file to write")
    if is_sqlite_file(real):
        # No output is a database: this is a ledger (`--out ledger.db` for `--out ledger.csv`),
        # and replacing it would lose every charge it records for their report.
        raise BadInputError(f"gpuledger: {option}: {target} is an SQLite database (a ledger?): name another file")
    # The file keeps the mode of the one it replaces (a report kept private stays private);
    # a new one gets what the umask leaves of rw-rw-rw-, as any file the user creates.
    mode = stat.S_IMODE(real.stat().st_mode) if real.exists() else 0o666 & ~_umask()
    try:
        fd, name = tempfile.mkstemp(prefix=f".{real.name}.", dir=real.parent)
    except OSError as exc:
        raise BadInputError(f"gpuledger: {option}: {target}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())  # the data on disk before the rename names it
        os.chmod(name, mode)
        os.replace(name, real)
    except BaseException:
        with suppress(OSError):
            os.unlink(name)
        raise


def _umask() -> int:
    """The process's umask, read from /proc (os.umask can only read it by changing it, for every
    thread at once); 0o022, the usual one, where /proc does not say."""
    with suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022

"""Reading a ledger, for `report`: never writes. The file is opened `mode=ro`, and where even that
needs to create the WAL's shared-memory file in a directory the reader may not write,
`immutable=1` (see `fallback_uri`). An older schema is migrated in a copy in memory.
"""

from __future__ import annotations

import logging
import math
import sqlite3
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.ledger.files import (
    SQLITE_CANTOPEN,
    SQLITE_READONLY_DIRECTORY,
    LedgerError,
    NotALedger,
    errorcode,
    migrate,
    stored_version,
    unusable,
)
from agent.ledger.pending import hour_start
from agent.ledger.schema import SCHEMA_VERSION
from agent.model import Workload

log = logging.getLogger("gpuledger.ledger")


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One stored hour: a workload on one cost unit, (`idle`) the part of a GPU nobody held, or
    (`unobserved`) the part of a GPU nobody could see.

    `held_s` counts a shared unit once per holder; `charged_s` is the workload's share of it, so
    the charged seconds of every row of a GPU-hour add up to the hour. For an idle row both are
    the GPU's idle seconds, `dollars`, `joules` and `energy_dollars` its idle cost and energy,
    `busy_s` 0, the workload empty and `left_by` the workload that left the GPU idle (empty
    where nobody is known to have held it); an unobserved row likewise carries the unobserved
    seconds and dollars, and the energy the GPU's counter counted that no other row of the hour
    carries (0 where the counter could not be read either). `energy_dollars` is None where no
    price per kWh was set (and for hours written before the ledger stored it).

    `account` is the Slurm account of a job's row ('' otherwise, and in rows written before
    schema version 5); `dollars_per_hour`, `purchase` and `price_source` are the price the row was
    charged at, the GPU's latest in the hour (None where it was not recorded).
    """

    hour: int
    node: str
    gpu: int
    uuid: str
    workload: Workload
    held_s: float
    busy_s: float
    dollars: float
    joules: float | None  # None where no energy counter measured it (schema version 9 on)
    energy_dollars: float | None = None
    idle: bool = False
    charged_s: float = 0.0
    unobserved: bool = False
    left_by: Workload = field(default_factory=Workload)  # an idle row's: who left the GPU idle
    account: str = ""
    dollars_per_hour: float | None = None
    purchase: str | None = None
    price_source: str | None = None
    # The part of charged_s whose use nothing measured (schema version 8; 0 before it): busy_s
    # covers the rest. Idle and unobserved rows have none (idle time is known unused).
    unmeasured_s: float = 0.0


@dataclass(frozen=True, slots=True)
class LedgerInfo:
    """What a ledger file records about itself (`ledger_meta`), and the nodes its rows name.

    `first_at` / `last_at` bound the period it records: the earliest start and the latest end
    of the charges written to it (None while it records nothing). A file written before
    schema version 3 is known only by its hours: its period starts at its first hour and ends
    where the charges of its last hour end, read from their seconds.
    """

    path: Path
    ledger_id: str
    node: str  # the node it belongs to; '' until an agent that knew its node opened or wrote it
    created_at: float
    created_by: str  # "gpuledger <version>"; '' for a file an earlier release created
    first_at: float | None
    last_at: float | None
    nodes: frozenset[str] = frozenset()  # every node its rows name (one, unless a node was renamed)

    @property
    def recorded(self) -> bool:
        """Whether it holds any charges."""
        return self.first_at is not None


@dataclass(frozen=True, slots=True)
class LedgerContents:
    info: LedgerInfo
    rows: list[UsageRow]


# --- reading (report) ----------------------------------------------------------------------------


def reader_uri(path: Path, *, immutable: bool = False) -> str:
    """The URI a reader opens `path` with: read-only, and `immutable=1` where asked (SQLite then
    takes no locks and creates no -shm file, and does not read the WAL)."""
    uri = f"{path.resolve().as_uri()}?mode=ro"
    return f"{uri}&immutable=1" if immutable else uri


def fallback_uri(path: Path, errorcode: int, wal_bytes: int) -> str | None:
    """The URI to read `path` with after `mode=ro` failed with SQLite's `errorcode`, or None where
    there is no safe other way.

    A WAL ledger read `mode=ro` still needs its -shm file, which SQLite creates beside it when
    absent: in a directory the reader may not write (the agent's, once the agent has stopped and
    removed it) that fails, SQLITE_READONLY_DIRECTORY or SQLITE_CANTOPEN. `immutable=1` reads the
    file without it, but also without the WAL: safe only while the WAL holds nothing
    (`wal_bytes` 0), which is how a cleanly stopped agent leaves it.
    """
    if errorcode != SQLITE_READONLY_DIRECTORY and errorcode & 0xFF != SQLITE_CANTOPEN:
        return None
    if wal_bytes > 0:
        return None
    return reader_uri(path, immutable=True)


def _connect_reader(uri: str) -> sqlite3.Connection:
    conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    try:
        conn.execute("SELECT count(*) FROM sqlite_schema").fetchone()  # SQLite opens lazily: fail here
    except BaseException:
        conn.close()
        raise
    return conn


def open_read_only(path: str | Path) -> sqlite3.Connection:
    """A connection that cannot write `path`: `mode=ro`, else `immutable=1` where `fallback_uri`
    allows. LedgerError (naming the file) where neither opens it."""
    path = Path(path)
    try:
        return _connect_reader(reader_uri(path))
    except sqlite3.Error as exc:
        wal = Path(f"{path}-wal")
        try:
            wal_bytes = wal.stat().st_size
        except OSError:
            wal_bytes = 0
        uri = fallback_uri(path, errorcode(exc), wal_bytes)
        if uri is None:
            if wal_bytes:
                raise LedgerError(
                    f"ledger {path}: cannot open read-only ({exc}) and {wal} holds charges not yet in the file: "
                    "read it as the user the agent runs as"
                ) from exc
            raise LedgerError(f"ledger {path}: cannot open: {exc}") from exc
        log.debug("ledger %s: %s read-only; reading it immutable", path, exc)
        try:
            return _connect_reader(uri)
        except sqlite3.Error as again:
            raise LedgerError(f"ledger {path}: cannot open: {again}") from again


def _bounds(since: float | None, until: float | None) -> tuple[str, list[int | float]]:
    """WHERE clause for the hours that overlap [since, until)."""
    clauses = []
    params: list[int | float] = []
    if since is not None:
        clauses.append("hour >= ?")
        params.append(hour_start(since))
    if until is not None:
        clauses.append("hour < ?")
        params.append(until)
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


def read_ledger(
    path: str | Path, *, since: float | None = None, until: float | None = None, rows: bool = True
) -> LedgerContents:
    """The ledger's own record (`LedgerInfo`) and every stored hour that overlaps [since, until):
    workload rows, then one idle row per GPU hour with idle time and workload that left it idle,
    then one unobserved row per GPU
    hour with unobserved time; no rows unless `rows`.
    Hours are the ledger's resolution, so a partly covered hour is read whole.

    Opens the file read-only (`open_read_only`; a missing file is an error, never created) and
    reads in one transaction, so a flush committing meanwhile is seen wholly or not at all. A
    file at an earlier schema version is copied into memory and migrated there: reading never
    writes, and the agent migrates the file itself the next time it opens it.
    """
    path = Path(path)
    where, params = _bounds(since, until)
    with current_schema(path) as conn:
        return _read(conn, path, where, params, rows)


@contextmanager
def current_schema(path: Path) -> Iterator[sqlite3.Connection]:
    """A connection that reads the ledger at `path` at the current schema: the file itself,
    read-only, or where it is at an earlier version a copy migrated in memory. LedgerError
    (naming the file) where it is missing, empty or unreadable, also for sqlite3 errors raised
    while the caller reads."""
    if not path.exists():
        raise LedgerError(f"ledger {path}: no such file")
    why = unusable(path)
    if why is not None:
        raise NotALedger(f"ledger {path}: {why}")
    try:
        with closing(open_read_only(path)) as conn:
            version = stored_version(conn, path)
            if version == 0:
                raise NotALedger(f"ledger {path}: empty, not a gpuledger ledger")
            if version < SCHEMA_VERSION:
                with closing(_migrated_copy(conn, path)) as copy:
                    yield copy
            else:
                yield conn
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot read: {exc}") from exc


def read_usage(path: str | Path, *, since: float | None = None, until: float | None = None) -> list[UsageRow]:
    """The rows of `read_ledger`."""
    return read_ledger(path, since=since, until=until).rows


def read_info(path: str | Path) -> LedgerInfo:
    """The record `read_ledger` gives, without the rows."""
    return read_ledger(path, rows=False).info


def recorded_period(path: str | Path) -> tuple[float, float] | None:
    """The period a ledger file records (`LedgerInfo.first_at`, `last_at`); None where it records
    nothing: no file, an empty one, a SQLite file with no tables yet, a ledger with no charges.
    LedgerError for a file that is not a ledger; NotALedger, before anything opens it, for a
    directory or what is not a regular file (SQLite would wait on a FIFO for ever)."""
    path = Path(path)
    if not path.exists() or (path.is_file() and path.stat().st_size == 0):
        return None
    if not path.is_file():
        raise NotALedger(f"ledger {path}: {unusable(path)}")
    try:
        with closing(open_read_only(path)) as conn:
            if stored_version(conn, path) == 0:
                return None
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot read: {exc}") from exc
    info = read_info(path)
    return (info.first_at, info.last_at) if info.first_at is not None and info.last_at is not None else None


def _migrated_copy(conn: sqlite3.Connection, path: Path) -> sqlite3.Connection:
    copy = sqlite3.connect(":memory:", isolation_level=None)
    try:
        conn.backup(copy)
        copy.execute("BEGIN")
        migrate(copy, stored_version(copy, path))  # the copy's own version: the agent may have migrated since
        copy.execute("COMMIT")
    except BaseException:
        copy.close()
        raise
    return copy


def _read(
    conn: sqlite3.Connection, path: Path, where: str, params: Sequence[int | float], rows: bool
) -> LedgerContents:
    conn.row_factory = sqlite3.Row
    conn.execute("BEGIN")
    meta = conn.execute("SELECT * FROM ledger_meta").fetchone()
    nodes = frozenset(node for (node,) in conn.execute("SELECT DISTINCT node FROM gpu_hours"))
    workload = conn.execute(f"SELECT * FROM workload_hours{where} ORDER BY hour", params).fetchall() if rows else []
    gpu = conn.execute(f"SELECT * FROM gpu_hours{where} ORDER BY hour", params).fetchall() if rows else []
    idle = conn.execute(f"SELECT * FROM idle_hours{where} ORDER BY hour", params).fetchall() if rows else []
    conn.execute("COMMIT")
    if meta is None:
        raise NotALedger(f"ledger {path}: not a gpuledger ledger (no ledger_meta row)")
    info = LedgerInfo(
        path=path,
        ledger_id=meta["ledger_id"],
        node=meta["node"],
        created_at=meta["created_at"],
        created_by=meta["created_by"],
        first_at=meta["first_at"],
        last_at=meta["last_at"],
        nodes=nodes,
    )
    usage = [
        UsageRow(
            hour=r["hour"],
            node=r["node"],
            gpu=r["gpu"],
            uuid=r["uuid"],
            workload=Workload.from_labels(r),
            held_s=r["held_s"],
            busy_s=r["busy_s"],
            dollars=r["dollars"],
            joules=r["joules"],
            energy_dollars=r["energy_dollars"],
            charged_s=r["charged_s"],
            unmeasured_s=r["unmeasured_s"],
            account=r["account"],
            dollars_per_hour=r["dollars_per_hour"],
            purchase=r["purchase"],
            price_source=r["price_source"],
        )
        for r in workload
    ]
    # A GPU-hour's idle time by who left it idle (idle_hours); its rows add up to the GPU-hour's
    # idle figures in gpu_hours.
    # The price an idle row was charged at is its GPU-hour's.
    prices = {
        (r["hour"], r["node"], r["uuid"]): {
            "dollars_per_hour": r["dollars_per_hour"],
            "purchase": r["purchase"],
            "price_source": r["price_source"],
        }
        for r in gpu
    }
    usage.extend(
        _unowned_row(
            r,
            r["idle_s"],
            r["idle_dollars"],
            joules=r["idle_joules"],
            energy_dollars=r["idle_energy_dollars"],
            idle=True,
            left_by=Workload.from_labels(r),
            **prices.get((r["hour"], r["node"], r["uuid"]), {}),
        )
        for r in idle
        if r["idle_s"] or r["idle_dollars"] or r["idle_joules"]
    )
    # A GPU-hour's unobserved energy: what its counter counted that no workload or idle row
    # carries (the energy of units whose holders could not be known, and of a gap in the counter
    # beyond the interval after it). Derived, so every ledger ever written has it. A row belongs
    # to the GPU-hour of its uuid, else (a MIG instance's) to its GPU's by index, the first uuid
    # where two GPUs had that index within the hour (one swapped for another across a reboot,
    # GPUs renumbered after one fell off the bus): by index alone, each GPU's energy was set
    # against the other's rows, and what neither carried was lost from TOTAL's.
    at_index: dict[tuple[int, str, int], str] = {}
    for r in gpu:
        index = (r["hour"], r["node"], r["gpu"])
        at_index[index] = min(at_index.get(index, r["uuid"]), r["uuid"])
    gpu_uuids = {(r["hour"], r["node"], r["uuid"]) for r in gpu}
    carried: dict[tuple[int, str, str], list[float]] = {}
    for row in usage:
        own = (row.hour, row.node, row.uuid)
        uuid = row.uuid if own in gpu_uuids else at_index.get((row.hour, row.node, row.gpu), row.uuid)
        carried.setdefault((row.hour, row.node, uuid), []).append(row.joules or 0.0)
    for r in gpu:
        unseen = _unobserved_joules(r["joules"], carried.get((r["hour"], r["node"], r["uuid"]), []))
        if not (r["unobserved_s"] or r["unobserved_dollars"] or unseen):
            continue
        # Priced at the hour's rate: its energy dollars over its joules.
        priced = r["energy_dollars"]
        usage.append(
            _unowned_row(
                r,
                r["unobserved_s"],
                r["unobserved_dollars"],
                joules=unseen,
                energy_dollars=priced * unseen / r["joules"] if priced is not None and unseen else None,
                unobserved=True,
                dollars_per_hour=r["dollars_per_hour"],
                purchase=r["purchase"],
                price_source=r["price_source"],
            )
        )
    return LedgerContents(info, usage)


def _unobserved_joules(gpu_joules: float | None, carried: list[float]) -> float:
    """The GPU-hour's joules less those its rows carry; 0 where that is rounding (a part in a
    billion of the hour's energy: the rows are its shares, summed in another order) or where no
    counter measured any (NULL)."""
    if gpu_joules is None:
        return 0.0
    rest = gpu_joules - math.fsum(carried)
    return rest if rest > gpu_joules * 1e-9 else 0.0


def _unowned_row(r: sqlite3.Row, seconds: float, dollars: float, **figures: Any) -> UsageRow:
    """A GPU-hour's time nobody held (idle or unobserved): all of it charged, none of it busy."""
    return UsageRow(
        hour=r["hour"],
        node=r["node"],
        gpu=r["gpu"],
        uuid=r["uuid"],
        workload=Workload(),
        held_s=seconds,
        busy_s=0.0,
        dollars=dollars,
        charged_s=seconds,
        **figures,
    )

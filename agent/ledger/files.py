"""Opening a ledger file for writing: schema migration, the integrity check, what happens to a
corrupt file, and the lock that keeps a ledger to one writing agent. A file whose pages are corrupt
(`PRAGMA quick_check` at open, or a flush that meets a corrupt page) is renamed
`<name>.corrupt-<UTC time>` with its WAL, and a fresh ledger started in its place; nothing is
deleted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import time
from datetime import UTC, datetime
from pathlib import Path

from agent import __version__
from agent.errors import GpuledgerError
from agent.ledger.schema import MIGRATIONS, SCHEMA_VERSION

log = logging.getLogger("gpuledger.ledger")


class LedgerError(GpuledgerError):
    """The ledger file cannot be opened or read (or is closed); the message names the file."""


class LedgerInUse(LedgerError):
    """Another process writes the ledger (it holds the ledger's `WriterLock`)."""


class NotALedger(LedgerError):
    """The file given as a ledger is not one (not SQLite, another program's database, empty):
    bad input, where the other LedgerErrors (damage, permissions, a newer schema) are failures."""


# --- one writer ---------------------------------------------------------------------------------


class WriterLock:
    """An exclusive `flock` on `<ledger>.lock` beside the ledger, held while one agent writes it.

    Each agent charges every second it polls, so two agents writing one ledger (a second `run`
    started by hand beside the service, `simulate --append` into a running agent's ledger) would
    charge each second twice: TOTAL's GPU-hours past the GPUs x the hours. SQLite's own locks
    cannot say this (both take turns at the file, and `report` must read while one writes).
    The lock file stays when the lock is let go (unlinking it could let two writers lock two
    files); it holds the pid of the last holder, for the refusal's message. The kernel drops the
    lock with the process, however it ends, so a SIGKILLed agent never blocks its restart.
    LedgerInUse where another process holds it; OSError where the file cannot be made.
    """

    def __init__(self, ledger: Path) -> None:
        self.path = ledger.with_name(f"{ledger.name}.lock")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LedgerInUse(
                f"ledger {ledger}: another gpuledger is writing it (pid {holder}, holding {self.path}); "
                "stop that one first, or choose another ledger"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


# --- opening, and corruption ---------------------------------------------------------------------

# SQLite's result codes (sqlite3.h); an extended code keeps its primary code in the low byte.
SQLITE_CANTOPEN = 14
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
SQLITE_READONLY_DIRECTORY = 8 | (6 << 8)
_SQLITE_HEADER = b"SQLite format 3\x00"


class CorruptLedger(Exception):
    """A SQLite file whose pages are damaged (never raised for a file that is not SQLite's)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def errorcode(exc: sqlite3.Error) -> int:
    code: int | None = getattr(exc, "sqlite_errorcode", None)
    return code if code is not None else 0


def is_corruption(exc: sqlite3.Error) -> bool:
    return errorcode(exc) & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)


def unusable(path: Path) -> str | None:
    """Why `path` can never be a ledger, or None: a directory, something that is not a regular
    file (SQLite would wait on a FIFO for a writer that never comes), or a file with content that
    is not SQLite's (a mistyped path). A missing or empty file becomes a new ledger."""
    if not path.exists():
        return None
    if path.is_dir():
        return "is a directory"
    if not path.is_file():
        return "is not a regular file"
    if path.stat().st_size and not is_sqlite_file(path):
        return "is not a ledger (not an SQLite database)"
    return None


def is_sqlite_file(path: Path) -> bool:
    """Whether `path` starts with SQLite's header: only such a file is ever moved aside as corrupt;
    anything else at the ledger's path (a mistyped --ledger README.md) is refused and left alone.
    Nor is such a file ever replaced by an output (`export.replacing`)."""
    try:
        with path.open("rb") as f:
            return f.read(len(_SQLITE_HEADER)) == _SQLITE_HEADER
    except OSError:
        return False


def file_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path`; None where there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def move_aside(path: Path, now: float) -> Path:
    """Rename a corrupt ledger to `<name>.corrupt-<UTC time>`, its WAL and shared memory with it
    (a fresh file at `path` must never replay the old file's WAL); returns the new path."""
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%SZ")
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    try:
        path.rename(aside)
        for suffix in ("-wal", "-shm"):
            companion = Path(f"{path}{suffix}")
            if companion.exists():
                companion.rename(f"{aside}{suffix}")
    except OSError as exc:
        raise LedgerError(f"ledger {path}: corrupt, and cannot be moved aside: {exc.strerror or exc}") from exc
    return aside


def _quick_check(conn: sqlite3.Connection) -> None:
    answer = [str(row) for (row,) in conn.execute("PRAGMA quick_check").fetchall()]
    if answer != ["ok"]:
        # One problem per line (a row may hold several), under a "*** in database main ***" heading.
        problems = [line for row in answer for line in row.splitlines() if line and not line.startswith("***")]
        more = f" and {len(problems) - 1} more problems" if len(problems) > 1 else ""
        raise CorruptLedger(f"quick_check: {problems[0] if problems else 'no answer'}{more}")


def open_file(
    path: Path, busy_timeout_s: float, node: str | None, *, fsync_each_flush: bool = True
) -> sqlite3.Connection:
    """Open or create the ledger for writing: checked with quick_check, WAL, synchronous=FULL
    (NORMAL without `fsync_each_flush`), schema migrated to SCHEMA_VERSION, and the node
    recorded, in one write transaction (so an unwritable file fails here, not at the first
    flush). `CorruptLedger` for damaged pages."""
    if path.exists() and not path.is_file():
        raise LedgerError(f"ledger {path}: {unusable(path)}")
    existing = is_sqlite_file(path)
    try:
        # isolation_level=None: transactions are the explicit BEGIN/COMMIT in this module only.
        conn = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot open: {exc}") from exc
    try:
        if existing:
            _quick_check(conn)
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise LedgerError(f"ledger {path}: the filesystem does not support a WAL journal (got {mode})")
        conn.execute(f"PRAGMA synchronous={'FULL' if fsync_each_flush else 'NORMAL'}")
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Read under the write lock: another process may have migrated meanwhile.
            version = stored_version(conn, path)
            migrate(conn, version)
            if version == 0:
                conn.execute("UPDATE ledger_meta SET created_by = ?", (f"gpuledger {__version__}",))
            if node:
                conn.execute("UPDATE ledger_meta SET node = ? WHERE node = ''", (node,))
            (recorded_node,) = conn.execute("SELECT node FROM ledger_meta").fetchone()
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        if 0 < version < SCHEMA_VERSION:
            log.info("ledger %s: schema migrated from version %d to %d", path, version, SCHEMA_VERSION)
        if node and recorded_node != node:
            log.warning(
                "ledger %s belongs to node %s; this agent is node %s and records its rows under that name",
                path,
                recorded_node,
                node,
            )
    except sqlite3.Error as exc:
        conn.close()
        if existing and is_corruption(exc):
            raise CorruptLedger(str(exc)) from exc
        raise LedgerError(f"ledger {path}: cannot open: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def stored_version(conn: sqlite3.Connection, path: Path) -> int:
    """The file's schema version; 0 for an empty file. LedgerError for anything else."""
    tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")}
    if "schema_version" not in tables:
        if tables:
            raise NotALedger(f"ledger {path}: not a gpuledger ledger (tables {', '.join(sorted(tables))})")
        return 0
    (version,) = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    if version is None:
        raise NotALedger(f"ledger {path}: not a gpuledger ledger (no schema version recorded)")
    if version > SCHEMA_VERSION:
        raise LedgerError(
            f"ledger {path}: schema version {version} is newer than this gpuledger reads "
            f"(versions 1 to {SCHEMA_VERSION}): upgrade gpuledger"
        )
    return int(version)


def migrate(conn: sqlite3.Connection, version: int) -> None:
    """Apply every step after `version`, in order, recording each; the caller holds the transaction."""
    for step_version in range(version + 1, SCHEMA_VERSION + 1):
        MIGRATIONS[step_version - 1](conn)
        conn.execute("INSERT INTO schema_version (version, applied_at) VALUES (?, ?)", (step_version, time.time()))

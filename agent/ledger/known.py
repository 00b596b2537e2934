"""What a ledger remembers of its node's GPUs, for an agent that cannot ask the driver yet.

An agent restarted on a node whose driver is not answering (not loaded after a kernel
upgrade, mid-reinstall) still knows which GPUs the node had from its ledger: their indexes,
uuids and models as last recorded. The sampler names its down GPUs after them, so their time
from the first poll on is booked, as unobserved, to the right uuid at the right price.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from agent.ledger.files import LedgerError, stored_version
from agent.ledger.read import open_read_only
from agent.model import PROVISIONAL_UUID_PREFIX


def recorded_gpus(path: str | Path, node: str | None) -> list[tuple[int, str, str]]:
    """(index, uuid, NVML name) of each GPU of `node` (any node when None) in the ledger's
    latest recorded hour, by index; [] for a missing or empty file. GPUs booked under a
    provisional uuid are left out: the ledger never knew who they were. LedgerError for a file
    that cannot be read as a ledger."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return []
    try:
        with closing(open_read_only(path)) as conn:
            if stored_version(conn, path) == 0:
                return []
            latest = "SELECT gpu, uuid, model FROM gpu_hours WHERE {node}hour = (SELECT max(hour) FROM gpu_hours{of})"
            if node is None:
                rows = conn.execute(latest.format(node="", of="") + " ORDER BY gpu, uuid").fetchall()
            else:
                # A named placeholder with a mapping: Python 3.12.0 to 3.12.3 take `?1` for a named
                # one and warn when a sequence binds it (an error under -W error).
                sql = latest.format(node="node = :node AND ", of=" WHERE node = :node") + " ORDER BY gpu, uuid"
                rows = conn.execute(sql, {"node": node}).fetchall()
    except sqlite3.Error as exc:
        raise LedgerError(f"ledger {path}: cannot read: {exc}") from exc
    found: dict[int, tuple[int, str, str]] = {}
    for gpu, uuid, model in rows:
        if isinstance(gpu, int) and uuid and not str(uuid).startswith(PROVISIONAL_UUID_PREFIX):
            found[gpu] = (gpu, str(uuid), f"NVIDIA {model}" if model else "")
    return [found[index] for index in sorted(found)]

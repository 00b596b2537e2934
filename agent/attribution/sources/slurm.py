"""Slurm's GPU mapping directory, as a prolog writes it and an epilog removes it: one file per
GPU index (or MIG `gpu.gi`) holding `JOBID [USER [ACCOUNT]]`, its modification time the job's
start there. A missing directory is a node without Slurm."""

from __future__ import annotations

import locale
import logging
import os
import re
from dataclasses import replace
from pathlib import Path

from agent.attribution.facts import HostFacts, SlurmAllocation
from agent.attribution.sources.base import AttributionSource, SourceOptions
from agent.model import Snapshot

log = logging.getLogger(__name__)

_MAP_NAME = re.compile(r"^(\d+)(?:\.(\d+))?$")
# Slurm account names: letters, digits and a few separators (sacctmgr refuses the rest).
_ACCOUNT = re.compile(r"[A-Za-z0-9_.@+-]{1,128}")
_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")  # a job id, or an array task's (`1234_7`)


def read_slurm_map(directory: str | Path) -> list[SlurmAllocation]:
    """One file per GPU index (`3`) or MIG instance (`0.2`), as a prolog writes them and an
    epilog removes them; the first line holds the job id and, optionally, the user and the
    job's account ($SLURM_JOB_ACCOUNT in the prolog)."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found: list[SlurmAllocation] = []
    encoding = locale.getpreferredencoding(False)  # asked once per read, not once per file
    for name in names:
        match = _MAP_NAME.match(name)
        if not match:
            continue
        path = os.path.join(directory, name)
        try:
            text, written_at = _read_text(path, encoding)
        except OSError:
            continue  # removed by the epilog while we listed: the job is gone
        first = text.strip().splitlines()
        fields = first[0].split() if first else []
        if not fields or not _JOB_ID.fullmatch(fields[0]):
            log.debug("ignoring %s: no job id on its first line", path)
            continue
        found.append(
            SlurmAllocation(
                gpu_index=int(match.group(1)),
                gpu_instance_id=int(match.group(2)) if match.group(2) else None,
                job=fields[0],
                user=fields[1] if len(fields) > 1 else None,
                started_at=written_at,
                account=fields[2] if len(fields) > 2 and _ACCOUNT.fullmatch(fields[2]) else None,
            )
        )
    return found


class SlurmMapSource(AttributionSource):
    """The Slurm jobs each GPU is allocated to, from the map directory, read every poll (a
    prolog or epilog may have run since the last)."""

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = directory

    @classmethod
    def from_options(cls, options: SourceOptions) -> SlurmMapSource:
        return cls(options.slurm_map_dir)

    def gather(self, snapshot: Snapshot, found: HostFacts) -> HostFacts:
        if not self.directory:
            return found
        return replace(found, slurm_allocations=(*found.slurm_allocations, *read_slurm_map(self.directory)))


def _read_text(path: str, encoding: str) -> tuple[str, float]:
    """The file's text, as Path.read_text(errors="replace") gives it, and its modification time,
    through os.open, os.read and os.fstat: the map is read every poll, and a buffered text file
    costs more than the read. The time is when the prolog wrote the file: the job's start on
    this GPU, which accounting charges it from."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        written_at = os.fstat(fd).st_mtime
        chunks = []
        while chunk := os.read(fd, 4096):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode(encoding, errors="replace"), written_at

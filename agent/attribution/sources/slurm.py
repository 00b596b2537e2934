"""Slurm's GPU mapping directory, as a prolog writes it and an epilog removes it: one file per
GPU index (or MIG `gpu.gi`), or per device node (`nvidia<minor>`, as deploy/slurm's prolog names
them), holding `JOBID [USER [ACCOUNT]]`, its modification time the job's start there. An array
task's JOBID is `<its job id>=<array job id>_<task id>`: slurmd names its cgroup by the first,
users know it by the second, which labels it. A missing directory is a node without Slurm.

The directory is looked at every poll (a prolog or epilog may have run since the last), but a
file is read again only when its stat changed (`SlurmMap`): an unchanged map costs one stat
of the directory and one of each file.
"""

from __future__ import annotations

import locale
import logging
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from agent.attribution.facts import HostFacts, SlurmAllocation
from agent.attribution.sources.base import AttributionSource, SourceOptions
from agent.attribution.sources.settled import Listing, StatKey, settled_before, stat_key
from agent.model import Snapshot

log = logging.getLogger(__name__)

# `<index>` or `<index>.<gi>` (a MIG instance), or `nvidia<minor>`: a GPU by its device node.
_MAP_NAME = re.compile(r"^(?:(\d+)(?:\.(\d+))?|nvidia(\d+))$")
# Slurm account names: letters, digits and a few separators (sacctmgr refuses the rest).
_ACCOUNT = re.compile(r"[A-Za-z0-9_.@+-]{1,128}")
_JOB_ID = re.compile(r"[0-9]+(?:_[0-9]+)?")  # a job id, or an array task's (`1234_7`)
# An array task as the prolog writes it, `<its own job id>=<array job id>_<task id>`: the id its
# cgroup carries, and the one squeue and sacct show.
_ARRAY_TASK = re.compile(r"([0-9]+)=([0-9]+_[0-9]+)")
_MapFile = tuple[str, str, re.Match[str]]  # name, path, the name's match of _MAP_NAME
# "JOBID USER ACCOUNT" is a few dozen bytes: a map file is read no further than this.
_MAP_FILE_MAX_BYTES = 4096


def read_slurm_map(directory: str | Path) -> list[SlurmAllocation]:
    """One file per GPU index (`3`), MIG instance (`0.2`) or device node (`nvidia3`: the GPU whose
    minor number is 3, whatever its index), as a prolog writes them and an
    epilog removes them; the first line holds the job id and, optionally, the user and the
    job's account ($SLURM_JOB_ACCOUNT in the prolog). Reads every file (`SlurmMap` reads only
    what changed)."""
    return SlurmMap(directory, now_ns=lambda: 0).read()  # nothing settles at time 0: nothing is kept


class SlurmMap:
    """The map directory, read as `read_slurm_map` reads it, keeping what each file said with
    the stat it was read under (`agent.attribution.sources.settled`): a file whose stat is
    unchanged is not read again, and the directory is listed again only when its own stat
    changed. A file written just before a read is read again at the next, until its stat has
    settled."""

    def __init__(self, directory: str | Path, now_ns: Callable[[], int] = time.time_ns) -> None:
        self.directory = str(directory)
        self._now_ns = now_ns
        self._listing = Listing(directory, now_ns)
        self._map_files: tuple[list[str], list[_MapFile]] = ([], [])  # the listing's map files
        # Map file name -> the stat it was read under and what it said (None: no job id in it).
        self._files: dict[str, tuple[StatKey, SlurmAllocation | None]] = {}
        self.file_reads = 0  # map files opened and parsed (tests and benchmarks count them)
        self._refused: set[str] = set()  # map files not trusted, said once each

    def read(self) -> list[SlurmAllocation]:
        before = settled_before(self._now_ns)
        kept: dict[str, tuple[StatKey, SlurmAllocation | None]] = {}
        found: list[SlurmAllocation] = []
        encoding = None  # asked once per read that reads a file, not once per file (nor per poll)
        for name, path, match in self._files_listed():
            known = self._files.get(name)
            try:
                if known is not None and stat_key(os.stat(path)) == known[0]:
                    kept[name] = known
                    allocation = known[1]
                else:
                    if encoding is None:
                        encoding = locale.getpreferredencoding(False)
                    text, st = _read_text(path, encoding)
                    self.file_reads += 1
                    allocation = _parse(path, match, text, st.st_mtime) if self._trusted(path, st) else None
                    if st.st_ctime_ns <= before:
                        kept[name] = (stat_key(st), allocation)
            except OSError:
                continue  # removed by the epilog while we listed: the job is gone
            if allocation is not None:
                found.append(allocation)
        self._files = kept  # files gone from the directory are forgotten
        return found

    def _trusted(self, path: str, st: os.stat_result) -> bool:
        """Whether a map file is the prolog's: owned by root (or the agent's own user) and not
        writable by everyone. A map file names who pays for a GPU: one a user could write would
        let them bill their GPU time to anyone's job."""
        if st.st_uid in (0, os.geteuid()) and not st.st_mode & stat.S_IWOTH:
            self._refused.discard(path)
            return True
        if path not in self._refused:
            self._refused.add(path)
            log.warning(
                "ignoring Slurm map file %s: owned by uid %d, mode %o; only root's, not writable by all, are trusted",
                path,
                st.st_uid,
                stat.S_IMODE(st.st_mode),
            )
        return False

    def _files_listed(self) -> list[_MapFile]:
        """The directory's map files, by name, matched once per listing."""
        names = self._listing.names()
        listed, files = self._map_files
        if names is not listed:
            files = [
                (name, os.path.join(self.directory, name), match) for name in names if (match := _MAP_NAME.match(name))
            ]
            self._map_files = (names, files)
        return files


class SlurmMapSource(AttributionSource):
    """The Slurm jobs each GPU is allocated to, from the map directory, looked at every poll (a
    prolog or epilog may have run since the last)."""

    def __init__(self, directory: str | Path | None) -> None:
        self.directory = directory
        self.map = SlurmMap(directory) if directory else None

    @classmethod
    def from_options(cls, options: SourceOptions) -> SlurmMapSource:
        return cls(options.slurm_map_dir)

    def gather(self, snapshot: Snapshot, found: HostFacts) -> HostFacts:
        if self.map is None:
            return found
        return replace(found, slurm_allocations=(*found.slurm_allocations, *self.map.read()))


def _parse(path: str, match: re.Match[str], text: str, written_at: float) -> SlurmAllocation | None:
    """The allocation a map file names, or None where its first line holds no job id."""
    first = text.strip().splitlines()
    fields = first[0].split() if first else []
    task = _ARRAY_TASK.fullmatch(fields[0]) if fields else None
    if task is not None:
        task_job_id, job = task.group(1), task.group(2)
    elif fields and _JOB_ID.fullmatch(fields[0]):
        task_job_id, job = None, fields[0]
    else:
        log.debug("ignoring %s: no job id on its first line", path)
        return None
    minor = match.group(3)
    return SlurmAllocation(
        gpu_index=int(minor if minor is not None else match.group(1)),
        gpu_instance_id=int(match.group(2)) if match.group(2) else None,
        job=job,
        task_job_id=task_job_id,
        user=fields[1] if len(fields) > 1 else None,
        started_at=written_at,
        account=fields[2] if len(fields) > 2 and _ACCOUNT.fullmatch(fields[2]) else None,
        by_minor=minor is not None,
    )


def _read_text(path: str, encoding: str) -> tuple[str, os.stat_result]:
    """The file's text, as Path.read_text(errors="replace") gives it, and its stat (taken before
    the read: a write after it changes the stat, and the file is read again), through os.open,
    os.read and os.fstat: a buffered text file costs more than the read. The modification time
    is when the prolog wrote the file: the job's start on this GPU, which accounting charges it
    from. Only a regular file is read, and only its first `_MAP_FILE_MAX_BYTES`: a FIFO would
    block the poll for good, a symlink may lead anywhere (/dev/zero: a read without end); either
    raises OSError, as a file the epilog removed does, and is passed over."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: not a regular file")
        chunks = []
        left = _MAP_FILE_MAX_BYTES
        while left > 0 and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode(encoding, errors="replace"), st

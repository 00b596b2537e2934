"""The one module that reads procfs (and the passwd file beside it).

A process is identified by (pid, start time in clock ticks), so a reused pid is never taken
for the process that had it before. OS errors become `ProcessGone` / `ProcessUnreadable`.
The root is injectable: `/proc` on a host, the host's /proc mounted elsewhere in a container,
or the tree the fake node writes.

Environment variables are secrets until proven otherwise: `environ` is parsed here and only
allowlisted keys leave this module; every other value is dropped with the buffer it came in.

`ProcessSource` is the attribution source built on them: the facts of every process on a GPU,
and its user's name.

A read of a process's own files can block: its cmdline and environ are read from its memory,
under a lock that a task stuck in the kernel (on an NFS or FUSE mount, say) may hold for good.
So a process is read in full (once, when it is new) on a worker thread, within `READ_BUDGET_S`:
one that overstays leaves its process unresolved, is counted (`timeouts()`) and is not tried
again while its thread is still in it; the other new processes of that poll wait for the next,
so that a poll waits on one stuck read at most. The stat file read every poll takes no such
lock, and is read on the poll's own thread.

Servers that rename their GPU processes (vLLM's V1 engine: `VLLM::EngineCore`, `VLLM::Worker_TP0`;
SGLang: `sglang::scheduler_TP0`, both through setproctitle) leave the model only on the command
line of the API server that spawned them, which holds no GPU. So a GPU process whose own command
line names no model inherits the model of its nearest ancestor that names one, within
`ANCESTOR_LEVELS` and within its own cgroup and uid: a container runtime's shim, a host shell or
init never lend their arguments.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from stat import S_ISREG

from agent.attribution.facts import HostFacts
from agent.attribution.recognise import recognise_model
from agent.attribution.sources.base import AttributionSource, SourceOptions
from agent.deadline import CallTimeout, Worker
from agent.errors import GpuledgerError
from agent.model import ProcessFacts, ProcessIdentity, Snapshot

log = logging.getLogger(__name__)

_READ_CHUNK_BYTES = 65536
# Files of a single line: read whole once a read returns that line's newline.
_ONE_LINE_FILES = frozenset({"stat"})
# Clock ticks a second in /proc/<pid>/stat's start time: USER_HZ, 100 on every Linux platform
# that matters; sysconf says so where it can.
try:
    CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
    CLOCK_TICKS_PER_S = 100

# How far up the process tree a GPU process looks for a model: vLLM's workers are the API
# server's grandchildren (server -> EngineCore -> Worker_TPn); a launcher or `tini` above it
# leaves room to spare.
ANCESTOR_LEVELS = 4
# How long one full read of a new process (its files and its ancestors') may take. It takes well
# under a millisecond, on a loaded host too.
READ_BUDGET_S = 2.0


class ProcessGone(GpuledgerError):
    """The pid is not there (exited, or in a PID namespace we cannot see)."""


class ProcessUnreadable(GpuledgerError):
    """The process exists but we may not read it (permissions, hidepid)."""


def _map_os_error(pid: int, exc: OSError) -> GpuledgerError:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return ProcessUnreadable(f"pid {pid}: permission denied")
    return ProcessGone(f"pid {pid}: {exc.strerror or 'not found'}")


class ProcFS:
    def __init__(self, root: str | Path = "/proc", env_allowlist: Iterable[str] = ()) -> None:
        self.root = Path(root)
        self._root = str(self.root)
        self.env_allowlist = frozenset(env_allowlist)
        self._environ_denied_logged = False
        self._boot_time: float | None = None

    def _read(self, pid: int, name: str) -> bytes:
        # os.open and os.read rather than open(): a buffered file object costs more than these
        # small reads themselves, and every process on a GPU is read every poll.
        try:
            fd = os.open(f"{self._root}/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                chunk = os.read(fd, _READ_CHUNK_BYTES)
                # A one-line file comes whole in one read (procfs makes the line at once, and a
                # file on disk reads to its end): the read that would return nothing is saved,
                # a third of the syscalls of the stat read every process on a GPU gets every poll.
                if name in _ONE_LINE_FILES and chunk.endswith(b"\n"):
                    return chunk
                chunks = [chunk]
                # procfs reports no size and may return a file in pieces: read to the end.
                while chunk:
                    chunk = os.read(fd, _READ_CHUNK_BYTES)
                    chunks.append(chunk)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _map_os_error(pid, exc) from exc
        return b"".join(chunks)

    def identity(self, pid: int) -> ProcessIdentity:
        """(pid, start time): one small read, done every poll to notice pid reuse."""
        return ProcessIdentity(pid, self.start_ticks(pid))

    def start_ticks(self, pid: int) -> int:
        """The process's start time in clock ticks since boot: `identity`'s reading, alone."""
        return self.stat(pid)[1]

    def stat(self, pid: int) -> tuple[int, int]:
        """(parent pid, start time in clock ticks since boot), from one read of the stat file."""
        try:
            return parse_stat(self._read(pid, "stat"))
        except ValueError:
            raise ProcessGone(f"pid {pid}: unreadable stat") from None

    def boot_time(self) -> float | None:
        """When the host booted (unix seconds): `btime` in <root>/stat, read once. None where it
        cannot be read."""
        if self._boot_time is None:
            try:
                with open(f"{self._root}/stat", "rb") as stat:
                    for line in stat:
                        if line.startswith(b"btime "):
                            self._boot_time = float(line.split()[1])
                            break
            except (OSError, ValueError, IndexError):
                return None
        return self._boot_time

    def started_at(self, identity: ProcessIdentity) -> float | None:
        """When the process started, wall clock: boot time + its start ticks (psutil's
        create_time(), from the same two files). None where the boot time is unknown."""
        boot = self.boot_time()
        return None if boot is None else boot + identity.start_ticks / CLOCK_TICKS_PER_S

    def facts(self, identity: ProcessIdentity, *, environ: bool = True) -> ProcessFacts:
        """The process's facts; its allowlisted environment only with `environ` (an ancestor's
        is never read: it is not the GPU process's, and reading it is what costs privilege)."""
        pid = identity.pid
        cmdline = tuple(part.decode(errors="replace") for part in self._read(pid, "cmdline").split(b"\0") if part)
        cgroup = self._read(pid, "cgroup").decode(errors="replace")
        uid = _status_uid(self._read(pid, "status"))
        env = self._environ(pid) if self.env_allowlist and environ else ()
        # The pid may have been reused while we read: only facts of the same process count.
        if self.identity(pid) != identity:
            raise ProcessGone(f"pid {pid}: exited while being read")
        return ProcessFacts(identity, uid, cmdline, cgroup, env, self.started_at(identity))

    def _environ(self, pid: int) -> tuple[tuple[str, str], ...]:
        try:
            raw = self._read(pid, "environ")
        except ProcessUnreadable:
            # Reading another user's environ needs CAP_SYS_PTRACE; without it, go on quietly.
            if not self._environ_denied_logged:
                log.info("cannot read process environments (no privilege); attribution uses cgroups and cmdlines")
                self._environ_denied_logged = True
            return ()
        kept: list[tuple[str, str]] = []
        for entry in raw.split(b"\0"):
            key, sep, value = entry.partition(b"=")
            if sep and key.decode(errors="replace") in self.env_allowlist:
                kept.append((key.decode(errors="replace"), value.decode(errors="replace")))
        del raw
        return tuple(sorted(kept))


def parse_stat(stat: bytes) -> tuple[int, int]:
    """(parent pid, start ticks) from a /proc/<pid>/stat line (proc(5) fields 4 and 22). The
    command name before them sits in parentheses and may itself hold spaces, '(' and ')': the
    fields after it start after the last ')'. ValueError where the line is cut short."""
    # Split no further than field 22: the 30 after it are not needed.
    after_comm = stat[stat.rfind(b")") + 2 :].split(maxsplit=20)
    try:
        return int(after_comm[1]), int(after_comm[19])  # fields after comm start at 3
    except IndexError:
        raise ValueError("stat line cut short") from None


def _status_uid(status: bytes) -> int | None:
    for line in status.splitlines():
        if line.startswith(b"Uid:"):
            fields = line.split()
            if len(fields) > 1 and fields[1].isdigit():
                return int(fields[1])
    return None


class Passwd:
    """uid -> user name from a passwd-format file, re-read when the file changes."""

    def __init__(self, path: str | Path = "/etc/passwd") -> None:
        self.path = Path(path)
        self._mtime: float | None = None
        self._names: Mapping[int, str] = {}
        self._said_irregular = False

    def name(self, uid: int) -> str | None:
        self._refresh()
        return self._names.get(uid)

    def names(self, uids: Iterable[int]) -> dict[int, str]:
        """uid -> name for each of `uids` the file names, from one look at the file."""
        self._refresh()
        return {uid: name for uid in uids if (name := self._names.get(uid)) is not None}

    def _refresh(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime
        except OSError:
            self._names, self._mtime = {}, None
            return
        if mtime == self._mtime:
            return
        names: dict[int, str] = {}
        try:
            # Not blocking in the open, and read only as a regular file: a FIFO (or /dev/stdin)
            # named here would hold the poll for good, /dev/zero fill memory.
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            with open(fd, "rb") as file:
                if not S_ISREG(os.fstat(fd).st_mode):
                    if not self._said_irregular:
                        self._said_irregular = True
                        log.warning("passwd file %s is not a regular file: user names are not resolved", self.path)
                    return
                text = file.read().decode(errors="replace")
        except OSError:
            return
        for line in text.splitlines():
            fields = line.split(":")
            if len(fields) >= 3 and fields[2].isdigit():
                names.setdefault(int(fields[2]), fields[0])
        self._names, self._mtime = names, mtime


@dataclass(frozen=True, slots=True)
class _Ancestor:
    """What a GPU process's ancestor lends it: no more than the model its command line names
    (the command line itself is dropped once read), and what decides whether it may lend."""

    start_ticks: int
    parent_pid: int
    uid: int | None
    cgroup: str
    model: str | None


@dataclass(frozen=True, slots=True)
class _FullRead:
    """What reading one new process in full found: its facts (with the model inherited from an
    ancestor), the ancestors read afresh for it and the pids its walk went through. Built on
    the worker, taken in by the poll's thread, so that an abandoned read changes nothing."""

    facts: ProcessFacts
    ancestors: dict[int, _Ancestor]
    lineage: tuple[int, ...]


class ProcessSource(AttributionSource):
    """The facts of every process on a GPU (uid, cmdline, cgroup, allowlisted environment) and
    the names of their users.

    Facts are cached per identity (pid, start time): a process is read in full once, and each
    later poll costs one small read of its stat file to notice an exit or a reused pid. A
    process whose own command line names no model is given its nearest ancestor's (see the
    module docstring) when it is read in full; the ancestors read are cached per identity too,
    so tensor-parallel workers starting together read their server once.
    """

    def __init__(self, procfs: ProcFS, passwd: Passwd, read_budget_s: float = READ_BUDGET_S) -> None:
        self.procfs = procfs
        self.passwd = passwd
        self.read_budget_s = read_budget_s
        self._cache: dict[int, ProcessFacts] = {}
        # Ancestors read for the cached processes, and the pids each cached process's walk read.
        self._ancestors: dict[int, _Ancestor] = {}
        self._lineage: dict[int, tuple[int, ...]] = {}
        self._worker = Worker("gpuledger-proc")
        # pid -> the thread still in a full read of it that overstayed: one such thread per pid.
        self._stuck: dict[int, threading.Thread] = {}
        self.full_reads = 0  # how many processes were read in full (for tests and benchmarks)
        self.ancestor_reads = 0  # how many ancestors were read in full (for tests)
        self._timeouts = 0
        self._gave_up = False  # a full read of this poll timed out: no more this poll

    @classmethod
    def from_options(cls, options: SourceOptions) -> ProcessSource:
        return cls(ProcFS(options.proc_root, env_allowlist=options.env_allowlist), Passwd(options.passwd_file))

    def gather(self, snapshot: Snapshot, found: HostFacts) -> HostFacts:
        pids = {p.pid for d in snapshot.devices for p in d.processes}
        self._gave_up = False
        processes = {pid: self._facts(pid) for pid in sorted(pids)}
        for gone in set(self._cache) - pids:
            del self._cache[gone]
        for gone in [pid for pid, thread in self._stuck.items() if pid not in pids and not thread.is_alive()]:
            del self._stuck[gone]
        if self._lineage or self._ancestors:
            for gone in set(self._lineage) - set(self._cache):
                del self._lineage[gone]
            kept = {a for lineage in self._lineage.values() for a in lineage}
            for gone in set(self._ancestors) - kept:
                del self._ancestors[gone]
        uids = {f.uid for f in processes.values() if f is not None and f.uid is not None}
        user_names = self.passwd.names(uids)
        return replace(found, processes={**found.processes, **processes}, user_names={**found.user_names, **user_names})

    def forget(self) -> None:
        """Drop every cached process, so the next poll reads each in full (a cold start)."""
        self._cache.clear()
        self._ancestors.clear()
        self._lineage.clear()

    def timeouts(self) -> int:
        return self._timeouts

    def close(self) -> None:
        self._worker.close()

    def _facts(self, pid: int) -> ProcessFacts | None:
        """`pid`'s facts: the cached ones while its start time is unchanged, else read in full
        within `read_budget_s`. None where it cannot be read, or not in time."""
        try:
            parent, start_ticks = self.procfs.stat(pid)
        except GpuledgerError as exc:
            log.debug("cannot resolve pid %d: %s", pid, exc)
            self._cache.pop(pid, None)
            return None
        cached = self._cache.get(pid)
        # The same process as last poll (cached under its pid): compared without building
        # its identity, which only a process read in full needs.
        if cached is not None and cached.identity.start_ticks == start_ticks:
            return cached
        self._cache.pop(pid, None)
        stuck = self._stuck.get(pid)
        if stuck is not None:
            if stuck.is_alive():
                return None  # not asked again: that would park a second thread on it
            del self._stuck[pid]
            log.info("pid %d: the stuck read of its /proc files returned; reading it again", pid)
        if self._gave_up:
            return None  # this poll waited on a stuck read already: read at the next
        identity = ProcessIdentity(pid, start_ticks)
        try:
            read = self._worker.call(lambda: self._read_in_full(identity, parent), self.read_budget_s)
        except CallTimeout as exc:
            self._timeouts += 1
            self._gave_up = True
            if exc.thread is not None:
                self._stuck[pid] = exc.thread
                log.warning(
                    "pid %d: a read of its /proc files has not returned in %.1fs; its owner is unknown until it does",
                    pid, self.read_budget_s,
                )  # fmt: skip
            return None
        except GpuledgerError as exc:
            log.debug("cannot resolve pid %d: %s", pid, exc)
            return None
        self.full_reads += 1
        self.ancestor_reads += len(read.ancestors)
        self._ancestors.update(read.ancestors)
        if read.lineage:
            self._lineage[pid] = read.lineage
        self._cache[pid] = read.facts
        return read.facts

    def _read_in_full(self, identity: ProcessIdentity, parent: int) -> _FullRead:
        """On the worker: the process's facts, and the model the nearest ancestor's command line
        names, within `ANCESTOR_LEVELS`; the walk stops at pid 1 (init, or a container's init seen
        from inside its namespace), at an ancestor in another cgroup or of another uid (the
        runtime's shim, a host shell, sudo), and at one that cannot be read. It only reads the
        source's caches: what it found is handed back."""
        facts = self.procfs.facts(identity)
        fresh: dict[int, _Ancestor] = {}
        lineage: list[int] = []
        if recognise_model(facts.cmdline) is not None:
            return _FullRead(facts, fresh, ())
        pid = parent
        while pid > 1 and len(lineage) < ANCESTOR_LEVELS:
            ancestor = self._ancestor(pid, fresh)
            if ancestor is None:
                break
            lineage.append(pid)  # kept while this process is: its siblings need not read it again
            if ancestor.cgroup != facts.cgroup or ancestor.uid != facts.uid:
                break
            if ancestor.model is not None:
                facts = replace(facts, inherited_model=ancestor.model)
                break
            pid = ancestor.parent_pid
        return _FullRead(facts, fresh, tuple(lineage))

    def _ancestor(self, pid: int, fresh: dict[int, _Ancestor]) -> _Ancestor | None:
        """Ancestor `pid`, from the cache while its start time is unchanged, else read (and put
        in `fresh`)."""
        try:
            parent, start_ticks = self.procfs.stat(pid)
            cached = fresh.get(pid) or self._ancestors.get(pid)
            if cached is not None and cached.start_ticks == start_ticks:
                return cached
            facts = self.procfs.facts(ProcessIdentity(pid, start_ticks), environ=False)
        except GpuledgerError as exc:
            log.debug("cannot read ancestor pid %d: %s", pid, exc)
            return None
        ancestor = _Ancestor(start_ticks, parent, facts.uid, facts.cgroup, recognise_model(facts.cmdline))
        fresh[pid] = ancestor
        return ancestor

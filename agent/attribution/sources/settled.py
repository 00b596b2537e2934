"""When a file or directory read at an earlier poll can be taken as unchanged, from its stat.

Sources that look at the same files every poll (Slurm's map files, the kubelet's pod log
directories) read them again only when their stat changed: inode, size, modification time and
change time. The change time is the kernel's, set by every write, rename or utime and by
nothing else, so a file rewritten in place at the same length and dated back with utime still
shows as changed.

A stat is trusted only once it has settled: file systems stamp times at their own granularity
(a kernel tick; whole seconds on some), so a second change within the tick of the first, after
the read, would leave the stat as it was. A stat whose change time is within `SETTLE_NS` of
the read is therefore never kept, and the file is read again at the next poll (git's index has
the same rule, "racy git").
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

SETTLE_NS = 2_000_000_000

StatKey = tuple[int, int, int, int]  # inode, size, modification and change time (ns)


def stat_key(st: os.stat_result) -> StatKey:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def settled_before(now_ns: Callable[[], int]) -> int:
    """The latest change time a stat taken from now on may have and still be kept: taken before
    the stats it judges, so each was settled when it was taken."""
    return now_ns() - SETTLE_NS


class Listing:
    """A directory's entries, sorted, listed again only when the directory's stat changed (an
    entry added, removed or renamed changes it). Empty where the directory cannot be read."""

    def __init__(self, directory: str | Path, now_ns: Callable[[], int] = time.time_ns) -> None:
        self.directory = str(directory)
        self._now_ns = now_ns
        self._kept: tuple[StatKey, list[str]] | None = None
        self.listings = 0  # times the directory was listed (tests and benchmarks count them)

    def names(self) -> list[str]:
        """The entries; the same list object as the last call's while the directory is unchanged."""
        before = settled_before(self._now_ns)
        try:
            key = stat_key(os.stat(self.directory))
            kept = self._kept
            if kept is not None and kept[0] == key:
                return kept[1]
            # Stat first, then list: an entry added in between changes the next stat.
            names = sorted(os.listdir(self.directory))
        except OSError:
            self._kept = None
            return []
        self.listings += 1
        self._kept = (key, names) if key[3] <= before else None
        return names

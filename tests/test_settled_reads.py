"""Files looked at every poll but read again only where their stat changed
(`agent.attribution.sources.settled`): the Slurm map directory (`SlurmMap`) and the kubelet's pod
log directories (`PodLogSource`). Every way a prolog, an epilog or the kubelet can change them
is seen at the next read, and a file written just before a read is read again until its stat
has settled."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from agent.attribution.facts import HostFacts, SlurmAllocation
from agent.attribution.sources.podlogs import PodLogSource
from agent.attribution.sources.settled import SETTLE_NS, Listing
from agent.attribution.sources.slurm import SlurmMap, read_slurm_map
from agent.model import NodeInfo, ProcessFacts, ProcessIdentity, Snapshot

# A clock an hour ahead of the files: every stat has settled.
LATER_NS = time.time_ns() + 3600 * 10**9


def write(path: Path, text: str, dated: float = 1_795_000_000.0) -> None:
    """As a prolog writes a map file: the text, dated when the job started there."""
    path.write_text(text)
    os.utime(path, (dated, dated))


def jobs(found: list[SlurmAllocation]) -> dict[int, tuple[str, str | None]]:
    return {a.gpu_index: (a.job, a.user) for a in found}


def wait_for_a_new_change_time(path: Path) -> None:
    """Sleep until a write to `path` would stamp a change time other than its present one (the
    kernel stamps at tick granularity): the rewrites below must change only that."""
    before = path.stat().st_ctime_ns
    deadline = time.monotonic() + 5
    while time.time_ns() <= before + 50_000_000 and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def slurm_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "slurm"
    directory.mkdir()
    write(directory / "0", "4242 bob\n")
    write(directory / "1", "4243 carol\n")
    return directory


def test_an_unchanged_map_is_not_read_again(slurm_dir: Path) -> None:
    reader = SlurmMap(slurm_dir, now_ns=lambda: LATER_NS)
    first = reader.read()
    again = reader.read()
    assert jobs(first) == jobs(again) == {0: ("4242", "bob"), 1: ("4243", "carol")}
    assert again == first == read_slurm_map(slurm_dir)
    assert reader.file_reads == 2  # each file once


def test_a_file_rewritten_in_place_at_the_same_length_and_date_is_read_again(slurm_dir: Path) -> None:
    reader = SlurmMap(slurm_dir, now_ns=lambda: LATER_NS)
    reader.read()
    wait_for_a_new_change_time(slurm_dir / "0")
    before = (slurm_dir / "0").stat()
    write(slurm_dir / "0", "4299 dan\n")  # as long as "4242 bob", dated as before
    after = (slurm_dir / "0").stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert jobs(reader.read())[0] == ("4299", "dan")


def test_a_new_map_file_and_a_removed_one_are_seen_at_the_next_read(slurm_dir: Path) -> None:
    reader = SlurmMap(slurm_dir, now_ns=lambda: LATER_NS)
    reader.read()
    write(slurm_dir / "3", "5000 erin\n")  # a prolog
    (slurm_dir / "1").unlink()  # an epilog
    assert jobs(reader.read()) == {0: ("4242", "bob"), 3: ("5000", "erin")}


def test_a_file_replaced_by_another_of_the_same_stat_but_its_inode_is_read_again(slurm_dir: Path) -> None:
    # An epilog removes a GPU's file and the next job's prolog writes a new one.
    reader = SlurmMap(slurm_dir, now_ns=lambda: LATER_NS)
    reader.read()
    wait_for_a_new_change_time(slurm_dir / "1")
    replacement = slurm_dir.parent / "next"
    write(replacement, "4244 carla\n")  # as long as "4243 carol", dated as before
    replacement.replace(slurm_dir / "1")
    assert jobs(reader.read())[1] == ("4244", "carla")


def test_a_file_written_just_before_the_read_is_read_again_until_it_settles(slurm_dir: Path) -> None:
    # Within SETTLE_NS of its change time a second write could leave every field of the stat as
    # it was (the same tick): the file is read again at every read until then.
    ctime = (slurm_dir / "0").stat().st_ctime_ns
    now = ctime + SETTLE_NS // 2
    reader = SlurmMap(slurm_dir, now_ns=lambda: now)
    reader.read()
    reader.read()
    assert reader.file_reads == 4  # both files, both times
    now = ctime + 2 * SETTLE_NS
    reader.read()
    reader.read()
    assert reader.file_reads == 6  # read once more, then kept


def test_the_directory_removed_and_made_again_is_read_afresh(slurm_dir: Path) -> None:
    reader = SlurmMap(slurm_dir, now_ns=lambda: LATER_NS)
    reader.read()
    for name in ("0", "1"):
        (slurm_dir / name).unlink()
    slurm_dir.rmdir()
    assert reader.read() == []  # no Slurm (any more) on this node
    slurm_dir.mkdir()
    write(slurm_dir / "0", "4242 bob\n")
    assert jobs(reader.read()) == {0: ("4242", "bob")}


def test_a_file_without_a_job_id_is_skipped_and_named_once_it_has_one(slurm_dir: Path) -> None:
    reader = SlurmMap(slurm_dir, now_ns=lambda: LATER_NS)
    write(slurm_dir / "2", "\n")  # a prolog that has not written yet
    assert 2 not in jobs(reader.read())
    assert 2 not in jobs(reader.read())
    write(slurm_dir / "2", "4300 fay\n")
    assert jobs(reader.read())[2] == ("4300", "fay")


def test_only_regular_map_files_are_read_and_only_their_start(slurm_dir: Path, tmp_path: Path) -> None:
    os.mkfifo(slurm_dir / "2")  # opened for reading, a FIFO blocks until someone writes
    write(tmp_path / "elsewhere", "4400 mallory\n")
    (slurm_dir / "3").symlink_to(tmp_path / "elsewhere")  # might as well be /dev/zero
    write(slurm_dir / "4", "4500 gil\n" + "x" * (1 << 20))  # its first line is all that counts
    found: list[dict[int, tuple[str, str | None]]] = []
    reader = threading.Thread(target=lambda: found.append(jobs(read_slurm_map(slurm_dir))), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "the poll hangs on a FIFO in the map directory"
    assert found == [{0: ("4242", "bob"), 1: ("4243", "carol"), 4: ("4500", "gil")}]


def test_a_map_file_a_user_could_write_is_not_trusted(slurm_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A map file names who pays for a GPU. One owned by another user, or writable by everyone,
    # was read like the prolog's: a user able to write there could bill their GPUs to any job.
    write(slurm_dir / "2", "4400 mallory\n")
    (slurm_dir / "2").chmod(0o666)
    write(slurm_dir / "3", "4401 mallory\n")
    if os.geteuid() == 0:
        os.chown(slurm_dir / "3", 4321, 4321)  # another user's file
    else:
        (slurm_dir / "3").chmod(0o646)  # a non-root run cannot give a file away: everyone's, then
    reader = SlurmMap(slurm_dir, now_ns=lambda: LATER_NS)
    assert jobs(reader.read()) == {0: ("4242", "bob"), 1: ("4243", "carol")}
    assert jobs(reader.read()) == {0: ("4242", "bob"), 1: ("4243", "carol")}
    refused = [r.getMessage() for r in caplog.records if "ignoring Slurm map file" in r.getMessage()]
    assert len(refused) == 2  # once per file, not once per poll
    (slurm_dir / "2").chmod(0o644)  # the operator fixes it: trusted again
    assert jobs(reader.read()) == {0: ("4242", "bob"), 1: ("4243", "carol"), 2: ("4400", "mallory")}


def test_a_directory_is_listed_again_only_when_an_entry_changed(tmp_path: Path) -> None:
    listing = Listing(tmp_path, now_ns=lambda: LATER_NS)
    (tmp_path / "a").mkdir()
    assert listing.names() == ["a"]
    assert listing.names() == ["a"]
    assert listing.listings == 1
    (tmp_path / "b").mkdir()
    (tmp_path / "a").rename(tmp_path / "c")
    assert listing.names() == ["b", "c"]
    (tmp_path / "b").rmdir()
    assert listing.names() == ["c"]
    assert listing.listings == 3


def test_a_directory_changed_just_before_it_is_listed_is_listed_again_until_it_settles(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    ctime = tmp_path.stat().st_ctime_ns
    now = ctime + SETTLE_NS // 2
    listing = Listing(tmp_path, now_ns=lambda: now)
    listing.names()
    listing.names()
    assert listing.listings == 2
    now = ctime + 2 * SETTLE_NS
    listing.names()
    listing.names()
    assert listing.listings == 3


NOTEBOOK_UID = "5f2c9a77-0b6e-4c1d-9a3e-7d2b1c0e4f11"


def test_pod_names_follow_the_kubelets_log_directories(tmp_path: Path) -> None:
    # A process in a pod's cgroup: its pod's namespace and name come from /var/log/pods.
    in_pod = ProcessFacts(
        ProcessIdentity(700, 1),
        1000,
        ("python",),
        f"0::/kubepods.slice/kubepods-pod{NOTEBOOK_UID}.slice/cri-containerd-1",
    )
    found = HostFacts(processes={700: in_pod})
    snapshot = Snapshot(0.0, NodeInfo("n"), ())
    source = PodLogSource(tmp_path, now_ns=lambda: LATER_NS)  # every listing is kept
    assert source.gather(snapshot, found).pod_names == {}
    (tmp_path / f"research_notebook-7_{NOTEBOOK_UID}").mkdir()  # the kubelet starts the pod
    assert source.gather(snapshot, found).pod_names == {NOTEBOOK_UID: ("research", "notebook-7")}
    (tmp_path / f"research_notebook-7_{NOTEBOOK_UID}").rmdir()  # and removes it
    assert source.gather(snapshot, found).pod_names == {}

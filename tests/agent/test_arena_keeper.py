"""The daemon's arena keeper on real tmpfs folders: kept while a launcher lives and for the TTL after, removed at
the job's end or after the TTL, never while another process holds a rank's writer lease; arenas left before the
daemon started are adopted and aged out. The clock is injected (the TTL is the unit under test); pids and the
lease are real (a child process holding :class:`trainguard.checkpoint.arena.ArenaLease`)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from trainguard.agent.arena_keeper import ArenaKeeper, ArenaRootError, ArenaState, lease_held


@pytest.fixture
def root():
    path = Path(f"/dev/shm/tg-h16d-keeper-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _arena(root: Path, job: str) -> Path:
    d = root / job / "rank_00000"
    d.mkdir(parents=True)
    (d / "slot_0.data").write_bytes(b"x" * 4096)
    return root / job


def test_kept_while_a_launcher_lives_and_for_the_ttl_after(root):
    clock = Clock()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    keeper = ArenaKeeper(str(root), ttl_s=60, clock=clock)
    assert keeper.attach("j1", str(root), dead.pid) is False  # a new job: nothing kept yet
    arena = _arena(root, "j1")
    keeper.attach("j2", str(root), os.getpid())  # this process stands for a live launcher
    _arena(root, "j2")
    assert keeper.sweep() == [] and keeper.kept()["j1"].state is ArenaState.ORPHANED
    clock.now += 59
    assert keeper.sweep() == [] and arena.is_dir()
    # A restarted launcher (same job) within the TTL finds the arena kept.
    again = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert keeper.attach("j1", str(root), again.pid) is True
        assert keeper.kept()["j1"].state is ArenaState.HELD
        clock.now += 600
        assert keeper.sweep() == [] and arena.is_dir()
    finally:
        again.kill()
        again.wait()
    keeper.sweep()  # orphaned now, TTL from now
    clock.now += 60
    assert keeper.sweep() == ["j1"] and not arena.exists()
    assert (root / "j2").is_dir() and "j2" in keeper.kept()  # its launcher lives
    assert keeper.detach("j2", os.getpid(), ended=True) is True and not (root / "j2").exists()


def test_a_held_writer_lease_is_never_robbed_and_leftovers_are_adopted(root):
    clock = Clock()
    arena = _arena(root, "old")  # left by a launcher that died while no daemon ran
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from trainguard.checkpoint.arena import ArenaLease; "
         "l = ArenaLease(sys.argv[1]); l.acquire(); print('held', flush=True); time.sleep(60)",
         str(arena / "rank_00000")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lease_held(str(arena))
        keeper = ArenaKeeper(str(root), ttl_s=10, clock=clock)
        assert keeper.adopt_existing() == ["old"]
        clock.now += 11
        assert keeper.sweep() == [] and arena.is_dir()  # a writer the daemon does not know of
    finally:
        holder.kill()
        holder.wait()
    assert not lease_held(str(arena))  # the kernel dropped the dead writer's record lock
    assert keeper.sweep() == ["old"] and not arena.exists()


def test_another_root_or_a_path_as_job_is_refused(root, tmp_path):
    keeper = ArenaKeeper(str(root), ttl_s=10)
    with pytest.raises(ArenaRootError, match="memory_tier.root"):
        keeper.attach("j", str(tmp_path), os.getpid())
    with pytest.raises(ArenaRootError, match="not a usable arena folder name"):
        keeper.attach("../etc", str(root), os.getpid())


def _keeper_in_child(root: Path) -> subprocess.Popen:
    """A process keeping ``root`` until its stdin closes (prints ``held`` once it does)."""
    return subprocess.Popen([sys.executable, "-c", "import sys\nfrom trainguard.agent.arena_keeper import ArenaKeeper\n"
                             "k = ArenaKeeper(sys.argv[1], 0.0, exclusive=True)\nprint('held', flush=True)\nsys.stdin.read()",
                             str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_second_process_keeping_the_same_root_is_refused_naming_the_first(root) -> None:
    """Found by review: two daemons given one memory_tier.root each adopted the other's jobs' arenas and removed
    them ttl_s later, under running jobs. The first keeper now holds the root; another process's is refused,
    naming the holder's pid and the setting; a keeper of this same process (a daemon restarted in-process) is not.
    """
    _arena(root, "j1")
    holder = _keeper_in_child(root)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ArenaRootError, match=rf"daemon \(pid {holder.pid}\b.*memory_tier.root"):
            ArenaKeeper(str(root), 0.0, exclusive=True)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    keeper = ArenaKeeper(str(root), 0.0, exclusive=True)  # the holder is gone: its lock with it
    assert ArenaKeeper(str(root), 0.0, exclusive=True).root == keeper.root  # this process's keepers share it
    assert keeper.adopt_existing() == ["j1"]  # the lock file is no arena


def test_a_closed_keeper_lets_go_of_its_root(root) -> None:
    """The daemon closes its keeper when it stops (in-process too): the daemon started next on that root is not
    refused."""
    keeper = ArenaKeeper(str(root), 60.0, exclusive=True)
    keeper.close()
    nxt = _keeper_in_child(root)
    try:
        assert nxt.stdout.readline() == "held\n"
    finally:
        nxt.stdin.close()
        nxt.wait(timeout=30)
    assert ArenaKeeper(str(root), 60.0).sweep() == []  # a keeper not made exclusive takes nothing


def test_a_missing_root_is_made_for_launchers_of_any_user(tmp_path: Path) -> None:
    ArenaKeeper(str(tmp_path / "shm"), 0.0, exclusive=True)
    assert (tmp_path / "shm").stat().st_mode & 0o7777 == 0o1777


def test_an_arena_that_cannot_be_removed_is_said_so_not_logged_removed(tmp_path: Path, caplog) -> None:
    """rmtree failing (an immutable file here; in production a daemon without the rights to another user's
    files) leaves the arena: sweep() does not count it removed, and the log names the file and the cause."""
    keeper = ArenaKeeper(str(tmp_path), 0.0)
    stuck = tmp_path / "j1" / "rank_00000" / "data"
    stuck.parent.mkdir(parents=True)
    stuck.write_bytes(b"x")
    if subprocess.run(["chattr", "+i", str(stuck)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root and an ext4/tmpfs folder)")
    try:
        keeper.adopt_existing()
        with caplog.at_level(logging.INFO, logger="trainguard.agent.arena_keeper"):
            assert keeper.sweep() == []
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert stuck.exists()
    lines = [r.getMessage() for r in caplog.records]
    assert any("cannot remove the arena of job j1" in m and "Operation not permitted" in m for m in lines), lines
    assert not any("removed the arena of job j1" in m and "cannot" not in m for m in lines), lines


def test_only_a_launcher_of_the_job_ends_it(root) -> None:
    """DetachJob(ended) removes the arena at once; from a launcher that never attached the job (another user on
    the socket), it removes nothing, whether the job's own launcher lives or was killed: the daemon may delete any
    user's files, and a killed launcher's restart needs its snapshots."""
    keeper = ArenaKeeper(str(root), ttl_s=60)
    arena = _arena(root, "j1")
    keeper.attach("j1", str(root), os.getpid())  # this process stands for the job's live launcher
    assert keeper.detach("j1", "intruder.1.ab.lock", ended=True) is False and arena.is_dir()
    assert keeper.kept()["j1"].launchers == {os.getpid()}
    assert keeper.detach("j1", os.getpid(), ended=True) is True and not arena.exists()
    # With no launcher left (killed; or a daemon restarted since), a launcher that never attached the job does
    # not end it either: the arena is kept for the job's restart (before, any user of the socket removed it).
    clock = Clock()
    keeper = ArenaKeeper(str(root), ttl_s=60, clock=clock)
    _arena(root, "j2")
    keeper.adopt_existing()
    assert keeper.detach("j2", 1, ended=True) is False and (root / "j2").is_dir()
    assert keeper.detach("j2", "intruder.1.ab.lock", ended=True) is False and (root / "j2").is_dir()
    assert keeper.attach("j2", str(root), "restarted.2.cd.lock") is True  # the restart finds its snapshots
    assert keeper.detach("j2", "restarted.2.cd.lock", ended=True) is True and not (root / "j2").exists()
    _arena(root, "j3")
    keeper.adopt_existing()
    assert keeper.detach("j3", 1, ended=True) is False
    clock.now += 60
    assert keeper.sweep() == ["j3"] and not (root / "j3").exists()  # an orphan nobody claims ages out


def test_a_folder_of_another_program_is_never_attached_nor_removed(root, caplog) -> None:
    """Any user of the daemon's socket could AttachJob a name of an existing folder under the root (which may be
    /dev/shm itself) and DetachJob(ended=True): the daemon, as root, deleted that folder as the job's arena.
    Attach refuses it now; and a folder filled by another program after the attach is left at the end."""
    keeper = ArenaKeeper(str(root), ttl_s=10)
    (root / "theirs").mkdir()
    (root / "theirs" / "important.txt").write_text("data")
    with pytest.raises(ArenaRootError, match="not a checkpoint arena's"):
        keeper.attach("theirs", str(root), os.getpid())
    assert keeper.detach("theirs", os.getpid(), ended=True) is False and (root / "theirs" / "important.txt").exists()
    (root / "file").write_text("x")
    with pytest.raises(ArenaRootError):
        keeper.attach("file", str(root), os.getpid())
    assert keeper.attach("late", str(root), os.getpid()) is False  # a new job: no folder yet
    (root / "late").mkdir()
    (root / "late" / "notes.txt").write_text("x")
    with caplog.at_level(logging.WARNING):
        assert keeper.detach("late", os.getpid(), ended=True) is False
    assert (root / "late" / "notes.txt").exists() and "not removing" in caplog.text
    _arena(root, "ours")
    assert keeper.attach("ours", str(root), os.getpid()) is False  # an arena left before: attached
    assert keeper.detach("ours", os.getpid(), ended=True) is True and not (root / "ours").exists()


def test_a_root_that_cannot_be_made_is_refused_at_start() -> None:
    """A daemon given memory_tier.root = /proc/shm said "ready ... node healthy" and kept no job's snapshots, with
    only a warning about detecting a second daemon."""
    with pytest.raises(ArenaRootError, match=r"memory_tier.root: cannot create /proc/trainguard-shm \("):
        ArenaKeeper("/proc/trainguard-shm", ttl_s=60, exclusive=True)

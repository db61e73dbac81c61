"""How the node daemon tells an attached launcher lives (agent/launcher_lock.py): by the flock the launcher holds
on a file beside the daemon's socket, not by a pid (pids differ between pods). Real files and real processes:
the lock of a live holder (another process) is seen held, a SIGKILLed holder's is seen free and its file removed;
names that are not plain lock files and symlinks planted in the folder count as dead and are never followed.
An attachment the daemon refuses for its TLS files leaves the job's arena not held (it would never be freed)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from trainguard.agent.arena_keeper import ArenaKeeper
from trainguard.agent.coordinator_report import NodeVerdict
from trainguard.agent.daemon_jobs import DaemonJobs
from trainguard.agent.launcher_lock import (
    LauncherLock, launcher_alive, launchers_dir, lock_alive, prepare_launchers_dir,
)
from trainguard.proto import agent_pb2
from trainguard.recovery.rpc_security import SecurityConfigError

HOLD = ("import sys, time; from trainguard.agent.launcher_lock import LauncherLock; "
        "l = LauncherLock.acquire(sys.argv[1], 'job/x'); print(l.name, flush=True); time.sleep(60)")


@pytest.fixture
def sock(tmp_path: Path) -> str:
    path = str(tmp_path / "run" / "agent.sock")
    os.makedirs(os.path.dirname(path))
    prepare_launchers_dir(path, 0o660)
    return path


def test_the_folder_admits_the_sockets_users_and_no_one_else(tmp_path: Path) -> None:
    for mode, want in ((0o660, 0o1770), (0o600, 0o1700)):
        path = str(tmp_path / f"m{mode:o}" / "agent.sock")
        os.makedirs(os.path.dirname(path))
        assert stat.S_IMODE(os.stat(prepare_launchers_dir(path, mode)).st_mode) == want


def test_a_live_holder_is_seen_alive_and_a_killed_one_gone(sock: str, tg_env: dict) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, sock], env=tg_env, stdout=subprocess.PIPE, text=True)
    try:
        name = holder.stdout.readline().strip()
        assert name.startswith("job_x.") and name.endswith(".lock")  # a job name never makes a path
        folder = launchers_dir(sock)
        assert lock_alive(folder, name) and lock_alive(folder, name)  # probing does not take it away
        assert launcher_alive(folder)(name) and launcher_alive(folder)(os.getpid())  # str: lock, int: pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert not lock_alive(folder, name)  # the kernel dropped the dead holder's lock
    assert not os.path.exists(os.path.join(folder, name))  # and the daemon removed its file


def test_release_and_an_unwritable_folder(sock: str, tmp_path: Path) -> None:
    lock = LauncherLock.acquire(sock, "job")
    assert lock is not None and lock_alive(launchers_dir(sock), lock.name)
    lock.release()
    assert not os.path.exists(lock.path) and not lock_alive(launchers_dir(sock), lock.name)
    # No folder (an older daemon): no lock, the daemon goes by pid.
    assert LauncherLock.acquire(str(tmp_path / "elsewhere" / "agent.sock"), "job") is None


def test_names_that_are_not_lock_files_and_planted_symlinks_count_as_dead(sock: str, tmp_path: Path) -> None:
    folder = launchers_dir(sock)
    target = tmp_path / "precious"
    target.write_text("keep")
    os.symlink(target, os.path.join(folder, "evil.lock"))
    assert not lock_alive(folder, "evil.lock") and target.read_text() == "keep"
    for name in ("../run/agent.sock", "/etc/passwd", ".hidden.lock", "x.txt", ""):
        assert not lock_alive(folder, name)


def test_a_refused_tls_attachment_leaves_the_arena_not_held(tmp_path: Path) -> None:
    root = Path(f"/dev/shm/tg-launcher-lock-{uuid.uuid4().hex[:8]}")
    root.mkdir()
    try:
        keeper = ArenaKeeper(str(root), ttl_s=0.0, alive=lambda key: True)  # every launcher "lives"
        jobs = DaemonJobs("n", "h", "i", lambda: NodeVerdict(), keeper, 1.0, 1.0, alive=lambda key: True)
        req = agent_pb2.AttachJobRequest(job="j", coordinator="127.0.0.1:1", launcher_pid=1, arena_root=str(root),
                                         tls_ca_file=str(tmp_path / "missing-ca.crt"), launcher_lock="j.1.ab.lock")
        with pytest.raises(SecurityConfigError):
            jobs.attach(req)
        assert keeper.kept()["j"].launchers == set()  # not held for a launcher that never attached
        (root / "j").mkdir()
        assert keeper.sweep() == ["j"] and not (root / "j").exists()  # so it ages out like any orphan
        assert jobs.reporters() == []
    finally:
        shutil.rmtree(root, ignore_errors=True)

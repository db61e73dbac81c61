"""pid_alive against real processes: this one, a zombie (exited, not reaped) and a reaped one; and the run
registry, which uses it, dropping the record of a launcher that is a zombie although its socket file stayed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from trainguard.agent import job_registry
from trainguard.agent.pids import pid_alive


def _zombie() -> subprocess.Popen:
    """A child that has exited and is not reaped yet (poll/wait not called)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while True:
        with open(f"/proc/{p.pid}/stat", "rb") as fh:
            if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return p
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.02)


def test_live_zombie_and_reaped_processes() -> None:
    assert pid_alive(os.getpid())
    p = _zombie()
    try:
        assert not pid_alive(p.pid)
    finally:
        p.wait()
    assert not pid_alive(p.pid)


def test_a_zombie_launchers_record_is_dropped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(job_registry.REGISTRY_DIR_ENV, str(tmp_path))
    sock = tmp_path / "launcher.sock"
    sock.touch()  # a launcher killed with SIGKILL leaves its socket file behind
    p = _zombie()
    try:
        for pid, job in ((os.getpid(), "alive"), (p.pid, "zombie")):
            (tmp_path / f"{pid}.json").write_text(
                json.dumps({"job": job, "pid": pid, "socket": str(sock), "started": time.time()}))
        assert [r.job for r in job_registry.live_runs()] == ["alive"]
        assert not (tmp_path / f"{p.pid}.json").exists()
    finally:
        p.wait()


def test_run_records_under_a_folder_another_user_controls_are_not_trusted(tmp_path: Path, monkeypatch) -> None:
    """/tmp/trainguard-<uid> is a name anyone can create first; its owner could then swap the records and point
    `trainguard status` at a socket of theirs. Only the leaf runs/ folder's owner used to be checked."""
    import tempfile

    monkeypatch.delenv(job_registry.REGISTRY_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sock = tmp_path / "launcher.sock"
    sock.touch()
    path = job_registry.register("mine", str(sock))  # a fresh parent: created private, trusted
    assert path is not None and [r.job for r in job_registry.live_runs()] == ["mine"]
    parent = Path(job_registry.registry_dir()).parent
    assert parent.stat().st_mode & 0o777 == 0o700
    parent.chmod(0o777)  # a folder others may write: records could be swapped under it
    assert job_registry.live_runs() == [] and job_registry.register("mine", str(sock)) is None
    parent.chmod(0o700)
    if os.geteuid() == 0:
        os.chown(parent, 65534, 65534)  # pre-created by another user (nobody)
        assert job_registry.live_runs() == [] and job_registry.register("mine", str(sock)) is None

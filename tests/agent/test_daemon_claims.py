"""The daemon's lock files on a full filesystem, and the global --log-level reaching the daemon."""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

import pytest

from trainguard.agent.config import LOG_LEVEL_ENV, AgentConfigError


@pytest.fixture
def full_tmpfs(tmp_path: Path):
    """A 64 KiB tmpfs filled to the last block, as a /dev/shm full of leftover arenas."""
    d = tmp_path / "full"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], check=False).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        fd = os.open(d / "fill", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_lock_file_that_cannot_be_written_names_the_setting(full_tmpfs: Path) -> None:
    """Black-box review: the pid write's ENOSPC (no file name) reached the CLI as "cannot write the output
    (standard output)", exit 74, and an empty agent.lock stayed behind."""
    from trainguard.agent.daemon_claims import lock_state_dir

    state = full_tmpfs / "state"
    state.mkdir()
    with pytest.raises(AgentConfigError, match=r"agent.state_dir: cannot write .*agent.lock \(No space left on "
                                               r"device\); free space there or pick another --state-dir"):
        lock_state_dir(str(state))
    assert not (state / "agent.lock").exists()


def test_a_full_memory_root_still_takes_the_keepers_lock(full_tmpfs: Path, caplog) -> None:
    from trainguard.agent.arena_keeper import drop_root, hold_root

    root = str(full_tmpfs / "shm")
    os.mkdir(root)
    try:
        assert hold_root(root) is True
        assert "cannot write this daemon's pid" in caplog.text and "is full" in caplog.text
    finally:
        drop_root(root)


def test_the_global_log_level_reaches_the_daemon_and_only_when_given(monkeypatch) -> None:
    """Black-box review: `trainguard --log-level ERROR agent` logged at its config file's level."""
    from trainguard.cli_support import setup_logging

    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    setup_logging(argparse.Namespace(log_level=None))
    assert LOG_LEVEL_ENV not in os.environ  # unsaid: the daemon's config decides
    setup_logging(argparse.Namespace(log_level="ERROR"))
    assert os.environ[LOG_LEVEL_ENV] == "error"

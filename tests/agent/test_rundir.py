"""Run folders of dead launchers are removed by the next launcher (agent/rundir.py), with real locks, processes
and unix sockets: a folder whose owner lock is free (its launcher died by SIGKILL) goes, one whose owner lives
stays, even when its socket no longer answers (a launcher draining its persist process at the end); folders of
older versions (no lock) go only when a day old with a dead socket; other ``tg-*`` names stay (found by a user's
review: 765 such folders on one machine)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from trainguard.agent.rundir import LOCK_NAME, SOCKET_NAME, owner_gone, reap_stale_rundirs

HOLD = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")


def _folder(tmp: Path, name: str, age_s: float, lock: bool, dead_socket: bool) -> Path:
    d = tmp / name
    d.mkdir()
    if lock:
        (d / LOCK_NAME).touch()
    if dead_socket:  # bound, never listened on, closed: the file stays and refuses, as after a SIGKILL
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(d / SOCKET_NAME))
        s.close()
    old = time.time() - age_s
    os.utime(d, (old, old))
    return d


def test_only_folders_whose_owner_is_gone_are_removed(tmp_path: Path, tg_env: dict) -> None:
    dead = _folder(tmp_path, "tg-dead0001", 3600, lock=True, dead_socket=True)
    killed = _folder(tmp_path, "tg-kill0001", 3600, lock=True, dead_socket=False)
    live = _folder(tmp_path, "tg-live0001", 3600, lock=True, dead_socket=True)  # its socket is gone, it is not
    legacy_old = _folder(tmp_path, "tg-lgcy0001", 2 * 86400, lock=False, dead_socket=True)
    legacy_recent = _folder(tmp_path, "tg-lgcy0002", 3600, lock=False, dead_socket=True)
    young = _folder(tmp_path, "tg-young001", 1, lock=True, dead_socket=True)
    drill = _folder(tmp_path, "tg-soak-12345", 3600, lock=True, dead_socket=True)
    holders = []
    try:
        for d in (live, killed):
            p = subprocess.Popen([sys.executable, "-c", HOLD, str(d / LOCK_NAME)], env=tg_env, stdout=subprocess.PIPE,
                                 text=True)
            assert p.stdout.readline().strip() == "held"
            holders.append(p)
        os.kill(holders[1].pid, signal.SIGKILL)  # killed's launcher dies: the kernel drops its lock
        holders[1].wait(10)
        for d in (live, killed):  # a touch while the holders started made them young again
            os.utime(d, (time.time() - 3600,) * 2)
        assert owner_gone(str(live)) is False and owner_gone(str(killed)) is True and owner_gone(str(legacy_old)) is None
        assert sorted(reap_stale_rundirs(str(tmp_path))) == sorted([str(dead), str(killed), str(legacy_old)])
        for kept in (live, legacy_recent, young, drill):
            assert kept.is_dir(), kept
    finally:
        for p in holders:
            if p.poll() is None:
                p.kill()
                p.wait()

"""Run folders of dead launchers are removed by the next launcher (agent/rundir.py), with real unix sockets: a
folder whose ``agent.sock`` refuses connections (its launcher died by SIGKILL) goes; a live launcher's (a socket
someone listens on), a young one, one without a socket and other ``tg-*`` names stay (found by a user's review:
765 such folders on one machine)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from trainguard.agent.rundir import MIN_AGE_S, SOCKET_NAME, reap_stale_rundirs, socket_dead


def _rundir(tmp: Path, name: str, listening: bool | None, age_s: float) -> tuple[Path, socket.socket | None]:
    d = tmp / name
    d.mkdir()
    s = None
    if listening is not None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(d / SOCKET_NAME))
        if listening:
            s.listen(1)
        else:
            s.close()  # the file stays, nobody listens: what a SIGKILLed server leaves
            s = None
    old = time.time() - age_s
    os.utime(d, (old, old))
    return d, s


def test_only_folders_of_dead_launchers_are_removed(tmp_path: Path) -> None:
    dead, _ = _rundir(tmp_path, "tg-dead0001", listening=False, age_s=3600)
    live, server = _rundir(tmp_path, "tg-live0001", listening=True, age_s=3600)
    young, _ = _rundir(tmp_path, "tg-young001", listening=False, age_s=MIN_AGE_S / 2)
    nosock, _ = _rundir(tmp_path, "tg-nosock01", listening=None, age_s=3600)
    drill, _ = _rundir(tmp_path, "tg-soak-12345", listening=False, age_s=3600)
    try:
        assert socket_dead(str(dead / SOCKET_NAME)) and not socket_dead(str(live / SOCKET_NAME))
        assert reap_stale_rundirs(str(tmp_path)) == [str(dead)]
        assert not dead.exists() and live.is_dir() and young.is_dir() and nosock.is_dir() and drill.is_dir()
    finally:
        if server is not None:
            server.close()

"""Socket files of persist processes killed with SIGKILL do not pile up in the temp directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil
import pytest

from trainguard.checkpoint.service import CheckpointService

# A worker with a private persist process, driven over stdin: "save N" saves and waits, then prints the persist
# process's pid, its socket, and the sockets in $TMPDIR.
WORKER = textwrap.dedent("""
    import json, os, sys, torch
    from trainguard.checkpoint import Checkpointer, CheckpointConfig

    cfg = CheckpointConfig(directory=sys.argv[1], memory={"directory": sys.argv[2]})
    ck = Checkpointer(cfg, job=sys.argv[3])
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "save":
            ok = ck.save({"w": torch.full((4,), float(cmd[1]))}, int(cmd[1])).wait(60)
            if not ok:  # the save racing the persist process's death fails; the next one starts a new process
                ok = ck.save({"w": torch.full((4,), float(cmd[1]))}, int(cmd[1])).wait(60)
            proc = ck._channel.proc
            print(json.dumps({"ok": ok, "pid": proc.pid, "sock": proc.args[proc.args.index("--socket") + 1],
                              "socks": sorted(n for n in os.listdir(os.environ["TMPDIR"]) if n.endswith(".sock"))}),
                  flush=True)
""")


def _ask(p: subprocess.Popen[str], line: str) -> dict:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()
    out = p.stdout.readline()
    assert out, f"worker died answering {line!r}"
    return json.loads(out)


def _kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:  # dead; its parent reaps it later
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} survived SIGKILL")


@pytest.fixture
def sock_dir():
    # Short: a unix socket path holds 107 bytes; a pytest tmp_path may not leave room for the socket's name.
    d = tempfile.mkdtemp(prefix="tgs-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_sockets_of_persist_processes_killed_with_sigkill_are_removed(tmp_path, shm_dir, sock_dir, tg_env,
                                                                       monkeypatch):
    # A persist process killed with kill -9 cannot unlink its socket, and each private persist process gets a new
    # name: a long-lived node collected /tmp/trainguard-ckpt-*.sock files without bound.
    env = dict(tg_env, TMPDIR=sock_dir)
    cmd = [sys.executable, "-c", WORKER, str(tmp_path / "ckpt"), shm_dir]
    a = subprocess.Popen(cmd + ["a"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    dead_pid_proc = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_pid_proc.wait()
    dead_pid = dead_pid_proc.pid
    keepers = []
    try:
        first = _ask(a, "save 0")
        assert first["ok"] and first["socks"] == [os.path.basename(first["sock"])]
        _kill9(first["pid"])
        # The worker lives on and starts a new persist process at its next save: the dead one's socket goes.
        second = _ask(a, "save 1")
        assert second["ok"] and second["pid"] != first["pid"]
        assert second["socks"] == [os.path.basename(second["sock"])], second["socks"]

        # Sockets that must stay: one a live process listens on although its name's pid is gone, and one nobody
        # listens on whose name's pid (this test) lives (an agent between two starts of its service).
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listening.bind(os.path.join(sock_dir, f"trainguard-ckpt-{dead_pid}-live.sock"))
        listening.listen(1)
        unbound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unbound.bind(os.path.join(sock_dir, f"trainguard-ckpt-{os.getpid()}-restarting.sock"))
        unbound.close()
        keepers = [listening]
        with open(os.path.join(sock_dir, f"trainguard-ckpt-{dead_pid}-file.sock"), "w"):
            pass  # not a socket: not ours to judge

        # The node loses the worker and its persist process at once (kill -9 of both): the next start cleans up.
        _kill9(second["pid"])
        _kill9(a.pid)
        a.wait()  # its parent (the agent, a shell) reaps it
        stale = os.path.basename(second["sock"])
        assert stale in os.listdir(sock_dir)
        # The next start on the node (here the agent's service of a new job, in this process) sweeps the folder.
        monkeypatch.setattr(tempfile, "tempdir", sock_dir)
        svc = CheckpointService(job="next", shm_dir=shm_dir).start()
        try:
            assert sorted(os.listdir(sock_dir)) == sorted([
                os.path.basename(svc.address), f"trainguard-ckpt-{dead_pid}-file.sock",
                f"trainguard-ckpt-{dead_pid}-live.sock", f"trainguard-ckpt-{os.getpid()}-restarting.sock"])
        finally:
            svc.stop()
        assert os.path.basename(svc.address) not in os.listdir(sock_dir)  # a clean stop removes its own
    finally:
        for s in keepers:
            s.close()
        if a.poll() is None:
            a.kill()
            a.wait()


def test_stop_of_a_service_it_had_to_kill_removes_the_socket(sock_dir, shm_dir):
    # A service that does not drain within stop()'s timeout (here: stopped with SIGSTOP) is killed with SIGKILL,
    # so it cannot unlink its socket file: stop() removes it, as nothing listens there any more.
    svc = CheckpointService(job="hung", socket_path=os.path.join(sock_dir, "hung.sock"), shm_dir=shm_dir).start()
    pid = svc.pid
    assert pid is not None
    try:
        os.kill(pid, signal.SIGSTOP)
        svc.stop(timeout=0.5)
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert os.listdir(sock_dir) == [], "stop() left the killed service's socket file behind"
    finally:
        if svc.proc is not None:  # stop() failed before killing it
            svc.proc.kill()
            svc.proc.wait()

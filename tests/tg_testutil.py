"""Helpers shared by the integration tests: run the CLI in a subprocess, find processes a test left behind.

(A uniquely named module rather than ``conftest``: several folders have a conftest.py, and ``from conftest
import`` would pick whichever was imported first.)
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train.py"

#: Test ports come from below this (or the kernel's ephemeral range, when it starts lower) ...
_PORTS_BELOW = 32768
#: ... and from here up, a block for each xdist worker.
_PORTS_FROM = 15000
_PORT_BLOCKS = 8
#: torchrun's and c10d's defaults (29400, 29500 and the ports next to them): a launch given no port takes them.
_DEFAULT_PORTS = range(29390, 29610)
_port_lock = threading.Lock()
_port_seq: itertools.count | None = None


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _PORTS_BELOW


def _bindable(port: int, host: str) -> bool:
    """Whether ``port`` binds on ``host`` and on the wildcard address without SO_REUSEADDR (no listener, no
    bound socket, no TIME_WAIT left there)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for address in {host, "::" if family == socket.AF_INET6 else "0.0.0.0"}:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, port))
            except OSError:
                return False
    return True


def ipv6_loopback() -> bool:
    """Whether this host can bind ``::1`` (containers often run without IPv6)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now that no other process takes by chance before the test's process binds it.

    A port found by binding port 0 and closing comes from the kernel's ephemeral range, from which every
    ``bind(0)`` and outgoing connection on the box draws too (the other xdist worker's launchers, gRPC channels,
    etcd): taken in the seconds before a test's subprocess bound it (a torch import, a restart of a killed
    server on the same port), the test failed. These come from below that range, from a block of this xdist
    worker's own, in turn from a random start (a port is not handed out twice in a session).
    """
    global _port_seq
    low = min(_PORTS_BELOW, _ephemeral_low())
    if low - _PORTS_FROM < 1000 * _PORT_BLOCKS:  # an unusual ephemeral range: the kernel's choice, as before
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    size = (low - _PORTS_FROM) // _PORT_BLOCKS
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    base = _PORTS_FROM + (index % _PORT_BLOCKS) * size
    with _port_lock:
        if _port_seq is None:
            _port_seq = itertools.count(random.randrange(size))
        for _ in range(size):
            port = base + next(_port_seq) % size
            if port not in _DEFAULT_PORTS and _bindable(port, host):
                return port
    raise RuntimeError(f"no free port in {base}..{base + size - 1}")


def marked_processes(marker: str) -> list[psutil.Process]:
    """Live processes whose environment has ``TG_TEST_MARKER=marker``."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("TG_TEST_MARKER") == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def run_cli(args: list[str], env: dict, timeout: float = 90.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs ``trainguard ARGS`` to completion; kills its whole session on timeout."""
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", *args], env=env, cwd=cwd or REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"trainguard {' '.join(args)} timed out\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def until(cond, timeout: float = 10.0) -> bool:
    """Polls ``cond`` every 10 ms until it holds or ``timeout`` seconds pass (the CI machine may be busy: no
    fixed sleeps for things that must happen). Returns whether it held."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str, str]]:
    """Waits for every process (``timeout`` s each) and returns ``(returncode, stdout, stderr)`` of each; any
    still running when this ends (a timeout, an assertion of the caller's) is killed and reaped."""
    out = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout or "", stderr or ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def fill_fs(directory: str | os.PathLike, leave_pages: int) -> Path:
    """Fills the file system of ``directory`` as another process would (DataLoader workers sharing tensors in
    /dev/shm, another job's files), leaving ``leave_pages`` 4 KiB pages free; returns the filler file."""
    path = Path(directory) / "filler"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\0" * 4096) == 4096:
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    os.truncate(path, max(0, os.path.getsize(path) - leave_pages * 4096))
    return path


class HookLinkFake:
    """The agent side of the training hook's link (``Session._agent``), recording what the hook sends: each step
    heartbeat as ``(step, step time, sections)`` and each pause of hang detection (``quiet``)."""

    def __init__(self) -> None:
        self.beats: list[tuple] = []
        self.quiet: list[bool] = []
        self.checkpoints: list[tuple[int, str]] = []

    def beat(self, step: int, dt: float, sections=None) -> None:
        self.beats.append((step, dt, sections))

    def set_quiet(self, quiet: bool, timeout: float = 2.0) -> bool:
        self.quiet.append(quiet)
        return True

    def report_checkpoint(self, step: int, tier: str, nbytes: int, stall_s: float, *args, **kwargs) -> None:
        self.checkpoints.append((step, tier))

    def take_advisories(self) -> list:
        return []

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


def gated_store(reads: bool = False):
    """The real in-memory coordinator store whose commits (and, with ``reads``, reads) hang while its ``gate``
    event is clear: a store that accepts but does not answer (etcd stopped, a stuck disk). Set by default."""
    import threading

    from trainguard.recovery.store import MemoryStore

    class GatedStore(MemoryStore):
        def __init__(self) -> None:
            super().__init__()
            self.gate = threading.Event()
            self.gate.set()

        def get(self, key):
            if reads:
                self.gate.wait(60)
            return super().get(key)

        def scan(self, prefix):
            if reads:
                self.gate.wait(60)
            return super().scan(prefix)

        def commit(self, compares, puts):
            self.gate.wait(60)
            return super().commit(compares, puts)

    return GatedStore()

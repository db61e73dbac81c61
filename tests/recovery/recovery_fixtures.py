"""Fixtures of the recovery tests (imported by name: no conftest.py here, so `from conftest import ...` in other
folders keeps resolving to tests/conftest.py): a real etcd server on loopback, skipped with a reason when absent."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import tg_testutil

ETCD_BINARY = shutil.which("etcd")
ETCD_SKIP_REASON = "etcd binary not found: install Debian's etcd-server package (apt-get install -y etcd-server)"


def _free_port() -> int:
    return tg_testutil.free_port()


def free_port() -> int:
    """A TCP port free on loopback right now."""
    return _free_port()


def start_etcd(data: Path, client: int, peer: int, log: object, name: str = "tg-test", cluster: str = "",
               wait: bool = True) -> subprocess.Popen:
    """Starts etcd on loopback with its data in ``data/d`` (``data/<name>`` for a member of ``cluster``, an
    ``--initial-cluster`` value) and waits until it is healthy unless ``wait`` is off (a cluster's members are
    healthy only once a quorum runs: start them all, then :func:`wait_etcd`). A restart with the same arguments
    keeps the data."""
    proc = subprocess.Popen(
        [ETCD_BINARY, "--name", name, "--data-dir", str(data / (name if cluster else "d")),
         "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
         "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-cluster", cluster or f"{name}=http://127.0.0.1:{peer}", "--log-level", "error",
         # a member that lost its peers notices within 0.1 s, not etcd's default second
         *(("--heartbeat-interval", "20", "--election-timeout", "100") if cluster else ())],
        stdout=log, stderr=subprocess.STDOUT)
    if wait:
        wait_etcd(proc, client, data)
    return proc


def wait_etcd(proc: subprocess.Popen, client: int, data: Path) -> None:
    """Waits until the etcd serving ``client`` reports itself healthy (kills it when it does not start)."""
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=1) as r:
                if b"true" in r.read():
                    return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"etcd did not start: {Path(data / 'etcd.log').read_text()[-2000:]}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Starts one etcd on loopback with a temp data dir for the session; yields ``host:port``."""
    if ETCD_BINARY is None:
        pytest.skip(ETCD_SKIP_REASON)
    data = tmp_path_factory.mktemp("etcd")
    client, peer = _free_port(), _free_port()
    log = open(data / "etcd.log", "wb")
    proc = start_etcd(data, client, peer, log)
    try:
        yield f"127.0.0.1:{client}"
    finally:
        proc.kill()
        proc.wait()
        log.close()

"""sd_notify datagrams to a socket the test owns (path and abstract), and watchdog pacing."""

from __future__ import annotations

import os
import socket

import pytest

from trainguard.agent.sdnotify import SystemdNotifier, Watchdog, watchdog_interval


@pytest.fixture
def listener(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    sock.bind(path)
    sock.settimeout(2)
    yield sock, path
    sock.close()


def test_fields_arrive_as_one_datagram(listener):
    sock, path = listener
    n = SystemdNotifier(path)
    assert n.ready("serving 3 detectors\nsecond line")
    assert sock.recv(4096).decode() == "READY=1\nSTATUS=serving 3 detectors second line"
    assert n.reloading()
    fields = dict(line.split("=", 1) for line in sock.recv(4096).decode().splitlines())
    assert fields["RELOADING"] == "1" and int(fields["MONOTONIC_USEC"]) > 0
    assert n.stopping("stopping")
    assert sock.recv(4096).decode() == "STOPPING=1\nSTATUS=stopping"
    n.close()


def test_abstract_socket():
    name = f"trainguard-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(2)
    try:
        assert SystemdNotifier("@" + name).status("hello")
        assert sock.recv(100) == b"STATUS=hello"
    finally:
        sock.close()


def test_disabled_and_unreachable_never_raise(tmp_path):
    assert not SystemdNotifier(None).ready()
    env = {"NOTIFY_SOCKET": str(tmp_path / "gone.sock")}
    n = SystemdNotifier.from_env(env)
    assert "NOTIFY_SOCKET" not in env  # workers must not inherit it
    assert n.enabled and not n.ready()


def test_watchdog_interval_from_env():
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "4000000"}) == 4.0
    assert watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}) == 4.0
    assert watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None


def test_watchdog_pings_at_half_interval_only_when_healthy(listener):
    sock, path = listener
    wd = Watchdog(SystemdNotifier(path), interval_s=2.0)
    assert wd.tick(True, now=100.0)
    assert not wd.tick(True, now=100.5)  # not due yet (period 1 s)
    assert not wd.tick(False, now=101.5)  # due, but unhealthy: silence so systemd restarts us
    assert wd.tick(True, now=101.6)
    assert wd.pings == 2
    assert [sock.recv(100), sock.recv(100)] == [b"WATCHDOG=1", b"WATCHDOG=1"]
    assert wd.seconds_until_due(now=102.0) == pytest.approx(0.6)
    assert not Watchdog(SystemdNotifier(path), None).tick(True)

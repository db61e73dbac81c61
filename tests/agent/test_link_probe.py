"""The agent's link probes (agent/link_probe.py) over real TCP sockets on loopback."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from trainguard.agent.echo_probe import EchoProbeServer, ProbeError, probe_once
from trainguard.agent.link_probe import LinkProber
from trainguard.proto import coordinator_pb2


def test_a_probe_moves_the_bytes_both_ways_and_times_each_direction():
    srv = EchoProbeServer("127.0.0.1")
    try:
        up, down = probe_once("127.0.0.1", srv.port, 2 << 20, timeout_s=20)
        assert up > 0 and down > 0
        deadline = time.monotonic() + 5
        while srv.served < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.served == 1
    finally:
        srv.close()


def test_a_closed_listener_is_a_probe_error_not_a_hang():
    srv = EchoProbeServer("127.0.0.1")
    port = srv.port
    srv.close()
    with pytest.raises(ProbeError, match=str(port)):
        probe_once("127.0.0.1", port, 4096, timeout_s=2)


def test_the_listener_drops_a_connection_asking_for_too_much_and_keeps_serving():
    srv = EchoProbeServer("127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
            s.sendall(struct.pack("!Q", 1 << 40))
            assert s.recv(1) == b""  # closed without an answer
        assert probe_once("127.0.0.1", srv.port, 4096, timeout_s=5)[0] > 0
    finally:
        srv.close()


def test_the_prober_runs_each_ask_once_and_reports_failures_by_probe():
    a, b = LinkProber("127.0.0.1"), LinkProber("127.0.0.1")
    try:
        assert a.port > 0 and b.port > 0 and a.port != b.port
        ok = coordinator_pb2.LinkProbeAsk(probe_id="p1", peer_node="b", peer_address="127.0.0.1", peer_port=b.port,
                                          bytes=1 << 20, timeout_s=10)
        dead = coordinator_pb2.LinkProbeAsk(probe_id="p2", peer_node="x", peer_address="127.0.0.1", peer_port=1,
                                            bytes=4096, timeout_s=2)
        a.run([ok, dead])
        a.run([ok])  # asked again in the next reply: not run twice
        got = []
        deadline = time.monotonic() + 15
        while len(got) < 2 and time.monotonic() < deadline:
            got += a.drain()
            time.sleep(0.02)
        time.sleep(0.2)
        got += a.drain()
        by = {r.probe_id: r for r in got}
        assert sorted(by) == ["p1", "p2"] and len(got) == 2
        assert by["p1"].up_s > 0 and by["p1"].down_s > 0 and not by["p1"].error and by["p1"].bytes == 1 << 20
        assert by["p2"].error and "127.0.0.1:1" in by["p2"].error
    finally:
        a.close()
        b.close()


def test_a_node_that_cannot_listen_reports_port_zero():
    p = LinkProber("192.0.2.1")  # TEST-NET-1: not an address of this host
    assert p.port == 0
    p.close()

"""The peer check's parts on loopback: the echo server, one timed exchange, and the comparison with the reference."""

from __future__ import annotations

import socket
import struct

from trainguard.agent.qualify import CheckStatus, QualifySection
from trainguard.agent.qualify.base import QualifyContext
from trainguard.agent.echo_probe import MAX_PROBE_BYTES, EchoProbeServer
from trainguard.agent.qualify.peers import Peer, PeerSet, exchange
from trainguard.agent.qualify.runner import qualify_node


def ctx_with(source, **fields) -> QualifyContext:
    section = QualifySection(checks=["peers"], peer_kib=64, **fields)
    section.validate()
    return QualifyContext("n9", section, peer_source=source)


def test_echo_server_returns_the_bytes_and_drops_oversized_requests() -> None:
    server = EchoProbeServer("127.0.0.1")
    try:
        took = exchange(Peer("p", "127.0.0.1", server.port), 100_000, timeout_s=5)
        assert 0 < took < 5
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(struct.pack("!Q", MAX_PROBE_BYTES + 1))
            assert s.recv(1) == b""  # closed without reading gigabytes
    finally:
        server.close()


def test_peer_check_records_its_time_passes_within_the_ratio_and_fails_beyond() -> None:
    servers = [EchoProbeServer("127.0.0.1") for _ in range(2)]
    try:
        peers = tuple(Peer(f"p{i}", "127.0.0.1", s.port) for i, s in enumerate(servers))
        asked: list[int] = []

        def source(reference_s: float, history: int):
            def ask(count: int) -> PeerSet:
                asked.append(count)
                return PeerSet(peers, reference_s, history)
            return ask

        verdict = qualify_node(ctx_with(source(0.0, 0)))
        r = verdict.results[0]
        assert r.status is CheckStatus.PASS and "no reference yet (0 earlier node(s), 3 needed)" in r.detail
        assert verdict.peer_s == r.measured_s > 0 and asked == [3]
        verdict = qualify_node(ctx_with(source(3600.0, 5)))  # a very slow reference: this node is fast
        assert verdict.passed and "qualified node(s)" in verdict.results[0].detail
        verdict = qualify_node(ctx_with(source(1e-9, 5)))  # a reference no real exchange can meet
        r = verdict.results[0]
        assert r.status is CheckStatus.FAIL and "median of 5 qualified node(s) (limit 3x)" in r.detail
        assert verdict.to_pb(echo_port=1234).peer_s == verdict.peer_s
    finally:
        for s in servers:
            s.close()


def test_peer_check_skips_without_peers_and_fails_when_none_answers() -> None:
    assert qualify_node(ctx_with(None)).results[0].status is CheckStatus.SKIP
    assert qualify_node(ctx_with(lambda n: PeerSet())).results[0].status is CheckStatus.SKIP
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = Peer("gone", "127.0.0.1", s.getsockname()[1])
    r = qualify_node(ctx_with(lambda n: PeerSet((dead,), 0.01, 5))).results[0]
    assert r.status is CheckStatus.FAIL and r.detail.startswith("no peer answered over the data network: gone")

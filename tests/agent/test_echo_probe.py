"""One echo listener per node: qualification's peer check and fail-slow's link probes share it, and a real
coordinator gets the same port from the verdict and from the heartbeats."""

from __future__ import annotations


import pytest

from trainguard.agent.echo_probe import EchoListener, ProbeError, probe_once
from trainguard.agent.node import NodeAgent, NodeConfig
from trainguard.agent.qualify import QualifySection
from trainguard.recovery import CoordinatorServer, JobSpec


@pytest.fixture
def coordinator():
    srv = CoordinatorServer(JobSpec(job="echo", nnodes=1, heartbeat_interval_s=0.1), listen="127.0.0.1:0").start()
    yield srv
    srv.stop()


def test_the_verdict_and_the_heartbeats_carry_the_one_listeners_port(coordinator) -> None:
    section = QualifySection(checks=["peers"])
    section.validate()
    agent = NodeAgent(NodeConfig(job="echo", coordinator=coordinator.target, argv=["x"], node_id="n1", spare=True,
                                 qualify=section, detectors=(), address="127.0.0.1"))
    assert agent.link.qualifier.echo is None and agent.link_probe.listener is agent.echo
    agent.link.open()  # qualifies (peers: none yet), then registers with the verdict
    try:
        assert agent.link.qualifier.echo is agent.echo and agent.echo.port > 0
        assert agent.link.heartbeat(agent._beat_content) is not None
        member = coordinator.core.members()["n1"]
        assert member.echo_port == agent.echo.port
        assert coordinator.core._failslow._probe_ports["n1"] == agent.echo.port
        up, down = probe_once("127.0.0.1", agent.echo.port, 1 << 16, timeout_s=10)  # and it answers probes
        assert up > 0 and down > 0
    finally:
        agent.link.close()
        agent.echo.close()


def test_a_listener_that_cannot_listen_says_port_0_and_a_closed_one_refuses() -> None:
    listener = EchoListener("192.0.2.1")  # TEST-NET-1: not an address of this host
    assert listener.port == 0 and listener.port == 0  # tried once
    listener = EchoListener("127.0.0.1")
    port = listener.port
    assert port > 0 and listener.port == port  # started once, kept
    listener.close()
    with pytest.raises(ProbeError, match=str(port)):
        probe_once("127.0.0.1", port, 4096, timeout_s=2)

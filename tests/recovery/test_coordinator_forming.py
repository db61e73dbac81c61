"""The first generation's wait for nodes, as agents and operators read it over real gRPC: the count of registered
nodes ("N of M registered", and ``forming_missing``, each agent's join timeout) counts only live nodes that are
not spares, and the last call for nodes beyond ``--nnodes`` starts again when the count falls below it."""

from __future__ import annotations

import time

import grpc
import pytest
from coordinator_client import Agent, node_info

from trainguard.proto import coordinator_pb2 as pb
from trainguard.proto import coordinator_pb2_grpc
from trainguard.recovery import CoordinatorServer, JobSpec

JOB = "forming"


@pytest.fixture
def serve(tmp_path):
    """Starts a coordinator for JOB with the given spec fields; stops every one started."""
    started = []

    def start(**fields) -> tuple[CoordinatorServer, coordinator_pb2_grpc.CoordinatorStub]:
        srv = CoordinatorServer(JobSpec(job=JOB, heartbeat_interval_s=0.05, lease_timeout_s=30,
                                        store=f"sqlite://{tmp_path}/f{len(started)}.db", **fields)).start()
        chan = grpc.insecure_channel(srv.target)
        started.append((srv, chan))
        return srv, coordinator_pb2_grpc.CoordinatorStub(chan)

    yield start
    for srv, chan in started:
        chan.close()
        srv.stop(0)


def test_spares_are_not_counted_as_registered_nodes_of_the_first_generation(serve) -> None:
    _, stub = serve(nnodes=3)
    a = Agent(stub, JOB, node_info("a", idx=0))
    Agent(stub, JOB, node_info("s1", idx=1, spare=True))
    resp = a.beat()
    # Counted with the spare, it read "2 of 3" and told the agents one node was missing.
    assert resp.command == pb.NODE_COMMAND_WAIT and "waiting for nodes: 1 of 3 registered (a)" in resp.message, \
        resp.message
    assert resp.forming_missing == 2
    Agent(stub, JOB, node_info("s2", idx=2, spare=True))  # spares alone never make the count
    resp = a.beat()
    assert "1 of 3 registered" in resp.message and resp.forming_missing == 2, resp.message
    b = Agent(stub, JOB, node_info("b", idx=3))
    resp = b.beat()
    assert "2 of 3 registered (a, b)" in resp.message and resp.forming_missing == 1, resp.message
    Agent(stub, JOB, node_info("c", idx=4))
    deadline = time.monotonic() + 10
    while a.gen != 1:
        assert time.monotonic() < deadline, a.last.message
        a.beat()
        time.sleep(0.02)
    assert sorted(n.node_id for n in a.table.nodes) == ["a", "b", "c"]


def test_the_last_call_starts_again_when_a_node_leaves_below_the_minimum(serve) -> None:
    _, stub = serve(nnodes=2, max_nodes=3, last_call_s=0.3)
    a, b = Agent(stub, JOB, node_info("a", idx=0)), Agent(stub, JOB, node_info("b", idx=1))
    assert "last call" in a.beat().message  # enough to start: the job waits 0.3 s for a third node
    stub.LeaveNode(pb.LeaveNodeRequest(job=JOB, node_id="b", lease_id=b.lease, reason="gave up"), timeout=10)
    resp = a.beat()
    assert "1 of 2 registered" in resp.message and resp.forming_missing == 1, resp.message
    time.sleep(0.4)  # past the first last call's end
    b = Agent(stub, JOB, node_info("b", idx=1))
    # MIN again: a new last call, not the one that ran out while the job had too few nodes.
    resp = a.beat()
    assert a.gen < 0 and "last call" in resp.message, resp.message


def test_cordoned_live_nodes_are_not_counted_as_registered_nodes_of_the_first_generation(serve) -> None:
    """A registered node whose daemon reported it fatal keeps beating but never gets a slot: counted, the agents
    read "2 of 3 registered" and ``forming_missing`` 1 while two nodes were still missing."""
    _, stub = serve(nnodes=3)
    a = Agent(stub, JOB, node_info("a", idx=0))
    b = Agent(stub, JOB, node_info("b", idx=1))
    verdict = stub.ReportNodeHealth(pb.NodeHealthReportRequest(job=JOB, node_id="b", host="h", agent_instance="d",
                                                               verdict=pb.NODE_HEALTH_VERDICT_FATAL,
                                                               reason="pcie: AER fatal"), timeout=10)
    assert verdict.cordoned
    b.beat()
    resp = a.beat()
    assert resp.command == pb.NODE_COMMAND_WAIT and "waiting for nodes: 1 of 3 registered (a)" in resp.message, \
        resp.message
    assert resp.forming_missing == 2
    Agent(stub, JOB, node_info("c", idx=2))
    resp = a.beat()  # two counted: still the quick count, not a layout attempt
    assert "2 of 3 registered (a, c)" in resp.message and resp.forming_missing == 1, resp.message
    Agent(stub, JOB, node_info("d", idx=3))
    deadline = time.monotonic() + 10
    while a.gen != 1:
        assert time.monotonic() < deadline, a.last.message
        a.beat()
        time.sleep(0.02)
    assert sorted(n.node_id for n in a.table.nodes) == ["a", "c", "d"]

"""Advisories are acknowledged: an answer that never reaches the worker (its heartbeat call timed out) does not
lose the advisory it carried; a worker from before acknowledgements still gets each advisory once.

Real supervisor with a real worker process, the real local gRPC service on a unix socket and the hook's real link.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from trainguard import hook
from trainguard.agent.event_bus import EventBus
from trainguard.agent.local_server import serve
from trainguard.agent.node import NodeConfig
from trainguard.agent.supervisor import MAX_PENDING_ADVISORIES, LocalSupervisor
from trainguard.proto import agent_pb2, agent_pb2_grpc, common_pb2

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
CKPT = agent_pb2.ADVISORY_KIND_CHECKPOINT_NOW


def _supervisor(tmp_path: Path) -> LocalSupervisor:
    config = NodeConfig(job="ack", coordinator="", argv=SLEEPER, nproc_per_node=1, node_id="n1", standby=False,
                        host_store=False, error_dir=str(tmp_path / "errors"), stop_grace_s=2.0)
    return LocalSupervisor(config)


def _table(generation: int = 1) -> common_pb2.RankTable:
    return common_pb2.RankTable(
        generation=generation, world_size=1, master_addr="127.0.0.1", master_port=29999,
        nodes=[common_pb2.NodeRanks(node_id="n1", first_rank=0, local_world_size=1, group_rank=0)])


class _Node:
    """The served node around a real supervisor. The hook's link runs in this test process, standing in for the
    worker the supervisor started, so its pid is that worker's. ``lose_first`` answers the first heartbeat that
    carries an advisory only after the caller's timeout: that answer never reaches the worker."""

    stopping = False

    def __init__(self, sup: LocalSupervisor, lose_first: float = 0.0) -> None:
        self.sup = sup
        self.bus = EventBus()
        self.lose_first = lose_first
        self.answers: list[list[str]] = []  # advisory ids of each answer, in order
        self._lock = threading.Lock()

    @property
    def generation(self) -> int:
        return self.sup.generation

    def on_worker_heartbeat(self, rank, pid, generation, step, step_time_s, finished=False, sections=None,
                            acked=None) -> list:
        worker_pid = self.sup.group.by_rank(rank).pid
        out = self.sup.on_heartbeat(rank, worker_pid, generation, step, step_time_s, finished, sections, acked)
        with self._lock:
            self.answers.append([a.advisory_id for a in out])
            lose, self.lose_first = (self.lose_first, 0.0) if out else (0.0, self.lose_first)
        time.sleep(lose)  # the caller has given up by now: this answer is lost
        return out

    def on_checkpoint_report(self, report) -> None:
        pass


@pytest.fixture
def served(tmp_path: Path):
    sup = _supervisor(tmp_path)
    sup.start(_table())
    servers = []

    def start(lose_first: float = 0.0) -> tuple[_Node, str]:
        node = _Node(sup, lose_first)
        sock = str(tmp_path / f"a{len(servers)}.sock")
        server, _ = serve(node, sock)
        servers.append(server)
        return node, sock

    try:
        yield sup, start
    finally:
        for server in servers:
            server.stop(0)
        sup.close()


def test_an_advisory_whose_answer_timed_out_reaches_the_worker_in_a_later_answer(served, monkeypatch) -> None:
    sup, start = served
    monkeypatch.setattr(hook, "HEARTBEAT_TIMEOUT_S", 0.3)
    node, sock = start(lose_first=0.8)
    link = hook._AgentLink(sock, rank=0, generation=1)
    try:
        adv_id = sup.advise(CKPT, "failure predicted")
        got: list[str] = []
        step = 0
        deadline = time.monotonic() + 6
        while adv_id not in got and time.monotonic() < deadline:
            link.beat(step, 0.01)
            step += 1
            time.sleep(0.05)
            got += [a.advisory_id for a in link.take_advisories()]
        assert link.failures >= 1, "the first answer carrying the advisory was not lost"
        assert adv_id in got, f"the advisory never reached the worker; answers: {node.answers}"
        # Once acknowledged, the agent stops handing it out.
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline and not (len(node.answers) >= 2 and node.answers[-1] == []):
            link.beat(step, 0.01)
            step += 1
            time.sleep(0.05)
        assert node.answers[-1] == [], node.answers
    finally:
        link.close()


def test_a_worker_that_does_not_acknowledge_gets_each_advisory_once(served) -> None:
    """A worker from before acknowledgements (no acks_advisories) gets the advisory in its next answer, as
    before, and not in every answer after it (it never acknowledges)."""
    sup, start = served
    _, sock = start()
    pid = sup.group.by_rank(0).pid
    with grpc.insecure_channel(f"unix:{sock}") as channel:
        stub = agent_pb2_grpc.NodeAgentStub(channel)
        adv_id = sup.advise(agent_pb2.ADVISORY_KIND_STOP, "drain")
        beat = agent_pb2.WorkerHeartbeatRequest(rank=0, pid=pid, generation=1, step=1, step_time_s=0.1)
        assert [a.advisory_id for a in stub.WorkerHeartbeat(beat, timeout=5).advisories] == [adv_id]
        beat.step = 2
        assert list(stub.WorkerHeartbeat(beat, timeout=5).advisories) == []


def test_pending_advisories_are_kept_until_acknowledged_bounded_and_dropped_at_a_new_generation(
        tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    try:
        sup.start(_table())
        pid = sup.group.by_rank(0).pid

        def beat(acked):
            return [a.advisory_id for a in sup.on_heartbeat(0, pid, 1, 1, 0.1, acked=acked)]

        first = sup.advise(CKPT, "a")
        assert beat([]) == [first] and beat([]) == [first]  # no acknowledgement yet: again
        second = sup.advise(CKPT, "b")
        assert beat([first]) == [second] and beat([second]) == [] and beat([]) == []
        ids = [sup.advise(CKPT, str(i)) for i in range(MAX_PENDING_ADVISORIES + 5)]
        assert beat([]) == ids[5:]  # the oldest went first
        sup.stop()
        sup.start(_table(generation=2))
        pid = sup.group.by_rank(0).pid
        assert [a.advisory_id for a in sup.on_heartbeat(0, pid, 2, 1, 0.1, acked=[])] == []
    finally:
        sup.close()

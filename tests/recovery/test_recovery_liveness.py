"""Recovery never stalls while capacity exists (issue 12), against real ``trainguard coordinator`` processes:

- group size 4, a p2 node faults while the only spare is in p1: the p1 spare is not used (it would split a
  parallel group across pods), the wait names pod p2, and a p2 spare registering later is used at once, even
  after the p1 spare died;
- no group size, the spare a node-level plan would use dies during the backoff: another same-pod spare
  registered all along takes the slot;
- nothing can ever fill the vacancy (no shrinking): after ``--membership-timeout`` the job FAILS with a reason.
"""

from __future__ import annotations

import pytest
from coordinator_client import Agent, CoordinatorProcess, beat_until, node_info

from trainguard.proto import coordinator_pb2 as pb

NODE = pb.RECOVERY_LEVEL_NODE


@pytest.fixture
def coordinator(tmp_path, tg_env):
    started: list[CoordinatorProcess] = []

    def start(job: str, *flags: str) -> CoordinatorProcess:
        c = CoordinatorProcess(tmp_path, tg_env, job, "--heartbeat-interval", "0.1", *flags)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def _formed(agents: list[Agent], gen: int):
    return lambda: all(a.gen == gen for a in agents)


def test_group_size_vacancy_waits_for_its_own_pod_and_takes_a_late_spare(coordinator) -> None:
    c = coordinator("liveness-groups", "--nnodes", "4", "--group-size", "4", "--lease-timeout", "3",
                    "--membership-timeout", "120")
    nodes = [c.agent(node_info(f"{p}n{i}", p, i)) for p in ("p1", "p2") for i in range(2)]
    spare_p1 = c.agent(node_info("s1", "p1", 9, spare=True))
    beat_until(nodes + [spare_p1], _formed(nodes, 1))
    victim = nodes[3]  # p2n1
    d = victim.fail(level=NODE, kind="gpu.lost")
    assert "replacing" not in d.message and "in pod 'p2'" in d.message, d.message  # s1 would split ranks 4..7
    rest = [n for n in nodes if n is not victim]
    for _ in range(15):
        for a in rest + [spare_p1]:
            a.beat()
    waiting = rest[0].last.message
    assert rest[0].gen == -1 and "'p2'" in waiting and "'p1'" not in waiting.split("cannot")[0], waiting
    assert "generation 2 waits" in c.log() and "in pod 'p1'" not in c.log()
    # The p1 spare dies (still waiting), then a p2 spare registers: the vacancy is re-planned and filled at once.
    beat_until(rest, lambda: "node s1 lost" in c.log())
    assert all(a.gen == -1 for a in rest)
    spare_p2 = c.agent(node_info("s2", "p2", 9, spare=True))
    beat_until(rest + [spare_p2], _formed(rest + [spare_p2], 2))
    t = spare_p2.table
    assert [n.node_id for n in t.nodes] == ["p1n0", "p1n1", "p2n0", "s2"] and t.world_size == 8
    assert spare_p1.gen == -1


def test_spare_dying_in_the_backoff_is_replaced_by_another_registered_spare(coordinator) -> None:
    c = coordinator("liveness-backoff", "--nnodes", "3", "--lease-timeout", "2", "--backoff", "6",
                    "--membership-timeout", "120")
    nodes = [c.agent(node_info(f"n{i}", "p1", i)) for i in range(3)]
    spares = [c.agent(node_info(f"s{i}", "p1", 10 + i, spare=True)) for i in range(2)]
    beat_until(nodes + spares, _formed(nodes, 1))
    nodes[0].fail()  # first restart: no backoff
    beat_until(nodes + spares, _formed(nodes, 2))
    d = nodes[1].fail(level=NODE, kind="gpu.lost")  # second restart without progress: 6 s backoff
    assert "replacing n1->s0" in d.message, d.message
    # s0, the spare the plan would use, dies during the backoff; s1 beats all along.
    alive = [nodes[0], nodes[2], spares[1]]
    beat_until(alive, _formed(alive, 3), timeout=30)
    assert [n.node_id for n in spares[1].table.nodes] == ["n0", "s1", "n2"]
    log = c.log()
    assert "add a spare" not in log and log.index("node s0 lost") < log.index("generation 3 formed"), log[-2000:]


def test_vacancy_nothing_can_fill_fails_the_job_after_the_membership_timeout(coordinator) -> None:
    c = coordinator("liveness-impossible", "--nnodes", "2", "--lease-timeout", "30", "--membership-timeout", "1.5")
    nodes = [c.agent(node_info(f"n{i}", "p1", i)) for i in range(2)]
    beat_until(nodes, _formed(nodes, 1))
    nodes[1].fail(level=NODE, kind="gpu.lost")
    beat_until(nodes[:1], lambda: nodes[0].last.job_state == pb.JOB_STATE_FAILED, timeout=30)
    msg = nodes[0].last.message
    assert nodes[0].last.command == pb.NODE_COMMAND_STOP
    assert "no valid membership for 1.5 s" in msg and "n1" in msg and "'p1'" in msg, msg


def test_a_spare_that_leaves_is_logged_as_a_spare_leaving_and_nothing_restarts(coordinator) -> None:
    # A spare whose launcher was stopped (SIGTERM: its agent sends LeaveNode) was logged "node s lost (it left:
    # ...)" at WARNING, as a worker node lost would be. It holds no slot: an INFO line saying a spare left, and
    # the running generation goes on (no new one).
    import time

    c = coordinator("spare-leaves", "--nnodes", "2", "--lease-timeout", "5", "--backoff", "0")
    a, b = c.agent(node_info("a", idx=0)), c.agent(node_info("b", idx=1))
    s = c.agent(node_info("s", idx=2, spare=True))
    beat_until([a, b, s], lambda: a.gen == 1 and b.gen == 1)
    c.stub.LeaveNode(pb.LeaveNodeRequest(job=c.job, node_id="s", lease_id=s.lease,
                                         reason="its node agent stopped"), timeout=10)
    deadline = time.monotonic() + 20
    while "its node agent stopped" not in c.log():  # logged in the LeaveNode call; the reader thread may lag
        assert time.monotonic() < deadline, c.log()
        time.sleep(0.05)
    line = next(ln for ln in c.lines if "its node agent stopped" in ln)
    assert " INFO " in line and "spare node s left" in line and "lost" not in line, line
    for _ in range(5):  # a failure is decided within LeaveNode: the next heartbeats would carry a restart
        for x in (a, b):
            resp = x.beat()
            assert resp.command not in (pb.NODE_COMMAND_RESTART, pb.NODE_COMMAND_STOP) and x.gen == 1, resp


def test_exit_when_done_waits_until_every_live_node_was_told(coordinator) -> None:
    # `--exit-when-done` went away a fixed 3 heartbeats after the end: a node that had not heartbeated since (or
    # whose answer waited for the outcome's store write) never heard the outcome, and exited 2 after its patience.
    import time

    c = coordinator("exit-when-done", "--nnodes", "2", "--lease-timeout", "30", "--exit-when-done")
    a, b = c.agent(node_info("a", idx=0)), c.agent(node_info("b", idx=1))
    beat_until([a, b], _formed([a, b], 1))
    done = pb.NodeHeartbeatRequest(job=c.job, node_id="b", lease_id=b.lease, generation=1, workers_succeeded=True)
    b.stub.Heartbeat(done, timeout=10)
    done = pb.NodeHeartbeatRequest(job=c.job, node_id="a", lease_id=a.lease, generation=1, workers_succeeded=True)
    # a reports its workers done but b, told nothing yet, heartbeats only after 2.5 s (10 of the old wait's 1.3 s)
    assert a.stub.Heartbeat(done, timeout=10).command == pb.NODE_COMMAND_STOP
    time.sleep(2.5)
    assert c.proc.poll() is None, "the coordinator left before node b heard the outcome"
    assert b.beat().command == pb.NODE_COMMAND_STOP
    assert c.proc.wait(timeout=15) == 0

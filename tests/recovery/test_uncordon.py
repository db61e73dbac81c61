"""``trainguard uncordon`` against a real ``trainguard coordinator`` process: a node cordoned after it was lost (no
node daemon to vouch for it) is returned to service by the operator and fills the next vacancy; a node that is
not cordoned, or another job, is refused in one line."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest

from coordinator_client import CoordinatorProcess, beat_until, node_info
from tg_testutil import run_cli

pytestmark = pytest.mark.timeout(90)


@contextlib.contextmanager
def beating(agents: list, period: float = 0.1) -> Iterator[None]:
    """Keeps ``agents`` heartbeating from a thread while the body runs (a CLI process starting up takes over a
    second on a loaded box, longer than a 1 s lease: a node the test means alive was lost meanwhile)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period):
            for a in agents:
                a.beat()

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)


def test_an_operator_returns_a_lost_and_replaced_node_to_service(tmp_path, tg_env) -> None:
    c = CoordinatorProcess(tmp_path, tg_env, "unc-job", "--nnodes", "2", "--heartbeat-interval", "0.1",
                           "--lease-timeout", "1", "--backoff", "0")
    try:
        a = c.agent(node_info("a", idx=0))
        b = c.agent(node_info("b", idx=1))
        s = c.agent(node_info("s", idx=2, spare=True))
        beat_until([a, b, s], lambda: a.gen == 1 and b.gen == 1)
        beat_until([a, s], lambda: a.gen == 2 and s.gen == 2)  # b silent: lost, cordoned, s took its slot
        b.beat()  # its machine is back (rebooted), with no daemon to report it healthy: still cordoned
        assert b.gen < 0 and "cordoned" in b.last.message
        uncordon = ["uncordon", "b", "--coordinator", c.target, "--job", "unc-job", "--reason", "PSU swapped"]
        with beating([a, s]):
            r = run_cli(uncordon, env=tg_env, timeout=60)
        assert r.returncode == 0 and "back in service" in r.stdout and "PSU swapped" in r.stdout, r.stderr
        # s is lost in turn: b fills the vacancy.
        beat_until([a, b], lambda: a.gen == 3 and b.gen == 3)
        assert sorted(n.node_id for n in a.table.nodes) == ["a", "b"]
        with beating([a, b]):
            r = run_cli(uncordon, env=tg_env, timeout=60)  # b holds a slot: not cordoned
        assert r.returncode == 1 and "not cordoned" in r.stderr and "Traceback" not in r.stderr, r.stderr
        with beating([a, b]):
            r = run_cli(["uncordon", "b", "--coordinator", c.target, "--job", "other"], env=tg_env, timeout=60)
        assert r.returncode == 2 and "unknown job" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        c.stop()


def _report(c: CoordinatorProcess, node: str, verdict: int, instance: str, reason: str = "") -> bool:
    from trainguard.proto import coordinator_pb2 as pb

    return c.stub.ReportNodeHealth(pb.NodeHealthReportRequest(job=c.job, node_id=node, host=f"host-{node}",
                                                              verdict=verdict, reason=reason,
                                                              agent_instance=instance), timeout=10).cordoned


def test_uncordon_keeps_out_a_node_its_running_daemon_reports_fatal_and_rearms_its_daemon(tmp_path, tg_env) -> None:
    # b's daemon d1 latched a fatal fault and keeps reporting it. The operator's uncordon returned b to service
    # anyway, and d1's reports, never a *new* fatal verdict of that daemon, could not cordon it again: b took
    # the next vacancy with its daemon saying FATAL, and no later fault of d1's could ever cordon it.
    from trainguard.proto import coordinator_pb2 as pb

    c = CoordinatorProcess(tmp_path, tg_env, "unc-fatal", "--nnodes", "2", "--heartbeat-interval", "0.1",
                           "--lease-timeout", "30", "--backoff", "0")
    try:
        a = c.agent(node_info("a", idx=0))
        b = c.agent(node_info("b", idx=1))
        s = c.agent(node_info("s", idx=2, spare=True))
        beat_until([a, b, s], lambda: a.gen == 1 and b.gen == 1)
        assert _report(c, "b", pb.NODE_HEALTH_VERDICT_FATAL, "d1", "nvidia: GPU fell off the bus")
        beat_until([a, s], lambda: a.gen == 2 and s.gen == 2)
        stop = threading.Event()

        def daemon_d1() -> None:  # d1 runs on, reporting its latched fault each interval
            while not stop.wait(0.1):
                _report(c, "b", pb.NODE_HEALTH_VERDICT_FATAL, "d1", "nvidia: GPU fell off the bus")

        d1 = threading.Thread(target=daemon_d1, daemon=True)
        d1.start()
        uncordon = ["uncordon", "b", "--coordinator", c.target, "--job", "unc-fatal"]
        try:
            r = run_cli(uncordon, env=tg_env, timeout=60)
        finally:
            stop.set()
            d1.join(10)
        assert r.returncode == 1 and "still reports a fatal fault" in r.stderr and "GPU fell off" in r.stderr, \
            (r.returncode, r.stdout, r.stderr)
        # d1 goes quiet (the machine was taken down for the repair): the operator's word is all there is.
        time.sleep(1.0)
        with beating([a, s]):
            r = run_cli(uncordon, env=tg_env, timeout=60)
        assert r.returncode == 0 and "back in service" in r.stdout, (r.stdout, r.stderr)
        # The same daemon comes back and reports the fault again: a new fault for this job, cordoned again.
        assert _report(c, "b", pb.NODE_HEALTH_VERDICT_FATAL, "d1", "nvidia: GPU fell off the bus")
    finally:
        c.stop()



def _b_fatal_and_no_spare(c: "CoordinatorProcess", beating: list[int]):
    """Nodes a and b form generation 1, b's daemon d1 reports it FATAL, and with no spare the next generation
    waits; ``beating``: which of (a, b) keep heartbeating until then. Returns the two agents."""
    from trainguard.proto import coordinator_pb2 as pb

    a = c.agent(node_info("a", idx=0))
    b = c.agent(node_info("b", idx=1))
    beat_until([a, b], lambda: a.gen == 1 and b.gen == 1)
    assert _report(c, "b", pb.NODE_HEALTH_VERDICT_FATAL, "d1", "nvidia: GPU fell off the bus")
    beat_until([(a, b)[i] for i in beating], lambda: a.gen < 0 and "waits" in a.last.message)
    return a, b

def test_a_node_whose_replacement_waits_for_a_spare_nobody_has_is_given_its_slot_back(tmp_path, tg_env) -> None:
    # b failed with no spare anywhere: generation 2 waits for one. The operator repairs b and uncordons it; it was
    # refused ("generation 2 is replacing it now; uncordon it once that generation runs"), a generation that
    # could never run, so the job waited until someone registered a spare. Now b takes its slot back.
    c = CoordinatorProcess(tmp_path, tg_env, "unc-wait", "--nnodes", "2", "--heartbeat-interval", "0.1",
                           "--lease-timeout", "30", "--backoff", "0")
    try:
        a, b = _b_fatal_and_no_spare(c, [0, 1])
        assert "trainguard uncordon" in a.last.message and "'b'" in a.last.message, a.last.message
        time.sleep(1.0)  # d1 is stopped for the repair (a daemon still reporting FATAL would keep b out)
        r = run_cli(["uncordon", "b", "--coordinator", c.target, "--job", "unc-wait"], env=tg_env, timeout=60)
        assert r.returncode == 0 and "back in service" in r.stdout, (r.stdout, r.stderr)
        beat_until([a, b], lambda: a.gen == 2 and b.gen == 2)
        assert sorted(n.node_id for n in a.table.nodes) == ["a", "b"]
    finally:
        c.stop()


def test_a_node_whose_replacement_waits_gets_no_slot_back_while_its_agent_is_down(tmp_path, tg_env) -> None:
    # The wait for a spare ends by uncordoning the node only when its agent heartbeats: a dead node put back in
    # its slot would form a generation that can never start.
    c = CoordinatorProcess(tmp_path, tg_env, "unc-lost", "--nnodes", "2", "--heartbeat-interval", "0.1",
                           "--lease-timeout", "1", "--backoff", "0")
    try:
        a, _ = _b_fatal_and_no_spare(c, [0])  # b's agent and daemon stop
        time.sleep(1.5)  # past b's lease
        r = run_cli(["uncordon", "b", "--coordinator", c.target, "--job", "unc-lost"], env=tg_env, timeout=60)
        assert r.returncode == 1 and "not heartbeating" in r.stderr, (r.stdout, r.stderr)
        a.beat()
        assert a.gen < 0 and "waits" in a.last.message
    finally:
        c.stop()


def test_an_operator_clears_the_cordon_of_a_slot_whose_node_record_was_lost(tmp_path, tg_env) -> None:
    # b's node record was lost (a store outage) and the coordinator restarted: the layout names b's slot only by a
    # digest no record resolves, ``?lost-record-<digest>``. That slot is lost and replaced, and its id stays on the
    # cordon list; `trainguard uncordon` could not name it (the service refused any id with '?'), so nothing an
    # operator could do cleared it. The exact placeholder is now accepted by UncordonNode, and nothing else is.
    import grpc

    from trainguard.proto import coordinator_pb2 as pb
    from trainguard.recovery.job_records import id_digest
    from trainguard.recovery.store import Put, SQLiteStore

    flags = ("--nnodes", "2", "--heartbeat-interval", "0.1", "--lease-timeout", "1", "--backoff", "0")
    c = CoordinatorProcess(tmp_path, tg_env, "unc-lost", *flags)
    try:
        a = c.agent(node_info("a", idx=0))
        b = c.agent(node_info("b", idx=1))
        beat_until([a, b], lambda: a.gen == 1 and b.gen == 1)
    finally:
        c.stop()
    store = SQLiteStore(c.db)
    try:
        assert store.commit([], [Put("trainguard/jobs/unc-lost/nodes/b", None)]).ok
    finally:
        store.close()
    lost = "?lost-record-" + id_digest("b").hex()
    c = CoordinatorProcess(tmp_path, tg_env, "unc-lost", *flags, db=c.db)
    try:
        a.stub = c.stub  # a's agent carries on with the restarted coordinator, under the lease it stored
        s = c.agent(node_info("s", idx=2, spare=True))
        beat_until([a, s], lambda: a.gen == 2 and s.gen == 2)  # b's slot, lost, went to the spare
        with beating([a, s]):
            r = run_cli(["uncordon", lost, "--coordinator", c.target, "--job", "unc-lost"], env=tg_env, timeout=60)
        assert r.returncode == 0 and "back in service" in r.stdout, (r.returncode, r.stdout, r.stderr)
        assert f"trainguard uncordon '{lost}'" in c.log()  # the coordinator said how to clear it
        for bad in (lost + "0", "?lost-record-" + "g" * 16, "a?b", "?" + lost):  # only that exact form
            with pytest.raises(grpc.RpcError) as err:
                c.stub.UncordonNode(pb.UncordonNodeRequest(job="unc-lost", node_id=bad), timeout=10)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "not a valid node id" in err.value.details()
    finally:
        c.stop()

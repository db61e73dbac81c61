"""The coordinator link against a real coordinator over gRPC: a health-only member (no workers) registers,
heartbeats and reports; a worker member follows START and STOP; illegal moves are refused."""

from __future__ import annotations

import time

import pytest

from trainguard.agent.coordinator_link import GrpcCoordinatorLink, LinkConfig
from trainguard.agent.errors import CoordinatorUnavailableError, IllegalTransitionError
from trainguard.agent.lifecycle import Lifecycle
from trainguard.agent.parts import LINK_TRANSITIONS, LinkState, LinkTrigger, NoWorkers
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.proto import coordinator_pb2
from trainguard.recovery import CoordinatorServer, JobSpec


@pytest.fixture
def coordinator():
    srv = CoordinatorServer(JobSpec(job="link", nnodes=1, heartbeat_interval_s=0.1), listen="127.0.0.1:0").start()
    yield srv
    srv.stop()


def test_health_only_member_registers_heartbeats_and_reports(coordinator) -> None:
    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator=coordinator.target, node_id="watcher",
                                          spare=True, patience_s=5.0))
    assert link.state == LinkState.UNREGISTERED and not link.connected
    link.open()
    try:
        assert link.state == LinkState.WAITING and link.lease
        resp = link.heartbeat(NoWorkers())
        assert resp is not None
        link.follow(resp)
        assert link.state == LinkState.WAITING  # a spare without workers gets no ranks
        assert "watcher" in coordinator.core.members()
        ev = HealthEvent(source="pcie", kind="pcie.link_narrow", severity=Severity.WARNING, action=Action.WATCH,
                         message="x16 -> x4", node_id="watcher")
        link.report(ev, coordinator_pb2.RECOVERY_LEVEL_NONE, generation=-1)  # between jobs: no generation
        assert link.heartbeat(NoWorkers()) is not None
    finally:
        link.close()
    assert link.state == LinkState.DONE


def test_worker_member_follows_start_then_stop(coordinator) -> None:
    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator=coordinator.target, node_id="n1",
                                          device_count=1, patience_s=5.0))
    link.open()
    try:
        resp = link.heartbeat(NoWorkers())
        assert resp.command == coordinator_pb2.NODE_COMMAND_START, resp
        link.follow(resp)
        assert link.state == LinkState.RUNNING and link.generation == resp.rank_table.generation >= 1
        stop = coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_STOP,
                                                     job_state=coordinator_pb2.JOB_STATE_RUNNING)
        link.follow(stop)  # stop the workers, the job goes on: wait for a table
        assert link.state == LinkState.WAITING
        link.follow(resp)
        link.follow(coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_STOP,
                                                          job_state=coordinator_pb2.JOB_STATE_SUCCEEDED))
        assert link.state == LinkState.DONE
    finally:
        link.close()


def test_a_standing_stop_or_wait_message_is_logged_once(caplog) -> None:
    """Found by a user's review: a node cordoned in an earlier recovery that registered again under its id, and
    every node of a job waiting for a spare, logged nothing while the job waited (the why was only in the
    coordinator's log)."""
    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator="127.0.0.1:1", node_id="n1"))
    cordoned = coordinator_pb2.NodeHeartbeatResponse(
        command=coordinator_pb2.NODE_COMMAND_STOP, job_state=coordinator_pb2.JOB_STATE_RECOVERING,
        message="node n1 is cordoned: node n1 node lost (no heartbeat for 6.0 s)")
    with caplog.at_level("INFO", logger="trainguard.agent.coordinator_link"):
        for _ in range(3):
            link.follow(cordoned)
        waits = coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_WAIT,
                                                      message="generation 3 waits: no spare node for 1 slot")
        link.follow(waits)
        link.follow(waits)
        link.follow(coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_STOP,
                                                          job_state=coordinator_pb2.JOB_STATE_SUCCEEDED,
                                                          message="succeeded in generation 3"))
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [("WARNING", f"coordinator: {cordoned.message}"), ("INFO", f"coordinator: {waits.message}")]
    link.close()


def test_unreachable_coordinator_is_bounded_by_patience() -> None:
    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator="127.0.0.1:1", node_id="n1", patience_s=0.3))
    with pytest.raises(CoordinatorUnavailableError, match="unreachable"):
        link.open()
    assert link.state == LinkState.UNREGISTERED
    link.close()
    assert link.state == LinkState.DONE


def test_waiting_for_an_unreachable_coordinator_says_so_once_at_once(caplog) -> None:
    """`trainguard run --coordinator <down>` printed nothing for the whole patience (a minute by default), then
    "unreachable for 60s": the operator could not tell a dead coordinator from a slow start."""
    import logging

    caplog.set_level(logging.INFO, logger="trainguard.agent.coordinator_link")
    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator="127.0.0.1:1", node_id="n1", patience_s=0.8))
    with pytest.raises(CoordinatorUnavailableError, match="unreachable for 1s"):
        link.open()  # tries about five times (0.1, 0.2, 0.4 s apart...)
    link.close()
    said = [r for r in caplog.records if "not reachable yet" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    text = said[0].getMessage()
    assert "coordinator 127.0.0.1:1" in text and "UNAVAILABLE" in text and "join_timeout" in text, text


def test_a_coordinator_host_name_that_does_not_resolve_is_named_once_and_waited_for(caplog) -> None:
    """`--rdzv-endpoint nosuch:29400`: the node said "not reachable yet (UNAVAILABLE: errors resolving ...)" and
    after join_timeout "check the address and that it runs". It still waits (a Kubernetes headless service's name
    resolves only once its pod is ready; torchrun's c10d store waits as well), saying so once, naming the host."""
    import logging
    import time

    caplog.set_level(logging.INFO, logger="trainguard.agent.coordinator_link")
    # .invalid never resolves (RFC 6761): no DNS server can make this test pass by answering.
    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator="tg-nosuch.invalid:29400", node_id="n1",
                                          patience_s=0.8))
    start = time.monotonic()
    with pytest.raises(CoordinatorUnavailableError) as err:
        link.open()
    link.close()
    assert time.monotonic() - start >= 0.8, "it must wait for the name to appear"
    said = [r.getMessage() for r in caplog.records if "does not resolve yet" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "'tg-nosuch.invalid'" in said[0] and "waiting up to 1 s" in said[0] and "join_timeout" in said[0], said
    assert "'tg-nosuch.invalid' does not resolve" in str(err.value) and "--rdzv-endpoint" in str(err.value), err.value


def test_an_outage_after_the_local_workers_succeeded_does_not_say_start_again(coordinator) -> None:
    """Found by a user's review: a job that finished while its coordinator was down ended with "check that it
    runs, then start this node again", which reruns a finished job."""
    import time

    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator=coordinator.target, node_id="n1",
                                          device_count=1, patience_s=0.3))
    link.open()
    try:
        link.follow(link.heartbeat(NoWorkers()))
        coordinator.stop()
        assert link.heartbeat(NoWorkers()) is None
        time.sleep(0.4)
        with pytest.raises(CoordinatorUnavailableError) as err:
            link.check_patience(0, local_succeeded=link.generation)
        text = str(err.value)
        assert f"every local worker of generation {link.generation} exited 0" in text and "unknown" in text, text
        with pytest.raises(CoordinatorUnavailableError, match="start this node again"):
            link.check_patience(0)  # no workers and nothing finished: starting again is the advice
    finally:
        link.close()


def test_a_heartbeat_refused_for_a_stalled_store_says_the_coordinators_reason(caplog) -> None:
    # Found by a review: with the coordinator's store full or hung, the node logged only "heartbeat failed:
    # UNAVAILABLE", and the coordinator's reason read "could not be made durable (); retry shortly" (a timeout
    # has no text of its own).
    import logging
    from tg_testutil import gated_store

    from trainguard.recovery.domain import NodeRecord

    store = gated_store()
    srv = CoordinatorServer(JobSpec(job="link", nnodes=2, heartbeat_interval_s=0.1), store=store,
                            listen="127.0.0.1:0").start()
    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator=srv.target, node_id="n1", device_count=1,
                                          patience_s=30.0))
    try:
        link.open()
        store.gate.clear()  # the store hangs: the first generation's START waits for its write
        srv.core.register("link", NodeRecord("n2", "", 1, "n2", 1, "127.0.0.1"), 29999)  # in-process: no wait
        caplog.set_level(logging.WARNING, logger="trainguard.agent.coordinator_link")
        assert link.heartbeat(NoWorkers()) is None
        said = [r.getMessage() for r in caplog.records if "heartbeat failed" in r.getMessage()]
        assert len(said) == 1, said
        assert "UNAVAILABLE (" in said[0] and "could not be made durable (the store did not take the write within" \
            in said[0], said
    finally:
        store.gate.set()
        link.close()
        srv.stop()


def test_closing_a_running_nodes_link_twice_does_not_leave_the_job(coordinator) -> None:
    # close() moves every state to DONE, and LeaveNode was keyed on DONE: a second close() of a running node's
    # link would have told the coordinator it leaves (a node-level failure of a job that goes on).
    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator=coordinator.target, node_id="n1",
                                          device_count=1, patience_s=5.0))
    link.open()
    link.follow(link.heartbeat(NoWorkers()))
    assert link.state is LinkState.RUNNING
    link.close()
    link.close()
    st = coordinator.core.state
    assert st.restart_count == 0 and st.phase.name == "RUNNING", st.message


def test_link_table_refuses_illegal_moves() -> None:
    life = Lifecycle("coordinator link", LINK_TRANSITIONS, LinkState.UNREGISTERED)
    with pytest.raises(IllegalTransitionError, match="coordinator link: no transition from UNREGISTERED"):
        life.fire(LinkTrigger.GENERATION)  # no ranks before registering
    life.fire(LinkTrigger.REGISTERED)
    with pytest.raises(IllegalTransitionError):
        life.fire(LinkTrigger.JOB_ENDED)  # the job ends through STOP
    life.fire(LinkTrigger.GENERATION)
    life.fire(LinkTrigger.STOP)
    assert life.state == LinkState.STOPPING
    with pytest.raises(IllegalTransitionError):
        life.fire(LinkTrigger.GENERATION)
    life.fire(LinkTrigger.JOB_ENDED)
    with pytest.raises(IllegalTransitionError):
        life.fire(LinkTrigger.REGISTERED)  # DONE is final
    assert life.fire(LinkTrigger.CLOSE) == LinkState.DONE


@pytest.mark.parametrize("address", ["192.0.2.1", "no-such-host.invalid"])
def test_an_address_that_is_not_this_hosts_is_a_one_line_error(address, tmp_path) -> None:
    """`trainguard run --local-addr` with an address of another host, or a Slurm node list whose names do not
    resolve here, ended in a socket traceback at registration; now it names the address and the flag."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text("print('never started')\n")
    done = subprocess.run([sys.executable, "-m", "trainguard.cli", "run", "--standalone", "--local-addr", address,
                           str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip().splitlines()[-1]
    assert err.startswith(f"trainguard: error: cannot listen on this node's address '{address}'") and "--local-addr" in err
    assert "Traceback" not in done.stderr and "never started" not in done.stdout


def test_a_stop_while_registering_with_an_unreachable_coordinator_ends_the_run_at_once(tmp_path) -> None:
    """Found by a user's review: `timeout 20 trainguard run --coordinator <down> ...` logged "received SIGTERM:
    stopping workers" and then went on retrying registration until the 60 s patience, ending with "coordinator
    unreachable" instead of the signal's 143."""
    import signal
    import threading

    from trainguard.agent.errors import RegistrationCancelledError
    from trainguard.agent.node import NodeAgent, NodeConfig

    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator="127.0.0.1:1", node_id="n1", patience_s=600))
    raised: list[BaseException] = []

    def register() -> None:
        try:
            link.open()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            raised.append(exc)

    th = threading.Thread(target=register)
    th.start()
    link.cancel()
    th.join(60)
    assert not th.is_alive() and len(raised) == 1 and isinstance(raised[0], RegistrationCancelledError), raised
    link.close()

    agent = NodeAgent(NodeConfig(job="link", coordinator="127.0.0.1:1", argv=["x"], checkpoint_dir=str(tmp_path),
                                 address="127.0.0.1", coordinator_patience_s=600))
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(agent.run()))
    runner.start()
    agent.request_stop(signal.SIGTERM)
    runner.join(60)
    assert not runner.is_alive() and codes == [143], codes


def test_the_first_generation_is_given_up_on_only_while_nodes_are_missing() -> None:
    """The join timeout (torchrun's ``join_timeout``) ends a node only while the coordinator says nodes are missing:
    a job past ``--nnodes`` MIN waits out its last call, bounded by the coordinator, and a node that ran a
    generation never times out for joining."""
    from trainguard.agent.coordinator_link import JoinTimeoutError

    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator="127.0.0.1:1", node_id="n1", patience_s=5.0))
    link._joining_since = 100.0  # open() without a coordinator: the clock starts when registration starts
    wait = coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_WAIT,
                                                 job_state=coordinator_pb2.JOB_STATE_FORMING,
                                                 message="waiting for nodes: 1 of 3 registered (n1)")
    last_call = coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_WAIT,
                                                      job_state=coordinator_pb2.JOB_STATE_FORMING,
                                                      message="waiting for nodes: 3 of 3..4 registered")
    link.follow(last_call, now=1000.0)  # enough nodes: the coordinator's last call bounds the wait
    wait.forming_missing = 2
    link.follow(wait, now=104.9)
    with pytest.raises(JoinTimeoutError, match=r"within 5 s .*1 of 3 registered \(n1\).*--nnodes.*join_timeout"):
        link.follow(wait, now=105.0)
    start = coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_START,
                                                  job_state=coordinator_pb2.JOB_STATE_FORMING)
    start.rank_table.generation = 1
    start.rank_table.nodes.add(node_id="n1")
    link._life.fire(LinkTrigger.REGISTERED)
    link.follow(start, now=105.0)
    link.follow(wait, now=10_000.0)  # once it ran a generation, never


def test_the_join_bound_holds_while_the_coordinator_is_away() -> None:
    """The node embedding the coordinator gave up on its join timeout and took the coordinator with it: the
    other nodes then waited a second join timeout, counted from the outage, before they gave up too."""
    from trainguard.agent.coordinator_link import JoinTimeoutError

    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator="127.0.0.1:1", node_id="n2", patience_s=5.0))
    link._joining_since = 100.0
    wait = coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_WAIT, forming_missing=1,
                                                 job_state=coordinator_pb2.JOB_STATE_FORMING,
                                                 message="waiting for nodes: 2 of 3 registered (n1, n2)")
    link.follow(wait, now=104.0)
    link._unreachable_since = 104.5  # the coordinator went away with the node that gave up
    link.check_patience(0, now=104.9)
    with pytest.raises(JoinTimeoutError, match=r"2 of 3 registered \(n1, n2\)"):
        link.check_patience(0, now=105.0)


def test_the_formation_bound_is_its_own_and_not_the_outage_patience() -> None:
    """``form_timeout_s`` (torchrun's 600 s join_timeout default) bounds the wait for missing nodes; the patience for
    an unreachable coordinator (60 s) is another bound, and it used to end a node whose peers were still booting."""
    from trainguard.agent.coordinator_link import JoinTimeoutError

    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator="127.0.0.1:1", node_id="n1", patience_s=5.0,
                                          form_timeout_s=50.0))
    link._joining_since = 100.0
    wait = coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_WAIT, forming_missing=1,
                                                 job_state=coordinator_pb2.JOB_STATE_FORMING,
                                                 message="waiting for nodes: 1 of 2 registered (n1)")
    link.follow(wait, now=149.9)  # far past the patience, within the formation bound
    with pytest.raises(JoinTimeoutError, match=r"within 50 s"):
        link.follow(wait, now=150.0)


def test_a_node_that_gives_up_before_the_first_generation_leaves_and_no_generation_forms_with_it() -> None:
    """A node whose agent gave up (join timeout, or a stop) stayed live at the coordinator for its lease (10 s by
    default): a node registering in that window formed the first generation with it, and then waited for a node
    that was gone until --membership-timeout. Now the link leaves at close, and the coordinator drops it at once."""
    srv = CoordinatorServer(JobSpec(job="leave", nnodes=2, heartbeat_interval_s=0.1, lease_timeout_s=60),
                            listen="127.0.0.1:0").start()
    first = GrpcCoordinatorLink(LinkConfig(job="leave", coordinator=srv.target, node_id="gone", device_count=1,
                                           patience_s=5.0))
    late = GrpcCoordinatorLink(LinkConfig(job="leave", coordinator=srv.target, node_id="late", device_count=1,
                                          patience_s=5.0))
    try:
        first.open()
        resp = first.heartbeat(NoWorkers())
        assert resp.command == coordinator_pb2.NODE_COMMAND_WAIT and resp.forming_missing == 1, resp
        assert "1 of 2 registered (gone)" in resp.message, resp.message
        first.close()
        late.open()
        resp = late.heartbeat(NoWorkers())
        assert resp.command == coordinator_pb2.NODE_COMMAND_WAIT, resp  # not a START naming the node that left
        assert resp.forming_missing == 1 and "1 of 2 registered (late)" in resp.message, resp.message
        assert not srv.core.members()["gone"].alive
    finally:
        late.close()
        srv.stop()


def test_a_coordinator_restarted_at_another_address_of_the_list_is_followed_with_the_same_lease(tmp_path) -> None:
    """Agents kept dialling the coordinator's old address after it was restarted elsewhere (and a comma-separated
    list was one invalid target). Now each call that finds one unreachable moves to the next address on a new
    channel: registration skips a dead first address, and a coordinator restarted at the list's other address on
    the same store gets the node's heartbeats, under the lease it had."""
    from tg_testutil import free_port

    spec = JobSpec(job="moved", nnodes=1, heartbeat_interval_s=0.1, store=f"sqlite://{tmp_path}/moved.db")
    first_at, second_at = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    srv = CoordinatorServer(spec, listen=first_at).start()
    link = GrpcCoordinatorLink(LinkConfig(job="moved", coordinator=f"{second_at}, {first_at}", node_id="n1",
                                          spare=True, patience_s=10.0))
    try:
        link.open()  # the first address of the list is down: the second one answers
        lease = link.lease
        assert link.heartbeat(NoWorkers()) is not None
        srv.stop()
        srv = CoordinatorServer(spec, listen=second_at).start()  # restarted elsewhere, same store
        deadline = time.monotonic() + 10
        resp = None
        while resp is None and time.monotonic() < deadline:
            resp = link.heartbeat(NoWorkers())
            time.sleep(0.05)
        assert resp is not None and link.lease == lease, resp  # not registered again: the lease stood
        assert srv.core.members()["n1"].alive
    finally:
        link.close()
        srv.stop()


def test_a_failure_report_cut_off_by_a_redial_is_sent_again() -> None:
    """A heartbeat that finds the coordinator unreachable closes its channel for a new one; a failure report in
    flight on the old channel (from another thread) ends CANCELLED, and was dropped as refused."""
    import grpc

    class Cancelled(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.CANCELLED

        def details(self):
            return "Channel closed!"

    class Stub:
        def ReportEvent(self, req, timeout):  # noqa: N802 - the gRPC stub's name
            raise Cancelled()

    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator="127.0.0.1:1", node_id="n1"))
    link._stub = Stub()
    ev = HealthEvent(source="process", kind="process.exit", severity=Severity.CRITICAL, action=Action.RESTART_PROCESS,
                     message="rank 0 exited 1", node_id="n1")
    link.report(ev, coordinator_pb2.RECOVERY_LEVEL_PROCESS, generation=1, rank=0, code=1)
    assert [r.generation for r in link._unsent] == [1]


class _Done:
    """Heartbeat content of a node whose local workers of ``generation`` all exited 0."""

    def __init__(self, generation: int) -> None:
        self.generation = generation

    def heartbeat_fields(self) -> dict:
        return {"generation": self.generation, "workers_running": 0, "last_step": 10, "workers_succeeded": True}


def test_nodes_leaving_after_the_job_succeeded_tell_the_coordinator_and_are_not_reaped_as_lost(caplog) -> None:
    """Found by a user's review: after a multi-node job succeeded, the coordinator logged every node as "lost (no
    heartbeat for N s)" a lease later: a link sent LeaveNode only for a node that never ran a generation. Now a
    node told the job's outcome leaves too; the outcome stays."""
    import logging

    srv = CoordinatorServer(JobSpec(job="ends", nnodes=2, heartbeat_interval_s=0.1, lease_timeout_s=1.5),
                            listen="127.0.0.1:0").start()
    links = [GrpcCoordinatorLink(LinkConfig(job="ends", coordinator=srv.target, node_id=n, device_count=1,
                                            patience_s=5.0)) for n in ("a", "b")]
    try:
        for link in links:
            link.open()
        deadline = time.monotonic() + 10
        while not all(link.state is LinkState.RUNNING for link in links):
            assert time.monotonic() < deadline, [link.state for link in links]
            for link in links:
                link.follow(link.heartbeat(NoWorkers() if link.generation < 0 else _Done(-1)))
            time.sleep(0.05)
        while not all(link.state is LinkState.DONE for link in links):
            assert time.monotonic() < deadline, [link.state for link in links]
            for link in links:
                if link.state is not LinkState.DONE:
                    link.follow(link.heartbeat(_Done(link.generation)))
            time.sleep(0.05)
        with caplog.at_level(logging.INFO, logger="trainguard"):
            for link in links:
                link.close()
            time.sleep(3 * 1.5)  # past the lease: a node not heard from would be reaped by now
        said = caplog.text
        assert "no heartbeat" not in said, said
        assert "node a" in said and "it left: the job succeeded" in said, said
        left = [r for r in caplog.records if "left the succeeded job" in r.getMessage()]
        assert len(left) == 2 and all(r.levelname == "INFO" for r in left), said
        assert srv.core.state.phase.name == "SUCCEEDED"
    finally:
        srv.stop()


def test_a_node_kept_out_as_cordoned_says_so_in_its_status_once(tmp_path) -> None:
    """From a review: a replaced node that came back showed `trainguard status` with no workers, no recent event
    and no word of the cordon nor of `trainguard uncordon`; only its launcher's log said why."""
    from trainguard.agent.node import NodeAgent, NodeConfig

    agent = NodeAgent(NodeConfig(job="link", coordinator="127.0.0.1:1", argv=["x"], node_id="n1",
                                 checkpoint_dir=str(tmp_path), address="127.0.0.1"))
    try:
        cordoned = coordinator_pb2.NodeHeartbeatResponse(
            command=coordinator_pb2.NODE_COMMAND_STOP, job_state=coordinator_pb2.JOB_STATE_RUNNING,
            message="node n1 is cordoned: node n1 node lost (no heartbeat for 10.3 s)")
        for _ in range(3):
            agent._obey(cordoned)
        said = [e for e in agent.health_snapshot(50).recent_events if e.kind == "node.cordoned"]
        assert len(said) == 1, [e.kind for e in agent.health_snapshot(50).recent_events]
        assert said[0].message.startswith(cordoned.message)
        assert "trainguard uncordon n1 --coordinator 127.0.0.1:1 --job link" in said[0].message
        agent._obey(coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_WAIT,
                                                          message="spare: no ranks in this generation"))
        agent._obey(cordoned)  # uncordoned, then cordoned again: said again
        assert len([e for e in agent.health_snapshot(50).recent_events if e.kind == "node.cordoned"]) == 2
    finally:
        agent.link.close()


def test_leaving_an_ended_job_whose_coordinator_is_gone_says_nothing_of_a_lease(caplog) -> None:
    """From a review: every successful `--exit-when-done` run ended on "could not tell the coordinator this node
    leaves (UNAVAILABLE); its lease runs out instead", though the coordinator had exited with the job."""
    import grpc

    from trainguard.proto import coordinator_pb2_grpc

    link = GrpcCoordinatorLink(LinkConfig(job="link", coordinator="127.0.0.1:1", node_id="n1"))
    link._stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel("127.0.0.1:1"))  # nobody listens
    link._lease = "lease"
    link.follow(coordinator_pb2.NodeHeartbeatResponse(command=coordinator_pb2.NODE_COMMAND_STOP,
                                                      job_state=coordinator_pb2.JOB_STATE_SUCCEEDED,
                                                      message="succeeded in generation 1"))
    with caplog.at_level("INFO", logger="trainguard.agent.coordinator_link"):
        link.close()
    assert not [r for r in caplog.records if "lease runs out" in r.getMessage()], caplog.records

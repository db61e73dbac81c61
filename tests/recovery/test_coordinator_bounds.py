"""What a client can make the coordinator store, over real gRPC: requests naming made-up node ids (registrations,
node daemons' reports) are bounded, and a checkpoint commit needs the node's lease. Before, every new id was a
member and a store key, or a daemon row, for good: a client looping over ids grew both without end."""

from __future__ import annotations

import time

import grpc
import pytest
from coordinator_client import node_info

from trainguard.proto import coordinator_pb2 as pb
from trainguard.proto import coordinator_pb2_grpc
from trainguard.recovery import CoordinatorServer, JobSpec

JOB = "bounds"
LIMIT = 8


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setattr("trainguard.recovery.spec.MIN_NODE_ID_LIMIT", LIMIT, raising=False)
    srv = CoordinatorServer(JobSpec(job=JOB, nnodes=2, heartbeat_interval_s=0.05, lease_timeout_s=0.4,
                                    store=f"sqlite://{tmp_path}/b.db")).start()
    chan = grpc.insecure_channel(srv.target)
    yield srv, coordinator_pb2_grpc.CoordinatorStub(chan)
    chan.close()
    srv.stop(0)


def _register(stub, nid: str) -> str:
    return stub.RegisterNode(pb.RegisterNodeRequest(job=JOB, node=node_info(nid), free_port=40000),
                             timeout=10).lease_id


def _until(what, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_registrations_of_made_up_node_ids_keep_the_members_and_the_store_bounded(server) -> None:
    srv, stub = server
    for i in range(LIMIT):
        _register(stub, f"x{i}")
    with pytest.raises(grpc.RpcError) as ei:  # every id kept is live: a new one is refused, saying why
        _register(stub, "one-more")
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
    assert "'one-more' cannot join" in ei.value.details() and "made-up node ids" in ei.value.details()
    _until(lambda: not any(m.alive for m in srv.core.members().values()))  # their leases ran out
    for i in range(LIMIT - 2):  # each new id takes the place of the one silent longest ...
        _register(stub, f"y{i}")
    with pytest.raises(grpc.RpcError) as ei:  # ... but for the first generation's slot holders (x0, x1)
        _register(stub, "y-last")
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
    members = srv.core.members()
    assert sorted(members) == sorted(["x0", "x1"] + [f"y{i}" for i in range(LIMIT - 2)]), sorted(members)
    prefix = f"trainguard/jobs/{JOB}/nodes/"
    _until(lambda: sorted(srv.core._raw_store.scan(prefix)) == sorted(prefix + n for n in members))


def test_daemon_reports_for_made_up_node_ids_keep_the_table_bounded(server) -> None:
    srv, stub = server

    def report(nid: str) -> pb.NodeHealthReportResponse:
        return stub.ReportNodeHealth(pb.NodeHealthReportRequest(job=JOB, node_id=nid, host="h", agent_instance="d",
                                                                verdict=pb.NODE_HEALTH_VERDICT_HEALTHY), timeout=10)

    for i in range(LIMIT):
        report(f"d{i}")
    with pytest.raises(grpc.RpcError) as ei:
        report("one-more")
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "made-up node ids" in ei.value.details()
    report("d0")  # a node already in the table still reports
    time.sleep(3 * srv.core.report_interval_s() + 0.05)  # rows silent for 3 report intervals may go
    for i in range(LIMIT):
        report(f"e{i}")
    with pytest.raises(grpc.RpcError) as ei:  # the newcomers' rows are recent again
        report("e-last")
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert sorted(srv.core.node_health.snapshot()) == sorted(f"e{i}" for i in range(LIMIT))


def test_a_checkpoint_commit_needs_the_nodes_lease(server) -> None:
    _, stub = server
    lease = _register(stub, "n0")
    for nid, bad, code in (("n0", "", grpc.StatusCode.FAILED_PRECONDITION),
                           ("n0", "f" * 32, grpc.StatusCode.FAILED_PRECONDITION),
                           ("nobody", lease, grpc.StatusCode.NOT_FOUND)):
        with pytest.raises(grpc.RpcError) as ei:
            stub.CommitCheckpoint(pb.CommitCheckpointRequest(job=JOB, node_id=nid, step=5, lease_id=bad), timeout=10)
        assert ei.value.code() == code, (nid, bad, ei.value)
    assert stub.CommitCheckpoint(pb.CommitCheckpointRequest(job=JOB, node_id="n0", step=5, lease_id=lease),
                                 timeout=10).last_committed_step == -1  # no generation yet: nothing job-wide


def test_a_hung_store_does_not_take_every_handler_thread_from_the_heartbeats(tmp_path) -> None:
    """A store that hangs (etcd unreachable, a stuck disk) held each registration's handler thread for 30 s while
    its caller gave up after its deadline and retried: a few such calls took every thread, and heartbeats, which
    write nothing, queued behind them until the leases ran out. Now a call waits for durability no longer than its
    caller's deadline."""
    import threading

    from tg_testutil import gated_store

    store = gated_store()
    srv = CoordinatorServer(JobSpec(job=JOB, nnodes=1, heartbeat_interval_s=0.1, lease_timeout_s=30.0),
                            store=store, max_workers=4).start()
    chan = grpc.insecure_channel(srv.target)
    stub = coordinator_pb2_grpc.CoordinatorStub(chan)
    try:
        lease = _register(stub, "n0")
        beat = pb.NodeHeartbeatRequest(job=JOB, node_id="n0", lease_id=lease, generation=-1, free_port=40001)
        stub.Heartbeat(beat, timeout=10)
        store.gate.clear()  # the store hangs from here

        def register(i: int) -> None:
            try:
                stub.RegisterNode(pb.RegisterNodeRequest(job=JOB, node=node_info(f"r{i}"), free_port=40000),
                                  timeout=0.5)
            except grpc.RpcError:
                pass

        callers = [threading.Thread(target=register, args=(i,)) for i in range(8)]  # twice the handler threads
        for t in callers:
            t.start()
        for t in callers:
            t.join(30)
        assert stub.Heartbeat(beat, timeout=3).command != pb.NODE_COMMAND_UNSPECIFIED
    finally:
        store.gate.set()
        chan.close()
        srv.stop(0)


def test_a_failed_rank_outside_the_generations_world_is_refused_naming_the_range() -> None:
    """A report's failed_rank was taken as it came: "rank 99 on node n0 ..." went into the failure's description and
    the log as though the generation had that rank, and the report was acted on."""
    from coordinator_client import Agent, beat_until

    # A 30 s lease: no node is lost on a loaded box while the reports are checked.
    srv = CoordinatorServer(JobSpec(job=JOB, nnodes=2, heartbeat_interval_s=0.05, lease_timeout_s=30.0)).start()
    chan = grpc.insecure_channel(srv.target)
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(chan)
        a, b = Agent(stub, JOB, node_info("n0", idx=0)), Agent(stub, JOB, node_info("n1", idx=1))  # 2 ranks each
        beat_until([a, b], lambda: a.gen == 1 and b.gen == 1, period=0.02)
        with pytest.raises(grpc.RpcError) as ei:
            a.fail(rank=4)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
        assert "failed_rank is 4" in ei.value.details() and "ranks 0..3" in ei.value.details(), ei.value.details()
        assert srv.core.state.generation == 1 and srv.core.state.restart_count == 0  # nothing was acted on
        assert "rank 3 on node n1" in b.fail(rank=3).message  # the last rank of the world is one
    finally:
        chan.close()
        srv.stop(0)


def test_a_forgotten_nodes_record_whose_deletion_the_store_failed_is_deleted_once_it_answers(monkeypatch) -> None:
    """Making room for a new node id deletes the record of the node silent longest. When the store failed that
    deletion nothing wrote it again: the record stayed, and the forgotten node was a member again at the next
    coordinator start."""
    import threading

    from trainguard.recovery.errors import StoreError
    from trainguard.recovery.store import MemoryStore

    class NoDeletes(MemoryStore):
        """The real in-memory store, failing every commit that deletes a key while ``failing`` is set."""

        def __init__(self) -> None:
            super().__init__()
            self.failing = threading.Event()

        def commit(self, compares, puts):
            if self.failing.is_set() and any(p.value is None for p in puts):
                raise StoreError("store unavailable (test)")
            return super().commit(compares, puts)

    monkeypatch.setattr("trainguard.recovery.spec.MIN_NODE_ID_LIMIT", LIMIT, raising=False)
    store = NoDeletes()
    srv = CoordinatorServer(JobSpec(job=JOB, nnodes=2, heartbeat_interval_s=0.05, lease_timeout_s=0.4),
                            store=store).start()
    chan = grpc.insecure_channel(srv.target)
    stub = coordinator_pb2_grpc.CoordinatorStub(chan)
    prefix = f"trainguard/jobs/{JOB}/nodes/"
    try:
        for i in range(LIMIT):  # x0 and x1 hold the first generation's slots and stay
            _register(stub, f"x{i}")
        _until(lambda: not any(m.alive for m in srv.core.members().values()))
        store.failing.set()
        try:
            _register(stub, "newcomer")  # one x is forgotten to make room; the store fails the deletion
        except grpc.RpcError as exc:  # the newcomer's record may share the failed commit: its agent retries
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        gone = [f"x{i}" for i in range(LIMIT) if f"x{i}" not in srv.core.members()]
        assert len(gone) == 1 and prefix + gone[0] in store.scan(prefix), (gone, sorted(store.scan(prefix)))
        store.failing.clear()  # the store answers again
        _until(lambda: sorted(store.scan(prefix)) == sorted(prefix + n for n in srv.core.members()), timeout=10)
    finally:
        chan.close()
        srv.stop(0)


def test_fatal_reports_for_unregistered_node_ids_are_held_and_stored_only_when_the_node_registers(server) -> None:
    """Every fatal daemon report about a new id cordoned it in the job state, which each state write carries whole:
    made-up ids filled it up to the table's bound (16384 rows, 1-2 MB, about etcd's request limit). A daemon may
    report before its node registers: that node is still kept out, and cordoned durably when it registers."""
    from trainguard.recovery.job_records import decode_state

    srv, stub = server

    def report(nid: str) -> pb.NodeHealthReportResponse:
        return stub.ReportNodeHealth(pb.NodeHealthReportRequest(job=JOB, node_id=nid, host="h", agent_instance="d",
                                                                verdict=pb.NODE_HEALTH_VERDICT_FATAL,
                                                                reason="pcie: AER fatal"), timeout=10)

    def stored_cordons() -> list[str]:
        rec = srv.core._raw_store.get(f"trainguard/jobs/{JOB}/state")
        return [] if rec is None else list(decode_state(JOB, rec.value).policy.cordoned)

    for i in range(LIMIT):
        resp = report(f"f{i}")
        assert resp.cordoned and "AER fatal" in resp.message, resp.message
    assert stored_cordons() == [] and list(srv.core.state.cordoned) == []
    resp = report("f0")  # its daemon says so again: still kept out
    assert resp.cordoned and "not registered" in resp.message, resp.message
    assert srv.core.held_cordons() == [f"f{i}" for i in range(LIMIT)]
    _register(stub, "f3")  # answered once its cordon is durable
    assert stored_cordons() == ["f3"] and "f3" not in srv.core.held_cordons()
    from coordinator_client import Agent, beat_until

    a, b = Agent(stub, JOB, node_info("n0", idx=0)), Agent(stub, JOB, node_info("n1", idx=1))
    beat_until([a, b], lambda: a.gen == 1 and b.gen == 1, period=0.02)  # the first generation: never with f3
    assert sorted(n.node_id for n in a.table.nodes) == ["n0", "n1"]
    # An operator may drop a held cordon once its daemon went quiet (trainguard uncordon): nothing to store.
    _until(lambda: srv.core.uncordon(JOB, "f5", "repaired")[0])
    assert "f5" not in srv.core.held_cordons() and "f5" not in srv.core.state.cordoned


def test_the_stored_cordon_list_is_bounded_and_a_node_past_it_is_refused(server, monkeypatch) -> None:
    """Registered node ids filled the job state's cordon list up to the node id limit (16384, ~8.6 MB compressed
    with 128-character ids), and etcd refuses a state write past 1.5 MiB: every recovery then failed to be stored.
    Past the bound a node that must be kept out and holds no slot is refused membership instead (no work either)."""
    from trainguard.recovery.job_records import decode_state

    monkeypatch.setattr("trainguard.recovery.spec.MAX_CORDONED", 2)
    srv, stub = server

    def fatal(nid: str) -> pb.NodeHealthReportResponse:
        return stub.ReportNodeHealth(pb.NodeHealthReportRequest(job=JOB, node_id=nid, host="h", agent_instance="d",
                                                                verdict=pb.NODE_HEALTH_VERDICT_FATAL,
                                                                reason="pcie: AER fatal"), timeout=10)

    def stored_cordons() -> list[str]:
        rec = srv.core._raw_store.get(f"trainguard/jobs/{JOB}/state")
        return [] if rec is None else sorted(decode_state(JOB, rec.value).policy.cordoned)

    for nid in ("r0", "r1"):
        _register(stub, nid)
        assert fatal(nid).cordoned
    assert stored_cordons() == ["r0", "r1"]
    lease = _register(stub, "r2")  # registered, then its daemon's fatal report: its membership goes, held
    assert fatal("r2").cordoned
    assert "r2" not in srv.core.members() and srv.core.held_cordons() == ["r2"] and stored_cordons() == ["r0", "r1"]
    with pytest.raises(grpc.RpcError) as ei:
        stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id="r2", lease_id=lease, generation=-1), timeout=10)
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    for nid in ("r2", "f0"):  # f0: held before it ever registered
        if nid == "f0":
            assert fatal("f0").cordoned
        with pytest.raises(grpc.RpcError) as ei:
            _register(stub, nid)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
        assert "cordon list holds 2 nodes" in ei.value.details() and "trainguard uncordon" in ei.value.details()
    assert sorted(srv.core.held_cordons()) == ["f0", "r2"] and stored_cordons() == ["r0", "r1"]
    # An operator returns a repaired node once its daemon went quiet: room for one more cordon.
    _until(lambda: srv.core.uncordon(JOB, "r0", "repaired")[0])
    _register(stub, "f0")  # answered once its cordon is stored
    assert stored_cordons() == ["f0", "r1"] and sorted(srv.core.held_cordons()) == ["r2"]


def test_the_cordon_bound_keeps_the_worst_case_state_record_under_etcds_request_limit() -> None:
    """Every cordoned node at its longest (128-character id, a failure description of a 4 KB reason, a 64-character
    daemon instance), at random so that nothing compresses: the state stays well under etcd's 1.5 MiB, leaving room
    for the rank layout and the records committed with it."""
    import random
    import string

    from trainguard.recovery.job_records import state_value
    from trainguard.recovery.policy import Cause, Failure, Level, PolicyState
    from trainguard.recovery.spec import MAX_CORDONED

    rnd = random.Random(7)
    alphabet = string.ascii_letters + string.digits + "._:@-"

    def text(n: int) -> str:
        return "".join(rnd.choice(alphabet) for _ in range(n))

    st = PolicyState()
    for _ in range(MAX_CORDONED):
        nid = text(128)
        st.cordoned.append(nid)
        st.cordon_why[nid] = Failure(nid, 3, Cause.NODE_CRITICAL, Level.NODE, detail=text(4096)).describe()
        st.cordon_daemon[nid] = text(64)
    assert len(state_value(st, None, 1, 29500, set(range(29500, 29600)))) < 0.75 * 1.5 * 2**20


def test_the_cordon_bound_is_a_coordinator_setting_checked_against_the_store(tmp_path, tg_env) -> None:
    """`--max-cordoned` (JobSpec.max_cordoned) sets the bound (a constant before: a job with many flaky nodes on a
    sqlite store could not raise it, one wanting a tighter one could not lower it); a value the store cannot take
    is one usage line naming the flag and the range, and the refusal past the bound names the flag."""
    import subprocess
    import sys

    from trainguard.recovery.errors import InvalidRequestError
    from trainguard.recovery.spec import MAX_CORDONED

    assert JobSpec(job=JOB).cordon_limit() == MAX_CORDONED
    assert JobSpec(job=JOB, max_cordoned=3000, store="sqlite:///x.db").cordon_limit() == 3000
    with pytest.raises(InvalidRequestError, match="from 1 to 16384 \\(the node id limit\\)"):
        JobSpec(job=JOB, max_cordoned=-1).validate()
    # 0 is the spec's "default": on the command line it ran silently with 1024 while the message said "from 1".
    for value, store, said in ((5000, "etcd://127.0.0.1:1", "from 1 to 1024 (with an etcd store"),
                               (-1, "memory://", "--max-cordoned: must be at least 1 (got -1)"),
                               (0, "memory://", "--max-cordoned: must be at least 1 (got 0)")):
        if value > 0:
            with pytest.raises(InvalidRequestError, match="--max-cordoned"):
                JobSpec(job=JOB, max_cordoned=value, store=store).validate()
        out = subprocess.run([sys.executable, "-m", "trainguard.cli", "coordinator", "--job", JOB, "--listen",
                              "127.0.0.1:0", "--store", store, "--max-cordoned", str(value)],
                             env=tg_env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and said in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
        # It offered "or 0 for the default", which the same command then refused ("must be at least 1").
        assert "or 0 for" not in out.stderr, out.stderr
    srv = CoordinatorServer(JobSpec(job=JOB, nnodes=2, max_cordoned=1, store=f"sqlite://{tmp_path}/c.db")).start()
    try:
        with grpc.insecure_channel(srv.target) as chan:
            stub = coordinator_pb2_grpc.CoordinatorStub(chan)
            for nid in ("r0", "r1"):
                _register(stub, nid)
                assert stub.ReportNodeHealth(pb.NodeHealthReportRequest(
                    job=JOB, node_id=nid, host="h", agent_instance="d", verdict=pb.NODE_HEALTH_VERDICT_FATAL,
                    reason="pcie: AER fatal"), timeout=10).cordoned
            assert srv.core.state.cordoned == ["r0"] and srv.core.held_cordons() == ["r1"]
            with pytest.raises(grpc.RpcError) as ei:
                _register(stub, "r1")
            assert "cordon list holds 1 nodes" in ei.value.details() and "--max-cordoned" in ei.value.details()
    finally:
        srv.stop(0)


def test_a_restart_with_a_lower_cordon_bound_keeps_the_cordons_and_says_what_follows(tmp_path, caplog) -> None:
    """Started again with --max-cordoned below the stored cordon list: the cordons stand (nothing is dropped), and
    the log says at once that nodes to be kept out are refused from now on, not only at the next bad node."""
    import logging

    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.domain import NodeRecord
    from trainguard.recovery.node_health import NodeHealthReport, Verdict
    from trainguard.recovery.store import SQLiteStore

    spec = JobSpec(job=JOB, nnodes=4, store=f"sqlite://{tmp_path}/c.db")
    core = JobCoordinator(spec, store=SQLiteStore(tmp_path / "c.db"))
    try:
        for nid in ("r0", "r1", "r2"):
            core.wait_durable(core.register(JOB, NodeRecord(nid, host=nid), 30000)[2])
            assert core.report_node_health(NodeHealthReport(JOB, nid, "h", Verdict.FATAL, "pcie: AER fatal",
                                                            instance="d"))[0]
        assert sorted(core.state.cordoned) == ["r0", "r1", "r2"]
        core.wait_durable(core._state_fut)
    finally:
        core.close()
    lower = JobSpec(job=JOB, nnodes=4, store=f"sqlite://{tmp_path}/c.db", max_cordoned=2)
    with caplog.at_level(logging.WARNING, logger="trainguard.recovery.coordinator"):
        core = JobCoordinator(lower, store=SQLiteStore(tmp_path / "c.db"))
    try:
        assert sorted(core.state.cordoned) == ["r0", "r1", "r2"]
        assert any("holds 3 node(s), more than --max-cordoned 2" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
    finally:
        core.close()


@pytest.mark.parametrize("holding, field", [
    (pb.MemoryHolding(step=-3, world_size=2, ranks=[0]), "memory[0].step is -3"),
    (pb.MemoryHolding(step=5, world_size=0, ranks=[0]), "memory[0].world_size is 0"),
    (pb.MemoryHolding(step=5, world_size=2, ranks=[0, 7]), "memory[0].ranks names rank 7"),
    (pb.MemoryHolding(step=5, world_size=2, replica_ranks=[-1]), "memory[0].replica_ranks names rank -1"),
])
def test_heartbeat_memory_holdings_out_of_range_are_refused_naming_the_field(server, holding, field) -> None:
    """A heartbeat's in-memory holdings were stored unchecked and walked for every node's restore plan; garbage
    is now INVALID_ARGUMENT naming the field, and so are more holdings than any node keeps."""
    srv, stub = server
    lease = _register(stub, "m0")
    beat = dict(job=JOB, node_id="m0", lease_id=lease, generation=-1, last_step=-1)
    assert stub.Heartbeat(pb.NodeHeartbeatRequest(**beat, memory=[pb.MemoryHolding(step=5, world_size=2, ranks=[0, 1])]),
                          timeout=10) is not None
    with pytest.raises(grpc.RpcError) as ei:
        stub.Heartbeat(pb.NodeHeartbeatRequest(**beat, memory=[holding]), timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in ei.value.details(), ei.value
    many = [pb.MemoryHolding(step=s, world_size=1, ranks=[0]) for s in range(300)]
    with pytest.raises(grpc.RpcError) as ei:
        stub.Heartbeat(pb.NodeHeartbeatRequest(**beat, memory=many), timeout=10)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 256" in ei.value.details()

"""The coordinator over real gRPC: formation, commands, recovery decisions, bad input refused with precise
status codes and no state change, lost nodes replaced by spares, fencing, and SIGKILL of the coordinator."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import recovery_fixtures

import tg_testutil
from trainguard.proto import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc
from trainguard.recovery.convert import beat, node_record
from trainguard.recovery.coordinator import JobCoordinator
from trainguard.recovery.errors import NotServingError
from trainguard.recovery.service import CoordinatorServer, JobSpec
from trainguard.recovery.store import open_store

JOB = "svc-test"
_ports = iter(range(31000, 60000))

# the etcd server fixture, by name (an assignment, so no linter takes it for an unused import)
etcd_endpoint = recovery_fixtures.etcd_endpoint


def _info(nid: str, pod: str = "p0", idx: int = 0, addr: str = "127.0.0.1", spare: bool = False,
          replaces: str = "", dev: int = 2) -> common_pb2.NodeInfo:
    return common_pb2.NodeInfo(node_id=nid, address=addr, spare=spare, replaces=replaces,
                               topology=common_pb2.Topology(pod_id=pod, node_index=idx, host=nid, device_count=dev))


class Node:
    """A minimal real agent speaking the protocol (register, heartbeat, report)."""

    def __init__(self, stub, info: common_pb2.NodeInfo, instance: str = "") -> None:
        self.stub, self.info, self.instance = stub, info, instance
        self.gen, self.table = -1, None
        r = stub.RegisterNode(pb.RegisterNodeRequest(job=JOB, node=info, free_port=next(_ports),
                                                     agent_instance=instance))
        self.lease = r.lease_id

    def beat(self, **kw) -> pb.NodeHeartbeatResponse:
        req = pb.NodeHeartbeatRequest(job=JOB, node_id=self.info.node_id, lease_id=self.lease, generation=self.gen,
                                      free_port=next(_ports), **kw)
        resp = self.stub.Heartbeat(req)
        if resp.command in (pb.NODE_COMMAND_START, pb.NODE_COMMAND_RESTART):
            self.gen, self.table = resp.rank_table.generation, resp.rank_table
        elif resp.command == pb.NODE_COMMAND_STOP:
            self.gen = -1
        return resp

    def fail(self, rank: int = 0, code: int = -9, gen: int | None = None, level=pb.RECOVERY_LEVEL_PROCESS,
             kind: str = "process.exit") -> pb.ReportEventResponse:
        ev = common_pb2.HealthEvent(node_id=self.info.node_id, source="process", kind=kind, message="boom",
                                    severity=common_pb2.SEVERITY_CRITICAL)
        return self.stub.ReportEvent(pb.ReportEventRequest(
            job=JOB, node_id=self.info.node_id, lease_id=self.lease, generation=self.gen if gen is None else gen,
            event=ev, proposed_level=level, failed_rank=rank, exit_code=code))


@pytest.fixture
def server(tmp_path, request):
    kw = getattr(request, "param", {})
    spec = JobSpec(job=JOB, nnodes=kw.get("nnodes", 3), max_restarts=kw.get("max_restarts", 3),
                   heartbeat_interval_s=0.1, lease_timeout_s=kw.get("lease", 30.0), backoff_initial_s=0.0,
                   store=f"sqlite://{tmp_path}/c.db")
    srv = CoordinatorServer(spec).start()
    chan = grpc.insecure_channel(srv.target)
    try:
        yield srv, coordinator_pb2_grpc.CoordinatorStub(chan)
    finally:
        chan.close()
        srv.stop(0)


def _form(stub, infos) -> list[Node]:
    infos = list(infos)
    random.shuffle(infos)
    nodes = [Node(stub, i) for i in infos]
    for n in nodes:
        n.beat()
    for n in nodes:
        if n.gen < 0:
            n.beat()
    return sorted(nodes, key=lambda n: n.info.node_id)


def test_formation_ranks_and_fresh_master_port(server) -> None:
    srv, stub = server
    a, b, c = _form(stub, [_info("a", "pod-10"), _info("b", "pod-2", 1), _info("c", "pod-2", 0)])
    assert a.gen == b.gen == c.gen == 1
    t = stub.GetRankTable(pb.GetRankTableRequest(job=JOB))
    assert [n.node_id for n in t.nodes] == ["c", "b", "a"] and t.world_size == 6 and t.node_count == 3
    assert [n.first_rank for n in t.nodes] == [0, 2, 4]
    assert a.beat().command == pb.NODE_COMMAND_NONE
    assert a.beat().job_state == pb.JOB_STATE_RUNNING


def test_failure_restart_dedup_budget_and_success(server) -> None:
    srv, stub = server
    nodes = _form(stub, [_info(f"n{i}", idx=i) for i in range(3)])
    port1 = nodes[0].table.master_port
    d = nodes[1].fail(rank=3, code=-9)
    assert d.decided_level == pb.RECOVERY_LEVEL_PROCESS and d.new_generation == 2
    dup = nodes[2].fail(rank=5, code=1, gen=1)  # consequence of the same fault, same old generation
    assert dup.new_generation == 2
    for n in nodes:
        n.beat()
        n.beat()
    assert {n.gen for n in nodes} == {2} and nodes[0].table.master_port != port1
    assert nodes[0].table.restart_count == 1
    for n in nodes:
        assert n.beat(workers_running=2, workers_succeeded=True).command in (pb.NODE_COMMAND_NONE,
                                                                             pb.NODE_COMMAND_STOP)
    r = nodes[0].beat(workers_succeeded=True)
    assert r.job_state == pb.JOB_STATE_SUCCEEDED and r.command == pb.NODE_COMMAND_STOP


@pytest.mark.parametrize("server", [{"nnodes": 1, "max_restarts": 1}], indirect=True)
def test_budget_exhausted_names_rank_code_and_count(server) -> None:
    srv, stub = server
    (n,) = _form(stub, [_info("solo")])
    n.fail(rank=1, code=7)
    n.beat()
    n.beat()
    d = n.fail(rank=1, code=7)
    assert d.decided_level == pb.RECOVERY_LEVEL_PROCESS
    r = n.beat()
    assert r.job_state == pb.JOB_STATE_FAILED and r.command == pb.NODE_COMMAND_STOP
    assert "rank 1 on node solo exited with code 7" in r.message and "after 1 restart (max 1)" in r.message


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as ei:
        fn()
    return ei.value.code()


def test_bad_input_is_refused_precisely_and_changes_nothing(server, tmp_path) -> None:
    srv, stub = server
    nodes = _form(stub, [_info(f"n{i}", idx=i) for i in range(3)])
    store = open_store(f"sqlite://{tmp_path}/c.db")
    before = {k: r.value for k, r in store.scan("").items()}
    reg = lambda **kw: stub.RegisterNode(pb.RegisterNodeRequest(**{"job": JOB, "node": _info("x"), **kw}))  # noqa
    assert _code(lambda: reg(job="other")) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: reg(node=_info(""))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: reg(node=_info("a/b"))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: reg(free_port=70000)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: reg(node=_info("x", dev=5000))) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: reg(node=_info("n1", addr="10.9.9.9"))) == grpc.StatusCode.ALREADY_EXISTS
    assert _code(lambda: reg(node=_info("x", replaces="n1"))) == grpc.StatusCode.FAILED_PRECONDITION
    big = _info("x")
    big.topology.labels["blob"] = "y" * 300_000
    assert _code(lambda: reg(node=big)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    hb = lambda **kw: stub.Heartbeat(pb.NodeHeartbeatRequest(**{"job": JOB, "node_id": "n0",  # noqa
                                                                "lease_id": nodes[0].lease, **kw}))
    assert _code(lambda: hb(lease_id="f" * 32)) == grpc.StatusCode.FAILED_PRECONDITION
    assert _code(lambda: hb(node_id="ghost")) == grpc.StatusCode.NOT_FOUND
    assert _code(lambda: hb(generation=99)) == grpc.StatusCode.OUT_OF_RANGE
    assert _code(lambda: hb(generation=-5)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: nodes[0].fail(gen=7)) == grpc.StatusCode.OUT_OF_RANGE
    assert _code(lambda: stub.GetRankTable(pb.GetRankTableRequest(job="nope"))) == grpc.StatusCode.NOT_FOUND
    after = {k: r.value for k, r in store.scan("").items()}
    assert after == before
    assert nodes[0].beat().command == pb.NODE_COMMAND_NONE  # the job is untouched
    store.close()


def test_agent_restart_on_same_host_takes_over_and_old_instance_is_a_duplicate(server) -> None:
    srv, stub = server
    nodes = [Node(stub, _info(f"n{i}", idx=i), instance=f"i{i}") for i in range(3)]
    for n in nodes:
        n.beat()
    again = Node(stub, _info("n1", idx=1), instance="i1")  # a retried registration: same lease
    assert again.lease == nodes[1].lease
    newer = Node(stub, _info("n1", idx=1), instance="i1-restarted")
    assert newer.lease != nodes[1].lease
    assert _code(lambda: Node(stub, _info("n1", idx=1), instance="i1")) == grpc.StatusCode.ALREADY_EXISTS
    assert _code(lambda: nodes[1].beat()) == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("server", [{"nnodes": 3, "lease": 1.0}], indirect=True)
def test_lost_node_is_replaced_by_a_same_pod_spare(server) -> None:
    srv, stub = server
    nodes = _form(stub, [_info("a0", "pa", 0), _info("a1", "pa", 1), _info("b0", "pb", 0)])
    spares = [Node(stub, _info("sb", "pb", 9, spare=True)), Node(stub, _info("sa", "pa", 9, spare=True))]
    master = nodes[0].table.master_addr
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for n in nodes[:2] + spares:  # a1 keeps beating, b0 falls silent
            n.beat(workers_running=2)
        if spares[0].gen > 1:
            break
        time.sleep(0.1)
    t = spares[0].table
    assert t is not None and [n.node_id for n in t.nodes] == ["a0", "a1", "sb"], t
    assert t.master_addr == master and spares[1].gen == -1
    r = nodes[2].beat()  # b0 comes back: it was cordoned
    assert r.command == pb.NODE_COMMAND_STOP and "cordoned" in r.message


@pytest.mark.parametrize("server", [{"nnodes": 3, "lease": 1.5}], indirect=True)
@pytest.mark.parametrize("b0_beats_last", [False, True], ids=["b0-quiet-first", "b0-beat-just-before"])
def test_peers_crash_report_waits_for_the_dead_node_and_merges_into_one_node_restart(server, b0_beats_last) -> None:
    """b0 dies; a0's worker breaks with it and reports first. The process-level restart waits (while b0 is
    quiet, or, when b0 beat a few ms before the report, until it is heard from after the plan, which never
    happens), and b0's lease expiry turns it into one node-level restart with the spare (not two restarts; the
    second case was a regression: the restart went ahead in place with the dead b0)."""
    srv, stub = server
    nodes = _form(stub, [_info("a0", "pa", 0), _info("a1", "pa", 1), _info("b0", "pb", 0)])
    spare = Node(stub, _info("sb", "pb", 9, spare=True))
    if not b0_beats_last:
        time.sleep(0.5)  # b0 misses its heartbeats from now on
    for n in (nodes if b0_beats_last else nodes[:2]) + [spare]:
        n.beat(workers_running=2)
    r = nodes[0].fail(rank=0, code=1)
    assert r.new_generation == 2
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and spare.gen < 2:
        for n in nodes[:2] + [spare]:
            n.beat(workers_running=2)
            assert not (n.gen == 2 and "b0" in [x.node_id for x in n.table.nodes])  # no restart in place
        time.sleep(0.05)
    t = spare.table
    assert spare.gen == 2 and [n.node_id for n in t.nodes] == ["a0", "a1", "sb"], t  # generation 2, not 3
    assert t.restart_count == 1


@pytest.mark.parametrize("server", [{"nnodes": 3, "lease": 1.5}], indirect=True)
def test_process_restart_in_place_forms_once_every_holder_has_beaten_after_the_report(server) -> None:
    """A worker crash with every node alive: the restart stays in place, and forms at the first round of
    heartbeats after the report."""
    srv, stub = server
    nodes = _form(stub, [_info("a0", "pa", 0), _info("a1", "pa", 1), _info("b0", "pb", 0)])
    for n in nodes:
        n.beat(workers_running=2)
    assert nodes[1].fail(rank=2, code=1).new_generation == 2
    for _ in range(2):  # the round that forms it, and one to tell the nodes that beat before the last one
        for n in nodes:
            n.beat(workers_running=0)
    assert all(n.gen == 2 for n in nodes), [n.gen for n in nodes]
    assert [x.node_id for x in nodes[0].table.nodes] == ["a0", "a1", "b0"]


def test_predicted_failure_gets_one_job_wide_checkpoint_step_ahead_of_every_rank(server) -> None:
    srv, stub = server
    nodes = _form(stub, [_info("a0", "pa", 0), _info("a1", "pa", 1), _info("b0", "pb", 0)])
    for step in range(0, 40, 4):  # ~40 steps/s reported over a second
        for n in nodes:
            n.beat(workers_running=2, last_step=step)
        time.sleep(0.1)

    def ask(node: Node) -> pb.ReportEventResponse:
        ev = common_pb2.HealthEvent(node_id=node.info.node_id, source="predictor", kind="predictor.checkpoint",
                                    message="risk 0.97", severity=common_pb2.SEVERITY_WARNING,
                                    action=common_pb2.ACTION_CHECKPOINT_NOW)
        return stub.ReportEvent(pb.ReportEventRequest(job=JOB, node_id=node.info.node_id, lease_id=node.lease,
                                                      generation=node.gen, event=ev,
                                                      proposed_level=pb.RECOVERY_LEVEL_NONE, failed_rank=-1))

    r = ask(nodes[2])
    assert r.decided_level == pb.RECOVERY_LEVEL_NONE and r.new_generation == 1 and "job-wide checkpoint" in r.message
    reqs = [n.beat(workers_running=2, last_step=36).checkpoint for n in nodes]
    assert len({(q.at_step, q.request_id) for q in reqs}) == 1  # every node hears the same step
    assert reqs[0].at_step >= 36 + 2 and reqs[0].generation == 1 and "b0" in reqs[0].reason
    assert "already pending" in ask(nodes[0]).message  # no second, moving target
    nodes[0].fail(rank=0, code=1)  # a restart: the request belonged to generation 1 only
    assert not any(n.beat(workers_running=0).HasField("checkpoint") for n in nodes)


def test_fencing_refuses_the_superseded_coordinator(tmp_path) -> None:
    spec = JobSpec(job=JOB, store=f"sqlite://{tmp_path}/f.db")
    old = JobCoordinator(spec)
    lease, _, fut = old.register(JOB, node_record(_info("n0")), 40000)
    old.wait_durable(fut)
    new = JobCoordinator(spec)
    _, _, fut = old.register(JOB, node_record(_info("n1")), 40001)
    with pytest.raises(NotServingError, match="another coordinator took over"):
        old.wait_durable(fut)
    with pytest.raises(NotServingError):
        old.register(JOB, node_record(_info("n2")), 40002)
    assert set(new.members()) == {"n0"}
    old.close()
    new.close()


def _until(nodes: list[Node], gen: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while {n.gen for n in nodes} != {gen}:
        assert time.monotonic() < deadline, [(n.info.node_id, n.gen) for n in nodes]
        for n in nodes:
            n.beat()
        time.sleep(0.05)


def _free_port() -> int:
    return tg_testutil.free_port()


def _start_cli(port: int, store: str, env: dict, tmp: Path) -> subprocess.Popen:
    pf = tmp / f"port-{time.monotonic_ns()}"
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "coordinator", "--job", JOB, "--listen",
                             f"127.0.0.1:{port}", "--store", store, "--nnodes", "2", "--heartbeat-interval", "0.2",
                             "--lease-timeout", "20", "--port-file", str(pf)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not pf.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("scheme", ["sqlite", "file", "etcd"])
def test_sigkilled_coordinator_continues_the_job(tmp_path, tg_env, scheme, request) -> None:
    if scheme == "etcd":
        from recovery_fixtures import ETCD_BINARY, ETCD_SKIP_REASON
        if ETCD_BINARY is None:
            pytest.skip(ETCD_SKIP_REASON)
        store = f"etcd://{request.getfixturevalue('etcd_endpoint')}/kill{os.getpid()}-{time.monotonic_ns()}"
    else:
        store = {"sqlite": f"sqlite://{tmp_path}/k.db", "file": f"file://{tmp_path}/kdir"}[scheme]
    port = _free_port()
    proc = _start_cli(port, store, tg_env, tmp_path)
    chan = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = coordinator_pb2_grpc.CoordinatorStub(chan)
        nodes = _form(stub, [_info("n0"), _info("n1", idx=1)])
        assert {n.gen for n in nodes} == {1}
        nodes[1].fail(rank=2, code=-9)
        for n in nodes:
            n.beat()
            n.beat()
        assert {n.gen for n in nodes} == {2}
        ports = {nodes[0].table.master_port}
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with pytest.raises(grpc.RpcError) as ei:
            nodes[0].beat()
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        proc = _start_cli(port, store, tg_env, tmp_path)
        # Same leases, same generation, same budget: the agents just keep going (after their channel reconnects).
        deadline = time.monotonic() + 20
        while True:
            try:
                r = nodes[0].beat(workers_running=2)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                time.sleep(0.2)
        assert r.command == pb.NODE_COMMAND_NONE and r.job_state in (pb.JOB_STATE_RUNNING, pb.JOB_STATE_RECOVERING)
        nodes[1].beat(workers_running=2)
        d = nodes[0].fail(rank=0, code=1)
        assert d.new_generation == 3 and "restart 2/3" in d.message
        _until(nodes, 3)  # the 2nd restart without progress waits out the backoff
        assert nodes[0].table.restart_count == 2
        assert nodes[0].table.master_port not in ports
    finally:
        chan.close()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("args, needle", [
    (["--store", "nosuch:///x"], "unknown store URL"),
    (["--store", "etcd://noport"], "is not host:port"),
    (["--nnodes", "0"], "--nnodes '0': need 1 <= MIN <= MAX"),
    (["--nnodes", "2", "--last-call-timeout", "-1"], "--last-call-timeout -1.0"),
    (["--job", "bad job!"], "job name"),
    # An int32 overflow in every rank table: the coordinator served, and every heartbeat answer failed.
    (["--max-restarts", "99999999999"], "max restarts 99999999999 is above 2147483647"),
])
def test_cli_bad_flags_are_one_line_errors(args, needle, tg_env) -> None:
    r = subprocess.run([sys.executable, "-m", "trainguard.cli", "coordinator", "--job", "j", "--listen",
                        "127.0.0.1:0", "--store", "memory://", *args], env=tg_env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_interval_and_lease_stretch_to_keep_under_the_heartbeat_rate() -> None:
    core = JobCoordinator(JobSpec(job=JOB, nnodes=40, heartbeat_interval_s=0.5, lease_timeout_s=2.0,
                                  max_heartbeat_rate=10.0))
    leases = [core.register(JOB, node_record(_info(f"n{i}", idx=i)), 40000 + i)[0] for i in range(30)]
    r = core.heartbeat(beat(pb.NodeHeartbeatRequest(job=JOB, node_id="n0", lease_id=leases[0], generation=-1)))
    assert r.response.interval_s == pytest.approx(3.0) and r.response.command == pb.NODE_COMMAND_WAIT
    assert core._lease_s() == pytest.approx(9.0)
    core.close()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_dial_target_of_an_ipv6_listener_is_bracketed() -> None:
    """`trainguard coordinator --listen [::1]:P`: the server's dial target read ::1:P, which gRPC cannot dial
    (an embedded coordinator's own agent waited out its join timeout against it)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv = CoordinatorServer(JobSpec(job=JOB, nnodes=1), listen="[::1]:0").start()
    try:
        assert srv.target == f"[::1]:{srv.port}"
        with grpc.insecure_channel(srv.target) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        srv.stop()


def test_a_node_refused_at_every_heartbeat_logs_one_warning_not_one_per_beat(server, caplog) -> None:
    """A lasting refusal (here a stale lease) comes back at every heartbeat: the first is a WARNING naming it,
    the rest of the window only DEBUG lines (at a thousand nodes that was hundreds of WARNINGs a second); another
    kind of refusal still gets its own WARNING at once."""
    import logging

    srv, stub = server
    nodes = _form(stub, [_info(f"n{i}", idx=i) for i in range(3)])
    caplog.set_level(logging.DEBUG, logger="trainguard.recovery.service")
    stale = pb.NodeHeartbeatRequest(job=JOB, node_id="n0", lease_id="f" * 32, generation=nodes[0].gen)
    for _ in range(20):
        assert _code(lambda: stub.Heartbeat(stale)) == grpc.StatusCode.FAILED_PRECONDITION
    assert _code(lambda: stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id="ghost", lease_id="f" * 32))) == \
        grpc.StatusCode.NOT_FOUND
    lines = [r for r in caplog.records if r.name == "trainguard.recovery.service" and "refused" in r.getMessage()]
    warnings = [r.getMessage() for r in lines if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "Heartbeat" in warnings[0] and "FAILED_PRECONDITION" in warnings[0] and "NOT_FOUND" in warnings[1]
    assert sum(r.levelno == logging.DEBUG for r in lines) == 19


def test_the_refusal_log_says_how_many_it_left_out_once_the_window_has_passed(caplog) -> None:
    """After the window, the next refusal of the kind is logged again with the count of those left out."""
    import logging

    from trainguard.recovery.errors import StaleLeaseError
    from trainguard.recovery.refusal_log import RefusalLog

    now = [100.0]
    logger = logging.getLogger("test.refusals")
    refusals = RefusalLog(logger, window_s=30.0, clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="test.refusals")
    for t in (100.0, 101.0, 110.0, 129.0, 131.0, 132.0):
        now[0] = t
        refusals.refused("Heartbeat", "FAILED_PRECONDITION", "a stale lease",
                         f"refused Heartbeat from ipv4:10.0.0.7:5000: {StaleLeaseError('stale lease')}")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "left out" not in warnings[0]
    assert "3 more Heartbeat call(s) refused with FAILED_PRECONDITION for a stale lease in the 31 s before" \
        in warnings[1], warnings[1]

"""The coordinator as a hostile peer sees it: two coordinators on one store, and requests no agent would send,
over real gRPC against in-process servers (each answer a clear status, never a crash, hang or changed state)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor

from coordinator_client import node_info

from trainguard.proto import common_pb2, coordinator_pb2 as pb, coordinator_pb2_grpc
from trainguard.recovery.job_records import decode_state
from trainguard.recovery.service import CoordinatorServer, JobSpec
from trainguard.recovery.store import FileStore

JOB = "hostile"


def _spec(tmp_path, nnodes: int = 2) -> JobSpec:
    return JobSpec(job=JOB, nnodes=nnodes, heartbeat_interval_s=0.1, lease_timeout_s=30.0, backoff_initial_s=0.0,
                   store=f"sqlite://{tmp_path}/hostile.db")


class _Client:
    """A gRPC stub on a server, closed with it."""

    def __init__(self, server: CoordinatorServer) -> None:
        self.chan = grpc.insecure_channel(server.target)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.chan)
        self.leases: dict[str, str] = {}

    def register(self, nid: str, idx: int = 0) -> str:
        self.leases[nid] = self.stub.RegisterNode(pb.RegisterNodeRequest(job=JOB, node=node_info(nid, idx=idx),
                                                                         free_port=40000 + idx), timeout=10).lease_id
        return self.leases[nid]

    def beat(self, nid: str, lease: str, gen: int = -1, idx: int = 0) -> pb.NodeHeartbeatResponse:
        return self.stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id=nid, lease_id=lease, generation=gen,
                                                           free_port=41000 + idx), timeout=10)

    def commit(self, nid: str, step: int) -> pb.CommitCheckpointResponse:
        return self.stub.CommitCheckpoint(pb.CommitCheckpointRequest(job=JOB, node_id=nid, step=step,
                                                                     lease_id=self.leases.get(nid, "")), timeout=10)


def _formed(c: _Client, n: int) -> dict[str, str]:
    """Registers n nodes and heartbeats until the first generation started; returns node -> lease."""
    leases = {f"n{i}": c.register(f"n{i}", i) for i in range(n)}
    for _ in range(20):
        if all(c.beat(nid, lease, idx=i).command == pb.NODE_COMMAND_START for i, (nid, lease) in
               enumerate(leases.items())):
            return leases
    raise AssertionError("the first generation did not form")


def test_a_superseded_coordinator_refuses_a_checkpoint_commit(tmp_path) -> None:
    # A commit that did not raise the job's step wrote nothing, so a coordinator whose job another had just taken
    # over answered OK: the node believed its step recorded, and the owner never learned of it.
    old = CoordinatorServer(_spec(tmp_path)).start()
    new = None
    oc = _Client(old)
    try:
        _formed(oc, 2)
        assert oc.commit("n0", 5).last_committed_step == -1  # n1 has committed nothing yet
        new = CoordinatorServer(_spec(tmp_path)).start()  # takes the job's fence
        with pytest.raises(grpc.RpcError) as ei:
            oc.commit("n0", 10)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "took over" in ei.value.details()
        nc = _Client(new)
        nc.leases = oc.leases  # the new coordinator restored the leases from the store
        try:
            assert nc.commit("n1", 10).last_committed_step == -1  # n0's step 10 reached the owner nowhere
            assert nc.commit("n0", 10).last_committed_step == 10
        finally:
            nc.chan.close()
    finally:
        oc.chan.close()
        old.stop(0)
        if new is not None:
            new.stop(0)


def test_a_step_near_int64_max_is_refused_and_the_job_wide_checkpoint_still_reaches_every_node(tmp_path) -> None:
    # One heartbeat's last_step of 2**63-1 was accepted; a checkpoint-now report then set the job-wide checkpoint
    # two steps beyond it, past int64, and every heartbeat answer of the generation failed with UNKNOWN.
    srv = CoordinatorServer(_spec(tmp_path)).start()
    c = _Client(srv)
    try:
        leases = _formed(c, 2)
        for i, (nid, lease) in enumerate(leases.items()):
            c.beat(nid, lease, gen=1, idx=i)
        for tokens in (10**12, 10**13):  # a step counted in tokens is a step
            c.stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id="n0", lease_id=leases["n0"], generation=1,
                                                     workers_running=2, last_step=tokens), timeout=10)
        for bad in (2**63 - 1, 2**53, -2):
            with pytest.raises(grpc.RpcError) as ei:
                c.stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id="n0", lease_id=leases["n0"], generation=1,
                                                         workers_running=2, last_step=bad), timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "last_step" in ei.value.details()
        for bad in (2**63 - 1, -1):
            with pytest.raises(grpc.RpcError) as ei:
                c.commit("n0", bad)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "step" in ei.value.details()
        ev = common_pb2.HealthEvent(node_id="n0", source="predictor", kind="predict", message="soon",
                                    severity=common_pb2.SEVERITY_WARNING, action=common_pb2.ACTION_CHECKPOINT_NOW)
        c.stub.ReportEvent(pb.ReportEventRequest(job=JOB, node_id="n0", lease_id=leases["n0"], generation=1, event=ev,
                                                 proposed_level=pb.RECOVERY_LEVEL_NONE, failed_rank=-1), timeout=10)
        for i, (nid, lease) in enumerate(leases.items()):
            assert c.beat(nid, lease, gen=1, idx=i).checkpoint.at_step >= 2
    finally:
        c.chan.close()
        srv.stop(0)


def test_a_replica_address_no_agent_sends_is_refused_and_never_relayed(tmp_path) -> None:
    # The address a node's replica server listens on is handed to its buddies with every heartbeat answer; it
    # was taken unchecked, so a 200 KB string or control characters reached every buddy.
    srv = CoordinatorServer(_spec(tmp_path)).start()
    c = _Client(srv)
    try:
        leases = _formed(c, 2)
        ok = c.stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id="n0", lease_id=leases["n0"], generation=1,
                                                      workers_running=2, replica_address="127.0.0.1:7001"), timeout=10)
        assert ok.job_state in (pb.JOB_STATE_RUNNING, pb.JOB_STATE_FORMING)
        for bad in ("h" * 200_000, "h" * 256, "127.0.0.1:7001\nFAKE LOG LINE"):
            with pytest.raises(grpc.RpcError) as ei:
                c.stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id="n0", lease_id=leases["n0"], generation=1,
                                                         workers_running=2, replica_address=bad), timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "replica_address" in ei.value.details()
        c.stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id="n1", lease_id=leases["n1"], generation=1,
                                                 workers_running=2, replica_address="127.0.0.1:7002"), timeout=10)
        targets = c.beat("n1", leases["n1"], gen=1, idx=1).replica_targets
        assert [(t.node_id, t.address) for t in targets] == [("n0", "127.0.0.1:7001")]
    finally:
        c.chan.close()
        srv.stop(0)


class _BrokenFileStore:
    """Makes a real file store's document unreadable (a directory where the file was) and mends it."""

    def __init__(self, directory: Path) -> None:
        self.doc, self.aside = directory / "state.json", directory.parent / "state.json.aside"

    def __enter__(self) -> "_BrokenFileStore":
        os.rename(self.doc, self.aside)
        self.doc.mkdir()
        return self

    def __exit__(self, *exc: object) -> None:
        self.doc.rmdir()
        os.rename(self.aside, self.doc)


def _file_spec(tmp_path) -> JobSpec:
    return JobSpec(job=JOB, nnodes=2, heartbeat_interval_s=0.1, lease_timeout_s=30.0, backoff_initial_s=0.0,
                   store=f"file://{tmp_path}/st")


def test_a_generation_the_store_failed_to_take_starts_once_the_store_answers_again(tmp_path) -> None:
    # The first generation formed during a store outage: its write failed, and after the store came back every
    # heartbeat still waited on that failed write and was answered UNAVAILABLE "retry shortly", for good.
    srv = CoordinatorServer(_file_spec(tmp_path)).start()
    c = _Client(srv)
    try:
        n1 = pb.RegisterNodeRequest(job=JOB, node=node_info("n1", idx=1), free_port=40001, agent_instance="agent-1")
        leases = {"n0": c.register("n0", 0)}
        with _BrokenFileStore(tmp_path / "st"):
            with pytest.raises(grpc.RpcError) as ei:
                c.stub.RegisterNode(n1, timeout=10)  # enough nodes: the generation forms, neither write lands
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "durable" in ei.value.details()
            assert srv.core.state.generation == 1
        leases["n1"] = c.stub.RegisterNode(n1, timeout=10).lease_id  # the agent retries
        deadline = time.monotonic() + 20
        started: set[str] = set()
        while started != set(leases):
            assert time.monotonic() < deadline, "the generation never started after the store came back"
            for i, (nid, lease) in enumerate(leases.items()):
                try:
                    if c.beat(nid, lease, idx=i).command == pb.NODE_COMMAND_START:
                        started.add(nid)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            time.sleep(0.05)
        state = FileStore(tmp_path / "st").get(f"trainguard/jobs/{JOB}/state")
        assert state is not None and decode_state(JOB, state.value).policy.generation == 1
    finally:
        c.chan.close()
        srv.stop(0)


def test_a_retried_registration_is_acknowledged_only_once_its_record_is_durable(tmp_path) -> None:
    # The store failed the first call's write (UNAVAILABLE, "retry shortly"); the agent's retry was answered OK at
    # once as "the live agent registering again", and its record never reached the store: a restarted
    # coordinator did not know the node.
    srv = CoordinatorServer(_file_spec(tmp_path)).start()
    c = _Client(srv)
    req = pb.RegisterNodeRequest(job=JOB, node=node_info("n0"), free_port=40000, agent_instance="agent-1")
    try:
        with _BrokenFileStore(tmp_path / "st"):
            with pytest.raises(grpc.RpcError) as ei:
                c.stub.RegisterNode(req, timeout=10)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        lease = c.stub.RegisterNode(req, timeout=10).lease_id
        rec = FileStore(tmp_path / "st").get(f"trainguard/jobs/{JOB}/nodes/n0")
        assert rec is not None and lease in rec.value.decode(errors="replace")
    finally:
        c.chan.close()
        srv.stop(0)


_INTS = [0, 1, -1, 2, 7, 2**31 - 1, -2**31, 2**63 - 1, -2**63, 65535, 65536, 1025, 10**12]
_FLOATS = [0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), float("-inf"), 1e308, 5e-324, 3600.0]
_STRS = ["", JOB, "n0", "n1", "ghost", "a/b", " ", "x" * 300, "\x00", "é", "n0\n", "..", "n" * 129, "stack.0"]
#: What a hostile request may be answered: a refusal from the service's table, never UNKNOWN (a handler raised),
#: INTERNAL or DEADLINE_EXCEEDED (a hang).
_CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OUT_OF_RANGE}


def _value(rnd: random.Random, f: FieldDescriptor) -> object:
    if f.type == FieldDescriptor.TYPE_STRING:
        return rnd.choice(_STRS)
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return rnd.choice(_FLOATS)
    if f.type == FieldDescriptor.TYPE_BOOL:
        return rnd.random() < 0.5
    if f.type == FieldDescriptor.TYPE_BYTES:
        return rnd.randbytes(8)
    return rnd.choice(_INTS + [3, 4, 99])  # ints and enums; values a field cannot hold are skipped


def _mutate(rnd: random.Random, msg, depth: int = 0) -> None:
    """Sets one field of ``msg`` (or of a message inside it) to a hostile value."""
    f = rnd.choice(msg.DESCRIPTOR.fields)
    repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == f.LABEL_REPEATED
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        getattr(msg, f.name)[rnd.choice(_STRS)] = rnd.choice(_STRS)
    elif f.message_type is not None:
        if depth >= 3:
            return
        for _ in range(rnd.choice([1, 3, 40]) if repeated else 1):
            sub = getattr(msg, f.name).add() if repeated else getattr(msg, f.name)
            for _ in range(rnd.randint(1, 4)):
                _mutate(rnd, sub, depth + 1)
            sub.SetInParent()
    else:
        try:
            if repeated:
                getattr(msg, f.name).append(_value(rnd, f))
            else:
                setattr(msg, f.name, _value(rnd, f))
        except (ValueError, TypeError):
            pass


def test_hostile_values_in_every_rpc_field_get_a_clear_status_and_the_job_is_served_on(tmp_path) -> None:
    srv = CoordinatorServer(_spec(tmp_path)).start()
    c = _Client(srv)
    rnd = random.Random(5)
    try:
        leases = _formed(c, 2)
        ev = common_pb2.HealthEvent(node_id="n0", source="t", kind="process.exit", message="m",
                                    severity=common_pb2.SEVERITY_CRITICAL)
        ask = common_pb2.HealthEvent(node_id="n0", source="predictor", kind="predict", message="soon",
                                     action=common_pb2.ACTION_CHECKPOINT_NOW)
        valid = {
            "RegisterNode": lambda n, l: pb.RegisterNodeRequest(job=JOB, node=node_info("n2", idx=2), free_port=40002),
            "Heartbeat": lambda n, l: pb.NodeHeartbeatRequest(job=JOB, node_id=n, lease_id=l, generation=1,
                                                              workers_running=2, last_step=3),
            "ReportEvent": lambda n, l: pb.ReportEventRequest(job=JOB, node_id=n, lease_id=l, generation=1, event=ev,
                                                              proposed_level=pb.RECOVERY_LEVEL_NONE, failed_rank=-1),
            "GetRankTable": lambda n, l: pb.GetRankTableRequest(job=JOB),
            "CommitCheckpoint": lambda n, l: pb.CommitCheckpointRequest(job=JOB, node_id=n, step=5, lease_id=l),
            "QualifyPeers": lambda n, l: pb.QualifyPeersRequest(job=JOB, node_id=n, count=2),
            "ReportNodeHealth": lambda n, l: pb.NodeHealthReportRequest(
                job=JOB, node_id=n, host="h", verdict=pb.NODE_HEALTH_VERDICT_HEALTHY, risk=0.1, agent_instance="d"),
            "UncordonNode": lambda n, l: pb.UncordonNodeRequest(job=JOB, node_id=n, reason="r"),
            # Another lease than the node's (a slot holder that leaves is a lost node: the job must go on here).
            "LeaveNode": lambda n, l: pb.LeaveNodeRequest(job=JOB, node_id=n, lease_id=l[::-1], reason="r"),
        }
        assert sorted(valid) == sorted(m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods)
        answers: dict[str, set[str]] = {}
        for i in range(240):
            name = rnd.choice(sorted(valid))
            nid = rnd.choice(sorted(leases))
            req = valid[name](nid, leases[nid])
            for _ in range(rnd.randint(1, 3)):
                _mutate(rnd, req)
            try:
                getattr(c.stub, name)(req, timeout=15)
                code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                code = exc.code()
                assert code in _CLEAR, (name, code, exc.details(), str(req)[:500])
            answers.setdefault(name, set()).add(code.name)
            if i % 20 == 0 or (name == "Heartbeat" and code == grpc.StatusCode.OK):
                # What was accepted must not break the well-behaved nodes, a job-wide checkpoint asked for included.
                c.stub.ReportEvent(pb.ReportEventRequest(job=JOB, node_id="n0", lease_id=leases["n0"], generation=1,
                                                         event=ask, failed_rank=-1), timeout=15)
                for j, nid in enumerate(sorted(leases)):
                    try:
                        c.beat(nid, leases[nid], gen=1, idx=j)
                    except grpc.RpcError as exc:  # a hostile registration under its id took the node over
                        assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE), exc
                        leases[nid] = c.register(nid, j)
        assert all(len(codes) >= 2 for codes in answers.values()), answers  # each RPC got past its checks too
        assert c.stub.GetRankTable(pb.GetRankTableRequest(job=JOB), timeout=10).job == JOB
    finally:
        c.chan.close()
        srv.stop(0)


def test_fatal_reports_with_long_reasons_keep_the_job_state_small(tmp_path) -> None:
    # Each cordoned node's reason went whole into the job state, which is rewritten at every change: a few hundred
    # fatal reports with 4 KB reasons made it pass etcd's 1.5 MiB request limit, after which no state write landed.
    # (Only registered nodes are cordoned in the stored state: see test_coordinator_bounds for made-up ids.)
    srv = CoordinatorServer(_spec(tmp_path, nnodes=61)).start()  # 60 nodes form no generation
    c = _Client(srv)
    rnd = random.Random(3)
    try:
        for i in range(60):
            c.register(f"bad{i}", i)
            reason = "".join(rnd.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=4000))
            r = c.stub.ReportNodeHealth(pb.NodeHealthReportRequest(
                job=JOB, node_id=f"bad{i}", host=f"h{i}", verdict=pb.NODE_HEALTH_VERDICT_FATAL, reason=reason,
                agent_instance="d"), timeout=30)
            assert r.cordoned
        state = srv.core._raw_store.get(f"trainguard/jobs/{JOB}/state")  # noqa: SLF001 - the record as stored
        assert state is not None and len(state.value) < 60 * 600, len(state.value)
        why = decode_state(JOB, state.value).policy.cordon_why
        assert len(why) == 60 and all(w.endswith("...)") and len(w) < 400 for w in why.values())
    finally:
        c.chan.close()
        srv.stop(0)


def test_a_corrupt_checkpoint_record_stops_the_start_with_a_message_naming_it(tmp_path, tg_env) -> None:
    """The committed step was read raw: a damaged record (a hand edit, a half-restored backup) stopped
    `trainguard coordinator` with a Python traceback (KeyError / JSON error) that named neither the key nor what
    to do, where every other damaged record is named with its remedy."""
    import subprocess
    import sys

    from trainguard.recovery.store import Put, open_store

    url = f"sqlite://{tmp_path}/ck.db"
    store = open_store(url)
    store.commit([], [Put(f"trainguard/jobs/{JOB}/checkpoint", b'{"steps": 12}')])
    store.close()
    r = subprocess.run([sys.executable, "-m", "trainguard.cli", "coordinator", "--job", JOB, "--nnodes", "1",
                        "--listen", "127.0.0.1:0", "--store", url], env=tg_env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert f"checkpoint record 'trainguard/jobs/{JOB}/checkpoint' is corrupt" in r.stderr and "delete it" in r.stderr, \
        r.stderr

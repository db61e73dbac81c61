"""The coordinator as a hostile peer sees it: two coordinators on one store, and requests no agent would send,
over real gRPC against in-process servers (each answer a clear status, never a crash, hang or changed state)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

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

    def register(self, nid: str, idx: int = 0) -> str:
        return self.stub.RegisterNode(pb.RegisterNodeRequest(job=JOB, node=node_info(nid, idx=idx),
                                                             free_port=40000 + idx), timeout=10).lease_id

    def beat(self, nid: str, lease: str, gen: int = -1, idx: int = 0) -> pb.NodeHeartbeatResponse:
        return self.stub.Heartbeat(pb.NodeHeartbeatRequest(job=JOB, node_id=nid, lease_id=lease, generation=gen,
                                                           free_port=41000 + idx), timeout=10)

    def commit(self, nid: str, step: int) -> pb.CommitCheckpointResponse:
        return self.stub.CommitCheckpoint(pb.CommitCheckpointRequest(job=JOB, node_id=nid, step=step), timeout=10)


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
        for bad in (2**63 - 1, 10**12, -2):
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

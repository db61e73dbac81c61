"""Random bytes sent to every coordinator RPC over a real socket, against a real ``trainguard coordinator``:
each gets INVALID_ARGUMENT (not INTERNAL), the log holds no traceback, and the job is untouched."""

from __future__ import annotations

import random

import grpc
from coordinator_client import CoordinatorProcess, beat_until, node_info

from trainguard.proto import coordinator_pb2 as pb

METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods]


def test_random_bytes_on_every_rpc_get_invalid_argument_and_no_traceback(tmp_path, tg_env) -> None:
    c = CoordinatorProcess(tmp_path, tg_env, "bad-bytes", "--nnodes", "2", "--heartbeat-interval", "0.1")
    try:
        nodes = [c.agent(node_info(f"n{i}", "p1", i)) for i in range(2)]
        beat_until(nodes, lambda: all(n.gen == 1 for n in nodes))
        rnd = random.Random(12)
        codes: dict[str, list[grpc.StatusCode]] = {}
        assert len(METHODS) == 9  # QualifyPeers, ReportNodeHealth (node daemons), UncordonNode (operators), LeaveNode
        for method in METHODS:
            call = c.channel.unary_unary(f"/trainguard.v1.Coordinator/{method}", request_serializer=None,
                                         response_deserializer=None)
            for n in range(40):
                payload = rnd.randbytes(rnd.randint(1, 300)) if n else b"\xff\xff\xff"
                try:
                    call(payload, timeout=10)
                    codes.setdefault(method, []).append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.setdefault(method, []).append(exc.code())
        bad = {m: sorted({s.name for s in v if s is not grpc.StatusCode.INVALID_ARGUMENT}) for m, v in codes.items()}
        assert not any(bad.values()), bad
        assert all(len(v) == 40 for v in codes.values())
        assert nodes[0].beat().command == pb.NODE_COMMAND_NONE  # the job runs on, unchanged
        assert nodes[0].last.job_state == pb.JOB_STATE_RUNNING
    finally:
        c.stop()
    log = c.log()
    assert "Traceback" not in log and "Exception deserializing" not in log, log[-3000:]

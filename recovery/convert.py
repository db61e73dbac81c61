"""Protobuf <-> domain types, for the coordinator's gRPC service only (the core never sees a message).

Fail-slow rides on the same messages: a heartbeat's per-rank timing (``timings``), a report's stack dumps
(``hang.stacks`` evidence), and a reply's findings (``failslow``) and stack request (``stacks``).

Rank tables are the one large message: the wire form of a full table is built once per generation and reused
for every node's START (a 1,024-node table is ~50 KB; building it per heartbeat would dominate formation).
"""

from __future__ import annotations

from trainguard.proto import common_pb2, coordinator_pb2 as pb
from trainguard.recovery.domain import (Beat, CheckpointAsk, FailSlowStatus, FaultReport, GenerationTable,
                                        Instruction, LinkProbeResult, NodeRecord, RankTiming, StackAsk)
from trainguard.recovery.node_health import NodeHealthReport, Verdict
from trainguard.recovery.failslow import is_hang_report
from trainguard.recovery.memory_plan import MemoryHolding, RestorePlan
from trainguard.recovery.policy import Cause, Level
from trainguard.recovery.qualification import Qualification


def node_record(info: common_pb2.NodeInfo) -> NodeRecord:
    """A registration's NodeInfo as a :class:`NodeRecord`."""
    t = info.topology
    return NodeRecord(info.node_id, t.pod_id, t.node_index, t.host, t.device_count, info.address, info.agent_port,
                      info.spare, info.replaces, dict(t.labels))


def legacy_node_record(hex_info: str) -> NodeRecord:
    """A node record written by an older coordinator (the NodeInfo message, hex-encoded).

    Raises:
        ValueError: not hex, or not a NodeInfo.
    """
    from google.protobuf.message import DecodeError

    try:
        return node_record(common_pb2.NodeInfo.FromString(bytes.fromhex(hex_info)))
    except DecodeError as exc:
        raise ValueError(f"not a NodeInfo ({exc})") from exc


def beat(req: pb.NodeHeartbeatRequest) -> Beat:
    """A heartbeat request as a :class:`Beat`."""
    return Beat(req.job, req.node_id, req.lease_id, req.generation, req.workers_running, req.workers_succeeded,
                req.last_step, req.free_port,
                tuple(RankTiming(t.rank, t.step, t.step_s, t.wait_s, t.compute_s, t.steps) for t in req.timings),
                qualification(req), req.link_probe_port,
                tuple(LinkProbeResult(r.probe_id, r.peer_node, r.bytes, r.up_s, r.down_s, r.error)
                      for r in req.link_results),
                tuple(MemoryHolding(h.step, h.world_size, tuple(h.ranks), tuple(h.replica_ranks))
                      for h in req.memory), req.replica_address, req.replica_bytes, req.replica_holds_none)


def qualification(req: pb.RegisterNodeRequest | pb.NodeHeartbeatRequest) -> Qualification | None:
    """The pre-flight verdict a registration or heartbeat carries (None when it carries none)."""
    if not req.HasField("qualification"):
        return None
    q = req.qualification
    reason = q.reason or "; ".join(f"{c.name}: {c.detail}" for c in q.checks if c.status == "fail")
    return Qualification(q.passed, reason, q.duration_s, q.echo_port, q.peer_s)


def classify(event: common_pb2.HealthEvent, proposed: int) -> Cause:
    """Maps a reported health event (and the proposed level) to a failure cause.

    Args:
        event: the event.
        proposed: the proto ``RecoveryLevel`` the reporter proposes.

    Returns:
        The cause the policy uses.
    """
    kind = event.kind.lower()
    if proposed == pb.RECOVERY_LEVEL_JOB or event.action == common_pb2.ACTION_RESTART_JOB:
        return Cause.JOB_REQUEST
    if proposed == pb.RECOVERY_LEVEL_NODE or event.action == common_pb2.ACTION_DRAIN_NODE:
        return Cause.NODE_CRITICAL
    if is_hang_report(kind):  # by word: "hang" as a substring missed process.hung and took every *_change kind
        return Cause.WORKER_HANG
    if kind.startswith("process.") or proposed == pb.RECOVERY_LEVEL_PROCESS \
            or event.action == common_pb2.ACTION_RESTART_PROCESS:
        return Cause.WORKER_EXIT
    if event.severity >= common_pb2.SEVERITY_CRITICAL:
        return Cause.NODE_CRITICAL
    return Cause.ADVISORY


def fault_report(req: pb.ReportEventRequest) -> FaultReport:
    """A ReportEvent request as a classified :class:`FaultReport` (with the stack dumps its evidence carries)."""
    ev = req.event
    stacks = {k: v for k, v in ev.evidence.items() if k == "stack" or k.startswith("stack.")}
    return FaultReport(req.job, req.node_id, req.lease_id, req.generation, classify(ev, req.proposed_level),
                       Level(req.proposed_level) if req.proposed_level >= 1 else Level.NONE, req.failed_rank,
                       req.exit_code, ev.message or ev.kind,
                       req.proposed_level <= pb.RECOVERY_LEVEL_NONE and ev.action == common_pb2.ACTION_CHECKPOINT_NOW,
                       kind=ev.kind, stacks=stacks, stack_request=ev.evidence.get("request_id", ""))


def node_health_report(req: pb.NodeHealthReportRequest) -> NodeHealthReport:
    """A node daemon's ReportNodeHealth request as a :class:`NodeHealthReport` (an unset verdict is HEALTHY)."""
    verdict = Verdict(req.verdict) if req.verdict in (v.value for v in Verdict) else Verdict.HEALTHY
    return NodeHealthReport(req.job, req.node_id, req.host, verdict, req.reason, req.risk, req.agent_instance)


def _table_header(t: GenerationTable) -> common_pb2.RankTable:
    return common_pb2.RankTable(job=t.job, generation=t.generation, world_size=t.world_size,
                                master_addr=t.master_addr, master_port=t.master_port, restart_count=t.restart_count,
                                max_restarts=t.max_restarts, node_count=len(t.slots))


def rank_table(t: GenerationTable | None, job: str, only_node: str = "") -> common_pb2.RankTable:
    """A generation's table on the wire (empty with ``job`` set when there is none yet).

    Args:
        t: the table, or None before the first generation.
        job: the job name.
        only_node: cut the node list down to this node's entry ("" keeps every node).
    """
    if t is None:
        return common_pb2.RankTable(job=job)
    msg = _table_header(t)
    if only_node:
        one = t.slot_of(only_node)
        slots: tuple = (one,) if one is not None else ()
    else:
        slots = t.slots
    for s in slots:
        msg.nodes.add(node_id=s.node_id, group_rank=s.group_rank, first_rank=s.first_rank,
                      local_world_size=s.local_world_size, address=s.address)
    return msg


def checkpoint(c: CheckpointAsk) -> pb.CheckpointRequest:
    """A job-wide checkpoint on the wire."""
    return pb.CheckpointRequest(at_step=c.at_step, reason=c.reason, request_id=c.request_id, generation=c.generation)


def restore_plan(p: RestorePlan) -> pb.MemoryRestorePlan:
    """A restore plan on the wire."""
    msg = pb.MemoryRestorePlan(step=p.step, memory_steps=list(p.memory_steps))
    for r in p.ranks:
        entry = msg.ranks.add(rank=r.rank, source=int(r.source), peer_node=r.peer_node, peer_address=r.peer_address)
        for node, address in r.alternates:
            entry.alternates.add(node_id=node, address=address)
    return msg


def failslow_status(st: FailSlowStatus) -> common_pb2.FailSlowStatus:
    """Fail-slow findings on the wire."""
    msg = common_pb2.FailSlowStatus(job_step_s=st.job_step_s, job_slowdown=st.job_slowdown, action=st.action,
                                    message=st.message, ranks_observed=st.ranks_observed, link_probe=st.link_probe)
    for r in st.slow:
        msg.slow.add(rank=r.rank, node_id=r.node_id, ratio=r.ratio, excess_s=r.excess_s, since=r.since,
                     basis=r.basis, individual=r.individual)
    h = st.hang
    if h is not None:
        msg.hang.CopyFrom(common_pb2.HangFinding(
            generation=h.generation, outlier_ranks=list(h.outlier_ranks), outlier_nodes=list(h.outlier_nodes),
            outlier_frame=h.outlier_frame, majority_frame=h.majority_frame, ranks_seen=h.ranks_seen,
            groups=h.groups, repeats=h.repeats, time=h.time))
    return msg


def stack_request(a: StackAsk) -> pb.StackRequest:
    """A stack request on the wire."""
    return pb.StackRequest(request_id=a.request_id, generation=a.generation)


class ResponseCache:
    """Heartbeat answers on the wire, built once where every node gets the same one.

    Every node of a generation gets the same START (or RESTART) with the full table: the response is built once per
    (table, command, message, interval, fail-slow findings, stack request); the full table alone is kept per
    generation for GetRankTable. The fail-slow findings every reply carries while there are any are converted once
    per findings object (the coordinator keeps one until something changes).
    """

    def __init__(self) -> None:
        self._start: tuple[GenerationTable, tuple[object, ...], pb.NodeHeartbeatResponse] | None = None
        self._table: tuple[GenerationTable, common_pb2.RankTable] | None = None
        self._failslow: tuple[FailSlowStatus, common_pb2.FailSlowStatus] | None = None

    def full_table(self, t: GenerationTable) -> common_pb2.RankTable:
        """The wire form of a full table, cached per generation table."""
        cached = self._table
        if cached is None or cached[0] is not t:
            cached = (t, rank_table(t, t.job))
            self._table = cached
        return cached[1]

    def failslow(self, st: FailSlowStatus) -> common_pb2.FailSlowStatus:
        """The wire form of fail-slow findings, cached per findings object."""
        cached = self._failslow
        if cached is None or cached[0] is not st:
            cached = (st, failslow_status(st))
            self._failslow = cached
        return cached[1]

    def response(self, ins: Instruction) -> pb.NodeHeartbeatResponse:
        """A heartbeat response for an instruction."""
        if ins.table is not None and not ins.only_node:
            key = (ins.command, ins.message, ins.interval_s, ins.phase, ins.failslow, ins.stacks, ins.link_probes,
                   ins.restore_plan, ins.replica_targets)
            cached = self._start
            if cached is not None and cached[0] is ins.table and cached[1] == key:
                return cached[2]
            resp = pb.NodeHeartbeatResponse(command=int(ins.command), interval_s=ins.interval_s,
                                            job_state=ins.phase.value, message=ins.message)
            resp.rank_table.CopyFrom(self.full_table(ins.table))
            if ins.restore_plan is not None:
                resp.restore_plan.CopyFrom(restore_plan(ins.restore_plan))
            self._add_failslow(resp, ins)
            self._start = (ins.table, key, resp)
            return resp
        resp = pb.NodeHeartbeatResponse(command=int(ins.command), interval_s=ins.interval_s,
                                        job_state=ins.phase.value, message=ins.message, forming_missing=ins.missing)
        if ins.table is not None:
            resp.rank_table.CopyFrom(rank_table(ins.table, ins.table.job, ins.only_node))
            if ins.restore_plan is not None:
                resp.restore_plan.CopyFrom(restore_plan(ins.restore_plan))
        if ins.checkpoint is not None:
            resp.checkpoint.CopyFrom(checkpoint(ins.checkpoint))
        self._add_failslow(resp, ins)
        return resp

    def _add_failslow(self, resp: pb.NodeHeartbeatResponse, ins: Instruction) -> None:
        for node_id, address in ins.replica_targets:  # (rides with every reply, like the fail-slow findings)
            resp.replica_targets.add(node_id=node_id, address=address)
        if ins.failslow is not None:
            resp.failslow.CopyFrom(self.failslow(ins.failslow))
        if ins.stacks is not None:
            resp.stacks.CopyFrom(stack_request(ins.stacks))
        for a in ins.link_probes:
            resp.link_probes.add(probe_id=a.probe_id, peer_node=a.peer_node, peer_address=a.peer_address,
                                 peer_port=a.peer_port, bytes=a.bytes, timeout_s=a.timeout_s)

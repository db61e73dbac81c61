"""The coordinator's gRPC service: membership, rank tables per generation, restart decisions.

This is the job's single source of truth for "who runs which ranks in which generation". Node agents register,
heartbeat and report failures; the coordinator answers each heartbeat with a command (START/RESTART/STOP/WAIT).
A failure reported for the current generation opens a new generation for the whole job (a broken collective
group needs every rank); reports for older generations are duplicates of a fault already handled, so many
simultaneous failures cost one restart.

Every new generation gets a MASTER_PORT never used before in the job (the rank-0 node reports free ports in
its heartbeats): rank 0 hosts a fresh TCP store on it, so no worker of a new generation can read keys or peer
addresses left by the previous one.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from trainguard.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class _Member:
    info: common_pb2.NodeInfo
    lease_id: str
    last_seen: float
    free_port: int = 0
    generation: int = -1
    succeeded_generation: int = -1


@dataclass
class JobSpec:
    """What the coordinator needs to know about the job before nodes arrive.

    Attributes:
        job: job name; requests for other jobs are refused.
        nnodes: number of nodes that must register before the first generation starts.
        max_restarts: restarts allowed (counted job-wide, not per node) before the job fails.
        heartbeat_interval_s: interval told to agents, in seconds.
    """

    job: str
    nnodes: int = 1
    max_restarts: int = 3
    heartbeat_interval_s: float = 0.5


@dataclass
class _JobState:
    state: int = coordinator_pb2.JOB_STATE_FORMING
    generation: int = 0
    table: common_pb2.RankTable | None = None
    restart_count: int = 0
    used_ports: set[int] = field(default_factory=set)
    pending_generation: bool = False
    message: str = ""


def _host_key(host: str) -> tuple:
    # Numeric-aware: node-2 before node-10.
    import re

    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", host))


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """In-memory coordinator for one job.

    Args:
        spec: the job's parameters.
    """

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._job = _JobState()

    # -- helpers (called with the lock held) ---------------------------------------------------------------
    def _check_job(self, job: str, context: grpc.ServicerContext) -> None:
        if job != self.spec.job:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job {job!r}; this coordinator runs {self.spec.job!r}")

    def _member(self, node_id: str, lease_id: str, context: grpc.ServicerContext) -> _Member:
        m = self._members.get(node_id)
        if m is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"node {node_id!r} is not registered; register first")
        if m.lease_id != lease_id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stale lease for node {node_id!r}; register again")
        return m

    def _try_form_generation(self) -> None:
        job = self._job
        if job.state in (coordinator_pb2.JOB_STATE_SUCCEEDED, coordinator_pb2.JOB_STATE_FAILED):
            return
        if not (job.state == coordinator_pb2.JOB_STATE_FORMING or job.pending_generation):
            return
        active = [m for m in self._members.values() if not m.info.spare]
        if len(active) < self.spec.nnodes:
            return
        if job.table is not None:
            order = [n.node_id for n in job.table.nodes if n.node_id in self._members]
        else:
            order = []
        if len(order) != self.spec.nnodes:
            chosen = sorted(
                active,
                key=lambda m: (m.info.topology.pod_id, m.info.topology.node_index, _host_key(m.info.topology.host)),
            )[: self.spec.nnodes]
            order = [m.info.node_id for m in chosen]
        rank0 = self._members[order[0]]
        if rank0.free_port <= 0 or rank0.free_port in job.used_ports:
            return  # wait for the rank-0 node to report a fresh port
        table = common_pb2.RankTable(
            job=self.spec.job,
            generation=job.generation + 1,
            master_addr=rank0.info.address,
            master_port=rank0.free_port,
            restart_count=job.restart_count,
            max_restarts=self.spec.max_restarts,
        )
        first = 0
        for group_rank, node_id in enumerate(order):
            m = self._members[node_id]
            n = max(1, m.info.topology.device_count)
            table.nodes.add(node_id=node_id, group_rank=group_rank, first_rank=first, local_world_size=n,
                            address=m.info.address)
            first += n
        table.world_size = first
        job.used_ports.add(rank0.free_port)
        job.generation += 1
        job.table = table
        job.pending_generation = False
        job.state = coordinator_pb2.JOB_STATE_RUNNING
        log.info("generation %d formed: world size %d, master %s:%d", job.generation, first,
                 table.master_addr, table.master_port)

    def _command_for(self, m: _Member) -> coordinator_pb2.NodeHeartbeatResponse:
        job = self._job
        resp = coordinator_pb2.NodeHeartbeatResponse(
            interval_s=self.spec.heartbeat_interval_s, job_state=job.state, message=job.message
        )
        if job.state in (coordinator_pb2.JOB_STATE_SUCCEEDED, coordinator_pb2.JOB_STATE_FAILED):
            resp.command = coordinator_pb2.NODE_COMMAND_STOP
            return resp
        in_table = job.table is not None and any(n.node_id == m.info.node_id for n in job.table.nodes)
        if job.pending_generation or job.table is None:
            resp.command = (coordinator_pb2.NODE_COMMAND_STOP if m.generation >= 0 and job.pending_generation
                            else coordinator_pb2.NODE_COMMAND_WAIT)
            return resp
        if not in_table:
            resp.command = coordinator_pb2.NODE_COMMAND_STOP if m.generation >= 0 else coordinator_pb2.NODE_COMMAND_WAIT
            return resp
        if m.generation == job.generation:
            resp.command = coordinator_pb2.NODE_COMMAND_NONE
            return resp
        resp.command = (coordinator_pb2.NODE_COMMAND_START if m.generation < 0
                        else coordinator_pb2.NODE_COMMAND_RESTART)
        resp.rank_table.CopyFrom(job.table)
        return resp

    def _check_success(self) -> None:
        job = self._job
        if job.table is None or job.state != coordinator_pb2.JOB_STATE_RUNNING:
            return
        if all(self._members[n.node_id].succeeded_generation == job.generation
               for n in job.table.nodes if n.node_id in self._members):
            job.state = coordinator_pb2.JOB_STATE_SUCCEEDED
            job.message = f"all {job.table.world_size} ranks of generation {job.generation} exited 0"
            log.info("job %s succeeded: %s", self.spec.job, job.message)

    # -- RPCs -----------------------------------------------------------------------------------------------
    def RegisterNode(self, request, context):  # noqa: N802 (gRPC naming)
        """Adds (or re-adds) a node to the membership and returns its lease."""
        if not request.node.node_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "node.node_id is required")
        with self._lock:
            self._check_job(request.job, context)
            lease = uuid.uuid4().hex
            prev = self._members.get(request.node.node_id)
            m = _Member(info=request.node, lease_id=lease, last_seen=time.monotonic(), free_port=request.free_port)
            if prev is not None:
                m.generation = -1  # a re-registered agent runs no workers until told
            self._members[request.node.node_id] = m
            self._try_form_generation()
            return coordinator_pb2.RegisterNodeResponse(generation=self._job.generation, lease_id=lease)

    def Heartbeat(self, request, context):  # noqa: N802
        """Records a node's progress and returns the command it must carry out."""
        with self._lock:
            self._check_job(request.job, context)
            m = self._member(request.node_id, request.lease_id, context)
            m.last_seen = time.monotonic()
            if request.free_port > 0:
                m.free_port = request.free_port
            m.generation = request.generation
            if request.workers_succeeded and request.generation == self._job.generation:
                m.succeeded_generation = request.generation
                self._check_success()
            self._try_form_generation()
            return self._command_for(m)

    def ReportEvent(self, request, context):  # noqa: N802
        """Decides the recovery for a reported failure; duplicates of a handled fault change nothing."""
        with self._lock:
            self._check_job(request.job, context)
            self._member(request.node_id, request.lease_id, context)
            job = self._job
            resp = coordinator_pb2.ReportEventResponse(new_generation=job.generation)
            if job.state in (coordinator_pb2.JOB_STATE_SUCCEEDED, coordinator_pb2.JOB_STATE_FAILED):
                resp.decided_level = coordinator_pb2.RECOVERY_LEVEL_NONE
                resp.message = job.message
                return resp
            if request.generation < job.generation or job.pending_generation:
                resp.decided_level = coordinator_pb2.RECOVERY_LEVEL_NONE
                resp.message = f"duplicate: generation {request.generation} is already being replaced"
                return resp
            what = request.event.message or request.event.kind
            if job.restart_count >= self.spec.max_restarts:
                job.state = coordinator_pb2.JOB_STATE_FAILED
                job.message = (f"rank {request.failed_rank} failed ({what}); restart budget exhausted after "
                               f"{job.restart_count} restarts (max {self.spec.max_restarts})")
                log.error("job %s failed: %s", self.spec.job, job.message)
                resp.decided_level = coordinator_pb2.RECOVERY_LEVEL_JOB
                resp.message = job.message
                return resp
            job.restart_count += 1
            job.pending_generation = True
            job.state = coordinator_pb2.JOB_STATE_RECOVERING
            job.message = f"restart {job.restart_count}/{self.spec.max_restarts} after rank {request.failed_rank}: {what}"
            log.warning("job %s: %s", self.spec.job, job.message)
            self._try_form_generation()
            resp.decided_level = coordinator_pb2.RECOVERY_LEVEL_PROCESS
            resp.new_generation = job.generation + (1 if job.pending_generation else 0)
            resp.message = job.message
            return resp

    def GetRankTable(self, request, context):  # noqa: N802
        """The current generation's rank table (empty before the first generation forms)."""
        with self._lock:
            self._check_job(request.job, context)
            return self._job.table if self._job.table is not None else common_pb2.RankTable(job=self.spec.job)

    def CommitCheckpoint(self, request, context):  # noqa: N802
        """Not used by the in-memory coordinator beyond echoing the step."""
        with self._lock:
            self._check_job(request.job, context)
            return coordinator_pb2.CommitCheckpointResponse(last_committed_step=request.step)


class CoordinatorServer:
    """A coordinator for one job served over gRPC.

    Args:
        spec: the job's parameters.
        listen: ``host:port`` to bind (port 0 picks a free one).
    """

    def __init__(self, spec: JobSpec, listen: str = "127.0.0.1:0") -> None:
        self.service = CoordinatorService(spec)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        coordinator_pb2_grpc.add_CoordinatorServicer_to_server(self.service, self._server)
        self.port = self._server.add_insecure_port(listen)
        if self.port == 0:
            from trainguard.recovery.errors import CoordinatorError

            raise CoordinatorError(f"cannot listen on {listen}: address in use or not local")
        self.host = listen.rsplit(":", 1)[0]

    @property
    def target(self) -> str:
        """``host:port`` clients dial."""
        return f"{self.host}:{self.port}"

    def start(self) -> "CoordinatorServer":
        """Starts serving; returns self."""
        self._server.start()
        return self

    def stop(self, grace_s: float = 0.5) -> None:
        """Stops serving and waits for in-flight calls up to ``grace_s`` seconds."""
        self._server.stop(grace_s).wait()

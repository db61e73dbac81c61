"""The node agent's core: obey the coordinator, supervise the local workers, record the failure timeline.

One loop per node::

    register --> heartbeat every interval --> command from the coordinator
                   ^        |                    START/RESTART: (stop old generation) start workers of the table
                   |        |                    STOP:          stop workers; exit when the job is over
                   |        v                    WAIT/NONE:     nothing
                   '-- poll workers every 50 ms: a worker that died -> stop local workers, report to coordinator

A worker failure is reported at once (not at the next heartbeat), so detection costs one poll period. The
coordinator turns it into a new generation for every node; the new rank table has a MASTER_PORT never used
before in the job.

Hardware cause. When hardware detectors run (any but ``process``), a worker failure first asks them for an
out-of-schedule sample (:mod:`trainguard.agent.node_faults`): if the node itself failed (action DRAIN_NODE or
more: PCIe AER fatal, GPU lost), the failure is reported at node level with that event as its cause, so the
coordinator replaces the node instead of restarting the workers on broken hardware. At most one node-level
report goes out per generation.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from trainguard._version import __version__
from trainguard.agent.errors import CoordinatorUnavailableError, JobFailedError
from trainguard.agent.event_bus import EventBus
from trainguard.agent.fault_records import FaultPlan, FaultRecord  # noqa: F401 (re-exported)
from trainguard.agent.generation import (  # noqa: F401 (the env names are re-exported)
    AGENT_SOCKET_ENV,
    GENERATION_ENV,
    JOB_ENV,
    NODE_ID_ENV,
    GenerationResources,
    read_error_file,
    worker_specs,
)
from trainguard.agent.memory_tier import MemoryTier, apply_restore_plan
from trainguard.agent.replica_agent import ReplicaAgent, ReplicaConfig
from trainguard.agent.node_faults import NodeReportLedger, hardware_cause, hardware_detector_names
from trainguard.agent.standby import StandbyPool
from trainguard.agent.step_timing import FailSlowView, TimingRelay, stack_evidence
from trainguard.agent.workers import WorkerGroup, WorkerState, describe_exit
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.proto import agent_pb2, common_pb2, coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)

# Worker exits reach the supervisor through its own 50 ms poll; the process detector's copies are only published.
_SEEN_BY_SUPERVISOR = frozenset({"process.killed", "process.failed", "process.exited", "process.vanished"})
_RPC_TIMEOUT_S = 5.0


@dataclass
class NodeConfig:
    """Everything one node agent needs to run its share of a job.

    Attributes:
        job: job name, as known to the coordinator.
        coordinator: ``host:port`` of the coordinator.
        argv_for_rank: builds a worker's command line (the same for every rank today).
        nproc_per_node: local worker count (devices, or CPU slots).
        node_id: stable identity; defaults to the host name.
        pod_id: pod / supernode label.
        node_index: index of the node in its pod.
        host: host name used for ordering.
        address: address other nodes reach this node's rank-0 store at.
        spare: join as a spare (no ranks until needed).
        max_restarts: restart budget, exported to workers as TORCHELASTIC_MAX_RESTARTS.
        socket_path: unix socket of the local NodeAgent service.
        log_dir: per-rank worker logs; None inherits the agent's stdout/stderr.
        coordinator_patience_s: how long the coordinator may be unreachable at registration, in seconds; also how
            long it may stay unreachable while this node runs no workers (running workers keep running through
            any outage, waiting for a restarted coordinator).
        stop_grace_s: SIGTERM-to-SIGKILL grace when stopping workers, in seconds.
        extra_env: more variables for every worker.
        standby: keep one warm standby process per local rank, so a restart skips interpreter start-up and
            imports (see :mod:`trainguard.agent.standby`).
        preload: modules a standby imports (default: torch and the trainguard hook).
        detectors: detector names to run (see ``trainguard detect``); "process" finds hung workers.
        detector_config: per-detector settings, name -> fields (e.g. ``{"process": {"hang_floor_s": 30}}``).
        predictor_model: trained predictor model file; None scores with the rules tier only.
        history_path: SQLite file of the metric history kept for training; None keeps none.
        checkpoint_dir: the job's checkpoint root on disk (``--checkpoint-dir``), where a predicted failure's
            drain looks for the job-wide checkpoint it asked for to be complete; None waits the whole grace.
        predictor_interval_s: seconds between two predictor scores. Default 5.0.
        drain_grace_s: seconds from a predictor alarm (workers advised to checkpoint now) to asking the
            coordinator to replace this node. Default 30.0.
        role: ``ROLE_NAME`` of the workers (torchrun's ``--role``).
        streams: local rank -> :class:`~trainguard.agent.run_torchrun.StreamSpec` (``-r``/``-t``/
            ``--local-ranks-filter``); missing ranks use the console (or ``log_dir``).
        error_dir: where each worker's ``TORCHELASTIC_ERROR_FILE`` lies (``<dir>/g<gen>/rank<R>/error.json``);
            None makes a temporary folder.
        virtual_local_rank: torchrun's ``--virtual-local-rank``.
        poll_s: seconds between two polls of the workers (torchrun's ``--monitor-interval``). Default 0.05.
        signals_to_handle: exported as ``TORCHELASTIC_SIGNALS_TO_HANDLE``.
        host_store: the agent of rank 0's node hosts each generation's store before the workers start
            (:mod:`trainguard.agent.worker_store`); else rank 0 hosts it. Default True.
        standby_after_s: arm the warm standbys once the generation has run this long even if no worker reported
            a step through the hook (plain scripts never do). Default 3.0.
        coordinator_channel: opens the channel to ``coordinator`` (TLS, client certificate and job token of
            :class:`trainguard.recovery.rpc_security.RpcSecurity`); None dials plaintext without a token.
        replica: peer replication of the in-memory checkpoints (:mod:`trainguard.agent.replica_agent`).
        memory_tier: ``"job"``: report the node's in-memory checkpoints and restore from any node's memory (see
            :mod:`trainguard.agent.memory_tier`); ``"host"``: neither (each host's memory tier on its own).
    """

    job: str
    coordinator: str
    argv: list[str]
    nproc_per_node: int = 1
    node_id: str = field(default_factory=socket.gethostname)
    pod_id: str = ""
    node_index: int = 0
    host: str = field(default_factory=socket.gethostname)
    address: str = "127.0.0.1"
    spare: bool = False
    max_restarts: int = 3
    socket_path: str | None = None
    log_dir: str | None = None
    coordinator_patience_s: float = 60.0
    stop_grace_s: float = 3.0
    extra_env: dict[str, str] = field(default_factory=dict)
    standby: bool = True
    preload: tuple[str, ...] = ()
    detectors: tuple[str, ...] = ("process",)
    detector_config: dict[str, dict] = field(default_factory=dict)
    predictor_model: str | None = None
    history_path: str | None = None
    checkpoint_dir: str | None = None
    predictor_interval_s: float = 5.0
    drain_grace_s: float = 30.0
    role: str = "default"
    streams: dict = field(default_factory=dict)
    error_dir: str | None = None
    virtual_local_rank: bool = False
    poll_s: float = 0.05
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    host_store: bool = True
    standby_after_s: float = 3.0
    coordinator_channel: Callable[[str], grpc.Channel] | None = None
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    memory_tier: str = "job"


def find_free_port(address: str) -> int:
    """A TCP port free on ``address`` right now (bind to port 0, read it, close)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class NodeAgent:
    """Runs one node's workers under a coordinator's direction.

    Args:
        config: the node's configuration.
        on_worker_started: test and drill hook, called with each new WorkerGroup.
    """

    def __init__(self, config: NodeConfig, faults: Sequence[FaultPlan] = (), notifier=None) -> None:
        self.config = config
        # systemd integration of `trainguard run` as a service (Type=notify): READY once registered, WATCHDOG
        # from the main loop only, STATUS per generation, STOPPING on a requested stop.
        self._notifier = notifier
        self._watchdog = None
        if notifier is not None and notifier.enabled:
            from trainguard.agent.sdnotify import Watchdog, watchdog_interval

            self._watchdog = Watchdog(notifier, watchdog_interval())
        for var in ("WATCHDOG_USEC", "WATCHDOG_PID"):  # meant for this process, not for the workers
            os.environ.pop(var, None)
        self.bus = EventBus()
        self.faults = list(faults)
        self.fault_records: list[FaultRecord] = []
        self.generation = -1
        self.table: common_pb2.RankTable | None = None
        self.stopping = False
        self.started_at = time.time()
        self.final_message = ""
        self.last_checkpoint_step = -1
        self.predictor_score = 0.0
        self.predictor_threshold = 0.0
        self.predictor_alarms_per_day = float("nan")  # realised learned-tier alarm rate (vs the budget)
        self._group: WorkerGroup | None = None
        self._lock = threading.RLock()
        self._advisories: dict[int, list[agent_pb2.Advisory]] = {}
        self._channel: grpc.Channel | None = None
        self._stub: coordinator_pb2_grpc.CoordinatorStub | None = None
        self._lease = ""
        self._unreachable_since: float | None = None  # first failed heartbeat of the current outage
        self._interval = 0.5
        self._wake = threading.Event()
        self._restart_count = 0
        # Tells a restarted agent of this node apart from a second agent claiming the same node id.
        self._instance = uuid.uuid4().hex
        self._standbys = StandbyPool()
        self._last_heartbeat = 0.0
        self._in_keepalive = False
        self._relayed: set[str] = set()  # job-wide checkpoint requests already passed to the workers
        self._drain_after_step: int | None = None  # the job-wide checkpoint a pending drain waits for
        self._runner = None
        self._hardware_detectors: tuple[str, ...] = ()
        self._pending_events: list[HealthEvent] = []
        self._node_reports = NodeReportLedger()
        self.predictor = None  # PredictorMonitor once start_predictor() ran
        self._predictor_interval_s = 5.0
        self._predictor_next = 0.0
        self._drain_grace_s = 30.0
        # (when, alarm, generation at the alarm) of a drain the predictor scheduled.
        self._drain_due: tuple[float, HealthEvent, int] | None = None
        self._resources = GenerationResources(config.error_dir)  # the generation's store and error files
        self._group_started = 0.0  # time.monotonic() when the current generation's workers started
        # Fail-slow: step timing relayed to the coordinator, its findings, stack requests answered.
        self.timing = TimingRelay()
        self.failslow = FailSlowView(config.node_id)
        self._stack_requests: set[str] = set()
        # Job-wide memory tier (agent/memory_tier.py): verified holdings out in heartbeats, restore plan in.
        self.memory_tier = MemoryTier.for_checkpoint_dir(config.checkpoint_dir, config.job) \
            if config.memory_tier == "job" else None
        self._restore_plan: coordinator_pb2.MemoryRestorePlan | None = None
        self.replicas = ReplicaAgent(config.replica, self.memory_tier, config.node_id, config.address) \
            if self.memory_tier is not None and config.replica.enabled else None

    # -- state served to workers and operators ---------------------------------------------------------------
    def on_worker_heartbeat(self, rank: int, pid: int, generation: int, step: int, step_time_s: float,
                            finished: bool = False, sections: Mapping[str, float] | None = None) -> list:
        """Records a step reported by a local worker (with its section times, if any); returns advisories
        pending for that rank."""
        with self._lock:
            group = self._group
            w = group.by_rank(rank) if group is not None else None
            if w is None or (pid and w.pid != pid) or generation != self.generation:
                return []  # a straggler of an older generation
            now = time.time()
            w.finished = w.finished or finished
            if step > w.last_step:
                w.last_step = step
                w.last_heartbeat = time.monotonic()
                if step_time_s > 0:
                    w.step_times.append(step_time_s)
                    self.timing.record(generation, rank, step, step_time_s, sections or {})
            for rec in self.fault_records:
                if rec.resumed_at is None and rec.restarted_at is not None and step >= 0:
                    rec.resumed_at = now
                    rec.resumed_step = step
            pending = self._advisories.pop(rank, [])
        if self.faults:
            self._wake.set()
        return pending

    def on_checkpoint_report(self, report: agent_pb2.CheckpointReport) -> None:
        """Records a durable checkpoint step reported by a worker."""
        with self._lock:
            self.last_checkpoint_step = max(self.last_checkpoint_step, report.step)

    def advise(self, kind: int, reason: str, at_step: int = 0) -> str:
        """Queues an advisory for every current local worker; returns its id.

        Args:
            kind: the proto ``AdvisoryKind`` (CHECKPOINT_NOW, STOP).
            reason: why, for the workers' logs.
            at_step: CHECKPOINT_NOW only: save when this step completes (a job-wide checkpoint); 0 for the next
                step.
        """
        adv_id = uuid.uuid4().hex[:12]
        with self._lock:
            if self._group is not None:
                for w in self._group.workers:
                    self._advisories.setdefault(w.spec.rank, []).append(
                        agent_pb2.Advisory(kind=kind, reason=reason, advisory_id=adv_id, at_step=at_step)
                    )
        return adv_id

    def _ask_checkpoint(self, alarm: HealthEvent) -> None:
        """Asks the coordinator for a job-wide checkpoint (every rank saves at the same step, so the step is
        complete and the drain loses nothing after it); without a coordinator, or when it cannot be reached,
        advises the local workers to save at their next step."""
        if self._stub is not None:
            ev = HealthEvent(source=alarm.source, kind="predictor.checkpoint", severity=Severity.WARNING,
                             action=Action.CHECKPOINT_NOW, message=alarm.message, node_id=self.config.node_id)
            req = coordinator_pb2.ReportEventRequest(
                job=self.config.job, node_id=self.config.node_id, lease_id=self._lease, generation=self.generation,
                event=ev.to_proto(), proposed_level=coordinator_pb2.RECOVERY_LEVEL_NONE, failed_rank=-1)
            try:
                resp = self._stub.ReportEvent(req, timeout=_RPC_TIMEOUT_S)
                log.info("coordinator: %s", resp.message)
                return
            except grpc.RpcError as exc:
                log.warning("could not ask the coordinator for a job-wide checkpoint (%s); advising the local "
                            "workers only", exc.code().name)
        self.advise(agent_pb2.ADVISORY_KIND_CHECKPOINT_NOW, alarm.message)

    def _relay_checkpoint(self, req: coordinator_pb2.CheckpointRequest) -> None:
        """Passes a job-wide checkpoint request from the coordinator to the local workers, once per id."""
        if not req.request_id or req.request_id in self._relayed or req.generation != self.generation:
            return
        self._relayed.add(req.request_id)
        with self._lock:
            if self._drain_due is not None:
                self._drain_after_step = req.at_step
        log.info("job-wide checkpoint at step %d requested (%s)", req.at_step, req.reason)
        self.advise(agent_pb2.ADVISORY_KIND_CHECKPOINT_NOW, req.reason, at_step=req.at_step)

    def health_snapshot(self, max_events: int = 20) -> agent_pb2.NodeHealth:
        """The node's current health as a ``NodeHealth`` message."""
        with self._lock:
            h = agent_pb2.NodeHealth(
                node_id=self.config.node_id,
                version=__version__,
                uptime_s=time.time() - self.started_at,
                predictor_score=self.predictor_score,
                predictor_threshold=self.predictor_threshold,
                job=self.config.job,
                generation=self.generation,
                last_checkpoint_step=self.last_checkpoint_step,
            )
            h.failslow.CopyFrom(self.failslow.status)
            if self.replicas is not None:
                h.replica_bytes, h.replica_limit_bytes = self.replicas.store.bytes_held(), self.replicas.store.max_bytes
                h.replica_buddies.extend(self.replicas.buddies)
            if self._group is not None:
                now = time.monotonic()
                for w in self._group.workers:
                    h.workers.add(
                        rank=w.spec.rank,
                        local_rank=w.spec.local_rank,
                        pid=w.pid,
                        state=int(w.state),
                        step=w.last_step,
                        last_heartbeat_age_s=(now - w.last_heartbeat) if w.last_heartbeat else -1.0,
                        exit_code=w.exit_code if w.exit_code is not None else 0,
                    )
        for ev in self.bus.recent(max_events):
            h.recent_events.append(ev.to_proto())
        return h

    def workers(self) -> list:
        """The current generation's workers as detector snapshots (implements ``WorkerView``)."""
        from trainguard.detectors.process import WorkerSnapshot

        group = self._group
        if group is None:
            return []
        mono = time.monotonic()
        offset = mono - time.time()
        # A worker whose loop is over (final evaluation, last save, exit) sends no more steps and is not hung.
        return [
            WorkerSnapshot(rank=w.spec.rank, pid=w.pid, started_at=w.started_at + offset, last_step=w.last_step,
                           last_heartbeat=mono if w.finished else w.last_heartbeat,
                           recent_step_times=tuple(w.step_times), returncode=w.exit_code)
            for w in group.workers
        ]

    def _on_detector_event(self, event: HealthEvent) -> None:
        event = event.with_node(self.config.node_id) if not event.node_id else event
        self.bus.publish(event)
        if event.action >= Action.RESTART_PROCESS and event.kind not in _SEEN_BY_SUPERVISOR:
            with self._lock:
                self._pending_events.append(event)
            self._wake.set()

    def _handle_detector_events(self) -> None:
        with self._lock:
            events, self._pending_events = self._pending_events, []
        for ev in events:
            if ev.action == Action.RESTART_PROCESS and ev.subject.startswith("rank:"):
                if self._group is None:
                    continue
                rank = int(ev.subject.split(":", 1)[1].split("/")[0])
                w = self._group.by_rank(rank)
                if w is None or w.proc.poll() is not None or str(w.pid) != ev.evidence.get("pid", str(w.pid)):
                    continue  # about a worker of an older generation
                rec = FaultRecord(generation=self.generation, rank=rank, cause=ev.message or ev.kind,
                                  injected_at=self._injected_at(rank), detected_at=time.time())
                self.fault_records.append(rec)
                log.warning("generation %d: %s; stopping local workers", self.generation, ev.message)
                gen = self.generation
                if ev.kind == "process.hung":  # every local rank's stack, for the coordinator's localisation
                    ev = HealthEvent(**{**ev.__dict__, "evidence": {**ev.evidence, **self._local_stacks()}})
                self._stop_workers()
                self._report(ev, coordinator_pb2.RECOVERY_LEVEL_PROCESS, gen, rank, 0)
            elif ev.action >= Action.DRAIN_NODE:
                if self._node_reports.covers(ev, self.generation):
                    log.info("node-level fault: %s; already reported for generation %d", ev.message,
                             self.generation)
                    continue
                log.error("node-level fault: %s; asking the coordinator to replace this node", ev.message)
                self._report_node(ev, self.generation, -1, 0)

    def _report_node(self, ev: HealthEvent, generation: int, rank: int, code: int) -> None:
        """Reports a node- (or job-) level fault of ``generation`` and notes it, so it goes out once."""
        self._report(ev, self._node_reports.record(ev, generation), generation, rank, code)

    def _pending_snapshot(self) -> list[HealthEvent]:
        with self._lock:
            return list(self._pending_events)

    def _injected_at(self, rank: int) -> float | None:
        return next((f.done_at for f in self.faults
                     if f.rank == rank and f.done_at and f.generation == self.generation), None)

    @property
    def group(self) -> WorkerGroup | None:
        """The current generation's workers, if any."""
        return self._group

    # -- coordinator calls -----------------------------------------------------------------------------------
    def _node_info(self) -> common_pb2.NodeInfo:
        c = self.config
        return common_pb2.NodeInfo(
            node_id=c.node_id,
            topology=common_pb2.Topology(pod_id=c.pod_id, node_index=c.node_index, host=c.host,
                                         device_count=c.nproc_per_node),
            address=c.address,
            spare=c.spare,
        )

    def _register(self, patience_s: float) -> None:
        deadline = time.monotonic() + patience_s
        delay = 0.1
        while True:
            try:
                resp = self._stub.RegisterNode(
                    coordinator_pb2.RegisterNodeRequest(job=self.config.job, node=self._node_info(),
                                                        free_port=find_free_port(self.config.address),
                                                        agent_instance=self._instance),
                    timeout=_RPC_TIMEOUT_S,
                )
                self._lease = resp.lease_id
                log.info("registered node %s with coordinator %s", self.config.node_id, self.config.coordinator)
                return
            except grpc.RpcError as exc:
                code = exc.code()
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise CoordinatorUnavailableError(
                        f"coordinator {self.config.coordinator} refused registration: {code.name}: {exc.details()}"
                    ) from exc
                if time.monotonic() > deadline:
                    raise CoordinatorUnavailableError(
                        f"coordinator {self.config.coordinator} unreachable for {patience_s:.0f}s; "
                        "check the address and that it runs"
                    ) from exc
                time.sleep(delay)
                delay = min(2.0, delay * 2)

    def _keepalive(self) -> None:
        """Renews the coordinator lease while the loop is busy (stopping hung workers); commands in the reply
        are left to the loop's next heartbeat, which gets them again."""
        if self._stub is not None and not self._in_keepalive \
                and time.monotonic() - self._last_heartbeat >= self._interval:
            self._in_keepalive = True
            try:
                self._heartbeat()
            finally:
                self._in_keepalive = False

    def _heartbeat(self) -> coordinator_pb2.NodeHeartbeatResponse | None:
        self._last_heartbeat = time.monotonic()
        with self._lock:
            group = self._group
            req = coordinator_pb2.NodeHeartbeatRequest(
                job=self.config.job,
                node_id=self.config.node_id,
                lease_id=self._lease,
                generation=self.generation if group is not None else -1,
                workers_running=group.running() if group is not None else 0,
                last_step=max((w.last_step for w in group.workers), default=-1) if group else -1,
                workers_succeeded=group.all_succeeded() if group is not None else False,
                free_port=find_free_port(self.config.address),
                timings=self.timing.drain(),
                memory=self.memory_tier.scan() if self.memory_tier is not None else (),
                replica_address=self.replicas.address if self.replicas is not None else "",
                replica_bytes=self.replicas.store.bytes_held() if self.replicas is not None else 0,
            )
        try:
            resp = self._stub.Heartbeat(req, timeout=_RPC_TIMEOUT_S)
            self._unreachable_since = None
            return resp
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                if self._unreachable_since is None:
                    self._unreachable_since = time.monotonic()
            else:
                self._unreachable_since = None
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                log.warning("coordinator forgot this node (%s); registering again", exc.details())
                self._register(self.config.coordinator_patience_s)
            elif exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                log.warning("coordinator does not know our generation (%s); stopping workers and registering "
                            "again", exc.details())
                self._stop_workers()
                self._register(self.config.coordinator_patience_s)
            else:
                log.warning("coordinator heartbeat failed: %s; workers keep running", exc.code().name)
            return None

    def _report_failure(self, rank: int, code: int | None, generation: int,
                        hardware: HealthEvent | None = None, error: str | None = None) -> None:
        cause = describe_exit(code)
        ev = HealthEvent(
            source="process",
            kind="process.exit",
            severity=Severity.CRITICAL,
            action=Action.RESTART_PROCESS,
            subject=f"rank:{rank}",
            # The worker's own account (torch's @record, through TORCHELASTIC_ERROR_FILE) is the reason the
            # coordinator logs and the operator reads.
            message=f"rank {rank} ended with {cause}" + (f": {error}" if error else ""),
            evidence={"rank": str(rank), "exit_code": str(code), "generation": str(generation),
                      **({"error": error} if error else {})},
            node_id=self.config.node_id,
        )
        self.bus.publish(ev)
        if hardware is None:
            self._report(ev, coordinator_pb2.RECOVERY_LEVEL_PROCESS, generation, rank, code if code is not None else 0)
            return
        if self._node_reports.covers(hardware, generation):
            log.warning("generation %d: rank %d died with a hardware fault on this node (%s: %s); this node's "
                        "replacement was already requested", generation, rank, hardware.kind, hardware.message)
            return
        log.error("generation %d: rank %d died with a hardware fault on this node (%s: %s); asking the coordinator "
                  "to replace this node", generation, rank, hardware.kind, hardware.message)
        self._report_node(hardware, generation, rank, code if code is not None else 0)

    def _report(self, ev: HealthEvent, level: int, generation: int, rank: int, code: int) -> None:
        if self._stub is None:
            return  # standalone daemon: no coordinator to tell
        req = coordinator_pb2.ReportEventRequest(
            job=self.config.job, node_id=self.config.node_id, lease_id=self._lease, generation=generation,
            event=ev.to_proto(), proposed_level=level, failed_rank=rank, exit_code=code,
        )
        try:
            resp = self._stub.ReportEvent(req, timeout=_RPC_TIMEOUT_S)
            log.info("coordinator: %s", resp.message)
        except grpc.RpcError as exc:
            log.warning("could not report the failure to the coordinator (%s); it will learn from heartbeats",
                        exc.code().name)

    # -- workers ---------------------------------------------------------------------------------------------
    def _start_generation(self, table: common_pb2.RankTable) -> None:
        mine = next((n for n in table.nodes if n.node_id == self.config.node_id), None)
        if mine is None:
            return
        c = self.config
        use_agent_store = self._resources.host_store(c, table, mine)
        specs = worker_specs(c, table, mine, self._resources.error_dir(table.generation), use_agent_store)
        if self.replicas is not None:  # a new slot's ranks: their buddy's copies into this node's memory first
            self.replicas.fetch_planned(self._restore_plan, [s.rank for s in specs], tick=self._keepalive)
        apply_restore_plan(specs, self._restore_plan, table.generation)
        group = WorkerGroup(specs, log_dir=c.log_dir, streams=c.streams, role=c.role)
        with self._lock:
            self.table = table
            self.generation = table.generation
            self._restart_count = table.restart_count
            self._group = group
            self._advisories.clear()
        standbys = self._standbys.take()
        try:
            group.start(standbys)
        finally:
            StandbyPool.drop_all(standbys)
        self._group_started = time.monotonic()
        now = time.time()
        for rec in self.fault_records:
            if rec.restarted_at is None:
                rec.restarted_at = now
        if self._notifier is not None:
            self._notifier.status(f"job {c.job}: generation {table.generation}, ranks {mine.first_rank}.."
                                  f"{mine.first_rank + mine.local_world_size - 1} of {table.world_size}, "
                                  f"{table.restart_count} restarts")
        log.info("generation %d: started ranks %d..%d (master %s:%d)", table.generation, mine.first_rank,
                 mine.first_rank + mine.local_world_size - 1, table.master_addr, table.master_port)

    def _ensure_standbys(self) -> None:
        """Prepares the current generation's replacements once it trains (see :class:`StandbyPool`)."""
        if self.config.standby:
            self._standbys.ensure(self.config, self._group, self._group_started,
                                  spare_waiting=self.config.spare and self.generation <= 0 and self._stub is not None)

    def _stop_workers(self) -> None:
        with self._lock:
            group = self._group
            self._group = None
        if group is not None:
            group.stop(self.config.stop_grace_s, tick=self._keepalive)
        self._resources.close_store()

    def _check_workers(self) -> None:
        group = self._group
        if group is None:
            return
        failed = self._resources.failed
        if failed is not None and failed[0] == self.generation:
            self._resources.failed = None
            gen = self.generation
            ev = HealthEvent(source="agent", kind="agent.store", severity=Severity.CRITICAL,
                             action=Action.RESTART_PROCESS, subject="rank:0", node_id=self.config.node_id,
                             message=f"generation {gen}: {failed[1]}; restarting with rank 0 hosting the store")
            self.fault_records.append(FaultRecord(generation=gen, rank=0, cause=ev.message, injected_at=None,
                                                  detected_at=time.time()))
            log.error("%s", ev.message)
            self._stop_workers()
            self._report(ev, coordinator_pb2.RECOVERY_LEVEL_PROCESS, gen, 0, 0)
            return
        for w in group.poll():
            if w.state != WorkerState.FAILED:
                continue
            rec = FaultRecord(
                generation=self.generation, rank=w.spec.rank, cause=describe_exit(w.exit_code),
                injected_at=self._injected_at(w.spec.rank),
                detected_at=time.time(),
                error=read_error_file(w.spec.env.get("TORCHELASTIC_ERROR_FILE")),
            )
            self.fault_records.append(rec)
            gen = self.generation
            hardware = hardware_cause(self._runner, self._hardware_detectors, self._pending_snapshot,
                                      self._node_reports, gen, self.config.node_id)
            if hardware is not None:
                rec.hardware = f"{hardware.kind}: {hardware.message}"
            if self.predictor is not None:
                self.predictor.record_failure(rec.detected_at, hardware.kind if hardware else "process.exit")
            log.warning("generation %d: rank %d ended with %s; stopping local workers", gen, w.spec.rank, rec.cause)
            self._stop_workers()
            self._report_failure(w.spec.rank, w.exit_code, gen, hardware, error=rec.error)
            self._wake.set()
            return

    def _inject_faults(self) -> None:
        group = self._group
        if group is None:
            return
        for f in self.faults:
            if f.done_at is not None or f.generation != self.generation:
                continue
            w = group.by_rank(f.rank)
            if w is not None and w.last_step >= f.step and w.proc.poll() is None:
                group.kill(f.rank, f.sig)
                f.done_at = time.time()
                log.warning("fault injected: %s to rank %d at step %d", signal.Signals(f.sig).name, f.rank, w.last_step)

    # -- main loop -------------------------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Asks the loop to stop the workers and return (signal handlers call this)."""
        if self._notifier is not None and not self.stopping:
            self._notifier.stopping(f"job {self.config.job}: stopping workers")
        self.stopping = True
        self._wake.set()

    def run(self) -> int:
        """Runs until the job ends or a stop is requested.

        Returns:
            0 when the job succeeded; 1 when it failed; 130 when stopped by a signal.

        Raises:
            CoordinatorUnavailableError: registration failed, or the coordinator stayed unreachable for
                ``coordinator_patience_s`` while this node ran no workers.
        """
        if self.config.host_store:
            from trainguard.agent.worker_store import preload

            preload()  # torch for the workers' store, imported while the node registers
        dial = self.config.coordinator_channel or grpc.insecure_channel
        self._channel = dial(self.config.coordinator)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._register(self.config.coordinator_patience_s)
        if self.memory_tier is not None:
            self.memory_tier.start()
        if self.replicas is not None:
            self.replicas.start()
        self._start_detectors()
        if self._notifier is not None:
            self._notifier.ready(f"job {self.config.job}: registered, waiting for a rank table")
        next_hb = 0.0
        try:
            while not self.stopping:
                if self._watchdog is not None:
                    self._watchdog.tick(healthy=True)
                self._inject_faults()
                self._check_workers()
                self._handle_detector_events()
                if self._runner is not None:
                    self.predictor_tick(self._runner.latest_metrics())
                self._drain_if_due()
                self._ensure_standbys()
                now = time.monotonic()
                if now >= next_hb:
                    resp = self._heartbeat()
                    next_hb = now + (resp.interval_s if resp is not None and resp.interval_s > 0 else self._interval)
                    if resp is not None:
                        done = self._obey(resp)
                        if done is not None:
                            return done
                    else:
                        self._give_up_if_coordinator_gone(now)
                self._wake.wait(self.config.poll_s)
                self._wake.clear()
            return 130
        finally:
            if self._runner is not None:
                self._runner.stop()
            if self.memory_tier is not None:
                self.memory_tier.stop()
            if self.replicas is not None:
                self.replicas.stop()
            self._stop_workers()
            self._standbys.drop()
            self._channel.close()
            self.stopping = True
            self._resources.cleanup()

    def _give_up_if_coordinator_gone(self, now: float) -> None:
        """Ends an agent that has no running workers and has not reached its coordinator for
        ``coordinator_patience_s`` (``--rdzv-conf join_timeout``): with nothing to keep alive it would otherwise
        heartbeat into a coordinator that is gone, forever. Running workers are never stopped for an outage
        (a restarted coordinator picks the job up again).

        Raises:
            CoordinatorUnavailableError: the bound passed.
        """
        since = self._unreachable_since
        if since is None or now - since < self.config.coordinator_patience_s:
            return
        with self._lock:
            running = self._group.running() if self._group is not None else 0
        if running:
            return
        raise CoordinatorUnavailableError(
            f"coordinator {self.config.coordinator} unreachable for {now - since:.0f}s with no workers running "
            f"on this node (the bound is {self.config.coordinator_patience_s:.0f}s, --rdzv-conf join_timeout); "
            "check that it runs, then start this node again")

    def _start_detectors(self) -> None:
        if not self.config.detectors:
            return
        from trainguard.detectors.base import create_detectors
        from trainguard.detectors.runner import DetectorRunner

        detectors = create_detectors(list(self.config.detectors), self.config.detector_config, worker_view=self)
        self.start_predictor(self.config.predictor_model, self.config.history_path,
                             interval_s=self.config.predictor_interval_s, drain_grace_s=self.config.drain_grace_s)
        self._hardware_detectors = hardware_detector_names(detectors)

        def on_event(event: HealthEvent) -> None:
            self.predictor_event(event)
            self._on_detector_event(event)

        self._runner = DetectorRunner(detectors, on_event=on_event)
        self._runner.start()
        self._predictor_next = time.monotonic() + self._predictor_interval_s

    # -- predictor -------------------------------------------------------------------------------------------
    def start_predictor(self, model_path: str | None, history_path: str | None, interval_s: float = 5.0,
                        drain_grace_s: float = 30.0) -> None:
        """Scores failure risk from the detectors' metrics every ``interval_s`` seconds.

        On an alarm the workers are advised to checkpoint at once, and ``drain_grace_s`` seconds later (time
        for that checkpoint) the coordinator is asked to replace this node (node-level recovery).

        Args:
            model_path: a trained predictor model file, or None for the rules tier only.
            history_path: SQLite file keeping the metric history (training data), or None.
            interval_s: seconds between scores.
            drain_grace_s: seconds between the checkpoint advisory and the drain request.

        Raises:
            TrainguardError: the model or history file is unusable (named in the message).
        """
        from trainguard.agent.predictor_feed import PredictorMonitor
        from trainguard.predictor.history import MetricHistory
        from trainguard.predictor.runtime import PredictorRuntime

        history = MetricHistory(history_path) if history_path else None
        self._predictor_interval_s = interval_s
        self._drain_grace_s = drain_grace_s
        self.predictor = PredictorMonitor(
            PredictorRuntime.load(model_path, missing="nan"), self.config.node_id, history=history,
            on_score=self._on_score, on_alarm=self._on_alarm,
        )

    def predictor_event(self, event: HealthEvent) -> None:
        """Feeds a detector event (XIDs, link flaps) to the predictor; thread-safe."""
        if self.predictor is not None:
            self.predictor.observe_event(event)

    def predictor_tick(self, metrics: dict[str, float]) -> None:
        """Scores one sample when an interval has passed (called from the agent's loop)."""
        if self.predictor is None or time.monotonic() < self._predictor_next:
            return
        self._predictor_next = time.monotonic() + self._predictor_interval_s
        group = self._group
        step = max((w.step_times[-1] for w in group.workers if w.step_times), default=None) if group else None
        self.predictor.tick(time.time(), metrics, step)

    def _on_score(self, score) -> None:
        self.predictor_score = score.score
        self.predictor_threshold = score.threshold
        if self.predictor is not None:
            self.predictor_alarms_per_day = self.predictor.runtime.realised_alarms_per_day()

    def _on_alarm(self, score) -> None:
        top = ", ".join(f"{name}={value:.3g}" for name, value in score.top_features[:3])
        event = HealthEvent(
            source="predictor", kind="predictor.alarm",
            severity=Severity.CRITICAL if score.source == "rules" else Severity.WARNING,
            action=Action.DRAIN_NODE,
            message=f"failure risk {score.score:.2f} >= {score.threshold:.2f} ({score.source}): {top}",
            evidence={"score": f"{score.score:.4f}", "threshold": f"{score.threshold:.4f}", "source": score.source,
                      **{f"feature.{n}": f"{v:.6g}" for n, v in score.top_features[:5]},
                      **{f"rule.{h.rule}": h.description for h in score.rule_hits}},
            node_id=self.config.node_id,
        )
        self.bus.publish(event)
        log.warning("predictor alarm: %s; asking for a checkpoint now, drain request in %.1f s",
                    event.message, self._drain_grace_s)
        self._ask_checkpoint(event)
        with self._lock:
            if self._drain_due is None:
                self._drain_due = (time.monotonic() + self._drain_grace_s, event, self.generation)

    def _drain_if_due(self) -> None:
        with self._lock:
            due = self._drain_due
            if due is None:
                return
            # Drain as soon as the job-wide checkpoint the alarm asked for is complete on disk (every rank's
            # commit marker), rather than train on for the rest of the grace only to lose those steps.
            if time.monotonic() < due[0] and not (self._drain_after_step is not None
                                                  and self._job_step_complete(self._drain_after_step)):
                return
            self._drain_due = None
            self._drain_after_step = None
        reported = self._node_reports.reported_since(due[2])
        if reported is not None:
            # A hardware fault already had this node replaced (or the job restarted) since the alarm.
            log.info("predicted failure (%s): this node's replacement was already requested for generation %d",
                     due[1].message, reported)
            return
        log.error("predicted failure: asking the coordinator to drain this node (%s)", due[1].message)
        self._report_node(due[1], self.generation, -1, 0)

    def _job_step_complete(self, step: int) -> bool:
        """Whether checkpoint ``step`` has every rank's commit marker under ``checkpoint_dir`` (see
        :mod:`trainguard.checkpoint.storage`)."""
        from trainguard.checkpoint.storage import step_dirname

        table = self.table
        if not self.config.checkpoint_dir or table is None:
            return False
        try:
            names = os.listdir(os.path.join(self.config.checkpoint_dir, self.config.job, step_dirname(step)))
        except OSError:
            return False
        return sum(1 for n in names if n.endswith(".commit")) >= table.world_size

    def _local_stacks(self) -> dict[str, str]:
        """Python stacks of every live local worker (``stack.<rank>`` evidence entries)."""
        group = self._group
        pids = {w.spec.rank: w.pid for w in group.workers if w.proc.poll() is None} if group is not None else {}
        return stack_evidence(pids)

    def _answer_stacks(self, req: coordinator_pb2.StackRequest) -> None:
        """Sends the coordinator the local workers' stacks for a hang it localises, once per request, before
        any command in the same reply stops the workers."""
        if not req.request_id or req.request_id in self._stack_requests or req.generation != self.generation:
            return
        self._stack_requests.add(req.request_id)
        evidence = {"request_id": req.request_id, **self._local_stacks()}
        ev = HealthEvent(source="failslow", kind="hang.stacks", severity=Severity.INFO, action=Action.NONE,
                         message=f"stacks of {sum(k.startswith('stack.') for k in evidence)} local rank(s)",
                         evidence=evidence, node_id=self.config.node_id)
        self._report(ev, coordinator_pb2.RECOVERY_LEVEL_NONE, self.generation, -1, 0)

    def _obey(self, resp: coordinator_pb2.NodeHeartbeatResponse) -> int | None:
        cmd = resp.command
        if resp.HasField("stacks"):
            self._answer_stacks(resp.stacks)
        for ev in self.failslow.update(resp.failslow):
            self.bus.publish(ev)
        if resp.HasField("checkpoint"):
            self._relay_checkpoint(resp.checkpoint)
        if self.replicas is not None:
            self.replicas.set_targets(resp.replica_targets)
        if cmd in (coordinator_pb2.NODE_COMMAND_START, coordinator_pb2.NODE_COMMAND_RESTART):
            if resp.rank_table.generation != self.generation or self._group is None:
                self._restore_plan = resp.restore_plan if resp.HasField("restore_plan") else None
                self._stop_workers()
                self._start_generation(resp.rank_table)
        elif cmd == coordinator_pb2.NODE_COMMAND_STOP:
            self._stop_workers()
            if resp.job_state == coordinator_pb2.JOB_STATE_SUCCEEDED:
                self.final_message = resp.message
                return 0
            if resp.job_state == coordinator_pb2.JOB_STATE_FAILED:
                self.final_message = resp.message
                raise JobFailedError(resp.message)
        return None


def install_signal_handlers(agent: NodeAgent, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)
                            ) -> Callable[[], None]:
    """Makes ``signals`` (default SIGTERM, SIGINT) stop the agent gracefully; returns a function restoring the
    old handlers."""
    old = {s: signal.getsignal(s) for s in signals}

    def handler(signum, _frame):
        log.warning("received %s: stopping workers", signal.Signals(signum).name)
        agent.request_stop()

    for s in old:
        signal.signal(s, handler)

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore

"""The node agent as ``trainguard run`` composes it: a worker supervisor, a coordinator link and node health.

The three parts (contracts and state machines in :mod:`trainguard.agent.parts`) each own one job:

- :class:`~trainguard.agent.supervisor.LocalSupervisor`: this node's workers of the current generation and the
  warm standbys for the next;
- :class:`~trainguard.agent.coordinator_link.GrpcCoordinatorLink`: registration, heartbeats, reports;
- :class:`~trainguard.agent.node_health.LocalNodeHealth`: detectors (or another event source), predictor,
  drain timer, event bus.

:class:`NodeAgent` wires them in one loop per node::

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

Fault injection is not part of the agent: a drill passes a :class:`~trainguard.agent.parts.SupervisorHook`
(:class:`trainguard.drill.inject.StepFaultInjector` for ``trainguard run --fault``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from trainguard._version import __version__
from trainguard.agent.coordinator_link import GrpcCoordinatorLink, LinkConfig
from trainguard.agent.errors import JobFailedError, RegistrationCancelledError
from trainguard.agent.event_bus import EventBus
from trainguard.agent.fault_records import FaultRecord
from trainguard.agent.echo_probe import EchoListener
from trainguard.agent.lease_keeper import keep_lease
from trainguard.agent.link_probe import LinkProber, WithLinkProbe
from trainguard.agent.job_memory import HeartbeatParts, JobMemory
from trainguard.agent.node_health import DetectorEventSource, LocalNodeHealth
from trainguard.agent.parts import SupervisorState
from trainguard.agent.qualify.agent_side import NodeQualifier
from trainguard.agent.qualify.config import QualifySection
from trainguard.agent.parts import SupervisorHook
from trainguard.agent.replica_agent import ReplicaConfig
from trainguard.agent.step_timing import FailSlowView, hang_location
from trainguard.agent.supervisor import LocalSupervisor, WorkerExit
from trainguard.agent.workers import WorkerGroup, describe_exit
from trainguard.checkpoint.location import job_step_committed
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.proto import agent_pb2, common_pb2, coordinator_pb2

log = logging.getLogger(__name__)


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
        coordinator_form_timeout_s: how long after registering the node waits for the job's first generation
            while fewer than ``--nnodes`` nodes joined (torchrun's ``join_timeout``); None:
            ``coordinator_patience_s``.
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
        predictor_threshold: alarm when the risk score reaches this, in [0, 1]; None (default) uses the model's
            own threshold, calibrated per node.
        role: ``ROLE_NAME`` of the workers (torchrun's ``--role``).
        job_by_start_time: ``job`` is only the start-time default of a one-node ``trainguard run`` (exported as
            ``TRAINGUARD_JOB_BY_START_TIME``: a worker with a checkpoint directory of its own names the job after
            it).
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
        qualify: ``[qualify]`` settings: the node qualifies before it registers and, while idle, again every
            ``recheck_s`` (:mod:`trainguard.agent.qualify`); None: it does not.
        coordinator_channel: opens the channel to ``coordinator`` (TLS, client certificate and job token of
            :class:`trainguard.recovery.rpc_security.RpcSecurity`); None dials plaintext without a token.
        daemon: the node daemon this job attached to (:class:`~trainguard.agent.health_source.DaemonLink`): its
            event stream and predictor stand in for this process's hardware detectors and predictor (only
            ``detectors``, the worker ones, still run here); None runs them all here.
        replica: peer replication of the in-memory checkpoints (:mod:`trainguard.agent.replica_agent`).
        memory_tier: ``"job"``: report the node's in-memory checkpoints and restore from any node's memory (see
            :mod:`trainguard.agent.job_memory`); ``"host"``: neither (each host's memory tier on its own).
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
    coordinator_form_timeout_s: float | None = None
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
    predictor_threshold: float | None = None
    role: str = "default"
    job_by_start_time: bool = False
    streams: dict = field(default_factory=dict)
    error_dir: str | None = None
    virtual_local_rank: bool = False
    poll_s: float = 0.05
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    host_store: bool = True
    standby_after_s: float = 3.0
    coordinator_channel: Callable[[str], grpc.Channel] | None = None
    qualify: QualifySection | None = None
    daemon: Any = None
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    memory_tier: str = "job"


def link_config(c: NodeConfig) -> LinkConfig:
    """The coordinator link's view of a node's configuration."""
    return LinkConfig(job=c.job, coordinator=c.coordinator, node_id=c.node_id, pod_id=c.pod_id,
                      node_index=c.node_index, host=c.host, address=c.address, device_count=c.nproc_per_node,
                      spare=c.spare, patience_s=c.coordinator_patience_s,
                      form_timeout_s=c.coordinator_form_timeout_s, channel=c.coordinator_channel)


class NodeAgent:
    """Runs one node's workers under a coordinator's direction: the composition of the three parts.

    Args:
        config: the node's configuration.
        hooks: supervisor hooks (a drill's fault injector, see :mod:`trainguard.drill.inject`).
        notifier: systemd notifier of ``trainguard run`` as a service (Type=notify), or None.
    """

    def __init__(self, config: NodeConfig, hooks: Sequence[SupervisorHook] = (), notifier=None) -> None:
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
        self._wake = threading.Event()
        self.supervisor = LocalSupervisor(config, hooks)
        # One echo listener on the data address: qualification's peer check and fail-slow's link probes.
        self.echo = EchoListener(config.address)
        self.link = GrpcCoordinatorLink(link_config(config), on_generation_lost=self._stop_workers,
                                        qualifier=NodeQualifier.for_node(config, self.echo))  # pre-flight check
        self.health = LocalNodeHealth(config.node_id, generation=lambda: self.supervisor.generation,
                                      on_alarm=self._ask_checkpoint, on_actionable=self._wake.set,
                                      threshold=config.predictor_threshold)
        self.stopping = False
        self._cordon_said = ""  # the coordinator's last cordon message published as an event (see _say_cordoned)
        self.stop_code = 130  # what run() returns once stopped: 128 + the signal (see request_stop)
        self.started_at = time.monotonic()  # for the uptime: a duration, so no wall-clock steps in it
        self.final_message = ""
        self.last_checkpoint_step = -1
        self._lock = threading.RLock()
        self._relayed: set[str] = set()  # job-wide checkpoint requests already passed to the workers
        self._stack_requests: set[str] = set()
        # Fail-slow: the coordinator's findings about this node; link probes (listener + probes it asks for).
        self.failslow = FailSlowView(config.node_id)
        self.link_probe = LinkProber(config.address, self.echo)
        # Job-wide memory tier (agent/job_memory.py): holdings and replicas out in heartbeats, plan and buddies in.
        self.job_memory = JobMemory.for_node(config.checkpoint_dir, config.job, config.memory_tier, config.replica,
                                             config.node_id, config.address)
        self._beat_content = WithLinkProbe(HeartbeatParts(self.supervisor, self.job_memory), self.link_probe)

    # -- the parts' state, as operators and the local service read it ----------------------------------------
    @property
    def replicas(self):
        """The node's peer replication (:class:`~trainguard.agent.replica_agent.ReplicaAgent`), or None."""
        return self.job_memory.replicas if self.job_memory is not None else None

    @property
    def bus(self) -> EventBus:
        """The node's event bus (node health's)."""
        return self.health.bus

    @bus.setter
    def bus(self, bus: EventBus) -> None:
        self.health.bus = bus

    @property
    def generation(self) -> int:
        """The generation of the local workers; -1 before the first."""
        return self.supervisor.generation

    @property
    def table(self) -> common_pb2.RankTable | None:
        """The rank table of the current generation."""
        return self.supervisor.table

    @property
    def group(self) -> WorkerGroup | None:
        """The current generation's workers, if any."""
        return self.supervisor.group

    @property
    def fault_records(self) -> list[FaultRecord]:
        """The failure timeline of this node."""
        return self.supervisor.fault_records

    @property
    def timing(self):
        """Step timing relayed to the coordinator (the supervisor's)."""
        return self.supervisor.timing

    @property
    def predictor(self):
        """The predictor monitor, once :meth:`start_predictor` ran."""
        return self.health.predictor

    @property
    def predictor_score(self) -> float:
        """The last failure-risk score in [0, 1]."""
        return self.health.score

    @property
    def predictor_threshold(self) -> float:
        """The alarm threshold in force (see :attr:`LocalNodeHealth.threshold`)."""
        return self.health.threshold

    @predictor_threshold.setter
    def predictor_threshold(self, value: float | None) -> None:
        """Configures the alarm threshold (None or NaN: the model's own)."""
        self.health.threshold = value

    @property
    def predictor_alarms_per_day(self) -> float:
        """Realised learned-tier alarm rate (NaN before any time observed)."""
        return self.health.alarms_per_day

    # -- workers' reports (the local gRPC service calls these) -----------------------------------------------
    def on_worker_heartbeat(self, rank: int, pid: int, generation: int, step: int, step_time_s: float,
                            finished: bool = False, sections: Mapping[str, float] | None = None,
                            acked: Sequence[str] | None = None) -> list:
        """Records a step reported by a local worker (with its section times, if any); returns advisories
        pending for that rank (``acked``: see :meth:`LocalSupervisor.on_heartbeat`)."""
        pending = self.supervisor.on_heartbeat(rank, pid, generation, step, step_time_s, finished, sections,
                                               acked)
        if self.supervisor.hooks:
            self._wake.set()  # a hook may be waiting for this step
        return pending

    def on_checkpoint_report(self, report: agent_pb2.CheckpointReport) -> None:
        """Records a durable checkpoint step reported by a worker."""
        with self._lock:
            self.last_checkpoint_step = max(self.last_checkpoint_step, report.step)

    def advise(self, kind: int, reason: str, at_step: int = 0) -> str:
        """Queues an advisory for every current local worker; returns its id (see
        :meth:`LocalSupervisor.advise`)."""
        return self.supervisor.advise(kind, reason, at_step)

    def workers(self) -> list:
        """The current generation's workers as detector snapshots (implements ``WorkerView``)."""
        return self.supervisor.workers()

    def health_snapshot(self, max_events: int = 20) -> agent_pb2.NodeHealth:
        """The node's current health as a ``NodeHealth`` message."""
        h = agent_pb2.NodeHealth(
            node_id=self.config.node_id,
            version=__version__,
            uptime_s=time.monotonic() - self.started_at,
            predictor_score=self.health.score,
            predictor_threshold=self.health.threshold,
            job=self.config.job,
            generation=self.generation,
            last_checkpoint_step=self.last_checkpoint_step,
        )
        h.failslow.CopyFrom(self.failslow.status)
        if self.job_memory is not None:
            self.job_memory.fill_health(h)
        self.supervisor.worker_statuses(h)
        for ev in self.bus.recent(max_events):
            h.recent_events.append(ev.to_proto())
        return h

    # -- predictor (node health) -------------------------------------------------------------------------------
    def start_predictor(self, model_path: str | None, history_path: str | None, interval_s: float = 5.0,
                        drain_grace_s: float = 30.0) -> None:
        """Scores failure risk every ``interval_s`` seconds; an alarm asks for a checkpoint at once and for this
        node's replacement ``drain_grace_s`` later (see :meth:`LocalNodeHealth.start_predictor`).

        Raises:
            TrainguardError: the model or history file is unusable (named in the message).
        """
        self.health.start_predictor(model_path, history_path, interval_s, drain_grace_s)

    def predictor_event(self, event: HealthEvent) -> None:
        """Feeds a detector event (XIDs, link flaps) to the predictor; thread-safe."""
        self.health.predictor_event(event)

    def predictor_tick(self, metrics: dict[str, float]) -> None:
        """Scores one sample of ``metrics`` when an interval has passed."""
        self.health.tick(self.supervisor.last_step_time(), metrics)

    def _ask_checkpoint(self, alarm: HealthEvent) -> None:
        """Asks the coordinator for a job-wide checkpoint (every rank saves at the same step, so the step is
        complete and the drain loses nothing after it); without a coordinator, or when it cannot be reached,
        advises the local workers to save at their next step."""
        ev = HealthEvent(source=alarm.source, kind="predictor.checkpoint", severity=Severity.WARNING,
                         action=Action.CHECKPOINT_NOW, message=alarm.message, node_id=self.config.node_id)
        if not self.link.ask_checkpoint(ev, self.generation):
            self.advise(agent_pb2.ADVISORY_KIND_CHECKPOINT_NOW, alarm.message)

    def drain_if_due(self) -> None:
        """Asks the coordinator to replace this node when a predicted failure's drain is due."""
        due = self.health.due_drain(self._job_step_complete)
        if due is None:
            return
        alarm, generation = due
        try:
            reported = self.link.reports.reported_since(generation)
            if reported is not None:
                # A hardware fault already had this node replaced (or the job restarted) since the alarm.
                log.info("predicted failure (%s): this node's replacement was already requested for generation "
                         "%d", alarm.message, reported)
                return
            log.error("predicted failure: asking the coordinator to drain this node (%s)", alarm.message)
            self.link.report_node(alarm, self.generation)
        finally:
            self.health.drained()

    def _job_step_complete(self, step: int) -> bool:
        """Whether checkpoint ``step`` or a later one has every rank's commit marker at ``checkpoint_dir`` (a path
        or any fsspec URL; see :mod:`trainguard.checkpoint.location`)."""
        table = self.table
        if not self.config.checkpoint_dir or table is None:
            return False
        # or a later one: the hook takes the checkpoint at the first step reaching ``step``, a later one when the
        # loop's steps jump (counted in samples), and the drain waited out its whole grace for the exact step
        return job_step_committed(self.config.checkpoint_dir, self.config.job, step, table.world_size, or_later=True)

    # -- coordinator commands ----------------------------------------------------------------------------------
    def _relay_checkpoint(self, req: coordinator_pb2.CheckpointRequest) -> None:
        """Passes a job-wide checkpoint request from the coordinator to the local workers, once per id."""
        if not req.request_id or req.request_id in self._relayed or req.generation != self.generation:
            return
        self._relayed.add(req.request_id)
        self.health.drain_after(req.at_step)
        log.info("job-wide checkpoint at step %d requested (%s)", req.at_step, req.reason)
        self.advise(agent_pb2.ADVISORY_KIND_CHECKPOINT_NOW, req.reason, at_step=req.at_step)

    def _answer_stacks(self, req: coordinator_pb2.StackRequest) -> None:
        """Sends the coordinator the local workers' stacks for a hang it localises, once per request, before
        any command in the same reply stops the workers."""
        if not req.request_id or req.request_id in self._stack_requests or req.generation != self.generation:
            return
        self._stack_requests.add(req.request_id)
        # A worker that cannot answer (SIGSTOPped, or in the D state of a stuck driver call) makes the dump wait
        # out its 5 s limit, longer than a lease: the loop held here lost the node, and a hang became a
        # replacement. The stacks must still be taken before the reply's RESTART stops the workers.
        with keep_lease(lambda: self.link.keepalive(self._beat_content), self.link.interval_s, "stack dump"):
            stacks = self.supervisor.local_stacks()
        evidence = {"request_id": req.request_id, **stacks}
        ev = HealthEvent(source="failslow", kind="hang.stacks", severity=Severity.INFO, action=Action.NONE,
                         message=f"stacks of {sum(k.startswith('stack.') for k in evidence)} local rank(s)",
                         evidence=evidence, node_id=self.config.node_id)
        self.link.report(ev, coordinator_pb2.RECOVERY_LEVEL_NONE, self.generation, -1, 0)

    def _say_cordoned(self, resp: coordinator_pb2.NodeHeartbeatResponse) -> None:
        """Publishes the coordinator keeping this node out as cordoned (once per cordon): only the launcher's log
        said it, and `trainguard status` showed an idle node with no recent event and no way back."""
        prefix = f"node {self.config.node_id} is cordoned"
        if resp.command not in (coordinator_pb2.NODE_COMMAND_STOP, coordinator_pb2.NODE_COMMAND_NONE):
            self._cordon_said = ""  # returned to service (uncordon): a later cordon is said again
        if resp.command != coordinator_pb2.NODE_COMMAND_STOP or not resp.message.startswith(prefix) \
                or self._cordon_said:
            return  # once per cordon: without a stored reason the message carries the job's changing status
        self._cordon_said = resp.message
        from trainguard.detectors.events import Action, HealthEvent, Severity

        address = self.config.coordinator.split(",")[0]  # `uncordon --coordinator` takes one address
        self.bus.publish(HealthEvent(
            source="coordinator", kind="node.cordoned", severity=Severity.WARNING, action=Action.NONE,
            message=f"{resp.message}; once the machine is repaired: trainguard uncordon {self.config.node_id} "
                    f"--coordinator {address} --job {self.config.job} (with --token-file and TLS flags as the "
                    "coordinator requires)",
            node_id=self.config.node_id))

    def _obey(self, resp: coordinator_pb2.NodeHeartbeatResponse) -> int | None:
        cmd = resp.command
        if resp.HasField("stacks"):
            self._answer_stacks(resp.stacks)
        for ev in self.failslow.update(resp.failslow):
            if (where := hang_location(ev)) is not None:  # the run's summary names the stuck rank, not only
                self.supervisor.note_hang(*where)  # the one found silent first (often waiting on it)
            self.bus.publish(ev)
        self.link_probe.run(resp.link_probes)
        if resp.HasField("checkpoint"):
            self._relay_checkpoint(resp.checkpoint)
        self.link.follow(resp)
        self._say_cordoned(resp)
        if self.job_memory is not None:
            self.job_memory.follow(resp, self.generation if self.group is not None else -1)
        if cmd in (coordinator_pb2.NODE_COMMAND_START, coordinator_pb2.NODE_COMMAND_RESTART):
            if resp.rank_table.generation != self.generation or self.group is None:
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

    def _start_generation(self, table: common_pb2.RankTable) -> None:
        jm = self.job_memory
        keepalive = lambda: self.link.keepalive(self._beat_content)  # noqa: E731 (the lease lives on while a slot fetches)
        before = (lambda specs: jm.before_spawn(specs, table.generation, tick=keepalive)) if jm is not None else None
        if not self.supervisor.start(table, before_spawn=before):
            return
        mine = next(n for n in table.nodes if n.node_id == self.config.node_id)
        if self._notifier is not None:
            self._notifier.status(f"job {self.config.job}: generation {table.generation}, ranks {mine.first_rank}.."
                                  f"{mine.first_rank + mine.local_world_size - 1} of {table.world_size}, "
                                  f"{table.restart_count} restarts")

    def _stop_workers(self) -> None:
        self.supervisor.stop(keepalive=lambda: self.link.keepalive(self._beat_content))

    # -- failures ----------------------------------------------------------------------------------------------
    def _check_workers(self) -> None:
        failure = self.supervisor.poll()
        if failure is None:
            return
        gen = self.generation
        if failure.agent_side:
            ev = HealthEvent(source="agent", kind="agent.store", severity=Severity.CRITICAL,
                             action=Action.RESTART_PROCESS, subject="rank:0", node_id=self.config.node_id,
                             message=failure.cause)
            log.error("%s", ev.message)
            self._stop_workers()
            self.link.report(ev, coordinator_pb2.RECOVERY_LEVEL_PROCESS, gen, 0, 0)
            return
        hardware = self.health.hardware_cause(self.link.reports, gen)
        if hardware is not None:
            failure.record.hardware = f"{hardware.kind}: {hardware.message}"
        self.health.record_failure(failure.record.detected_at, hardware.kind if hardware else "process.exit")
        log.warning("generation %d: rank %d ended with %s; stopping local workers", gen, failure.rank,
                    failure.cause)
        self._stop_workers()
        self._report_failure(failure, gen, hardware)
        self._wake.set()

    def _report_failure(self, failure: WorkerExit, generation: int, hardware: HealthEvent | None) -> None:
        rank, code, error = failure.rank, failure.exit_code, failure.error
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
            self.link.report(ev, coordinator_pb2.RECOVERY_LEVEL_PROCESS, generation, rank,
                             code if code is not None else 0)
            return
        if self.link.reports.covers(hardware, generation):
            log.warning("generation %d: rank %d died with a hardware fault on this node (%s: %s); this node's "
                        "replacement was already requested", generation, rank, hardware.kind, hardware.message)
            return
        log.error("generation %d: rank %d died with a hardware fault on this node (%s: %s); asking the coordinator "
                  "to replace this node", generation, rank, hardware.kind, hardware.message)
        self.link.report_node(hardware, generation, rank, code if code is not None else 0)

    def _handle_detector_events(self) -> None:
        for ev in self.health.take_actionable():
            if ev.action == Action.RESTART_PROCESS and ev.subject.startswith("rank:"):
                gen = self.generation
                rank = self.supervisor.mark_hung(ev)
                if rank is None:
                    continue  # about a worker of an older generation
                log.warning("generation %d: %s; stopping local workers", gen, ev.message)
                if ev.kind == "process.hung":  # every local rank's stack, for the coordinator's localisation
                    ev = HealthEvent(**{**ev.__dict__, "evidence": {**ev.evidence, **self.supervisor.local_stacks()}})
                self._stop_workers()
                self.link.report(ev, coordinator_pb2.RECOVERY_LEVEL_PROCESS, gen, rank, 0)
            elif ev.action >= Action.DRAIN_NODE:
                if self.link.reports.covers(ev, self.generation):
                    log.info("node-level fault: %s; already reported for generation %d", ev.message,
                             self.generation)
                    continue
                log.error("node-level fault: %s; asking the coordinator to replace this node", ev.message)
                self.link.report_node(ev, self.generation)

    # -- main loop ---------------------------------------------------------------------------------------------
    def request_stop(self, signum: int = signal.SIGINT) -> bool:
        """Asks the loop to stop the workers and return ``128 + signum`` (signal handlers call this: 143 for
        SIGTERM, 130 for SIGINT, as a shell reports them, so a scheduler tells a TERM from a Ctrl-C).

        One stop: a request while stopping already changes nothing (the first signal's code stands).

        Returns:
            True when this request began the stop, False when the agent was stopping already.
        """
        if self.stopping:
            self._wake.set()
            return False
        if self._notifier is not None:
            self._notifier.stopping(f"job {self.config.job}: stopping workers")
        self.stopping = True
        self.stop_code = 128 + int(signum)
        self.link.cancel()  # a registration still waiting for the coordinator gives up now
        self._wake.set()
        return True

    def _start_health(self) -> None:
        local = DetectorEventSource.create(self.config.detectors, self.config.detector_config,
                                           worker_view=self.supervisor) if self.config.detectors else None
        if self.config.daemon is not None:  # the daemon's detectors and predictor watch this node
            from trainguard.agent.health_source import DaemonEventSource

            self.health.drain_grace_s = self.config.drain_grace_s
            self.health.start(DaemonEventSource(self.config.daemon, local, on_alarm=self.health.alarm))
            return
        if local is None:
            return
        source = local
        self.start_predictor(self.config.predictor_model, self.config.history_path,
                             interval_s=self.config.predictor_interval_s, drain_grace_s=self.config.drain_grace_s)
        self.health.start(source)

    def run(self) -> int:
        """Runs until the job ends or a stop is requested.

        Returns:
            0 when the job succeeded; 1 when it failed; 128 + the signal when stopped by one (143: SIGTERM,
            130: SIGINT).

        Raises:
            CoordinatorUnavailableError: registration failed, or the coordinator stayed unreachable for
                ``coordinator_patience_s`` while this node ran no workers.
            JobFailedError: the coordinator declared the job failed.
        """
        if self.config.host_store:
            from trainguard.agent.worker_store import preload

            preload()  # torch for the workers' store, imported while the node registers
        try:
            try:
                self.link.open()
            except RegistrationCancelledError:
                return self.stop_code  # stopped by a signal before the coordinator answered
            if self.job_memory is not None:
                self.job_memory.start()
            with keep_lease(lambda: self.link.keepalive(self._beat_content), self.link.interval_s, "detector start"):
                self._start_health()  # imports: seconds on a busy host, longer than a short lease
            if self._notifier is not None:
                self._notifier.ready(f"job {self.config.job}: registered, waiting for a rank table")
            next_hb = 0.0
            success_sent = -1  # the generation whose success a heartbeat has carried
            while not self.stopping:
                if self._watchdog is not None:
                    self._watchdog.tick(healthy=True)
                self._check_workers()
                if self.supervisor.state is SupervisorState.SUCCEEDED and success_sent != self.generation:
                    # Say so now, not at the next beat: the coordinator ends the job when every node has, and the
                    # interval it tells grows with the node count (seconds): each launcher waited that long.
                    success_sent, next_hb = self.generation, 0.0
                self._handle_detector_events()
                self.health.tick(self.supervisor.last_step_time())
                self.drain_if_due()
                self.supervisor.ensure_standbys(
                    spare_waiting=self.config.spare and self.generation <= 0 and self.link.connected)
                now = time.monotonic()
                if now >= next_hb:
                    resp = self.link.heartbeat(self._beat_content)
                    next_hb = now + (resp.interval_s if resp is not None and resp.interval_s > 0
                                     else self.link.interval_s)
                    if resp is not None:
                        done = self._obey(resp)
                        if done is not None:
                            return done
                    else:
                        done_gen = self.link.generation \
                            if self.supervisor.state is SupervisorState.SUCCEEDED else None
                        self.link.check_patience(self.supervisor.running(), now, done_gen)
                self._wake.wait(self.config.poll_s)
                self._wake.clear()
            return self.stop_code
        finally:
            self.health.stop()
            if self.job_memory is not None:
                self.job_memory.stop()
            self.supervisor.close()
            self.link_probe.close()
            self.link.close()
            self.stopping = True


def install_signal_handlers(agent: NodeAgent, signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT)
                            ) -> Callable[[], None]:
    """Makes ``signals`` (default SIGTERM, SIGINT) stop the agent gracefully; returns a function restoring the
    old handlers."""
    def handler(signum, _frame):
        # One line per stop: a second signal while the workers are being stopped (a worker slow to exit, a
        # scheduler or a user sending it again) logged "stopping workers" again, as if another stop began.
        if agent.request_stop(signum):
            log.warning("received %s: stopping workers", signal.Signals(signum).name)
        else:
            log.debug("received %s: already stopping", signal.Signals(signum).name)

    return handle_signals(signals, handler)


def handle_signals(signals: Sequence[int], handler: Callable[[int, Any], None]) -> Callable[[], None]:
    """Installs ``handler`` for ``signals``; returns a function that puts back the handlers found."""
    old = {s: signal.getsignal(s) for s in signals}
    for s in old:
        signal.signal(s, handler)

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore


__all__ = ["NodeAgent", "NodeConfig", "install_signal_handlers", "link_config"]

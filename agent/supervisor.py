"""The worker supervisor: one node's worker group of the current generation, and warm standbys for the next.

It starts a generation's workers from the coordinator's rank table, hosts that generation's store, polls the
workers, takes their step reports (and queues advisories for them), stops them, and keeps the failure timeline
(:class:`~trainguard.agent.fault_records.FaultRecord`). It tells nobody: :meth:`LocalSupervisor.poll` returns
a failure and the composition (:class:`~trainguard.agent.node.NodeAgent`) decides whom to tell. States and
transitions: :data:`~trainguard.agent.parts.SUPERVISOR_TRANSITIONS` (diagram in :mod:`trainguard.agent.parts`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainguard.agent.errors import WorkerStartError
from trainguard.agent.fault_records import FaultRecord
from trainguard.agent.generation import GenerationResources, read_error_file, worker_specs
from trainguard.agent.lifecycle import Lifecycle
from trainguard.agent.parts import SUPERVISOR_TRANSITIONS, SupervisorHook, SupervisorState, SupervisorTrigger
from trainguard.agent.standby import StandbyPool
from trainguard.agent.step_timing import TimingRelay, stack_evidence
from trainguard.agent.workers import WorkerGroup, WorkerState, describe_exit
from trainguard.proto import agent_pb2, common_pb2
from trainguard.worker_env import ERROR_FILE_ENV

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.agent.node import NodeConfig
    from trainguard.detectors.events import HealthEvent

log = logging.getLogger(__name__)

_T = SupervisorTrigger

#: Most advisories kept per rank until the worker acknowledges them; the oldest go first beyond it (a worker that
#: never acknowledges, or one that is wedged, must not grow the agent's memory without bound).
MAX_PENDING_ADVISORIES = 32


@dataclass
class WorkerExit:
    """A failed worker, as :meth:`LocalSupervisor.poll` reports it.

    Attributes:
        rank: the failed global rank.
        exit_code: its Popen return code (negative: killed by that signal); None for an agent-side failure.
        error: the first line of the worker's ``@record`` error file, or None.
        record: the fault timeline entry made for it (the caller may add the hardware cause).
        cause: why, for logs and reports (``signal SIGKILL (9)``, or the agent-side failure's message).
        agent_side: the failure is the agent's (the generation's store), not the worker's exit.
    """

    rank: int
    exit_code: int | None
    error: str | None
    record: FaultRecord
    cause: str
    agent_side: bool = False


def _discard_empty_dumps(group: WorkerGroup) -> None:
    """Removes the stack-dump files the stopped workers opened and never wrote (one empty file per worker process
    in /tmp, for good, before)."""
    from trainguard.detectors.stackdump import STACK_DIR_ENV, discard_empty_dump

    for w in group.workers:
        discard_empty_dump(w.pid, w.spec.env.get(STACK_DIR_ENV) or None)


class LocalSupervisor:
    """Supervises this node's workers (implements :class:`~trainguard.agent.parts.Supervisor`).

    Args:
        config: the node's configuration (worker command, counts, logs, grace, standbys).
        hooks: called once per loop turn with the running workers (a drill's fault injector; see
            :class:`~trainguard.agent.parts.SupervisorHook`).
        running_after_s: a worker that never reports through the hook counts as RUNNING (no longer STARTING)
            after this many seconds alive; default ``config.standby_after_s``.
    """

    def __init__(self, config: "NodeConfig", hooks: Sequence[SupervisorHook] = (),
                 running_after_s: float | None = None) -> None:
        self.config = config
        self.hooks = list(hooks)
        self.fault_records: list[FaultRecord] = []
        self.table: common_pb2.RankTable | None = None
        self.restart_count = 0
        #: Fail-slow: step timing of the local ranks, relayed to the coordinator with each heartbeat.
        self.timing = TimingRelay()
        self._life: Lifecycle[SupervisorState, SupervisorTrigger] = Lifecycle(
            "supervisor", SUPERVISOR_TRANSITIONS, SupervisorState.INIT)
        self._running_after_s = config.standby_after_s if running_after_s is None else running_after_s
        self._generation = -1
        self._group: WorkerGroup | None = None
        self._lock = threading.RLock()
        self._advisories: dict[int, list[agent_pb2.Advisory]] = {}
        self._standbys = StandbyPool()
        self._resources = GenerationResources(config.error_dir)  # the generation's store and error files
        self._started = 0.0  # time.monotonic() when the current generation's workers started
        self._failed = False  # the current stop ends in FAILED (a worker failed or hung)
        # Some worker of this job, in any generation, reported through the hook: the job's workers do, so a
        # silent one before its first step is hung (a script without the hook is never judged by silence).
        self._hook_seen = False
        # rank -> its last reported step when a hook struck it in the current generation: the fault record's
        # step (taken at the strike, as the injector logs it, not the step the drill asked for).
        self._struck_steps: dict[int, int] = {}

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def state(self) -> SupervisorState:
        """The current lifecycle state."""
        return self._life.state

    @property
    def generation(self) -> int:
        """Generation of the current (or last) worker group; -1 before the first."""
        return self._generation

    @property
    def group(self) -> WorkerGroup | None:
        """The current generation's workers, if any."""
        return self._group

    def running(self) -> int:
        """Number of live local workers."""
        group = self._group
        return group.running() if group is not None else 0

    def heartbeat_fields(self) -> Mapping[str, object]:
        """What the coordinator heartbeat says about the workers (implements
        :class:`~trainguard.agent.parts.HeartbeatContent`)."""
        with self._lock:
            group = self._group
            return {
                "generation": self._generation if group is not None else -1,
                "workers_running": group.running() if group is not None else 0,
                "last_step": max((w.last_step for w in group.workers), default=-1) if group else -1,
                "workers_succeeded": group.all_succeeded() if group is not None else False,
                "timings": self.timing.drain(),
            }

    def last_step_time(self) -> float | None:
        """Duration of the newest step any local worker reported, seconds (the predictor's input)."""
        group = self._group
        return max((w.step_times[-1] for w in group.workers if w.step_times), default=None) if group else None

    # -- workers' reports ----------------------------------------------------------------------------------
    def on_heartbeat(self, rank: int, pid: int, generation: int, step: int, step_time_s: float,
                     finished: bool = False, sections: Mapping[str, float] | None = None,
                     acked: Sequence[str] | None = None) -> list:
        """Records a step reported by a local worker (with its section times, if any).

        Args:
            acked: ids of advisories the worker has received (it acknowledges them); None for a worker that does
                not acknowledge (from before acknowledgements), whose advisories are handed out once.

        Returns:
            The advisories pending for that rank (empty for a straggler of an older generation). A worker that
            acknowledges gets each one again in every answer until it acknowledges it: the answer carrying it may
            never reach the worker (its call timed out), and the worker acts on each id once.
        """
        with self._lock:
            group = self._group
            w = group.by_rank(rank) if group is not None else None
            if w is None or (pid and w.pid != pid) or generation != self._generation:
                return []  # a straggler of an older generation
            now = time.time()
            w.hooked = self._hook_seen = True
            if w.state == WorkerState.STARTING:
                w.state = WorkerState.RUNNING  # it reached the hook: its start-up is over
            if w.finished and not finished:
                # the hook's pause of hang detection is over: silence counts afresh from here
                w.last_heartbeat = time.monotonic()
            w.finished = finished  # the latest state: the hook sends its messages in order, from one thread
            if step > w.last_step:
                w.last_step = step
                w.last_heartbeat = time.monotonic()
                if step_time_s > 0:
                    w.step_times.append(step_time_s)
                    self.timing.record(generation, rank, step, step_time_s, sections or {})
            elif step >= 0:
                # A step that does not grow (the index within an epoch: `for step, batch in enumerate(loader)`,
                # or a rollback) is still a step done: the hook sends step numbers only from step_done. Taken as
                # silence, it had a healthy job restarted as hung from its second epoch on. Its time is not
                # recorded: the fail-slow windows follow step numbers.
                w.last_heartbeat = time.monotonic()
            for rec in self.fault_records:
                if rec.resumed_at is None and rec.restarted_at is not None and step >= 0:
                    rec.resumed_at = now
                    rec.resumed_step = step
            if acked is None:
                return self._advisories.pop(rank, [])
            pending = self._advisories.get(rank)
            if not pending:
                return []
            if acked:
                done = set(acked)
                pending[:] = [a for a in pending if a.advisory_id not in done]
            return list(pending)

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
                    pending = self._advisories.setdefault(w.spec.rank, [])
                    pending.append(agent_pb2.Advisory(kind=kind, reason=reason, advisory_id=adv_id,
                                                      at_step=at_step))
                    if len(pending) > MAX_PENDING_ADVISORIES:
                        dropped = pending.pop(0)
                        log.warning("rank %d has not acknowledged %d advisories; dropping the oldest (%s)",
                                    w.spec.rank, len(pending) + 1, dropped.reason)
        return adv_id

    # -- lifecycle -----------------------------------------------------------------------------------------
    def start(self, table: common_pb2.RankTable, before_spawn: Callable[[list], None] | None = None) -> bool:
        """Starts this node's ranks of ``table`` as a new generation (STARTING -> RUNNING).

        ``before_spawn`` is called with the workers' specs before they start (the job memory tier fetches a new
        slot's copies there and puts each worker's restore plan into its environment).

        Returns:
            False when the table gives this node no ranks (nothing started).

        Raises:
            WorkerStartError: a worker could not be spawned (the supervisor is then FAILED).
        """
        c = self.config
        mine = next((n for n in table.nodes if n.node_id == c.node_id), None)
        if mine is None:
            return False
        self._life.fire(_T.START)
        use_agent_store = self._resources.host_store(c, table, mine)
        specs = worker_specs(c, table, mine, self._resources.error_dir(table.generation), use_agent_store)
        if before_spawn is not None:
            before_spawn(specs)
        group = WorkerGroup(specs, log_dir=c.log_dir, streams=c.streams, role=c.role)
        with self._lock:
            self.table = table
            self._generation = table.generation
            self.restart_count = table.restart_count
            self._group = group
            self._advisories.clear()
            self._failed = False
            self._struck_steps = {}
        standbys = self._standbys.take()
        try:
            group.start(standbys)
        except WorkerStartError:
            self._life.fire(_T.SPAWN_FAILED)
            raise
        finally:
            StandbyPool.drop_all(standbys)
        self._started = time.monotonic()
        self._life.fire(_T.SPAWNED)
        now = time.time()
        for rec in self.fault_records:
            if rec.restarted_at is None:
                rec.restarted_at = now
        log.info("generation %d: started ranks %d..%d (master %s:%d)", table.generation, mine.first_rank,
                 mine.first_rank + mine.local_world_size - 1, table.master_addr, table.master_port)
        return True

    def stop(self, keepalive: Callable[[], None] | None = None) -> None:
        """Stops the workers (SIGTERM, SIGKILL after ``stop_grace_s``) and the generation's store.

        Args:
            keepalive: called about every 0.1 s while waiting (the composition renews its coordinator lease
                with it: a hung worker ignoring SIGTERM must not make the whole node look lost).
        """
        with self._lock:
            group = self._group
            self._group = None
        if group is not None and self._life.state == SupervisorState.RUNNING and group.all_succeeded():
            # Every worker exited 0 since the last poll (the heartbeat that told the coordinator saw it first).
            self._life.fire(_T.ALL_SUCCEEDED)
        if group is not None and self._life.fire_if(_T.STOP):
            group.stop(self.config.stop_grace_s, tick=keepalive)
            self._life.fire(_T.STOPPED_AFTER_FAILURE if self._failed else _T.STOPPED)
        elif group is not None:
            group.stop(self.config.stop_grace_s, tick=keepalive)
        if group is not None:
            _discard_empty_dumps(group)
        self._resources.close_store()

    def close(self) -> None:
        """Stops the workers, drops the standbys, removes the generation's files (the node is leaving)."""
        self.stop()
        self._standbys.drop()
        self._resources.cleanup()

    def poll(self) -> WorkerExit | None:
        """Runs the hooks, reaps ended workers and moves the state.

        Returns:
            The first failure of the current generation (the supervisor is then STOPPING: call :meth:`stop`),
            or None.
        """
        group = self._group
        if group is None:
            return None
        if self._life.state in (SupervisorState.RUNNING, SupervisorState.HUNG):
            for hook in self.hooks:
                hook.on_tick(self._generation, group)
            self._note_struck(group)
        failed = self._resources.failed
        if failed is not None and failed[0] == self._generation:
            self._resources.failed = None
            gen = self._generation
            message = f"generation {gen}: {failed[1]}; restarting with rank 0 hosting the store"
            rec = FaultRecord(generation=gen, rank=0, cause=message, injected_at=None, detected_at=time.time())
            self.fault_records.append(rec)
            self._fail()
            return WorkerExit(rank=0, exit_code=None, error=None, record=rec, cause=message, agent_side=True)
        now = time.monotonic()
        for w in group.workers:
            if w.state == WorkerState.STARTING and now - self._started >= self._running_after_s \
                    and w.proc.poll() is None:
                w.state = WorkerState.RUNNING
        for w in group.poll():
            if w.state != WorkerState.FAILED:
                continue
            rec = FaultRecord(
                generation=self._generation, rank=w.spec.rank, cause=describe_exit(w.exit_code),
                injected_at=self.injected_at(w.spec.rank), detected_at=time.time(),
                step=self._fault_step(w.spec.rank, w.last_step),
                error=read_error_file(w.spec.env.get(ERROR_FILE_ENV)),
            )
            self.fault_records.append(rec)
            self._fail()
            return WorkerExit(rank=w.spec.rank, exit_code=w.exit_code, error=rec.error, record=rec,
                              cause=rec.cause)
        if self._life.state == SupervisorState.RUNNING and group.all_succeeded():
            self._life.fire(_T.ALL_SUCCEEDED)
        return None

    def note_hang(self, generation: int, outlier_ranks: Sequence[int], where: str) -> None:
        """Notes on this node's hang records of ``generation`` where the coordinator localised the hang, unless
        the recorded rank is an outlier itself (``where``: "rank(s) R on NODE in FRAME")."""
        for rec in self.fault_records:
            if rec.generation == generation and rec.rank not in outlier_ranks and "no step heartbeat" in rec.cause:
                rec.hang = where

    def mark_hung(self, event: "HealthEvent") -> int | None:
        """Takes the process detector's verdict (``process.hung`` or another RESTART_PROCESS event about
        ``rank:R``) on a current worker: for a hang, that worker and the supervisor become HUNG (stop() then ends
        in FAILED); for another cause the supervisor is STOPPING. A fault record is made either way.

        Returns:
            The rank, or None when the event is about a worker of an older generation (ignored).
        """
        group = self._group
        if group is None or not event.subject.startswith("rank:"):
            return None
        rank = int(event.subject.split(":", 1)[1].split("/")[0])
        w = group.by_rank(rank)
        if w is None or w.proc.poll() is not None or str(w.pid) != event.evidence.get("pid", str(w.pid)):
            return None  # about a worker of an older generation
        self.fault_records.append(FaultRecord(generation=self._generation, rank=rank,
                                              cause=event.message or event.kind,
                                              injected_at=self.injected_at(rank), detected_at=time.time(),
                                              step=self._fault_step(rank, w.last_step)))
        if event.kind == "process.hung" and self._life.can(_T.HANG):
            w.state = WorkerState.HUNG
            self._life.fire(_T.HANG)  # HUNG until stop(), which then ends in FAILED
            self._failed = True
        else:
            self._fail()
        return rank

    def _fail(self) -> None:
        self._failed = True
        self._life.fire(_T.WORKER_FAILED)

    def injected_at(self, rank: int) -> float | None:
        """When a hook struck ``rank`` in the current generation (None: a real fault)."""
        return next((t for t in (h.injected_at(self._generation, rank) for h in self.hooks) if t), None)

    def _note_struck(self, group: WorkerGroup) -> None:
        """Keeps the last reported step of each worker a hook has just struck: the step of the injected fault.

        Read right after the hooks ran, before the next heartbeats: the demo reported the step the drill asked
        for (275) while the injector struck at the first tick at or after it (281).
        """
        if not self.hooks:
            return
        for w in group.workers:
            rank = w.spec.rank
            if rank not in self._struck_steps and self.injected_at(rank) is not None:
                self._struck_steps[rank] = w.last_step

    def _fault_step(self, rank: int, last_step: int) -> int | None:
        """The step of ``rank``'s fault: its step when a hook struck it, else the last one it reported."""
        step = self._struck_steps.get(rank, last_step)
        return step if step >= 0 else None

    # -- standbys and views --------------------------------------------------------------------------------
    def ensure_standbys(self, spare_waiting: bool) -> None:
        """Prepares the current generation's replacements once it trains (see :class:`StandbyPool`).

        Args:
            spare_waiting: this node is a registered spare without a generation yet (arm at once).
        """
        if self.config.standby:
            self._standbys.ensure(self.config, self._group, self._started, spare_waiting=spare_waiting)

    def local_stacks(self) -> dict[str, str]:
        """Python stacks of every live local worker (``stack.<rank>`` evidence entries)."""
        group = self._group
        pids = {w.spec.rank: w.pid for w in group.workers if w.proc.poll() is None} if group is not None else {}
        return stack_evidence(pids)

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
                           recent_step_times=tuple(w.step_times), returncode=w.exit_code,
                           hooked=w.hooked or self._hook_seen)
            for w in group.workers
        ]

    def worker_statuses(self, into: agent_pb2.NodeHealth) -> None:
        """Adds one ``WorkerStatus`` per current worker to ``into``."""
        with self._lock:
            if self._group is None:
                return
            now = time.monotonic()
            for w in self._group.workers:
                into.workers.add(
                    rank=w.spec.rank,
                    local_rank=w.spec.local_rank,
                    pid=w.pid,
                    state=int(w.state),
                    step=w.last_step,
                    last_heartbeat_age_s=(now - w.last_heartbeat) if w.last_heartbeat else -1.0,
                    exit_code=w.exit_code if w.exit_code is not None else 0,
                )


__all__ = ["MAX_PENDING_ADVISORIES", "LocalSupervisor", "WorkerExit"]

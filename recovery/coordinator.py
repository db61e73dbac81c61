"""The coordinator's core for one job: membership, generations and recovery, durable through a store.

This module knows nothing about gRPC or protobuf: :mod:`trainguard.recovery.service` validates requests,
converts them to the plain types of :mod:`~trainguard.recovery.domain` (:mod:`~trainguard.recovery.convert`),
calls these methods and maps the :class:`~trainguard.recovery.errors.RequestError` they raise to status codes.
Decisions about the job are made by the pure step of :mod:`~trainguard.recovery.decide`; this module is the
effect layer around it (membership, leases, store commits, the commands agents read). It combines

- :mod:`~trainguard.recovery.ranks` (who gets which ranks),
- :mod:`~trainguard.recovery.policy` (which recovery level a failure gets, budget, backoff, de-duplication),
- :mod:`~trainguard.recovery.store` (compare-and-set with a fencing token) through a
  :class:`~trainguard.recovery.committer.GroupCommitter`, records encoded by :mod:`.job_records`,

and one collaborator per feature, each called with this coordinator's lock held: :mod:`.membership` (the member
record, admission rules), :mod:`.node_command` (a heartbeat's answer), :mod:`.memory_book` (the memory tier's
holdings, restore plan and replica targets), :mod:`.checkpoint_relay` (job-wide checkpoint requests),
:mod:`.peer_pool` (qualification peers), :mod:`.daemon_reports` (node daemons' verdicts) and
:mod:`.failslow_wiring` (to and from :mod:`.failslow`).

The class is put together from parts that share its state (set up in ``__init__``) and its lock, one module each:
:mod:`.durability` (reading the store back, writes, lost writes made again, the fence), :mod:`.formation` (the first
generation's wait for nodes, a plan's placement, :meth:`~.formation.Formation._advance`), :mod:`.cordoning` (daemon
verdicts, held cordons, qualification, uncordon, the cordon list's bound) and :mod:`.leases` (registration,
liveness, leaving, forgetting members). This module keeps the state, heartbeats, fault reports, checkpoint commits
and the fail-slow wiring. Every part logs as ``trainguard.recovery.coordinator``.

Durability. Store keys under ``trainguard/jobs/<job>/``: ``fence`` (epoch of the owning coordinator),
``nodes/<node id>`` (registration and lease, one key per node so 12.5k registrations are not one growing
blob), ``held/<node id>`` (a node daemon's fatal verdict about a node not registered yet: see
:mod:`.daemon_reports`), ``state`` (policy state, rank layout naming its nodes by id digest, MASTER_PORT and every port used,
zlib-compressed JSON, rewritten whole at each change) and ``checkpoint`` (last step every rank committed). A registration is
acknowledged once its record is durable; a START/RESTART is sent only once the generation it names is durable, so a
coordinator killed at any instant and restarted never hands out a generation number or a MASTER_PORT twice.
Heartbeats are soft state: after a restart every known node gets ``lease_timeout_s`` to heartbeat again with
its old lease, which stays valid, so agents just keep calling and need no re-registration.

Liveness. A node that misses heartbeats for ``lease_timeout_s`` is lost: a node-level failure (cordon, spare,
shrink, or job level). A node in the current generation whose agent registers again (the agent restarted,
so its workers are gone) is a process-level failure of that generation.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from trainguard.recovery.checkpoint_relay import CheckpointRelay
from trainguard.recovery.committer import GroupCommitter
from trainguard.recovery.daemon_reports import DaemonReports
from trainguard.recovery.decide import Event, FaultReported, Persist, Progressed, Step, decide
from trainguard.recovery.domain import Beat, FaultReport, GenerationTable
from trainguard.recovery.cordoning import Cordoning
from trainguard.recovery.durability import DURABLE_WAIT_S, RERUN_HINT, Durability
from trainguard.recovery.errors import (CapacityError, InvalidRequestError, NotServingError, StaleGenerationError,
                                        UnknownJobError)
from trainguard.recovery.failslow import FailSlowSupervisor, is_hang_report
from trainguard.recovery.failslow_wiring import FailSlowWiring
from trainguard.recovery.formation import Formation
from trainguard.recovery.job_records import checkpoint_value
from trainguard.recovery.leases import Leases
from trainguard.recovery.membership import Member
from trainguard.recovery.memory_book import MemoryBook
from trainguard.recovery.node_command import HeartbeatReply, command_for
from trainguard.recovery.peer_pool import PeerPool
from trainguard.recovery.policy import Failure, Level, Phase, PolicyState, RecoveryPolicy
from trainguard.recovery.ranks import RankLayout
from trainguard.recovery.spec import JobSpec
from trainguard.recovery.store import FencedStore, Put, Store, acquire_fence, open_store
from trainguard.recovery.straggler import ReplaceDecision, WindowSnapshot
from trainguard.recovery.write_ledger import WriteLedger, lost

log = logging.getLogger(__name__)

__all__ = ["DURABLE_WAIT_S", "JobCoordinator", "JobSpec", "steady_wall"]


def steady_wall(wall: Callable[[], float], clock: Callable[[], float]) -> Callable[[], float]:
    """Wall-clock seconds that move only with the monotonic ``clock``: ``wall`` is read once, here.

    Why: the policy's times are wall-clock seconds because they outlive the process in the store (backoff
    deadlines, membership waits, repeat windows), but a clock step while the coordinator ran moved every one:
    NTP stepping the clock back an hour held a restart's 1 s backoff for an hour, a step forward failed a job
    waiting for a spare at once (membership timeout). A coordinator started again reads the wall clock afresh.
    """
    base_wall, base = wall(), clock()
    return lambda: base_wall + (clock() - base)


class JobCoordinator(Durability, Formation, Cordoning, Leases):
    """One job's coordinator state machine; thread-safe.

    Args:
        spec: the job.
        store: an opened store (tests); None opens ``spec.store``.
        clock: monotonic clock for leases, seconds (tests may inject one).
        wall: wall clock for the policy's persisted times (repeat windows, backoff deadlines), seconds; read once
            and then advanced by ``clock`` (:func:`steady_wall`), so a clock step while it runs moves none of them.

    Raises:
        InvalidRequestError: the spec is invalid.
        StoreError: the store cannot be opened or read, or holds corrupt state.
    """

    def __init__(self, spec: JobSpec, store: Store | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        spec.validate()
        self._wall = wall = steady_wall(wall, clock)
        self.spec = spec
        self._clock = clock
        self._prefix = f"trainguard/jobs/{spec.job}/"
        raw = store if store is not None else open_store(spec.store)
        self._raw_store = raw
        self.fence = acquire_fence(raw, self._prefix + "fence")
        self._store = FencedStore(raw, self.fence)
        self._committer = GroupCommitter(self._store)
        self._writes = WriteLedger(self._committer.submit)  # each key's last write: made again if the store lost it
        self._lock = threading.RLock()
        self._members: dict[str, Member] = {}
        # Live members that are not spares: the first generation's count of registered nodes, kept as a counter
        # so that each registration of a forming job costs O(1) (see _advance). Spares were counted before: the
        # operator read "2 of 2 registered" with one worker and one spare, and agents' join timeouts were short.
        self._joined = 0
        self._policy = RecoveryPolicy(spec.policy_config())
        self._layout: RankLayout | None = None
        self._master_port = 0
        self._used_ports: set[int] = set()
        self._committed_step = -1
        self._node_steps: dict[str, int] = {}
        self._form_note = ""
        self._form_missing = 0  # nodes the first generation still needs (told to agents: their join timeout)
        self._last_call_at: float | None = None  # when the first generation stops waiting for nodes past nnodes
        self._table: GenerationTable | None = None
        self._state_fut: Future | None = None
        self._held_fut: Future | None = None  # the last write of a held cordon's record (see _persist_held)
        self._big_state_logged = -math.inf  # when _save_state last said the state record is too big
        self._mver = 0  # bumped on every membership/liveness change: invalidates _layout_cache
        self._layout_cache: tuple[object, RankLayout | None] | None = None
        self._running: set[str] = set()  # slot holders running the current generation
        self._succeeded: set[str] = set()  # slot holders whose workers of the current generation all exited 0
        self._told_end: set[str] = set()  # nodes a heartbeat answer told that the job is over
        self._refused_at_registration: set[str] = set()  # nodes whose registration was answered with a refusal
        self._plan_since: tuple[int, float] = (-1, 0.0)  # (plan generation, when it was made): see _quiet_holder
        self._beat_at: dict[str, float] = {}  # node -> when its last heartbeat (with its holdings) arrived
        self._relay = CheckpointRelay(spec.job)  # job-wide checkpoint requests and the step rate they need
        self._beat_observers: list[Callable[[Beat, float], None]] = []
        self.fenced = ""
        self._fence_checked = clock()  # when reap() last read the fence key
        self._fence_unread = False  # the last fence check could not read the store (logged once)
        self._failslow = FailSlowSupervisor(spec.failslow, wall=wall)  # fail-slow: see _failslow_* below
        self._slow = FailSlowWiring(spec.job, self._failslow)
        self._peers = PeerPool()  # qualified nodes' exchange times: the next node's reference
        self._daemons = DaemonReports(spec.job, self._persist_held)
        self.node_health = self._daemons.table  # what node daemons report: see report_node_health
        # Job-wide memory tier: each node's latest in-memory checkpoint copies, and the restore plan built from
        # them for the current table (recomputed when holdings, liveness or the table change).
        self._memory = MemoryBook(spec.job, self._alive)
        self._ended_note = ""  # set when the store holds a job that had ended already (see _load)
        # Slot holders the stored layout names without a node record in the store, and when _load found them:
        # reap() loses those still unknown once a restart's lease has run out (see Leases._lose_unrecorded).
        self._unrecorded: set[str] = set()
        self._unrecorded_since = clock()
        self._load()

    # ----------------------------------------------------------------------------------------------- helpers
    @property
    def state(self) -> PolicyState:
        """The policy state (read-only use)."""
        return self._policy.state

    @property
    def layout(self) -> RankLayout | None:
        """The current generation's layout."""
        return self._layout

    def members(self) -> dict[str, Member]:
        """A snapshot of the membership."""
        with self._lock:
            return dict(self._members)

    def not_told_of_end(self) -> list[str]:
        """Live nodes that no heartbeat answer has told yet that the job is over (all live nodes while it
        runs; none before the first generation formed). An embedded coordinator stays up until this is empty, so
        every agent learns the outcome.

        Judged by the answers, not by heartbeat times against the moment the caller noticed the end: a node told
        in the answer that ended the job, or just before its caller got round to asking, exits at once and is
        never heard again (the launcher embedding the coordinator then waited its whole patience for it, and
        logged the node as lost)."""
        with self._lock:
            if self._policy.state.phase is Phase.FORMING:
                # No generation ever ran: there is no outcome to hear, and each node bounds its own wait (its join
                # timeout). A launcher whose join timed out waited up to 10 s more for the others to "hear" it.
                return []
            # A node refused at registration never learned its lease: it cannot heartbeat, so it would only be
            # waited out to its lease's expiry (10 s at the end of such a job). A node cordoned by a failed
            # re-check (a waiting spare) still heartbeats, and hears the outcome.
            return sorted(nid for nid, m in self._members.items()
                          if m.alive and nid not in self._told_end and nid not in self._refused_at_registration)

    def ended_before_start(self) -> bool:
        """Whether the store held a job that had ended before this coordinator started (nothing runs again)."""
        return bool(self._ended_note)

    def told_of_end(self) -> int:
        """Nodes a heartbeat answer told that the job is over."""
        with self._lock:
            return len(self._told_end)

    def registration_refused(self, node_id: str) -> None:
        """The service answered ``node_id``'s registration with its refusal: its agent never learned the lease and
        exits, so the end of the job is not held for it (see :meth:`not_told_of_end`)."""
        with self._lock:
            self._refused_at_registration.add(node_id)

    def _check_serving(self, job: str) -> None:
        if self.fenced:
            raise NotServingError(f"this coordinator no longer owns job {self.spec.job!r}: {self.fenced}")
        if job != self.spec.job:
            raise UnknownJobError(f"unknown job {job!r}: this coordinator runs {self.spec.job!r}")

    def _fresh_port(self, node_id: str) -> int:
        m = self._members.get(node_id)
        if m is None or m.free_port <= 0 or m.free_port in self._used_ports:
            return 0
        return m.free_port

    def _rebuild_table(self) -> None:
        lay, st = self._layout, self._policy.state
        if lay is None:
            self._table = None
            return
        self._table = GenerationTable(self.spec.job, st.generation, lay.world_size, lay.master_addr,
                                      self._master_port, st.restart_count, self.spec.max_restarts, lay.slots)

    def _apply(self, event: Event, persist: bool = True) -> Step:
        """The effect layer: runs the pure decision step on the policy state, keeps the new state, applies the
        actions (log lines; a store commit unless ``persist`` is off because the caller commits itself)."""
        before = set(self._policy.state.cordoned)
        step = decide(self._policy.config, self._policy.state, event)
        for node in set(step.state.cordoned) - before:
            # Which daemon process vouched for the node when it was cordoned: only a healthy report from another
            # one (the daemon restarted after a repair) returns it to service (see report_node_health).
            row = self._daemons.table.get(node)
            step.state.cordon_daemon[node] = row.report.instance if row is not None else ""
        self._policy.state = step.state
        for action in step.actions:
            if isinstance(action, Persist):
                if persist:
                    self._save_state()
            else:
                getattr(log, action.severity.value)("job %s: %s", self.spec.job, action.text)
        return step

    def _fail(self, f: Failure, now: float) -> tuple[Level, int, str]:
        lay = self._layout
        holders = [self._members[s.node_id].spec() for s in lay.slots if s.node_id in self._members] if lay else []
        spares = [m.spec() for m in self._candidates(now) if m.info.node_id != f.node_id]
        # A merged report (another node of the same fault) is routine at scale: decide() logs it at debug.
        step = self._apply(FaultReported(f, lay, tuple(holders), tuple(spares)), persist=False)
        plan = self._policy.state.plan
        if plan is not None and self._plan_since[0] != plan.generation:
            self._plan_since = (plan.generation, now)
        if step.changed:
            self._mver += 1
            self._rebuild_table()
            self._save_state()
        d = step.decision
        assert d is not None
        return d.level, d.generation, d.message

    # --------------------------------------------------------------------------------------------------- API
    def heartbeat(self, req: Beat, hold_s: float = DURABLE_WAIT_S) -> HeartbeatReply:
        """Records a node's progress and says what it must do.

        Args:
            req: the heartbeat (validated for format by the service).
            hold_s: the longest the caller waits for an answer that depends on a store write (the service holds
                it until :meth:`wait_durable` returns; the node is not silent meanwhile). Then call
                :meth:`told` when that wait succeeded.

        Returns:
            The response, and the store write it depends on.

        Raises:
            UnknownJobError, NotServingError, UnknownNodeError, StaleLeaseError: see the service.
            StaleGenerationError: the node claims a generation this job never had.
        """
        now = self._clock()
        with self._lock:
            self._check_serving(req.job)
            m = self._auth(req.node_id, req.lease_id)
            st = self._policy.state
            if req.generation > st.generation:
                raise StaleGenerationError(f"node {req.node_id!r} runs generation {req.generation}, but job "
                                           f"{self.spec.job!r} is at generation {st.generation}: stop those workers")
            self._record_beat(m, req, now)
            if lost(self._state_fut) and not self._fence_unread:  # a START waits on the generation's write
                self._rewrite_lost()
            durable = None
            if req.qualification is not None and not req.qualification.passed and not m.refused:
                if not self._room_to_cordon(m.info.node_id):
                    self._forget(m)  # kept out without a cordon: its agent's registration is refused in turn
                    raise CapacityError(self._no_room(m.info.node_id, req.qualification.refusal))
                m.refused = req.qualification.refusal
                self._submit([Put(self._prefix + "nodes/" + m.info.node_id,  # durable before the cordon
                                  self._member_value(m))])
                durable = self._disqualify(m, now)
            self._advance()
            self._memory.mark_fresh(req.node_id, self._table)  # recorded in this call: no older than the table
            reply = self._failslow_reply(self._with_buddies(self._command(m), req.node_id), m.info.node_id)
            if durable is not None and reply.durable is None:
                reply = replace(reply, durable=durable)
            window = self._failslow.pop_window()
            if reply.durable is not None:
                self._hold(m, reply.durable, now, hold_s)
            elif self._policy.state.phase in (Phase.SUCCEEDED, Phase.FAILED):
                self._told_end.add(req.node_id)
        if window is not None:  # a fail-slow window closed: scored without the lock (~1 s at 16k ranks)
            self._failslow_score(window)
        return reply

    def answered(self, req: Beat, hold_s: float = DURABLE_WAIT_S) -> HeartbeatReply:
        """:meth:`heartbeat`, then waits up to ``hold_s`` for the store write its answer depends on and counts a
        delivered outcome as told (:meth:`told`): what the gRPC service does for each heartbeat.

        Raises:
            NotServingError: the write did not become durable in time (the caller retries), besides
                :meth:`heartbeat`'s errors.
        """
        reply = self.heartbeat(req, hold_s)
        if reply.durable is not None:
            ended = reply.response.phase in (Phase.SUCCEEDED, Phase.FAILED)
            self.wait_durable(reply.durable, "the job's outcome" if ended else "the new generation", hold_s)
            self.told(req.node_id, reply)
        return reply

    def told(self, node_id: str, reply: HeartbeatReply) -> None:
        """The service delivered ``reply`` after its store write became durable: a reply telling the job's outcome
        counts for :meth:`not_told_of_end` only now (counted when computed, an outcome the store had not taken yet
        let the embedding launcher stop its coordinator before any node had heard it)."""
        if reply.response.phase in (Phase.SUCCEEDED, Phase.FAILED):
            with self._lock:
                self._told_end.add(node_id)

    def add_heartbeat_observer(self, observer: Callable[[Beat, float], None]) -> None:
        """Calls ``observer(beat, now_s)`` for every accepted heartbeat (e.g. straggler detection).

        Observers run with the coordinator's lock held, on the serving thread: keep them to a few microseconds
        (queue the work elsewhere), and never call back into the coordinator.

        Args:
            observer: the callable; ``now_s`` is the coordinator's monotonic clock.
        """
        self._beat_observers.append(observer)

    def _record_beat(self, m: Member, req: Beat, now: float) -> None:
        """Everything a heartbeat's data changes (called with the lock held): liveness, the node's progress,
        the step rate, who runs or finished the current generation, the backoff reset, the observers, and
        fail-slow detection (the step timing the beat carries; a replacement it decides is applied here)."""
        st = self._policy.state
        if not m.alive:
            log.info("job %s: node %s is back", self.spec.job, req.node_id)
            self._mver += 1
            self._joined += not m.info.spare
            m.alive = True
            # Its record said lost: a coordinator restarted now would have left it out.
            self._submit([Put(self._prefix + "nodes/" + m.info.node_id, self._member_value(m))])
        m.last_seen = now
        if req.free_port > 0:
            m.free_port = req.free_port
        m.generation, m.workers_running, m.last_step = req.generation, req.workers_running, req.last_step
        self._memory.record(req.node_id, req.memory, req.replica_address, req.replica_holds_none)
        self._beat_at[req.node_id] = now
        if req.generation == st.generation and req.last_step >= 0:
            self._relay.observe_step(now, req.last_step, st.generation)
        if req.generation == st.generation >= 0 and self._layout is not None \
                and self._layout.slot_of(req.node_id) is not None:
            self._running.add(req.node_id)
            if req.workers_succeeded:
                m.succeeded_generation = req.generation
                self._succeeded.add(req.node_id)
        if req.generation == st.generation and st.consecutive and req.last_step > st.progress_step \
                and st.phase is Phase.RUNNING:
            self._apply(Progressed(req.last_step))
        for observe in self._beat_observers:
            observe(req, now)
        self._failslow_apply(self._failslow.on_beat(req, self._policy.state.generation, now), now)

    def _command(self, m: Member) -> HeartbeatReply:
        """What the node must do now (lock held; see :func:`~.node_command.command_for`)."""
        st = self._policy.state
        reply = command_for(m, st, self._layout, self._table, self._interval_s(), self._form_note,
                            self._relay.pending(st.generation), self.spec.full_table_max_nodes,
                            lambda: self._memory.holdings_fresh(self._table, self._clock, self._interval_s()),
                            lambda: self._memory.restore_plan(self._table, self._mver, self._committed_step),
                            self._state_fut,
                            self._form_missing if st.phase is Phase.FORMING else 0)
        if self._ended_note and st.phase in (Phase.SUCCEEDED, Phase.FAILED):
            reply = replace(reply, response=replace(reply.response, message=(
                f"{self._ended_note}: {st.message}; {RERUN_HINT}")))
        return reply

    def _with_buddies(self, reply: HeartbeatReply, node_id: str) -> HeartbeatReply:
        """Adds the node's replica targets (see :meth:`MemoryBook.replica_targets`) to a heartbeat reply."""
        targets = self._memory.replica_targets(self._table, self._mver, self.spec.memory_replicas, node_id)
        return replace(reply, response=replace(reply.response, replica_targets=targets)) if targets else reply

    def report(self, req: FaultReport, hold_s: float = DURABLE_WAIT_S) -> tuple[Level, int, str, Future | None]:
        """Decides the recovery for a reported event.

        Args:
            req: the report (validated for format by the service).
            hold_s: the longest the caller waits for the decision's store write (the node is not silent meanwhile).

        Returns:
            (decided level, generation to move to, message, the store write it depends on).

        Raises:
            UnknownJobError, NotServingError, UnknownNodeError, StaleLeaseError: see the service.
            StaleGenerationError: the report names a generation this job never had.
        """
        now = self._clock()
        with self._lock:
            self._check_serving(req.job)
            m = self._auth(req.node_id, req.lease_id)
            st = self._policy.state
            if req.generation > st.generation:
                raise StaleGenerationError(f"report about generation {req.generation}, but job {self.spec.job!r} "
                                           f"is at generation {st.generation}")
            lay = self._layout
            if req.rank >= 0 and lay is not None and req.generation == st.generation \
                    and req.rank >= lay.world_size:
                # Taken as it came, the rank went into the failure's description ("rank 99999 on node ...") and
                # the operator's log as though the generation had it; the agent sends a rank of its rank table.
                raise InvalidRequestError(
                    f"failed_rank is {req.rank}, but generation {st.generation} of job {self.spec.job!r} has ranks "
                    f"0..{lay.world_size - 1}; send a rank of that range, or -1 when not about one rank")
            m.last_seen = now
            handled = self._failslow_report(req, now)
            if handled is not None:  # stacks for a hang being localised: fail-slow's own, not a failure
                return Level.NONE, st.generation, handled, None
            if req.checkpoint_now:
                return Level.NONE, st.generation, self._request_checkpoint(req, now), None
            detail = req.detail
            if is_hang_report(req.kind) and req.rank >= 0:  # localised in this very report (one node's ranks)
                blame = self._failslow.hang_blame(req.generation, req.rank)
                detail = f"{blame}; {detail}" if blame else detail
            f = Failure(req.node_id, req.generation, req.cause, req.proposed, req.rank, req.exit_code, detail,
                        self._wall())
            fut_before = self._state_fut
            level, gen, msg = self._fail(f, now)
            self._advance()
            fut = self._state_fut if self._state_fut is not fut_before else None
            if fut is not None:  # the node waits for the decision to be durable: no silence meanwhile
                self._hold(m, fut, now, hold_s)
            return level, gen, msg, fut

    def _request_checkpoint(self, req: FaultReport, now: float) -> str:
        """Sets a job-wide checkpoint at a step no rank reached yet (lock held; see :class:`CheckpointRelay`)."""
        lay = self._layout
        steps = [self._members[s.node_id].last_step for s in lay.slots if s.node_id in self._members] \
            if lay is not None else None
        return self._relay.request(self._policy.state, steps, self._interval_s(), f"{req.node_id}: {req.detail}")

    def rank_table(self, job: str) -> GenerationTable | None:
        """The current generation's full rank table (None before the first one forms).

        Raises:
            UnknownJobError, NotServingError: wrong job or not serving.
        """
        with self._lock:
            self._check_serving(job)
            return self._table

    def commit_checkpoint(self, job: str, node_id: str, step: int, lease_id: str) -> tuple[int, Future | None]:
        """Records that a node committed a checkpoint step; the job's step is the minimum over its nodes.

        The node's lease is required, as for every other change a node makes: without it anyone who knew a node
        id moved the job's committed step (which restores read) for that node.

        Returns:
            (last step committed by every node of the current generation, the store commit to wait for: the
            job's new step, or a commit with no writes that fails when another coordinator took the job over).

        Raises:
            UnknownJobError, NotServingError, UnknownNodeError, StaleLeaseError: see the service.
        """
        with self._lock:
            self._check_serving(job)
            self._auth(node_id, lease_id)
            self._node_steps[node_id] = max(step, self._node_steps.get(node_id, -1))
            fut = None
            if self._layout is not None:
                low = min(self._node_steps.get(s.node_id, -1) for s in self._layout.slots)
                if low > self._committed_step:
                    self._committed_step = low
                    fut = self._submit([Put(self._prefix + "checkpoint", checkpoint_value(low))])
            if fut is None:
                fut = self._pending(self._prefix + "checkpoint")  # a retried call whose step the store failed
            if fut is None:
                # Nothing to write, yet the answer tells the node its step is recorded: a coordinator whose job
                # another took over (before its once-a-second fence read noticed) acknowledged steps the owner
                # never learned of. A fenced commit with no writes proves ownership; concurrent ones share it.
                fut = self._submit([])
            return self._committed_step, fut

    # ------------------------------------------------------------------------------------ fail-slow wiring
    # All fail-slow logic lives in trainguard.recovery.failslow, the translation in FailSlowWiring; these
    # methods only hand them the job's state and apply decisions through the ordinary node-failure path.

    def _failslow_report(self, req: FaultReport, now: float) -> str | None:
        """Shows a report to fail-slow (called with the lock held); returns the answer when it was fail-slow's
        own (stacks of a hang), else None and the report goes on to the policy."""
        message, decision = self._slow.on_report(req, self._layout, self._policy.state.generation, now)
        self._failslow_apply(decision, now)
        return message

    def _failslow_reply(self, reply: HeartbeatReply, node_id: str = "") -> HeartbeatReply:
        """Adds fail-slow's findings, an open stack request and the node's link probe to a heartbeat reply."""
        ins = self._slow.decorate(reply.response, node_id)
        return reply if ins is None else HeartbeatReply(ins, reply.durable)

    def _failslow_score(self, window: WindowSnapshot) -> None:
        """Scores a closed fail-slow window WITHOUT the lock, then applies it under the lock (the supervisor drops
        it when the generation changed meanwhile); link probes pair the slot holders at their addresses."""
        result = self._failslow.score(window)
        if result is None:
            return
        with self._lock:
            if self.fenced:
                return
            now = self._clock()
            addresses = self._slow.slot_addresses(self._layout, self._members)
            self._failslow_apply(self._failslow.apply_window(result, now, lambda: len(self._candidates(now)),
                                                             lambda: addresses), now)

    def _failslow_apply(self, d: ReplaceDecision | None, now: float) -> None:
        """Replaces a slow (or repeatedly hanging) node with a spare as a node-level failure of that node (see
        :meth:`FailSlowWiring.replacement`), through the policy's ordinary node-failure path (:meth:`_fail`)."""
        f = self._slow.replacement(d, self._layout, self._policy.state, lambda: bool(self._candidates(now)),
                                   self._members.values(), now, self._wall)
        if f is not None:
            self._fail(f, now)
            self._advance()

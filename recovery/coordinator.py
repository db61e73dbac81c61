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

Durability. Store keys under ``trainguard/jobs/<job>/``: ``fence`` (epoch of the owning coordinator),
``nodes/<node id>`` (registration and lease, one key per node so 12.5k registrations are not one growing
blob), ``state`` (policy state, rank layout, MASTER_PORT and every port used, zlib-compressed JSON, rewritten
whole at each change) and ``checkpoint`` (last step every rank committed). A registration is acknowledged
once its record is durable; a START/RESTART is sent only once the generation it names is durable, so a
coordinator killed at any instant and restarted never hands out a generation number or a MASTER_PORT twice.
Heartbeats are soft state: after a restart every known node gets ``lease_timeout_s`` to heartbeat again with
its old lease, which stays valid, so agents just keep calling and need no re-registration.

Liveness. A node that misses heartbeats for ``lease_timeout_s`` is lost: a node-level failure (cordon, spare,
shrink, or job level). A node in the current generation whose agent registers again (the agent restarted,
so its workers are gone) is a process-level failure of that generation.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import replace

from trainguard.recovery.checkpoint_relay import CheckpointRelay
from trainguard.recovery.committer import GroupCommitter
from trainguard.recovery.daemon_reports import DaemonReports
from trainguard.recovery.decide import (AllSucceeded, DaemonHealthy, Event, FaultReported, FormingChecked,
                                        GenerationFormed, GenerationRunning, MembershipChanged, NodeDisqualified,
                                        OperatorUncordon, Persist, Progressed, Step, Tick, decide)
from trainguard.recovery.domain import Beat, FaultReport, GenerationTable, NodeRecord
from trainguard.recovery.errors import (CapacityError, FencedError, InvalidRequestError, MembershipError,
                                        NotServingError, StaleGenerationError, StaleLeaseError, StoreError,
                                        UnknownJobError, UnknownNodeError)
from trainguard.recovery.failslow import FailSlowSupervisor
from trainguard.recovery.failslow_wiring import FailSlowWiring
from trainguard.recovery.job_records import (STATE_WARN_BYTES, decode_held, decode_node, decode_state, node_value,
                                             state_value)
from trainguard.recovery.membership import Member, check_slot_claim, superseded_instances
from trainguard.recovery.memory_book import MemoryBook
from trainguard.recovery.node_command import HeartbeatReply, command_for
from trainguard.recovery.node_health import NodeHealthReport, Verdict
from trainguard.recovery.peer_pool import PeerPool
from trainguard.recovery.planner import place
from trainguard.recovery.policy import Cause, Failure, Level, Phase, PolicyState, RecoveryPolicy
from trainguard.recovery.qualification import Qualification
from trainguard.recovery.ranks import RankLayout, assign_ranks
from trainguard.recovery.spec import MIN_NODE_ID_LIMIT, JobSpec
from trainguard.recovery.store import FencedStore, Put, Store, acquire_fence, open_store
from trainguard.recovery.straggler import ReplaceDecision, WindowSnapshot
from trainguard.recovery.write_ledger import WriteLedger, lost

log = logging.getLogger(__name__)

#: Longest a call waits for its write to become durable, seconds.
DURABLE_WAIT_S = 30.0
#: Nodes a "waiting for nodes" message names at most (the rest are counted).
_NAMED = 8


def steady_wall(wall: Callable[[], float], clock: Callable[[], float]) -> Callable[[], float]:
    """Wall-clock seconds that move only with the monotonic ``clock``: ``wall`` is read once, here.

    Why: the policy's times are wall-clock seconds because they outlive the process in the store (backoff
    deadlines, membership waits, repeat windows), but a clock step while the coordinator ran moved every one:
    NTP stepping the clock back an hour held a restart's 1 s backoff for an hour, a step forward failed a job
    waiting for a spare at once (membership timeout). A coordinator started again reads the wall clock afresh.
    """
    base_wall, base = wall(), clock()
    return lambda: base_wall + (clock() - base)


class JobCoordinator:
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
        self._load()

    # ------------------------------------------------------------------------------------------- persistence
    def _load(self) -> None:
        now = self._clock()
        recs = self._raw_store.scan(self._prefix)
        held = self._prefix + "held/"
        for key, rec in recs.items():
            if key.startswith(self._prefix + "nodes/"):
                n = decode_node(key, rec.value)
                self._members[n.info.node_id] = Member(n.info, n.lease, n.instance, now, refused=n.refused)
                self._joined += not n.info.spare
            elif key.startswith(held):
                self._daemons.restore(decode_held(key, key[len(held):], rec.value), now)
        state = recs.get(self._prefix + "state")
        if state is not None:
            d = decode_state(self.spec.job, state.value)
            self._policy.state, self._layout, self._master_port, self._used_ports = \
                d.policy, d.layout, d.master_port, d.used_ports
        ck = recs.get(self._prefix + "checkpoint")
        if ck is not None:
            self._committed_step = int(json.loads(ck.value)["step"])
        if state is not None or self._members:
            st = self._policy.state
            log.info("job %s restored from store (fence epoch %d): %s, generation %d, %d restart(s), %d node(s)",
                     self.spec.job, self.fence.epoch, st.phase.name, st.generation, st.restart_count,
                     len(self._members))
            if st.phase in (Phase.SUCCEEDED, Phase.FAILED):
                # The outcome stands (a coordinator restarted after the end must not run the job again), but a
                # rerun of the same commands otherwise got only an old "job failed: ..." with no word of where
                # it came from, and nothing ran.
                self._ended_note = (f"job {self.spec.job} had already {st.phase.name.lower()} before this "
                                    f"coordinator started (its store {self.spec.store} keeps the outcome)")
                log.warning("%s: %s; every node is told it is over. To run the job again, start the coordinator "
                            "with another --job or --store", self._ended_note, st.message)
        lay = self._layout
        if lay is not None and (not self.spec.nnodes <= len(lay.slots) <= self._max_nodes()
                                or lay.group_size != self.spec.group_size):
            # The stored layout wins so that a coordinator restart keeps every rank where it was; a changed flag
            # used to be ignored without a word.
            log.warning("job %s: the stored rank layout has %d node(s) with group size %d, this coordinator was "
                        "started with --nnodes %d --group-size %d; the job keeps the stored layout (the job "
                        "shrank, or the flags changed). To lay the job out afresh, use a new --job name or --store",
                        self.spec.job, len(lay.slots), lay.group_size, self.spec.nnodes, self.spec.group_size)
        self._rebuild_table()
        if self._policy.state.phase not in (Phase.SUCCEEDED, Phase.FAILED):
            for nid in self._daemons.held():
                if nid in self._members and not self._excluded(nid):
                    # Registered, but the coordinator stopped before the cordon its registration applied was stored
                    # (the node's record came first): its agent's retried registration keeps its lease and is not
                    # a registration again, so the cordon is applied now.
                    self._cordon_held(nid, now)

    def _cordon_held(self, nid: str, now: float) -> None:
        """Applies a held cordon to a node that registered (lock held, or from ``_load``): a node-level failure,
        stored before its held record is deleted."""
        held, st = self._daemons.held_reason(nid), self._policy.state
        self._fail(Failure(nid, st.generation, Cause.NODE_CRITICAL, Level.NODE,
                           detail=f"node daemon reports a fatal fault: {held}", time_s=self._wall()), now)
        self._mver += 1  # the forming layout must drop the node even when the policy state looks unchanged
        self._save_state()
        self._daemons.release(nid)
        log.warning("job %s: node %s cordoned at registration on its daemon's report: %s", self.spec.job, nid, held)

    def _persist_held(self, node_id: str, value: bytes | None) -> None:
        """Stores (or deletes, ``value`` None) a held cordon's record (lock held; see :mod:`.daemon_reports`)."""
        self._held_fut = self._submit([Put(self._prefix + "held/" + node_id, value)])

    def _save_state(self) -> Future:
        """Queues a snapshot of the job state; callers needing durability wait on the future (lock released)."""
        value = state_value(self._policy.state, self._layout, self.spec.group_size, self._master_port,
                            self._used_ports)
        if len(value) > STATE_WARN_BYTES and self._clock() >= self._big_state_logged + 60.0:  # once a minute
            self._big_state_logged = self._clock()
            st = self._policy.state
            log.error("job %s: the job state record is %d bytes (%d cordoned node(s), %d slot(s)); etcd refuses "
                      "requests over its --max-request-bytes (1.5 MiB by default), and every recovery then fails "
                      "to be stored: return repaired nodes to service (`trainguard uncordon NODE`), shorten node ids, "
                      "or raise etcd's --max-request-bytes", self.spec.job, len(value), len(st.cordoned),
                      len(self._layout.slots) if self._layout else 0)
        fut = self._submit([Put(self._prefix + "state", value)])
        self._state_fut = fut
        return fut

    def _submit(self, puts: Sequence[Put]) -> Future:
        fut = self._writes.submit(puts)
        fut.add_done_callback(self._watch_commit)
        return fut

    def _rewrite_lost(self) -> None:
        """Writes again, with their current values, the keys whose last write the store failed (lock held): node
        records first, then the checkpoint step, then the job state, so a generation never lands before the node
        records it names."""
        keys = set(self._writes.lost_keys())
        if not keys:
            return
        state_key, ckpt_key, nodes = self._prefix + "state", self._prefix + "checkpoint", self._prefix + "nodes/"
        held = self._prefix + "held/"
        puts: list[Put] = []
        for k in sorted(k for k in keys if k.startswith(nodes)):
            m = self._members.get(k[len(nodes):])
            # No member: the lost write deleted a forgotten node's record (see _make_room). It is made again
            # too; left, the record brought the node back as a member at the next coordinator start.
            puts.append(Put(k, node_value(m.info, m.lease_id, m.instance, m.refused) if m is not None else None))
        puts += [Put(k, self._daemons.stored_value(k[len(held):])) for k in sorted(keys) if k.startswith(held)]
        if ckpt_key in keys:
            puts.append(Put(ckpt_key, json.dumps({"step": self._committed_step}).encode()))
        for put in puts:  # one each: the committer batches them, and no batch outgrows an etcd transaction
            self._submit([put])
        if state_key in keys:
            self._save_state()
        log.debug("job %s: writing %d record(s) again that the store failed to take", self.spec.job,
                  len(puts) + (state_key in keys))

    def _pending(self, key: str) -> Future | None:
        """The write ``key`` still waits for (lock held): its last one when pending, a new one of every lost record
        when the store failed it (the failed one while the store is known to be away: a caller is answered at once,
        not after another attempt's timeout), None once it landed."""
        if lost(self._writes.last(key)) and not self._fence_unread:
            self._rewrite_lost()
        return self._writes.last(key)

    def _watch_commit(self, fut: Future) -> None:
        exc = fut.exception()
        if isinstance(exc, FencedError) and not self.fenced:
            self.fenced = str(exc)
            log.error("job %s: %s", self.spec.job, exc)

    @staticmethod
    def _wait(fut: Future | None, what: str, timeout_s: float = DURABLE_WAIT_S) -> None:
        if fut is None:
            return
        try:
            fut.result(timeout=max(0.0, min(timeout_s, DURABLE_WAIT_S)))
        except FencedError as exc:
            raise NotServingError(f"{exc}; reconnect to the coordinator that owns the job") from exc
        except (StoreError, TimeoutError) as exc:
            raise NotServingError(f"{what} could not be made durable ({exc}); retry shortly") from exc

    def wait_durable(self, fut: Future | None, what: str = "the change", timeout_s: float = DURABLE_WAIT_S) -> None:
        """Blocks until a write returned by a call is durable (call without holding any coordinator lock).

        Args:
            fut: the future a call returned, or None.
            what: what was written, for the error message.
            timeout_s: the longest wait (capped at :data:`DURABLE_WAIT_S`): the caller's remaining deadline.

        Raises:
            NotServingError: the write failed or this coordinator was fenced off.
        """
        self._wait(fut, what, timeout_s)

    def close(self) -> None:
        """Flushes pending writes and closes the store."""
        self._committer.close()
        self._raw_store.close()

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
            return sorted(nid for nid, m in self._members.items() if m.alive and nid not in self._told_end)

    def _check_serving(self, job: str) -> None:
        if self.fenced:
            raise NotServingError(f"this coordinator no longer owns job {self.spec.job!r}: {self.fenced}")
        if job != self.spec.job:
            raise UnknownJobError(f"unknown job {job!r}: this coordinator runs {self.spec.job!r}")

    def _auth(self, node_id: str, lease_id: str) -> Member:
        m = self._members.get(node_id)
        if m is None:
            raise UnknownNodeError(f"node {node_id!r} is not registered with job {self.spec.job!r}: register first")
        if m.lease_id != lease_id:
            raise StaleLeaseError(f"lease {lease_id[:8]!r}.. of node {node_id!r} is stale (a newer registration "
                                  "holds the node): register again")
        return m

    def _lease_live(self, m: Member, now: float) -> bool:
        return m.alive and now - m.last_seen <= self._lease_s()

    def _interval_s(self) -> float:
        """Heartbeat interval told to nodes: the configured one, stretched to keep under max_heartbeat_rate."""
        return max(self.spec.heartbeat_interval_s, len(self._members) / self.spec.max_heartbeat_rate)

    def _lease_s(self) -> float:
        """Silence after which a node is lost: the configured lease, at least 3 current intervals."""
        return max(self.spec.lease_timeout_s, 3 * self._interval_s())

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

    def _candidates(self, now: float) -> list[Member]:
        """Alive members holding no slot and not cordoned: spares and standby nodes."""
        cordoned = set(self._policy.state.cordoned)
        lay = self._layout
        return [m for m in self._members.values()
                if self._lease_live(m, now) and m.info.node_id not in cordoned
                and (lay is None or lay.slot_of(m.info.node_id) is None)]

    # -------------------------------------------------------------------------------------------- advancing
    def _install(self, layout: RankLayout, generation: int, port: int) -> None:
        self._layout = layout
        self._master_port = port
        self._used_ports.add(port)
        self._rebuild_table()
        self._failslow.new_world(layout.world_size)  # a shrink renumbers the ranks fail-slow remembers
        self._form_note = ""
        self._form_missing = 0
        self._running.clear()
        self._succeeded.clear()
        self._memory.table_installed(self._clock())
        self._mver += 1
        log.info("job %s: generation %d formed: %d nodes, world size %d, master %s:%d", self.spec.job, generation,
                 len(layout.slots), layout.world_size, layout.master_addr, port)

    def _note(self, text: str) -> None:
        if text != self._form_note:
            self._form_note = text
            log.warning("job %s: %s", self.spec.job, text)

    def _max_nodes(self) -> int:
        return max(self.spec.max_nodes, self.spec.nnodes)

    def _last_call_over(self, now: float) -> bool:
        """Whether the first generation's wait for nodes beyond ``nnodes`` has run out (lock held)."""
        return self._last_call_at is not None and now >= self._last_call_at

    def _first_layout(self, now: float) -> RankLayout | None:
        cordoned = set(self._policy.state.cordoned)
        active = sorted((m for m in self._members.values() if self._lease_live(m, now) and not m.info.spare
                         and m.info.node_id not in cordoned), key=lambda m: m.spec().order_key())
        why, layout = "", None
        most = self._max_nodes()
        self._form_missing = max(0, self.spec.nnodes - len(active))
        if len(active) < self.spec.nnodes:
            self._form_note = self._short_note(len(active), [m.info.node_id for m in active[:_NAMED]])
            self._last_call_at = None  # torchrun clears its deadline too when the count drops below the minimum
        elif len(active) < most and not self._last_call_over(now):
            # torchrun's last call: once MIN joined, nodes arriving within last_call_timeout still join the first
            # round, so a job that could run on MAX nodes does not start on MIN because the rest came late.
            if self._last_call_at is None:
                self._last_call_at = now + self.spec.last_call_s
                log.info("job %s: %d node(s) registered, enough to start; waiting up to %.0f s for up to %d",
                         self.spec.job, len(active), self.spec.last_call_s, most)
            self._form_note = (f"waiting for nodes: {len(active)} of {self.spec.nnodes}..{most} registered; the "
                               f"job starts with those there {self.spec.last_call_s:.0f} s after {self.spec.nnodes} "
                               f"had registered (last call), or at once with {most}")
        else:
            try:
                layout = assign_ranks([m.spec() for m in active[:most]], group_size=self.spec.group_size)
            except MembershipError as exc:
                why = f"cannot lay out ranks: {exc}"
                self._note(why)
        if why or self._policy.state.forming_since_s:
            self._apply(FormingChecked(why, self._wall()))
        return layout

    def _short_note(self, joined: int, named: list[str]) -> str:
        """Why the first generation waits when too few nodes registered, naming the first ones."""
        who = ", ".join(named) + (f" and {joined - len(named)} more" if joined > len(named) else "")
        return (f"waiting for nodes: {joined} of {self.spec.nnodes} registered"
                + (f" ({who})" if named else "") + "; the job starts once --nnodes MIN have registered")

    def _plan_layout(self, now: float) -> RankLayout | None:
        """Places the pending plan's vacancies on the membership now (see :mod:`~trainguard.recovery.planner`)."""
        st = self._policy.state
        plan, lay = st.plan, self._layout
        assert plan is not None and lay is not None
        if plan.level is Level.PROCESS:
            return lay
        gone = set(st.cordoned) | set(plan.cordon)
        holders = [self._members[s.node_id] for s in lay.slots
                   if s.node_id in self._members and s.node_id not in gone]
        if plan.level is Level.JOB:  # every node restarts: only live ones can hold a slot
            holders = [m for m in holders if self._lease_live(m, now)]
        free = [m.spec() for m in self._candidates(now) if m.info.node_id not in gone]
        placement = place(lay, [m.spec() for m in holders], free,
                          allow_shrink=plan.level is Level.NODE and self.spec.allow_shrink,
                          min_nodes=self._policy.config.min_nodes)
        if placement.layout is None:
            placement = replace(placement, waiting=placement.waiting + self._cordoned_live(now))
        self._apply(MembershipChanged(placement, self._wall()))
        if placement.layout is None:
            self._note(f"generation {plan.generation} waits: {placement.waiting}")
        return placement.layout

    def _cordoned_live(self, now: float) -> str:
        """Names the live members a vacancy cannot use because they are cordoned (lock held; "" when none).

        A node cordoned in an earlier recovery stays out of the job when its agent registers again under the same
        id, so an operator who restarted it would otherwise read only "register a spare node" while the job
        waits, with no hint that the node they just started is excluded, nor why.
        """
        st = self._policy.state
        def alive(n: str) -> bool:
            return (m := self._members.get(n)) is not None and self._lease_live(m, now)

        live = sorted(n for n in st.cordoned if alive(n))
        vacated = sorted(n for n in (st.plan.cordon if st.plan else ()) if n not in st.cordoned and alive(n))
        note = ""
        if live:
            named = ", ".join(f"{n!r} ({self._members[n].refused or st.cordon_why.get(n) or 'cordoned'})"
                              for n in live)
            note = (f"; registered but cordoned for this job: {named} (once a machine is repaired, restart its node "
                    "daemon, whose healthy report returns it to service, or run `trainguard uncordon NODE`)")
        if vacated:
            note += (f"; the node(s) this generation replaces are still registered: {', '.join(map(repr, vacated))} "
                     "(once one is repaired, `trainguard uncordon NODE` gives it its slot back)")
        return note

    def _next_layout(self, now: float) -> RankLayout | None:
        """The layout the next generation would get; recomputed only when the membership changed.

        Heartbeats arrive from every node every interval; recomputing an O(n log n) layout on each would make
        a 12.5k-node formation quadratic, so the result is cached per membership version.
        """
        st = self._policy.state
        key = (self._mver, st.plan.generation if st.plan else 0, st.plan.level if st.plan else None,
               self._last_call_over(now))
        if self._layout_cache is None or self._layout_cache[0] != key:
            layout = self._first_layout(now) if st.phase is Phase.FORMING else self._plan_layout(now)
            self._layout_cache = (key, layout)
        return self._layout_cache[1]

    def _try_form(self, now: float) -> None:
        layout = self._next_layout(now)
        if layout is None:
            return
        port = self._fresh_port(layout.slots[0].node_id)
        if not port:
            return  # the rank-0 node reports a fresh port with its next heartbeat
        st = self._policy.state
        generation = 1 if st.phase is Phase.FORMING or st.plan is None else st.plan.generation
        in_place = st.plan is not None and st.plan.level is Level.PROCESS and self._plan_since[0] == generation
        step = self._apply(GenerationFormed(generation), persist=False)
        self._install(layout, step.state.generation, port)
        if in_place:
            # A restart in place forms only once every holder was heard from since the fault (_quiet_holder):
            # the holdings those heartbeats carried are as fresh as the wait for fresh holdings asks, and
            # asking again would cost every restart one more heartbeat interval.
            since = self._plan_since[1]
            for slot in layout.slots:
                if self._beat_at.get(slot.node_id, -math.inf) > since:  # after the fault, not with it
                    self._memory.mark_fresh(slot.node_id, self._table)
        self._save_state()

    def _advance(self) -> None:
        """Moves the job forward as far as the membership allows (called with the lock held)."""
        now = self._clock()
        st = self._policy.state
        if st.phase is Phase.FORMING:
            if self._joined >= self.spec.nnodes:
                self._try_form(now)
            else:
                # _first_layout says why once enough registered (it sorts every member, so it is skipped before,
                # or each registration of a large job would sort them all); until then the nodes that did
                # register waited with an empty message, and their logs said nothing for as long as they waited.
                # Names come from the first few members (insertion order), so a large job's formation stays linear.
                named = [n for n, m in itertools.islice(self._members.items(), 4 * _NAMED)
                         if self._lease_live(m, now) and not m.info.spare][:_NAMED]
                joined = self._joined  # a spare, or a node that left or went silent, is not counted
                self._form_note = self._short_note(joined, named)
                self._form_missing = self.spec.nnodes - joined
                self._last_call_at = None  # as _first_layout does below MIN: the last call starts again at MIN
                if self._policy.state.forming_since_s:  # nodes missing is no layout problem (as _first_layout)
                    self._apply(FormingChecked("", self._wall()))
            if self._policy.state.forming_since_s and self._apply(Tick(self._wall())).changed:
                self._mver += 1
        elif st.plan is not None:
            # Re-planned on every membership change (cached per version), during the backoff too, so the
            # plan's message and its wait clock follow the membership.
            ready = self._next_layout(now) is not None
            if ready and self._wall() >= st.plan.not_before_s and not self._quiet_holder(now):
                self._try_form(now)
            st = self._policy.state
            if st.plan is not None and st.plan.waiting_since_s:
                if self._apply(Tick(self._wall())).changed:
                    self._mver += 1
        elif st.phase in (Phase.RUNNING, Phase.RECOVERING) and self._layout is not None:
            n = len(self._layout.slots)
            if len(self._succeeded) >= n:
                self._apply(AllSucceeded())
            elif st.phase is Phase.RECOVERING and len(self._running) >= n:
                self._apply(GenerationRunning(st.generation))

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

    def _quiet_holder(self, now: float) -> bool:
        """Whether a process-level plan should wait: a slot holder missed two heartbeats but its lease runs on.

        When a node dies, its peers' collectives break at once and they report a process-level failure before
        the dead node's lease expires. Restarting in place then would wait on the dead node, and its expiry would
        cost a second restart; waiting (at most until the lease expires, or until every holder's first heartbeat
        after the plan) lets the expiry merge into this plan as one node-level restart.
        """
        plan = self._policy.state.plan
        if plan is None or plan.level is not Level.PROCESS or self._layout is None:
            return False
        if self._plan_since[0] != plan.generation:  # a plan restored from the store: timed from now
            self._plan_since = (plan.generation, now)
        since = self._plan_since[1]
        quiet = 2.0 * self._interval_s()
        for slot in self._layout.slots:
            m = self._members.get(slot.node_id)
            # Silence alone misses a peer that died a heartbeat ago: its peers' sockets reset at once, faster
            # than two intervals. A holder must also have been heard since the plan was made; a live one is,
            # within one interval, and it needs that heartbeat anyway to learn of the restart.
            if m is not None and m.alive and (now - m.last_seen > quiet or m.last_seen < since):
                return True
        return False

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

    def _disqualify(self, m: Member, now: float) -> Future | None:
        """Cordons a node that failed qualification (lock held; see :mod:`~trainguard.recovery.qualification`).

        A slot holder of a running generation fails at node level (its slot goes to a spare); any other node only
        joins the cordon list. Returns the state write to wait for, or None when nothing changed.
        """
        nid, st = m.info.node_id, self._policy.state
        if nid in st.cordoned:
            return None
        if self._layout is not None and self._layout.slot_of(nid) is not None \
                and st.phase in (Phase.RUNNING, Phase.RECOVERING):
            self._fail(Failure(nid, st.generation, Cause.NODE_CRITICAL, detail=m.refused, time_s=self._wall()), now)
        elif self._apply(NodeDisqualified(nid, m.refused)).changed:
            self._mver += 1
        return self._state_fut

    def qualify_peers(self, job: str, node_id: str, count: int) -> tuple[list[tuple[str, str, int]], float, int]:
        """Up to ``count`` qualified peers for ``node_id``'s timed exchange, and the reference time.

        Peers are live, not cordoned, serve exchanges, and are picked at random so that many nodes qualifying at
        once spread over the qualified ones.

        Returns:
            ([(node id, address, echo port)], median exchange time of the qualified nodes so far, how many).

        Raises:
            UnknownJobError, NotServingError: wrong job, or this coordinator cannot serve.
        """
        now = self._clock()
        with self._lock:
            self._check_serving(job)
            return self._peers.pick(self._members.values(), node_id, count, set(self._policy.state.cordoned),
                                    lambda m: self._lease_live(m, now))

    def refusal(self, node_id: str) -> str:
        """Why ``node_id`` is refused: the qualification it failed ("" when it did not)."""
        with self._lock:
            m = self._members.get(node_id)
            return m.refused if m is not None and node_id in self._policy.state.cordoned else ""

    # --------------------------------------------------------------------------------------------------- API
    def register(self, job: str, info: NodeRecord, free_port: int,
                 instance: str = "", qualification: Qualification | None = None) -> tuple[str, int, Future]:
        """Adds or re-adds a node.

        Args:
            job: job name from the request.
            info: the node's identity and topology (validated for format by the service).
            free_port: a port free on the node now.
            instance: the agent process's random id ("" when unknown).
            qualification: the node's pre-flight verdict (None: it did not qualify). A failed one cordons the node
                (see :mod:`~trainguard.recovery.qualification`); :meth:`refusal` then says why.

        Returns:
            (lease id, current generation, future of the durable node record and cordon).

        Raises:
            UnknownJobError, NotServingError: wrong job, or this coordinator cannot serve.
            DuplicateNodeError: the node id is held by another live agent.
            SlotTakenError: ``info.replaces`` names a live node that holds a slot.
        """
        now = self._clock()
        with self._lock:
            self._check_serving(job)
            nid = info.node_id
            prev = self._members.get(nid)
            superseded = superseded_instances(prev, info, instance, prev is not None and self._lease_live(prev, now),
                                              now, self._lease_s)
            if superseded is None:  # the live agent registering again (a retried call): its lease stands
                assert prev is not None
                # ... once its record is durable: the call retried may be one the store failed.
                fut = self._pending(self._prefix + "nodes/" + nid)
                return prev.lease_id, self._policy.state.generation, fut or _done_future()
            if prev is None and len(self._members) >= self.spec.node_id_limit():
                self._make_room(nid)
            check_slot_claim(info, self._members.get(info.replaces) if info.replaces else None,
                             self._members.values(), self._layout, self._policy.state.cordoned,
                             lambda m: self._lease_live(m, now))
            lease = uuid.uuid4().hex
            refused = (prev.refused if prev is not None else "") \
                or (qualification.refusal if qualification is not None else "")
            held = self._daemons.held_reason(nid) if not self._excluded(nid) else ""
            if (held or refused and nid not in self._policy.state.cordoned) and not self._room_to_cordon(nid):
                raise CapacityError(self._no_room(nid, held or refused))
            m = Member(info=info, lease_id=lease, instance=instance, last_seen=now, free_port=free_port,
                       superseded=superseded, refused=refused)
            self._members[nid] = m
            self._joined += (not info.spare) - (prev is not None and prev.alive and not prev.info.spare)
            self._mver += 1
            fut = self._submit([Put(self._prefix + "nodes/" + nid, node_value(info, lease, instance, refused))])
            st = self._policy.state
            if qualification is not None and not refused:
                m.echo_port = qualification.echo_port
                self._peers.record(qualification.peer_s)
            if refused:
                fut = self._disqualify(m, now) or fut
            elif held and st.phase not in (Phase.SUCCEEDED, Phase.FAILED):
                # Its daemon reported a fatal fault before the node registered: the cordon held until now is applied
                # (and stored) before any generation can place the node.
                self._cordon_held(nid, now)
                fut = self._state_fut
            elif prev is not None and self._layout is not None and self._layout.slot_of(nid) is not None \
                    and st.phase in (Phase.RUNNING, Phase.RECOVERING) and prev.generation >= 0:
                # The agent restarted while its workers ran a generation: they are gone with it.
                self._fail(Failure(nid, prev.generation, Cause.WORKER_EXIT, detail="node agent restarted",
                                   time_s=self._wall()), now)
            log.debug("job %s: node %s registered (pod %r, index %d, %d devices%s)", job, nid,
                     info.pod_id, info.node_index, info.device_count,
                     ", spare" if info.spare else "")
            self._advance()
            return lease, self._policy.state.generation, fut

    def _make_room(self, nid: str) -> None:
        """Forgets the member silent longest among those that can go (lease expired, no slot, not cordoned nor
        named by the pending plan), so a new node id fits (lock held).

        Raises:
            CapacityError: none can go.
        """
        st = self._policy.state
        keep = set(st.cordoned) | set(st.plan.cordon if st.plan else ())
        if self._layout is not None:
            keep |= {s.node_id for s in self._layout.slots}
        gone = [m for m in self._members.values() if not m.alive and m.info.node_id not in keep]
        if not gone:
            raise CapacityError(
                f"node {nid!r} cannot join job {self.spec.job!r}: the coordinator keeps {len(self._members)} node ids, "
                f"its limit ({self.spec.node_id_limit()}: twice --nnodes/--max-nodes, at least {MIN_NODE_ID_LIMIT}), "
                "and none of them expired or can be dropped (slot holders and cordoned nodes stay); "
                "check for a client registering made-up node ids, or retry once unused nodes' leases run out")
        old = min(gone, key=lambda m: m.last_seen)
        oid = old.info.node_id
        self._forget(old)
        log.info("job %s: forgot node %s (lease expired %.0f s ago) to make room for node %s", self.spec.job, oid,
                 self._clock() - old.last_seen, nid)

    def _forget(self, m: Member) -> None:
        """Drops a member and its record (lock held): its lease is void, its agent must register again."""
        nid = m.info.node_id
        del self._members[nid]
        if m.alive and not m.info.spare:
            self._joined -= 1
        for table in (self._node_steps, self._beat_at):
            table.pop(nid, None)
        self._told_end.discard(nid)
        self._running.discard(nid)
        self._succeeded.discard(nid)
        self._memory.forget(nid)
        self._mver += 1
        self._submit([Put(self._prefix + "nodes/" + nid, None)])

    def _room_to_cordon(self, nid: str) -> bool:
        """Whether ``nid`` may join the job state's cordon list (lock held): a slot holder always may (its failure
        must be handled); any other node while the list is under :data:`~trainguard.recovery.spec.MAX_CORDONED`."""
        if self._layout is not None and self._layout.slot_of(nid) is not None:
            return True
        st = self._policy.state
        return len(set(st.cordoned) | set(st.plan.cordon if st.plan else ())) < self.spec.cordon_limit()

    def _no_room(self, nid: str, why: str) -> str:
        """The refusal of a node that must be kept out while the cordon list is full."""
        return (f"node {nid!r} is refused by job {self.spec.job!r} ({' '.join(why.split())[:200]}) instead of "
                f"cordoned: the job state's cordon list holds {self.spec.cordon_limit()} nodes, the most it may (the state is "
                "stored whole at each change, and etcd refuses requests over 1.5 MiB by default); return repaired "
                "nodes to service (`trainguard uncordon NODE`, or restart their node daemon), or check for a client "
                "registering made-up node ids")

    def heartbeat(self, req: Beat) -> HeartbeatReply:
        """Records a node's progress and says what it must do.

        Args:
            req: the heartbeat (validated for format by the service).

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
                                  node_value(m.info, m.lease_id, m.instance, m.refused))])
                durable = self._disqualify(m, now)
            self._advance()
            self._memory.mark_fresh(req.node_id, self._table)  # recorded in this call: no older than the table
            reply = self._failslow_reply(self._with_buddies(self._command(m), req.node_id), m.info.node_id)
            if durable is not None and reply.durable is None:
                reply = replace(reply, durable=durable)
            window = self._failslow.pop_window()
            if self._policy.state.phase in (Phase.SUCCEEDED, Phase.FAILED):
                self._told_end.add(req.node_id)
        if window is not None:  # a fail-slow window closed: scored without the lock (~1 s at 16k ranks)
            self._failslow_score(window)
        return reply

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
        if not m.alive and not m.info.spare:
            self._joined += 1
        m.last_seen, m.alive = now, True
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
                            lambda: self._memory.restore_plan(self._table, self._mver), self._state_fut,
                            self._form_missing if st.phase is Phase.FORMING else 0)
        if self._ended_note and st.phase in (Phase.SUCCEEDED, Phase.FAILED):
            reply = replace(reply, response=replace(reply.response, message=(
                f"{self._ended_note}: {st.message}; to run it again, start the coordinator with another --job "
                "or --store")))
        return reply

    def _alive(self, node_id: str) -> bool:
        """Whether ``node_id`` is a member whose lease has not been found expired (lock held)."""
        return (m := self._members.get(node_id)) is not None and m.alive

    def _with_buddies(self, reply: HeartbeatReply, node_id: str) -> HeartbeatReply:
        """Adds the node's replica targets (see :meth:`MemoryBook.replica_targets`) to a heartbeat reply."""
        targets = self._memory.replica_targets(self._table, self._mver, self.spec.memory_replicas, node_id)
        return replace(reply, response=replace(reply.response, replica_targets=targets)) if targets else reply

    def report(self, req: FaultReport) -> tuple[Level, int, str, Future | None]:
        """Decides the recovery for a reported event.

        Args:
            req: the report (validated for format by the service).

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
            f = Failure(req.node_id, req.generation, req.cause, req.proposed, req.rank, req.exit_code, req.detail,
                        self._wall())
            fut_before = self._state_fut
            level, gen, msg = self._fail(f, now)
            self._advance()
            fut = self._state_fut if self._state_fut is not fut_before else None
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
                    fut = self._submit([Put(self._prefix + "checkpoint",
                                                      json.dumps({"step": low}).encode())])
            if fut is None:
                fut = self._pending(self._prefix + "checkpoint")  # a retried call whose step the store failed
            if fut is None:
                # Nothing to write, yet the answer tells the node its step is recorded: a coordinator whose job
                # another took over (before its once-a-second fence read noticed) acknowledged steps the owner
                # never learned of. A fenced commit with no writes proves ownership; concurrent ones share it.
                fut = self._submit([])
            return self._committed_step, fut

    def reap(self) -> None:
        """Expires silent nodes' leases (a node-level failure for slot holders) and runs due recoveries; every
        second or so, checks that this coordinator still holds the job's fence and, when the store answers, writes
        again what it failed to take."""
        now = self._clock()
        checked = now - self._fence_checked >= 1.0 and not self.fenced
        if checked:
            self._fence_checked = now
            self._check_fence()
        with self._lock:
            if self.fenced:
                return
            if checked and not self._fence_unread:  # the store answers: writes it failed are made again
                self._rewrite_lost()
            for m in list(self._members.values()):
                if m.alive and now - m.last_seen > self._lease_s():
                    self._lose(m, now, f"no heartbeat for {now - m.last_seen:.1f} s")
            self._advance()

    def _lose(self, m: Member, now: float, why: str) -> None:
        """Ends a member's liveness (lock held): a node-level failure when it holds a slot of the running job."""
        m.alive = False
        self._joined -= not m.info.spare
        self._mver += 1
        log.warning("job %s: node %s lost (%s)", self.spec.job, m.info.node_id, why)
        st = self._policy.state  # fresh: each decision replaces the state
        if self._layout is not None and self._layout.slot_of(m.info.node_id) is not None \
                and st.phase in (Phase.RUNNING, Phase.RECOVERING):
            self._fail(Failure(m.info.node_id, st.generation, Cause.NODE_LOST, detail=why, time_s=self._wall()), now)

    def leave(self, job: str, node_id: str, lease_id: str, reason: str = "") -> tuple[str, Future]:
        """A node leaves: its lease ends now (see ``LeaveNode`` in ``coordinator.proto``).

        Without it a node whose agent gave up waiting for the first generation stayed live for ``lease_timeout_s``,
        and a node registering in that window formed a generation with it, which then waited for a node that was
        gone until ``--membership-timeout``. Its lease is replaced (durably), so the left agent must register again.

        Returns:
            (message, the store write to wait for).

        Raises:
            UnknownJobError, NotServingError, UnknownNodeError, StaleLeaseError: see the service.
        """
        now = self._clock()
        with self._lock:
            self._check_serving(job)
            m = self._auth(node_id, lease_id)
            m.lease_id = uuid.uuid4().hex
            fut = self._submit([Put(self._prefix + "nodes/" + node_id,
                                    node_value(m.info, m.lease_id, m.instance, m.refused))])
            if m.alive:
                self._lose(m, now, f"it left: {' '.join(reason.split())[:200] or 'no reason given'}")
            self._advance()
            return f"node {node_id} left job {self.spec.job!r}", fut

    def _check_fence(self) -> None:
        """Reads the fence key (no lock held) and stops serving when another coordinator took it.

        Why: a coordinator learned it was fenced off only from its next store write. While a job just trains
        (heartbeats are not written), one started on the same store for the same job owned it, and this one kept
        answering its agents for as long as nothing failed, without a word.
        """
        try:
            rec = self._raw_store.get(self.fence.key)
        except StoreError as exc:
            if not self._fence_unread:  # once per outage, not every second
                log.warning("job %s: cannot read store %s (%s); durable changes wait until it answers",
                            self.spec.job, self.spec.store, exc)
            self._fence_unread = True
            return
        if self._fence_unread:
            self._fence_unread = False
            log.info("job %s: store %s answers again", self.spec.job, self.spec.store)
        have = rec.version if rec is not None else 0
        if have != self.fence.version and not self.fenced:
            self.fenced = (f"another coordinator took over this job (fence {self.fence.key!r} in store "
                           f"{self.spec.store} moved from version {self.fence.version} to {have}): this one stops; "
                           "run one coordinator per job and store")
            log.error("job %s: %s", self.spec.job, self.fenced)

    # ------------------------------------------------------------------------------------ node daemons
    def report_node_health(self, report: NodeHealthReport) -> tuple[bool, str, Future | None]:
        """Records a node daemon's verdict; a FATAL one cordons the node through the policy's node-failure path.

        The node need not be registered: a daemon reports between jobs, before its node's launcher registers,
        so the node is kept out before the first generation forms and never gets a rank. Until it registers the
        cordon is held, in a record of its own (see :mod:`~trainguard.recovery.daemon_reports`), and applied to the
        job state at its registration: reports naming made-up ids filled the stored cordon list. A node holding a slot
        gets a node-level recovery (its slot goes to a spare, or the job waits for one). A daemon's silence
        changes nothing.

        Uncordon. A cordoned node stays out while the daemon that was running when it was cordoned keeps
        reporting (HEALTHY included: a latched fault, a slow or crashing node look healthy to it). A HEALTHY report
        from a *restarted* daemon (another instance: what an operator does once the machine is repaired; its
        second in a row, so its detectors have sampled) returns the node to service, as a spare or a waiting
        vacancy's filler, without a new node id or a coordinator restart. A node refused by its pre-flight check,
        or about to be cordoned by the pending plan, stays out (``trainguard uncordon`` overrules those).

        Args:
            report: the report (validated for format by the service).

        Returns:
            (whether the node is cordoned in this job now, message, the store write it depends on or None).

        Raises:
            UnknownJobError, NotServingError: the report names another job, or this coordinator cannot serve.
        """
        now = self._clock()
        with self._lock:
            self._check_serving(report.job or self.spec.job)
            fut_before, held_before = self._state_fut, self._held_fut
            cordoned, message = self._daemons.record(report, now, self._policy.state, self._excluded,
                                                     lambda f: self._fail_node_on_report(f, now), self._wall,
                                                     self.spec.node_id_limit(), 3 * self.report_interval_s(),
                                                     known=lambda n: n in self._members)
            if cordoned and self._may_uncordon(report):
                step = self._apply(DaemonHealthy(report.node_id, report.instance))
                if step.changed:
                    cordoned, message = False, step.state.message
                    self._mver += 1  # a vacancy waiting for a spare is re-planned with this node
                    self._advance()
            if self._state_fut is not fut_before:
                return cordoned, message, self._state_fut
            # A cordon held for a node not registered yet is answered once its record is stored, so a coordinator
            # restarted right after the answer still keeps the node out.
            return cordoned, message, self._held_fut if self._held_fut is not held_before else None

    def uncordon(self, job: str, node_id: str, reason: str = "") -> tuple[bool, str, Future | None]:
        """An operator returns a cordoned node to service (``trainguard uncordon``): a repaired machine with no node
        daemon to vouch for it, or one whose pre-flight refusal they overrule (its record is rewritten without it).

        Args:
            job: job name from the request.
            node_id: the node.
            reason: the operator's one line, for the log.

        Returns:
            (whether it was uncordoned, message, the store write to wait for or None).

        Raises:
            UnknownJobError, NotServingError: wrong job, or this coordinator cannot serve.
        """
        with self._lock:
            self._check_serving(job)
            st = self._policy.state
            # A plan waiting for a spare nobody has: the node may end the wait by taking its slot back, if its agent
            # heartbeats (a slot holder is not checked for a live lease at node level: a dead one would be placed).
            m = self._members.get(node_id)
            alive = m is not None and self._lease_live(m, self._clock())
            waiting = self._policy.waiting_for(node_id) and alive
            if st.plan is not None and node_id in st.plan.cordon and not waiting:
                later = ("its agent is not heartbeating: start it, then uncordon it again"
                         if self._policy.waiting_for(node_id) else "uncordon it once that generation runs")
                return False, (f"node {node_id} stays cordoned: generation {st.plan.generation} is replacing it now; "
                               f"{later}"), None
            held = self._daemons.held_reason(node_id) if m is None and node_id not in st.cordoned else ""
            if node_id not in st.cordoned and not waiting and not held:
                return False, f"node {node_id} is not cordoned in job {self.spec.job!r}", None
            row = self._daemons.table.get(node_id)
            if row is not None and row.report.verdict is Verdict.FATAL \
                    and not row.silent(self._clock(), 3 * self._interval_s()):
                # Its daemon latched the fault and still says so: uncordoned, the node would take a slot with its
                # daemon reporting FATAL, and that daemon's reports (never a new fault) could not cordon it again.
                return False, (f"node {node_id} stays cordoned: its node daemon still reports a fatal fault "
                               f"({row.fatal_reason or row.report.reason}); once the machine is repaired restart "
                               "the daemon (its healthy reports return the node), or stop it and uncordon again"), None
            if held:  # kept out on its daemon's report before it registered: nothing stored to rewrite
                self._daemons.release(node_id)
                self._daemons.table.rearm(node_id)
                return True, (f"node {node_id} returned to service: its daemon's fatal report ({held}), held until "
                              "it registers, is dropped"), None
            step = self._apply(OperatorUncordon(node_id, " ".join(reason.split())[:200]), persist=False)
            if not step.changed:
                return False, f"node {node_id} stays cordoned: {st.message}", None
            self._daemons.table.rearm(node_id)  # a fatal report of its daemon from now on is a new fault
            m = self._members.get(node_id)
            if m is not None and m.refused:
                m.refused = ""
                self._submit([Put(self._prefix + "nodes/" + node_id, node_value(m.info, m.lease_id, m.instance, ""))])
            message = step.state.message
            self._mver += 1  # a vacancy waiting for a spare is re-planned with this node
            self._save_state()
            self._advance()
            return True, message, self._state_fut

    def _may_uncordon(self, report: NodeHealthReport) -> bool:
        """Whether a daemon's report may return its cordoned node to service (lock held): the second HEALTHY report
        in a row of its daemon process, and the node neither refused by its pre-flight check nor holding a slot.

        The second, not the first: a daemon just restarted on a machine still broken may send its first report
        before its detectors sampled the fault; one report interval later they have."""
        nid = report.node_id
        m = self._members.get(nid)
        row = self._daemons.table.get(nid)
        return report.verdict is Verdict.HEALTHY and row is not None and row.healthy_streak >= 2 \
            and not (m is not None and m.refused) and (self._layout is None or self._layout.slot_of(nid) is None)

    def _fail_node_on_report(self, f: Failure, now: float) -> None:
        """Applies a daemon's fatal verdict as a node failure (lock held), and moves the job on."""
        m = self._members.get(f.node_id)
        if m is not None and not self._room_to_cordon(f.node_id):
            # Kept out as a node not registered is: its cordon is held (a record of its own), its membership goes,
            # and its agent's next registration is refused while the cordon list stays full.
            log.error("job %s: %s", self.spec.job, self._no_room(f.node_id, f.detail))
            self._forget(m)
            self._daemons.hold(f.node_id)
            self._advance()
            return
        self._fail(f, now)
        self._mver += 1  # the forming layout must drop the node even when the policy state looks unchanged
        self._save_state()
        self._advance()

    def silent_daemons(self) -> list[str]:
        """Nodes whose daemon reported before but not for 3 report intervals (shown only, never cordoned)."""
        return self._daemons.silent(self._clock(), 3 * self._interval_s())

    def report_interval_s(self) -> float:
        """How often node daemons should report: the heartbeat interval told to nodes now."""
        return self._interval_s()

    def _excluded(self, node_id: str) -> bool:
        """Whether the node is cordoned, or about to be by the pending plan (called with the lock held)."""
        st = self._policy.state
        return node_id in st.cordoned or (st.plan is not None and node_id in st.plan.cordon)

    def cordon_reason(self, node_id: str) -> str:
        """Why a node was cordoned when its daemon said so ("" otherwise: the policy's message tells)."""
        return self._daemons.cordon_reason(node_id)

    def held_cordons(self) -> list[str]:
        """Nodes kept out on their daemon's fatal report before they registered (in records of their own, not the job
        state's cordon list, until they register): the scheduler's cordon hooks mark them too."""
        with self._lock:
            if self._policy.state.phase in (Phase.SUCCEEDED, Phase.FAILED):
                return []
            return [n for n in self._daemons.held() if n not in self._members and not self._excluded(n)]

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


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f

"""Membership and leases: who registered, who is alive, and who is forgotten.

Part of :class:`~trainguard.recovery.coordinator.JobCoordinator`: a mixin, whose state the coordinator's ``__init__``
sets up; its methods with a leading underscore run with the coordinator's lock held. A registration admits a node
(the rules are :mod:`~trainguard.recovery.membership`'s) within the node id bound; a lease lives while heartbeats
arrive within ``lease_timeout_s`` (stretched to three heartbeat intervals); a node that goes silent, or leaves, is
lost: a node-level failure when it holds a slot of the running job.
The reaper's fence read (:meth:`Leases._probe_fence`, :meth:`Leases._fence_read`) is the exception: it runs
without the lock, as the fence check always did (a store read must never be made under it); the flags it sets
are single assignments the lock holders only read.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import Future

from trainguard.recovery.domain import NodeRecord
from trainguard.recovery.durability import DURABLE_WAIT_S
from trainguard.recovery.errors import CapacityError, StaleLeaseError, UnknownNodeError
from trainguard.recovery.job_records import LOST_RECORD_PREFIX, node_value
from trainguard.recovery.membership import Member, check_slot_claim, superseded_instances
from trainguard.recovery.policy import Cause, Failure, Phase
from trainguard.recovery.qualification import Qualification
from trainguard.recovery.spec import MIN_NODE_ID_LIMIT
from trainguard.recovery.store import Put

log = logging.getLogger("trainguard.recovery.coordinator")  # the coordinator's log lines, unchanged by the split

#: Longest reap() waits for its fence read before going on with the last result known (seconds): a store that
#: answers does so well within it, so a fenced-off coordinator still stops in the same reap as before.
FENCE_WAIT_S = 0.2
#: A fence read unanswered for this long is a stalled store: said at WARNING, then every STORE_STALL_REPEAT_S.
STORE_STALL_WARN_S = 2.0
STORE_STALL_REPEAT_S = 30.0


class Leases:
    """Membership and leases, for :class:`~trainguard.recovery.coordinator.JobCoordinator` (see the module)."""

    def _auth(self, node_id: str, lease_id: str) -> Member:
        m = self._members.get(node_id)
        if m is None:
            raise UnknownNodeError(f"node {node_id!r} is not registered with job {self.spec.job!r}: register first")
        if m.lease_id != lease_id:
            raise StaleLeaseError(f"lease {lease_id[:8]!r}.. of node {node_id!r} is stale (a newer registration "
                                  "holds the node): register again")
        return m

    def _lease_live(self, m: Member, now: float) -> bool:
        return m.alive and self._silent_s(m, now) <= self._lease_s()

    def _interval_s(self) -> float:
        """Heartbeat interval told to nodes: the configured one, stretched to keep under max_heartbeat_rate."""
        return max(self.spec.heartbeat_interval_s, len(self._members) / self.spec.max_heartbeat_rate)

    def _lease_s(self) -> float:
        """Silence after which a node is lost: the configured lease, at least 3 current intervals."""
        return max(self.spec.lease_timeout_s, 3 * self._interval_s())

    def _alive(self, node_id: str) -> bool:
        """Whether ``node_id`` is a member whose lease has not been found expired (lock held)."""
        return (m := self._members.get(node_id)) is not None and m.alive

    def _candidates(self, now: float) -> list[Member]:
        """Alive members holding no slot and not cordoned: spares and standby nodes."""
        cordoned = set(self._policy.state.cordoned)
        lay = self._layout
        return [m for m in self._members.values()
                if self._lease_live(m, now) and m.info.node_id not in cordoned
                and (lay is None or lay.slot_of(m.info.node_id) is None)]

    def register(self, job: str, info: NodeRecord, free_port: int,
                 instance: str = "", qualification: Qualification | None = None,
                 hold_s: float = DURABLE_WAIT_S) -> tuple[str, int, Future]:
        """Adds or re-adds a node.

        Args:
            job: job name from the request.
            info: the node's identity and topology (validated for format by the service).
            free_port: a port free on the node now.
            instance: the agent process's random id ("" when unknown).
            qualification: the node's pre-flight verdict (None: it did not qualify). A failed one cordons the node
                (see :mod:`~trainguard.recovery.qualification`); :meth:`refusal` then says why.
            hold_s: the longest the caller waits for the record's store write (the node is not silent meanwhile:
                it cannot heartbeat before it has its lease).

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
                if fut is not None:
                    self._hold(prev, fut, now, hold_s)
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
            if nid in st.cordoned and not refused and not held:
                # Only the node's own log said it was kept out: the coordinator's said nothing of it coming back.
                log.info("job %s: node %s registered again and stays cordoned (%s); `trainguard uncordon %s "
                         "--coordinator <this coordinator> --job %s` returns it to service once the machine is "
                         "repaired", job, nid, st.cordon_why.get(nid) or "cordoned", nid, job)
            self._hold(m, fut, now, hold_s)
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
        self._refused_at_registration.discard(nid)
        self._running.discard(nid)
        self._succeeded.discard(nid)
        self._memory.forget(nid)
        self._mver += 1
        self._submit([Put(self._prefix + "nodes/" + nid, None)])

    # The fence read in flight (see _probe_fence), when it started, and when a stalled store was last said to be.
    _fence_probe: threading.Thread | None = None
    _fence_probe_since = 0.0
    _store_stall_said = 0.0

    def reap(self) -> None:
        """Expires silent nodes' leases (a node-level failure for slot holders) and runs due recoveries; every
        second or so, checks that this coordinator still holds the job's fence and, when the store answers, writes
        again what it failed to take.

        The fence read waits at most :data:`FENCE_WAIT_S`: with a store that accepts but does not answer it held
        the reaper for the client's timeout (~20 s), and a dead node was declared lost only once the store answered
        again, without a word meanwhile. Expiring a lease on the last fence result known is safe: what a fenced-off
        coordinator must not do is made durable, and the store refuses its fenced writes (a START waits for the
        generation's write)."""
        now = self._clock()
        checked = self._probe_fence(now)
        with self._lock:
            if self.fenced:
                return
            if checked and not self._fence_unread:  # the store answers: writes it failed are made again
                self._rewrite_lost()
            for m in list(self._members.values()):
                if m.alive and self._silent_s(m, now) > self._lease_s():
                    self._lose(m, now, f"no heartbeat for {now - m.last_seen:.1f} s")
            if self._unrecorded and now - self._unrecorded_since > self._lease_s():
                self._lose_unrecorded(now)
            self._advance()

    def _silent_s(self, m: Member, now: float) -> float:
        """How long a member has not been heard from, not counting time its heartbeat was held by the service.

        A heartbeat whose answer depends on a store write (a START, the job's outcome) is answered once the write
        is durable, up to its caller's deadline. With lease expiry no longer frozen while the store hangs, such
        held nodes went silent for the deadline (5 s, past a 4 s lease) and were lost too: a second restart for
        one fault, or a "lost" line per node at a job's end. So a node is silent only from the end of its hold
        (the write's end, or the caller's deadline, whichever came first).
        """
        return now - max(m.last_seen, min(m.held_until, now))

    def _hold(self, m: Member, fut: Future, now: float, hold_s: float) -> None:
        """Notes that the service holds ``m``'s heartbeat for ``fut`` up to ``hold_s`` (lock held)."""
        m.held_until = now + hold_s

        def ended(_f: Future) -> None:  # on the committer's thread (or here, when it ended already)
            m.held_until = min(m.held_until, self._clock())
        fut.add_done_callback(ended)

    def _probe_fence(self, now: float) -> bool:
        """Reads the fence key on a thread of its own every second or so, waiting up to
        :data:`FENCE_WAIT_S` for it, and says at WARNING when the store has not answered it for
        :data:`STORE_STALL_WARN_S`.

        Returns:
            Whether a fence read finished since the last call (``_fence_unread`` tells whether it read the store).
        """
        probe = self._fence_probe
        if probe is None and not self.fenced and now - self._fence_checked >= 1.0:
            self._fence_checked = self._fence_probe_since = now
            probe = self._fence_probe = threading.Thread(target=self._fence_read, name="coordinator-fence-read",
                                                         daemon=True)
            probe.start()
            probe.join(FENCE_WAIT_S)  # one already stalled is not waited for again: the reaper keeps its period
        if probe is None:
            return False
        if not probe.is_alive():
            self._fence_probe = None
            if not self._fence_unread:  # it answered: a later stall is said at once (a read that timed out is
                self._store_stall_said = 0.0  # the same stall, said every STORE_STALL_REPEAT_S)
            return True
        silent = now - self._fence_probe_since
        if silent >= STORE_STALL_WARN_S and now - self._store_stall_said >= STORE_STALL_REPEAT_S:
            self._store_stall_said = now
            # Known away: a caller whose write the store failed is answered at once, not after another attempt's
            # timeout, and the fence read that succeeds says "answers again".
            self._fence_unread = True
            log.warning("job %s: store %s has not answered for %.1f s (a read of its fence key is pending); leases "
                        "still expire on time, and durable changes (a new generation, a registration) wait until it "
                        "answers", self.spec.job, self.spec.store, silent)
        return False

    def _fence_read(self) -> None:
        """The fence read of :meth:`_probe_fence`, on its own thread: an error is logged, as the reaper does."""
        try:
            self._check_fence()
        except Exception as exc:  # noqa: BLE001 - a thread's exception would go to stderr as a traceback
            log.error("job %s: fence check: %s", self.spec.job, exc)

    def _lose_unrecorded(self, now: float) -> None:
        """Fails, as lost nodes, the slot holders the stored layout named without a node record that have not
        registered since this coordinator started (lock held; see ``_unrecorded`` and ``_load``).

        Why: the state can name a holder whose record's write the store lost (and whose digest no record then
        resolves, ``?lost-record-...``); never a member, it was never lost either, and the job ran on without it.
        """
        gone, self._unrecorded = sorted(self._unrecorded), set()
        for nid in gone:
            st = self._policy.state  # fresh: each decision replaces the state
            if nid in self._members or self._layout is None or self._layout.slot_of(nid) is None \
                    or st.phase not in (Phase.RUNNING, Phase.RECOVERING):
                continue
            why = "no node record in the store and no registration since the coordinator started"
            if nid.startswith(LOST_RECORD_PREFIX):  # it stays on the cordon list: say how to clear it (quoted: '?')
                why += f"; once replaced, clear it with: trainguard uncordon '{nid}'"
            log.warning("job %s: node %s lost (%s)", self.spec.job, nid, why)
            self._fail(Failure(nid, st.generation, Cause.NODE_LOST, detail=why, time_s=self._wall()), now)

    def _lose(self, m: Member, now: float, why: str, left: bool = False) -> Future:
        """Ends a member's liveness (lock held): a node-level failure when it holds a slot of the running job.

        The node's record says it was lost (durably, before the failure's state write: the committer keeps their
        order), so that a coordinator restarted meanwhile neither places it in a slot again nor charges its loss
        twice (see :meth:`~.durability.Durability._keep_lost`).

        Args:
            left: the node said it leaves (``LeaveNode``) rather than going silent.

        Returns:
            The write of the node's record.
        """
        m.alive = False
        self._joined -= not m.info.spare
        self._mver += 1
        fut = self._submit([Put(self._prefix + "nodes/" + m.info.node_id, self._member_value(m))])
        holds = self._layout is not None and self._layout.slot_of(m.info.node_id) is not None
        st = self._policy.state  # fresh: each decision replaces the state
        if left and m.info.spare and not holds:
            # A spare stopped on purpose (its launcher got SIGTERM) is no loss: logged as one at WARNING it read as
            # a worker node lost, and operators looked for a recovery that never was.
            log.info("job %s: spare node %s left (%s); it held no slot", self.spec.job, m.info.node_id, why)
        elif left and st.phase in (Phase.SUCCEEDED, Phase.FAILED):
            # Every node of an ended job leaves (its agent is done): a WARNING per node at every job's end read as
            # a failure to anyone alerting on them.
            log.info("job %s: node %s left the %s job (%s)", self.spec.job, m.info.node_id, st.phase.name.lower(),
                     why)
        else:
            log.warning("job %s: node %s lost (%s)", self.spec.job, m.info.node_id, why)
        if holds and st.phase in (Phase.RUNNING, Phase.RECOVERING):
            self._fail(Failure(m.info.node_id, st.generation, Cause.NODE_LOST, detail=why, time_s=self._wall()), now)
        return fut

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
            if m.alive:  # the record is written with the new lease, marked lost
                fut = self._lose(m, now, f"it left: {' '.join(reason.split())[:200] or 'no reason given'}", left=True)
            else:
                fut = self._submit([Put(self._prefix + "nodes/" + node_id, self._member_value(m))])
            self._advance()
            return f"node {node_id} left job {self.spec.job!r}", fut


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f

"""The coordinator's durability: its records read back from the store at a start, and written at each change.

Part of :class:`~trainguard.recovery.coordinator.JobCoordinator`: a mixin, whose state the coordinator's ``__init__``
sets up; its methods with a leading underscore run with the coordinator's lock held. What each store key holds,
and when a call waits for its write, is told in :mod:`~trainguard.recovery.coordinator`. Here: reading the records
back (:meth:`Durability._load`), queueing writes through the write ledger and the group committer, writing again
what the store failed to take, waiting for a write to be durable, and reading the fence that says whether this
coordinator still owns the job.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future

from trainguard.recovery.errors import FencedError, NotServingError, StoreError
from trainguard.recovery.job_records import (STATE_WARN_BYTES, checkpoint_value, decode_checkpoint, decode_held,
                                             decode_node, decode_state, node_value, state_value)
from trainguard.recovery.membership import Member
from trainguard.recovery.policy import Phase
from trainguard.recovery.store import Put
from trainguard.recovery.write_ledger import lost

log = logging.getLogger("trainguard.recovery.coordinator")  # the coordinator's log lines, unchanged by the split

#: Longest a call waits for its write to become durable, seconds.
DURABLE_WAIT_S = 30.0

#: How to run an ended job again. Checkpoints are kept under the job's name, so "another --job" (said before)
#: started training from step 0; a new store with the same --job resumes from the newest checkpoint.
RERUN_HINT = ("to run it again from its newest checkpoint, start the coordinator with the same --job and another "
              "--store (another --job starts from scratch: checkpoints are kept under the job's name)")


class Durability:
    """The store side of :class:`~trainguard.recovery.coordinator.JobCoordinator` (see the module)."""

    def _load(self) -> None:
        now = self._clock()
        recs = self._raw_store.scan(self._prefix)
        held = self._prefix + "held/"
        lost_ids: set[str] = set()
        for key, rec in recs.items():
            if key.startswith(self._prefix + "nodes/"):
                n = decode_node(key, rec.value)
                self._members[n.info.node_id] = Member(n.info, n.lease, n.instance, now, refused=n.refused)
                self._joined += not n.info.spare
                if n.lost:
                    lost_ids.add(n.info.node_id)
            elif key.startswith(held):
                self._daemons.restore(decode_held(key, key[len(held):], rec.value), now)
        state = recs.get(self._prefix + "state")
        if state is not None:
            d = decode_state(self.spec.job, state.value, self._members)  # the layout names them by digest
            self._policy.state, self._layout, self._master_port, self._used_ports = \
                d.policy, d.layout, d.master_port, d.used_ports
        ck = recs.get(self._prefix + "checkpoint")
        if ck is not None:
            self._committed_step = decode_checkpoint(self._prefix + "checkpoint", ck.value)
        self._keep_lost(lost_ids)
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
                log.warning("%s: %s; every node that registers is told it is over; %s", self._ended_note, st.message,
                            RERUN_HINT)
        lay = self._layout
        if lay is not None and (not self.spec.nnodes <= len(lay.slots) <= self._max_nodes()
                                or lay.group_size != self.spec.group_size):
            # The stored layout wins so that a coordinator restart keeps every rank where it was; a changed flag
            # used to be ignored without a word.
            log.warning("job %s: the stored rank layout has %d node(s) with group size %d, this coordinator was "
                        "started with --nnodes %d --group-size %d; the job keeps the stored layout (the job "
                        "shrank, or the flags changed). To lay the job out afresh, use a new --job name or --store",
                        self.spec.job, len(lay.slots), lay.group_size, self.spec.nnodes, self.spec.group_size)
        held_out = len(self._policy.state.cordoned)
        if held_out > self.spec.cordon_limit() and self._policy.state.phase not in (Phase.SUCCEEDED, Phase.FAILED):
            # Started again with a lower --max-cordoned: the cordons stand, but every node to be kept out from now
            # on is refused membership instead, which otherwise surprised the operator at the next bad node.
            log.warning("job %s: the stored cordon list holds %d node(s), more than --max-cordoned %d: they stay "
                        "cordoned, and a node to be kept out is refused membership until repaired ones are returned "
                        "(`trainguard uncordon NODE`) below the bound", self.spec.job, held_out,
                        self.spec.cordon_limit())
        if lay is not None and self._policy.state.phase in (Phase.RUNNING, Phase.RECOVERING):
            self._unrecorded = {s.node_id for s in lay.slots if s.node_id not in self._members}
            if self._unrecorded:
                log.warning("job %s: %d slot holder(s) of the stored rank layout have no node record in the store "
                            "(a write lost to a store outage): %s; each is lost unless it registers within %.0f s",
                            self.spec.job, len(self._unrecorded), ", ".join(sorted(self._unrecorded)[:5]),
                            self._lease_s())
        self._rebuild_table()
        if self._policy.state.phase not in (Phase.SUCCEEDED, Phase.FAILED):
            for nid in self._daemons.held():
                if nid in self._members and self._excluded(nid):
                    # Its cordon is in the job state already (the coordinator stopped before the held record's
                    # deletion): left, the record outlived an operator's uncordon and cordoned the node again at the
                    # next start.
                    self._daemons.release(nid)
                elif nid in self._members:
                    # Registered, but the coordinator stopped before the cordon its registration applied was stored
                    # (the node's record came first): its agent's retried registration keeps its lease and is not
                    # a registration again, so the cordon is applied now.
                    self._cordon_held(nid, now)

    def _keep_lost(self, lost_ids: set[str]) -> None:
        """Leaves lost, after a restart, the members whose records say they were lost, where the stored state
        accounts for the loss (lock held; called by :meth:`_load`).

        Every member used to come back alive with a fresh lease. A node lost while its recovery waited for a spare
        then looked alive again: the waiting plan formed the next generation with it at once (in its old slot),
        and its second expiry charged the restart budget a second time for one fault (with ``--max-restarts 1``
        the job failed though the spare it waited for came). A lost spare came back as a candidate replacement
        the same way. A loss the state does not account for (the node still holds a slot of a running
        generation, and no plan names it: the failure's state write did not land before the stop) keeps the
        fresh lease, so that the loss is found again, and handled, once the lease expires.
        """
        st = self._policy.state
        lay = self._layout
        ended = st.phase in (Phase.SUCCEEDED, Phase.FAILED)
        handled = {*st.plan.failed_nodes, *st.plan.cordon} if st.plan is not None else set()
        for nid in sorted(lost_ids):
            m = self._members[nid]
            if ended or lay is None or lay.slot_of(nid) is None or nid in handled or nid in st.cordoned:
                m.alive = False
                self._joined -= not m.info.spare
            else:  # its record no longer says lost: a later restart would otherwise keep it out of every plan
                self._submit([Put(self._prefix + "nodes/" + nid, self._member_value(m))])

    def _member_value(self, m: Member) -> bytes:
        """A member's node record as it stands (lost or not)."""
        return node_value(m.info, m.lease_id, m.instance, m.refused, lost=not m.alive)

    def _persist_held(self, node_id: str, value: bytes | None) -> None:
        """Stores (or deletes, ``value`` None) a held cordon's record (lock held; see :mod:`.daemon_reports`)."""
        self._held_fut = self._submit([Put(self._prefix + "held/" + node_id, value)])

    def _save_state(self) -> Future:
        """Queues a snapshot of the job state; callers needing durability wait on the future (lock released)."""
        value = state_value(self._policy.state, self._layout, self.spec.group_size, self._master_port,
                            self._used_ports, self._record_stored)
        if len(value) > STATE_WARN_BYTES and self._clock() >= self._big_state_logged + 60.0:  # once a minute
            self._big_state_logged = self._clock()
            st = self._policy.state
            log.error("job %s: the job state record is %d bytes (%d cordoned node(s), %d slot(s)); etcd refuses "
                      "requests over its --max-request-bytes (1.5 MiB by default), and every recovery then fails "
                      "to be stored: return repaired nodes to service (`trainguard uncordon NODE`), lower the "
                      "coordinator's --max-cordoned, shorten node ids and addresses, or raise etcd's "
                      "--max-request-bytes", self.spec.job, len(value), len(st.cordoned),
                      len(self._layout.slots) if self._layout else 0)
        fut = self._submit([Put(self._prefix + "state", value)])
        self._state_fut = fut
        return fut

    def _record_stored(self, node_id: str) -> bool:
        """Whether a member's node record is in the store by the time the state written now is, so that the job
        state's rank layout may name the node by a digest of its id (lock held; see
        :func:`~.job_records.layout_doc`).

        A write still pending counts: the group committer commits it before (or with) the state written now. At
        a 12,500-node formation a third of the records were still pending, and storing those ids in full made the
        formation's state record 0.5 MB, up to the old 1.45 MB when the store is slow. A record whose last write
        failed is stored in full (it is written again before the state, but a stop in between would leave the
        digest unresolved: see :meth:`~.leases.Leases._lose_unrecorded` for what then happens)."""
        return node_id in self._members and not lost(self._writes.last(self._prefix + "nodes/" + node_id))

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
            puts.append(Put(k, self._member_value(m) if m is not None else None))
        puts += [Put(k, self._daemons.stored_value(k[len(held):])) for k in sorted(keys) if k.startswith(held)]
        if ckpt_key in keys:
            puts.append(Put(ckpt_key, checkpoint_value(self._committed_step)))
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
        wait_s = max(0.0, min(timeout_s, DURABLE_WAIT_S))
        try:
            fut.result(timeout=wait_s)
        except FencedError as exc:
            raise NotServingError(f"{exc}; reconnect to the coordinator that owns the job") from exc
        except (StoreError, TimeoutError) as exc:
            # A timeout has no text of its own: the line read "could not be made durable (); retry shortly".
            why = str(exc) or f"the store did not take the write within {wait_s:.1f} s"
            raise NotServingError(f"{what} could not be made durable ({why}); retry shortly") from exc

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

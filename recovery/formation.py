"""Forming generations: the first one's wait for nodes, a recovery plan's placement, and moving the job on.

Part of :class:`~trainguard.recovery.coordinator.JobCoordinator`: a mixin, whose state the coordinator's ``__init__``
sets up; every method runs with the coordinator's lock held. The first generation waits as torchrun's rendezvous
does (``--nnodes MIN``, up to ``--max-nodes`` within the last call) and is laid out by
:func:`~trainguard.recovery.ranks.assign_ranks`; a pending plan's vacancies are placed on the membership by
:mod:`~trainguard.recovery.planner`. Either layout is cached per membership version, so that the heartbeats of a
large job forming cost no sort each. :meth:`Formation._advance` is called after every change.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import replace

from trainguard.recovery.decide import (AllSucceeded, FormingChecked, GenerationFormed, GenerationRunning,
                                        MembershipChanged, Tick)
from trainguard.recovery.errors import MembershipError
from trainguard.recovery.planner import place
from trainguard.recovery.policy import Level, Phase
from trainguard.recovery.ranks import RankLayout, assign_ranks

log = logging.getLogger("trainguard.recovery.coordinator")  # the coordinator's log lines, unchanged by the split

#: Nodes a "waiting for nodes" message names at most (the rest are counted).
_NAMED = 8


class Formation:
    """Generations forming, for :class:`~trainguard.recovery.coordinator.JobCoordinator` (see the module)."""

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
            # Cordoned live nodes never get a slot (_first_layout leaves them out), yet they were counted: agents
            # read "2 of 3 registered" and a forming_missing of 1 while two nodes were missing. The cordon list is
            # bounded (spec.cordon_limit), so this stays cheap per registration.
            cordoned = set(st.cordoned)
            joined = self._joined - sum(1 for n in cordoned if (m := self._members.get(n)) is not None
                                        and m.alive and not m.info.spare)
            if joined >= self.spec.nnodes:
                self._try_form(now)
            else:
                # _first_layout says why once enough registered (it sorts every member, so it is skipped before,
                # or each registration of a large job would sort them all); until then the nodes that did
                # register waited with an empty message, and their logs said nothing for as long as they waited.
                # Names come from the first few members (insertion order), so a large job's formation stays linear.
                named = [n for n, m in itertools.islice(self._members.items(), 4 * _NAMED)
                         if self._lease_live(m, now) and not m.info.spare and n not in cordoned][:_NAMED]
                # A spare, a cordoned node, or a node that left or went silent, is not counted.
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

    def _quiet_holder(self, now: float) -> bool:
        """Whether a plan should wait: a slot holder it keeps missed two heartbeats but its lease runs on.

        When a node dies, its peers' collectives break at once and they report a process-level failure before
        the dead node's lease expires. Restarting in place then would wait on the dead node, and its expiry would
        cost a second restart; waiting (at most until the lease expires, or until every holder's first heartbeat
        after the plan) lets the expiry merge into this plan as one node-level restart. The same holds for a
        node-level plan: of two nodes killed together, the first lease to expire made a plan replacing only that
        node, formed at once with the other (silent for seconds already) in its slot, and the second expiry cost
        a second restart (with ``--max-restarts 1`` the job failed with a spare idle). Nodes the plan replaces or
        cordons are not waited for; the spares it puts in their slots are.
        """
        st = self._policy.state
        plan = st.plan
        if plan is None or self._layout is None:
            return False
        if self._plan_since[0] != plan.generation:  # a plan restored from the store: timed from now
            self._plan_since = (plan.generation, now)
        since = self._plan_since[1]
        quiet = 2.0 * self._interval_s()
        leaving = set() if plan.level is Level.PROCESS else {*plan.failed_nodes, *plan.cordon, *st.cordoned}
        for slot in self._layout.slots:
            if slot.node_id in leaving:
                continue
            m = self._members.get(slot.node_id)
            # Silence alone misses a peer that died a heartbeat ago: its peers' sockets reset at once, faster
            # than two intervals. A holder must also have been heard since the plan was made; a live one is,
            # within one interval, and it needs that heartbeat anyway to learn of the restart.
            if m is not None and m.alive and (now - m.last_seen > quiet or m.last_seen < since):
                return True
        # The same for the spares the plan puts in the vacated slots: a spare killed seconds after the node it
        # replaces still had a live lease, and took the slot at once; its own expiry then cost a second restart
        # (escalated to job level with no spare left) while another, live spare could have had the slot. Waited
        # for, its expiry re-plans with the spares that answer.
        for node in plan.replacements.values():
            m = self._members.get(node)
            if m is not None and m.alive and (now - m.last_seen > quiet or m.last_seen < since):
                return True
        return False

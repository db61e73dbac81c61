"""Stateful property tests of the coordinator (hypothesis ``RuleBasedStateMachine``), in process, with a
simulated clock: random registrations of spares, node deaths and returns (with the old lease or afresh, also
while the dead node's replacement is being chosen), agent restarts, lease expiries, fault reports
(single and in bursts, process- and node-level), coordinator restarts on the same store, and group sizes.

The real :class:`~trainguard.recovery.coordinator.JobCoordinator` runs on a real in-memory store; the nodes are
simulated agents that follow its commands. Invariants:

- ranks of surviving nodes never move from one generation to the next;
- at most one restart per fault burst (reports about one generation before the next forms);
- the budget is counted once: ``restart_count`` equals the generations started after the first, plus one for
  the plan being prepared, across coordinator restarts, and never exceeds ``max_restarts``;
- liveness: whenever each pod has as many healthy (alive, uncordoned) nodes as the layout has slots there,
  a pending recovery forms its generation within a bounded number of heartbeat rounds.
"""

from __future__ import annotations

import itertools

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from trainguard.recovery.coordinator import JobCoordinator, JobSpec
from trainguard.recovery.domain import Beat, Command, FaultReport, NodeRecord
from trainguard.recovery.errors import StaleLeaseError, UnknownNodeError
from trainguard.recovery.policy import Cause, Level, Phase
from trainguard.recovery.store import MemoryStore

JOB = "prop"
INTERVAL = 0.5
LEASE = 3.0
#: Heartbeat rounds (INTERVAL apart) within which a recovery must form once capacity is there: a lease expiry
#: (6 rounds), the longest backoff (2 rounds), the START round, with slack.
SETTLE_ROUNDS = 16
MAX_NODES = 10


class Clock:
    """The simulated clock, for both the coordinator's monotonic and wall time."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class SimNode:
    """A simulated agent: registers, heartbeats, follows START/RESTART/STOP, reports faults."""

    _ports = itertools.count(20000)

    def __init__(self, nid: str, pod: str, idx: int, spare: bool) -> None:
        self.info = NodeRecord(nid, pod, idx, nid, 2, f"10.0.0.{idx}", spare=spare)
        self.alive = True
        self.gen = -1
        self.lease = ""
        self.instance = 0

    def register(self, core: JobCoordinator) -> None:
        self.instance += 1
        self.lease, _, _ = core.register(JOB, self.info, next(self._ports), f"{self.info.node_id}-{self.instance}")
        self.gen = -1

    def beat(self, core: JobCoordinator) -> None:
        try:
            self._beat(core)
        except (StaleLeaseError, UnknownNodeError):  # what a real agent does: register again, then beat
            self.register(core)
            self._beat(core)

    def _beat(self, core: JobCoordinator) -> None:
        reply = core.heartbeat(Beat(JOB, self.info.node_id, self.lease, self.gen, 2 if self.gen > 0 else 0,
                                    free_port=next(self._ports)))
        cmd = reply.response.command
        if cmd in (Command.START, Command.RESTART):
            self.gen = reply.response.table.generation
        elif cmd is Command.STOP:
            self.gen = -1

    def report(self, core: JobCoordinator, node_level: bool) -> None:
        core.report(FaultReport(JOB, self.info.node_id, self.lease, self.gen,
                                Cause.NODE_CRITICAL if node_level else Cause.WORKER_EXIT,
                                Level.NODE if node_level else Level.PROCESS, rank=0, exit_code=-9, detail="fault"))


class CoordinatorMachine(RuleBasedStateMachine):
    """Random histories against one job's coordinator."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.store = MemoryStore()
        self.nodes: dict[str, SimNode] = {}
        self.core: JobCoordinator | None = None
        self.spec: JobSpec | None = None
        self.seen: dict[int, dict[str, tuple[int, int]]] = {}  # generation -> node -> (group rank, first rank)
        self.ids = itertools.count()

    # ---------------------------------------------------------------------------------------------- helpers
    def _open(self) -> None:
        assert self.spec is not None
        self.core = JobCoordinator(self.spec, store=self.store, clock=self.clock, wall=self.clock)

    def _add(self, pod: str, spare: bool) -> SimNode:
        n = next(self.ids)
        node = SimNode(f"{pod}-n{n}", pod, n, spare)
        self.nodes[node.info.node_id] = node
        node.register(self.core)
        return node

    def _round(self) -> None:
        self.clock.t += INTERVAL
        for node in self.nodes.values():
            if node.alive:
                node.beat(self.core)
        self.core.reap()
        self._record_layout()

    def _record_layout(self) -> None:
        lay, st_ = self.core.layout, self.core.state
        if lay is not None and st_.generation not in self.seen:
            self.seen[st_.generation] = {s.node_id: (s.group_rank, s.first_rank) for s in lay.slots}

    def _capacity_suffices(self) -> bool:
        st_, lay = self.core.state, self.core.layout
        if lay is None:
            return False
        gone = set(st_.cordoned) | set(st_.plan.cordon if st_.plan else ())
        need: dict[str, int] = {}
        for s in lay.slots:
            need[s.pod_id] = need.get(s.pod_id, 0) + 1
        have: dict[str, int] = {}
        for n in self.nodes.values():
            if n.alive and n.info.node_id not in gone:
                have[n.info.pod_id] = have.get(n.info.pod_id, 0) + 1
        return all(have.get(p, 0) >= k for p, k in need.items())

    def _holders(self) -> list[SimNode]:
        lay = self.core.layout
        return [self.nodes[s.node_id] for s in lay.slots if s.node_id in self.nodes] if lay else []

    # ------------------------------------------------------------------------------------------------ rules
    @initialize(group_size=st.sampled_from([1, 2, 4]), max_restarts=st.integers(1, 6), spares=st.integers(0, 2))
    def start(self, group_size: int, max_restarts: int, spares: int) -> None:
        self.spec = JobSpec(job=JOB, nnodes=4, max_restarts=max_restarts, heartbeat_interval_s=INTERVAL,
                            group_size=group_size, lease_timeout_s=LEASE, backoff_initial_s=0.5, backoff_max_s=1.0,
                            membership_timeout_s=1e6)
        self._open()
        for pod in ("p0", "p0", "p1", "p1"):
            self._add(pod, spare=False)
        for i in range(spares):
            self._add(("p0", "p1")[i % 2], spare=True)
        for _ in range(4):
            self._round()
        assert self.core.state.generation == 1 and self.core.state.phase is Phase.RUNNING

    @precondition(lambda self: len(self.nodes) < MAX_NODES)
    @rule(pod=st.sampled_from(["p0", "p1"]))
    def add_spare(self, pod: str) -> None:
        self._add(pod, spare=True)

    @rule(pick=st.integers(0, 99))
    def kill_node(self, pick: int) -> None:
        alive = [n for n in self.nodes.values() if n.alive]
        if alive:
            alive[pick % len(alive)].alive = False  # no more heartbeats: its lease will expire

    @rule(pick=st.integers(0, 99), fresh=st.booleans())
    def revive_node(self, pick: int, fresh: bool) -> None:
        """A dead node comes back while its replacement may be being chosen: its agent heartbeats again with
        its old lease (re-registering when the coordinator says it forgot it), or starts afresh."""
        dead = [n for n in self.nodes.values() if not n.alive]
        if dead:
            n = dead[pick % len(dead)]
            n.alive = True
            if fresh:
                n.register(self.core)

    @rule(pick=st.integers(0, 99))
    def restart_agent(self, pick: int) -> None:
        alive = [n for n in self.nodes.values() if n.alive]
        if alive:
            alive[pick % len(alive)].register(self.core)  # workers gone with the agent: a process-level fault

    @rule(picks=st.lists(st.integers(0, 99), min_size=1, max_size=4), node_level=st.lists(st.booleans(), min_size=4,
                                                                                       max_size=4))
    def fault_burst(self, picks: list[int], node_level: list[bool]) -> None:
        running = [n for n in self._holders() if n.alive and n.gen == self.core.state.generation]
        if not running:
            return
        before = self.core.state.restart_count
        for i, p in enumerate(picks):
            running[p % len(running)].report(self.core, node_level[i])
        assert self.core.state.restart_count - before <= 1, "one fault burst cost more than one restart"

    @rule(rounds=st.integers(1, 4))
    def heartbeats(self, rounds: int) -> None:
        for _ in range(rounds):
            self._round()

    @rule()
    def restart_coordinator(self) -> None:
        before = self.core.state.to_dict()
        layout = self.core.layout
        self.core.close()
        self._open()
        assert self.core.state.to_dict() == before  # budget, plan and cordon list survive the restart
        assert self.core.layout == layout

    @rule()
    def settle(self) -> None:
        """Heartbeat rounds with time passing: a pending recovery with enough capacity must form."""
        for _ in range(SETTLE_ROUNDS):
            self._round()
        st_ = self.core.state
        if st_.plan is not None and st_.phase is Phase.RECOVERING and self._capacity_suffices():
            raise AssertionError(f"recovery stalled with capacity available: {st_.plan} / {st_.message}")

    # ------------------------------------------------------------------------------------------- invariants
    @invariant()
    def surviving_ranks_never_move(self) -> None:
        if self.core is None:
            return
        self._record_layout()
        gens = sorted(self.seen)
        for a, b in zip(gens, gens[1:]):
            for node, slot in self.seen[a].items():
                if node in self.seen[b]:
                    assert self.seen[b][node] == slot, f"{node} moved from {slot} to {self.seen[b][node]}"

    @invariant()
    def budget_counted_once(self) -> None:
        if self.core is None:
            return
        st_ = self.core.state
        assert st_.restart_count <= self.spec.max_restarts
        if st_.phase in (Phase.RUNNING, Phase.RECOVERING):
            assert st_.restart_count == st_.generation - 1 + (st_.plan is not None), st_

    def teardown(self) -> None:
        if self.core is not None:
            self.core.close()


CoordinatorMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=25, deadline=None)
test_coordinator_state_machine = CoordinatorMachine.TestCase

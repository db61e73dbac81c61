"""The coordinator's core for one job: membership, generations and recovery, durable through a store.

This module knows nothing about gRPC: :mod:`trainguard.recovery.service` validates requests, calls these
methods and maps the :class:`~trainguard.recovery.errors.RequestError` they raise to status codes. It combines

- :mod:`~trainguard.recovery.ranks` (who gets which ranks),
- :mod:`~trainguard.recovery.policy` (which recovery level a failure gets, budget, backoff, de-duplication),
- :mod:`~trainguard.recovery.store` (compare-and-set with a fencing token) through a
  :class:`~trainguard.recovery.committer.GroupCommitter`.

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

import json
import math
import logging
import re
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from trainguard.proto import common_pb2, coordinator_pb2
from trainguard.recovery.committer import GroupCommitter
from trainguard.recovery.failslow import FailSlowSupervisor
from trainguard.recovery.errors import (DuplicateNodeError, FencedError, InvalidRequestError, MembershipError,
                                        NotServingError, PolicyError, SlotTakenError, StaleGenerationError,
                                        StaleLeaseError, StoreError, UnknownJobError, UnknownNodeError)
from trainguard.recovery.policy import Cause, Failure, Level, Phase, PolicyConfig, PolicyState, RecoveryPolicy
from trainguard.recovery.ranks import NodeSpec, RankLayout, assign_ranks, layout_from_mapping, layout_to_rows
from trainguard.recovery.store import FencedStore, Put, Store, acquire_fence, open_store
from trainguard.recovery.straggler import ReplaceDecision, StragglerConfig

log = logging.getLogger(__name__)

#: Job names: what fits in a store key and a log line.
JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$")

_CMD = coordinator_pb2


@dataclass
class JobSpec:
    """What the coordinator needs to know about the job before nodes arrive.

    The first four fields (and their defaults) are what ``trainguard run`` embeds; the rest tune a standalone
    coordinator (``trainguard coordinator``).

    Attributes:
        job: job name; requests for other jobs are refused.
        nnodes: nodes that must register before the first generation starts (>= 1).
        max_restarts: restarts allowed, counted job-wide by the coordinator (>= 0).
        heartbeat_interval_s: interval told to agents, seconds. Default 0.5.
        group_size: ranks per parallel group kept inside one pod (1: no constraint).
        allow_shrink: a lost node with no spare may be dropped from the job.
        min_nodes: fewest nodes a shrunk job may run on (0: ``nnodes``, i.e. never shrink below the start).
        lease_timeout_s: a node silent for this long is lost, seconds. Default 10.
        backoff_initial_s: wait before the 2nd consecutive restart without progress, seconds (doubles). Default 0.5.
        backoff_max_s: cap of that wait, seconds. Default 30.
        process_repeats_to_node: process-level failures of one node (within ``repeat_window_s``) that make the
            next node-level.
        node_repeats_to_job: node-level failures (within ``repeat_window_s``) that make the next one job-level.
        hold_unhealthy: see :class:`~trainguard.recovery.policy.PolicyConfig` (``trainguard run`` on one node
            turns it off: its only node is all the capacity there is). Default True.
        repeat_window_s: how far back those repeats count, seconds. Default 600 (drills with compressed time
            shrink it by their compression factor).
        full_table_max_nodes: up to this many nodes every START carries the whole rank table; above it, only
            the receiving node's entry (``RankTable.node_count`` tells the size). Default 1024.
        max_heartbeat_rate: heartbeats per second the coordinator invites at most: with more nodes than
            ``rate x heartbeat_interval_s`` it tells nodes a longer interval (nodes / rate) and stretches the
            lease to at least 3 such intervals, so a large job cannot overload it. Default 5000/s.
        store: state store URL (see :func:`~trainguard.recovery.store.open_store`). Default ``memory://``.
        failslow: straggler detection and replace policy (:mod:`~trainguard.recovery.straggler`).
    """

    job: str
    nnodes: int = 1
    max_restarts: int = 3
    heartbeat_interval_s: float = 0.5
    group_size: int = 1
    allow_shrink: bool = False
    min_nodes: int = 0
    lease_timeout_s: float = 10.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    process_repeats_to_node: int = 2
    node_repeats_to_job: int = 3
    repeat_window_s: float = 600.0
    hold_unhealthy: bool = True
    full_table_max_nodes: int = 1024
    max_heartbeat_rate: float = 5000.0
    store: str = "memory://"
    failslow: StragglerConfig = field(default_factory=StragglerConfig)

    def validate(self) -> None:
        """Checks every field.

        Raises:
            InvalidRequestError: a field is out of range; the message names it.
        """
        if not JOB_NAME_RE.match(self.job):
            raise InvalidRequestError(f"job name {self.job!r} is invalid: use 1-128 of [A-Za-z0-9._:@-], "
                                      "starting with a letter or digit")
        if self.nnodes < 1 or self.max_restarts < 0 or self.group_size < 1 or self.min_nodes < 0:
            raise InvalidRequestError("need nnodes >= 1, max_restarts >= 0, group_size >= 1, min_nodes >= 0")
        if not self.repeat_window_s > 0:
            raise InvalidRequestError(f"repeat window {self.repeat_window_s} s must be positive")
        if self.max_heartbeat_rate <= 0:
            raise InvalidRequestError(f"max heartbeat rate {self.max_heartbeat_rate}/s must be positive")
        if self.heartbeat_interval_s <= 0 or self.lease_timeout_s <= self.heartbeat_interval_s:
            raise InvalidRequestError(f"lease timeout {self.lease_timeout_s} s must exceed the heartbeat interval "
                                      f"{self.heartbeat_interval_s} s (> 0)")

    def policy_config(self) -> PolicyConfig:
        """The recovery policy's knobs derived from this spec."""
        return PolicyConfig(max_restarts=self.max_restarts, backoff_initial_s=self.backoff_initial_s,
                            backoff_max_s=max(self.backoff_max_s, self.backoff_initial_s),
                            process_repeats_to_node=self.process_repeats_to_node,
                            node_repeats_to_job=self.node_repeats_to_job, window_s=self.repeat_window_s,
                            hold_unhealthy=self.hold_unhealthy, allow_shrink=self.allow_shrink,
                            min_nodes=self.min_nodes or self.nnodes)


@dataclass
class Member:
    """A registered node as the coordinator tracks it."""

    info: common_pb2.NodeInfo
    lease_id: str
    instance: str
    last_seen: float
    alive: bool = True
    free_port: int = 0
    generation: int = -1
    workers_running: int = 0
    last_step: int = -1
    succeeded_generation: int = -1
    superseded: set[str] = field(default_factory=set)

    def spec(self, replaces: str = "") -> NodeSpec:
        """The node as rank assignment sees it."""
        t = self.info.topology
        return NodeSpec(self.info.node_id, t.pod_id, t.node_index, t.host, max(1, t.device_count),
                        self.info.address, replaces)


@dataclass(frozen=True)
class HeartbeatReply:
    """A heartbeat's answer, plus the store write the answer depends on (None when durable already)."""

    response: coordinator_pb2.NodeHeartbeatResponse
    durable: Future | None = None


def _encode(obj: object) -> bytes:
    return zlib.compress(json.dumps(obj, separators=(",", ":")).encode(), 3)


def _decode(raw: bytes) -> object:
    return json.loads(zlib.decompress(raw))


def classify(event: common_pb2.HealthEvent, proposed: int) -> Cause:
    """Maps a reported health event (and the proposed level) to a failure cause.

    Args:
        event: the event.
        proposed: the proto ``RecoveryLevel`` the reporter proposes.

    Returns:
        The cause the policy uses.
    """
    kind = event.kind.lower()
    if proposed == _CMD.RECOVERY_LEVEL_JOB or event.action == common_pb2.ACTION_RESTART_JOB:
        return Cause.JOB_REQUEST
    if proposed == _CMD.RECOVERY_LEVEL_NODE or event.action == common_pb2.ACTION_DRAIN_NODE:
        return Cause.NODE_CRITICAL
    if "hang" in kind or "stall" in kind:
        return Cause.WORKER_HANG
    if kind.startswith("process.") or proposed == _CMD.RECOVERY_LEVEL_PROCESS \
            or event.action == common_pb2.ACTION_RESTART_PROCESS:
        return Cause.WORKER_EXIT
    if event.severity >= common_pb2.SEVERITY_CRITICAL:
        return Cause.NODE_CRITICAL
    return Cause.ADVISORY


class JobCoordinator:
    """One job's coordinator state machine; thread-safe.

    Args:
        spec: the job.
        store: an opened store (tests); None opens ``spec.store``.
        clock: monotonic clock for leases, seconds (tests may inject one).
        wall: wall clock for the policy's persisted times (repeat windows, backoff deadlines), seconds.

    Raises:
        InvalidRequestError: the spec is invalid.
        StoreError: the store cannot be opened or read, or holds corrupt state.
    """

    def __init__(self, spec: JobSpec, store: Store | None = None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        spec.validate()
        self._wall = wall
        self.spec = spec
        self._clock = clock
        self._prefix = f"trainguard/jobs/{spec.job}/"
        raw = store if store is not None else open_store(spec.store)
        self._raw_store = raw
        self.fence = acquire_fence(raw, self._prefix + "fence")
        self._store = FencedStore(raw, self.fence)
        self._committer = GroupCommitter(self._store)
        self._lock = threading.RLock()
        self._members: dict[str, Member] = {}
        self._policy = RecoveryPolicy(spec.policy_config())
        self._layout: RankLayout | None = None
        self._master_port = 0
        self._used_ports: set[int] = set()
        self._committed_step = -1
        self._node_steps: dict[str, int] = {}
        self._form_note = ""
        self._full_table: common_pb2.RankTable | None = None
        self._state_fut: Future | None = None
        self._mver = 0  # bumped on every membership/liveness change: invalidates _layout_cache
        self._layout_cache: tuple[object, RankLayout | None] | None = None
        self._start_cache: dict[tuple[int, int, str, float], coordinator_pb2.NodeHeartbeatResponse] = {}
        self._running: set[str] = set()  # slot holders running the current generation
        self._succeeded: set[str] = set()  # slot holders whose workers of the current generation all exited 0
        self._ckpt_req: coordinator_pb2.CheckpointRequest | None = None  # job-wide checkpoint being relayed
        self._step_rate = 0.0  # steps/s of the current generation (EWMA over >= 1 s windows)
        self._rate_mark: tuple[float, int, int] | None = None  # (time, max step, generation) of the last sample
        self.fenced = ""
        self._failslow = FailSlowSupervisor(spec.failslow, wall=wall)  # fail-slow: see _failslow_* below
        self._load()

    # ------------------------------------------------------------------------------------------- persistence
    def _load(self) -> None:
        now = self._clock()
        recs = self._raw_store.scan(self._prefix)
        for key, rec in recs.items():
            if not key.startswith(self._prefix + "nodes/"):
                continue
            try:
                d = json.loads(rec.value)
                info = common_pb2.NodeInfo.FromString(bytes.fromhex(d["info"]))
                self._members[info.node_id] = Member(info, str(d["lease"]), str(d.get("instance", "")), now)
            except (ValueError, KeyError, TypeError) as exc:
                raise StoreError(f"node record {key!r} is corrupt ({exc}): delete it or use a fresh store") from exc
        state = recs.get(self._prefix + "state")
        if state is not None:
            try:
                d = _decode(state.value)
                self._policy.state = PolicyState.from_dict(d["policy"])  # type: ignore[index]
                rows = d["layout"]  # type: ignore[index]
                self._layout = layout_from_mapping(rows, int(d["group_size"])) if rows else None  # type: ignore
                self._master_port = int(d["master_port"])  # type: ignore[index]
                self._used_ports = {int(p) for p in d["used_ports"]}  # type: ignore[index]
            except (ValueError, KeyError, TypeError, zlib.error, PolicyError, MembershipError) as exc:
                raise StoreError(f"job state of {self.spec.job!r} is corrupt ({exc}): use a fresh store") from exc
        ck = recs.get(self._prefix + "checkpoint")
        if ck is not None:
            self._committed_step = int(json.loads(ck.value)["step"])
        if state is not None or self._members:
            st = self._policy.state
            log.info("job %s restored from store (fence epoch %d): %s, generation %d, %d restart(s), %d node(s)",
                     self.spec.job, self.fence.epoch, st.phase.name, st.generation, st.restart_count,
                     len(self._members))
        self._rebuild_table()

    def _save_state(self) -> Future:
        """Queues a snapshot of the job state; callers needing durability wait on the future (lock released)."""
        st = self._policy.state
        doc = {"policy": st.to_dict(), "layout": layout_to_rows(self._layout) if self._layout else None,
               "group_size": self._layout.group_size if self._layout else self.spec.group_size,
               "master_port": self._master_port, "used_ports": sorted(self._used_ports)}
        fut = self._submit([Put(self._prefix + "state", _encode(doc))])
        self._state_fut = fut
        return fut

    def _submit(self, puts: Sequence[Put]) -> Future:
        fut = self._committer.submit(puts)
        fut.add_done_callback(self._watch_commit)
        return fut

    def _watch_commit(self, fut: Future) -> None:
        exc = fut.exception()
        if isinstance(exc, FencedError) and not self.fenced:
            self.fenced = str(exc)
            log.error("job %s: %s", self.spec.job, exc)

    @staticmethod
    def _wait(fut: Future | None, what: str) -> None:
        if fut is None:
            return
        try:
            fut.result(timeout=30)
        except FencedError as exc:
            raise NotServingError(f"{exc}; reconnect to the coordinator that owns the job") from exc
        except (StoreError, TimeoutError) as exc:
            raise NotServingError(f"{what} could not be made durable ({exc}); retry shortly") from exc

    def wait_durable(self, fut: Future | None, what: str = "the change") -> None:
        """Blocks until a write returned by a call is durable (call without holding any coordinator lock).

        Args:
            fut: the future a call returned, or None.
            what: what was written, for the error message.

        Raises:
            NotServingError: the write failed or this coordinator was fenced off.
        """
        self._wait(fut, what)

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
            self._full_table = None
            return
        t = common_pb2.RankTable(job=self.spec.job, generation=st.generation, world_size=lay.world_size,
                                 master_addr=lay.master_addr, master_port=self._master_port,
                                 restart_count=st.restart_count, max_restarts=self.spec.max_restarts,
                                 node_count=len(lay.slots))
        for s in lay.slots:
            t.nodes.add(node_id=s.node_id, group_rank=s.group_rank, first_rank=s.first_rank,
                        local_world_size=s.local_world_size, address=s.address)
        self._full_table = t

    def _table_for(self, node_id: str) -> common_pb2.RankTable:
        full = self._full_table
        assert full is not None and self._layout is not None
        if len(full.nodes) <= self.spec.full_table_max_nodes:
            return full
        t = common_pb2.RankTable(job=full.job, generation=full.generation, world_size=full.world_size,
                                 master_addr=full.master_addr, master_port=full.master_port,
                                 restart_count=full.restart_count, max_restarts=full.max_restarts,
                                 node_count=full.node_count)
        s = self._layout.slot_of(node_id)
        if s is not None:
            t.nodes.add(node_id=s.node_id, group_rank=s.group_rank, first_rank=s.first_rank,
                        local_world_size=s.local_world_size, address=s.address)
        return t

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
        self._policy.state.generation = generation
        self._rebuild_table()
        self._form_note = ""
        self._running.clear()
        self._succeeded.clear()
        self._mver += 1
        log.info("job %s: generation %d formed: %d nodes, world size %d, master %s:%d", self.spec.job, generation,
                 len(layout.slots), layout.world_size, layout.master_addr, port)
        self._save_state()

    def _note(self, text: str) -> None:
        if text != self._form_note:
            self._form_note = text
            log.warning("job %s: %s", self.spec.job, text)

    def _first_layout(self, now: float) -> RankLayout | None:
        cordoned = set(self._policy.state.cordoned)
        active = sorted((m for m in self._members.values() if self._lease_live(m, now) and not m.info.spare
                         and m.info.node_id not in cordoned), key=lambda m: m.spec().order_key())
        if len(active) < self.spec.nnodes:
            self._form_note = f"waiting for nodes: {len(active)} of {self.spec.nnodes} registered"
            return None
        try:
            return assign_ranks([m.spec() for m in active[: self.spec.nnodes]], group_size=self.spec.group_size)
        except MembershipError as exc:
            self._note(f"cannot lay out ranks: {exc}")
            return None

    def _plan_layout(self, now: float) -> RankLayout | None:
        st = self._policy.state
        plan, lay = st.plan, self._layout
        assert plan is not None and lay is not None
        holders = [self._members[s.node_id] for s in lay.slots if s.node_id in self._members]
        try:
            if plan.level is Level.PROCESS:
                return lay
            if plan.level is Level.NODE:
                gone = set(plan.cordon)
                specs = [m.spec() for m in holders if m.info.node_id not in gone]
                for old, new in plan.replacements.items():
                    spare = self._members.get(new)
                    if spare is not None and self._lease_live(spare, now):
                        specs.append(spare.spec(replaces=old))
                return assign_ranks(specs, previous=lay, group_size=lay.group_size, allow_shrink=plan.shrink,
                                    grow=False)
            cordoned = set(st.cordoned) | set(plan.cordon)
            specs = [m.spec() for m in holders if self._lease_live(m, now) and m.info.node_id not in cordoned]
            taken = set()
            for old, new in plan.replacements.items():  # spares the policy picked for failed nodes' slots
                spare = self._members.get(new)
                if spare is not None and self._lease_live(spare, now) and new not in cordoned:
                    specs.append(spare.spec(replaces=old))
                    taken.add(new)
            specs += [m.spec() for m in self._candidates(now) if m.info.node_id not in cordoned | taken]
            return assign_ranks(specs, previous=lay, group_size=lay.group_size, grow=False)
        except MembershipError as exc:
            self._note(f"generation {plan.generation} waits: {exc}")
            return None

    def _next_layout(self, now: float) -> RankLayout | None:
        """The layout the next generation would get; recomputed only when the membership changed.

        Heartbeats arrive from every node every interval; recomputing an O(n log n) layout on each would make
        a 12.5k-node formation quadratic, so the result is cached per membership version.
        """
        st = self._policy.state
        key = (self._mver, st.plan.generation if st.plan else 0, st.plan.level if st.plan else None)
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
        if st.phase is Phase.FORMING:
            self._policy.formed(1)
            self._install(layout, 1, port)
            return
        plan = self._policy.plan_started()
        for n in plan.cordon:
            if n not in st.cordoned:
                st.cordoned.append(n)
        self._install(layout, plan.generation, port)

    def _advance(self) -> None:
        """Moves the job forward as far as the membership allows (called with the lock held)."""
        now = self._clock()
        st = self._policy.state
        if st.phase is Phase.FORMING:
            if len(self._members) >= self.spec.nnodes:
                self._try_form(now)
        elif st.plan is not None:
            if self._wall() >= st.plan.not_before_s and not self._quiet_holder(now):
                self._try_form(now)
        elif st.phase in (Phase.RUNNING, Phase.RECOVERING) and self._layout is not None:
            n = len(self._layout.slots)
            if len(self._succeeded) >= n:
                self._policy.succeeded()
                log.info("job %s: %s", self.spec.job, st.message)
                self._save_state()
            elif st.phase is Phase.RECOVERING and len(self._running) >= n:
                self._policy.started(st.generation)
                self._save_state()

    def _quiet_holder(self, now: float) -> bool:
        """Whether a process-level plan should wait: a slot holder missed two heartbeats but its lease runs on.

        When a node dies, its peers' collectives break at once and they report a process-level failure before
        the dead node's lease expires. Restarting in place then would wait on the dead node, and its expiry would
        cost a second restart; waiting (at most until the lease expires, or the node's next heartbeat) lets the
        expiry merge into this plan as one node-level restart.
        """
        plan = self._policy.state.plan
        if plan is None or plan.level is not Level.PROCESS or self._layout is None:
            return False
        quiet = 2.0 * self._interval_s()
        for slot in self._layout.slots:
            m = self._members.get(slot.node_id)
            if m is not None and m.alive and now - m.last_seen > quiet:
                return True
        return False

    def _fail(self, f: Failure, now: float) -> tuple[int, int, str]:
        lay = self._layout
        holders = [self._members[s.node_id].spec() for s in lay.slots if s.node_id in self._members] if lay else []
        spares = [m.spec() for m in self._candidates(now) if m.info.node_id != f.node_id]
        before = json.dumps(self._policy.state.to_dict(), sort_keys=True)
        d = self._policy.on_failure(f, layout=lay, members=holders, spares=spares)
        if json.dumps(self._policy.state.to_dict(), sort_keys=True) != before:
            self._mver += 1
            # A merged report (another node of the same fault) is routine at scale: keep the log readable.
            (log.error if d.job_failed else log.debug if d.merged else log.warning)("job %s: %s", self.spec.job,
                                                                                    d.message)
            self._rebuild_table()
            self._save_state()
        return int(d.level), d.generation, d.message

    # --------------------------------------------------------------------------------------------------- API
    def register(self, job: str, info: common_pb2.NodeInfo, free_port: int,
                 instance: str = "") -> tuple[str, int, Future]:
        """Adds or re-adds a node.

        Args:
            job: job name from the request.
            info: the node's identity and topology (validated for format by the service).
            free_port: a port free on the node now.
            instance: the agent process's random id ("" when unknown).

        Returns:
            (lease id, current generation, future of the durable node record).

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
            superseded: set[str] = set()
            if prev is not None:
                superseded = set(prev.superseded)
                if instance and instance in prev.superseded:
                    raise DuplicateNodeError(
                        f"node id {nid!r} was taken over by a newer agent at {prev.info.address or '?'}: this "
                        "agent is a duplicate; give each node a unique --node-id")
                if self._lease_live(prev, now):
                    if instance and instance == prev.instance:
                        return prev.lease_id, self._policy.state.generation, _done_future()
                    same_host = prev.info.address == info.address and prev.info.topology.host == info.topology.host
                    if not same_host:
                        raise DuplicateNodeError(
                            f"node id {nid!r} is held by a live agent at {prev.info.address or '?'} (last heartbeat "
                            f"{now - prev.last_seen:.1f} s ago): give each node a unique --node-id, or wait "
                            f"{self._lease_s():.0f} s for that lease to expire")
                if prev.instance:
                    superseded.add(prev.instance)
            if info.replaces:
                holder = self._members.get(info.replaces)
                lay = self._layout
                if holder is not None and self._lease_live(holder, now) and lay is not None \
                        and lay.slot_of(info.replaces) is not None and info.replaces not in self._policy.state.cordoned:
                    raise SlotTakenError(
                        f"node {nid!r} claims the slot of {info.replaces!r}, which is alive and holds it: only a "
                        "failed or cordoned node's slot can be taken over")
                for other in self._members.values():
                    if other.info.node_id != nid and other.info.replaces == info.replaces \
                            and self._lease_live(other, now):
                        raise SlotTakenError(f"node {other.info.node_id!r} already claims the slot of "
                                             f"{info.replaces!r}: one replacement per slot")
            lease = uuid.uuid4().hex
            m = Member(info=info, lease_id=lease, instance=instance, last_seen=now, free_port=free_port,
                       superseded=superseded)
            self._members[nid] = m
            self._mver += 1
            fut = self._submit([Put(self._prefix + "nodes/" + nid, json.dumps(
                {"info": info.SerializeToString().hex(), "lease": lease, "instance": instance}).encode())])
            st = self._policy.state
            if prev is not None and self._layout is not None and self._layout.slot_of(nid) is not None \
                    and st.phase in (Phase.RUNNING, Phase.RECOVERING) and prev.generation >= 0:
                # The agent restarted while its workers ran a generation: they are gone with it.
                self._fail(Failure(nid, prev.generation, Cause.WORKER_EXIT, detail="node agent restarted",
                                   time_s=self._wall()), now)
            log.debug("job %s: node %s registered (pod %r, index %d, %d devices%s)", job, nid,
                     info.topology.pod_id, info.topology.node_index, info.topology.device_count,
                     ", spare" if info.spare else "")
            self._advance()
            return lease, st.generation, fut

    def heartbeat(self, req: coordinator_pb2.NodeHeartbeatRequest) -> HeartbeatReply:
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
            if not m.alive:
                log.info("job %s: node %s is back", self.spec.job, req.node_id)
                self._mver += 1
            m.last_seen, m.alive = now, True
            if req.free_port > 0:
                m.free_port = req.free_port
            m.generation, m.workers_running, m.last_step = req.generation, req.workers_running, req.last_step
            self._failslow_apply(self._failslow.on_heartbeat(req, st.generation, now,
                                                             lambda: len(self._candidates(now))), now)
            if req.generation == st.generation and req.last_step >= 0:
                self._observe_step(now, req.last_step, st.generation)
            if req.generation == st.generation >= 0 and self._layout is not None \
                    and self._layout.slot_of(req.node_id) is not None:
                self._running.add(req.node_id)
                if req.workers_succeeded:
                    m.succeeded_generation = req.generation
                    self._succeeded.add(req.node_id)
            if req.generation == st.generation and st.consecutive:
                self._policy.progressed(req.last_step)
                if not st.consecutive:
                    self._save_state()
            self._advance()
            return self._failslow_reply(self._command(m))

    def _command(self, m: Member) -> HeartbeatReply:
        st = self._policy.state
        resp = coordinator_pb2.NodeHeartbeatResponse(interval_s=self._interval_s(),
                                                     job_state=st.phase.value, message=st.message)
        nid = m.info.node_id
        slot = self._layout.slot_of(nid) if self._layout is not None else None
        if st.phase in (Phase.SUCCEEDED, Phase.FAILED):
            resp.command = _CMD.NODE_COMMAND_STOP
        elif nid in st.cordoned:
            resp.command = _CMD.NODE_COMMAND_STOP
            resp.message = f"node {nid} is cordoned: {st.message}"
        elif st.plan is not None or self._layout is None:
            resp.command = _CMD.NODE_COMMAND_STOP if m.generation >= 0 else _CMD.NODE_COMMAND_WAIT
            if self._layout is None and self._form_note:
                resp.message = self._form_note
        elif slot is None:
            resp.command = _CMD.NODE_COMMAND_STOP if m.generation >= 0 else _CMD.NODE_COMMAND_WAIT
            resp.message = "spare: no ranks in this generation"
        elif m.generation == st.generation:
            resp.command = _CMD.NODE_COMMAND_NONE
            req = self._ckpt_req
            if req is not None and req.generation == st.generation:
                resp.checkpoint.CopyFrom(req)
        else:
            cmd = _CMD.NODE_COMMAND_START if m.generation < 0 else _CMD.NODE_COMMAND_RESTART
            if self._full_table is not None and len(self._full_table.nodes) <= self.spec.full_table_max_nodes:
                # Every node gets the same full table: build the response once per (generation, command).
                key = (st.generation, cmd, resp.message, resp.interval_s)
                cached = self._start_cache.get(key)
                if cached is None:
                    resp.command = cmd
                    resp.rank_table.CopyFrom(self._full_table)
                    self._start_cache = {key: resp}
                    cached = resp
                resp = cached
            else:
                resp.command = cmd
                resp.rank_table.CopyFrom(self._table_for(nid))
            fut = self._state_fut
            pending = fut is not None and (not fut.done() or fut.exception() is not None)
            return HeartbeatReply(resp, fut if pending else None)
        return HeartbeatReply(resp)

    def report(self, req: coordinator_pb2.ReportEventRequest) -> tuple[int, int, str, Future | None]:
        """Decides the recovery for a reported event.

        Args:
            req: the report (validated for format by the service).

        Returns:
            (decided proto RecoveryLevel, generation to move to, message, the store write it depends on).

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
            m.last_seen = now
            handled = self._failslow_report(req, now)
            if handled is not None:
                return _CMD.RECOVERY_LEVEL_NONE, st.generation, handled, None
            if req.proposed_level <= _CMD.RECOVERY_LEVEL_NONE and req.event.action == common_pb2.ACTION_CHECKPOINT_NOW:
                return _CMD.RECOVERY_LEVEL_NONE, st.generation, self._request_checkpoint(req, now), None
            f = Failure(req.node_id, req.generation, classify(req.event, req.proposed_level),
                        Level(req.proposed_level) if req.proposed_level >= 1 else Level.NONE,
                        req.failed_rank, req.exit_code, req.event.message or req.event.kind, self._wall())
            fut_before = self._state_fut
            level, gen, msg = self._fail(f, now)
            self._advance()
            fut = self._state_fut if self._state_fut is not fut_before else None
            return level, gen, msg, fut

    def _observe_step(self, now: float, step: int, generation: int) -> None:
        """Keeps the job's step rate from heartbeats (for how far ahead a job-wide checkpoint must be set)."""
        mark = self._rate_mark
        if mark is None or mark[2] != generation or step < mark[1]:
            self._rate_mark = (now, step, generation)
            return
        if now - mark[0] >= 1.0:
            rate = (step - mark[1]) / (now - mark[0])
            self._step_rate = rate if self._step_rate == 0.0 else 0.5 * self._step_rate + 0.5 * rate
            self._rate_mark = (now, step, generation)

    def _request_checkpoint(self, req: coordinator_pb2.ReportEventRequest, now: float) -> str:
        """Sets a job-wide checkpoint at a step every rank has not reached yet (called with the lock held).

        The step is the furthest step reported plus what the job does in two heartbeat intervals and half a
        second more (time for every agent to hear of it and tell its workers), at least 2 steps ahead. A request
        still ahead of the job is kept rather than moved.

        Returns:
            The message for the reporter.
        """
        st = self._policy.state
        if st.phase is not Phase.RUNNING or st.plan is not None or self._layout is None:
            return f"no checkpoint requested: the job is {st.phase.name.lower()}"
        furthest = max((self._members[s.node_id].last_step for s in self._layout.slots
                        if s.node_id in self._members), default=-1)
        cur = self._ckpt_req
        if cur is not None and cur.generation == st.generation and cur.at_step > furthest:
            return f"a job-wide checkpoint at step {cur.at_step} is already pending"
        ahead = max(2, math.ceil(self._step_rate * (2.0 * self._interval_s() + 0.5)) + 1)
        self._ckpt_req = coordinator_pb2.CheckpointRequest(
            at_step=furthest + ahead, reason=f"{req.node_id}: {req.event.message or req.event.kind}",
            request_id=uuid.uuid4().hex[:12], generation=st.generation)
        log.warning("job %s: job-wide checkpoint requested at step %d (furthest step %d, %.1f steps/s): %s",
                    self.spec.job, self._ckpt_req.at_step, furthest, self._step_rate, self._ckpt_req.reason)
        return f"job-wide checkpoint at step {self._ckpt_req.at_step}"

    def rank_table(self, job: str) -> common_pb2.RankTable:
        """The current generation's full rank table (empty, with ``job`` set, before the first one forms).

        Raises:
            UnknownJobError, NotServingError: wrong job or not serving.
        """
        with self._lock:
            self._check_serving(job)
            if self._full_table is None:
                return common_pb2.RankTable(job=self.spec.job)
            return self._full_table

    def commit_checkpoint(self, job: str, node_id: str, step: int) -> tuple[int, Future | None]:
        """Records that a node committed a checkpoint step; the job's step is the minimum over its nodes.

        Returns:
            (last step committed by every node of the current generation, store write or None).

        Raises:
            UnknownJobError, NotServingError, UnknownNodeError: see the service.
        """
        with self._lock:
            self._check_serving(job)
            if node_id not in self._members:
                raise UnknownNodeError(f"node {node_id!r} is not registered with job {self.spec.job!r}")
            self._node_steps[node_id] = max(step, self._node_steps.get(node_id, -1))
            fut = None
            if self._layout is not None:
                low = min(self._node_steps.get(s.node_id, -1) for s in self._layout.slots)
                if low > self._committed_step:
                    self._committed_step = low
                    fut = self._submit([Put(self._prefix + "checkpoint",
                                                      json.dumps({"step": low}).encode())])
            return self._committed_step, fut

    def reap(self) -> None:
        """Expires silent nodes' leases (a node-level failure for slot holders) and runs due recoveries."""
        now = self._clock()
        with self._lock:
            if self.fenced:
                return
            st = self._policy.state
            for m in list(self._members.values()):
                if m.alive and now - m.last_seen > self._lease_s():
                    m.alive = False
                    self._mver += 1
                    log.warning("job %s: node %s lost (no heartbeat for %.1f s)", self.spec.job, m.info.node_id,
                                now - m.last_seen)
                    if self._layout is not None and self._layout.slot_of(m.info.node_id) is not None \
                            and st.phase in (Phase.RUNNING, Phase.RECOVERING):
                        self._fail(Failure(m.info.node_id, st.generation, Cause.NODE_LOST,
                                           detail=f"no heartbeat for {now - m.last_seen:.1f} s",
                                           time_s=self._wall()), now)
            self._advance()

    # ------------------------------------------------------------------------------------ fail-slow wiring
    # All fail-slow logic lives in trainguard.recovery.failslow; these three methods only hand it the job's
    # state and apply its decisions through the ordinary node-failure path.
    def _failslow_report(self, req: coordinator_pb2.ReportEventRequest, now: float) -> str | None:
        """Shows a report to fail-slow (called with the lock held); returns the answer when it was fail-slow's
        own (stacks of a hang), else None and the report goes on to the policy."""
        lay = self._layout
        node_of = {s.first_rank + i: s.node_id for s in lay.slots for i in range(s.local_world_size)} if lay else {}
        out = self._failslow.on_report(req, self._policy.state.generation, node_of, now)
        self._failslow_apply(out.replace, now)
        return out.message if out.handled else None

    def _failslow_reply(self, reply: HeartbeatReply) -> HeartbeatReply:
        """Adds fail-slow's findings and an open stack request to a heartbeat reply (a copy when the reply is
        the START/RESTART shared by every node)."""
        if not self._failslow.has_news():
            return reply
        resp = reply.response
        if resp.command in (_CMD.NODE_COMMAND_START, _CMD.NODE_COMMAND_RESTART):
            resp = coordinator_pb2.NodeHeartbeatResponse()
            resp.CopyFrom(reply.response)
        self._failslow.fill(resp)
        return HeartbeatReply(resp, reply.durable)

    def _failslow_apply(self, d: ReplaceDecision | None, now: float) -> None:
        """Replaces a slow (or repeatedly hanging) node with a spare as a node-level failure of that node."""
        if d is None or self._layout is None or self._layout.slot_of(d.node_id) is None:
            return
        st = self._policy.state
        if st.phase not in (Phase.RUNNING, Phase.RECOVERING) or not self._candidates(now):
            log.warning("job %s: fail-slow would replace node %s but no spare is available: %s", self.spec.job,
                        d.node_id, d.detail)
            return
        step = max((m.last_step for m in self._members.values() if m.generation == st.generation), default=-1)
        self._failslow.applied(d, now, step, st.generation)
        self._fail(Failure(d.node_id, st.generation, Cause.NODE_CRITICAL, Level.NODE, detail=d.detail,
                           time_s=self._wall()), now)
        self._advance()


def _done_future() -> Future:
    f: Future = Future()
    f.set_result(None)
    return f

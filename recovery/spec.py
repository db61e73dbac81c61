"""What a job's coordinator is told before nodes arrive: :class:`JobSpec`, its validation and the policy it implies."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Job names: what fits in a store key and a log line (one rule with node ids, in trainguard.names).
from trainguard.names import JOB_NAME_RE
from trainguard.recovery.errors import InvalidRequestError
from trainguard.recovery.policy import PolicyConfig
from trainguard.recovery.straggler import StragglerConfig

#: Most worker processes one node may run (its ``--nproc-per-node``): the coordinator refuses a node reporting more.
MAX_LOCAL_WORKERS = 1024
#: The largest restart budget (rank tables carry it as an int32).
MAX_RESTARTS_LIMIT = 2**31 - 1
#: Node ids a coordinator keeps at least (see :meth:`JobSpec.node_id_limit`): each registered id is a member and a
#: store key, each reporting daemon a row; without a bound, requests naming new ids grew both without end.
MIN_NODE_ID_LIMIT = 16384
#: Nodes the job state's cordon list holds at most, slot holders apart (a failed slot holder is always cordoned:
#: its count is bounded by the job's failures, which need spares to replace them). The state record is rewritten
#: whole at each change and carries, per cordoned node, its id (128 characters at most) three times, the failure
#: that cordoned it (~400 characters) and its daemon's instance: ~530 bytes compressed at worst, so 1024 of them
#: take ~0.55 MB, under etcd's default request limit (1.5 MiB) with room for the rank layout and the node records
#: committed with it. Registered node ids could fill it up to the node id limit (16384: ~8.6 MB), and every state
#: write, so every recovery, then failed for good. The default of :attr:`JobSpec.max_cordoned`, and its most with an
#: etcd store; other stores have no request limit and take up to the node id limit.
MAX_CORDONED = 1024


@dataclass
class JobSpec:
    """What the coordinator needs to know about the job before nodes arrive.

    The first four fields (and their defaults) are what ``trainguard run`` embeds; the rest tune a standalone
    coordinator (``trainguard coordinator``).

    Attributes:
        job: job name; requests for other jobs are refused.
        nnodes: nodes that must register before the first generation starts (>= 1).
        max_nodes: most nodes the first generation takes (0: ``nnodes``). Above ``nnodes`` (torchrun's
            ``--nnodes MIN:MAX``), the job waits once ``nnodes`` registered, up to ``last_call_s`` more, for
            nodes up to ``max_nodes`` and starts at once when that many are there, as torchrun's rendezvous does;
            nodes beyond the first generation wait as standbys.
        last_call_s: that wait, seconds (torchrun's ``last_call_timeout``). Default 30.
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
            lease to at least 3 such intervals, so a large job cannot overload it. Default 4000/s: about one
            core of heartbeat handling including gRPC (measured ~240 us per heartbeat, bench/bench_coordinator.py).
        membership_timeout_s: how long a recovery waits for a valid membership (a spare of the right pod, a lost
            node coming back) before the job fails (MEMBERSHIP_IMPOSSIBLE), seconds. Default 600.
        store: state store URL (see :func:`~trainguard.recovery.store.open_store`). Default ``memory://``.
        failslow: straggler detection and replace policy (:mod:`~trainguard.recovery.straggler`).
        max_cordoned: nodes the job state's cordon list holds at most, slot holders apart (0:
            :data:`MAX_CORDONED`, 1024); past it a node that must be kept out is refused membership instead. At most
            1024 with an etcd store (the state record must fit etcd's request limit), the node id limit otherwise.
        memory_replicas: buddy nodes each node replicates its ranks' in-memory snapshots to (another pod's
            first; :func:`~trainguard.recovery.memory_plan.buddies`); 0 turns peer replication off. Default 1.
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
    max_heartbeat_rate: float = 4000.0
    membership_timeout_s: float = 600.0
    store: str = "memory://"
    failslow: StragglerConfig = field(default_factory=StragglerConfig)
    memory_replicas: int = 1
    max_nodes: int = 0
    last_call_s: float = 30.0
    max_cordoned: int = 0

    def node_id_limit(self) -> int:
        """How many node ids the coordinator keeps at most (members; node daemons' rows apart): a bound on what
        clients can make it store, far above any real job's nodes and spares."""
        return max(MIN_NODE_ID_LIMIT, 2 * max(self.nnodes, self.max_nodes))

    def cordon_limit(self) -> int:
        """How many nodes the job state's cordon list holds at most, slot holders apart (:attr:`max_cordoned`,
        0: :data:`MAX_CORDONED`)."""
        return self.max_cordoned or MAX_CORDONED

    def cordon_limit_ceiling(self) -> int:
        """The largest :attr:`max_cordoned` this spec's store takes: :data:`MAX_CORDONED` for etcd (each cordoned
        node costs ~530 bytes of the state record at worst, which etcd's 1.5 MiB request limit must take with the
        rank layout and the records committed with it), the node id limit for the others (no request limit)."""
        return MAX_CORDONED if self.store.startswith("etcd:") else max(MAX_CORDONED, self.node_id_limit())

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
        if self.max_restarts > MAX_RESTARTS_LIMIT:
            # The budget travels in every rank table as an int32: a larger one made every heartbeat answer fail
            # (ValueError in the service), and the nodes waited forever for their first command.
            raise InvalidRequestError(f"max restarts {self.max_restarts} is above {MAX_RESTARTS_LIMIT}, the most a "
                                      "rank table carries")
        if self.min_nodes > self.nnodes:
            # Shrinking only ever removes nodes: a minimum above the start refused every shrink, so the first lost
            # node left the job waiting for a spare without saying that the flag was why.
            raise InvalidRequestError(f"min nodes {self.min_nodes} exceeds nnodes {self.nnodes}: a job shrinks from "
                                      f"--nnodes down to --min-nodes; use --min-nodes <= {self.nnodes} (0: --nnodes)")
        if self.max_nodes and self.max_nodes < self.nnodes:
            raise InvalidRequestError(f"max nodes {self.max_nodes} is below nnodes {self.nnodes}: use MIN:MAX with "
                                      "MIN <= MAX")
        if not (self.last_call_s >= 0 and math.isfinite(self.last_call_s)):
            raise InvalidRequestError(f"last call {self.last_call_s} s must be a finite number of seconds >= 0")
        if not self.repeat_window_s > 0:
            raise InvalidRequestError(f"repeat window {self.repeat_window_s} s must be positive")
        if not self.membership_timeout_s > 0:
            raise InvalidRequestError(f"membership timeout {self.membership_timeout_s} s must be positive")
        if isinstance(self.max_cordoned, bool) or not isinstance(self.max_cordoned, int) \
                or not 0 <= self.max_cordoned <= self.cordon_limit_ceiling():
            why = ("with an etcd store: the job state record must fit etcd's request limit" if
                   self.store.startswith("etcd:") else "the node id limit")
            raise InvalidRequestError(f"--max-cordoned {self.max_cordoned!r} must be a whole number of nodes from 1 to "
                                      f"{self.cordon_limit_ceiling()} ({why}); leave it out for the default "
                                      f"{min(MAX_CORDONED, self.cordon_limit_ceiling())}")
        if self.memory_replicas < 0:
            raise InvalidRequestError(f"memory replicas {self.memory_replicas} must be >= 0 (0: no replication)")
        if not (self.max_heartbeat_rate > 0 and math.isfinite(self.max_heartbeat_rate)):
            raise InvalidRequestError(f"max heartbeat rate {self.max_heartbeat_rate}/s must be positive")
        # NaN passed every comparison below (nodes were told a NaN interval), and an infinite lease or backoff
        # never runs out: a dead node would never be replaced, a second restart never start.
        if not (0 < self.heartbeat_interval_s < self.lease_timeout_s and math.isfinite(self.lease_timeout_s)):
            raise InvalidRequestError(f"lease timeout {self.lease_timeout_s} s must exceed the heartbeat interval "
                                      f"{self.heartbeat_interval_s} s (> 0), both finite")
        for what, v in (("backoff", self.backoff_initial_s), ("backoff maximum", self.backoff_max_s)):
            if not (v >= 0 and math.isfinite(v)):
                raise InvalidRequestError(f"{what} {v} s must be a finite number of seconds >= 0")

    def policy_config(self) -> PolicyConfig:
        """The recovery policy's knobs derived from this spec."""
        return PolicyConfig(max_restarts=self.max_restarts, backoff_initial_s=self.backoff_initial_s,
                            backoff_max_s=max(self.backoff_max_s, self.backoff_initial_s),
                            process_repeats_to_node=self.process_repeats_to_node,
                            node_repeats_to_job=self.node_repeats_to_job, window_s=self.repeat_window_s,
                            hold_unhealthy=self.hold_unhealthy, allow_shrink=self.allow_shrink,
                            min_nodes=self.min_nodes or self.nnodes,
                            membership_timeout_s=self.membership_timeout_s)

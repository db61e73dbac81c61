"""The coordinator's plain domain types: what the core takes and returns instead of protobuf messages.

:mod:`~trainguard.recovery.convert` maps them to and from the wire (``coordinator.proto``) in the gRPC service;
the core (:mod:`~trainguard.recovery.coordinator`), the decision step (:mod:`~trainguard.recovery.decide`) and
the tests use them directly. Enum values equal the proto enum numbers, so conversion is a cast.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainguard.recovery.memory_plan import MemoryHolding, RestorePlan
from trainguard.recovery.policy import Cause, Level
from trainguard.recovery.qualification import Qualification
from trainguard.recovery.ranks import NodeSlot, NodeSpec


class Command(enum.IntEnum):
    """What a heartbeat tells a node to do (values equal the proto ``NodeCommand``)."""

    NONE = 1     # keep going
    START = 2    # start workers for the table's generation
    RESTART = 3  # stop workers, start them again with the table
    STOP = 4     # stop workers (cordoned, spare, or job over)
    WAIT = 5     # no rank table yet: waiting for members


@dataclass(frozen=True)
class NodeRecord:
    """A node's identity and topology as it registered.

    Attributes:
        node_id: stable identity (survives agent restarts).
        pod_id: pod / supernode sharing the fast fabric.
        node_index: position inside the pod.
        host: host name.
        device_count: worker slots (0 means 1).
        address: address other nodes reach it at.
        agent_port: the node agent's gRPC port, 0 if none.
        spare: joins the spare pool.
        replaces: node id whose slot it takes over ("" when none).
        labels: free-form labels.
    """

    node_id: str
    pod_id: str = ""
    node_index: int = 0
    host: str = ""
    device_count: int = 1
    address: str = ""
    agent_port: int = 0
    spare: bool = False
    replaces: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)

    def spec(self, replaces: str = "") -> NodeSpec:
        """The node as rank assignment sees it."""
        return NodeSpec(self.node_id, self.pod_id, self.node_index, self.host, max(1, self.device_count),
                        self.address, replaces)

    def to_dict(self) -> dict[str, object]:
        """JSON-friendly form (inverse of :meth:`from_dict`)."""
        return {"node_id": self.node_id, "pod_id": self.pod_id, "node_index": self.node_index, "host": self.host,
                "device_count": self.device_count, "address": self.address, "agent_port": self.agent_port,
                "spare": self.spare, "replaces": self.replaces, "labels": dict(self.labels)}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> "NodeRecord":
        """Rebuilds a record from :meth:`to_dict` output.

        Raises:
            KeyError, TypeError, ValueError: the mapping is malformed.
        """
        return cls(str(d["node_id"]), str(d["pod_id"]), int(d["node_index"]), str(d["host"]),  # type: ignore
                   int(d["device_count"]), str(d["address"]), int(d["agent_port"]), bool(d["spare"]),  # type: ignore
                   str(d["replaces"]), {str(k): str(v) for k, v in dict(d["labels"]).items()})  # type: ignore


@dataclass(frozen=True)
class RankTiming:
    """One local rank's step timing over the steps it completed since its node's last heartbeat (medians).

    Attributes:
        rank: global rank.
        step: last step completed.
        step_s: median wall time of a step, seconds.
        wait_s: median time waiting for peers (the ``comm`` section), seconds; -1 when unknown.
        compute_s: median time in the other sections, seconds; -1 when no sections are used.
        steps: steps summarised.
    """

    rank: int
    step: int
    step_s: float
    wait_s: float = -1.0
    compute_s: float = -1.0
    steps: int = 1


@dataclass(frozen=True)
class Beat:
    """One node heartbeat.

    Attributes:
        job: job name.
        node_id: the node.
        lease_id: the lease RegisterNode returned.
        generation: generation its workers run (-1: none).
        workers_running: live workers.
        workers_succeeded: every worker of that generation exited 0.
        last_step: highest step completed (-1: none).
        free_port: a port free on the node now (0: none).
        timings: step timing of the node's ranks since its last heartbeat (fail-slow detection).
        qualification: a new pre-flight verdict of a node waiting without a slot (None: nothing new).
        link_probe_port: the node's link-probe listener on its address (0: none; slow-link localisation).
        link_results: link probes the node finished since its last heartbeat.
        memory: the in-memory checkpoint copies the node holds (:mod:`~trainguard.recovery.memory_plan`).
        replica_address: host:port of the node's replica server ("" when it serves none).
        replica_bytes: memory other nodes' replicas hold on the node.
        replica_holds_none: the node holds no other node's replicas (``--replica-memory-mib 0``): never a buddy.
    """

    job: str
    node_id: str
    lease_id: str
    generation: int = -1
    workers_running: int = 0
    workers_succeeded: bool = False
    last_step: int = -1
    free_port: int = 0
    timings: tuple[RankTiming, ...] = ()
    qualification: Qualification | None = None
    link_probe_port: int = 0
    link_results: tuple[LinkProbeResult, ...] = ()
    memory: tuple[MemoryHolding, ...] = ()
    replica_address: str = ""
    replica_bytes: int = 0
    replica_holds_none: bool = False


@dataclass(frozen=True)
class LinkProbeAsk:
    """A timed TCP transfer a node should run to a peer over the data network (slow-link localisation).

    Attributes:
        probe_id: identifies the probe (the answer names it).
        peer_node, peer_address, peer_port: where the peer's probe listener is.
        bytes: bytes to send (the peer echoes them back).
        timeout_s: give up after this long, seconds.
    """

    probe_id: str
    peer_node: str
    peer_address: str
    peer_port: int
    bytes: int
    timeout_s: float


@dataclass(frozen=True)
class LinkProbeResult:
    """The outcome of one :class:`LinkProbeAsk` (seconds; ``error`` set when it failed)."""

    probe_id: str
    peer_node: str
    bytes: int
    up_s: float
    down_s: float
    error: str = ""


@dataclass(frozen=True)
class FaultReport:
    """One reported event, classified (see :func:`~trainguard.recovery.convert.classify`).

    Attributes:
        job, node_id, lease_id: who reports.
        generation: generation the fault happened in (-1: no workers ran).
        cause: why.
        proposed: level the reporter proposes (NONE: no opinion).
        rank: failing global rank (-1: not about one rank).
        exit_code: the worker's exit code (negative: signal).
        detail: one line from the reporter.
        checkpoint_now: a predicted failure asks for a job-wide checkpoint instead of a restart.
        kind: the reported event's kind (``process.hung``, ``hang.stacks``, ...).
        stacks: Python stack dumps the event carries: ``stack.<rank>`` -> dump text, and ``stack`` for the
            failing rank's own (fail-slow hang localisation).
        stack_request: the coordinator's stack request this report answers ("" when none).
    """

    job: str
    node_id: str
    lease_id: str
    generation: int
    cause: Cause
    proposed: Level = Level.NONE
    rank: int = -1
    exit_code: int = 0
    detail: str = ""
    checkpoint_now: bool = False
    kind: str = ""
    stacks: Mapping[str, str] = field(default_factory=dict)
    stack_request: str = ""


@dataclass(frozen=True)
class CheckpointAsk:
    """A job-wide checkpoint relayed in heartbeats: every rank saves when it completes ``at_step``."""

    at_step: int
    reason: str
    request_id: str
    generation: int


@dataclass(frozen=True)
class StackAsk:
    """Asks every node to report its live workers' Python stacks (once per ``request_id``): a hang is localised."""

    request_id: str
    generation: int


@dataclass(frozen=True)
class SlowRank:
    """A flagged straggler as operators see it.

    Attributes:
        rank: global rank (-1: a node finding).
        node_id: its node.
        ratio: its own work over the others' median.
        excess_s: seconds per step the job loses to it.
        since: Unix time it was first flagged (0: unknown).
        basis: ``"compute"`` (own work vs the others') or ``"wait"`` (waits least).
        individual: its step time over its own healthy baseline.
    """

    rank: int
    node_id: str
    ratio: float
    excess_s: float
    since: float
    basis: str
    individual: float


@dataclass(frozen=True)
class HangFinding:
    """Where the latest hang was: ranks whose stacks differ from the majority's (the rest wait on them).

    Attributes:
        generation: the hung generation.
        outlier_ranks, outlier_nodes: the outliers.
        outlier_frame, majority_frame: innermost frame of the outliers' and of the majority's stack.
        ranks_seen: ranks whose stacks were grouped.
        groups: distinct stack signatures.
        repeats: consecutive hangs with the same outlier node.
        time: Unix time of the finding.
    """

    generation: int
    outlier_ranks: tuple[int, ...]
    outlier_nodes: tuple[str, ...]
    outlier_frame: str
    majority_frame: str
    ranks_seen: int
    groups: int
    repeats: int
    time: float


@dataclass(frozen=True)
class FailSlowStatus:
    """The coordinator's fail-slow findings, relayed in every heartbeat reply while there are any.

    Attributes:
        slow: flagged ranks (at most ``StragglerConfig.max_listed``).
        job_step_s: median step time of the job, seconds (0: unknown).
        job_slowdown: that over the job's own healthy baseline (0: unknown).
        action: ``"report"``, ``"replace <node>"``, or "" when nothing is flagged.
        message: one line for operators.
        hang: the latest hang localisation, if any.
        ranks_observed: ranks scored in the last window.
        link_probe: slow-link localisation: the last probe campaign's outcome, or its progress ("" when none).
    """

    slow: tuple[SlowRank, ...] = ()
    job_step_s: float = 0.0
    job_slowdown: float = 0.0
    action: str = ""
    message: str = ""
    hang: HangFinding | None = None
    ranks_observed: int = 0
    link_probe: str = ""

    @property
    def empty(self) -> bool:
        """Nothing to tell (no window scored, nothing flagged, no hang localised)."""
        return self == _NO_FINDINGS


_NO_FINDINGS = FailSlowStatus()


@dataclass(frozen=True)
class GenerationTable:
    """One generation's rank table (one object per generation: the service caches its wire form by identity).

    Attributes:
        job: job name.
        generation: the generation.
        world_size: total ranks.
        master_addr, master_port: rank 0's rendezvous address.
        restart_count, max_restarts: budget spent and allowed.
        slots: every node's ranks, in group-rank order.
    """

    job: str
    generation: int
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    max_restarts: int
    slots: tuple[NodeSlot, ...]
    _by_id: dict[str, NodeSlot] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {s.node_id: s for s in self.slots})

    def slot_of(self, node_id: str) -> NodeSlot | None:
        """The slot a node holds in this generation, or None (a dictionary lookup: large tables are cut per node)."""
        return self._by_id.get(node_id)


@dataclass(frozen=True)
class Instruction:
    """A heartbeat's answer.

    Attributes:
        command: what to do.
        phase: the job's phase (proto ``JobState`` number via ``phase.value``).
        interval_s: heartbeat interval to use, seconds.
        message: one line for the agent's log.
        table: START/RESTART: the generation's table.
        only_node: the node the table is cut down to ("" for the full table; large jobs send each node its entry).
        checkpoint: a pending job-wide checkpoint of the current generation.
        failslow: the fail-slow findings (None when there are none).
        stacks: an open stack request of a hang being localised.
        link_probes: link probes this node should run now (slow-link localisation).
        restore_plan: START/RESTART: where each rank reads its checkpoint (None: no memory holdings known).
        replica_targets: ``(node id, replica address)`` of the node's buddies in the current table.
        missing: while the first generation forms: nodes it still needs (0: enough, or it waits for another reason).
    """

    command: Command
    phase: enum.Enum
    interval_s: float
    message: str = ""
    table: GenerationTable | None = None
    only_node: str = ""
    checkpoint: CheckpointAsk | None = None
    failslow: FailSlowStatus | None = None
    stacks: StackAsk | None = None
    link_probes: tuple[LinkProbeAsk, ...] = ()
    restore_plan: RestorePlan | None = None
    replica_targets: tuple[tuple[str, str], ...] = ()
    missing: int = 0

"""Slow-link localisation: when the whole job slows down and no rank's own work explains it, probe the links.

A node whose NIC or link degrades (capped rate, lost packets) does not show as a straggler: in a ring
all-reduce every rank waits for the slow hop alike, so every rank's own work stays flat while every step grows.
The detector (:mod:`~trainguard.recovery.straggler`) then reports a *job slowdown* (step time against the job's
own history) with no slow rank. :class:`LinkLocator` turns that into a named node, in the manner of
ByteRobust's pairwise tests:

1. **Trigger.** ``trigger_windows`` consecutive scored windows with a job slowdown >= ``slow_ratio`` and no
   rank or node flagged by its own work, or over the threshold while its flag persists (a compute straggler
   has its own finding), at least ``cooldown_s`` after the last probe campaign, and at least 3 nodes (2 nodes
   share their only pair: no way to tell which end is slow).
2. **Probe.** The nodes are paired in rounds (a round-robin schedule: each round a matching, so no node runs
   two probes at once); each node is paired with up to ``max_peers`` others, and every pair is probed
   ``repeats`` times. A probe is a timed TCP transfer over the data network: the node sends ``probe_bytes``
   to its peer's probe listener (:mod:`trainguard.agent.link_probe`), which echoes them back; the pair's
   time is the slower direction, so a cap on either end's egress shows. A round ends when every probe in it
   answered or after ``timeout_s`` (a probe that did not answer counts as failed, i.e. as slow).
3. **Localise.** Each pair keeps its best rate over the repeats (noise only slows a transfer down, so the best
   is the link's capacity). A node is named when *every* one of its pairs is slower than ``link_ratio`` times
   below the median of the pairs it is not part of. A healthy node has at least one fast pair (with a healthy
   peer), so only the common end of the slow pairs is named.

The finding lasts until the job slowdown clears (``clear_windows`` windows below ``clear_ratio``), a new probe
names no one, or the node is replaced. States::

    IDLE --trigger--> PROBING --last round--> IDLE (finding or none; cooldown starts)

The locator is pure: no I/O, no lock, no clock (the coordinator calls it under its lock with its clock).
"""

from __future__ import annotations

import enum
import math
import statistics
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from trainguard.recovery.domain import LinkProbeAsk, LinkProbeResult
from trainguard.recovery.errors import InvalidRequestError

#: Most link results one heartbeat may carry.
MAX_LINK_RESULTS = 64
#: Most bytes a probe may move (each way).
MAX_PROBE_BYTES = 64 << 20


class ProbeState(enum.Enum):
    """Where the locator stands."""

    IDLE = "idle"
    PROBING = "probing"


#: (state, event) -> next state.
TRANSITIONS: dict[tuple[ProbeState, str], ProbeState] = {
    (ProbeState.IDLE, "trigger"): ProbeState.PROBING,
    (ProbeState.PROBING, "round"): ProbeState.PROBING,
    (ProbeState.PROBING, "done"): ProbeState.IDLE,
    (ProbeState.PROBING, "abort"): ProbeState.IDLE,
}


@dataclass
class LinkProbeConfig:
    """Knobs of slow-link localisation.

    Attributes:
        enabled: probe at all. Default True.
        trigger_windows: consecutive windows of job slowdown with no compute straggler before probing. Default 3.
        slow_ratio: job slowdown (step time over the job's own baseline) that counts. Default 1.3.
        clear_ratio: a finding clears after ``clear_windows`` windows below this slowdown. Default 1.1.
        clear_windows: see ``clear_ratio``. Default 4.
        probe_bytes: bytes sent (and echoed) per probe. Default 1 MiB.
        repeats: times each pair is probed (the best rate counts). Default 2.
        max_peers: pairs per node at most (all pairs up to ``max_peers + 1`` nodes). Default 4.
        link_ratio: a pair is slow when its rate is this many times below the other pairs' median. Default 4.
        timeout_s: one probe round's deadline, seconds. Default 15.
        cooldown_s: at least this long between two probe campaigns, seconds. Default 60.
    """

    enabled: bool = True
    trigger_windows: int = 3
    slow_ratio: float = 1.3
    clear_ratio: float = 1.1
    clear_windows: int = 4
    probe_bytes: int = 1 << 20
    repeats: int = 2
    max_peers: int = 4
    link_ratio: float = 4.0
    timeout_s: float = 15.0
    cooldown_s: float = 60.0

    def validate(self) -> None:
        """Checks every field.

        Raises:
            InvalidRequestError: a field is out of range; the message names it.
        """
        for name in ("trigger_windows", "clear_windows", "repeats", "max_peers"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"link probe {name}={getattr(self, name)} must be >= 1")
        if not self.slow_ratio > 1.0 or not 1.0 <= self.clear_ratio < self.slow_ratio:
            raise InvalidRequestError(f"link probe slow_ratio={self.slow_ratio} must be > 1 and clear_ratio="
                                      f"{self.clear_ratio} in [1, slow_ratio)")
        if not 1024 <= self.probe_bytes <= MAX_PROBE_BYTES:
            raise InvalidRequestError(f"link probe probe_bytes={self.probe_bytes} must be in [1024, "
                                      f"{MAX_PROBE_BYTES}]")
        if not self.link_ratio > 1.0:
            raise InvalidRequestError(f"link probe link_ratio={self.link_ratio} must be > 1")
        if not self.timeout_s > 0 or self.cooldown_s < 0:
            raise InvalidRequestError(f"link probe timeout_s={self.timeout_s} must be > 0 and cooldown_s="
                                      f"{self.cooldown_s} >= 0")


@dataclass(frozen=True)
class LinkFinding:
    """A node whose links were slow in every probed pair.

    Attributes:
        node_id: the node.
        ratio: the other pairs' median rate over the median rate of this node's pairs.
        rate_bps: median rate of this node's pairs, bytes/s.
        others_bps: median rate of the pairs without it, bytes/s.
        pairs: pairs of this node probed.
        since: when it was named (coordinator clock).
    """

    node_id: str
    ratio: float
    rate_bps: float
    others_bps: float
    pairs: int
    since: float


@dataclass
class _Campaign:
    """One probe campaign: its rounds and what came back."""

    rounds: list[list[tuple[str, str]]]  # each round: (client, server) pairs
    endpoints: dict[str, tuple[str, int]]
    round: int = 0
    deadline: float = 0.0
    asks: dict[str, LinkProbeAsk] = field(default_factory=dict)  # client node -> its ask this round
    pending: set[str] = field(default_factory=set)  # probe ids of this round not answered
    pair_of: dict[str, frozenset[str]] = field(default_factory=dict)  # probe id -> pair
    rates: dict[frozenset[str], list[float]] = field(default_factory=dict)  # pair -> rates seen (0: failed)


def pair_rounds(nodes: Sequence[str], max_peers: int, repeats: int) -> list[list[tuple[str, str]]]:
    """Rounds of probes: the circle method's matchings (each node in at most one pair per round), the first
    ``max_peers`` of them (each node paired with up to ``max_peers`` others), all of it ``repeats`` times, the
    probing end alternating between repeats.

    Args:
        nodes: node ids (sorted by the caller for a stable schedule).
        max_peers: pairs per node at most.
        repeats: times each pair is probed.
    """
    ring = list(nodes) + ([None] if len(nodes) % 2 else [])
    n = len(ring)
    matchings: list[list[tuple[str, str]]] = []
    for r in range(n - 1):
        pairs = []
        for i in range(n // 2):
            a, b = ring[i], ring[n - 1 - i]
            if a is not None and b is not None:
                pairs.append((a, b))
        if pairs:
            matchings.append(pairs)
        ring = [ring[0], ring[-1], *ring[1:-1]]
    matchings = matchings[:max_peers]
    out = []
    for rep in range(repeats):
        for m in matchings:
            out.append([(a, b) if rep % 2 == 0 else (b, a) for a, b in m])
    return out


def localise_links(rates: Mapping[frozenset[str], float], link_ratio: float) -> list[tuple[str, float, float, float,
                                                                                               int]]:
    """The nodes every pair of which is slow against the pairs without them.

    Args:
        rates: pair -> its best rate, bytes/s (0: every probe of it failed).
        link_ratio: how many times below the others' median a pair must be to count as slow.

    Returns:
        (node, ratio, its pairs' median rate, the others' median rate, pairs) per named node, worst first.
    """
    nodes = sorted({n for p in rates for n in p})
    out = []
    for node in nodes:
        mine = [r for p, r in rates.items() if node in p]
        others = [r for p, r in rates.items() if node not in p]
        if not mine or not others:
            continue
        ref = statistics.median(others)
        if ref <= 0 or any(r * link_ratio >= ref for r in mine):
            continue
        med = statistics.median(mine)
        out.append((node, ref / med if med > 0 else math.inf, med, ref, len(mine)))
    return sorted(out, key=lambda x: -x[1])


class LinkLocator:
    """Slow-link localisation for one job (see the module docstring).

    Args:
        config: the knobs (validated here).

    Raises:
        InvalidRequestError: the config is invalid.
    """

    def __init__(self, config: LinkProbeConfig | None = None) -> None:
        self.config = config or LinkProbeConfig()
        self.config.validate()
        self.state = ProbeState.IDLE
        self._over = 0
        self._under = 0
        self._next_ok = -math.inf
        self._campaign: _Campaign | None = None
        self.finding: LinkFinding | None = None
        self.last_outcome = ""  # one line for operators
        self._untimed = False  # the last window compared no two ranks' own work (see on_window)
        self._unprobed = False  # last_outcome is the "cannot probe" line, which names the cause of a slowdown
        self.campaigns = 0
        self.started_at: float | None = None

    def _cause(self) -> str:
        """Why no rank explains the slowdown, for the outcome lines."""
        if self._untimed:
            return ("but no rank times its own work, so a slow rank cannot be named (time the step's parts with "
                    "session.section(...), the wait in collectives as 'comm')")
        return "with no compute straggler"

    def _move(self, event: str) -> None:
        self.state = TRANSITIONS[(self.state, event)]

    # -- trigger ---------------------------------------------------------------------------------------------
    def on_window(self, job_slowdown: float, compute_straggler: bool, endpoints: Mapping[str, tuple[str, int]],
                  now: float, ranks_compared: bool = True) -> bool:
        """Looks at a scored window; may start a probe campaign.

        Args:
            job_slowdown: the window's job slowdown (step time over the job's own baseline; NaN: unknown).
            compute_straggler: a rank or node is flagged by its own work, or over the threshold while its flag
                persists (then that finding explains the slowdown: no probe).
            endpoints: node -> (address, probe port) of the nodes holding ranks now (port 0: cannot be probed).
            now: coordinator clock, seconds.
            ranks_compared: the window compared at least two ranks' own work. False when the ranks report step
                times only (a training loop without timed sections): a slow rank then looks like a slow link,
                and the outcome lines say so instead of claiming there is no compute straggler.

        Returns:
            True when a campaign started.
        """
        cfg = self.config
        self._untimed = not ranks_compared
        slowed = job_slowdown == job_slowdown and job_slowdown >= cfg.slow_ratio
        self._over = self._over + 1 if slowed and not compute_straggler else 0
        self._under = self._under + 1 if not (job_slowdown >= cfg.clear_ratio) else 0
        if self._unprobed and (compute_straggler or self._under >= cfg.clear_windows):
            # A rank flagged since: the slowdown has its cause, and "with no compute straggler" would contradict
            # the slow-rank table beside it in every status. Or the slowdown is over: "job 3.26x slower" stood
            # for the rest of the job beside a fail-slow line saying 0.97x.
            self.last_outcome, self._unprobed = "", False
        if self.finding is not None and self._under >= cfg.clear_windows:
            self.last_outcome = (f"{self.finding.node_id}'s links: cleared (the job's step is back within "
                                 f"{cfg.clear_ratio:g}x of its baseline)")
            self.finding = None
        if not cfg.enabled or self.state is not ProbeState.IDLE or self.finding is not None:
            return False
        if self._over < cfg.trigger_windows or now < self._next_ok:
            return False
        ready = {n: ep for n, ep in endpoints.items() if ep[1] > 0 and ep[0]}
        if len(ready) < 3:
            self.last_outcome = (f"job {job_slowdown:.2f}x slower {self._cause()}; link probe needs >= 3 "
                                 f"nodes with a probe listener, {len(ready)} have one")
            self._unprobed = True
            self._next_ok = now + cfg.cooldown_s
            return False
        rounds = pair_rounds(sorted(ready), cfg.max_peers, cfg.repeats)
        self._campaign = _Campaign(rounds, dict(ready))
        self.campaigns += 1
        self.started_at = now
        self._move("trigger")
        self._open_round(now)
        return True

    def _open_round(self, now: float) -> None:
        c = self._campaign
        assert c is not None
        c.asks.clear()
        c.pending.clear()
        c.deadline = now + self.config.timeout_s
        for client, server in c.rounds[c.round]:
            addr, port = c.endpoints[server]
            pid = uuid.uuid4().hex[:12]
            c.asks[client] = LinkProbeAsk(pid, server, addr, port, self.config.probe_bytes,
                                          max(1.0, self.config.timeout_s - 1.0))
            c.pending.add(pid)
            c.pair_of[pid] = frozenset((client, server))
        self.last_outcome = (f"probing links: round {c.round + 1} of {len(c.rounds)} "
                             f"({len(c.endpoints)} nodes, {len(c.rates)} pair(s) measured)")

    # -- probes ----------------------------------------------------------------------------------------------
    def asks_for(self, node_id: str) -> tuple[LinkProbeAsk, ...]:
        """The probe ``node_id`` should run now (empty when none, or when it answered already)."""
        c = self._campaign
        if c is None:
            return ()
        a = c.asks.get(node_id)
        return (a,) if a is not None and a.probe_id in c.pending else ()

    def on_results(self, results: Sequence[LinkProbeResult], now: float) -> LinkFinding | None:
        """Takes probe results from a heartbeat; advances rounds. Returns a new finding when the campaign ends
        naming a node."""
        c = self._campaign
        if c is None:
            return None
        for r in results:
            if r.probe_id not in c.pending:
                continue  # a late answer of an earlier round, or someone else's
            c.pending.discard(r.probe_id)
            t = max(r.up_s, r.down_s)
            rate = r.bytes / t if not r.error and r.bytes > 0 and t > 0 else 0.0
            c.rates.setdefault(c.pair_of[r.probe_id], []).append(rate)
        return self.tick(now)

    def tick(self, now: float) -> LinkFinding | None:
        """Closes a round when every probe answered or its deadline passed (unanswered probes count as failed)."""
        c = self._campaign
        if c is None or (c.pending and now < c.deadline):
            return None
        for pid in c.pending:
            c.rates.setdefault(c.pair_of[pid], []).append(0.0)
        c.round += 1
        if c.round < len(c.rounds):
            self._move("round")
            self._open_round(now)
            return None
        return self._finish(now)

    def _finish(self, now: float) -> LinkFinding | None:
        c = self._campaign
        assert c is not None
        self._campaign = None
        self._move("done")
        self._next_ok = now + self.config.cooldown_s
        best = {p: max(rs) for p, rs in c.rates.items()}
        named = localise_links(best, self.config.link_ratio)
        took = now - (self.started_at if self.started_at is not None else now)
        if not named:
            rates = sorted(best.values())
            self.last_outcome = (f"link probe of {len(best)} pair(s) in {took:.1f} s named no node (pair rates "
                                 f"{_mbs(rates[0])}..{_mbs(rates[-1])} MB/s)" if rates else "link probe: no pairs")
            if self._untimed:
                self.last_outcome += f"; the job is slower {self._cause()}"
            self.finding = None
            return None
        node, ratio, med, ref, pairs = named[0]
        self.finding = LinkFinding(node, ratio, med, ref, pairs, now)
        self.last_outcome = (f"node {node}: slow in all {pairs} of its probed link pair(s), {_mbs(med)} MB/s vs "
                             f"{_mbs(ref)} MB/s for the other pairs ({ratio:.1f}x); probe of {len(best)} pair(s) "
                             f"took {took:.1f} s")
        return self.finding

    def forget(self, node_id: str) -> None:
        """Drops a finding about ``node_id`` (it was replaced)."""
        if self.finding is not None and self.finding.node_id == node_id:
            self.finding = None
            self._over = 0
            self.last_outcome += f"; node {node_id} replaced"

    def abort(self) -> None:
        """Ends a campaign early (the job's membership changed: the pairs no longer hold ranks)."""
        if self._campaign is not None:
            self._campaign = None
            self._move("abort")
            self.last_outcome = "link probe aborted: the job restarted"


def _mbs(bps: float) -> str:
    return f"{bps / 1e6:.1f}"


def validate_link_results(results: Sequence, probe_port: int) -> None:
    """Checks a heartbeat's link-probe fields before anything is touched (the service calls it).

    Raises:
        InvalidRequestError: too many results, a port out of range, or a negative/non-finite number; the message
            names the field.
    """
    if not 0 <= probe_port <= 65535:
        raise InvalidRequestError(f"link_probe_port={probe_port} must be in [0, 65535]")
    if len(results) > MAX_LINK_RESULTS:
        raise InvalidRequestError(f"link_results has {len(results)} entries; at most {MAX_LINK_RESULTS} are allowed")
    for i, r in enumerate(results):
        if len(r.probe_id) > 64 or len(r.error) > 1024:
            raise InvalidRequestError(f"link_results[{i}].probe_id/error too long (64/1024 characters at most)")
        if r.bytes > MAX_PROBE_BYTES:
            raise InvalidRequestError(f"link_results[{i}].bytes={r.bytes} exceeds {MAX_PROBE_BYTES}")
        for name in ("up_s", "down_s"):
            v = getattr(r, name)
            if not (v >= 0 and v < 1e7):
                raise InvalidRequestError(f"link_results[{i}].{name}={v} must be a finite number of seconds >= 0")

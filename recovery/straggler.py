"""Straggler detection from per-rank step timing: a pure state machine with no I/O and no clock of its own.

Input: per-rank summaries (:class:`Timing`) the node agents relay with their heartbeats: median step time,
median time waiting in collectives (the ``comm`` section) and the rest, the rank's own work. In synchronous
training every rank's *step* takes as long as the slowest rank's, so step times cannot single a rank out; its
own work (step less wait) can, and so can its wait: the slow rank waits least, because everyone waits for it.

Every ``window_s`` seconds (and at least ``min_steps`` steps per rank) a window closes and each rank gets

- a **relative score**: its own work over the median of the *other* ranks' own work (leave-one-out, so it
  works from 2 ranks up). A job-wide slowdown moves the median with it and scores ~1 everywhere;
- a **node score**: the same for the median of each node's ranks against the other nodes' medians;
- an **individual score**: its step time over its own healthy baseline (the median of its first
  ``baseline_windows`` windows after two of warm-up). The median of these is the *job slowdown*, reported but
  never a straggler.

Persistence and hysteresis. A rank (node) is flagged after ``persist_windows`` consecutive windows with a
score >= ``slow_ratio`` (and an excess of at least ``min_excess`` of the job's step) and cleared after
``clear_windows`` consecutive windows below ``clear_ratio`` (< ``slow_ratio``), so one noisy step, or one noisy
window, never fires and a flag does not flap::

    HEALTHY --score >= slow_ratio--> SUSPECT --persist_windows in a row--> SLOW
       ^  <----score < slow_ratio------'                                    |
       '-------------------- clear_windows in a row below clear_ratio ------'

:class:`ReplacePolicy` turns a SLOW node into a replacement when the time it would save over the horizon
exceeds ``margin`` times the measured cost of a node-level restart, at most once per ``cooldown_s``.
"""

from __future__ import annotations

import enum
import math
import statistics
import threading
from collections.abc import Iterable, Mapping
from typing import Any
from dataclasses import dataclass, field

from trainguard.recovery.errors import InvalidRequestError
from trainguard.recovery.link_locator import LinkProbeConfig


class FlagState(enum.Enum):
    """Where a rank or node stands."""

    HEALTHY = "healthy"
    SUSPECT = "suspect"
    SLOW = "slow"


#: (state, event) -> next state; events: "over" (score >= slow_ratio), "under" (score < slow_ratio),
#: "persisted" (over for persist_windows), "cleared" (below clear_ratio for clear_windows).
TRANSITIONS: dict[tuple[FlagState, str], FlagState] = {
    (FlagState.HEALTHY, "over"): FlagState.SUSPECT,
    (FlagState.HEALTHY, "under"): FlagState.HEALTHY,
    (FlagState.SUSPECT, "over"): FlagState.SUSPECT,
    (FlagState.SUSPECT, "under"): FlagState.HEALTHY,
    (FlagState.SUSPECT, "persisted"): FlagState.SLOW,
    (FlagState.SLOW, "over"): FlagState.SLOW,
    (FlagState.SLOW, "under"): FlagState.SLOW,
    (FlagState.SLOW, "cleared"): FlagState.HEALTHY,
}


@dataclass
class StragglerConfig:
    """Knobs of straggler detection and of the replace policy.

    Attributes:
        slow_ratio: a rank whose own work is at least this multiple of the others' median is over. Default 1.3.
        clear_ratio: a flagged rank clears below this multiple (hysteresis). Default 1.1.
        min_excess: a rank (node) counts as over only when its own work also exceeds the others' by at least this
            share of the job's step (0.1: it costs the job >= 10% of every step), so ranks whose own work is a
            sliver of a communication-bound step do not fire on small absolute jitter. Default 0.1.
        persist_windows: consecutive windows over ``slow_ratio`` to flag. Default 6.
        clear_windows: consecutive windows below ``clear_ratio`` to clear. Default 4.
        window_s: length of an evaluation window, seconds. Default 2.0.
        min_steps: steps a rank must complete in a window to be scored (the window waits for them, up to 5
            window lengths). Default 3.
        baseline_windows: windows forming a rank's own baseline for the individual score. Default 5.
        action: ``"report"`` (event, status) or ``"replace"`` (also swap a slow node for a spare by policy).
        horizon_s: time over which a replacement's saving is projected, seconds. Default 3600.
        restart_cost_s: node-level restart cost assumed until one is measured, seconds. Default 60.
        margin: replace only when the projected saving is at least this multiple of the cost. Default 2.
        cooldown_s: at least this long between two replacements, seconds. Default 300.
        max_listed: slow ranks listed in the status at most. Default 16.
        link: slow-link localisation (:class:`~trainguard.recovery.link_locator.LinkProbeConfig`): probe the
            nodes' links when the job slows down with no compute straggler.
    """

    slow_ratio: float = 1.3
    clear_ratio: float = 1.1
    min_excess: float = 0.1
    persist_windows: int = 6
    clear_windows: int = 4
    window_s: float = 2.0
    min_steps: int = 3
    baseline_windows: int = 5
    action: str = "report"
    horizon_s: float = 3600.0
    restart_cost_s: float = 60.0
    margin: float = 2.0
    cooldown_s: float = 300.0
    max_listed: int = 16
    link: LinkProbeConfig = field(default_factory=LinkProbeConfig)

    def validate(self) -> None:
        """Checks every field.

        Raises:
            InvalidRequestError: a field is out of range; the message names it.
        """
        if not self.slow_ratio > 1.0:
            raise InvalidRequestError(f"failslow slow_ratio={self.slow_ratio} must be > 1")
        if not 1.0 <= self.clear_ratio < self.slow_ratio:
            raise InvalidRequestError(f"failslow clear_ratio={self.clear_ratio} must be in [1, slow_ratio)")
        for name in ("persist_windows", "clear_windows", "min_steps", "baseline_windows", "max_listed"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"failslow {name}={getattr(self, name)} must be >= 1")
        for name in ("window_s", "horizon_s", "restart_cost_s", "margin"):
            if not getattr(self, name) > 0:
                raise InvalidRequestError(f"failslow {name}={getattr(self, name)} must be > 0")
        if not 0 <= self.min_excess < 1:
            raise InvalidRequestError(f"failslow min_excess={self.min_excess} must be in [0, 1)")
        if self.cooldown_s < 0:
            raise InvalidRequestError(f"failslow cooldown_s={self.cooldown_s} must be >= 0")
        if self.action not in ("report", "replace"):
            raise InvalidRequestError(f"failslow action={self.action!r}: use 'report' or 'replace'")
        self.link.validate()


@dataclass(frozen=True)
class Timing:
    """One rank's timing summary from one heartbeat (seconds; negative wait/compute: not measured)."""

    rank: int
    node_id: str
    step: int
    step_s: float
    wait_s: float
    compute_s: float
    steps: int


@dataclass
class _Track:
    """What the detector keeps about one rank (or one node)."""

    state: FlagState = FlagState.HEALTHY
    over: int = 0
    under: int = 0
    since: float = 0.0
    ratio: float = 1.0
    excess_s: float = 0.0
    basis: str = "wait"


@dataclass(frozen=True)
class SlowFinding:
    """A flagged rank or node."""

    rank: int  # -1 for a node finding
    node_id: str
    ratio: float
    excess_s: float
    since: float
    basis: str
    individual: float


@dataclass(frozen=True)
class WindowSnapshot:
    """A closed window's samples, taken under the caller's lock and scored outside it (:meth:`StragglerDetector.
    score`).

    Attributes:
        epoch: the detector's epoch when the window closed (a reset in between makes the scores stale).
        seq: the window's number within the detector (an older window scored late is dropped).
        generation: the job generation of the samples.
        time: when the window closed, seconds.
        samples: rank -> the summaries of the window.
        node_of: rank -> node id.
    """

    epoch: int
    seq: int
    generation: int
    time: float
    samples: Mapping[int, list[Timing]]
    node_of: Mapping[int, str]


@dataclass(frozen=True)
class WindowResult:
    """What one closed window found."""

    time: float
    job_step_s: float
    job_slowdown: float
    ratios: dict[int, float]
    node_ratios: dict[str, float]
    slow_ranks: tuple[SlowFinding, ...]
    slow_nodes: tuple[SlowFinding, ...]
    newly_flagged: tuple[SlowFinding, ...] = ()
    generation: int = -1
    epoch: int = 0
    suspects: int = 0  # ranks and nodes over slow_ratio whose flag is still persisting (not SLOW yet)


#: First windows of a rank left out of its baseline (start-up: imports, allocator warm-up, first restore).
_WARMUP_WINDOWS = 2


def _median(xs: Iterable[float]) -> float:
    vals = list(xs)
    return statistics.median(vals) if vals else math.nan


def _leave_one_out_medians(values: Mapping[Any, float]) -> dict[Any, float]:
    """For each key, the median of the *other* values; O(n log n), so 100k ranks cost one sort per window."""
    order = sorted(values, key=values.__getitem__)
    vals = [values[k] for k in order]
    n = len(vals)
    out = {}
    for i, k in enumerate(order):
        def at(j: int) -> float:  # j-th smallest of the others
            return vals[j] if j < i else vals[j + 1]
        m = n - 1
        out[k] = at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2.0
    return out


def _relative_to_others(values: Mapping[Any, float]) -> tuple[dict[Any, float], dict[Any, float]]:
    """Each key's value against the median of the others: (ratio, excess over it). Empty below two keys."""
    ratios: dict[Any, float] = {}
    excess: dict[Any, float] = {}
    if len(values) >= 2:
        for k, others in _leave_one_out_medians(values).items():
            v = values[k]
            ratios[k] = v / others if others > 0 else (math.inf if v > 0 else 1.0)
            excess[k] = max(0.0, v - others)
    return ratios, excess


class StragglerDetector:
    """Scores ranks and nodes window by window (see the module docstring).

    Args:
        config: the knobs (validated here).

    Raises:
        InvalidRequestError: the config is invalid.
    """

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self.config.validate()
        self._window_start: float | None = None
        self._samples: dict[int, list[Timing]] = {}
        self._steps: dict[int, int] = {}  # steps per rank in the open window (kept as samples come: O(1) a beat)
        self._short = 0  # ranks of the open window below min_steps
        self._node_of: dict[int, str] = {}
        self._node_of_shared = False  # handed to a snapshot: copy before the next change
        self._ranks: dict[int, _Track] = {}
        self._nodes: dict[str, _Track] = {}
        self._baseline_obs: dict[int, list[float]] = {}
        self._individual: dict[int, float] = {}
        self._windows_seen: dict[int, int] = {}
        self.generation = -1
        self.last: WindowResult | None = None
        # Scoring may run outside the caller's lock (collect() under it, score() after): ``_state_lock`` guards
        # the epoch and the flag tracks against a concurrent reset(); ``_score_lock`` runs one scoring at a time
        # (the baselines and tracks belong to it).
        self._state_lock = threading.Lock()
        self._score_lock = threading.Lock()
        self._epoch = 0
        self._seq = 0
        self._scored_seq = 0

    # -- input -----------------------------------------------------------------------------------------------
    def observe(self, generation: int, timings: Iterable[Timing], now: float) -> WindowResult | None:
        """Adds heartbeat summaries; closes and scores the window when it is due (:meth:`collect` then
        :meth:`score`, for a caller with no lock to keep short).

        Args:
            generation: the job generation the summaries belong to (older ones are ignored).
            timings: summaries from one heartbeat.
            now: current time, seconds (any monotonic clock).

        Returns:
            The closed window's result, or None when no window closed.
        """
        snap = self.collect(generation, timings, now)
        return self.score(snap) if snap is not None else None

    def collect(self, generation: int, timings: Iterable[Timing], now: float) -> WindowSnapshot | None:
        """Adds heartbeat summaries; when the window is due, detaches its samples (cheap: no scoring).

        A new generation (a restart) starts fresh windows and flags: the ranks may sit on other nodes now.

        Args:
            generation: the job generation the summaries belong to (older ones are ignored).
            timings: summaries from one heartbeat.
            now: current time, seconds (any monotonic clock).

        Returns:
            The closed window to :meth:`score` (possibly outside the caller's lock), or None.
        """
        if generation < self.generation:
            return None
        if generation > self.generation:
            self.reset(generation)
        if self._window_start is None:
            self._window_start = now
        for t in timings:
            if t.steps <= 0 or not (t.step_s > 0 and math.isfinite(t.step_s)):
                continue
            self._samples.setdefault(t.rank, []).append(t)
            before = self._steps.get(t.rank, 0)
            after = self._steps[t.rank] = before + t.steps
            self._short += (after < self.config.min_steps) - (0 < before < self.config.min_steps)
            if self._node_of.get(t.rank) != t.node_id:
                if self._node_of_shared:  # a snapshot being scored reads the old map
                    self._node_of, self._node_of_shared = dict(self._node_of), False
                self._node_of[t.rank] = t.node_id
        return self._maybe_close(now)

    def reset(self, generation: int) -> None:
        """Forgets windows and flags (kept: individual baselines, which belong to the ranks' history)."""
        with self._state_lock:
            self._epoch += 1
            self.generation = generation
            self._window_start = None
            self._samples, self._steps, self._short = {}, {}, 0
            self._node_of, self._node_of_shared = {}, False
            self._ranks = {}  # new objects: a scoring still running on the old ones cannot touch these
            self._nodes = {}
            self.last = None

    def forget_baselines(self) -> None:
        """Forgets the ranks' own baselines (a world of another size: every rank does other work now).

        A shrink from 4 to 3 nodes made each rank's step 4/3 as long; against the baselines of the larger world
        the job read 1.33x slow for good (the baselines are complete and no longer learn), which the link probes
        and the replacement estimate took for a real slowdown. New dicts, not cleared ones: a scoring still running
        works on its own (its result is stale anyway, the generation changed)."""
        with self._state_lock:
            self._baseline_obs, self._individual, self._windows_seen = {}, {}, {}

    def _maybe_close(self, now: float) -> WindowResult | None:
        cfg = self.config
        age = now - (now if self._window_start is None else self._window_start)
        if age < cfg.window_s:
            return None
        # O(1) per beat: this runs under the coordinator's lock on every heartbeat once the window is due.
        if age < 5 * cfg.window_s and (len(self._steps) < 2 or self._short > 0):
            return None
        samples, self._samples, self._steps, self._short = self._samples, {}, {}, 0
        self._window_start = now
        self._seq += 1
        self._node_of_shared = True  # no copy of 16k entries under the lock: copied on the next change instead
        return WindowSnapshot(self._epoch, self._seq, self.generation, now, samples, self._node_of)

    # -- scoring ---------------------------------------------------------------------------------------------
    def score(self, snap: WindowSnapshot) -> WindowResult | None:
        """Scores a closed window (thread-safe; needs no outside lock).

        Returns:
            The result (also kept as :attr:`last`), or None when the window went stale: the detector was reset
            (a new generation) since it closed, or a newer window was scored first.
        """
        with self._score_lock:
            with self._state_lock:
                if snap.epoch != self._epoch or snap.seq <= self._scored_seq:
                    return None
                ranks, nodes = self._ranks, self._nodes
            result = self._score(snap, ranks, nodes)
            with self._state_lock:
                if snap.epoch != self._epoch:
                    return None
                self._scored_seq = snap.seq
                self.last = result
            return result

    def is_current(self, result: WindowResult) -> bool:
        """Whether ``result`` still belongs to the detector's epoch (no reset since it was scored)."""
        return result.epoch == self._epoch

    def _score(self, snap: WindowSnapshot, ranks: dict[int, _Track], nodes: dict[str, _Track]) -> WindowResult:
        cfg = self.config
        now, samples, node_of = snap.time, snap.samples, snap.node_of
        step = {r: _median(t.step_s for t in ts) for r, ts in samples.items()}
        own = {r: _median(t.compute_s for t in ts if t.compute_s >= 0) for r, ts in samples.items()}
        own = {r: v for r, v in own.items() if not math.isnan(v)}
        # "wait": own work is the step less the time waiting for peers (the slow rank waits least); "step":
        # no wait was timed, so own work is the whole step and ranks differ only by noise and start-up skew.
        waits_known = any(t.wait_s >= 0 for ts in samples.values() for t in ts)
        basis = "wait" if waits_known else "step"
        job_step = _median(step.values())

        # Individual scores against each rank's own baseline.
        for r, s in step.items():
            obs = self._baseline_obs.setdefault(r, [])
            self._windows_seen[r] = self._windows_seen.get(r, 0) + 1
            if len(obs) < cfg.baseline_windows and self._windows_seen[r] > _WARMUP_WINDOWS:
                obs.append(s)
            base = _median(obs)
            self._individual[r] = s / base if base > 0 else 1.0
        job_slowdown = _median(self._individual[r] for r in step) if step else 1.0

        ratios, excess = _relative_to_others(own)
        node_own: dict[str, list[float]] = {}
        for r, v in own.items():
            node_own.setdefault(node_of.get(r, "?"), []).append(v)
        node_med = {n: _median(vs) for n, vs in node_own.items()}
        node_ratios, node_excess = _relative_to_others(node_med)

        newly: list[SlowFinding] = []
        floor = cfg.min_excess * job_step if job_step == job_step else 0.0
        for r, ratio in ratios.items():
            tr = ranks.setdefault(r, _Track())
            if self._advance(tr, ratio, excess[r], basis, now, floor):
                newly.append(self._finding(r, node_of.get(r, "?"), tr, node_of))
        for n, ratio in node_ratios.items():
            tr = nodes.setdefault(n, _Track())
            if self._advance(tr, ratio, node_excess[n], basis, now, floor):
                newly.append(self._finding(-1, n, tr, node_of))
        slow_ranks = tuple(sorted((self._finding(r, node_of.get(r, "?"), tr, node_of) for r, tr in ranks.items()
                                   if tr.state is FlagState.SLOW), key=lambda f: -f.ratio))
        slow_nodes = tuple(sorted((self._finding(-1, n, tr, node_of) for n, tr in nodes.items()
                                   if tr.state is FlagState.SLOW), key=lambda f: -f.ratio))
        suspects = sum(tr.state is FlagState.SUSPECT for tracks in (ranks, nodes) for tr in tracks.values())
        return WindowResult(now, job_step, job_slowdown, ratios, node_ratios, slow_ranks, slow_nodes,
                            tuple(newly), snap.generation, snap.epoch, suspects)

    def _advance(self, tr: _Track, ratio: float, excess: float, basis: str, now: float, floor: float) -> bool:
        """Moves one track through :data:`TRANSITIONS`; True when it just became SLOW."""
        cfg = self.config
        over = ratio >= cfg.slow_ratio and excess >= floor
        tr.over = tr.over + 1 if over else 0
        tr.under = tr.under + 1 if ratio < cfg.clear_ratio else 0
        tr.ratio, tr.excess_s, tr.basis = ratio, excess, basis
        before = tr.state
        state = TRANSITIONS[(before, "over" if over else "under")]
        if state is FlagState.SUSPECT and tr.over >= cfg.persist_windows:
            state = TRANSITIONS[(state, "persisted")]
        elif state is FlagState.SLOW and tr.under >= cfg.clear_windows:
            state = TRANSITIONS[(state, "cleared")]
        tr.state = state
        if state is FlagState.SLOW and before is not FlagState.SLOW:
            tr.since = now
            return True
        return False

    def _finding(self, rank: int, node: str, tr: _Track, node_of: Mapping[int, str]) -> SlowFinding:
        ind = self._individual.get(rank, 1.0) if rank >= 0 else _median(
            self._individual.get(r, 1.0) for r, n in node_of.items() if n == node)
        return SlowFinding(rank, node, tr.ratio, tr.excess_s, tr.since, tr.basis, ind)

    # -- views -----------------------------------------------------------------------------------------------
    def state_of(self, rank: int) -> FlagState:
        """The flag state of ``rank`` (HEALTHY when never scored)."""
        tr = self._ranks.get(rank)
        return tr.state if tr is not None else FlagState.HEALTHY

    def node_state(self, node_id: str) -> FlagState:
        """The flag state of ``node_id`` (HEALTHY when never scored)."""
        tr = self._nodes.get(node_id)
        return tr.state if tr is not None else FlagState.HEALTHY


@dataclass(frozen=True)
class ReplaceDecision:
    """Replace ``node_id`` with a spare; ``detail`` says why, with the numbers."""

    node_id: str
    detail: str
    saved_s: float
    cost_s: float
    ranks: tuple[int, ...] = ()  # the node's slow ranks it is replaced for (empty: none flagged on their own)


@dataclass
class ReplacePolicy:
    """Decides whether a slow node is worth a node-level restart, and learns what one costs.

    The saving of replacing a node that costs the job ``excess_s`` of every ``step_s`` over a horizon ``H`` is
    ``H * excess_s / step_s`` (the time the same steps would take less). When that node is the only one flagged
    and the job's step grew against its own baseline, the growth counts as its excess if larger (a slow link
    delays every rank's collective, not the node's own work). The cost is the last measured
    node-level restart: from the decision until the job is back at the step it had reached (so it includes the
    work lost since the last checkpoint), or ``restart_cost_s`` before any was measured.

    Slowness that follows the rank. A replacement takes the slot, so the new node runs the same ranks. A rank
    slow because of its role (the last pipeline stage, rank 0 logging) is just as slow on the new node; the
    policy remembers the slow ranks each replacement was for, and a node flagged again for one of those ranks
    is reported, never replaced: the rank is slow, not the node, and replacing would burn spare after spare.
    """

    config: StragglerConfig
    cost_s: float = 0.0
    measured: bool = False
    last_replace: float = -math.inf
    replaced: list[str] = field(default_factory=list)
    verdict: str = ""  # why the last slow node weighed was not replaced ("" when it was, or none was weighed)
    replaced_for: dict[int, str] = field(default_factory=dict)  # slow rank -> node replaced for it (first one)
    world_size: int = 0  # ranks of the generation running now, which replaced_for's ranks are numbered in
    _pending: tuple[float, int, int] | None = None  # (decision time, step reached, generation) of a replacement

    def __post_init__(self) -> None:
        if not self.cost_s:
            self.cost_s = self.config.restart_cost_s

    def decide(self, result: WindowResult, now: float, spares: int) -> ReplaceDecision | None:
        """A replacement for the worst slow node, when it pays off (or None).

        Args:
            result: the window just closed.
            now: current time, seconds (same clock as the detector's).
            spares: spare nodes available now (0: nothing to replace with, report only).
        """
        cfg = self.config
        if cfg.action != "replace" or not result.slow_nodes or self._pending is not None or spares <= 0:
            return None
        worst = result.slow_nodes[0]
        if not result.job_step_s > 0:
            return None
        ranks = tuple(sorted(f.rank for f in result.slow_ranks if f.node_id == worst.node_id))
        followed = [r for r in ranks if r in self.replaced_for and self.replaced_for[r] != worst.node_id]
        if followed:
            r = followed[0]
            self.verdict = (f"not replacing node {worst.node_id}: rank {r} was as slow on node "
                            f"{self.replaced_for[r]}, replaced for it; the slowness follows the rank (its role, "
                            f"e.g. the last pipeline stage), not the node: look at rank {r}'s work")
            return None
        if now - self.last_replace < cfg.cooldown_s:
            return None
        excess = worst.excess_s
        if len(result.slow_nodes) == 1 and result.job_slowdown > 1.0:
            # The own-work excess understates what a lone slow node costs: a slow link shows as a small one (its
            # node waits a little less in the collective), and a CPU-starved rank is also starved inside its
            # `comm` section, which then counts as waiting. When one node is flagged, the job's step growth
            # against its own baseline is the direct measure of what replacing it wins back.
            excess = max(excess, result.job_step_s * (1.0 - 1.0 / result.job_slowdown))
        saved = cfg.horizon_s * excess / result.job_step_s
        if saved < cfg.margin * self.cost_s:
            self.verdict = (f"not replacing node {worst.node_id}: it costs {excess * 1000:.0f} ms of every "
                            f"{result.job_step_s * 1000:.0f} ms step, ~{saved:.0f} s over {cfg.horizon_s:.0f} s, "
                            f"less than {cfg.margin:g} x the {'measured' if self.measured else 'assumed'} restart "
                            f"cost of {self.cost_s:.1f} s")
            return None
        self.verdict = ""
        detail = (f"straggler node {worst.node_id}: own work {worst.ratio:.2f}x the other nodes' median, "
                  f"{excess * 1000:.0f} ms of every {result.job_step_s * 1000:.0f} ms step; replacing saves "
                  f"~{saved:.0f} s over {cfg.horizon_s:.0f} s against "
                  f"{'a measured' if self.measured else 'an assumed'} restart cost of {self.cost_s:.1f} s")
        return ReplaceDecision(worst.node_id, detail, saved, self.cost_s, ranks)

    def new_world(self, world_size: int) -> None:
        """A generation formed with ``world_size`` ranks. Another size than before (a shrink) numbered every rank
        anew, so a rank a replacement was for names other work now: those are forgotten, or the node now holding
        that number would be reported as a role straggler and never replaced however slow it is."""
        if world_size != self.world_size and self.replaced_for:
            self.replaced_for.clear()
        self.world_size = world_size

    def applied(self, decision: ReplaceDecision, now: float, step_reached: int, generation: int) -> None:
        """Notes that the coordinator replaced the node (starts the cost measurement and the cooldown)."""
        self.last_replace = now
        self.replaced.append(decision.node_id)
        for r in decision.ranks:
            self.replaced_for.setdefault(r, decision.node_id)
        self._pending = (now, step_reached, generation)

    def progress(self, generation: int, step: int, now: float) -> float | None:
        """Feeds the job's step; returns the measured restart cost once a replacement has caught up."""
        p = self._pending
        if p is None or generation <= p[2] or step < p[1]:
            return None
        self._pending = None
        self.cost_s = now - p[0]
        self.measured = True
        return self.cost_s

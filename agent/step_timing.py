"""The agent's small relay of step timing and fail-slow findings between workers and the coordinator.

Workers report each step's wall time and section times (:meth:`trainguard.hook.Session.section`). The agent
does not judge them (one node cannot tell a straggler from a job-wide slowdown); it summarises each local rank
over the steps since its last coordinator heartbeat (medians, so one odd step weighs little) and sends the
summaries with that heartbeat. The coordinator's findings come back in heartbeat replies;
:class:`FailSlowView` keeps the latest for ``trainguard status`` and turns new ones into health events, so
``trainguard events`` on any node shows them.
"""

from __future__ import annotations

import math
import re
import statistics
import threading
import time
from collections.abc import Mapping

from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.proto import common_pb2, coordinator_pb2

#: Section whose time is waiting for peers (see :mod:`trainguard.step_timer`).
WAIT_SECTION = "comm"
#: Steps kept per rank between two heartbeats (a fast job's extra steps are dropped from the summary, oldest
#: first; the median of the newest is enough).
MAX_STEPS_PER_RANK = 256


#: Characters of a worker's stack a hang report carries (the main thread's innermost frames).
STACK_EVIDENCE_CHARS = 3000
_FH_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):")
_PYSPY_HEADER = re.compile(r'^Thread\s+\S+\s+\([^)]*\):\s*"(?P<name>[^"]*)"')


def main_thread_stack(text: str, limit: int = STACK_EVIDENCE_CHARS) -> str:
    """The main thread's part of a py-spy or faulthandler dump, at most ``limit`` characters (innermost first).

    faulthandler lists the threads newest first, so the main thread, the oldest, comes last; py-spy names it
    ``MainThread``. The head of the whole dump was kept: behind a few helper threads (the hook's heartbeat,
    data-loader pinning, tqdm, wandb) the main thread was cut off, and the hang locator, which reads the last
    thread of a faulthandler dump as the main one, grouped the ranks by a helper thread's ``wait``.

    Args:
        text: the dump (or the reason there is none, kept as is).
        limit: characters kept.
    """
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if _FH_HEADER.match(line) or _PYSPY_HEADER.match(line)]
    if not starts:
        return text[:limit]
    blocks = [lines[a:b] for a, b in zip(starts, starts[1:] + [len(lines)])]
    named = [b for b in blocks if (m := _PYSPY_HEADER.match(b[0])) is not None and m.group("name") == "MainThread"]
    if named:
        return "".join(named[0])[:limit]
    if _FH_HEADER.match(blocks[-1][0]):
        return "".join(blocks[-1])[:limit]
    return text[:limit]


def _finite_nonneg(x: float) -> bool:
    return math.isfinite(x) and x >= 0


class TimingRelay:
    """Per-rank step timing since the last heartbeat; thread-safe (the gRPC threads record, the loop drains)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = -1
        self._steps: dict[int, list[tuple[float, float, float]]] = {}
        self._last_step: dict[int, int] = {}

    def record(self, generation: int, rank: int, step: int, step_s: float, sections: Mapping[str, float]) -> None:
        """Notes one completed step of a local rank.

        Args:
            generation: the worker's generation (a new one drops the old summaries).
            rank: global rank.
            step: the step completed.
            step_s: its wall time, seconds (0: unknown, e.g. the first step after a start; skipped).
            sections: seconds per section name in that step; ``comm`` is the wait.
        """
        if step < 0 or not (_finite_nonneg(step_s) and step_s > 0):
            return
        if any(not _finite_nonneg(v) for v in sections.values()):
            return
        wait = sections.get(WAIT_SECTION, -1.0) if sections else -1.0
        compute = max(0.0, step_s - max(wait, 0.0)) if sections else -1.0
        with self._lock:
            if generation != self._generation:
                self._generation = generation
                self._steps.clear()
                self._last_step.clear()
            buf = self._steps.setdefault(rank, [])
            buf.append((step_s, wait, compute))
            if len(buf) > MAX_STEPS_PER_RANK:
                del buf[0]
            self._last_step[rank] = max(step, self._last_step.get(rank, -1))

    def drain(self) -> list[coordinator_pb2.RankTiming]:
        """The summaries since the last call (one per rank that completed steps), and a fresh window."""
        with self._lock:
            steps, self._steps = self._steps, {}
            last = dict(self._last_step)
        out = []
        for rank, buf in sorted(steps.items()):
            if not buf:
                continue
            waits = [w for _, w, _ in buf if w >= 0]
            computes = [c for _, _, c in buf if c >= 0]
            out.append(coordinator_pb2.RankTiming(
                rank=rank, step=last.get(rank, -1), step_s=statistics.median(s for s, _, _ in buf),
                wait_s=statistics.median(waits) if waits else -1.0,
                compute_s=statistics.median(computes) if computes else -1.0, steps=len(buf)))
        return out


def hang_location(ev: HealthEvent) -> tuple[int, list[int], str] | None:
    """(generation, outlier ranks, "rank(s) R on NODE in FRAME") of a ``failslow.hang_localised`` event of
    :meth:`FailSlowView.update`; None for any other event or one without outliers."""
    e = ev.evidence
    if ev.kind != "failslow.hang_localised":
        return None
    try:
        generation = int(e.get("generation", ""))
    except ValueError:
        return None
    outliers = [int(r) for r in e.get("outlier_ranks", "").split(",") if r.strip().isdigit()]
    if not outliers:
        return None
    named = ", ".join(map(str, outliers[:8])) + (f" and {len(outliers) - 8} more" if len(outliers) > 8 else "")
    nodes = (e.get("outlier_nodes") or "?").split(",")
    where = ", ".join(nodes[:4]) + (f" and {len(nodes) - 4} more" if len(nodes) > 4 else "")
    return generation, outliers, f"rank(s) {named} on {where} in {e.get('outlier_frame') or '?'}"


class FailSlowView:
    """The coordinator's latest fail-slow findings as this node saw them, and the events they raise."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.status = common_pb2.FailSlowStatus()
        self._seen: set[tuple] = set()

    def update(self, status: common_pb2.FailSlowStatus) -> list[HealthEvent]:
        """Keeps ``status``; returns an event for each straggler or hang finding not seen before."""
        self.status = status
        events = []
        for s in status.slow:
            key = ("slow", s.rank, round(s.since, 3))
            if key in self._seen:
                continue
            self._seen.add(key)
            if s.basis == "link":
                events.append(HealthEvent(
                    source="failslow", kind="failslow.slow_link", severity=Severity.WARNING, action=Action.WATCH,
                    subject=f"node:{s.node_id}", node_id=self.node_id,
                    message=(f"node {s.node_id}'s links are slow in every probed pair ({s.ratio:.1f}x below the "
                             f"others); the job runs {s.individual:.2f}x slower than its baseline; action: "
                             f"{status.action or 'report'}"),
                    evidence={"node": s.node_id, "ratio": f"{s.ratio:.4f}", "excess_s": f"{s.excess_s:.6f}",
                              "job_slowdown": f"{s.individual:.4f}", "probe": status.link_probe[:500]}))
                continue
            events.append(HealthEvent(
                source="failslow", kind="failslow.straggler", severity=Severity.WARNING, action=Action.WATCH,
                subject=f"rank:{s.rank}", node_id=self.node_id,
                message=(f"rank {s.rank} on node {s.node_id} is {s.ratio:.2f}x the job's median ({s.basis}); "
                         f"the job loses {s.excess_s * 1000:.0f} ms per step; action: {status.action or 'report'}"),
                evidence={"rank": str(s.rank), "node": s.node_id, "ratio": f"{s.ratio:.4f}",
                          "excess_s": f"{s.excess_s:.6f}", "basis": s.basis, "individual": f"{s.individual:.4f}",
                          "job_step_s": f"{status.job_step_s:.6f}"}))
        h = status.hang
        if h.outlier_ranks or h.ranks_seen:
            key = ("hang", h.generation, round(h.time, 3))
            if key not in self._seen:
                self._seen.add(key)
                ranks = ",".join(str(r) for r in h.outlier_ranks) or "none"
                events.append(HealthEvent(
                    source="failslow", kind="failslow.hang_localised", severity=Severity.ERROR, action=Action.WATCH,
                    subject=f"ranks:{ranks}", node_id=self.node_id,
                    message=(f"hang in generation {h.generation}: outlier rank(s) {ranks} on "
                             f"{','.join(h.outlier_nodes) or '-'} in {h.outlier_frame or '?'}; the other ranks wait "
                             f"in {h.majority_frame or '?'} ({h.ranks_seen} ranks, {h.groups} stack groups)"),
                    evidence={"outlier_ranks": ranks, "outlier_nodes": ",".join(h.outlier_nodes),
                              "outlier_frame": h.outlier_frame, "generation": str(h.generation),
                              "repeats": str(h.repeats)}))
        return events


def stack_evidence(pid_by_rank: Mapping[int, int], timeout_s: float = 5.0) -> dict[str, str]:
    """Dumps the Python stacks of live local workers at once (in parallel) for a hang localisation.

    Args:
        pid_by_rank: rank -> pid of the workers to dump.
        timeout_s: per-dump limit, seconds.

    Returns:
        ``{"stack.<rank>": text}`` (the innermost part of each dump, at most 3000 characters),
        ``{"method.<rank>": "py-spy"|"faulthandler"|"none"}`` and ``{"dump_s": seconds}``.
    """
    from concurrent.futures import ThreadPoolExecutor

    from trainguard.detectors.stackdump import dump_stack

    if not pid_by_rank:
        return {}
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=min(8, len(pid_by_rank))) as pool:
        dumps = dict(zip(pid_by_rank, pool.map(lambda pid: dump_stack(pid, timeout_s=timeout_s),
                                               pid_by_rank.values())))
    out: dict[str, str] = {"dump_s": f"{time.monotonic() - t0:.3f}"}
    for rank, d in dumps.items():
        out[f"stack.{rank}"] = main_thread_stack(d.text)
        out[f"method.{rank}"] = d.method
    return out

"""Runs the ETTR model for the shipped traces and renders its tables, JSON and plot (``trainguard ettr``)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from trainguard.drill.components import Components
from trainguard.drill.errors import DrillError
from trainguard.drill.ettr import JobSize, SystemReport, cumulative_useful, format_report, simulate
from trainguard.drill.trace import FaultTrace, llama3_trace, load_stepfun


@dataclass
class TraceComparison:
    """trainguard and the baseline replayed on one trace."""

    trace: FaultTrace
    job: JobSize
    reports: list[SystemReport]

    def table(self) -> str:
        """The comparison as a text table."""
        return format_report(self.reports, f"{self.trace.source} -> job of {self.job.gpus} GPUs "
                                           f"({self.job.nodes} nodes)")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready figures."""
        out: dict[str, Any] = {"trace": self.trace.name, "source": self.trace.source, "gpus": self.job.gpus,
                               "nodes": self.job.nodes, "systems": {}}
        for rep in self.reports:
            r = rep.result
            out["systems"][r.system] = {
                "ettr": r.ettr, "interval_s": r.interval_s, "optimised": rep.optimised,
                "young_s": rep.young_daly.young_s, "daly_s": rep.young_daly.daly_s,
                "mtbf_work_losing_s": rep.young_daly.mtbf_s, "faults": r.faults, "span_s": r.span_s,
                "useful_s": r.useful_s, "stall_s": r.stall_s, "lost_s": r.lost_s, "down_s": r.down_s,
                "components": rep.components.as_dict(),
            }
        return out


def load_traces(kinds: list[str], trace_path: str | None, llama_days: float, seed: int) -> list[FaultTrace]:
    """The traces named in ``kinds`` (``stepfun``, ``llama3``).

    Raises:
        TraceError: the StepFun trace is missing or malformed.
    """
    out = []
    for k in kinds:
        out.append(load_stepfun(trace_path) if k == "stepfun" else llama3_trace(days=llama_days, seed=seed))
    return out


def compare(trace: FaultTrace, job: JobSize, systems: list[Components]) -> TraceComparison:
    """Replays ``trace`` for each system."""
    return TraceComparison(trace=trace, job=job, reports=[simulate(trace, job, c) for c in systems])


def plot_comparison(path: str | os.PathLike, cmp: TraceComparison) -> str:
    """Draws ETTR over time of every system and the fault timeline (with the first system's downtime)."""
    from trainguard.drill.plot import FaultMark, Series, plot_ettr

    series = []
    for rep in cmp.reports:
        t, u = cumulative_useful(rep.timeline, rep.result)
        series.append(Series(label=rep.result.system, times_s=t, useful_s=u, ettr=rep.result.ettr))
    tl = cmp.reports[0].timeline
    marks = [FaultMark(time_s=float(t), kind=c.value, down_s=float(d))
             for t, c, d in zip(tl.times_s, tl.classes, tl.down_s)]
    title = (f"ETTR, {cmp.trace.name} trace replayed on {cmp.job.gpus:,} GPUs: "
             + " vs ".join(f"{r.result.system} {100 * r.result.ettr:.1f}%" for r in cmp.reports))
    return plot_ettr(path, series, marks, tl.span_s, title, time_unit="days", bins=68)


def check_output_file(path: str | os.PathLike, flag: str) -> None:
    """Refuses an output path that cannot become a file, before the work that fills it is done.

    Args:
        path: where ``flag`` asks the output to go.
        flag: the option naming it, for the message (``--json``).

    Raises:
        DrillError: ``path`` is a folder, the nearest existing folder above it is a file, or its folder cannot be
            made or written.
    """
    p = os.path.abspath(os.fspath(path))
    if os.path.isdir(p):
        raise DrillError(f"{flag} {os.fspath(path)} is a folder; name a file in it, e.g. "
                         f"{os.path.join(os.fspath(path), 'out')}")
    parent = os.path.dirname(p)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise DrillError(f"{flag} {os.fspath(path)}: {parent} is a file, not a folder; pick another path")
    # The writers make the folder and write a temporary file beside the output; try both now. A folder the user
    # may not write (or one that cannot be made, under /proc) failed only after the minutes of drill it reports.
    folder = os.path.dirname(p)
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tg-probe-"):
            pass
    except OSError as exc:
        raise DrillError(f"{flag} {os.fspath(path)}: cannot write in {folder} ({exc.strerror or exc}); pick "
                         "another path") from None


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float as None: JSON has no Infinity or NaN (jq, browsers and strict
    parsers reject the file), and Young/Daly of a system that loses no work is infinite."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json_file(path: str | os.PathLike, data: Any, flag: str = "--json") -> None:
    """Writes ``data`` as strict JSON to ``path`` atomically (non-finite numbers as null), creating its folder
    (as the plots do).

    Raises:
        DrillError: the file cannot be written (named with ``flag``); no partial or temporary file is left.
    """
    out = os.fspath(path)
    tmp = f"{out}.tmp"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(tmp, "w") as f:
            # default=str first: objects (paths, enums) become strings; then non-finite floats become null
            json.dump(_finite(json.loads(json.dumps(data, default=str))), f, indent=1, allow_nan=False)
        os.replace(tmp, out)
    except OSError as exc:
        # a folder in the way, a full disk, a read-only mount: one line, and no stray .tmp next to it
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise DrillError(f"cannot write {flag} {out}: {exc}; pick another path") from exc


def write_json(path: str | os.PathLike, comparisons: list[TraceComparison]) -> None:
    """Writes every comparison's figures as JSON (atomically).

    Raises:
        DrillError: the file cannot be written.
    """
    write_json_file(path, [c.as_dict() for c in comparisons])

"""PNG plots of ETTR over time and the fault timeline (matplotlib, Agg backend, imported only when plotting).

Two panels share the time axis: above, ETTR per window for each system (and the whole-run figure as a dashed
line); below, one marker per fault, one row per fault class. The simulator and the soak drill both draw with
:func:`plot_ettr`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainguard.drill.errors import DrillError


@dataclass
class Series:
    """One system's kept compute over wall time.

    Attributes:
        label: legend label.
        times_s: knots of wall time, seconds, non-decreasing.
        useful_s: cumulative kept compute at each knot, seconds.
        ettr: whole-run ETTR, drawn as a dashed line.
    """

    label: str
    times_s: np.ndarray
    useful_s: np.ndarray
    ettr: float


@dataclass
class FaultMark:
    """One fault on the timeline.

    Attributes:
        time_s: wall time, seconds.
        kind: row label (fault class or injected kind).
        down_s: how long the job was down for it (drawn as a bar), seconds; 0 for a plain marker.
    """

    time_s: float
    kind: str
    down_s: float = 0.0


def windowed_ettr(series: Series, span_s: float, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """ETTR per window: kept compute gained in the window / window length.

    Args:
        series: the system's cumulative kept compute.
        span_s: wall time covered, seconds.
        bins: number of windows.

    Returns:
        (window centres, ETTR per window).
    """
    edges = np.linspace(0.0, span_s, bins + 1)
    u = np.interp(edges, series.times_s, series.useful_s)
    return (edges[:-1] + edges[1:]) / 2, np.diff(u) / np.diff(edges)


def plot_ettr(path: str | os.PathLike, series: Sequence[Series], faults: Sequence[FaultMark], span_s: float,
              title: str, *, time_unit: str = "days", bins: int = 60) -> str:
    """Writes the ETTR-over-time and fault-timeline figure as a PNG.

    Args:
        path: output file (``.png``); its folder is created.
        series: systems to draw.
        faults: faults to mark.
        span_s: wall time covered, seconds.
        title: figure title.
        time_unit: ``days``, ``hours``, ``minutes`` or ``seconds`` for the x axis.
        bins: windows for the ETTR curve.

    Returns:
        The path written.

    Raises:
        DrillError: matplotlib is missing, or the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise DrillError("plotting needs matplotlib: pip install matplotlib (or pass --no-plot)") from exc
    scale = {"days": 86_400.0, "hours": 3600.0, "minutes": 60.0, "seconds": 1.0}[time_unit]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5.2), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]},
                                   dpi=90)
    colors = ["tab:green", "tab:red", "tab:blue", "tab:orange"]
    for s, color in zip(series, colors):
        x, y = windowed_ettr(s, span_s, bins)
        ax1.step(x / scale, 100 * y, where="mid", color=color, lw=1.3, label=f"{s.label} ({100 * s.ettr:.1f}%)")
        ax1.axhline(100 * s.ettr, color=color, ls="--", lw=0.8)
    ax1.set_ylabel("ETTR per window (%)")
    lo = min([100 * s.ettr for s in series] + [50.0])
    ax1.set_ylim(0.0 if lo < 30 else lo - 10, 101)
    ax1.legend(loc="lower left", fontsize=8)
    ax1.set_title(title, fontsize=10)
    ax1.grid(alpha=0.3)
    kinds = sorted({f.kind for f in faults})
    row = {k: i for i, k in enumerate(kinds)}
    for f in faults:
        y = row[f.kind]
        if f.down_s > 0:
            ax2.barh(y, f.down_s / scale, left=f.time_s / scale, height=0.5, color="tab:gray", alpha=0.6)
        ax2.plot(f.time_s / scale, y, "|", color="black", ms=9)
    ax2.set_yticks(range(len(kinds)), kinds, fontsize=8)
    ax2.set_ylim(-0.7, max(len(kinds) - 0.3, 0.7))
    ax2.set_xlabel(f"wall time ({time_unit})")
    ax2.set_xlim(0, span_s / scale)
    ax2.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    out = os.fspath(path)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        # format named: without it matplotlib appends .png to a path with no suffix and writes elsewhere
        fig.savefig(out, format="png")
    except OSError as exc:
        raise DrillError(f"cannot write the plot {out}: {exc}; pick another --plot path") from exc
    finally:
        plt.close(fig)
    return out

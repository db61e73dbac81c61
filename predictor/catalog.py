"""The metric names the learned tier knows, and whether each is a counter or a gauge.

A node's sample is a flat ``dict[str, float]``. Counters are cumulative (monotone except at a reset, e.g. a
driver reload): features use their rate. Gauges are levels: features use the level, its drift and its slope.
The names below are the contract between the detectors (which produce them, summed or maxed over a node's
devices as noted) and the predictor. Any other numeric column is accepted too (:func:`classify_columns`):
declared a counter or gauge by the user, or taken as a counter when its name says so (``*_total``,
``*_count``) or its values never fall (except at rare resets), else as a gauge. Columns only the rules tier
reads (``gpu_xid_79_total``, ``nic_up``...) are left to it.
"""

from __future__ import annotations

import enum
import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


class MetricKind(enum.Enum):
    """How a metric evolves, which decides the features computed from it."""

    COUNTER = "counter"
    GAUGE = "gauge"


@dataclass(frozen=True)
class MetricInfo:
    """One known metric.

    Attributes:
        name: column name in samples and CSV files.
        kind: counter (cumulative) or gauge (level).
        unit: unit of the value (counters: of the counted thing).
        description: what it measures and how it is aggregated over a node's devices.
    """

    name: str
    kind: MetricKind
    unit: str
    description: str


_C, _G = MetricKind.COUNTER, MetricKind.GAUGE

#: Every metric the learned tier turns into features, in a fixed order.
CATALOG: tuple[MetricInfo, ...] = (
    MetricInfo("gpu_ecc_sbe_total", _C, "errors", "corrected (single-bit) ECC errors, volatile, summed over GPUs"),
    MetricInfo("gpu_ecc_dbe_total", _C, "errors", "uncorrected (double-bit) ECC errors, summed over GPUs"),
    MetricInfo("gpu_row_remap_pending", _G, "rows", "HBM rows pending remapping, summed over GPUs"),
    MetricInfo("gpu_xid_total", _C, "events", "non-fatal XID events (13, 31, 43, 63, 92, 94...), summed over GPUs"),
    MetricInfo("gpu_temp_c", _G, "degC", "hottest GPU core temperature"),
    MetricInfo("gpu_throttle_frac", _G, "fraction", "fraction of the interval any GPU was clock-throttled (0-1)"),
    MetricInfo("pcie_replay_total", _C, "replays", "PCIe replay counter, summed over GPUs and NICs"),
    MetricInfo("pcie_aer_corrected_total", _C, "errors", "AER correctable errors, summed over devices"),
    MetricInfo("nic_symbol_errors_total", _C, "errors", "physical symbol errors, summed over RDMA ports"),
    MetricInfo("nic_fec_corrected_total", _C, "blocks", "FEC-corrected blocks, summed over RDMA ports"),
    MetricInfo("nic_carrier_changes_total", _C, "changes", "carrier up/down transitions, summed over ports"),
    MetricInfo("rdma_retrans_total", _C, "packets", "RDMA retransmitted packets (out-of-sequence/timeouts)"),
    MetricInfo("rdma_cnp_total", _C, "packets", "RoCE congestion notification packets received"),
    MetricInfo("step_time_s", _G, "s", "duration of the last training step on this node"),
)

#: Name -> info.
BY_NAME: dict[str, MetricInfo] = {m.name: m for m in CATALOG}

def metric_family(name: str) -> str:
    """The family a metric belongs to for per-family alarm thresholds: its name up to the first ``_`` or
    ``.`` (the catalog's families are ``gpu``, ``pcie``, ``nic``, ``rdma`` and ``step``); a name without
    either is a family of its own."""
    for i, ch in enumerate(name):
        if ch in "_." and i > 0:
            return name[:i]
    return name


#: Columns of the interchange format that are not metrics.
RESERVED_COLUMNS: frozenset[str] = frozenset({"timestamp", "node", "job"})
#: The ``kind`` of a failure whose cause nobody named (an events row never has an empty kind).
UNKNOWN_KIND = "unknown"


def split_known(names: Iterable[str]) -> tuple[list[str], list[str]]:
    """Splits column names into those the learned tier knows (catalog order) and the rest (input order).

    Args:
        names: metric column names (reserved columns are skipped).

    Returns:
        ``(known, unknown)``.
    """
    given = [n for n in names if n not in RESERVED_COLUMNS]
    present = set(given)
    known = [m.name for m in CATALOG if m.name in present]
    unknown = [n for n in given if n not in BY_NAME]
    return known, unknown


#: Name endings that mark a cumulative counter (Prometheus naming).
COUNTER_SUFFIXES = ("_total", "_count", "_counter")
#: Share of a column's consecutive per-node steps that may fall (counter resets) for it to be taken as a counter.
COUNTER_MAX_DROP_SHARE = 0.01


@dataclass(frozen=True)
class ColumnKind:
    """How one column of a metrics table is used.

    Attributes:
        name: column name.
        kind: counter, gauge, or None when the learned tier does not use it.
        reason: why (``catalog``, ``declared``, ``name``, ``values``, ``rules tier``, ``fewer than two values on
            any node``).
    """

    name: str
    kind: MetricKind | None
    reason: str


def looks_like_counter(steps: np.ndarray) -> bool:
    """Whether consecutive per-node steps of a column look like a cumulative counter.

    Args:
        steps: finite differences between consecutive samples of one node (all nodes concatenated).

    Returns:
        True when it rises at least once and falls in at most :data:`COUNTER_MAX_DROP_SHARE` of the steps
        (a fall is a reset, e.g. a driver reload).
    """
    steps = steps[np.isfinite(steps)]
    if len(steps) < 10:
        return False
    return bool((steps > 0).any() and (steps < 0).mean() <= COUNTER_MAX_DROP_SHARE)


def classify_columns(
    columns: Sequence[str], node_steps: dict[str, np.ndarray] | None = None,
    counters: Iterable[str] = (), gauges: Iterable[str] = (), rule_patterns: Iterable[str] = (),
) -> list[ColumnKind]:
    """Decides how each metric column is used by the learned tier.

    Order of precedence: no values (fewer than two values of any node, when ``node_steps`` is given: nothing
    to learn from, whatever the name says), declared (``counters``/``gauges``), the catalog, a column the rules
    tier reads (unused by the learned tier unless declared), the name (``*_total``...), the values (never
    falling: counter), else gauge.

    Args:
        columns: metric column names (reserved columns are skipped).
        node_steps: column -> consecutive per-node differences (for value-based detection); None skips it.
        counters: names declared counters.
        gauges: names declared gauges.
        rule_patterns: metric name patterns the rules tier reads.

    Returns:
        One :class:`ColumnKind` per metric column, in input order.

    Raises:
        ValueError: a name is declared both a counter and a gauge, or declared but not a column.
    """
    counters, gauges = set(counters), set(gauges)
    both = sorted(counters & gauges)
    if both:
        raise ValueError(f"{both} declared both a counter and a gauge; give each name once")
    reserved = sorted((counters | gauges) & set(RESERVED_COLUMNS))
    if reserved:  # said "not in the data" of a column that is there
        raise ValueError(f"{reserved}: reserved column(s) (the row's time, node or job), not metrics; declare "
                         "metric columns with --counter/--gauge")
    absent = sorted((counters | gauges) - set(columns))
    if absent:
        raise ValueError(f"declared column(s) {absent} are not in the data; check --counter/--gauge")
    patterns = list(rule_patterns)
    out: list[ColumnKind] = []
    for name in columns:
        if name in RESERVED_COLUMNS:
            continue
        if node_steps is not None and name in node_steps and not np.isfinite(node_steps[name]).any():
            # A catalog or counter-named column left empty (an exporter's series without data) was taken as a
            # metric: train fitted and saved a model of nothing (threshold 0), which score then refused.
            # "no values" of a column holding one value per node read as a wrong listing
            out.append(ColumnKind(name, None, "fewer than two values on any node"))
        elif name in counters:
            out.append(ColumnKind(name, MetricKind.COUNTER, "declared"))
        elif name in gauges:
            out.append(ColumnKind(name, MetricKind.GAUGE, "declared"))
        elif name in BY_NAME:
            out.append(ColumnKind(name, BY_NAME[name].kind, "catalog"))
        elif any(fnmatch.fnmatchcase(name, p) for p in patterns):
            out.append(ColumnKind(name, None, "rules tier"))
        elif name.endswith(COUNTER_SUFFIXES):
            out.append(ColumnKind(name, MetricKind.COUNTER, "name"))
        elif node_steps is not None and name in node_steps and looks_like_counter(node_steps[name]):
            out.append(ColumnKind(name, MetricKind.COUNTER, "values"))
        else:
            out.append(ColumnKind(name, MetricKind.GAUGE, "values" if node_steps is not None else "default"))
    return out

"""The metric names the learned tier knows, and whether each is a counter or a gauge.

A node's sample is a flat ``dict[str, float]``. Counters are cumulative (monotone except at a reset, e.g. a
driver reload): features use their rate. Gauges are levels: features use the level, its drift and its slope.
The names below are the contract between the detectors (which produce them, summed or maxed over a node's
devices as noted) and the predictor. A column whose name is not here is not used by the learned tier (it is
reported as ignored, see :func:`split_known`), but the rules tier may still read it (e.g. ``gpu_xid_79_total``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


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

#: Columns of the interchange format that are not metrics.
RESERVED_COLUMNS: frozenset[str] = frozenset({"timestamp", "node", "job"})


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

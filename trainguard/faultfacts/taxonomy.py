"""Fault classes, and how the faults named in public traces map onto them.

A fault class says how a fault shows itself to a running job and what it takes to recover, which is all the
ETTR model needs:

============  ==========================================================  ====================================
class         what the job sees                                           trainguard finds it by
============  ==========================================================  ====================================
crash         a worker process dies; the node itself is fine              the agent's worker poll (exit)
node_fault    a worker dies or errors on a node that must be replaced     worker exit + kernel log / Xid
              (GPU ECC, Xid, GPU lost); the node agent survives
node_down     the whole node is gone (power, motherboard, kernel panic)   coordinator heartbeat lease expiry
link          a network link or NIC is lost; collectives hang             netlink link event (RoCE detector)
hang          a silent hang (driver stuck, watchdog timeout)              hang detector (no step within bound)
degraded      the node is slow or at risk (PCI width low, fan, thermal)   hardware counter / sysfs detectors
============  ==========================================================  ====================================

The tables are data, in ``taxonomy.json`` beside this module: a trace entry maps by (Level, Class, Desc), then
(Level, Class), then Level. Every fault in the StepFun trace and every Llama 3 category has an explicit entry; a
test checks that.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from trainguard.faultfacts import FactFileError, check_fields, read_fact_file


class FaultClass(str, Enum):
    """How a fault shows itself to a running job (see the module docstring)."""

    CRASH = "crash"
    NODE_FAULT = "node_fault"
    NODE_DOWN = "node_down"
    LINK = "link"
    HANG = "hang"
    DEGRADED = "degraded"


class RecoveryLevel(str, Enum):
    """The recovery levels of DESIGN.md: restart processes in place, replace a node, restart the whole job."""

    PROCESS = "process"
    NODE = "node"
    JOB = "job"


@dataclass(frozen=True)
class Taxonomy:
    """The parsed ``taxonomy.json``.

    Attributes:
        stepfun: StepFun trace key ``(Level, Class[, Desc])`` -> fault class.
        llama3: Llama 3 root-cause category -> (interruptions in the 54-day snapshot, fault class).
    """

    stepfun: dict[tuple[str, ...], FaultClass]
    llama3: dict[str, tuple[int, FaultClass]]


def load_taxonomy(path: str | None = None) -> Taxonomy:
    """Loads the fault taxonomy.

    Args:
        path: a file of the same schema; the shipped ``taxonomy.json`` when None.

    Raises:
        FactFileError: unreadable file, an unknown fault class, a duplicate key or a bad count.
    """
    label, data = read_fact_file(path, "taxonomy.json")
    check_fields(label, "top level", data, {"stepfun", "llama3"}, {"comment"})

    def fault_class(where: str, value: Any) -> FaultClass:
        try:
            return FaultClass(value)
        except ValueError:
            raise FactFileError(f"{label}: {where}: fault_class {value!r} is not one of "
                                f"{[c.value for c in FaultClass]}") from None

    stepfun: dict[tuple[str, ...], FaultClass] = {}
    table = check_fields(label, "stepfun", data["stepfun"], {"classes"}, {"source"})
    for i, raw in enumerate(table["classes"]):
        r = check_fields(label, f"stepfun class {i}", raw, {"level", "class", "fault_class"}, {"desc", "note"})
        key = tuple(str(r[k]) for k in ("level", "class", "desc") if k in r)
        if key in stepfun:
            raise FactFileError(f"{label}: stepfun class {i}: {key} appears twice")
        stepfun[key] = fault_class(f"stepfun class {i}", r["fault_class"])
    llama3: dict[str, tuple[int, FaultClass]] = {}
    table = check_fields(label, "llama3", data["llama3"], {"categories"}, {"source"})
    for i, raw in enumerate(table["categories"]):
        r = check_fields(label, f"llama3 category {i}", raw, {"category", "count", "fault_class"})
        if not isinstance(r["count"], int) or isinstance(r["count"], bool) or r["count"] < 0:
            raise FactFileError(f"{label}: llama3 category {i}: count must be an integer >= 0")
        if r["category"] in llama3:
            raise FactFileError(f"{label}: llama3 category {r['category']!r} appears twice")
        llama3[str(r["category"])] = (r["count"], fault_class(f"llama3 category {i}", r["fault_class"]))
    return Taxonomy(stepfun, llama3)


_SHIPPED = load_taxonomy()
#: StepFun InfiniteHBD trace (fault_statistics.json): (Level, Class, Desc) -> fault class.
STEPFUN_CLASSES: dict[tuple[str, ...], FaultClass] = _SHIPPED.stepfun
#: Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, Table 5): root causes of the 419 unexpected
#: interruptions in a 54-day snapshot of Llama 3 405B pre-training on 16,384 H100 GPUs, with their counts.
LLAMA3_CATEGORIES: dict[str, tuple[int, FaultClass]] = _SHIPPED.llama3


def classify_stepfun(level: str, cls: str, desc: str) -> FaultClass | None:
    """The fault class of one StepFun trace entry.

    Args:
        level: the entry's ``Level`` (e.g. ``Hardware Failure``).
        cls: its ``Class`` (e.g. ``GPU``).
        desc: its ``Desc`` (e.g. ``GPU xid Error``).

    Returns:
        The class from :data:`STEPFUN_CLASSES`, most specific key first; None when no key matches.
    """
    for key in ((level, cls, desc), (level, cls), (level,)):
        found = STEPFUN_CLASSES.get(key)
        if found is not None:
            return found
    return None


__all__ = ["FaultClass", "LLAMA3_CATEGORIES", "RecoveryLevel", "STEPFUN_CLASSES", "Taxonomy", "classify_stepfun",
           "load_taxonomy"]

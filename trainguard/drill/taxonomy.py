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

The tables below are data, not logic: a trace entry maps by (Level, Class, Desc), then (Level, Class), then
Level. Every fault in the StepFun trace and every Llama 3 category has an explicit entry; a test checks that.
"""

from __future__ import annotations

from enum import Enum


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


C = FaultClass

#: StepFun InfiniteHBD trace (fault_statistics.json): (Level, Class, Desc) -> fault class.
STEPFUN_CLASSES: dict[tuple[str, ...], FaultClass] = {
    ("Hardware Failure", "GPU", "GPU DBE(Double Bit ECC) > Threshold"): C.NODE_FAULT,
    ("Hardware Failure", "GPU", "GPU xid Error"): C.NODE_FAULT,
    ("Hardware Failure", "GPU", "GPU Temperature High"): C.DEGRADED,
    ("Hardware Failure", "GPU", "GPU Lost"): C.NODE_FAULT,
    ("Hardware Failure", "GPU", "GPU device unknow error"): C.NODE_FAULT,
    ("Hardware Failure", "GPU", "GPU PCI link width low"): C.DEGRADED,
    ("Hardware Failure", "GPU", "nvidia-smi Timeout"): C.HANG,
    ("Hardware Failure", "GPU", "GPU SBE(Single Bit ECC) > Threshold"): C.DEGRADED,
    ("Hardware Failure", "GPU", "GPU P2P Bandwidth Low"): C.DEGRADED,
    ("Hardware Failure", "GPU", "Silent Data Corruption"): C.NODE_FAULT,
    ("Hardware Failure", "GPU", "GPU device not found"): C.NODE_FAULT,
    ("Hardware Failure", "Parameter Plane Cable", "Link Down"): C.LINK,
    ("Hardware Failure", "NIC", "NIC Link Speed low"): C.DEGRADED,
    ("Hardware Failure", "NIC", "NIC Lost"): C.LINK,
    ("Hardware Failure", "NIC", "NIC PCI link Width low"): C.DEGRADED,
    ("Hardware Failure", "NIC", "Rnic Gid Error"): C.LINK,
    ("Hardware Failure", "Power Supply", "Power Supply Failure detected"): C.NODE_DOWN,
    ("Hardware Failure", "Power Supply", "Redundancy Lost"): C.DEGRADED,
    ("Hardware Failure", "Fan"): C.DEGRADED,
    ("Hardware Failure", "Motherboard Battery"): C.DEGRADED,
    ("Hardware Failure", "Other Failures"): C.NODE_DOWN,
    ("Hardware Failure", "Motherboard"): C.NODE_DOWN,
    ("Hardware Failure", "CPU"): C.NODE_DOWN,
    ("Hardware Failure", "RAID Card"): C.DEGRADED,
    ("Hardware Failure", "Riser Card"): C.NODE_DOWN,
    ("Software Failure", "Other Failures"): C.CRASH,
    ("Software Failure", "File System"): C.NODE_FAULT,
    ("Software Failure", "Software Tool"): C.NODE_DOWN,  # kubelet silent: the scheduler has lost the node
    ("Software Failure", "Operating System"): C.NODE_DOWN,  # kernel panic
    ("Software Failure", "Firmware"): C.DEGRADED,
    ("Other Failure", "Unknown Error"): C.NODE_DOWN,  # unexplained loss of the node: the costliest plausible class
    ("Other Failure", "System Crash"): C.NODE_DOWN,
    ("Other Failure", "Stress Test Failure"): C.DEGRADED,  # found by a health check, node drained
    ("Other Failure", "Change", "Y-cables Taken offline"): C.LINK,
    ("Other Failure", "Change", "Remote Optical Module Failure"): C.LINK,
    ("Other Failure", "Training Task Troubleshooting"): C.NODE_DOWN,  # "Suspect Machine Offline"
    ("Other Failure", "Test"): C.NODE_DOWN,  # "Temporarily Offline"
}

#: Llama 3 (Dubey et al., "The Llama 3 Herd of Models", 2024, Table 5): root causes of the 419 unexpected
#: interruptions in a 54-day snapshot of Llama 3 405B pre-training on 16,384 H100 GPUs, with their counts.
LLAMA3_CATEGORIES: dict[str, tuple[int, FaultClass]] = {
    "Faulty GPU": (148, C.NODE_FAULT),
    "GPU HBM3 Memory": (72, C.NODE_FAULT),
    "Software Bug": (54, C.CRASH),
    "Network Switch/Cable": (35, C.LINK),
    "Host Maintenance": (32, C.NODE_DOWN),
    "GPU SRAM Memory": (19, C.NODE_FAULT),
    "GPU System Processor": (17, C.NODE_FAULT),
    "NIC": (7, C.LINK),
    "NCCL Watchdog Timeouts": (7, C.HANG),
    "Silent Data Corruption": (6, C.NODE_FAULT),
    "GPU Thermal Interface + Sensor": (6, C.DEGRADED),
    "SSD": (3, C.NODE_DOWN),
    "Power Supply": (3, C.NODE_DOWN),
    "Server Chassis": (2, C.NODE_DOWN),
    "IO Expansion Board": (2, C.NODE_DOWN),
    "Dependency": (2, C.CRASH),
    "CPU": (2, C.NODE_DOWN),
    "System Memory": (2, C.NODE_DOWN),
}


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

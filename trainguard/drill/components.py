"""Component times of a fault-tolerance system: the inputs of the ETTR model.

:class:`Components` holds, for one system, what each part costs: the checkpoint stall, interval and persist
time, the detection latency per fault class, the recovery time per level, which level each fault class gets,
and the share of faults the predictor sees coming. Two sets ship:

- :func:`trainguard_defaults`: trainguard at scale. Detection figures are the code's own settings (agent worker
  poll 50 ms, process-detector hang floor 60 s, coordinator lease timeout 10 s); recovery and checkpoint figures are
  stated assumptions for a 16k-GPU job (see each field) until measured ones are fed in.
- :func:`baseline_defaults`: a torchrun-like job measured the same way: every fault restarts the whole job from
  the last ``torch.save`` checkpoint, which stalls training for its full write; a worker exit is seen within
  torchrun's ``--monitor-interval`` (0.1 s); anything that does not kill a process (node gone, link lost, hang,
  slow node) is found only when a collective times out (``default_pg_timeout``, 30 min in this torch build; CUDA
  builds of torch >= 2.2 default NCCL to 10 min: ``--collective-timeout 600`` models that).

A JSON file (``--components FILE``) overrides any field of either set, so figures measured by the benchmarks
feed straight in::

    {"trainguard": {"checkpoint_stall_s": 0.02, "recovery_process_s": 3.1},
     "baseline": {"checkpoint_stall_s": 2.4},
     "_source": "keys starting with _ are notes and are ignored"}
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from trainguard.drill.errors import ComponentsError
from trainguard.faultfacts.taxonomy import FaultClass, RecoveryLevel

#: Collective timeout of the baseline, seconds: torch's ``default_pg_timeout`` (30 min).
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0


def _all_node_levels() -> dict[str, str]:
    return {c.value: (RecoveryLevel.PROCESS if c is FaultClass.CRASH else RecoveryLevel.NODE).value
            for c in FaultClass}


@dataclass(frozen=True)
class Components:
    """What each part of a fault-tolerance system costs. Times in seconds.

    Attributes:
        name: system name in reports.
        checkpoint_stall_s: training is blocked this long per checkpoint. trainguard default 1.0 (the snapshot
            into pinned host memory, overlapped with the next step: issue 3's target is < 1/50 of the baseline's
            stall). Baseline default 60.0: a synchronous ``torch.save`` of Llama-3-405B-like training state
            (405e9 params x 14 bytes = 5.7 TB over the job) at 100 GB/s of aggregate storage bandwidth.
        checkpoint_interval_s: training (compute) time between checkpoints; None picks the ETTR-maximising one.
        persist_s: time from the end of a snapshot until the checkpoint is durable off the node (survives the
            node's loss). trainguard default 60.0 (the same 5.7 TB at the same 100 GB/s, in the background).
            Baseline 0.0: its save is durable when the stall ends. A snapshot taken while the previous one still
            persists is kept in memory only (the writer takes the newest when it is free).
        memory_restore: a process-level restart resumes from the newest in-memory snapshot (trainguard's
            agent-owned shared memory tier). Node and job levels always resume from a durable checkpoint.
        detect_crash_s: a worker exits -> detected. trainguard 0.1 (agent polls workers every 50 ms; measured
            +0-60 ms in ``trainguard run``); baseline 0.1 (torchrun ``--monitor-interval``).
        detect_node_fault_s: a worker dies on a broken node (Xid, ECC) -> detected. Both 0.1 (process exit).
        detect_node_down_s: a whole node (and its agent) vanishes -> detected. trainguard 10.0 (the coordinator's
            ``lease_timeout_s`` default); baseline: the collective timeout.
        detect_link_s: a network link or NIC goes down -> detected. trainguard 1.0 (netlink event ~2 ms, then the
            report and the coordinator's decision); baseline: the collective timeout.
        detect_hang_s: a silent hang -> detected. trainguard 60.0 (process detector: max(60 s, 5 x step time));
            baseline: the collective timeout.
        detect_degraded_s: a slow or at-risk node -> detected. trainguard 30.0 (hardware counter detectors poll
            in seconds; 30 s allows for confirmation); baseline: the collective timeout (no detector: charged
            like a hang, which flatters it when a slow node goes unnoticed for longer).
        recovery_process_s: restart of every rank in place until the first resumed step. trainguard 60.0
            (fresh store and port, process start, NCCL init at 16k ranks, restore from host memory).
        recovery_node_s: replace a node with a warm spare until the first resumed step. trainguard 120.0.
        recovery_job_s: tear down and restart the whole job from the durable checkpoint. 600.0 for both (requeue,
            start-up, communicator init, checkpoint load from remote storage).
        levels: fault class -> recovery level. trainguard: ``crash`` -> process, every other class -> node.
            Baseline: everything -> job.
        predicted_share: share (0..1) of faults of the :attr:`predictable` classes that the predictor flags in
            time; those lose no work (a checkpoint is taken just before, costing one extra stall) and need no
            detection. trainguard default 0.25 (a stated assumption; feed the predictor's event recall at its
            operating false-alarm rate). Baseline 0.
        predictable: the classes with precursor signals the predictor can see (ECC/Xid counts, link errors,
            thermal and PCI counters).
    """

    name: str = "trainguard"
    checkpoint_stall_s: float = 1.0
    checkpoint_interval_s: float | None = None
    persist_s: float = 60.0
    memory_restore: bool = True
    detect_crash_s: float = 0.1
    detect_node_fault_s: float = 0.1
    detect_node_down_s: float = 10.0
    detect_link_s: float = 1.0
    detect_hang_s: float = 60.0
    detect_degraded_s: float = 30.0
    recovery_process_s: float = 60.0
    recovery_node_s: float = 120.0
    recovery_job_s: float = 600.0
    levels: dict[str, str] = field(default_factory=_all_node_levels)
    predicted_share: float = 0.25
    predictable: tuple[str, ...] = ("node_fault", "link", "degraded")

    def __post_init__(self) -> None:
        # A components file is JSON: each field's type is checked, so a wrong one is named here rather than
        # crashing the model later (a list as a level was 'unhashable type', a string as predictable was split
        # into letters, "false" as memory_restore counted as true).
        if not isinstance(self.name, str) or not self.name:
            raise ComponentsError(f"name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.memory_restore, bool):
            raise ComponentsError(f"{self.name}: memory_restore must be true or false, got {self.memory_restore!r}")
        if not isinstance(self.levels, dict) or not all(isinstance(v, str) for v in self.levels.values()):
            raise ComponentsError(f"{self.name}: levels must map each fault class to a level name, got {self.levels!r}")
        if not isinstance(self.predictable, tuple) or not all(isinstance(c, str) for c in self.predictable):
            raise ComponentsError(f"{self.name}: predictable must be a list of fault class names, "
                                  f"got {self.predictable!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") and v is not None:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise ComponentsError(f"{self.name}: {f.name} must be a finite number of seconds >= 0, got {v!r}")
        if self.checkpoint_interval_s is not None and self.checkpoint_interval_s <= 0:
            raise ComponentsError(f"{self.name}: checkpoint_interval_s must be > 0 (or null to optimise), "
                                  f"got {self.checkpoint_interval_s}")
        if not (isinstance(self.predicted_share, (int, float)) and not isinstance(self.predicted_share, bool)
                and 0.0 <= self.predicted_share <= 1.0):
            raise ComponentsError(f"{self.name}: predicted_share must lie in [0, 1], got {self.predicted_share!r}")
        classes = {c.value for c in FaultClass}
        levels = {lv.value for lv in RecoveryLevel}
        if set(self.levels) != classes:
            raise ComponentsError(f"{self.name}: levels must name every fault class {sorted(classes)} exactly once, "
                                  f"got {sorted(self.levels)}")
        bad = {k: v for k, v in self.levels.items() if v not in levels}
        if bad:
            raise ComponentsError(f"{self.name}: unknown recovery level(s) {bad}; use one of {sorted(levels)}")
        unknown = set(self.predictable) - classes
        if unknown:
            raise ComponentsError(f"{self.name}: predictable names unknown fault classes {sorted(unknown)}")

    def detection_s(self, fc: FaultClass) -> float:
        """Detection latency of a fault of class ``fc``, seconds."""
        return float(getattr(self, f"detect_{fc.value}_s"))

    def level(self, fc: FaultClass) -> RecoveryLevel:
        """Recovery level used for a fault of class ``fc``."""
        return RecoveryLevel(self.levels[fc.value])

    def recovery_s(self, level: RecoveryLevel) -> float:
        """Recovery time of ``level``, seconds (restart to first resumed step)."""
        return float(getattr(self, f"recovery_{level.value}_s"))

    def predicted_fraction(self, fc: FaultClass) -> float:
        """Share of faults of class ``fc`` predicted in time."""
        return float(self.predicted_share) if fc.value in self.predictable else 0.0

    def with_overrides(self, overrides: dict[str, Any], where: str = "overrides") -> Components:
        """A copy with some fields replaced (keys starting with ``_`` are notes and skipped).

        Args:
            overrides: field name -> value; ``levels`` may be partial (merged onto the current table).
            where: what to name in error messages (e.g. the file).

        Returns:
            The new, validated components.

        Raises:
            ComponentsError: an unknown field or a bad value.
        """
        names = {f.name for f in fields(self)}
        clean: dict[str, Any] = {}
        for k, v in overrides.items():
            if k.startswith("_"):
                continue
            if k not in names:
                raise ComponentsError(f"{where}: unknown component {k!r}; known: {', '.join(sorted(names))}")
            if k == "levels":
                if not isinstance(v, dict):
                    raise ComponentsError(f"{where}: levels must be an object of fault class -> level")
                v = {**self.levels, **v}
            if k == "predictable":
                if not isinstance(v, (list, tuple)):
                    raise ComponentsError(f"{where}: predictable must be a list of fault class names, got {v!r}")
                v = tuple(v)
            clean[k] = v
        return dataclasses.replace(self, **clean)

    def as_dict(self) -> dict[str, Any]:
        """The components as a JSON-ready dict."""
        d = dataclasses.asdict(self)
        d["predictable"] = list(self.predictable)
        return d


def trainguard_defaults(**overrides: Any) -> Components:
    """trainguard's component times at scale (see :class:`Components` for each figure's origin)."""
    return Components().with_overrides(overrides)


def baseline_defaults(collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S, **overrides: Any) -> Components:
    """A torchrun-like baseline: job restarts, synchronous saves, hangs found by the collective timeout.

    Args:
        collective_timeout_s: how long a collective waits before failing, seconds.
        overrides: more field values.
    """
    t = collective_timeout_s
    base = Components(
        name="baseline", checkpoint_stall_s=60.0, persist_s=0.0, memory_restore=False,
        detect_crash_s=0.1, detect_node_fault_s=0.1, detect_node_down_s=t, detect_link_s=t, detect_hang_s=t,
        detect_degraded_s=t, levels={c.value: RecoveryLevel.JOB.value for c in FaultClass},
        predicted_share=0.0, predictable=(),
    )
    return base.with_overrides(overrides)


def load_components(
    path: str | os.PathLike | list[str | os.PathLike] | None,
    trainguard: Components | None = None,
    baseline: Components | None = None,
) -> tuple[Components, Components]:
    """Applies a components file to the two systems.

    Args:
        path: JSON file with optional ``trainguard`` and ``baseline`` objects of field overrides, or a list of
            them applied in order (a later file wins); None applies nothing.
        trainguard: starting point for trainguard (default :func:`trainguard_defaults`).
        baseline: starting point for the baseline (default :func:`baseline_defaults`).

    Returns:
        (trainguard, baseline) components.

    Raises:
        ComponentsError: the file is missing, not JSON, or names unknown systems or fields.
    """
    tg = trainguard or trainguard_defaults()
    bl = baseline or baseline_defaults()
    if path is None:
        return tg, bl
    if isinstance(path, (list, tuple)):
        for p in path:
            tg, bl = load_components(p, tg, bl)
        return tg, bl
    try:
        data = json.loads(open(path).read())
    except FileNotFoundError as exc:
        raise ComponentsError(f"components file {path} not found; pass an existing JSON file") from exc
    except (OSError, ValueError) as exc:
        raise ComponentsError(f"components file {path} is not readable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ComponentsError(f"components file {path}: expected an object with 'trainguard' and/or 'baseline'")
    unknown = {k for k in data if not k.startswith("_")} - {"trainguard", "baseline"}
    if unknown:
        raise ComponentsError(f"components file {path}: unknown section(s) {sorted(unknown)}; "
                              "use 'trainguard' and 'baseline'")
    for key in ("trainguard", "baseline"):
        if key in data and not isinstance(data[key], dict):
            raise ComponentsError(f"components file {path}: '{key}' must be an object of field -> value")
    tg = tg.with_overrides(data.get("trainguard", {}), where=f"{path} [trainguard]")
    bl = bl.with_overrides(data.get("baseline", {}), where=f"{path} [baseline]")
    return tg, bl

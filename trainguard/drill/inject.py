"""Fault injection for drills, the demo and tests: a supervisor hook that kills a worker at a given step.

The node agent has no fault-injection code of its own: a drill hands it a
:class:`~trainguard.agent.parts.SupervisorHook`, which the worker supervisor calls once per loop turn with the
running workers. :class:`StepFaultInjector` is the one ``trainguard run --fault RANK:STEP[:SIGNAL[:GEN]]``
uses: once ``rank`` of generation ``generation`` has reported ``step`` through the hook, it sends ``sig`` to
that worker only, and remembers when, so the failure timeline measures recovery from the injection.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.agent.workers import WorkerGroup

log = logging.getLogger(__name__)


@dataclass
class FaultPlan:
    """Kill ``rank`` with ``sig`` once it reports ``step`` in generation ``generation``.

    Attributes:
        rank: global rank to strike.
        step: the step it must have reported first.
        sig: the signal sent (default SIGKILL).
        generation: the generation struck (default 1, the first).
        done_at: when it was sent (Unix seconds), None before.
    """

    rank: int
    step: int
    sig: int = signal.SIGKILL
    generation: int = 1
    done_at: float | None = None


class StepFaultInjector:
    """Carries out :class:`FaultPlan` s (implements :class:`~trainguard.agent.parts.SupervisorHook`).

    Args:
        plans: the faults to inject, each at most once.
    """

    def __init__(self, plans: Sequence[FaultPlan]) -> None:
        self.plans = list(plans)

    def on_tick(self, generation: int, group: "WorkerGroup") -> None:
        """Strikes every plan of ``generation`` whose rank has reached its step and still runs."""
        for f in self.plans:
            if f.done_at is not None or f.generation != generation:
                continue
            w = group.by_rank(f.rank)
            if w is not None and w.last_step >= f.step and w.proc.poll() is None:
                group.kill(f.rank, f.sig)
                f.done_at = time.time()
                log.warning("fault injected: %s to rank %d at step %d", signal.Signals(f.sig).name, f.rank,
                            w.last_step)

    def injected_at(self, generation: int, rank: int) -> float | None:
        """When a plan struck ``rank`` in ``generation`` (None: it did not)."""
        return next((f.done_at for f in self.plans
                     if f.rank == rank and f.done_at and f.generation == generation), None)


__all__ = ["FaultPlan", "StepFaultInjector"]

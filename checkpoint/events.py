"""Turning checkpoint failures into health events and log lines, never into exceptions in the training loop."""

from __future__ import annotations

import errno
import logging
from typing import Any, Callable

log = logging.getLogger("trainguard.checkpoint")

SOURCE = "checkpoint"


def kind_for(tier: str, err: int) -> str:
    """Event kind for a failed tier: ``checkpoint.disk_full``, ``checkpoint.storage_unwritable``, ..."""
    if err == errno.ENOSPC:
        return "checkpoint.disk_full"
    if err in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "checkpoint.storage_unwritable"
    if tier == "remote":
        return "checkpoint.remote_unreachable"
    return "checkpoint.persist_failed"


class EventSink:
    """Calls the user's ``on_event`` with a HealthEvent, swallowing (and logging) anything it raises.

    Args:
        on_event: callback or None.
        rank: this rank (the events' subject).
    """

    def __init__(self, on_event: Callable[[Any], None] | None, rank: int) -> None:
        self.on_event = on_event
        self.rank = rank

    def notice(self, kind: str, message: str, evidence: dict[str, str]) -> None:
        """Reports a degraded but working checkpoint path (e.g. staging moved off a too-small /dev/shm)."""
        log.warning("%s", message)
        if self.on_event is None:
            return
        try:
            from trainguard.detectors.events import Action, HealthEvent, Severity

            self.on_event(HealthEvent(source=SOURCE, kind=kind, severity=Severity.WARNING, action=Action.WATCH,
                                      message=message, subject=f"rank:{self.rank}", evidence=evidence))
        except Exception:  # the training loop must never see our callback's failure
            log.exception("checkpoint on_event callback raised; ignored")

    def storage_failed(self, tier: str, step: int | None, message: str, err: int) -> None:
        """Reports a failed save/persist of ``step`` in ``tier``."""
        log.error("checkpoint %s tier failed%s: %s", tier, "" if step is None else f" for step {step}", message)
        if self.on_event is None:
            return
        try:
            from trainguard.detectors.events import Action, HealthEvent, Severity

            ev = HealthEvent(
                source=SOURCE, kind=kind_for(tier, err), severity=Severity.ERROR, action=Action.WATCH,
                message=f"checkpoint {tier} tier failed" + ("" if step is None else f" for step {step}")
                + f": {message}",
                subject=f"rank:{self.rank}",
                evidence={"tier": tier, "step": "" if step is None else str(step), "errno": str(err)})
            self.on_event(ev)
        except Exception:  # the training loop must never see our callback's failure
            log.exception("checkpoint on_event callback raised; ignored")

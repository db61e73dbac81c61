"""What a node agent records about worker failures (:class:`FaultRecord`, the timeline ``trainguard run``
prints). The faults drills inject live with the drills (:mod:`trainguard.drill.inject`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FaultRecord:
    """The timeline of one worker failure, as this node saw it (Unix times in seconds).

    Attributes:
        generation: generation the failed worker belonged to.
        rank: failed global rank.
        cause: ``exit code N`` / ``signal SIGKILL (9)``.
        injected_at: when a fault injector struck (None for real faults).
        detected_at: when the agent saw the worker end.
        restarted_at: when workers of the next generation were started here.
        resumed_at: when a worker of the next generation completed its first step.
        resumed_step: that step.
        step: the last step the failed rank had reported when it was struck (an injected fault: the step the
            injector saw when it sent the signal) or, for a real fault, when its end was seen; None when it
            reported no step. Not the step a drill asked for: the injector strikes at the first tick at or
            after that step.
        hardware: the node-level hardware event that explained the failure (``"pcie.aer_fatal: ..."``), or
            None when the failure was reported as a process failure.
        error: the exception the worker recorded in its ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record``),
            first line, or None.
        hang: where the coordinator localised the hang this record is about, when that was elsewhere
            (``"rank(s) 1 on n2 in step (train.py:40)"``): the rank found silent first is often one that waits
            in a collective for the stuck one. None otherwise.
    """

    generation: int
    rank: int
    cause: str
    injected_at: float | None
    detected_at: float
    restarted_at: float | None = None
    resumed_at: float | None = None
    resumed_step: int | None = None
    step: int | None = None
    hardware: str | None = None
    error: str | None = None
    hang: str | None = None

    @property
    def recovery_s(self) -> float | None:
        """Fault (injection, else detection) to first completed step of the next generation."""
        if self.resumed_at is None:
            return None
        return self.resumed_at - (self.injected_at or self.detected_at)


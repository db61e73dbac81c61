"""The job-wide checkpoint a node asks for, relayed to every node with its heartbeat replies.

A node that sees trouble coming (a predictor, a drained host) asks the coordinator for a checkpoint of the whole
job. :class:`CheckpointRelay` keeps the job's step rate from heartbeats, picks a step no rank has reached yet,
and holds the request until the generation changes; the coordinator adds :meth:`CheckpointRelay.pending` to the
replies of nodes running the current generation.

It is not thread-safe on its own: :class:`~trainguard.recovery.coordinator.JobCoordinator` calls every method
with its lock held.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Sequence

from trainguard.recovery.domain import CheckpointAsk
from trainguard.recovery.policy import Phase, PolicyState

log = logging.getLogger("trainguard.recovery.coordinator")  # the coordinator's log lines, unchanged by the split


class CheckpointRelay:
    """Step rate and the pending job-wide checkpoint of one job (call with the coordinator's lock held).

    Args:
        job: the job name, for log lines.
    """

    def __init__(self, job: str) -> None:
        self._job = job
        self._ckpt_req: CheckpointAsk | None = None  # job-wide checkpoint being relayed
        self._step_rate = 0.0  # steps/s of the current generation (EWMA over >= 1 s windows)
        self._rate_mark: tuple[float, int, int] | None = None  # (time, max step, generation) of the last sample

    def observe_step(self, now: float, step: int, generation: int) -> None:
        """Keeps the job's step rate from heartbeats (for how far ahead a job-wide checkpoint must be set)."""
        mark = self._rate_mark
        if mark is None or mark[2] != generation or step < mark[1]:
            self._rate_mark = (now, step, generation)
            return
        if now - mark[0] >= 1.0:
            rate = (step - mark[1]) / (now - mark[0])
            self._step_rate = rate if self._step_rate == 0.0 else 0.5 * self._step_rate + 0.5 * rate
            self._rate_mark = (now, step, generation)

    def request(self, st: PolicyState, last_steps: Sequence[int] | None, interval_s: float, reason: str) -> str:
        """Sets a job-wide checkpoint at a step every rank has not reached yet.

        The step is the furthest step reported plus what the job does in two heartbeat intervals and half a
        second more (time for every agent to hear of it and tell its workers), at least 2 steps ahead. A request
        still ahead of the job is kept rather than moved.

        Args:
            st: the policy state now.
            last_steps: the last step each slot holder reported (None when no generation is laid out).
            interval_s: the heartbeat interval told to nodes now.
            reason: who asked and why, for the log and the nodes.

        Returns:
            The message for the reporter.
        """
        if st.phase is not Phase.RUNNING or st.plan is not None or last_steps is None:
            return f"no checkpoint requested: the job is {st.phase.name.lower()}"
        furthest = max(last_steps, default=-1)
        cur = self._ckpt_req
        if cur is not None and cur.generation == st.generation and cur.at_step > furthest:
            return f"a job-wide checkpoint at step {cur.at_step} is already pending"
        ahead = max(2, math.ceil(self._step_rate * (2.0 * interval_s + 0.5)) + 1)
        self._ckpt_req = CheckpointAsk(at_step=furthest + ahead, reason=reason,
                                       request_id=uuid.uuid4().hex[:12], generation=st.generation)
        log.warning("job %s: job-wide checkpoint requested at step %d (furthest step %d, %.1f steps/s): %s",
                    self._job, self._ckpt_req.at_step, furthest, self._step_rate, self._ckpt_req.reason)
        return f"job-wide checkpoint at step {self._ckpt_req.at_step}"

    def pending(self, generation: int) -> CheckpointAsk | None:
        """The job-wide checkpoint nodes running ``generation`` must take (None when there is none)."""
        req = self._ckpt_req
        return req if req is not None and req.generation == generation else None

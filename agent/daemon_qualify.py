"""The daemon qualifies its node: at start and every ``qualify.recheck_s``, a failed verdict latched FATAL.

``trainguard run --qualify`` qualifies a node before it registers with its job's coordinator. A node run by the
daemon (``trainguard agent`` with ``[qualify] in_daemon = true``) is qualified by the daemon instead, between
jobs too: the verdict becomes an event on the node's bus; a failed one (a narrowed link, a slow disk, a detector
finding) is a node-level fault, so the daemon's verdict latch turns FATAL with the qualification's reason and
every coordinator it reports to cordons the node (see :mod:`trainguard.agent.coordinator_report`). The daemon
has no job's coordinator to find peers through, so the ``peers`` check is skipped there (it runs in
``trainguard run --qualify``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from trainguard.agent.qualify.agent_side import NodeQualifier, context_for_agent
from trainguard.agent.qualify.verdict import Verdict
from trainguard.detectors.events import Action, HealthEvent, Severity

log = logging.getLogger(__name__)


class DaemonQualification:
    """Runs the node's qualification for the daemon and publishes each verdict once.

    Args:
        config: the daemon's validated :class:`~trainguard.agent.config.AgentConfig`.
        publish: puts an event on the node's bus (the verdict latch and the event stream listen there).
    """

    def __init__(self, config, publish: Callable[[HealthEvent], None]) -> None:
        self.node_id = config.agent.node_id
        self.qualifier = NodeQualifier(context_for_agent(config))
        self._publish = publish

    def start(self) -> Verdict:
        """Qualifies the node now (bounded by ``qualify.budget_s``) and publishes the verdict."""
        self.qualifier.registration(None)
        verdict = self.qualifier.latest
        assert verdict is not None
        self._announce(verdict)
        return verdict

    def poll(self) -> None:
        """Publishes a re-check's verdict once it finished; starts the next re-check when one is due (call from
        the daemon's loop; the check runs on its own thread)."""
        if self.qualifier.for_heartbeat(idle=True) is not None and self.qualifier.latest is not None:
            self._announce(self.qualifier.latest)

    def _announce(self, verdict: Verdict) -> None:
        log.log(logging.INFO if verdict.passed else logging.ERROR, "node qualification: %s", verdict.summary())
        if verdict.passed:
            self._publish(HealthEvent(
                source="qualify", kind="qualify.passed", severity=Severity.INFO, action=Action.NONE,
                message=verdict.summary(), evidence={"duration_s": f"{verdict.duration_s:.3f}"},
                node_id=self.node_id))
            return
        self._publish(HealthEvent(
            source="qualify", kind="qualify.failed", severity=Severity.CRITICAL, action=Action.DRAIN_NODE,
            message=f"failed qualification: {verdict.reason}", evidence={"duration_s": f"{verdict.duration_s:.3f}"},
            node_id=self.node_id))


__all__ = ["DaemonQualification"]

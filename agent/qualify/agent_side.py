"""The node agent's side of qualification: qualify before registering, re-qualify while waiting as a spare.

:class:`NodeQualifier` is all the agent calls (two call sites: the registration request and the heartbeat):

- :meth:`NodeQualifier.registration` runs the check once (bounded by ``qualify.budget_s``) before the node first
  registers, and returns the verdict for ``RegisterNodeRequest.qualification``. The coordinator cordons a node
  whose verdict failed and refuses it with the reason, so the agent ends with that reason.
- :meth:`NodeQualifier.for_heartbeat` re-runs the check every ``qualify.recheck_s`` while the node runs no
  workers (a spare or a standby waiting to be promoted), on a background thread so heartbeats never wait, and
  hands each new verdict to the next heartbeat once. A failed one cordons the waiting node: it is never promoted
  on a link that narrowed while it waited.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from trainguard.agent.qualify.base import QualifyContext
from trainguard.agent.qualify.config import QualifySection
from trainguard.agent.qualify.runner import qualify_node
from trainguard.agent.qualify.verdict import Verdict
from trainguard.proto import coordinator_pb2

log = logging.getLogger(__name__)


def context_for_agent(config: Any, node_id: str = "", checkpoint_dir: str | None = None) -> QualifyContext:
    """The qualification context of the daemon's configuration (an :class:`~trainguard.agent.config.AgentConfig`):
    its ``[qualify]`` table with its ``[detectors]`` set and root.

    Args:
        config: the validated agent configuration.
        node_id: the node id to report; ``""`` uses ``agent.node_id``.
        checkpoint_dir: where the disk test writes unless ``qualify.disk_dir`` is set.
    """
    return QualifyContext(node_id=node_id or config.agent.node_id, config=config.qualify,
                          detector_names=tuple(config.detector_names()), detector_settings=config.detector_settings(),
                          detector_root=config.detectors.root, checkpoint_dir=checkpoint_dir)


def context_for_node(config: Any) -> QualifyContext | None:
    """The qualification context of a ``trainguard run`` agent (a :class:`~trainguard.agent.node.NodeConfig`).

    Returns:
        None when the node does not qualify (``config.qualify`` unset).
    """
    section: QualifySection | None = getattr(config, "qualify", None)
    if section is None:
        return None
    return QualifyContext(node_id=config.node_id, config=section, detector_names=tuple(config.detectors),
                          detector_settings=dict(config.detector_config), checkpoint_dir=config.checkpoint_dir)


class NodeQualifier:
    """Qualifies the node for its coordinator link; a disabled one (no context) sends nothing.

    Args:
        ctx: the node's context, or None when qualification is off.
        clock: monotonic clock, seconds.
    """

    def __init__(self, ctx: QualifyContext | None, clock=time.monotonic) -> None:
        self.ctx = ctx
        self._clock = clock
        self._lock = threading.Lock()
        self.latest: Verdict | None = None  # the newest verdict (registration's, then each re-check's)
        self._unsent: Verdict | None = None
        self._next_check = 0.0
        self._running = False

    @classmethod
    def for_node(cls, config: Any) -> "NodeQualifier":
        """The qualifier of a ``trainguard run`` agent's :class:`~trainguard.agent.node.NodeConfig`."""
        return cls(context_for_node(config))

    def registration(self) -> coordinator_pb2.NodeQualification | None:
        """The verdict to register with: the check runs (bounded) on the first call, later calls reuse it.

        Returns:
            The verdict on the wire, or None when qualification is off.
        """
        if self.ctx is None:
            return None
        with self._lock:
            verdict = self.latest
        if verdict is None:
            verdict = qualify_node(self.ctx)
            with self._lock:
                self.latest = verdict
                self._next_check = self._clock() + self.ctx.config.recheck_s
        return verdict.to_pb()

    def for_heartbeat(self, idle: bool) -> coordinator_pb2.NodeQualification | None:
        """A verdict not sent yet, if a re-check finished; starts a re-check when the node is idle and one is due.

        Args:
            idle: the node runs no workers (a spare or standby).

        Returns:
            The new verdict on the wire once, else None.
        """
        if self.ctx is None:
            return None
        with self._lock:
            out, self._unsent = self._unsent, None
            due = idle and self.ctx.config.recheck_s > 0 and not self._running and self.latest is not None \
                and self._clock() >= self._next_check
            if due:
                self._running = True
        if due:
            threading.Thread(target=self._recheck, name="qualify-recheck", daemon=True).start()
        return out.to_pb() if out is not None else None

    def _recheck(self) -> None:
        assert self.ctx is not None
        try:
            verdict = qualify_node(self.ctx)
        except Exception:  # noqa: BLE001 (a crash of the re-check must not end the agent; checks report their own)
            log.exception("qualification re-check crashed")
            verdict = None
        with self._lock:
            if verdict is not None:
                self.latest = self._unsent = verdict
            self._next_check = self._clock() + self.ctx.config.recheck_s
            self._running = False


__all__ = ["NodeQualifier", "context_for_agent", "context_for_node"]

"""The node agent's side of qualification: qualify before registering, re-qualify while waiting as a spare.

:class:`NodeQualifier` is all the agent calls (two call sites: the registration request and the heartbeat):

- :meth:`NodeQualifier.registration` runs the check once (bounded by ``qualify.budget_s``) before the node first
  registers, and returns the verdict for ``RegisterNodeRequest.qualification``. The coordinator cordons a node
  whose verdict failed and refuses it with the reason, so the agent ends with that reason. With the ``peers``
  check it first serves timed exchanges on the node's address (the node's
  :class:`~trainguard.agent.echo_probe.EchoListener`, shared with fail-slow's link probes, kept for the agent's
  life when the node passes, so later nodes time themselves against it) and asks the coordinator for peers; a
  coordinator that cannot be reached yet raises the gRPC error so the registration's retry loop tries again.
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

from dataclasses import replace

import grpc

from trainguard.agent.echo_probe import EchoListener
from trainguard.agent.qualify.base import QualifyContext
from trainguard.agent.qualify.config import QualifySection
from trainguard.agent.qualify.peers import Peer, PeerSet
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
        job: the job, for the coordinator's peer query.
        address: the node's data address, where it answers peers' exchanges.
        clock: monotonic clock, seconds.
        listener: the node's echo listener when another feature shares it (link probes); default: its own,
            started when the ``peers`` check first runs.
    """

    def __init__(self, ctx: QualifyContext | None, job: str = "", address: str = "", clock=time.monotonic,
                 listener: EchoListener | None = None) -> None:
        self.ctx = ctx
        self.job = job
        self.address = address
        self.echo: EchoListener | None = None  # serving peers' exchanges (the peers check is on)
        self._shared = listener
        self._clock = clock
        self._lock = threading.Lock()
        self.latest: Verdict | None = None  # the newest verdict (registration's, then each re-check's)
        self._unsent: Verdict | None = None
        self._next_check = 0.0
        self._running = False

    @classmethod
    def for_node(cls, config: Any, listener: EchoListener | None = None) -> "NodeQualifier":
        """The qualifier of a ``trainguard run`` agent's :class:`~trainguard.agent.node.NodeConfig` (``listener``:
        the node's echo listener, shared with its link probes)."""
        return cls(context_for_node(config), config.job, config.address, listener=listener)

    def registration(self, stub: Any = None) -> coordinator_pb2.NodeQualification | None:
        """The verdict to register with: the check runs (bounded) on the first call, later calls reuse it.

        Args:
            stub: the coordinator's stub, for the ``peers`` check (None skips that check).

        Returns:
            The verdict on the wire, or None when qualification is off.

        Raises:
            grpc.RpcError: the peer query failed (UNAVAILABLE while the coordinator starts: the caller's retry loop
                tries again; no verdict is kept).
        """
        if self.ctx is None:
            return None
        with self._lock:
            verdict = self.latest
        if verdict is None:
            verdict = qualify_node(self._with_peers(stub))
            if not verdict.passed:
                self._close_echo()
            with self._lock:
                self.latest = verdict
                self._next_check = self._clock() + self.ctx.config.recheck_s
        return verdict.to_pb(self.echo_port)

    @property
    def echo_port(self) -> int:
        """Where this node answers peers' exchanges (0: it does not)."""
        return self.echo.port if self.echo is not None else 0

    def _with_peers(self, stub: Any) -> QualifyContext:
        """The context with the peers to time when the ``peers`` check runs (and the echo server it needs).

        The coordinator is asked first, so that an unreachable one stops the registration attempt before any
        check runs (the caller's retry loop tries again; nothing is written to disk in vain).

        Raises:
            grpc.RpcError: the coordinator could not be asked (UNIMPLEMENTED, an older one, counts as no peers).
        """
        assert self.ctx is not None
        cfg = self.ctx.config
        if stub is None or "peers" not in cfg.checks or cfg.peer_count == 0 or not self.address:
            return self.ctx
        found = self._ask_peers(stub, cfg.peer_count)
        if self.echo is None:
            self.echo = self._shared if self._shared is not None else EchoListener(self.address)
            self.echo.port  # noqa: B018 - start it now (0 and one warning when it cannot listen)
        return replace(self.ctx, peer_source=lambda count: found)

    def _ask_peers(self, stub: Any, count: int) -> PeerSet:
        """Asks the coordinator for qualified peers; an old coordinator (UNIMPLEMENTED) has none."""
        try:
            resp = stub.QualifyPeers(coordinator_pb2.QualifyPeersRequest(job=self.job, node_id=self.ctx.node_id,
                                                                         count=count), timeout=5.0)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return PeerSet()
            raise
        return PeerSet(tuple(Peer(p.node_id, p.address, p.port) for p in resp.peers), resp.reference_s,
                       resp.history)

    def _close_echo(self) -> None:
        if self.echo is not None and self.echo is not self._shared:  # a shared one is the node's to close
            self.echo.close()
        self.echo = None

    def close(self) -> None:
        """Stops answering peers' exchanges (the agent is leaving)."""
        self._close_echo()

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
        return out.to_pb(self.echo_port) if out is not None else None

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

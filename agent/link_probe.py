"""The agent's side of slow-link localisation: timed transfers to peers on request, and the listener they use.

The coordinator localises a slow link by pairing nodes (:mod:`trainguard.recovery.link_locator`); each node
runs the transfers it is asked for in its heartbeat replies and reports their times in its next heartbeats.
A transfer is one echo probe over the node's data address (the address it registered with, which its ranks
use); the wire protocol, the bounded listener and the timed client are :mod:`trainguard.agent.echo_probe`'s,
shared with node qualification's peer check (one listener per node). Probes run on their own threads and never
hold up the agent's loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping

from trainguard.agent.echo_probe import MAX_PROBE_BYTES, EchoListener, ProbeError, probe_once
from trainguard.proto import coordinator_pb2

log = logging.getLogger(__name__)

#: Probe ids remembered (a repeated ask is not run twice).
_SEEN_MAX = 1024


class LinkProber:
    """The node's echo listener (started on first use) and the probes the coordinator asks it to run.

    Args:
        address: the node's data address (listener and probes use it).
        listener: the node's echo listener when another feature shares it (qualification); default: its own.
    """

    def __init__(self, address: str, listener: EchoListener | None = None) -> None:
        self.address = address
        self.listener = listener if listener is not None else EchoListener(address)
        self._lock = threading.Lock()
        self._results: list[coordinator_pb2.LinkProbeResult] = []
        self._seen: dict[str, None] = {}

    @property
    def port(self) -> int:
        """The echo listener's port (0 when it cannot listen: the node is then left out of link probes)."""
        return self.listener.port

    def run(self, asks: Iterable[coordinator_pb2.LinkProbeAsk]) -> None:
        """Starts the probes not run before, each on its own thread (results come back through :meth:`drain`)."""
        for a in asks:
            with self._lock:
                if a.probe_id in self._seen:
                    continue
                self._seen[a.probe_id] = None
                if len(self._seen) > _SEEN_MAX:
                    del self._seen[next(iter(self._seen))]
            threading.Thread(target=self._probe, args=(a,), name=f"link-probe-{a.probe_id}", daemon=True).start()

    def _probe(self, a: coordinator_pb2.LinkProbeAsk) -> None:
        res = coordinator_pb2.LinkProbeResult(probe_id=a.probe_id, peer_node=a.peer_node, bytes=a.bytes)
        n = min(int(a.bytes), MAX_PROBE_BYTES)
        try:
            res.up_s, res.down_s = probe_once(a.peer_address, a.peer_port, n, max(0.5, a.timeout_s))
            log.info("link probe to %s (%s:%d): %d bytes up in %.3f s, back in %.3f s", a.peer_node,
                     a.peer_address, a.peer_port, n, res.up_s, res.down_s)
        except ProbeError as exc:
            res.error = str(exc)[:1000]
            log.warning("link probe to %s failed: %s", a.peer_node, exc)
        with self._lock:
            self._results.append(res)

    def drain(self) -> list[coordinator_pb2.LinkProbeResult]:
        """Results finished since the last call."""
        with self._lock:
            out, self._results = self._results, []
        return out

    def close(self) -> None:
        """Stops the listener."""
        self.listener.close()


class WithLinkProbe:
    """Heartbeat content (:class:`~trainguard.agent.parts.HeartbeatContent`): another content's fields plus the
    link probe's listener port and the probe results finished since the last heartbeat."""

    def __init__(self, inner, prober: LinkProber) -> None:
        self.inner = inner
        self.prober = prober

    def heartbeat_fields(self) -> Mapping[str, object]:
        """The inner content's ``NodeHeartbeatRequest`` fields, ``link_probe_port`` and ``link_results``."""
        return {**self.inner.heartbeat_fields(), "link_probe_port": self.prober.port,
                "link_results": self.prober.drain()}

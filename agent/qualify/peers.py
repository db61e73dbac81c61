"""The peer check: a small timed exchange with a few already-qualified peers over the data network.

Every node that qualified serves the node's echo listener (:class:`~trainguard.agent.echo_probe.EchoListener`,
the same one fail-slow's link probes use) on its data address (the one it registers); the port goes with its
verdict (``NodeQualification.echo_port``). A node qualifying asks the coordinator for up to ``peer_count`` such
peers (``QualifyPeers``), sends each ``peer_kib`` KiB and reads them back (one echo probe), and takes the median
of the round trips (up + down, connection set-up not counted) as its time. The coordinator keeps the times of the nodes that qualified before and
answers with their median (the reference): a node whose time is over ``peer_slow_ratio`` times the reference
fails. Its own link is on every one of its round trips, a slow peer on one only, so the median pins the slowness
on the node under test.

Honest limits: the reference needs ``peer_min_history`` earlier measurements (the first nodes of a job only
record theirs); it is the median, so it stays right while fewer than half of the earlier nodes were slow; it is
kept in the coordinator's memory (a restarted coordinator starts a new history); and a TCP exchange on the data
network is a stand-in for the job's collective (gloo/NCCL), not the collective itself.

Wire format, bounds and timing: :mod:`trainguard.agent.echo_probe`.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainguard.agent.echo_probe import MAX_PROBE_BYTES, ProbeError, probe_once
from trainguard.agent.qualify.base import Outcome, QualifyContext, failed, passed, register_check, skipped

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    """A qualified node that answers exchanges: its id, data address and echo port."""

    node_id: str
    address: str
    port: int


@dataclass(frozen=True)
class PeerSet:
    """What the coordinator answered: peers to time, and the reference time of the nodes before.

    Attributes:
        peers: up to the requested count.
        reference_s: median exchange time of the nodes that qualified so far, seconds (0: none yet).
        history: how many times the reference is the median of.
    """

    peers: tuple[Peer, ...] = ()
    reference_s: float = 0.0
    history: int = 0


def exchange(peer: Peer, nbytes: int, timeout_s: float) -> float:
    """One timed exchange with ``peer``: ``nbytes`` sent and read back through its echo listener.

    Returns:
        Seconds from the first byte sent to the last byte back (up + down).

    Raises:
        ProbeError: unreachable, refused, timed out, or a short answer.
    """
    up_s, down_s = probe_once(peer.address, peer.port, min(nbytes, MAX_PROBE_BYTES), timeout_s)
    return up_s + down_s


@register_check("peers")
class PeerExchangeCheck:
    """The node's median exchange time with a few qualified peers, against the reference of the nodes before."""

    name = "peers"

    def run(self, ctx: QualifyContext, deadline: float) -> Outcome:
        """Asks for peers, times one exchange with each, compares the median with the reference."""
        cfg = ctx.config
        source: Callable[[int], PeerSet] | None = ctx.peer_source
        if cfg.peer_count == 0:
            return skipped("peer_count is 0")
        if source is None:
            return skipped("no coordinator to find peers through (runs at registration only)")
        found = source(cfg.peer_count)
        if not found.peers:
            return skipped("no qualified peer yet (the first node of a job)")
        nbytes = cfg.peer_kib * 1024
        times: list[float] = []
        errors: list[str] = []
        for peer in found.peers:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                times.append(exchange(peer, nbytes, left))
            except ProbeError as exc:
                errors.append(f"{peer.node_id} ({peer.address}:{peer.port}): {exc}")
        if not times:
            return failed("no peer answered over the data network: " + "; ".join(errors or ["out of time"]))
        mine = statistics.median(times)
        note = f"{len(times)} peer(s), median {mine * 1000:.1f} ms for {cfg.peer_kib} KiB each way"
        if errors:
            note += f" ({len(errors)} unreachable: {errors[0]})"
        if found.history < cfg.peer_min_history or found.reference_s <= 0:
            return passed(f"{note}; no reference yet ({found.history} earlier node(s), "
                          f"{cfg.peer_min_history} needed)", mine)
        ratio = mine / found.reference_s
        if ratio > cfg.peer_slow_ratio:
            return failed(f"{note}: {ratio:.1f}x the {found.reference_s * 1000:.1f} ms median of {found.history} "
                          f"qualified node(s) (limit {cfg.peer_slow_ratio:g}x)", mine)
        return passed(f"{note}, {ratio:.1f}x the median of {found.history} qualified node(s)", mine)


__all__ = ["Peer", "PeerExchangeCheck", "PeerSet", "exchange"]

"""Which qualified nodes a qualifying node times its exchanges against, and the reference they set.

A node qualifying before it joins (see :mod:`~trainguard.recovery.qualification`) times exchanges with a few
nodes that qualified already and compares its time with theirs. :class:`PeerPool` keeps the qualified nodes'
exchange times (:class:`~trainguard.recovery.qualification.PeerTimes`) and picks the peers.

It is not thread-safe on its own: :class:`~trainguard.recovery.coordinator.JobCoordinator` calls every method
with its lock held.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Iterable

from trainguard.recovery.membership import Member
from trainguard.recovery.qualification import PeerTimes

#: A peer as a qualifying node gets it: (node id, address, echo port).
Peer = tuple[str, str, int]


class PeerPool:
    """Qualified nodes' exchange times and the choice of peers (call with the coordinator's lock held)."""

    def __init__(self) -> None:
        self._peer_times = PeerTimes()  # qualified nodes' exchange times: the next node's reference

    def record(self, peer_s: float) -> None:
        """Keeps the exchange time a node measured when it qualified."""
        self._peer_times.record(peer_s)

    def pick(self, members: Iterable[Member], node_id: str, count: int, cordoned: Collection[str],
             live: Callable[[Member], bool]) -> tuple[list[Peer], float, int]:
        """Up to ``count`` qualified peers for ``node_id``'s timed exchange, and the reference time.

        Peers are live, not cordoned, not refused, serve exchanges, and are picked at random so that many nodes
        qualifying at once spread over the qualified ones.

        Returns:
            ([(node id, address, echo port)], median exchange time of the qualified nodes so far, how many).
        """
        pool = [m for m in members if m.echo_port > 0 and m.info.address and not m.refused
                and m.info.node_id != node_id and m.info.node_id not in cordoned and live(m)]
        picked = random.sample(pool, min(count, len(pool)))
        reference, history = self._peer_times.reference()
        return [(m.info.node_id, m.info.address, m.echo_port) for m in picked], reference, history

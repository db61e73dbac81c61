"""Peer replication of in-memory checkpoints, the node agent's side: serve, push to buddies, fetch for a new slot.

* **Serve**: a ``MemoryReplica`` gRPC server on the node's data address (:mod:`.replica_transport`) receives
  buddies' copies into the node's :class:`~trainguard.checkpoint.replica_store.ReplicaStore` (bounded memory,
  published only once verified) and serves copies to replacement nodes.
* **Push**: a background thread sends each local rank's newest verified snapshot (from :class:`.MemoryTier`) to
  every buddy the coordinator named for the current table (``NodeHeartbeatResponse.replica_targets``), one copy
  at a time, under a bandwidth cap. A buddy that changes (lost, or a new table) simply gets the newest copies: the
  sender remembers what each buddy already holds, so a lost buddy is re-replicated to its successor.
* **Fetch**: before a replacement node's workers start, the ranks the restore plan sends to a peer's memory are
  fetched into this node's own arena as memory-tier copies (:func:`~trainguard.checkpoint.replica_store.
  arena_writer`), so the workers restore from local memory as after a plain restart. A peer that fails (down,
  no copy, a copy failing its checksums) is followed by the next one holding the rank, then by the workers' own
  tiers (disk, remote).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from trainguard.agent.errors import AgentError
from trainguard.agent.memory_tier import MemoryTier
from trainguard.agent.replica_transport import ReplicaServer, ReplicaServicer, Throttle, fetch, push_copy
from trainguard.checkpoint.errors import CheckpointError, CorruptCheckpointError
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.replica_store import ReplicaRefusedError, ReplicaStore, ReplicaWriter, arena_writer
from trainguard.proto import coordinator_pb2

log = logging.getLogger(__name__)

#: Seconds before a refused or failed push is tried again, doubled at each further one to the same buddy up to
#: :data:`REFUSED_RETRY_MAX_S`. A refusal for room persists (a 64 MiB container /dev/shm can never keep the
#: reserve free): retried every second, it cost a warning per second on both ends for the job's whole life.
REFUSED_RETRY_S = 1.0
REFUSED_RETRY_MAX_S = 60.0
#: Pushes of one rank to one buddy in a row whose slot a newer snapshot rewrote before they ended, before a
#: warning says that the snapshots come faster than a copy can be sent.
SUPERSEDED_WARN_AFTER = 3


class ReplicaConfigError(AgentError):
    """A replication setting is out of range (the message names the flag)."""


@dataclass
class ReplicaConfig:
    """Peer replication of the node's in-memory checkpoints (``trainguard run --replica-*``).

    Attributes:
        enabled: serve, push and fetch replicas (the coordinator picks the buddies; ``trainguard coordinator
            --memory-replicas`` sets how many). Default True.
        bandwidth_mib_s: cap on each push stream, MiB/s; 0 = no cap. Default 1024 (a tenth of a 100 Gb/s NIC).
        memory_mib: most memory other nodes' replicas may hold on this node, MiB; 0: none (the node tells the
            coordinator, which never makes it a buddy; it still pushes its own copies and serves them). Default
            8192.
        reserve_mib: tmpfs space a replica must leave free for this node's own next snapshots, MiB. Default 64.
        timeout_s: bound on one push or fetch, seconds; a push gets this on top of the time the bandwidth cap
            alone takes for its copy (see :meth:`push_deadline_s`). Default 600.
        token: the job token (``--token-file``, as for the coordinator): demanded by this node's replica server
            and sent to its peers'; ``""``: none (anyone reaching the data address may push or fetch).
    """

    enabled: bool = True
    bandwidth_mib_s: float = 1024.0
    memory_mib: int = 8192
    reserve_mib: int = 64
    timeout_s: float = 600.0
    token: str = field(default="", repr=False)  # a secret: kept out of reprs and logs

    def push_deadline_s(self, nbytes: int) -> float:
        """Seconds one push of ``nbytes`` may take: :attr:`timeout_s` plus what the bandwidth cap alone takes.
        A fixed bound failed every push of a copy the cap needs longer for (8 GiB at 10 MiB/s: 820 s against
        600) at its end, forever; a stalled peer is caught by keepalive (``STALL_S``) whatever the bound."""
        if self.bandwidth_mib_s <= 0:
            return self.timeout_s
        return self.timeout_s + nbytes / (self.bandwidth_mib_s * (1 << 20))

    def validate(self) -> None:
        """Raises :class:`ReplicaConfigError` naming the flag of a value out of range."""
        for flag, value in (("--replica-bandwidth-mib-s", self.bandwidth_mib_s), ("--replica-memory-mib",
                                                                                 self.memory_mib),
                            ("--replica-reserve-mib", self.reserve_mib)):
            if not (value >= 0 and math.isfinite(value)):  # NaN passed `< 0` and meant "no cap", silently
                raise ReplicaConfigError(f"{flag} {value}: must be a finite number >= 0")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ReplicaConfigError(f"replica timeout {self.timeout_s}: must be a finite number of seconds > 0")


@dataclass
class ReplicaStats:
    """What replication did so far (logged, and reported in heartbeats as the memory replicas hold)."""

    pushes: int = 0
    push_failures: int = 0
    pushed_bytes: int = 0
    push_seconds: list[float] = field(default_factory=list)  # each completed push, newest last (at most 256)
    fetches: int = 0
    fetch_failures: int = 0


class ReplicaAgent:
    """Serves, pushes and fetches one job's replicas on this node (see the module docstring).

    Args:
        config: the settings.
        tier: the node's memory tier (own copies to push; replicas are reported through it).
        node_id: this node.
        host: the data address to serve on.
        clock: monotonic clock of the retry times, seconds (tests may inject one).
    """

    def __init__(self, config: ReplicaConfig, tier: MemoryTier, node_id: str, host: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        config.validate()
        self._clock = clock
        self.config, self.tier, self.node_id, self.job = config, tier, node_id, tier.job
        # The folders the store is about to make (the job's, and the root's when missing), deepest first.
        self._made: list[str] = []
        d = os.path.abspath(os.path.join(tier.shm_root, tier.job))
        while d != os.path.dirname(d) and not os.path.isdir(d):
            self._made.append(d)
            d = os.path.dirname(d)
        self.store = ReplicaStore(tier.shm_root, tier.job, config.memory_mib << 20, config.reserve_mib << 20,
                                  location=tier.location)
        # The store makes ``<root>/<job>/replicas`` (and the job folder) at once, and a job that never received
        # a replica left them behind, empty, in the node's /dev/shm: one job folder per job name for good. Its
        # folders are made again when a copy arrives (the store makes a rank's folder with its parents), so
        # they go now, and at :meth:`stop` when still empty.
        self._remove_empty_folders()
        tier.replicas = self.store
        self.servicer = ReplicaServicer(tier.job, self.store, tier.own_copy, node_id, tier.recheck)
        self._host = host
        self.server: ReplicaServer | None = None
        self.stats = ReplicaStats()
        self._targets: tuple[tuple[str, str], ...] = ()
        self._pushed: dict[tuple[str, int], tuple[int, float]] = {}  # (buddy, rank) -> (step, created) it holds
        self._retry_at: dict[str, float] = {}
        self._refusals: dict[str, int] = {}  # buddy -> refusals since its last accepted push (backoff, logging)
        self._addresses: dict[str, str] = {}  # buddy -> the replica address it was last named at
        self._superseded: dict[tuple[str, int], int] = {}  # (buddy, rank) -> pushes in a row cut by a newer snapshot
        self._lock = threading.Lock()
        self._wake = threading.Event()
        tier.on_new_copy = self._wake.set  # a new snapshot is pushed as soon as the scan verified it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """host:port of the replica server ("" before :meth:`start`)."""
        return self.server.address if self.server is not None else ""

    def start(self) -> "ReplicaAgent":
        """Starts the server and the push thread. A server that cannot listen on the node's address leaves this
        node out of replication (logged; it reports no replica address, so no node picks it as a buddy)."""
        if self.server is None:
            try:
                self.server = ReplicaServer(self.servicer, self._host, self.config.token)
            except (CheckpointError, RuntimeError, OSError) as exc:
                log.warning("not serving in-memory checkpoint replicas: cannot listen on %s (%s); this node's "
                            "snapshots are still pushed to its buddies", self._host, exc)
            else:
                log.info("serving in-memory checkpoint replicas on %s (%s)%s", self.server.address,
                         "job token required" if self.config.token else "no job token: anyone reaching it may call",
                         "; holding none of other nodes' (--replica-memory-mib 0), only serving this node's own"
                         if self.config.memory_mib == 0 else "")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="replica-push", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stops pushing and serving."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if self.server is not None:
            self.server.stop()
            self.server = None
        self._remove_empty_folders()

    def _remove_empty_folders(self) -> None:
        """Removes the store's folder when it holds nothing, then the job folder (and the root) if this agent's
        store made them and they are empty too (the job's own arena, a worker's rank folders, lives there
        otherwise). ``rmdir`` removes only an empty folder, so a copy arriving meanwhile is never lost."""
        for d in (self.store.root, *self._made):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                continue
            except OSError:
                return  # not empty: the folder above it is not empty either

    @property
    def buddies(self) -> list[str]:
        """Node ids this node currently replicates to."""
        with self._lock:
            return [n for n, _ in self._targets]

    # -- push ------------------------------------------------------------------------------------------------
    def set_targets(self, targets: Sequence[coordinator_pb2.ReplicaTarget]) -> None:
        """The buddies the coordinator named in its latest heartbeat answer."""
        new = tuple((t.node_id, t.address) for t in targets if t.address and t.node_id != self.node_id)
        with self._lock:
            if new != self._targets:
                log.info("replicating in-memory checkpoints to %s", ", ".join(n for n, _ in new) or "nobody")
                # A buddy at another address is another process (restarted, or its node rebooted with an empty
                # /dev/shm): what its predecessor held says nothing about it. Keyed by node id only, the copies
                # it had were never sent again, so it held nothing of this node until the next snapshot.
                for buddy, address in new:
                    if self._addresses.get(buddy, address) != address:
                        self._forget(buddy)
                    self._addresses[buddy] = address
                self._targets = new
                self._wake.set()

    def _forget(self, buddy: str) -> None:
        """Drops what ``buddy`` was known to hold and its refusal backoff (the caller holds the lock)."""
        for key in list(self._pushed):  # a copy: the push thread adds entries without the lock
            if key[0] == buddy:
                self._pushed.pop(key, None)
        self._retry_at.pop(buddy, None)
        self._refusals.pop(buddy, None)
        for key in list(self._superseded):
            if key[0] == buddy:
                self._superseded.pop(key, None)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._push_due()
            except Exception:  # noqa: BLE001 - replication must never take the agent down; the next round retries
                log.exception("replicating in-memory checkpoints failed")
            self._wake.wait(1.0)  # retries of failed pushes; new snapshots and buddies wake it at once
            self._wake.clear()

    def _push_due(self) -> None:
        with self._lock:
            targets = self._targets
        copies = self.tier.own_copies()
        for buddy, address in targets:
            if self._clock() < self._retry_at.get(buddy, 0.0):
                continue
            for rank, (step, paths, man) in sorted(copies.items()):
                if self._stop.is_set():
                    return
                if self._pushed.get((buddy, rank)) == (step, man.created):
                    continue
                t0 = self._clock()
                try:
                    ack = push_copy(address, self.job, man, paths.data, self.node_id,
                                    Throttle(self.config.bandwidth_mib_s), self.config.push_deadline_s(man.data_bytes),
                                    self.config.token)
                except CorruptCheckpointError as exc:
                    # The slot was rewritten by a newer snapshot mid-push (or is damaged, and the scan drops it):
                    # nothing the buddy did, so no backoff; the next round sends the newest copy. A damaged slot
                    # is checked again by the next scan: verified once, it stayed this rank's newest copy and was
                    # pushed (and failed) every round, and reported as held.
                    self.tier.recheck(paths.data)
                    self._superseded_push(buddy, rank, step, exc)
                    continue
                except (grpc.RpcError, CheckpointError, OSError) as exc:
                    # Backed off as a refusal is: a buddy whose replica port cannot be reached (a firewall, its
                    # data link down while it still heartbeats) cost a warning per second for the job's life.
                    self._refused(buddy, rank, step, _rpc_text(exc), failed=True)
                    break
                if not ack.ok:
                    self._refused(buddy, rank, step, ack.error)
                    break
                took = self._clock() - t0
                self._superseded.pop((buddy, rank), None)
                if self._refusals.pop(buddy, 0):
                    log.info("%s accepts replicas again", buddy)
                with self._lock:
                    # Only while the buddy is still at the address pushed to: a buddy named at another address
                    # meanwhile (a new process) was forgotten by set_targets, and recording this ack after that made
                    # the sender take the new process to hold the copy (it got nothing until the next snapshot;
                    # seen once in a loaded CI run).
                    if self._addresses.get(buddy, address) == address:
                        self._pushed[(buddy, rank)] = (step, man.created)
                self.stats.pushes += 1
                self.stats.pushed_bytes += man.data_bytes
                self.stats.push_seconds = (self.stats.push_seconds + [took])[-256:]
                log.info("replicated rank %d step %d to %s: %d bytes in %.3f s", rank, step, buddy, man.data_bytes,
                         took)

    def _superseded_push(self, buddy: str, rank: int, step: int, exc: CorruptCheckpointError) -> None:
        """A push cut because its slot was rewritten: debug level, a warning once it happens
        :data:`SUPERSEDED_WARN_AFTER` times in a row (then no copy of that rank may ever reach the buddy)."""
        self.stats.push_failures += 1
        n = self._superseded[(buddy, rank)] = self._superseded.get((buddy, rank), 0) + 1
        if n == SUPERSEDED_WARN_AFTER:
            log.warning("rank %d: %d snapshots in a row were overwritten by newer ones before their push to %s "
                        "ended (the last: step %d), so %s may hold no copy of it; snapshots come faster than "
                        "--replica-bandwidth-mib-s %g sends one: raise the cap, save less often or keep more "
                        "snapshots in memory", rank, n, buddy, step, buddy, self.config.bandwidth_mib_s)
        else:
            log.debug("the push of rank %d step %d to %s was cut: %s; the newest copy goes next", rank, step,
                      buddy, exc)

    def _refused(self, buddy: str, rank: int, step: int, error: str, failed: bool = False) -> None:
        """Backs off from a buddy that refused a copy (or that a push to failed: ``failed``), doubling the wait
        per refusal or failure in a row; only the first in a row is a warning (the push-failure count in the
        metrics and status keeps counting)."""
        self.stats.push_failures += 1
        n = self._refusals[buddy] = self._refusals.get(buddy, 0) + 1
        wait = min(REFUSED_RETRY_S * 2 ** (n - 1), REFUSED_RETRY_MAX_S)
        self._retry_at[buddy] = self._clock() + wait
        what = f"the replica of rank {rank} step {step} to {buddy} failed" if failed else \
            f"{buddy} refused the replica of rank {rank} step {step}"
        if n == 1:
            log.warning("%s: %s (retried after %.0f s, then less often up to every %.0f s; further failures are "
                        "logged at debug level)", what, error, wait, REFUSED_RETRY_MAX_S)
        else:
            log.debug("%s again (%d in a row): %s", what, n, error)

    # -- fetch -----------------------------------------------------------------------------------------------
    def fetch_planned(self, plan: coordinator_pb2.MemoryRestorePlan | None, ranks: Sequence[int],
                      tick: Callable[[], None] | None = None) -> list[int]:
        """Fetches into this node's arena the local ranks the plan sends to a peer's memory.

        Args:
            plan: the generation's restore plan (None: nothing to do).
            ranks: this node's ranks in the new table.
            tick: called while waiting (keeps the coordinator lease alive).

        Returns:
            The ranks fetched and verified (the others restore from their own tiers).
        """
        if plan is None or plan.step < 0:
            return []
        wanted = [e for e in plan.ranks if e.rank in set(ranks)
                  and e.source == coordinator_pb2.RESTORE_SOURCE_PEER_MEMORY and e.peer_address]
        done: list[int] = []
        threads = []
        for e in wanted:
            th = threading.Thread(target=self._fetch_one, args=(e, plan.step, done), daemon=True,
                                  name=f"replica-fetch-{e.rank}")
            th.start()
            threads.append(th)
        for th in threads:
            while th.is_alive():
                th.join(0.2)
                if tick is not None:
                    tick()
        return sorted(done)

    def _fetch_one(self, entry: coordinator_pb2.RankRestore, step: int, done: list[int]) -> None:
        sources = [(entry.peer_node, entry.peer_address)] + [(a.node_id, a.address) for a in entry.alternates
                                                               if a.address]
        def open_writer(m: Manifest) -> ReplicaWriter:
            # The server sends its copy of the step asked for, or when it holds none its newest above. A holder
            # that has moved on to a newer step since the plan was made (its node pushed one, or it went back to an older run) holds
            # no copy the workers can restore: they restore the plan's step only. Taken anyway, it counted as
            # fetched and the plan's next holder, which may still hold the step, was never asked.
            if m.step != step:
                raise ReplicaRefusedError(f"it holds step {m.step} of rank {m.rank}, not the planned step {step}")
            return arena_writer(self.tier.shm_root, self.job, m)

        for i, (node, address) in enumerate(sources):
            t0 = time.monotonic()
            try:
                _, man = fetch(address, self.job, entry.rank, step, open_writer, self.config.timeout_s,
                               self.config.token)
            except (grpc.RpcError, CheckpointError, OSError) as exc:
                self.stats.fetch_failures += 1
                following = (f"trying {sources[i + 1][0]}'s" if i + 1 < len(sources)
                             else "its workers restore from disk or remote storage")
                log.warning("rank %d: no copy of step %d from %s's memory (%s); %s", entry.rank, step, node,
                            _rpc_text(exc), following)
                continue
            self.stats.fetches += 1
            entry.peer_node, entry.peer_address = node, address  # the workers are told where it came from
            done.append(entry.rank)
            log.info("fetched rank %d step %d from %s's memory: %d bytes in %.3f s", entry.rank, man.step, node,
                     man.data_bytes, time.monotonic() - t0)
            return


def _rpc_text(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)

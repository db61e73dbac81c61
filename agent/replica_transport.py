"""Moving in-memory checkpoint copies between node agents: gRPC streaming over the data network.

Why gRPC streaming: the agents already run gRPC (grpcio is a dependency, its flow control and HTTP/2 framing
are well kept), a client-streaming ``PushReplica`` and a server-streaming ``FetchReplica`` carry a copy in
bounded pieces (:data:`PIECE_BYTES`) without a framing of our own, and a peer that dies mid-stream surfaces as
a cancelled or failed stream on the other side. The bytes themselves are never trusted: the sender checks each
checksum chunk against the manifest before sending it (a slot rewritten under it aborts the push), and the
receiver verifies the whole copy again before publishing it (:mod:`trainguard.checkpoint.replica_store`), so a
copy that looks complete is complete.

Framing: the first :class:`ReplicaChunk` is a header (job, rank, step, manifest JSON, sender); every further one
carries ``data`` at ``offset``.

Who may call: with a job token (``--token-file``, the one the coordinator checks) the server refuses every push
and fetch without it (``UNAUTHENTICATED``, before any byte is read), and peers send it. Without one, anyone who
reaches the data address could read every rank's weights or push a copy with valid checksums of its own making
(checksums detect damage, not forgery), which a replacement node would then restore.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures

import grpc

from trainguard.checkpoint.errors import CheckpointError, CorruptCheckpointError
from trainguard.checkpoint.manifest import CHECKSUM_ALGO, Manifest, chunk_checksum
from trainguard.checkpoint.replica_store import (Replica, ReplicaRefusedError, ReplicaStore, ReplicaTornError,
                                                  ReplicaWriter)
from trainguard.grpc_guard import RequestGuard
from trainguard.proto import replica_pb2, replica_pb2_grpc

log = logging.getLogger(__name__)

#: Most bytes of data per message: one checksum chunk of the default 4 MiB goes as one message, without a copy
#: (both sides raise gRPC's 4 MiB default message limit to :data:`MAX_MESSAGE_BYTES`).
PIECE_BYTES = 4 << 20
#: Largest message either side accepts: a piece, or a header whose manifest lists many tensors.
MAX_MESSAGE_BYTES = 64 << 20
_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
#: A push or fetch whose peer stops answering (frozen, or its link gone without a reset) for about this long is
#: abandoned, seconds: the channel pings every half of it and gives the ping the other half, and a connection
#: attempt gets as long. Without it only the call's whole bound (``ReplicaConfig.timeout_s``, 600 s) ended it: a
#: replacement fetching from a peer that froze held the job's next generation for 10 minutes.
STALL_S = 20.0
#: The server accepts those pings, also while it sends nothing (a receiver during a push).
_SERVER_OPTIONS = _OPTIONS + [("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
                              ("grpc.http2.max_ping_strikes", 0)]


#: Pushes one replica server receives at once; one more is refused at once (RESOURCE_EXHAUSTED, which the sender
#: backs off from as from any refusal). A node receives from about ``--memory-replicas`` nodes (default 1, one push
#: at a time each), which this agent does not know: 8 leave room for up to 8 replicas and for a table in flux.
#: Each held push costs one thread, and its reservation stays within the replica memory bound.
MAX_PUSHES = 8
#: Handler threads kept for everything but pushes (``FetchReplica``): pushes, however many are open or stalled,
#: never take these, so a replacement's restore is served while buddies push.
FETCH_WORKERS = 4


def _server_options(stall_s: float) -> list[tuple[str, int]]:
    """Server options: those of :data:`_SERVER_OPTIONS`, and pings of its own that end a call once the peer is
    silent ~``stall_s``. Without them a sender that froze mid-push (or whose link went without a reset) held a
    server thread, the copy's memory reservation and its tmpfs space until the sender's own deadline (600 s by
    default), refusing other pushes for room meanwhile; four of them left no thread for a replacement's fetch."""
    half_ms = max(500, int(stall_s * 500))
    return _SERVER_OPTIONS + [("grpc.keepalive_time_ms", half_ms), ("grpc.keepalive_timeout_ms", half_ms),
                              ("grpc.http2.ping_timeout_ms", half_ms)]


def _channel_options(stall_s: float) -> list[tuple[str, int]]:
    """Client options: message limits, and keepalive pings that end a call once the peer is silent ~``stall_s``."""
    half_ms = max(500, int(stall_s * 500))
    return _OPTIONS + [("grpc.keepalive_time_ms", half_ms), ("grpc.keepalive_timeout_ms", half_ms),
                       ("grpc.keepalive_permit_without_calls", 0), ("grpc.http2.max_pings_without_data", 0),
                       ("grpc.min_reconnect_backoff_ms", 2 * half_ms)]


class PushStalledError(ReplicaRefusedError):
    """A push delivered no message for the server's stall bound: the call was cancelled, its partial copy dropped."""


class _IdleWatch:
    """The request stream of one push, cancelled once the sender delivers no message for ``stall_s`` seconds.

    Keepalive pings only catch a sender whose transport stopped answering: a live sender that sent a header and
    then nothing (a stuck read of its slot, or anyone reaching the data address without a job token) kept its
    call, a handler thread and the copy's whole tmpfs reservation until its own deadline (600 s by default, or
    for good without one). Only time spent waiting for the next message counts, not the receiver's own writes.
    """

    def __init__(self, messages: Iterator[replica_pb2.ReplicaChunk], context: grpc.ServicerContext,
                 stall_s: float) -> None:
        self._it, self._context, self.stall_s = messages, context, stall_s
        self._lock = threading.Lock()
        self._waiting_since: float | None = None
        self.stalled = False
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="replica-push-idle", daemon=True)
        self._watcher.start()

    def __iter__(self) -> _IdleWatch:
        return self

    def __next__(self) -> replica_pb2.ReplicaChunk:
        with self._lock:
            if self.stalled:
                raise self._stalled_error()
            self._waiting_since = time.monotonic()
        try:
            msg = next(self._it)
        except grpc.RpcError:
            if self.stalled:  # gRPC reports the cancellation this watch made as a failed stream
                raise self._stalled_error() from None
            raise
        except StopIteration:
            if self.stalled:  # or as a stream that ended: not a short copy, a cancelled one
                raise self._stalled_error() from None
            raise
        finally:
            with self._lock:
                self._waiting_since = None
        return msg

    def _stalled_error(self) -> PushStalledError:
        return PushStalledError(f"the sender delivered nothing for {self.stall_s:g} s mid-push: call cancelled")

    def _watch(self) -> None:
        tick = max(0.05, min(1.0, self.stall_s / 4))
        while not self._done.wait(tick):
            with self._lock:
                since = self._waiting_since
                if since is None or time.monotonic() - since < self.stall_s:
                    continue
                self.stalled = True
            self._context.cancel()
            return

    def close(self) -> None:
        """Stops watching (the push ended)."""
        self._done.set()


class _PushGate(grpc.ServerInterceptor):
    """Bounds the pushes a server receives at once (:data:`MAX_PUSHES`, more are refused at once with
    RESOURCE_EXHAUSTED) and cancels a push that stays silent for ``stall_s`` (:class:`_IdleWatch`)."""

    def __init__(self, max_pushes: int, stall_s: float) -> None:
        self._slots = threading.BoundedSemaphore(max_pushes)
        self.max_pushes, self.stall_s = max_pushes, stall_s

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> object:
        handler = continuation(details)
        if handler is None or handler.stream_unary is None or not details.method.endswith("/PushReplica"):
            return handler
        behavior = handler.stream_unary

        def gated(messages: Iterator[replica_pb2.ReplicaChunk], context: grpc.ServicerContext) -> object:
            if not self._slots.acquire(blocking=False):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"the receiver is taking {self.max_pushes} pushes already; try again later")
            watch = _IdleWatch(messages, context, self.stall_s)
            try:
                return behavior(watch, context)
            finally:
                watch.close()
                self._slots.release()

        return grpc.stream_unary_rpc_method_handler(gated, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


class Throttle:
    """Caps the bytes per second of one stream (0: no cap), sleeping the sender as needed.

    Args:
        mib_s: the cap in MiB/s.
    """

    def __init__(self, mib_s: float) -> None:
        self.rate = mib_s * (1 << 20)
        self._t0 = time.monotonic()
        self._sent = 0

    def piece_bytes(self) -> int:
        """Bytes per data message: :data:`PIECE_BYTES`, or about a quarter second's worth under a cap, so a slow
        but live push delivers a message well within the receiver's stall bound (:class:`_IdleWatch`)."""
        if self.rate <= 0:
            return PIECE_BYTES
        return min(PIECE_BYTES, max(4096, int(self.rate / 4)))

    def take(self, nbytes: int) -> None:
        """Accounts ``nbytes`` about to be sent; returns when the cap allows them."""
        self._sent += nbytes
        if self.rate > 0:
            ahead = self._sent / self.rate - (time.monotonic() - self._t0)
            if ahead > 0:
                time.sleep(ahead)


class CopyTruncatedError(CorruptCheckpointError):
    """A copy's data file ended before the size its manifest names (truncated while, or before, it was read)."""


def _read_at(fd: int, nbytes: int, offset: int) -> bytes:
    """Up to ``nbytes`` bytes of ``fd`` at ``offset``; fewer only where the file ends (it was truncated)."""
    parts = []
    got = 0
    while got < nbytes:
        b = os.pread(fd, nbytes - got, offset + got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def copy_stream(job: str, man: Manifest, data_path: str, from_node: str,
                throttle: Throttle) -> Iterator[replica_pb2.ReplicaChunk]:
    """The messages of one copy: the header, then the data checked chunk by chunk against the manifest.

    Raises (while iterating):
        CorruptCheckpointError: a chunk does not match its checksum (the slot was reused, or the copy is damaged),
            or the file ends early (:class:`CopyTruncatedError`).
        OSError: the file cannot be opened or read (FileNotFoundError: it was removed).
    """
    yield replica_pb2.ReplicaChunk(job=job, rank=man.rank, step=man.step, manifest=man.to_json(), from_node=from_node)
    fd = os.open(data_path, os.O_RDONLY)
    try:
        yield from _data_messages(fd, man, throttle)
    finally:
        os.close(fd)


def _data_messages(fd: int, man: Manifest, throttle: Throttle) -> Iterator[replica_pb2.ReplicaChunk]:
    """The data messages of the copy open at ``fd``, each chunk checked against the manifest before it goes.

    Read with ``pread``, not through an mmap: a file truncated under a mapping (an operator, a full tmpfs's
    cleanup, a slot cut short) raised SIGBUS on the next page touched, which killed the whole agent, every job
    it served. ``pread`` returns a short read there instead. Same cost: slicing the mapping copied each chunk
    into a new ``bytes`` too (protobuf needs one), and ``pread`` makes one such copy with one syscall per chunk.
    Holding the open fd also keeps an unlinked file's data (the store evicting it for a newer push) readable.
    """
    cb = man.chunk_bytes
    for i, expected in enumerate(man.chunks):
        o, e = i * cb, min((i + 1) * cb, man.data_bytes)
        chunk = _read_at(fd, e - o, o)
        if len(chunk) < e - o:
            raise CopyTruncatedError(f"rank {man.rank} step {man.step}: its data file ends at byte "
                                     f"{o + len(chunk)} of {man.data_bytes} (truncated while being read)")
        if chunk_checksum(chunk) != expected:
            raise CorruptCheckpointError(f"rank {man.rank} step {man.step}: chunk {i} fails its "
                                         f"{CHECKSUM_ALGO} checksum (the slot was reused or is damaged)")
        step = throttle.piece_bytes()
        for p in range(0, len(chunk), step):
            piece = chunk[p:p + step]
            throttle.take(len(piece))
            yield replica_pb2.ReplicaChunk(offset=o + p, data=piece)


def receive(messages: Iterable[replica_pb2.ReplicaChunk], job: str,
            open_writer: Callable[[Manifest], ReplicaWriter]) -> tuple[object, Manifest]:
    """Reads one copy from ``messages`` into a writer and commits it.

    Returns:
        (what the writer's commit returned, the manifest).

    Raises:
        ReplicaRefusedError: a bad header, a foreign job, no room, a torn stream or a checksum mismatch (nothing
            is published). A failure of the stream itself (the peer died) propagates after the partial copy is
            dropped.
    """
    it = iter(messages)
    try:
        head = next(it)
    except StopIteration as exc:
        raise ReplicaRefusedError("empty replica stream") from exc
    if head.job != job:
        raise ReplicaRefusedError(f"replica of job {head.job!r} sent to the agent of job {job!r}")
    try:
        man = Manifest.from_json(head.manifest, f"replica header of rank {head.rank} step {head.step}")
    except CorruptCheckpointError as exc:
        raise ReplicaRefusedError(str(exc)) from exc
    if (man.rank, man.step) != (head.rank, head.step):
        raise ReplicaRefusedError(f"replica header says rank {head.rank} step {head.step}, its manifest rank "
                                  f"{man.rank} step {man.step}")
    with open_writer(man) as w:
        for msg in it:
            w.write(msg.offset, msg.data)
        return w.commit(), man


def _cancelled_by_peer(context: grpc.ServicerContext, wait_s: float = 1.0) -> bool:
    """Whether the call was cancelled by its peer, waiting up to ``wait_s`` for gRPC to report it."""
    deadline = time.monotonic() + wait_s
    while context.is_active():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


class _AlreadyHeld(Exception):
    """The pushed copy is already held, complete: nothing to receive."""

    def __init__(self, man: Manifest) -> None:
        super().__init__(f"rank {man.rank} step {man.step}")
        self.man = man


class ReplicaServicer(replica_pb2_grpc.MemoryReplicaServicer):
    """Receives buddies' copies into the store and serves copies to replacement nodes.

    Args:
        job: the job.
        store: where received replicas go.
        own_copy: ``(rank, step=None)`` -> (data path, manifest) of this node's own newest verified copy of that
            rank (with a step: of exactly that step), or None (:meth:`MemoryTier.own_copy
            <trainguard.agent.memory_tier.MemoryTier.own_copy>`).
        node_id: this node, named in the status of a fetch that fails ("" when unknown).
        recheck_own: called with the data path of an own copy found damaged while served (:meth:`MemoryTier.
            recheck <trainguard.agent.memory_tier.MemoryTier.recheck>`: it stops being reported), or None.

    FetchReplica serves the copy of exactly ``min_step`` when this node holds one, else its newest copy above it
    (``min_step`` -1: its newest); a restore's fetcher takes the planned step only.
    """

    def __init__(self, job: str, store: ReplicaStore,
                 own_copy: Callable[..., tuple[str, Manifest] | None], node_id: str = "",
                 recheck_own: Callable[[str], None] | None = None) -> None:
        self.job, self.store, self.own_copy, self.node_id = job, store, own_copy, node_id
        self.recheck_own = recheck_own
        self.received_bytes = 0
        self._refusing = False  # refused the last push: a refusal in a row is logged at debug level only

    def PushReplica(self, request_iterator, context):  # noqa: N802 (gRPC method name)
        try:
            replica, man = receive(request_iterator, self.job, self._begin)
        except _AlreadyHeld as held:
            # A sender that lost track (it restarted, or this agent did at a new address over the same tmpfs)
            # sends a copy this node holds: taken as is. Received again, it was refused for room when the bound
            # could not hold it twice, and the sender backed off, warning, though the copy was here.
            log.debug("already holding the replica of rank %d step %d", held.man.rank, held.man.step)
            return replica_pb2.ReplicaAck(ok=True, bytes=held.man.data_bytes)
        except PushStalledError as exc:
            # The sender's trouble, not this node's: said each time, and it leaves the "refused in a row" muting of
            # real refusals (no room), which the operator of this node can act on, alone.
            log.warning("replica push from %s dropped: %s", context.peer(), exc)
            return replica_pb2.ReplicaAck(ok=False, error=str(exc))
        except ReplicaRefusedError as exc:
            if isinstance(exc, ReplicaTornError) and _cancelled_by_peer(context):
                # the sender cancelled (a newer snapshot overwrote the slot it read): gRPC may end the request
                # stream before it reports the cancellation, so the stream looks short; the sender says why
                log.debug("push cancelled by the sender: %s", exc)
                return replica_pb2.ReplicaAck(ok=False, error=str(exc))
            (log.debug if self._refusing else log.warning)("replica refused: %s", exc)
            self._refusing = True
            return replica_pb2.ReplicaAck(ok=False, error=str(exc))
        except OSError as exc:  # the tmpfs itself (full, or a folder another agent on this host changed)
            log.warning("replica not stored: %s", exc)
            return replica_pb2.ReplicaAck(ok=False, error=f"the receiver could not store it: {exc}")
        self._refusing = False
        self.received_bytes += man.data_bytes
        log.info("holding the replica of rank %d step %d (%d bytes)", man.rank, man.step, man.data_bytes)
        return replica_pb2.ReplicaAck(ok=True, bytes=man.data_bytes)

    def _begin(self, man: Manifest) -> ReplicaWriter:
        if self.store.holds(man):
            raise _AlreadyHeld(man)
        return self.store.begin(man)

    def _exact(self, rank: int, step: int) -> tuple[str, Manifest, Replica | None] | None:
        """(data path, manifest, the replica or None for an own copy) of this node's copy of ``rank`` at exactly
        ``step`` (its own first), or None."""
        own = self.own_copy(rank, step)
        if own is not None:
            return own[0], own[1], None
        rep = self.store.copy_of(rank, step)
        return (rep.data, rep.manifest, rep) if rep is not None else None

    def FetchReplica(self, request, context):  # noqa: N802 (gRPC method name)
        if request.job != self.job:
            context.abort(grpc.StatusCode.NOT_FOUND, f"the agent on node {self.node_id or '(unnamed)'} serves job "
                                                     f"{self.job!r}, not {request.job!r}")
        # The copy of exactly the step asked for when this node holds one (in any of its own slots, or as a
        # replica); else its newest above it. A restore plan names one step: its fetcher takes that step only,
        # and sending the newest made it refuse the copy while an older slot here held the very step planned.
        found = self._exact(request.rank, request.min_step) if request.min_step >= 0 else None
        if found is None:
            candidates: list[tuple[str, Manifest, Replica | None]] = []
            own = self.own_copy(request.rank)
            if own is not None and own[1].step >= request.min_step:
                candidates.append((own[0], own[1], None))
            rep = self.store.newest(request.rank, request.min_step)
            if rep is not None:
                candidates.append((rep.data, rep.manifest, rep))
            if not candidates:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no in-memory copy of job {self.job!r} rank {request.rank} "
                                                         f"at step >= {request.min_step} on node "
                                                         f"{self.node_id or '(unnamed)'}")
            found = max(candidates, key=lambda c: c[1].step)
        data, man, replica = found
        what = (f"the {'replica' if replica is not None else 'own copy'} of job {self.job!r} rank {man.rank} "
                f"step {man.step} on node {self.node_id or '(unnamed)'}")
        # Every failure of the stream ends it with a status naming the copy: raised out of the generator, gRPC
        # logged "Exception iterating responses" with a traceback and the fetcher saw a bare UNKNOWN.
        try:
            fd = os.open(data, os.O_RDONLY)
        except FileNotFoundError:  # evicted for a newer push (or removed) since it was looked up
            context.abort(grpc.StatusCode.NOT_FOUND, f"{what} is gone: removed since it was listed (evicted for a "
                                                     f"newer copy, or by hand)")
        except OSError as exc:
            log.warning("cannot serve %s: %s", what, exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{what} cannot be read: {exc}")
        try:
            opened = os.fstat(fd)
            yield replica_pb2.ReplicaChunk(job=self.job, rank=man.rank, step=man.step, manifest=man.to_json(),
                                           from_node="")
            yield from _data_messages(fd, man, Throttle(0))
        except CorruptCheckpointError as exc:  # a checksum mismatch, or the file truncated under the stream
            dropped = replica is not None and self._drop(replica, opened)
            if replica is None and self.recheck_own is not None:
                self.recheck_own(data)  # verified once, it stayed reported; the next scan checks it again
            log.warning("%s cannot be served: %s%s", what, exc, "; dropped it" if dropped else "")
            context.abort(grpc.StatusCode.DATA_LOSS, f"{what} cannot be served: {exc}"
                                                     + ("; dropped it" if dropped else ""))
        except OSError as exc:  # EIO, ENOMEM: nothing says the copy is bad; another try (or holder) may do
            log.warning("cannot serve %s: %s", what, exc)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{what} could not be read: {exc}")
        except Exception as exc:  # noqa: BLE001 - a stream's failure must end that stream only, with a status
            log.exception("serving %s failed", what)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"serving {what} failed: {exc!r}")
        finally:
            os.close(fd)

    def _drop(self, replica: Replica, opened: os.stat_result) -> bool:
        """Removes ``replica`` found damaged while served (see :meth:`ReplicaStore.drop_damaged`)."""
        return self.store.drop_damaged(replica, opened)


class ReplicaServer:
    """The agent's ``MemoryReplica`` gRPC server on its data address.

    Args:
        servicer: the service.
        host: address to listen on (the node's data address).
        token: the job token every call must carry; ``""`` serves anyone (a job without a token).
        stall_s: a caller silent for about this long (frozen, or its link gone) loses its call, seconds; so does
            a sender that delivers no message for this long mid-push though its connection lives.
        max_pushes: pushes received at once; more are refused at once (RESOURCE_EXHAUSTED). The handler pool has
            :data:`FETCH_WORKERS` threads on top, so pushes never starve a fetch.
    """

    def __init__(self, servicer: ReplicaServicer, host: str, token: str = "", stall_s: float = STALL_S,
                 max_pushes: int = MAX_PUSHES) -> None:
        from trainguard.recovery.rpc_security import TokenCheck

        # The shared guard: random bytes on either method get INVALID_ARGUMENT, not gRPC's INTERNAL + traceback.
        guard = RequestGuard("trainguard.v1.MemoryReplica", max_request_bytes=MAX_MESSAGE_BYTES)
        self.token_check = TokenCheck(token, what="replica server") if token else None
        # The gate last: it wraps the service's own handler, so a call refused for its token takes no push slot.
        gate = _PushGate(max_pushes, stall_s)
        interceptors = [guard, gate] if self.token_check is None else [self.token_check, guard, gate]
        workers = max_pushes + FETCH_WORKERS
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="replica"),
                                  interceptors=interceptors, options=_server_options(stall_s))
        replica_pb2_grpc.add_MemoryReplicaServicer_to_server(servicer, self.server)
        bracket = f"[{host}]" if ":" in host else host
        port = self.server.add_insecure_port(f"{bracket}:0")
        if not port:
            raise CheckpointError(f"cannot listen for replicas on {host}")
        self.address = f"{bracket}:{port}"
        self.server.start()

    def stop(self) -> None:
        """Stops serving (in-flight streams are cancelled; their partial copies are dropped)."""
        self.server.stop(0.5).wait()


def _metadata(token: str) -> tuple[tuple[str, str], ...]:
    from trainguard.recovery.rpc_security import TOKEN_METADATA_KEY

    return ((TOKEN_METADATA_KEY, f"Bearer {token}"),) if token else ()


def push(address: str, messages: Iterator[replica_pb2.ReplicaChunk], timeout_s: float,
         token: str = "", stall_s: float = STALL_S) -> replica_pb2.ReplicaAck:
    """Sends one copy to the buddy at ``address`` (with the job token, when the job has one); a buddy silent for
    about ``stall_s`` seconds ends the call (UNAVAILABLE) well before ``timeout_s``.

    Raises:
        grpc.RpcError: the buddy is unreachable, refused the token (UNAUTHENTICATED) or died mid-stream, or the
            stream failed on this side (a chunk failing its checksum cancels it).
    """
    with grpc.insecure_channel(address, options=_channel_options(stall_s)) as ch:
        return replica_pb2_grpc.MemoryReplicaStub(ch).PushReplica(messages, timeout=timeout_s,
                                                                  metadata=_metadata(token))


def push_copy(address: str, job: str, man: Manifest, data_path: str, from_node: str, throttle: Throttle,
              timeout_s: float, token: str = "", stall_s: float = STALL_S) -> replica_pb2.ReplicaAck:
    """Sends one copy (:func:`copy_stream`) to the buddy at ``address``, cancelling the call cleanly when the slot
    is rewritten under it or cannot be read: raised inside gRPC's sending thread, the error was logged there as
    an ERROR traceback and surfaced as ``UNKNOWN: Exception iterating requests!``, which named neither the slot
    nor the copy.

    Raises:
        CorruptCheckpointError: a chunk failed its checksum while being sent (the slot was reused by a newer
            snapshot, or is damaged); the buddy dropped the partial copy.
        OSError: the slot could not be read.
        grpc.RpcError: as :func:`push`.
    """
    stale: list[Exception] = []
    made = threading.Event()
    holder: list[grpc.Future] = []

    def messages() -> Iterator[replica_pb2.ReplicaChunk]:
        try:
            yield from copy_stream(job, man, data_path, from_node, throttle)
        except (CorruptCheckpointError, OSError) as exc:
            stale.append(exc)
            if made.wait(10.0):
                holder[0].cancel()  # the receiver sees a cancelled call and drops what it got

    with grpc.insecure_channel(address, options=_channel_options(stall_s)) as ch:
        call = replica_pb2_grpc.MemoryReplicaStub(ch).PushReplica.future(messages(), timeout=timeout_s,
                                                                         metadata=_metadata(token))
        holder.append(call)
        made.set()
        try:
            ack = call.result()
        except (grpc.RpcError, grpc.FutureCancelledError):
            if stale:
                raise stale[0] from None
            raise
        if stale:  # ended short without the cancel: the receiver refused it as torn
            raise stale[0]
        return ack


def fetch(address: str, job: str, rank: int, min_step: int, open_writer: Callable[[Manifest], ReplicaWriter],
          timeout_s: float, token: str = "", stall_s: float = STALL_S) -> tuple[object, Manifest]:
    """Fetches the copy of ``rank`` at ``min_step`` from the node at ``address``, or when it holds none its newest
    above (``open_writer`` may refuse that one), with the job token when the job has one; a peer silent for about
    ``stall_s`` seconds ends the call before ``timeout_s``.

    Raises:
        grpc.RpcError: the peer is unreachable, refused the token (UNAUTHENTICATED), holds no such copy
            (NOT_FOUND), or died mid-stream.
        ReplicaRefusedError: the copy failed verification or does not fit (nothing is published).
    """
    with grpc.insecure_channel(address, options=_channel_options(stall_s)) as ch:
        stream = replica_pb2_grpc.MemoryReplicaStub(ch).FetchReplica(
            replica_pb2.FetchReplicaRequest(job=job, rank=rank, min_step=min_step), timeout=timeout_s,
            metadata=_metadata(token))
        return receive(stream, job, open_writer)


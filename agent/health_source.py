"""Where a ``trainguard run`` gets its node health from: its own detectors, or the node daemon's.

A launcher needs detector events (a worker hung, a fatal AER error, a link down) and the predictor's alarms.
Without a daemon on the node it runs the detectors and the predictor itself
(:class:`~trainguard.agent.node_health.DetectorEventSource`), as it always did. With one, the node daemon
(``trainguard agent``) already runs the node's detectors and predictor for every job: the launcher attaches to it
over its unix socket (:func:`attach_daemon`, ``AttachJob``: the daemon also reports the node's health to this
job's coordinator and keeps the job's memory-tier arena) and its node health watches a
:class:`DaemonEventSource`: the daemon's events (``WatchEvents``) plus the detectors that watch the launcher's
own workers (``process``: hangs), which the daemon cannot see. A daemon's ``predictor.alarm`` takes the
checkpoint-then-drain path (``on_alarm``); every other event the usual one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc

from trainguard.agent.errors import AgentError
from trainguard.agent.job_registry import DAEMON_SOCKET, DAEMON_SOCKET_ENV
from trainguard.agent.launcher_lock import LauncherLock
from trainguard.detectors.events import HealthEvent, Severity
from trainguard.proto import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

#: Detectors that watch the launcher's own workers; they run in the launcher even with a daemon.
WORKER_DETECTORS = ("process",)
#: Seconds a launcher waits for a daemon's first answer before it runs alone.
PROBE_TIMEOUT_S = 2.0


class DaemonAttachError(AgentError):
    """The node daemon answered but refused to attach the job (the message says why)."""


class DaemonJobHeld(DaemonAttachError):
    """The daemon refused because live launchers of another run hold the job name with another coordinator (a
    job started again while the old run's launchers end): it may attach once they are gone."""


def _refused(exc: grpc.RpcError) -> str:
    """What an ``AttachJob`` refusal says was refused (``"arena"``), from its trailing metadata; "" if unsaid."""
    from trainguard.agent.daemon_jobs import REFUSED_METADATA_KEY

    try:
        pairs = exc.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - an error raised before the call got metadata
        return ""
    return next((str(v) for k, v in pairs if k == REFUSED_METADATA_KEY), "")


def daemon_socket(environ: dict[str, str] | None = None) -> str:
    """The daemon's socket path: ``$TRAINGUARD_AGENT_SOCKET_PATH`` (empty: no daemon), else the default."""
    env = os.environ if environ is None else environ
    return env.get(DAEMON_SOCKET_ENV, DAEMON_SOCKET)


@dataclass(frozen=True)
class JobAttachment:
    """What a launcher tells the daemon about its job (``AttachJob``)."""

    job: str
    coordinator: str
    node_id: str
    arena_root: str = ""
    token: str = ""
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""


#: Largest TLS file a launcher sends the daemon (a CA bundle of a few hundred certificates fits).
MAX_PEM_BYTES = 1 << 20


def _pem(path: str) -> bytes:
    """The file's contents for ``AttachJob`` (b"" when unset or unreadable here: the daemon then opens the path
    itself only if its ``coordinator.job_tls_dirs`` holds it, and names the field when it refuses)."""
    if not path:
        return b""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_PEM_BYTES + 1)
    except OSError:
        return b""
    return data if len(data) <= MAX_PEM_BYTES else b""


# The daemon is on this host: a restarted one answers within seconds. gRPC's default reconnect backoff grows to
# 120 s while it is down, so the launcher could go on unattached for minutes after it is back.
_LOCAL_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                    ("grpc.max_reconnect_backoff_ms", 2000)]


class DaemonLink:
    """A launcher's connection to the node daemon's unix socket.

    Args:
        path: the daemon's socket.
        channel: an open channel to it.
    """

    def __init__(self, path: str, channel: grpc.Channel) -> None:
        self.path = path
        self._channel = channel
        self.stub = agent_pb2_grpc.NodeAgentStub(channel)
        self.job = ""
        self.attached: agent_pb2.AttachJobResponse | None = None
        self.attached_at = 0.0  # Unix time just before the attachment
        self._request: agent_pb2.AttachJobRequest | None = None  # repeated by reattach()
        self.lock: LauncherLock | None = None  # how the daemon tells this launcher lives (pids differ in pods)
        self.unreachable = False  # the last reattach() found no daemon answering (UNAVAILABLE)

    @classmethod
    def connect(cls, path: str, timeout_s: float = PROBE_TIMEOUT_S) -> "DaemonLink | None":
        """The daemon at ``path`` if one answers there, else None (the launcher runs alone)."""
        if not path or not os.path.exists(path):
            return None
        channel = grpc.insecure_channel(f"unix:{path}", options=_LOCAL_RECONNECT)
        try:
            agent_pb2_grpc.NodeAgentStub(channel).GetHealth(agent_pb2.GetHealthRequest(max_events=1),
                                                            timeout=timeout_s)
        except grpc.RpcError as exc:
            channel.close()
            log.warning("a node daemon socket is at %s but does not answer (%s); running without it", path,
                        exc.code().name)
            return None
        return cls(path, channel)

    def attach(self, job: JobAttachment) -> agent_pb2.AttachJobResponse:
        """Attaches the job; a daemon that refuses the arena root is asked again without the arena.

        Raises:
            DaemonAttachError: the daemon refused (e.g. an older daemon without ``AttachJob``).
        """
        if self.lock is None:
            self.lock = LauncherLock.acquire(self.path, job.job)
        req = agent_pb2.AttachJobRequest(
            job=job.job, coordinator=job.coordinator, node_id=job.node_id, launcher_pid=os.getpid(),
            arena_root=job.arena_root, token=job.token, tls_ca_file=job.tls_ca_file,
            tls_cert_file=job.tls_cert_file, tls_key_file=job.tls_key_file,
            # The contents too: in Kubernetes the daemon runs in another container and cannot open these paths.
            tls_ca_pem=_pem(job.tls_ca_file), tls_cert_pem=_pem(job.tls_cert_file), tls_key_pem=_pem(job.tls_key_file),
            tls_server_name=job.tls_server_name,
            launcher_lock=self.lock.name if self.lock is not None else "")
        self.attached_at = time.time()
        self._request = req
        try:
            resp = self.stub.AttachJob(req, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.FAILED_PRECONDITION and req.arena_root and _refused(exc) == "arena":
                log.warning("node daemon keeps no arena for this job: %s", exc.details())
                req.arena_root = ""
                try:
                    resp = self.stub.AttachJob(req, timeout=10)
                except grpc.RpcError as exc2:
                    raise DaemonAttachError(f"node daemon at {self.path}: {exc2.details()}") from exc2
            else:
                cls = DaemonJobHeld if exc.code() is grpc.StatusCode.FAILED_PRECONDITION and \
                    _refused(exc) == "held" else DaemonAttachError
                raise cls(f"node daemon at {self.path} did not attach job {job.job}: "
                          f"{exc.code().name}: {exc.details()}") from exc
        self.job, self.attached = job.job, resp
        return resp

    def reattach(self) -> bool:
        """Repeats the attachment (the daemon restarted and forgot the job); returns whether it took."""
        req = self._request
        self.unreachable = False
        if req is None or not self.job:
            return False
        self._renew_lock(req)
        try:
            self.stub.AttachJob(req, timeout=10)
        except grpc.RpcError as exc:
            self.unreachable = exc.code() is grpc.StatusCode.UNAVAILABLE
            if not self.unreachable:  # no daemon yet is the caller's to report, once
                log.warning("node daemon at %s: attaching job %s again failed (%s)", self.path, self.job,
                            exc.code().name)
            return False
        return True

    def _renew_lock(self, req: agent_pb2.AttachJobRequest) -> None:
        """Takes a new liveness lock when this launcher's lock file is gone with the daemon's folder: systemd
        removes a unit's RuntimeDirectory= when it stops, so a restarted daemon, not finding the file named in the
        attachment, would count this live launcher dead and drop its job."""
        if self.lock is None or os.path.exists(self.lock.path) or not os.path.isdir(os.path.dirname(self.lock.path)):
            return  # still there, or the new daemon has not made its folder yet (the attachment fails anyway)
        fresh = LauncherLock.acquire(self.path, self.job)
        if fresh is not None:
            self.lock.release()
            self.lock = fresh
            req.launcher_lock = fresh.name

    def detach(self, ended: bool) -> None:
        """Leaves the job (``ended``: it is over, the daemon removes its arena); errors are logged."""
        if not self.job:
            return
        try:
            self.stub.DetachJob(agent_pb2.DetachJobRequest(
                job=self.job, ended=ended, launcher_pid=os.getpid(),
                launcher_lock=self.lock.name if self.lock is not None else ""), timeout=5)
        except grpc.RpcError as exc:
            log.warning("node daemon at %s: detaching job %s failed (%s)", self.path, self.job, exc.code().name)
        self.job = ""

    def close(self) -> None:
        """Closes the channel and drops the launcher lock (the daemon then sees this launcher gone)."""
        self._channel.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


#: Recent events each (re)connection asks the daemon to replay; those older than the attachment, or already
#: handled, are skipped, so an event between the attachment and the stream's start (or during a reconnection)
#: is never lost.
REPLAY_EVENTS = 256


class DaemonEventSource:
    """The node daemon's events (``WatchEvents``) as an :class:`~trainguard.agent.parts.EventSource`, with the
    launcher's own worker detectors beside them; reconnects (and re-attaches) when the stream ends.

    Args:
        link: the attached daemon.
        local: the worker detectors running in the launcher (``process``), or None.
        on_alarm: takes the daemon predictor's ``predictor.alarm`` events (checkpoint now, drain later); None
            hands them to ``on_event`` like any other.
        retry_s: seconds between reconnection attempts.
        since: Unix time from which events concern this launcher (default: the link's attachment).
    """

    hardware_names: tuple[str, ...] = ()  # the hardware detectors run in the daemon, on its own schedule

    def __init__(self, link: DaemonLink, local: Any = None, on_alarm: Callable[[HealthEvent], None] | None = None,
                 retry_s: float = 1.0, since: float | None = None) -> None:
        self.link = link
        self.local = local
        self.on_alarm = on_alarm
        self.retry_s = retry_s
        self.since = (link.attached_at or time.time()) if since is None else since
        self.events = 0
        self._seen: dict[str, None] = {}  # event ids handled, oldest first (bounded)
        self._stop = threading.Event()
        self._call: Any = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, on_event: Callable[[HealthEvent], None]) -> None:
        """Starts the worker detectors and the stream of the daemon's events, both delivering to ``on_event``."""
        if self.local is not None:
            self.local.start(on_event)
        self._thread = threading.Thread(target=self._follow, args=(on_event,), name="daemon-events", daemon=True)
        self._thread.start()

    def latest_metrics(self) -> dict[str, float]:
        """The worker detectors' metrics (the daemon's own predictor scores the node's)."""
        return self.local.latest_metrics() if self.local is not None else {}

    def statuses(self) -> list:
        """The worker detectors' statuses."""
        return self.local.statuses() if self.local is not None else []

    def sample_now(self, names: Sequence[str], timeout_s: float) -> list | None:
        """Out-of-schedule samples run only for local detectors (the daemon samples on its own schedule)."""
        return self.local.sample_now(names, timeout_s) if self.local is not None else []

    def _deliver(self, msg: Any, on_event: Callable[[HealthEvent], None]) -> None:
        event = HealthEvent.from_proto(msg)
        if event.time < self.since or event.event_id in self._seen:
            return  # from before this launcher attached, or replayed after a reconnection
        self._seen[event.event_id] = None
        if len(self._seen) > 4 * REPLAY_EVENTS:
            del self._seen[next(iter(self._seen))]
        self.events += 1
        if event.severity >= Severity.WARNING:  # the node's trouble belongs in the job's log too
            log.warning("node daemon: %s: %s", event.kind, event.message)
        if event.kind == "predictor.alarm" and self.on_alarm is not None:
            self.on_alarm(event)
        else:
            on_event(event)

    def _follow(self, on_event: Callable[[HealthEvent], None]) -> None:
        down = False
        full = False  # the daemon refused the stream for its limit of streams (said once per refusal spell)
        while not self._stop.is_set():
            call = self.link.stub.WatchEvents(agent_pb2.WatchEventsRequest(replay=REPLAY_EVENTS))
            with self._lock:
                self._call = call
            if self._stop.is_set():
                call.cancel()
                return
            try:
                if down:
                    # The daemon may have restarted: attach again so it keeps reporting to this job's
                    # coordinator and keeps its arena. Not answering yet is still down, not "back".
                    attached = self.link.reattach()
                    if not attached and self.link.unreachable:
                        call.cancel()
                        self._stop.wait(self.retry_s)
                        continue
                    log.info("node daemon at %s is back; following its events again%s", self.link.path,
                             "" if attached else " (not attached)")
                    down = False
                for msg in call:
                    if full:
                        log.info("node daemon at %s: following its events (a stream slot freed)", self.link.path)
                        full = False
                    self._deliver(msg, on_event)
            except grpc.RpcError as exc:
                if self._stop.is_set() or exc.code() is grpc.StatusCode.CANCELLED:
                    return
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # Up, and this job still attached: its streams are all taken (one per launcher). Not a restart,
                    # so no re-attachment, which replaced the job's reporter and was announced to every launcher.
                    if not full:
                        log.warning("node daemon at %s refuses this launcher's event stream (%s); the job gets no "
                                    "node events from it until a stream ends (retrying every %.1f s); raise the "
                                    "daemon's grpc.max_watchers (and grpc.max_workers) to the launchers per node "
                                    "plus a few", self.link.path, exc.details(), self.retry_s)
                        full = True
                    self._stop.wait(self.retry_s)
                    continue
                if not down:
                    log.warning("node daemon at %s: event stream ended (%s); retrying every %.0f s",
                                self.link.path, exc.code().name, self.retry_s)
                    down = True
            self._stop.wait(self.retry_s)

    def stop(self) -> None:
        """Ends the stream and stops the worker detectors (idempotent)."""
        self._stop.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.local is not None:
            self.local.stop()


def launcher_arena_root(environ: Mapping[str, str]) -> str:
    """The shared-memory root this launcher's workers checkpoint into, as the daemon is told at attachment.

    An empty ``$TRAINGUARD_CHECKPOINT_SHM_DIR`` means the default, as for the workers
    (:mod:`trainguard.checkpoint.config`); read as "", the daemon was told the job has no arena and did not keep
    it across a launcher restart. A ``file://`` URL names its path, as the workers read it; any other value is
    passed on as given (the workers refuse it, naming the variable).
    """
    from trainguard.checkpoint.config import CHECKPOINT_SHM_DIR_ENV, DEFAULT_SHM_ROOT, local_directory
    from trainguard.checkpoint.errors import CheckpointConfigError

    root = environ.get(CHECKPOINT_SHM_DIR_ENV) or DEFAULT_SHM_ROOT
    try:
        return local_directory(root, f"${CHECKPOINT_SHM_DIR_ENV}") or DEFAULT_SHM_ROOT
    except CheckpointConfigError:
        return root


#: How long a launcher waits for another run's launchers holding its job name (with another coordinator) to go
#: before it runs without the daemon: a job started again while the old pods end (Kubernetes' grace period is
#: 30 s by default).
HELD_WAIT_S = 30.0


def _attach_when_free(link: "DaemonLink", attachment: "JobAttachment", wait_s: float = HELD_WAIT_S,
                      period_s: float = 2.0) -> agent_pb2.AttachJobResponse:
    """:meth:`DaemonLink.attach`, tried again for up to ``wait_s`` while the daemon says the job is held by live
    launchers of another run.

    Raises:
        DaemonAttachError: refused (still held after ``wait_s``, or for another reason).
    """
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            return link.attach(attachment)
        except DaemonJobHeld as exc:
            if time.monotonic() + period_s > deadline:
                raise
            if not said:
                log.warning("%s; trying again for up to %.0f s", exc, wait_s)
                said = True
            time.sleep(period_s)


def attach_daemon(job: str, coordinator: str, node_id: str, security, checkpointing: bool,
                  environ: dict[str, str] | None = None) -> DaemonLink | None:
    """Attaches ``job`` to the node daemon when one answers on its socket; None when none runs (run alone).

    Args:
        job: the job name.
        coordinator: ``HOST:PORT`` of the job's coordinator (the daemon reports the node's health there too).
        node_id: this launcher's node id (the daemon reports under it).
        security: the launcher's :class:`~trainguard.recovery.rpc_security.RpcSecurity` towards the coordinator.
        checkpointing: the job uses the memory tier: the daemon keeps its arena.
        environ: the environment (``$TRAINGUARD_AGENT_SOCKET_PATH``, ``$TRAINGUARD_CHECKPOINT_SHM_DIR``).

    Returns:
        The attached link, or None: no daemon answers, or it refused the job (logged; the launcher runs alone).
    """
    env = os.environ if environ is None else environ
    link = DaemonLink.connect(daemon_socket(env))
    if link is None:
        return None
    arena = launcher_arena_root(env) if checkpointing else ""
    attachment = JobAttachment(job, coordinator, node_id, arena, security.token, security.tls.ca_file,
                               security.tls.cert_file, security.tls.key_file, security.server_name)
    try:
        resp = _attach_when_free(link, attachment)
    except DaemonAttachError as exc:  # e.g. a daemon of an older version: this launcher still runs, alone
        link.close()
        log.warning("%s; running with this launcher's own detectors and predictor", exc)
        return None
    log.info("attached job %s to the node daemon at %s (node %s): its detectors and predictor watch this node%s",
             job, link.path, resp.node_id,
             "; it kept this job's memory tier from a previous launcher" if resp.arena_kept else "")
    return link


__all__ = ["DaemonAttachError", "DaemonEventSource", "DaemonJobHeld", "DaemonLink", "JobAttachment", "REPLAY_EVENTS",
           "WORKER_DETECTORS", "attach_daemon", "daemon_socket", "launcher_arena_root"]

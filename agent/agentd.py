"""The long-lived node agent daemon (``trainguard agent``) as operators run it under systemd.

Lifecycle (one process)::

    load config --> logging --> state dir --> TLS files --> detectors --> /metrics --> gRPC (unix + TCP)
        --> detectors start --> READY=1 --> main loop --SIGHUP--> RELOADING=1, re-read config, READY=1
                                             |
                                             '--SIGTERM/SIGINT--> STOPPING=1, health NOT_SERVING, stop reporting,
                                                                  detectors, servers; remove the socket; exit 0

Parts: :class:`~trainguard.agent.node_health.LocalNodeHealth` with the detectors as its event source
(:class:`~trainguard.agent.node_health.DetectorEventSource`) and the predictor; the node's verdict
(:class:`~trainguard.agent.coordinator_report.NodeVerdictLatch`, fed from the event bus) reported to every
coordinator by :class:`~trainguard.agent.daemon_jobs.DaemonJobs`; :class:`~trainguard.agent.daemon_node.DaemonNode`
is what the local gRPC service serves. ``trainguard run`` composes the same node health with a worker supervisor
and a job's coordinator link (:mod:`trainguard.agent.node`).

Any problem before READY=1 (bad config, unreadable certificate, address in use, another agent on the socket)
raises :class:`~trainguard.agent.config.AgentConfigError` or :class:`~trainguard.agent.errors.AgentError`; the
CLI prints it as one line and exits 2, and systemd sees the start fail.

The main loop is the only place that pings the systemd watchdog, at half ``WatchdogSec``, and only after a
self-check passed: the gRPC server answered a health check on its own socket and the detector sampler made
progress. A wedged loop or server therefore stops the pings and systemd restarts the agent. A socket file
removed or replaced under the running server (which cannot bind it again) turns health NOT_SERVING, which fails
the self-check and a liveness probe alike.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trainguard.agent.arena_keeper import ArenaKeeper, ArenaRootError
from trainguard.agent.config import RELOADABLE, AgentConfig, AgentConfigError, parse_hostport
from trainguard.agent.coordinator_report import NodeVerdict, NodeVerdictLatch
from trainguard.agent.daemon_jobs import (REFUSED_METADATA_KEY, DaemonJobs, JobTlsPathRefused, describe_launcher,
                                          launcher_key)
from trainguard.agent.daemon_node import DaemonNode
from trainguard.agent.daemon_qualify import DaemonQualification
from trainguard.agent.errors import AgentError
from trainguard.agent.event_bus import EventBus
from trainguard.agent.launcher_lock import LOCK_NAME_RE
from trainguard.agent.health import NODE_AGENT_SERVICE, HealthReporter, enable_reflection
from trainguard.agent.local_server import NodeAgentService, local_only
from trainguard.agent.logging_setup import configure_logging
from trainguard.agent.metrics import AgentMetrics, MetricsServer
from trainguard.agent.node_health import DetectorEventSource, LocalNodeHealth
from trainguard.agent.rpc_limits import RequestGuard
from trainguard.agent.self_check import SamplerProgress
from trainguard.agent.sdnotify import (
    WATCHDOG_PID_ENV,
    WATCHDOG_USEC_ENV,
    SystemdNotifier,
    Watchdog,
    watchdog_interval,
)
from trainguard.agent.tls import ServerCertificates, TlsFiles
from trainguard._version import __version__
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.proto import agent_pb2, agent_pb2_grpc

log = logging.getLogger(__name__)

#: Deadline of the daemon's own health self-check, in seconds.
SELF_CHECK_TIMEOUT_S = 2.0

ConfigLoader = Callable[[], AgentConfig]


def _grpc_options(config: AgentConfig) -> list[tuple[str, Any]]:
    g = config.grpc
    return [
        ("grpc.max_receive_message_length", g.max_message_bytes),
        ("grpc.max_send_message_length", 16 * 1024 * 1024),
        # Fail on a port another process holds instead of silently sharing it (grpc's default is SO_REUSEPORT).
        ("grpc.so_reuseport", 0),
        # No grpc.max_concurrent_streams and no maximum_concurrent_rpcs: both refuse cheap calls (a burst of
        # health probes got REFUSED_STREAM / RESOURCE_EXHAUSTED) where they must queue for a handler thread.
        # The bound that matters is on the expensive calls: open WatchEvents streams (RequestGuard, max_watchers).
        # Find dead peers of long WatchEvents streams; accept keep-alive pings from clients every 10 s.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def _hold_lock(lock_path: str, key: str, flag: str, taken: str) -> int:
    """Creates ``lock_path`` and takes its exclusive ``flock`` for the daemon's life, writing the pid in it;
    returns its fd.

    Args:
        lock_path: the lock file.
        key, flag: the setting and the flag that name the locked thing (in the errors).
        taken: what another agent holding the lock does, for the error (``"uses the state folder X"``).

    Raises:
        AgentConfigError: the lock file cannot be created.
        AgentError: another daemon holds the lock (the message names its pid).
    """
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise AgentConfigError(f"{key}: cannot create {lock_path} ({exc.strerror}); pick another {flag}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise AgentError(f"another trainguard agent{f' (pid {holder})' if holder.isdigit() else ''} {taken}; stop "
                         f"that agent first or give this one its own {flag}") from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _lock_state_dir(path: str) -> int:
    """Takes the exclusive lock ``<state_dir>/agent.lock`` that one daemon per state folder holds for its life.

    Two daemons given other sockets but one state folder (a copied unit file, a test instance left running) both
    ran, wrote one metric history and reported one node id to the coordinators; the socket's lock alone did not
    see it.
    """
    lock_path = os.path.join(path, "agent.lock")
    return _hold_lock(lock_path, "agent.state_dir", "--state-dir",
                      f"uses the state folder {path} (it holds {lock_path})")


def _lock_socket_path(path: str) -> int:
    """Takes the exclusive lock ``<socket>.lock`` that one daemon per socket path holds for its life; returns its fd.

    The probe of :func:`_prepare_socket_path` alone cannot tell a second daemon that one runs when its socket
    file was removed under it (a cleaner, a hand), nor win a start race: gRPC unlinks and rebinds a path even
    while another server listens on it, so two daemons would run (both keeping arenas and reporting the node).
    """
    lock_path = f"{path}.lock"
    return _hold_lock(lock_path, "grpc.socket", "--socket", f"holds {lock_path}, so serves on {path}")


def _prepare_socket_path(path: str) -> None:
    """Creates the socket's folder (0750) and removes a stale socket; refuses to steal a live one."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, mode=0o750, exist_ok=True)
    except OSError as exc:
        raise AgentConfigError(f"grpc.socket: cannot create folder {folder} ({exc.strerror}); pick another --socket") from exc
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AgentConfigError(f"grpc.socket: {path} exists and is not a socket; remove it or pick another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: left over from a crashed agent
        log.info("removed stale socket %s", path)
        return
    finally:
        probe.close()
    raise AgentError(f"another process serves on {path}; stop that agent first or pick another --socket")


def _refuse_taken_port(config: AgentConfig) -> None:
    """Refuses a ``grpc.listen`` port another process listens on, before gRPC is asked to bind it.

    gRPC's core logs its own "Failed to add port to server" line to stderr before the bind error reaches us, so an
    operator saw a C++ log line ahead of (and longer than) ours. A port taken between this probe and gRPC's bind
    still fails, with gRPC's line first.

    Raises:
        AgentConfigError: the port is in use, naming it and the option that sets it.
    """
    listen = config.grpc.listen
    host, port = parse_hostport(listen)
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # a host that does not resolve: gRPC's bind error says so
    for family, kind, proto, _, address in addresses:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family this host lacks (IPv6 off): gRPC's bind fails or skips it alike
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT holds nothing
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise AgentConfigError(_port_taken_message(config)) from exc
                # another error (an address not on this host) is gRPC's to report


def _port_taken_message(config: AgentConfig) -> str:
    """The one line for a ``grpc.listen`` port in use, naming the option to change where it was set."""
    origin = config.origins.get("grpc.listen")
    if origin == "--grpc-listen":
        where = "--grpc-listen HOST:PORT"
    elif origin:
        where = f"{origin} (or --grpc-listen HOST:PORT)"
    elif config.source.startswith("<"):  # no file: the built-in default
        where = "--grpc-listen HOST:PORT (or grpc.listen in the config file)"
    else:
        where = f"grpc.listen in {config.source} (or --grpc-listen HOST:PORT)"
    _, port = parse_hostport(config.grpc.listen)
    return (f"grpc.listen: port {port} ({config.grpc.listen}) is in use by another process (another agent?); stop "
            f"it or pick a free port with {where}; '' disables TCP")


def _self_check_host(listen: str) -> str:
    """Where the daemon reaches its own TCP listener ``listen`` (``HOST:PORT``): the host itself, or loopback of
    the same family for a wildcard address (an IPv6 or a single interface's address is not on 127.0.0.1)."""
    from trainguard.agent.config import parse_hostport

    host, _ = parse_hostport(listen)
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def detector_counts(statuses: list) -> str:
    """``detectors 7 ok, 4 no hardware, 1 failed`` for the status line: the detectors by state, ok first, then
    the others that occur (a detector with nothing to watch on this node is not "ok": it watches nothing, and
    one not sampled yet has read nothing).

    Args:
        statuses: the runner's :class:`~trainguard.detectors.runner.DetectorStatus` list.
    """
    counts: dict[str, int] = {}
    for status in sorted(statuses, key=lambda s: s.state):
        # OK is the runner's state before a first sample; a stalled first sample already reads ERROR.
        unsampled = not status.samples and status.state.name == "OK"
        label = "not sampled yet" if unsampled else status.state.name.lower().replace("_", " ")
        counts[label] = counts.get(label, 0) + 1
    counts = {"ok": counts.pop("ok", 0), **counts}
    return "detectors " + ", ".join(f"{n} {label}" for label, n in counts.items())


class AgentDaemon:
    """Owns every part of the running daemon; ``start()``, then ``run()`` until a stop signal."""

    def __init__(self, load_config: ConfigLoader, notifier: SystemdNotifier | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Creates the daemon (nothing runs until :meth:`start`).

        Args:
            load_config: reads and validates the configuration (file, environment, flags); called at start and
                on every SIGHUP.
            notifier: systemd notifier; default: from ``$NOTIFY_SOCKET`` (and removed from the environment so
                workers do not inherit it).
            clock: the clock the watchdog self-check times the detector sampler's progress on, in seconds; one
                that never steps (default ``time.monotonic``: an NTP step must neither trip nor mask the check).
        """
        self._load_config = load_config
        self.notifier = notifier if notifier is not None else SystemdNotifier.from_env()
        self.watchdog = Watchdog(self.notifier, watchdog_interval())
        # The watchdog settings are for this process only; workers it spawns must not inherit them.
        for var in (WATCHDOG_USEC_ENV, WATCHDOG_PID_ENV):
            os.environ.pop(var, None)
        self.config: AgentConfig | None = None
        self.health = HealthReporter()
        self.metrics: AgentMetrics | None = None
        # The daemon's parts: node health (detectors as its event source, predictor, event bus), the node its
        # local service serves, and (below) its coordinator reporting. No workers, no job's coordinator link.
        self.node_health: LocalNodeHealth | None = None
        self.source: DetectorEventSource | None = None
        self.node: DaemonNode | None = None
        self.detector_gap = ""
        self.tcp_port = 0
        self._metrics_server: MetricsServer | None = None
        self._server: grpc.Server | None = None
        self._certs: ServerCertificates | None = None
        self._socket_ino: int | None = None
        self._socket_lost = False  # the socket file was removed or replaced under the running server
        self._socket_lock: int | None = None  # fd of <socket>.lock, held for the daemon's life
        self._state_lock: int | None = None  # fd of <state_dir>/agent.lock, held for the daemon's life
        self._self_check: Any = None
        self._self_channel: grpc.Channel | None = None
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._wake = threading.Event()
        self._status_line = ""
        self._sampler_progress = SamplerProgress(clock)  # the sampler's progress since the start, for the self-check
        self._stopped = False
        # The node's verdict for coordinators, and one reporter per coordinator (configured, or a job's).
        self.verdict_latch = NodeVerdictLatch()
        self.instance = uuid.uuid4().hex
        self.jobs: DaemonJobs | None = None  # coordinators reported to, attached jobs, kept arenas
        self._arenas: ArenaKeeper | None = None  # holds memory_tier.root from the start to the stop
        self.qualification: DaemonQualification | None = None  # [qualify] in_daemon

    # -- start --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Brings every part up and sends READY=1.

        Raises:
            AgentConfigError: invalid configuration, unreadable files, an address that cannot be bound.
            AgentError: another agent already serves on the socket.
        """
        config = self._load_config()
        self.config = config
        configure_logging(config.log.format, config.log.level)
        self._make_state_dir(config)
        if config.tls.enabled:
            self._certs = ServerCertificates(
                TlsFiles(config.tls.cert_file, config.tls.key_file, config.tls.client_ca_file)
            )
        self._check_coordinator_tls(config)
        detectors = self._create_detectors(config)
        # Once the configuration checked out, before anything acts on the node (arenas adopted, the node reported):
        # a start refused for its configuration says so even while the daemon it would replace still runs.
        self._state_lock = _lock_state_dir(config.agent.state_dir)
        try:
            # Before anything binds: a second agent on this socket (given its own state folder) was told about
            # the metrics port or the TCP port the running one holds, not about the running agent.
            self._lock_socket(config)
            self.metrics = AgentMetrics(config.agent.node_id)
            health = LocalNodeHealth(config.agent.node_id, bus=EventBus(recent=config.detectors.recent_events),
                                     threshold=config.predictor.threshold)
            self.node_health = health
            self.node = DaemonNode(config.agent.node_id, health)
            # Count every event on the bus (detectors, the agent itself), whoever published it; node-level faults
            # latch the node's verdict for the coordinators.
            metrics = self.metrics
            health.bus.add_callback(lambda e: metrics.count_event(e.source, e.kind, e.severity.name))
            health.bus.add_callback(self._latch)
            self.metrics.set_predictor(health.score, health.threshold)
            # Nobody hands the daemon fail-slow findings (those go to a job's launcher): the gauges read empty.
            self.metrics.set_failslow([], 0.0, 0.0, config.agent.node_id)
            if config.metrics.listen:
                self._metrics_server = MetricsServer(self.metrics, config.metrics.listen)
                log.info("metrics on %s", self._metrics_server.url)
            from trainguard.agent.launcher_lock import launcher_alive, launchers_dir

            # Launchers are known by the lock they hold beside the socket (pids differ between pods).
            alive = launcher_alive(launchers_dir(config.grpc.socket) if config.grpc.socket else None)
            # Exclusive: a second daemon given this memory_tier.root would adopt this one's jobs' arenas and remove
            # them ttl_s later under the running jobs; it is refused at its start, naming this daemon's pid.
            arenas = ArenaKeeper(config.memory_tier.root, config.memory_tier.ttl_s, alive=alive, exclusive=True)
            self._arenas = arenas
            arenas.adopt_existing()
            # Before the socket serves: a launcher re-attaching the moment it answers (this daemon restarted under
            # a running job) must find the jobs' table, not an AssertionError that leaves its job unattached.
            self.jobs = DaemonJobs(config.agent.node_id, socket.gethostname(), self.instance, self.node_verdict,
                                   arenas, config.coordinator.heartbeat_interval_s, config.coordinator.timeout_s,
                                   alive=alive, tls_dirs=tuple(config.coordinator.job_tls_dirs))
            self._start_grpc(config)
            if detectors is not None and config.predictor.enabled:
                # Rules tier always; the learned tier when a model file is configured. The metric history in
                # the state directory is the training data of the next model.
                health.start_predictor(config.predictor.model or None,
                                       os.path.join(config.agent.state_dir, "metric-history.sqlite"),
                                       interval_s=config.predictor.interval_s, interval_key="predictor.interval_s")
            if detectors is not None:
                self.source = DetectorEventSource(detectors)
                health.start(self.source)  # events: predictor, bus (-> metrics, verdict latch, WatchEvents)
            self.health.set("", True)
            self.health.set(NODE_AGENT_SERVICE, True)
            self.health.set_subsystem("metrics", self._metrics_server is not None)
            # SERVING when a predictor scores risk or none is wanted.
            predictor_running = health.predictor is not None
            self.health.set_subsystem("predictor", predictor_running or not config.predictor.enabled)
            if config.predictor.enabled and not predictor_running:
                log.warning("predictor.enabled is true, but no detectors run to feed it; risk stays 0")
            if config.qualify.in_daemon:  # before the first report, so a refused node is cordoned at once
                self.qualification = DaemonQualification(config, self._on_event)
                self.qualification.start()
            self.jobs.start_configured(config.coordinator.targets(), config.coordinator.job,
                                       self.coordinator_security(config))
            self._refresh()
        except BaseException:
            if self.runner is None:  # the source never started
                for det in detectors or []:
                    det.close()  # not handed to a runner yet: release their sockets and files here
            self._shutdown_parts()
            raise
        self.notifier.ready(self._summary())
        log.info("agent ready: %s", self._summary())
        self._agent_event("agent.started", Severity.INFO, f"trainguard agent {__version__} started (pid {os.getpid()})")

    def _make_state_dir(self, config: AgentConfig) -> None:
        path = config.agent.state_dir
        try:
            os.makedirs(path, mode=0o750, exist_ok=True)
        except OSError as exc:
            raise AgentConfigError(f"agent.state_dir: cannot create {path} ({exc.strerror}); pick another --state-dir") from exc
        if not os.access(path, os.W_OK | os.X_OK):
            raise AgentConfigError(f"agent.state_dir: {path} is not writable by this user; pick another --state-dir")

    def _create_detectors(self, config: AgentConfig) -> list | None:
        from trainguard.detectors.errors import DetectorConfigError

        try:
            return config.detector_loader().create()
        except DetectorConfigError as exc:
            raise AgentConfigError(str(exc)) from exc
        except ImportError as exc:
            # A detector module missing from this install: keep serving health and metrics without detectors,
            # and say so on every health query rather than refuse to start.
            self.detector_gap = f"detectors unavailable: {exc}"
            log.error("%s; running without detectors", self.detector_gap)
            return None

    @staticmethod
    def _check_detectors(config: AgentConfig) -> None:
        """Checks the ``[detectors]`` settings as :meth:`_create_detectors` does, creating no detector.

        Raises:
            AgentConfigError: an unknown detector, a table for one not enabled, a bad field or root.
        """
        from trainguard.detectors.errors import DetectorConfigError

        try:
            config.detector_loader().settings()
        except DetectorConfigError as exc:
            raise AgentConfigError(str(exc)) from exc
        except ImportError:
            pass  # a detector module missing from this install: the start runs without detectors, not refused

    def _lock_socket(self, config: AgentConfig) -> None:
        """Creates the socket's folder and takes the socket's lock (see :func:`_lock_socket_path`).

        Raises:
            AgentConfigError: the folder cannot be created.
            AgentError: another agent holds the socket.
        """
        sock = config.grpc.socket
        if not sock:
            return
        folder = os.path.dirname(os.path.abspath(sock))
        try:
            os.makedirs(folder, mode=0o750, exist_ok=True)
        except OSError as exc:
            raise AgentConfigError(f"grpc.socket: cannot create folder {folder} ({exc.strerror}); pick another "
                                   "--socket") from exc
        self._socket_lock = _lock_socket_path(sock)

    def _start_grpc(self, config: AgentConfig) -> None:
        g = config.grpc
        guard = RequestGuard(g.max_request_bytes, g.max_watchers, observer=self.metrics.observe_request)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=g.max_workers, thread_name_prefix="trainguard-grpc"),
            interceptors=[guard],
            options=_grpc_options(config),
        )
        agent_pb2_grpc.add_NodeAgentServicer_to_server(_DaemonService(self), server)
        self.health.add_to_server(server)
        if g.reflection:
            enable_reflection(server)
        if g.listen:
            _refuse_taken_port(config)  # before the socket is bound: a refused start leaves no socket file behind
        if g.socket:
            _prepare_socket_path(g.socket)
            try:
                server.add_insecure_port(f"unix:{g.socket}")
            except RuntimeError as exc:
                raise AgentConfigError(f"grpc.socket: cannot listen on {g.socket} ({exc})") from exc
        if g.listen:
            try:
                if self._certs is not None:
                    self.tcp_port = server.add_secure_port(g.listen, self._certs.credentials())
                else:
                    self.tcp_port = server.add_insecure_port(g.listen)
            except RuntimeError as exc:
                raise AgentConfigError(f"grpc.listen: cannot listen on {g.listen} ({exc}); is the port in use? Pick "
                                       "another with --grpc-listen HOST:PORT or grpc.listen") from exc
        # The socket file is created by start(): owner-only until chmod gives the configured group access.
        old_umask = os.umask(0o177)
        try:
            server.start()
        finally:
            os.umask(old_umask)
        self._server = server
        if g.socket:
            os.chmod(g.socket, g.socket_mode)
            self._socket_ino = os.stat(g.socket).st_ino
            from trainguard.agent.launcher_lock import prepare_launchers_dir

            try:
                prepare_launchers_dir(g.socket, g.socket_mode)
            except OSError as exc:  # launchers then go by pid: right unless they run in another pid namespace
                log.warning("cannot prepare the launchers' lock folder beside %s (%s); attached launchers are "
                            "known by pid only", g.socket, exc)
            self._self_channel = grpc.insecure_channel(f"unix:{g.socket}")
        elif self._certs is None:
            self._self_channel = grpc.insecure_channel(f"{_self_check_host(g.listen)}:{self.tcp_port}")
        if self._self_channel is not None:
            self._self_check = health_pb2_grpc.HealthStub(self._self_channel).Check
        log.info("gRPC on %s%s", f"unix:{g.socket} " if g.socket else "",
                 f"tcp port {self.tcp_port}{' (TLS' + (', mutual' if self._certs.require_client_auth else '') + ')' if self._certs else ''}"
                 if g.listen else "")

    # -- events and state ---------------------------------------------------------------------------------

    def _agent_event(self, kind: str, severity: Severity, message: str, **evidence: str) -> None:
        """Publishes an event about the agent itself (start, reload) so operators see it in the event stream."""
        action = Action.NONE if severity <= Severity.INFO else Action.WATCH
        self._on_event(HealthEvent(source="agent", kind=kind, severity=severity, action=action, message=message,
                                   evidence=dict(evidence),
                                   node_id=self.config.agent.node_id if self.config else ""))

    def _on_event(self, event: HealthEvent) -> None:
        """Publishes an event of the daemon itself on the node's bus (detector events come through node health)."""
        if not event.node_id and self.config is not None:
            event = event.with_node(self.config.agent.node_id)
        if self.node_health is not None:
            self.node_health.bus.publish(event)

    def _latch(self, event: HealthEvent) -> None:
        """Bus callback: a node-level fault latches the verdict FATAL and tells every coordinator now."""
        if self.verdict_latch.observe(event) and self.jobs is not None:
            self.jobs.poke()  # not at the next interval

    @property
    def runner(self) -> Any:
        """The detector runner of the event source (None without detectors, or before start)."""
        return self.source.runner if self.source is not None else None

    # -- coordinators -------------------------------------------------------------------------------------

    def node_verdict(self) -> NodeVerdict:
        """The node's verdict now: a latched node-level fault, else the predictor's score against the threshold in
        force (the configured one, else the model's calibrated one)."""
        health = self.node_health
        if health is None:
            return self.verdict_latch.verdict()
        return self.verdict_latch.verdict(health.score, health.threshold)

    def coordinator_security(self, config: AgentConfig) -> Any:
        """The TLS files and job token of the configured coordinators (``[coordinator]``).

        Raises:
            AgentConfigError: the token file is unreadable.
        """
        from trainguard.agent.tls import TlsFiles as Files
        from trainguard.recovery.rpc_security import RpcSecurity, SecurityConfigError, read_token_file

        c = config.coordinator
        try:
            token = read_token_file(c.token_file, "coordinator.token_file") if c.token_file else ""
        except SecurityConfigError as exc:
            raise AgentConfigError(str(exc)) from exc
        return RpcSecurity(tls=Files(c.tls_cert_file, c.tls_key_file, c.tls_ca_file), token=token)

    @staticmethod
    def _check_coordinator_tls(config: AgentConfig) -> None:
        """Loads the ``[coordinator]`` TLS files as the reporters will, before anything listens: a readable file
        that is no PEM (or a key that is not the certificate's) was found only when the first reporter started,
        after the listeners had logged, and named by path only.

        Raises:
            AgentConfigError: a malformed file, naming its key and the config file.
        """
        from trainguard.agent.tls import TlsFiles as Files, channel_credentials

        c = config.coordinator
        if not c.targets() or not (c.tls_ca_file or c.tls_cert_file):
            return
        try:
            channel_credentials(Files(c.tls_cert_file, c.tls_key_file, c.tls_ca_file))
        except AgentConfigError as exc:
            text = str(exc)
            key = next((k for k in ("tls_ca_file", "tls_cert_file", "tls_key_file")
                        if getattr(c, k) and getattr(c, k) in text), "tls_cert_file")
            raise AgentConfigError(f"{config.source}: coordinator.{key}: {text}") from exc

    def attach_job(self, req: agent_pb2.AttachJobRequest) -> agent_pb2.AttachJobResponse:
        """A launcher attaches its job (see :meth:`DaemonJobs.attach`), announced on the event stream.

        Raises:
            ArenaRootError, SecurityConfigError: see :meth:`DaemonJobs.attach`.
        """
        assert self.jobs is not None
        resp = self.jobs.attach(req)
        self._agent_event("agent.job_attached", Severity.INFO,
                          f"job {req.job} attached by launcher {describe_launcher(req)}"
                          + (f" (coordinator {req.coordinator})" if req.coordinator else ""),
                          job=req.job, arena_kept=str(resp.arena_kept))
        return resp

    def detach_job(self, req: agent_pb2.DetachJobRequest) -> bool:
        """A launcher leaves its job (see :meth:`DaemonJobs.leave`), announced on the event stream as attaching is;
        returns whether the job's arena was removed."""
        if self.jobs is None:
            return False
        who = describe_launcher(req)
        done = self.jobs.leave(req.job, launcher_key(req), req.ended, who)
        self._agent_event("agent.job_detached", Severity.WARNING if done.ignored else Severity.INFO, done.summary,
                          job=req.job, ended=str(req.ended), ignored=str(done.ignored),
                          arena_removed=str(done.arena_removed))
        return done.arena_removed

    def detector_statuses(self) -> list:
        """The detector runner's statuses (empty without detectors)."""
        return list(self.runner.statuses()) if self.runner is not None else []

    def _refresh(self) -> None:
        """Copies live state into metrics and health statuses."""
        statuses = self.detector_statuses()
        self._sampler_progress.observe(statuses)  # every loop turn: progress is dated to the turn that saw it
        if self.metrics is not None:
            self.metrics.set_detector_states({s.name: s.state.name for s in statuses})
            self.metrics.set_worker_states([])  # the daemon runs no workers (jobs' launchers do)
            if self.node_health is not None:
                h = self.node_health
                self.metrics.set_predictor(h.score, h.threshold, h.alarms_per_day)
        if not self._socket_in_place():
            # Launchers and `trainguard status` cannot reach this agent and the running server cannot bind the
            # path again: NOT_SERVING fails the liveness probe (and the self-check, which stops the watchdog's
            # keep-alives), so the agent is restarted and binds it anew.
            self.health.set("", False)
            self.health.set(NODE_AGENT_SERVICE, False)
        self.health.set_subsystem("coordinator", self.jobs is None or self.jobs.configured_ok())
        self.health.set_subsystem("workers", True)
        from trainguard.detectors.base import DetectorState

        bad = (DetectorState.FAILED, DetectorState.ERROR)
        if statuses:
            self.health.set_detectors({s.name: s.state not in bad for s in statuses})
        else:
            self.health.set_subsystem("detectors", not self.detector_gap)

    def _socket_in_place(self) -> bool:
        """Whether ``grpc.socket`` still names the socket this agent serves on (logs once when it does not).

        The self-check's channel keeps the connection it made before, so it cannot tell a removed or replaced
        socket file: the agent answered itself while nobody else could reach it.
        """
        sock = self.config.grpc.socket if self.config is not None else ""
        if not sock or self._socket_ino is None:
            return True
        try:
            st = os.stat(sock)
            in_place = stat.S_ISSOCK(st.st_mode) and st.st_ino == self._socket_ino
        except OSError:
            in_place = False
        if not in_place and not self._socket_lost:
            self._socket_lost = True
            log.error("the socket %s was removed or replaced: launchers and `trainguard status` cannot reach this "
                      "agent; health NOT_SERVING and no watchdog keep-alives, so that it is restarted", sock)
        return in_place

    def _sampler_stalled(self) -> bool:
        statuses = self.detector_statuses()
        if not statuses:
            return False
        shortest = min(getattr(d.config, "interval_s", 5.0) for d in self.runner.detectors)
        return self._sampler_progress.stalled(statuses, shortest)

    def _healthy(self) -> bool:
        """The main loop's verdict: gRPC answers its own health check and the detector sampler progresses."""
        if self._self_check is not None:
            try:
                reply = self._self_check(health_pb2.HealthCheckRequest(service=""), timeout=SELF_CHECK_TIMEOUT_S)
            except grpc.RpcError as exc:
                log.error("self-check: the gRPC server did not answer (%s); withholding watchdog pings", exc.code())
                return False
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
        if self._sampler_stalled():
            log.error("self-check: the detector sampler made no progress; withholding watchdog pings")
            return False
        return True

    def _summary(self) -> str:
        """One line for systemd's STATUS= and the log."""
        workers = 0  # jobs' launchers run the workers
        score = self.node_health.score if self.node_health is not None else 0.0
        detectors = detector_counts(self.detector_statuses()) if not self.detector_gap else "no detectors"
        where = []
        if self.config is not None and self.config.grpc.socket:
            where.append(f"unix:{self.config.grpc.socket}")
        if self.config is not None and self.config.grpc.listen:
            where.append(f"tcp:{self.tcp_port}{'+tls' if self._certs else ''}")
        coordinators = self.jobs.summary() if self.jobs is not None else ""
        coordinators = f"; {coordinators}" if coordinators else ""
        verdict = self.verdict_latch.verdict().verdict.name.lower()
        return (f"serving on {' '.join(where)}; {detectors}; {workers} workers; risk {score:.2f}; "
                f"node {verdict}{coordinators}")

    # -- main loop ----------------------------------------------------------------------------------------

    def install_signal_handlers(self) -> Callable[[], None]:
        """SIGTERM/SIGINT request a graceful stop, SIGHUP a reload; returns a function restoring the old ones."""
        old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}

        def on_stop(signum: int, _frame: Any) -> None:
            self.request_stop()

        def on_hup(signum: int, _frame: Any) -> None:
            self._reload.set()
            self._wake.set()

        signal.signal(signal.SIGTERM, on_stop)
        signal.signal(signal.SIGINT, on_stop)
        signal.signal(signal.SIGHUP, on_hup)

        def restore() -> None:
            for s, h in old.items():
                signal.signal(s, h)

        return restore

    def request_stop(self) -> None:
        """Asks the main loop to stop gracefully (safe from signal handlers and other threads)."""
        self._stop.set()
        self._wake.set()

    def request_reload(self) -> None:
        """Asks the main loop to reload the configuration."""
        self._reload.set()
        self._wake.set()

    def run(self) -> int:
        """Runs the main loop until a stop is requested, then stops gracefully.

        Returns:
            0 after a clean stop.
        """
        assert self.config is not None, "start() first"
        try:
            while not self._stop.is_set():
                if self._reload.is_set():
                    self._reload.clear()
                    self.reload()
                self._refresh()
                if self.jobs is not None:
                    self.jobs.sweep()
                if self.qualification is not None:
                    self.qualification.poll()
                if self.node_health is not None:
                    self.node_health.take_actionable()  # acted on by the verdict latch; keep the queue empty
                    if self.runner is not None:
                        self.node_health.tick(None, self.runner.latest_metrics())
                withheld = False
                if self.watchdog.seconds_until_due() == 0.0:
                    if self.watchdog.tick(self._healthy()):
                        if self.metrics is not None:
                            self.metrics.watchdog_pings.inc()
                    else:
                        withheld = True
                summary = self._summary()
                if summary != self._status_line:
                    self._status_line = summary
                    self.notifier.status(summary)
                timeout = self.config.agent.loop_interval_s
                due = self.watchdog.seconds_until_due()
                # A keep-alive withheld (the self-check failed, or systemd's socket refused it) stays due: check
                # again after a loop interval, not at once (that spun the loop, logging an error every 10 ms).
                if due is not None and not withheld:
                    timeout = min(timeout, max(due, 0.01))
                self._wake.wait(timeout)
                self._wake.clear()
        finally:
            self.stop()
        return 0

    def reload(self) -> None:
        """Re-reads the configuration and applies the reloadable options (SIGHUP).

        A bad new configuration is logged and the running one kept; options that need a restart are named.
        """
        from trainguard.recovery.rpc_security import SecurityConfigError

        assert self.config is not None
        self.notifier.reloading()
        old = self.config
        try:
            new = self._load_config()
            # Checked as start() checks them: detectors.* apply only after a restart, and a table start() refuses
            # (an unknown detector or field) was taken here, so the next restart of the unit failed.
            self._check_detectors(new)
            if self._certs is not None and new.tls.enabled:
                self._certs.reload(TlsFiles(new.tls.cert_file, new.tls.key_file, new.tls.client_ca_file))
            if self.jobs is not None:
                # Rotated in place like tls.*: the running paths' new contents (a changed path needs a restart).
                self._check_coordinator_tls(old)
                try:
                    self.jobs.reload_configured(self.coordinator_security(old))
                except SecurityConfigError as exc:
                    raise AgentConfigError(f"{old.source}: [coordinator] TLS files: {exc}") from exc
        except (AgentConfigError, AgentError) as exc:
            log.error("reload failed, keeping the running configuration: %s", exc)
            self._agent_event("agent.reload_failed", Severity.WARNING, f"reload failed: {exc}")
            self.notifier.ready(f"reload failed: {exc}"[:200])
            return
        pending = old.restart_required(new)
        if pending:
            log.warning("reload: changes to %s apply only after a restart", ", ".join(pending))
        updates = {}
        for key in RELOADABLE:
            section, name = key.split(".")
            updates[(section, name)] = getattr(getattr(new, section), name)
        self.config = old.with_overrides(updates)
        configure_logging(self.config.log.format, self.config.log.level)
        if self.node_health is not None:
            self.node_health.threshold = self.config.predictor.threshold
        if self.jobs is not None:
            self.jobs.arenas.ttl_s = self.config.memory_tier.ttl_s
            self.jobs.set_timing(self.config.coordinator.heartbeat_interval_s, self.config.coordinator.timeout_s)
        log.info("configuration reloaded from %s", new.source)
        self._agent_event("agent.reloaded", Severity.INFO, f"configuration reloaded from {new.source}",
                          restart_needed=",".join(pending))
        self.notifier.ready(self._summary())

    # -- stop ---------------------------------------------------------------------------------------------

    def release_locks(self) -> None:
        """Lets go of the state folder's lock (at the stop, or after a failed start)."""
        if self._state_lock is not None:
            os.close(self._state_lock)
            self._state_lock = None

    def stop(self) -> None:
        """Stops gracefully: STOPPING=1, health NOT_SERVING, workers, detectors, servers, socket (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self.notifier.stopping("stopping: workers, detectors, servers")
        log.info("stopping")
        self.health.shutdown()
        self._shutdown_parts()
        log.info("stopped")
        self.notifier.close()

    def _shutdown_parts(self) -> None:
        if self.jobs is not None:
            self.jobs.stop()
        if self._arenas is not None:
            # Lets go of memory_tier.root, so the daemon started next (in this process too) is not refused.
            self._arenas.close()
            self._arenas = None
        if self.node is not None:
            self.node.stopping = True  # ends WatchEvents streams
        if self.node_health is not None and self.node_health.state.name != "STOPPED":
            self.node_health.stop()  # stops the detectors
        if self._self_channel is not None:
            self._self_channel.close()
        if self._server is not None:
            self._server.stop(grace=2.0).wait(5.0)
        if self._metrics_server is not None:
            self._metrics_server.close()
        sock = self.config.grpc.socket if self.config is not None else ""
        if sock and self._socket_ino is not None:
            try:
                if os.stat(sock).st_ino == self._socket_ino:  # never remove a successor's socket
                    os.unlink(sock)
            except FileNotFoundError:
                pass
        if self._socket_lock is not None:
            os.close(self._socket_lock)  # the file stays: unlinking a lock file races with the next daemon's open
            self._socket_lock = None
        self.release_locks()


class _DaemonService(NodeAgentService):
    """The node service with the daemon's detector states added to ``GetHealth`` and checkpoint reports
    recorded in the metrics."""

    def __init__(self, daemon: AgentDaemon) -> None:
        super().__init__(daemon.node)
        self._daemon = daemon
        self._lock = threading.Lock()
        self._detectors_key: tuple = ()
        self._detectors = agent_pb2.NodeHealth()

    def _detector_part(self) -> agent_pb2.NodeHealth:
        # Statuses change once per sample interval while health checkers may ask hundreds of times a second:
        # convert them once per change (the runner hands out a new status object on each sample).
        statuses = self._daemon.detector_statuses()
        with self._lock:
            # Identity, not equality: the cache holds the status objects, so their ids cannot be reused.
            same = len(statuses) == len(self._detectors_key) and all(
                a is b for a, b in zip(statuses, self._detectors_key))
            if not same or not statuses:
                key = tuple(statuses)
                part = agent_pb2.NodeHealth(detectors=[s.to_proto() for s in statuses])
                if self._daemon.detector_gap:
                    part.detectors.add(name="detectors", state=agent_pb2.DETECTOR_STATE_ERROR,
                                       detail=self._daemon.detector_gap)
                self._detectors_key, self._detectors = key, part
            return self._detectors

    def GetHealth(self, request, context):  # noqa: N802 (gRPC naming)
        health = super().GetHealth(request, context)
        if not health.detectors:
            health.MergeFrom(self._detector_part())
        return health

    def AttachJob(self, request, context):  # noqa: N802 (gRPC naming)
        """A `trainguard run` on this node attaches its job (local socket only)."""
        from trainguard.recovery.rpc_security import SecurityConfigError
        from trainguard.recovery.spec import JOB_NAME_RE

        local_only(context, "AttachJob")
        if not JOB_NAME_RE.match(request.job):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"job {request.job[:64]!r} is not a job name")
        if request.launcher_pid <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "launcher_pid must be the launcher's pid (> 0)")
        if request.launcher_lock and not LOCK_NAME_RE.match(request.launcher_lock):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"launcher_lock {request.launcher_lock[:64]!r} is not a "
                                                            "lock file name in the daemon's launchers folder")
        if request.coordinator:
            from trainguard.agent.config import parse_hostport

            try:
                parse_hostport(request.coordinator)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"coordinator: {exc}")
        try:
            return self._daemon.attach_job(request)
        except ArenaRootError as exc:
            # Marked, so the launcher retries without the arena only when the arena was what was refused.
            context.set_trailing_metadata(((REFUSED_METADATA_KEY, "arena"),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except JobTlsPathRefused as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except SecurityConfigError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the job's coordinator TLS files, as this daemon "
                                                               f"reads them: {exc}")

    def DetachJob(self, request, context):  # noqa: N802 (gRPC naming)
        """A launcher leaves its job; ``ended`` removes the job's arena now (local socket only)."""
        from trainguard.recovery.spec import JOB_NAME_RE

        local_only(context, "DetachJob")
        # The job name becomes a path under the daemon's folders (its TLS files, its arena): a name that is not
        # one plain path element ("/etc", "../..") would have the daemon delete a folder of someone else's.
        if not JOB_NAME_RE.match(request.job):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"job {request.job[:64]!r} is not a job name")
        if request.launcher_lock and not LOCK_NAME_RE.match(request.launcher_lock):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"launcher_lock {request.launcher_lock[:64]!r} is not a "
                                                            "lock file name in the daemon's launchers folder")
        return agent_pb2.DetachJobResponse(arena_removed=self._daemon.detach_job(request))

    def ReportCheckpoint(self, request, context):  # noqa: N802 (gRPC naming)
        reply = super().ReportCheckpoint(request, context)
        if self._daemon.metrics is not None:
            self._daemon.metrics.observe_checkpoint(request.tier, request.bytes, request.stall_s, request.persist_s,
                                                    request.step)
        return reply


def config_loader(
    config_path: str | None = None,
    grpc_listen: str | None = None,
    socket_path: str | None = None,
    state_dir: str | None = None,
) -> ConfigLoader:
    """Builds the loader the daemon calls at start and on SIGHUP: file, then environment, then these flags.

    Args:
        config_path: ``--config``; None means ``$TRAINGUARD_AGENT_CONFIG`` or the default path.
        grpc_listen: ``--grpc-listen HOST:PORT`` ("" disables TCP), or None to keep the configured one.
        socket_path: ``--socket PATH`` ("" disables it), or None.
        state_dir: ``--state-dir DIR``, or None.

    Relative ``config_path``, ``socket_path`` and ``state_dir`` are resolved against the current folder now.

    Returns:
        A function returning the validated configuration, raising AgentConfigError.
    """
    # Relative paths on the command line mean the folder the command was typed in: resolved once, here, so every
    # later load (SIGHUP) and every client reads the same place. In the file and the environment they are refused
    # (config.validate): under systemd the daemon starts in /, not where the file or the unit was written.
    config_path, socket_path, state_dir = (os.path.abspath(p) if p else p
                                           for p in (config_path, socket_path, state_dir))
    flags = {("grpc", "listen"): (grpc_listen, "--grpc-listen"), ("grpc", "socket"): (socket_path, "--socket"),
             ("agent", "state_dir"): (state_dir, "--state-dir")}

    def load() -> AgentConfig:
        config = AgentConfig.load(config_path)
        updates = {key: value for key, (value, _) in flags.items() if value is not None}
        origins = {f"{k[0]}.{k[1]}": flag for k, (value, flag) in flags.items() if value is not None}
        config = config.with_overrides(updates, origins)
        config.validate()
        return config

    return load


def handle_agent(args: Any) -> int:
    """``trainguard agent`` handler: runs the daemon in the foreground."""
    return run_agent(config_loader(args.config, args.grpc_listen, args.socket, args.state_dir))


def run_agent(load_config: ConfigLoader) -> int:
    """Runs the daemon in the foreground until SIGTERM/SIGINT.

    Args:
        load_config: reads and validates the configuration (see :class:`AgentDaemon`).

    Returns:
        The exit code (0 after a clean stop).

    Raises:
        AgentConfigError, AgentError: the daemon could not start.
    """
    daemon = AgentDaemon(load_config)
    restore = daemon.install_signal_handlers()
    try:
        try:
            daemon.start()
        except BaseException:
            daemon.release_locks()  # a failed start in a process that lives on must not keep the state folder
            raise
        return daemon.run()
    finally:
        restore()

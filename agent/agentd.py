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

This module is the daemon's lifecycle (start, main loop, reload, stop). Its other jobs live beside it:
:mod:`~trainguard.agent.daemon_config` (the loader and checks of its configuration),
:mod:`~trainguard.agent.daemon_claims` (its state folder's and socket's locks, the socket path, the TCP port),
:mod:`~trainguard.agent.daemon_service` (its gRPC service), :mod:`~trainguard.agent.daemon_status` (health
statuses, the watchdog's self-check, the status line).

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

import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health_pb2_grpc

from trainguard.agent.arena_keeper import ArenaKeeper
from trainguard.agent.config import METRICS_LISTEN_ENV, RELOADABLE, AgentConfig, AgentConfigError
from trainguard.agent.coordinator_report import NodeVerdict, NodeVerdictLatch
from trainguard.agent.daemon_jobs import DaemonJobs, describe_launcher, launcher_key
from trainguard.agent.daemon_claims import (lock_socket_path, lock_state_dir, make_state_dir, prepare_socket_path,
                                            refuse_taken_port, self_check_host)
from trainguard.agent.daemon_config import (ConfigLoader, check_coordinator_tls, check_detectors, config_loader,
                                            coordinator_security)
from trainguard.agent.daemon_node import DaemonNode
from trainguard.agent.daemon_service import DaemonService, grpc_options
from trainguard.agent.daemon_status import SELF_CHECK_TIMEOUT_S, DaemonStatus, detector_counts
from trainguard.agent.daemon_qualify import DaemonQualification
from trainguard.agent.errors import AgentError
from trainguard.agent.event_bus import EventBus
from trainguard.agent.health import NODE_AGENT_SERVICE, HealthReporter, enable_reflection
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

# Moved to modules of their own; still importable from here (the CLI, tests and deployments import them so).
__all__ = ["SELF_CHECK_TIMEOUT_S", "AgentDaemon", "ConfigLoader", "config_loader", "detector_counts", "handle_agent",
           "run_agent"]


class AgentDaemon(DaemonStatus):
    """Owns every part of the running daemon; ``start()``, then ``run()`` until a stop signal.

    Its statuses, watchdog self-check and status line are :class:`~trainguard.agent.daemon_status.DaemonStatus`'s.
    """

    #: The TLS files and job token of the configured coordinators (see :func:`daemon_config.coordinator_security`).
    coordinator_security = staticmethod(coordinator_security)

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
        self._executor: futures.ThreadPoolExecutor | None = None
        self._certs: ServerCertificates | None = None
        self._socket_ino: int | None = None
        self._socket_lost = False  # the socket file was removed or replaced under the running server
        self._predictor_degraded_said = False  # the predictor.degraded event went out (see DaemonStatus)
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
        make_state_dir(config)
        if config.tls.enabled:
            self._certs = ServerCertificates(
                TlsFiles(config.tls.cert_file, config.tls.key_file, config.tls.client_ca_file)
            )
        check_coordinator_tls(config)
        detectors = self._create_detectors(config)
        # Once the configuration checked out, before anything acts on the node (arenas adopted, the node reported):
        # a start refused for its configuration says so even while the daemon it would replace still runs.
        self._state_lock = lock_state_dir(config.agent.state_dir)
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
                self._metrics_server = MetricsServer(
                    self.metrics, config.metrics.listen,
                    setting=f"metrics.listen in the agent's config (or ${METRICS_LISTEN_ENV}; empty: no /metrics)")
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
            # A subsystem switched off is no fault: SERVING, and "off" in `trainguard status` (metrics.listen = ""
            # left the metrics NOT_SERVING, while a disabled predictor was SERVING). A metrics address that cannot
            # be bound fails the start above.
            if self._metrics_server is None:
                self.health.set_subsystem_off("metrics")
            else:
                self.health.set_subsystem("metrics", True)
            predictor_running = health.predictor is not None
            if not config.predictor.enabled:
                self.health.set_subsystem_off("predictor")
            else:  # wanted: SERVING only when it scores risk
                self.health.set_subsystem("predictor", predictor_running)
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

    def _lock_socket(self, config: AgentConfig) -> None:
        """Creates the socket's folder and takes the socket's lock (see :func:`~trainguard.agent.daemon_claims.lock_socket_path`).

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
        self._socket_lock = lock_socket_path(sock)

    def _start_grpc(self, config: AgentConfig) -> None:
        g = config.grpc
        guard = RequestGuard(g.max_request_bytes, g.max_watchers, observer=self.metrics.observe_request)
        self._executor = futures.ThreadPoolExecutor(max_workers=g.max_workers, thread_name_prefix="trainguard-grpc")
        server = grpc.server(
            self._executor,
            interceptors=[guard],
            options=grpc_options(config),
        )
        agent_pb2_grpc.add_NodeAgentServicer_to_server(DaemonService(self), server)
        self.health.add_to_server(server)
        if g.reflection:
            enable_reflection(server)
        if g.listen:
            refuse_taken_port(config)  # before the socket is bound: a refused start leaves no socket file behind
        if g.socket:
            prepare_socket_path(g.socket)
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
            self._self_channel = grpc.insecure_channel(f"{self_check_host(g.listen)}:{self.tcp_port}")
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


    def attach_job(self, req: agent_pb2.AttachJobRequest) -> agent_pb2.AttachJobResponse:
        """A launcher attaches its job (see :meth:`DaemonJobs.attach`), announced on the event stream.

        Raises:
            ArenaRootError, JobHeldElsewhere, SecurityConfigError: see :meth:`DaemonJobs.attach`.
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
            check_detectors(new)
            if self._certs is not None and new.tls.enabled:
                self._certs.reload(TlsFiles(new.tls.cert_file, new.tls.key_file, new.tls.client_ca_file))
            if self.jobs is not None:
                # Rotated in place like tls.*: the running paths' new contents (a changed path needs a restart).
                check_coordinator_tls(old)
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
        if self._executor is not None:
            # grpc does not shut its executor down: every daemon stopped in a process left its handler threads
            # behind. Not waited for: a handler stuck past the grace must not hold the stop.
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
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

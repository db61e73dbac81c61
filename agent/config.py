"""Typed, validated configuration of the node agent daemon (``trainguard agent``).

One TOML file (default :data:`DEFAULT_CONFIG_PATH`) holds every option; ``deploy/agent.toml`` documents each
one. Values are resolved in this order, later wins:

1. the defaults of the dataclasses below,
2. the TOML file,
3. environment variables (:data:`ENV_OVERRIDES`, names documented as module constants),
4. command-line flags (``--grpc-listen``, ``--socket``, ``--state-dir``), applied with :func:`with_overrides`.

Every problem (unknown key, wrong type, value out of range, unreadable certificate) raises
:class:`AgentConfigError` with one line naming the key and the file, so the daemon fails at start instead of
running half-configured.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import socket
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from trainguard.agent.errors import AgentError
from trainguard.agent.qualify.config import QualifyConfigError, QualifySection
from trainguard.config_loader import URL_RE, build, config_field, read_toml
from trainguard.errors import ConfigError
from trainguard.names import NODE_ID_RE

#: Where the daemon reads its configuration when neither ``--config`` nor :data:`CONFIG_ENV` says otherwise.
DEFAULT_CONFIG_PATH = "/etc/trainguard/agent.toml"

#: Path of the configuration file (used when ``--config`` is not given).
CONFIG_ENV = "TRAINGUARD_AGENT_CONFIG"
#: Overrides ``agent.node_id``.
NODE_ID_ENV = "TRAINGUARD_AGENT_NODE_ID"
#: Overrides ``agent.state_dir``.
STATE_DIR_ENV = "TRAINGUARD_AGENT_STATE_DIR"
#: Overrides ``grpc.listen`` (``HOST:PORT``; empty disables TCP).
GRPC_LISTEN_ENV = "TRAINGUARD_AGENT_GRPC_LISTEN"
#: Overrides ``grpc.socket`` (unix socket path; empty disables it).
SOCKET_ENV = "TRAINGUARD_AGENT_SOCKET_PATH"
#: Overrides ``metrics.listen`` (``HOST:PORT``; empty disables /metrics).
METRICS_LISTEN_ENV = "TRAINGUARD_AGENT_METRICS_LISTEN"
#: Overrides ``log.format`` (``auto``, ``journal``, ``text`` or ``json``).
LOG_FORMAT_ENV = "TRAINGUARD_AGENT_LOG_FORMAT"
#: Overrides ``log.level``.
LOG_LEVEL_ENV = "TRAINGUARD_AGENT_LOG_LEVEL"
#: Overrides ``detectors.root`` (prefix of /sys, /proc and /dev paths the detectors read).
DETECTORS_ROOT_ENV = "TRAINGUARD_AGENT_DETECTORS_ROOT"
#: Overrides ``coordinator.address``.
COORDINATOR_ENV = "TRAINGUARD_AGENT_COORDINATOR"

#: Environment variable -> (section, key) it overrides.
ENV_OVERRIDES: dict[str, tuple[str, str]] = {
    NODE_ID_ENV: ("agent", "node_id"),
    STATE_DIR_ENV: ("agent", "state_dir"),
    GRPC_LISTEN_ENV: ("grpc", "listen"),
    SOCKET_ENV: ("grpc", "socket"),
    METRICS_LISTEN_ENV: ("metrics", "listen"),
    LOG_FORMAT_ENV: ("log", "format"),
    LOG_LEVEL_ENV: ("log", "level"),
    DETECTORS_ROOT_ENV: ("detectors", "root"),
    COORDINATOR_ENV: ("coordinator", "address"),
}

LOG_FORMATS = ("auto", "journal", "text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
# sun_path is 108 bytes on Linux, one of which is the terminating NUL.
_MAX_SOCKET_PATH_BYTES = 107




def refuse_url(text: str | None, name: str, what: str = "a local file (a path on this host)") -> None:
    """Refuses a URL given for a local path (``--config http://host/x.toml``).

    A URL taken for a path became a relative one under the current folder (``/cwd/http:/host/x.toml``) and
    was reported as a file not found, as if the URL had been tried.

    Args:
        text: the value; None or "" passes. name: the flag or variable, for the message. what: what it must be.

    Raises:
        AgentConfigError: ``text`` starts with a URL scheme (``scheme://``).
    """
    if text and URL_RE.match(text):
        raise AgentConfigError(f"{name} {text!r} is a URL; it must be {what}")


class AgentConfigError(ConfigError, AgentError):
    """The agent's configuration file, an environment override or a flag is invalid."""


@dataclass
class AgentSection:
    """``[agent]``: identity and main loop of the daemon.

    Attributes:
        node_id: stable identity of this node, reported to the coordinator; :data:`NODE_ID_RE`. Default: the host
            name.
        state_dir: directory the agent owns for state that survives restarts (created at start, mode 0750); an
            absolute path (``--state-dir`` resolves a relative one against the folder it is typed in). Default
            ``/var/lib/trainguard``.
        loop_interval_s: period of the main loop that checks subsystems and pings the systemd watchdog, in
            seconds; the watchdog is pinged at most every half ``WatchdogSec``. Default 1.0.
        stop_grace_s: on SIGTERM, seconds the workers get to exit after SIGTERM before SIGKILL. Default 20.0.
    """

    node_id: str = field(default_factory=socket.gethostname)
    state_dir: str = "/var/lib/trainguard"
    loop_interval_s: float = 1.0
    stop_grace_s: float = 20.0


@dataclass
class LogSection:
    """``[log]``: how the daemon writes its log to stderr.

    Attributes:
        format: ``journal`` (syslog ``<N>`` level prefix, no timestamp: journald adds it), ``text`` (timestamped
            lines for a terminal), ``json`` (one object per line) or ``auto`` (``journal`` when stderr is
            connected to journald, else ``text``). Default ``auto``.
        level: ``debug``, ``info``, ``warning`` or ``error``. Reloaded on SIGHUP. Default ``info``.
    """

    format: str = "auto"
    level: str = "info"


@dataclass
class GrpcSection:
    """``[grpc]``: the NodeAgent, grpc.health.v1 and reflection services.

    Attributes:
        listen: TCP ``HOST:PORT`` for remote callers (health checkers, ``trainguard status --target``); ``""``
            disables TCP. Port 0 picks a free port (logged). Default ``127.0.0.1:7350``: the TCP listener
            serves the same methods as the socket, so expose it beyond the host only with TLS (``[tls]``,
            mutual TLS with ``client_ca_file``).
        socket: unix socket path for local workers and ``trainguard status``, absolute (``--socket`` resolves a
            relative one against the folder it is typed in); ``""`` disables it. Default
            ``/run/trainguard/agent.sock``.
        socket_mode: permission bits of the unix socket; must grant nothing to "other". Default ``0o660``.
        max_request_bytes: largest request a method accepts, in bytes; larger ones get INVALID_ARGUMENT.
            ``AttachJob`` accepts at least ``rpc_limits.ATTACH_MAX_REQUEST_BYTES`` (a job's TLS files). Default 65536.
        max_message_bytes: transport cap on any message, in bytes; larger ones are dropped by gRPC itself with
            RESOURCE_EXHAUSTED before they are read. Must be >= ``max_request_bytes``, and with a socket >=
            ``rpc_limits.ATTACH_MAX_REQUEST_BYTES`` (what ``AttachJob`` accepts). Default 4194304.
        max_workers: threads serving calls (each open ``WatchEvents`` stream holds one). Default 48.
        max_watchers: concurrent ``WatchEvents`` and server reflection streams; more get RESOURCE_EXHAUSTED
            naming this option. Each job's launcher on the node holds one, each ``trainguard events --follow``
            one; peers over TCP (``listen``, no credentials) get half at most, so they cannot cut the launchers
            (unix socket) off the node's events. Default 32: a 16-device node shared by single-device jobs plus
            operators' streams, and ``max_workers - max_watchers`` = 16 threads always free for health checks and
            launchers' calls.
        reflection: serve gRPC server reflection (for grpcurl and debugging). Default true.
    """

    listen: str = "127.0.0.1:7350"
    socket: str = "/run/trainguard/agent.sock"
    socket_mode: int = 0o660
    max_request_bytes: int = 65536
    max_message_bytes: int = 4 * 1024 * 1024
    max_workers: int = 48
    max_watchers: int = 32
    reflection: bool = True


@dataclass
class TlsSection:
    """``[tls]``: TLS on the TCP listener (the unix socket is protected by file permissions instead).

    Attributes:
        enabled: serve TCP over TLS only; plaintext connections are refused. Default false.
        cert_file: PEM server certificate chain. Required when enabled. Reloaded on SIGHUP.
        key_file: PEM private key of ``cert_file``. Required when enabled. Reloaded on SIGHUP.
        client_ca_file: PEM CA bundle; when set, mutual TLS: a client must present a certificate signed by
            one of these CAs. Default ``""`` (no client certificate asked).
    """

    enabled: bool = False
    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""


@dataclass
class MetricsSection:
    """``[metrics]``: the Prometheus ``/metrics`` endpoint.

    Attributes:
        listen: ``HOST:PORT`` of the HTTP endpoint; ``""`` disables it. Default ``127.0.0.1:9477``.
    """

    listen: str = "127.0.0.1:9477"


@dataclass
class DetectorsSection:
    """``[detectors]``: which detectors run and where they read the hardware.

    Attributes:
        enabled: detector names to run; ``["all"]`` runs the default set of the detectors package. Default
            ``["all"]``.
        root: path prefix of the /sys, /proc and /dev files detectors read (tests point it at a fake tree).
            Default ``/``.
        interval_s: sampling period of every polled detector, in seconds; 0 keeps each detector's own default.
            A ``[detectors.<name>]`` table may set its own. Default 0.
        recent_events: health events kept in memory for ``GetHealth`` and ``WatchEvents`` replay. Default 256.
        settings: per-detector tables ``[detectors.<name>]`` (detector name -> its fields), checked by that
            detector's own config class.
    """

    enabled: list[str] = field(default_factory=lambda: ["all"])
    root: str = "/"
    interval_s: float = 0.0
    recent_events: int = 256
    # Filled from the [detectors.<name>] sub-tables (see AgentConfig.from_mapping), never a key of its own.
    settings: dict[str, dict[str, Any]] = config_field(default_factory=dict, internal=True)


@dataclass
class PredictorSection:
    """``[predictor]``: the failure-risk predictor fed by detector metrics.

    Attributes:
        enabled: score risk from the metric stream. Default true.
        model: absolute path of a trained model file; ``""`` scores with the rules tier only (there is no built-in
            learned model). Default ``""``.
        threshold: risk score in [0, 1] at which the predictor alarms (workers advised to checkpoint now, then
            the node drained); it drives alarms, ``GetHealth`` and ``trainguard_predictor_threshold``. Unset (or
            ``nan``): the model's own threshold, calibrated per node to its false-alarm budget. Reloaded on
            SIGHUP. Default unset.
        interval_s: seconds between two scores (and history samples), in [0.1, 3600]; set it to the interval the
            model was trained at (a model's features count rows against that interval). The daemon scores at most
            once per ``agent.loop_interval_s``. Default 5.0.
    """

    enabled: bool = True
    model: str = ""
    threshold: float = config_field(default=math.nan, nan=True)  # nan: unset, the model's own
    interval_s: float = 5.0


@dataclass
class CoordinatorSection:
    """``[coordinator]``: the job coordinator this agent registers with.

    The daemon reports this node's health verdict (its detectors and predictor) to every coordinator listed,
    continuously, between jobs too; a coordinator cordons a node whose verdict is a fatal fault
    (:mod:`trainguard.agent.coordinator_report`). Jobs that ``trainguard run`` attaches add their own coordinator.

    Attributes:
        address: ``HOST:PORT`` of a coordinator; ``""`` for none. Default ``""``.
        addresses: more coordinators' ``HOST:PORT`` (the same TLS and token options apply to all). Default ``[]``.
        job: job name sent with each report; ``""`` means whatever job each coordinator serves. Default ``""``.
        timeout_s: deadline of each call to the coordinator, in seconds. Default 5.0.
        heartbeat_interval_s: period of health reports, in seconds (a coordinator may ask for longer). Default 2.0.
        tls_ca_file: PEM CA bundle to verify the coordinator; ``""`` connects in plaintext. Default ``""``.
        tls_cert_file: PEM client certificate for mutual TLS with the coordinator. Default ``""``.
        tls_key_file: PEM private key of ``tls_cert_file``. Default ``""``.
        token_file: file holding the coordinators' job token (sent on every call); ``""`` for none. Default ``""``.
        job_tls_dirs: folders whose files an attached job (``AttachJob``) may name by path (``tls_*_file`` sent
            without its PEM contents). The daemon runs as root for any user of its socket: it opens no other
            path a launcher names, so none can have it present this node's own key, or read a root-only file, to
            a coordinator of its choosing. Absolute paths, compared after resolving symlinks. Default ``[]``
            (launchers send the contents, as ``trainguard run`` does).
    """

    address: str = ""
    addresses: list[str] = field(default_factory=list)
    job: str = ""
    timeout_s: float = 5.0
    heartbeat_interval_s: float = 2.0
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    token_file: str = ""
    job_tls_dirs: list[str] = field(default_factory=list)

    def targets(self) -> list[str]:
        """Every configured coordinator address, ``address`` first, without duplicates."""
        out: list[str] = []
        for a in [self.address, *self.addresses]:
            if a and a not in out:
                out.append(a)
        return out


@dataclass
class MemoryTierSection:
    """``[memory_tier]``: the jobs' in-memory checkpoint arenas this daemon keeps on the node.

    ``trainguard run`` registers its job's arena (``<root>/<job>``) with the daemon (``AttachJob``); the daemon
    keeps it across launcher deaths, so a SIGKILLed launcher's restart restores from memory, and removes it when
    the job ends (``DetachJob``) or ``ttl_s`` after its last launcher is gone, so nothing is left in /dev/shm.

    Attributes:
        root: tmpfs directory holding the jobs' arenas. Default ``/dev/shm/trainguard``.
        ttl_s: seconds an arena outlives its last launcher before the daemon removes it. Default 3600.0.
    """

    root: str = "/dev/shm/trainguard"
    ttl_s: float = 3600.0


@dataclass
class AgentConfig:
    """The whole agent configuration; one attribute per TOML table.

    Attributes:
        source: file the configuration was read from (``""`` for defaults only); used in error messages.
        origins: dotted option -> what set it when not the file (``"$TRAINGUARD_AGENT_GRPC_LISTEN"``,
            ``"--grpc-listen"``); used in error messages.
    """

    agent: AgentSection = field(default_factory=AgentSection)
    log: LogSection = field(default_factory=LogSection)
    grpc: GrpcSection = field(default_factory=GrpcSection)
    tls: TlsSection = field(default_factory=TlsSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    detectors: DetectorsSection = field(default_factory=DetectorsSection)
    predictor: PredictorSection = field(default_factory=PredictorSection)
    coordinator: CoordinatorSection = field(default_factory=CoordinatorSection)
    qualify: QualifySection = field(default_factory=QualifySection)  # trainguard.agent.qualify
    memory_tier: MemoryTierSection = field(default_factory=MemoryTierSection)
    source: str = config_field(default="", compare=False, internal=True)
    origins: dict[str, str] = config_field(default_factory=dict, compare=False, repr=False, internal=True)

    # -- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "<mapping>") -> "AgentConfig":
        """Builds a configuration from parsed TOML, checking every key and type (not cross-field rules).

        Args:
            data: the parsed document.
            source: file name used in error messages.

        Returns:
            The configuration.

        Raises:
            AgentConfigError: unknown table or key, or a value of the wrong type.
        """
        # [detectors.<name>] sub-tables are each detector's own fields, checked by the detectors package.
        data = dict(data)
        detectors = data.get("detectors")
        tables: dict[str, dict[str, Any]] = {}
        if isinstance(detectors, Mapping):
            tables = {k: dict(v) for k, v in detectors.items() if isinstance(v, Mapping)}
            data["detectors"] = {k: v for k, v in detectors.items() if k not in tables}
        config = build(cls, data, source=source, error=AgentConfigError, extra={"source": source})
        config.detectors.settings = tables
        return config

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> "AgentConfig":
        """Reads, overrides from the environment and validates the configuration.

        Args:
            path: TOML file; None means ``$TRAINGUARD_AGENT_CONFIG`` or :data:`DEFAULT_CONFIG_PATH`. A missing
                default file is allowed (defaults apply); a missing explicit file is an error.
            env: environment to read overrides from; None means ``os.environ``.

        Returns:
            The validated configuration.

        Raises:
            AgentConfigError: unreadable or malformed file, unknown key, bad value or bad override.
        """
        env = os.environ if env is None else env
        explicit = path is not None or bool(env.get(CONFIG_ENV))
        if path is None:
            refuse_url(env.get(CONFIG_ENV), f"${CONFIG_ENV}")
        file = Path(path if path is not None else env.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
        if not explicit and not file.exists():
            config = cls(source="<defaults>")
        else:
            data = read_toml(file, error=AgentConfigError, what="config file", flag="--config")
            config = cls.from_mapping(data, source=str(file))
        config = config.with_env(env)
        config.validate()
        return config

    def with_env(self, env: Mapping[str, str]) -> "AgentConfig":
        """Returns a copy with the :data:`ENV_OVERRIDES` variables present in ``env`` applied.

        Raises:
            AgentConfigError: a variable's value does not parse as the option's type.
        """
        updates: dict[tuple[str, str], Any] = {}
        origins: dict[str, str] = {}
        for var, (section, key) in ENV_OVERRIDES.items():
            if var in env:
                ftype = _field_type(_section_type(type(self), section), key)
                updates[(section, key)] = _parse_env(env[var], ftype, var)
                origins[f"{section}.{key}"] = f"${var}"
        return self.with_overrides(updates, origins)

    def with_overrides(
        self, updates: Mapping[tuple[str, str], Any], origins: Mapping[str, str] | None = None
    ) -> "AgentConfig":
        """Returns a copy with ``{(section, key): value}`` replaced (command-line flags use this).

        The copy is not validated; call :meth:`validate`.

        Args:
            updates: new values.
            origins: dotted option -> where the value came from (e.g. ``"--socket"``), for error messages.
        """
        config = dataclasses.replace(self, origins={**self.origins, **(origins or {})})
        for (section, key), value in updates.items():
            current = getattr(config, section)
            setattr(config, section, dataclasses.replace(current, **{key: value}))
        return config

    # -- validation ----------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Checks ranges, addresses and cross-field rules, and that every referenced file is readable.

        Raises:
            AgentConfigError: the first problem found, naming the key and the file.
        """
        src = self.source or "<config>"

        def fail(key: str, problem: str) -> typing.NoReturn:
            origin = self.origins.get(key)
            raise AgentConfigError(f"{src}: {key}{f' (set by {origin})' if origin else ''}: {problem}")

        self._refuse_tilde(fail)
        # A URL where a local path belongs was "a relative path" (its scheme read as a folder name).
        for key, value, what in (("agent.state_dir", self.agent.state_dir, "a local folder"),
                                 ("predictor.model", self.predictor.model, "a local model file"),
                                 ("grpc.socket", self.grpc.socket, "a local unix socket path"),
                                 ("memory_tier.root", self.memory_tier.root, "a local tmpfs folder")):
            if value and URL_RE.match(value):
                fail(key, f"{value!r} is a URL; it must be {what} (an absolute path on this host)")
        a = self.agent
        if not a.node_id.strip():
            fail("agent.node_id", "must not be empty")
        if not NODE_ID_RE.match(a.node_id):
            fail("agent.node_id", f"{a.node_id[:64]!r} is not a node id (1-128 of [A-Za-z0-9._:@-], starting with "
                                  "a letter or digit); coordinators refuse every report under it")
        if not a.state_dir:
            fail("agent.state_dir", "must not be empty")
        if not os.path.isabs(a.state_dir):
            # Relative to whichever folder the daemon started in (/ under systemd): not where the operator meant.
            fail("agent.state_dir", f"{a.state_dir!r} is a relative path; give an absolute one (only --state-dir "
                                    "resolves a relative path, against the folder it is typed in)")
        if not 0.05 <= a.loop_interval_s <= 60:
            fail("agent.loop_interval_s", f"{a.loop_interval_s} is outside [0.05, 60] seconds")
        if not 0 <= a.stop_grace_s <= 3600:
            fail("agent.stop_grace_s", f"{a.stop_grace_s} is outside [0, 3600] seconds")

        if self.log.format not in LOG_FORMATS:
            fail("log.format", f"{self.log.format!r} is not one of {', '.join(LOG_FORMATS)}")
        if self.log.level.lower() not in LOG_LEVELS:
            fail("log.level", f"{self.log.level!r} is not one of {', '.join(LOG_LEVELS)}")

        g = self.grpc
        if g.listen:
            _check_hostport(g.listen, "grpc.listen", fail)
        if g.socket:
            if not os.path.isabs(g.socket):
                # Launchers and `trainguard status` look for the socket by its path from their own folders.
                fail("grpc.socket", f"{g.socket!r} is a relative path; give an absolute one (only --socket "
                                    "resolves a relative path, against the folder it is typed in)")
            if len(os.fsencode(g.socket)) > _MAX_SOCKET_PATH_BYTES:
                fail("grpc.socket", f"path is {len(os.fsencode(g.socket))} bytes, over the 107-byte unix limit")
        if not g.listen and not g.socket:
            fail("grpc.listen", "both grpc.listen and grpc.socket are empty; the agent would be unreachable")
        if not 0 <= g.socket_mode <= 0o777:
            fail("grpc.socket_mode", f"{oct(g.socket_mode)} is not a permission mode (0o000-0o777)")
        if g.socket_mode & 0o007:
            fail("grpc.socket_mode", f"{oct(g.socket_mode)} grants access to every user; use e.g. 0o660")
        if not 256 <= g.max_request_bytes <= 64 * 1024 * 1024:
            fail("grpc.max_request_bytes", f"{g.max_request_bytes} is outside [256, 67108864] bytes")
        if g.max_message_bytes < g.max_request_bytes:
            fail("grpc.max_message_bytes", f"{g.max_message_bytes} is below grpc.max_request_bytes")
        from trainguard.agent.rpc_limits import ATTACH_MAX_REQUEST_BYTES

        if g.socket and g.max_message_bytes < ATTACH_MAX_REQUEST_BYTES:
            # gRPC drops a larger message before any handler sees it: a launcher sending its CA bundle got
            # RESOURCE_EXHAUSTED and ran without the daemon.
            fail("grpc.max_message_bytes", f"{g.max_message_bytes} is below the {ATTACH_MAX_REQUEST_BYTES} bytes "
                                           "AttachJob accepts on the socket (a job's TLS files); use at least that")
        if not 2 <= g.max_workers <= 1024:
            fail("grpc.max_workers", f"{g.max_workers} is outside [2, 1024]")
        if not 1 <= g.max_watchers < g.max_workers:
            fail("grpc.max_watchers", f"{g.max_watchers} must be >= 1 and below grpc.max_workers ({g.max_workers})")

        t = self.tls
        if t.enabled:
            if not g.listen:
                fail("tls.enabled", "TLS is on but grpc.listen is empty; TLS applies to the TCP listener only")
            if not t.cert_file:
                fail("tls.cert_file", "required when tls.enabled = true")
            if not t.key_file:
                fail("tls.key_file", "required when tls.enabled = true")
            _check_readable(t.cert_file, "tls.cert_file", fail)
            _check_readable(t.key_file, "tls.key_file", fail)
            if t.client_ca_file:
                _check_readable(t.client_ca_file, "tls.client_ca_file", fail)
        elif t.client_ca_file:
            fail("tls.client_ca_file", "set but tls.enabled = false; mutual TLS needs TLS")

        if self.metrics.listen:
            _check_hostport(self.metrics.listen, "metrics.listen", fail)
            if g.listen and same_port(g.listen, self.metrics.listen):
                # /metrics binds first; the gRPC listener then found the port taken and blamed "another agent".
                fail("metrics.listen", f"{self.metrics.listen} and grpc.listen ({g.listen}) are the same port; give "
                                       "/metrics a port of its own")

        d = self.detectors
        for name in d.enabled:
            if not name or not name.replace("_", "").replace("-", "").isalnum():
                fail("detectors.enabled", f"{name!r} is not a detector name")
        if not d.root:
            fail("detectors.root", "must not be empty (use \"/\" for the real system)")
        if d.interval_s != 0 and not 0.05 <= d.interval_s <= 3600:
            fail("detectors.interval_s", f"{d.interval_s} is outside [0.05, 3600] seconds (or 0)")
        if not 1 <= d.recent_events <= 100_000:
            fail("detectors.recent_events", f"{d.recent_events} is outside [1, 100000]")

        self._validate_detectors(fail)

        p = self.predictor
        if not math.isnan(p.threshold) and not 0.0 <= p.threshold <= 1.0:
            fail("predictor.threshold", f"{p.threshold} is outside [0, 1] (leave it unset for the model's own)")
        if not 0.1 <= p.interval_s <= 3600:  # NaN and inf fail it too
            fail("predictor.interval_s", f"{p.interval_s} is outside [0.1, 3600] seconds")
        if p.enabled and p.model:
            if not os.path.isabs(p.model):
                # Read against whichever folder the daemon started in (/ under systemd), as state_dir would be.
                fail("predictor.model", f"{p.model!r} is a relative path; give an absolute one")
            _check_readable(p.model, "predictor.model", fail)

        c = self.coordinator
        if c.address:
            _check_hostport(c.address, "coordinator.address", fail, dial=True)
        for i, a in enumerate(c.addresses):
            _check_hostport(a, f"coordinator.addresses[{i}]", fail, dial=True)
        if c.job:
            from trainguard.recovery.spec import JOB_NAME_RE

            if not JOB_NAME_RE.match(c.job):
                fail("coordinator.job", f"{c.job!r} is not a job name (1-128 of [A-Za-z0-9._:@-])")
        if c.token_file:
            from trainguard.recovery.rpc_security import SecurityConfigError, read_token_file

            try:
                read_token_file(c.token_file, "coordinator.token_file")
            except SecurityConfigError as exc:
                fail("coordinator.token_file", str(exc).split(": ", 1)[-1])
        if not 0.1 <= c.timeout_s <= 600:
            fail("coordinator.timeout_s", f"{c.timeout_s} is outside [0.1, 600] seconds")
        if not 0.1 <= c.heartbeat_interval_s <= 600:
            fail("coordinator.heartbeat_interval_s", f"{c.heartbeat_interval_s} is outside [0.1, 600] seconds")
        if bool(c.tls_cert_file) != bool(c.tls_key_file):
            fail("coordinator.tls_cert_file", "tls_cert_file and tls_key_file must be set together")
        if c.tls_cert_file and not c.tls_ca_file:
            fail("coordinator.tls_ca_file", "required when a client certificate is configured")
        for key in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            if getattr(c, key):
                _check_readable(getattr(c, key), f"coordinator.{key}", fail)
        for i, folder in enumerate(c.job_tls_dirs):
            if not folder or not os.path.isabs(folder):
                fail(f"coordinator.job_tls_dirs[{i}]", f"{folder!r} must be an absolute path of a folder")
        m = self.memory_tier
        if not m.root or not os.path.isabs(m.root):
            fail("memory_tier.root", f"{m.root!r} must be an absolute path (a tmpfs folder, e.g. /dev/shm/trainguard)")
        if not 0 <= m.ttl_s <= 30 * 86400:
            fail("memory_tier.ttl_s", f"{m.ttl_s} is outside [0, 2592000] seconds")
        try:
            self.qualify.validate()
        except QualifyConfigError as exc:
            raise AgentConfigError(f"{src}: {exc}") from exc

    def _refuse_tilde(self, fail: Any) -> None:
        """Refuses a path written as ``~/...`` in the file or the environment: only a shell expands ``~``, and
        the daemon under systemd has no home of the operator's; the path was a folder named ``~``."""
        for section in dataclasses.fields(self):
            value = getattr(self, section.name)
            if not dataclasses.is_dataclass(value):
                continue
            for f in dataclasses.fields(value):
                item = getattr(value, f.name)
                for i, text in enumerate(item if isinstance(item, list) else [item]):
                    if isinstance(text, str) and text.startswith("~"):
                        key = f"{section.name}.{f.name}" + (f"[{i}]" if isinstance(item, list) else "")
                        home = os.path.expanduser(text.split("/", 1)[0])
                        hint = f" (e.g. {home}/...)" if not home.startswith("~") else ""
                        fail(key, f"{text!r} starts with '~', which only a shell expands; write the absolute "
                                  f"path{hint}")

    def detector_loader(self) -> Any:
        """The ``[detectors]`` section read by the one detector-settings loader
        (:class:`~trainguard.detectors.settings.DetectorSettings`).

        Raises:
            DetectorConfigError: an unknown detector, a table for one not enabled, or a bad field or root.
        """
        from trainguard.detectors.errors import DetectorConfigError
        from trainguard.detectors.settings import DetectorSettings

        d = self.detectors
        try:
            return DetectorSettings.from_table({"enabled": d.enabled, "root": d.root, "interval_s": d.interval_s,
                                                **d.settings}, source=self.source or "agent config",
                                               prefix="detectors.")
        except DetectorConfigError as exc:
            # A value from the environment ($TRAINGUARD_AGENT_DETECTORS_ROOT) is named as such, as every other
            # key's error does: the operator looked for it in the file.
            text = str(exc)
            for key, origin in self.origins.items():
                if key.startswith("detectors.") and f": {key}: " in text:
                    raise DetectorConfigError(text.replace(f": {key}: ", f": {key} (set by {origin}): ", 1)) from exc
            raise

    def detector_names(self) -> list[str]:
        """The detectors to run: ``detectors.enabled`` with ``"all"`` expanded to the default set."""
        return list(self.detector_loader().enabled)

    def detector_settings(self) -> dict[str, dict[str, Any]]:
        """Per-detector fields for ``create_detectors`` (see :meth:`detector_loader`)."""
        return self.detector_loader().settings()

    def _validate_detectors(self, fail: Any) -> None:
        # Detector names and their fields are checked by the detectors package when the daemon builds them
        # (see trainguard.agent.daemon); here only what needs no import.
        enabled = set(self.detectors.enabled)
        for name in self.detectors.settings:
            if "all" not in enabled and name not in enabled:
                fail(f"detectors.{name}", f"settings for a detector that is not in detectors.enabled {sorted(enabled)}")

    def restart_required(self, new: "AgentConfig") -> list[str]:
        """Names the options whose change a SIGHUP reload cannot apply (a restart is needed).

        Args:
            new: the freshly loaded configuration.

        Returns:
            Dotted option names that differ and are not reloadable, sorted.
        """
        changed = []
        for section in dataclasses.fields(self):
            if section.name in ("source", "origins"):
                continue
            old_s, new_s = getattr(self, section.name), getattr(new, section.name)
            for f in dataclasses.fields(old_s):
                key = f"{section.name}.{f.name}"
                if key not in RELOADABLE and getattr(old_s, f.name) != getattr(new_s, f.name):
                    changed.append(key)
        return sorted(changed)


#: Options a SIGHUP applies without a restart.
RELOADABLE = frozenset(
    {
        "log.level",
        "log.format",
        "tls.cert_file",
        "tls.key_file",
        "tls.client_ca_file",
        "predictor.threshold",
        "coordinator.timeout_s",
        "coordinator.heartbeat_interval_s",
        "memory_tier.ttl_s",
        "agent.loop_interval_s",
        "agent.stop_grace_s",
    }
)


def parse_hostport(text: str) -> tuple[str, int]:
    """Splits ``HOST:PORT`` (``[v6]:PORT`` for IPv6) into host and port.

    Raises:
        ValueError: no port, a port outside 0-65535, or an empty host.
    """
    if "://" in text:  # else "http://h:80" was answered with advice about IPv6 brackets
        raise ValueError(f"{text!r} is a URL; give HOST:PORT (e.g. 127.0.0.1:7350)")
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text!r} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        ipaddress.IPv6Address(host)
    elif ":" in host:
        raise ValueError(f"{text!r}: write an IPv6 host in brackets, e.g. [::1]:7350")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{text!r}: port must be a number in 0-65535")
    return host, int(port_text)


def hostport_arg(text: str) -> str:
    """argparse type of the ``--*-listen HOST:PORT`` flags: checked as :func:`parse_hostport` does, kept as written.

    Without it a port that is not a number reached the server's start: a ValueError traceback from
    ``trainguard run --metrics-listen 127.0.0.1:abc``, "address in use or not local" from the coordinator's
    ``--listen 127.0.0.1:99999``.

    Raises:
        argparse.ArgumentTypeError: not ``HOST:PORT`` (argparse names the flag).
    """
    import argparse

    try:
        parse_hostport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _check_hostport(value: str, key: str, fail: Any, dial: bool = False) -> None:
    """Checks ``HOST:PORT``; ``dial``: an address to connect to, where port 0 (a listener's "any free port")
    reaches nothing (every report to such a coordinator failed, as "unreachable")."""
    try:
        _, port = parse_hostport(value)
    except ValueError as exc:
        fail(key, str(exc))
        return
    if dial and port == 0:
        fail(key, f"{value!r} has port 0; give the port the coordinator listens on")


def same_port(a: str, b: str) -> bool:
    """Whether two valid ``HOST:PORT`` listeners would bind the same port (a fixed one, hosts equal or either a
    wildcard)."""
    (ha, pa), (hb, pb) = parse_hostport(a), parse_hostport(b)
    wild = ("0.0.0.0", "::", "*")
    return pa == pb != 0 and (ha == hb or ha in wild or hb in wild)


def _check_readable(path: str, key: str, fail: Any) -> None:
    try:
        with open(path, "rb") as fh:
            fh.read(1)
    except OSError as exc:
        fail(key, f"cannot read {path} ({exc.strerror}); check the path and its permissions")


def _section_type(cls: type, name: str) -> type:
    return typing.get_type_hints(cls)[name]


def _field_type(section_cls: type, key: str) -> Any:
    return typing.get_type_hints(section_cls)[key]


def _parse_env(text: str, ftype: Any, var: str) -> Any:
    try:
        if ftype is bool:
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true/false")
        if ftype is int:
            return int(text, 0)
        if ftype is float:
            return float(text)
        if ftype is str:
            return text
        if typing.get_origin(ftype) is list:
            return [item.strip() for item in text.split(",") if item.strip()]
    except ValueError as exc:
        raise AgentConfigError(f"environment variable {var}={text!r}: {exc}") from exc
    raise AssertionError(f"unsupported config field type {ftype!r} for {var}")

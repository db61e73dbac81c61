"""The coordinator link: one node's membership in one job's coordinator (register, heartbeat, report).

It registers the node (retrying while the coordinator is unreachable, up to a patience), renews the lease with
heartbeats whose worker part comes from a :class:`~trainguard.agent.parts.HeartbeatContent` (the supervisor, or
:class:`~trainguard.agent.parts.NoWorkers` for a member that only reports health), registers again when the
coordinator forgot the node, and reports events, each node-level fault once per generation
(:class:`~trainguard.agent.node_faults.NodeReportLedger`). It runs no workers and interprets no command beyond
its own state; the composition acts on the commands. States: :data:`~trainguard.agent.parts.LINK_TRANSITIONS`
(diagram in :mod:`trainguard.agent.parts`).
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from trainguard.agent.errors import (AgentError, CoordinatorUnavailableError, JoinTimeoutError,
                                     RegistrationCancelledError)
from trainguard.agent.lifecycle import Lifecycle
from trainguard.agent.node_faults import NodeReportLedger
from trainguard.agent.parts import LINK_TRANSITIONS, HeartbeatContent, LinkState, LinkTrigger
from trainguard.agent.port_offer import MasterPortOffer, hold_port
from trainguard.detectors.events import HealthEvent
from trainguard.proto import common_pb2, coordinator_pb2, coordinator_pb2_grpc

if TYPE_CHECKING:
    from trainguard.agent.qualify.agent_side import NodeQualifier

log = logging.getLogger(__name__)
#: Seconds between the WARNING lines of one coordinator outage (see CoordinatorLink._say_outage).
_OUTAGE_LOG_EVERY_S = 30.0

#: Deadline of every call to the coordinator, seconds.
RPC_TIMEOUT_S = 5.0
#: Deadline of the call that tells the coordinator this node leaves (at close, so short), seconds.
LEAVE_TIMEOUT_S = 2.0
#: Failure reports kept for sending again while the coordinator is unreachable (the newest; older ones are about
#: generations a later report supersedes).
MAX_UNSENT_REPORTS = 8

_T = LinkTrigger
#: Codes after which a failure report may not have arrived and is sent again. CANCELLED: another thread (the lease
#: keeper) dialled the coordinator again and closed the channel this call was on.
_UNREACHED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def coordinator_targets(coordinator: str) -> list[str]:
    """The coordinator addresses of a ``host:port[,host:port...]`` list, in the order they are tried.

    Raises:
        AgentError: the list names no address.
    """
    targets = [t.strip() for t in coordinator.split(",") if t.strip()]
    if not targets:
        raise AgentError(f"coordinator address {coordinator!r} names no host:port")
    return targets


#: What gRPC's connection error says when the peer answered with something other than HTTP/2 (an HTTP/1.x server, an
#: SSH banner, any other protocol): something listens there, and it is no gRPC server.
_NOT_HTTP2_MARKERS = ("Failed parsing HTTP/2", "http1.x server")


def foreign_listener(code: grpc.StatusCode, details: str, service: str = "coordinator") -> str | None:
    """What answered a call instead of a trainguard ``service`` ("coordinator", "node agent"), from the call's
    error; None when the error does not tell (nobody listens yet, a timeout, a reset: those may be a server
    starting or restarting).

    Args:
        code, details: the failed call's status code and details.
        service: what the caller dialled, as the message names it.
    """
    if code == grpc.StatusCode.UNIMPLEMENTED:
        name = "".join(w.capitalize() for w in service.split())
        return f"a gRPC server answers there without trainguard's {name} service"
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL) and any(
            m in (details or "") for m in _NOT_HTTP2_MARKERS):
        return ("something listens there that does not speak gRPC (HTTP/2): another program holds that port, or a "
                f"{service} serving TLS is dialled without it")
    return None


def foreign_said(details: str) -> str:
    """The short form of what a foreign listener's error said, for the one-line messages."""
    details = details or ""
    if "http1.x server" in details:
        return "it answered in HTTP/1.x"
    if "Failed parsing HTTP/2" in details:
        return "its first bytes are no HTTP/2 frame"
    return " ".join(details.split())[:200] or "no details"


#: What gRPC's TLS handshake error says when the peer answered the ClientHello with something that is no TLS
#: record: a server that does not speak TLS (a plaintext gRPC server, any other protocol). Checked against real
#: servers: a coordinator serving TLS dialled in plaintext gives only "Socket closed", as a coordinator that is
#: killed mid-connection does, so that direction cannot be told apart and keeps retrying.
_NO_TLS_MARKER = "WRONG_VERSION_NUMBER"


def plaintext_peer(code: grpc.StatusCode, details: str) -> bool:
    """Whether a call dialled with TLS failed because the peer does not speak TLS (from the call's error)."""
    d = details or ""
    return code == grpc.StatusCode.UNAVAILABLE and "handshake failed" in d.lower() and _NO_TLS_MARKER in d


def plaintext_peer_message(target: str) -> str:
    """The one line for a coordinator address that does not speak TLS while this node dials it with TLS."""
    return (f"{target} does not speak TLS: this node dials the coordinator with TLS (trainguard run "
            f"--coordinator-ca/--coordinator-cert/--coordinator-key, the daemon's coordinator.tls_ca_file), but "
            f"what answers there serves plaintext; start the coordinator with --tls-cert/--tls-key, or dial it "
            f"without those flags")


#: What gRPC's TLS error says when this node does not trust the coordinator's certificate: signed by a CA other
#: than the node's (BoringSSL's CERTIFICATE_VERIFY_FAILED), or naming another host (gRPC's hostname check). Checked
#: against real servers (tests/agent/test_foreign_listener.py). Neither changes while the node waits.
_UNTRUSTED_MARKERS = ("CERTIFICATE_VERIFY_FAILED", "Hostname Verification Check failed")


def untrusted_peer(code: grpc.StatusCode, details: str) -> str | None:
    """Why this node does not trust the certificate the coordinator presented, from a call's error; None when
    the error is not about that."""
    d = details or ""
    if code != grpc.StatusCode.UNAVAILABLE:
        return None
    if "Hostname Verification Check failed" in d:
        return "its certificate names another host"
    if "CERTIFICATE_VERIFY_FAILED" in d:
        # "...CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK": the reason is the next part.
        why = d.split("CERTIFICATE_VERIFY_FAILED", 1)[1].strip(": ").split(":", 1)[0].strip()
        return f"certificate verify failed: {why or 'no reason given'}"
    return None


def untrusted_peer_message(target: str, why: str) -> str:
    """The one line for a coordinator whose TLS certificate this node does not trust: what, and what to do."""
    return (f"TLS with the coordinator {target} failed ({why}): this node does not trust its certificate; give "
            f"--coordinator-ca (the daemon's coordinator.tls_ca_file) the CA that signed the coordinator's "
            f"--tls-cert, and (trainguard run) --coordinator-server-name when that certificate names "
            f"another host")


def _tls_probe(target: str) -> tuple[str, int, ssl.SSLContext] | None:
    """Host, port and an unverifying client context for probing ``target`` (``host:port``); None when it is not
    one. The certificate is not checked: the probes ask only how the peer answers a handshake."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])  # as gRPC offers: a gRPC server may refuse a handshake without it
    return host.strip("[]"), int(port), ctx


def speaks_tls(target: str, timeout_s: float = 2.0) -> bool:
    """Whether what listens at ``target`` (``host:port``) answers a TLS handshake (the certificate is not checked:
    only whether the peer speaks TLS at all).

    Why: a plaintext gRPC call to a server that serves TLS fails with gRPC's bare "Socket closed", which a
    coordinator killed mid-connection gives as well; a coordinator that is down or restarting does not complete
    a TLS handshake, so one that does is a TLS server, and this node dials it in plaintext in vain.
    """
    probe = _tls_probe(target)
    if probe is None:
        return False
    host, port, ctx = probe
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with ctx.wrap_socket(raw):
                return True
    except ssl.SSLError as exc:
        # The peer answered in TLS, with an alert (one that demands a client certificate, say): a TLS server.
        return "ALERT" in str(exc.reason or "").upper()
    except (OSError, ValueError):
        return False


def client_cert_refused(target: str, cert_file: str = "", key_file: str = "", timeout_s: float = 2.0) -> bool:
    """Whether the TLS server at ``target`` refuses this client's certificate (``cert_file``/``key_file``; none
    when empty): the handshake completes on this side, and the server closes the connection before its HTTP/2
    preface (it checks the certificate after the TLS 1.3 handshake). Tried twice: both must close.

    Why: gRPC reports such a refusal as a bare "Socket closed", as for a coordinator killed mid-connection; a
    server that is down or restarting completes no handshake, and one that accepts the certificate sends its
    preface at once.
    """
    probe = _tls_probe(target)
    if probe is None:
        return False
    host, port, ctx = probe
    try:
        if cert_file:
            ctx.load_cert_chain(cert_file, key_file or None)
    except (OSError, ssl.SSLError):
        return False  # the channel's own loading says what is wrong with the files
    for _ in range(2):
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as raw:
                with ctx.wrap_socket(raw) as tls:
                    tls.settimeout(timeout_s)
                    if tls.recv(1):
                        return False  # its preface: the certificate is accepted
        except ssl.SSLError as exc:
            if "ALERT" not in str(exc.reason or "").upper() and "EOF" not in str(exc).upper():
                return False
        except (OSError, ValueError):
            return False  # no handshake (nobody there), or a timeout: not a refusal
    return True


def client_cert_refused_message(target: str, has_cert: bool) -> str:
    """The one line for a coordinator that demands a client certificate it does not get from this node."""
    what = ("refuses this node's client certificate (--coordinator-cert): it demands one signed by its "
            "--tls-client-ca" if has_cert else "demands a client certificate (mutual TLS, its --tls-client-ca) "
            "and this node sends none")
    return (f"TLS with the coordinator {target} failed: it {what}; give this node --coordinator-cert/"
            f"--coordinator-key signed by that CA (the daemon's coordinator.tls_cert_file/tls_key_file)")


def tls_peer_message(target: str) -> str:
    """The one line for a coordinator address that serves TLS while this node dials it in plaintext."""
    return (f"{target} serves TLS but this node dials it in plaintext: give it the CA that signed the coordinator's "
            f"certificate (trainguard run --coordinator-ca, and --coordinator-cert/--coordinator-key if the "
            f"coordinator demands client certificates; the daemon's coordinator.tls_ca_file)")


#: What gRPC's error says when the coordinator's host name does not resolve (grpc 1.6x: "errors resolving H:P:
#: ... Domain name not found"; older c-ares builds: "DNS resolution failed for H:P").
_UNRESOLVED_MARKERS = ("errors resolving", "DNS resolution failed")


def unresolved_host(code: grpc.StatusCode, details: str) -> bool:
    """Whether a call failed because the coordinator's host name does not resolve (yet)."""
    return code == grpc.StatusCode.UNAVAILABLE and any(m in (details or "") for m in _UNRESOLVED_MARKERS)


def foreign_listener_message(target: str, what: str, details: str,
                             flags: str = "--rdzv-endpoint (or --coordinator, --master-addr/--master-port)") -> str:
    """The one line for a coordinator address where something else answers: what, and what to do (``flags``:
    the caller's flags that name the address)."""
    return (f"{target} is not a trainguard coordinator: {what} ({foreign_said(details)}); point {flags} at the "
            "node running the job's coordinator, or stop what holds that port")


def find_free_port(address: str) -> int:
    """A TCP port free on ``address`` right now (bind to port 0, read it, close): free only then (a node's
    ``MASTER_PORT`` offer holds its port instead, see :mod:`trainguard.agent.port_offer`).

    Raises:
        AgentError: ``address`` is not an address of this host (or a name that does not resolve).
    """
    with hold_port(address) as s:
        return s.getsockname()[1]


@dataclass
class LinkConfig:
    """Who this node is to the coordinator, and how to reach it.

    Attributes:
        job: job name, as known to the coordinator.
        coordinator: ``host:port`` of the coordinator, or several separated by commas (a standby coordinator on
            the same store, or where it is restarted): each call that finds one unreachable moves to the next, on a
            new channel, which also resolves a name again; "" for a standalone node (nothing is dialled,
            reports go nowhere).
        node_id: stable identity of the node.
        pod_id: pod / supernode label.
        node_index: index of the node in its pod.
        host: host name used for ordering.
        address: address other nodes reach this node at (also where free ports are looked for).
        device_count: local worker slots (0 for a health-only member).
        spare: join as a spare (no ranks until needed).
        patience_s: how long the coordinator may be unreachable at registration, seconds; also how long it
            may stay unreachable while this node runs no workers.
        form_timeout_s: how long after joining the node waits for the job's first generation to form while
            fewer than ``--nnodes`` nodes registered (torchrun's ``join_timeout``); None: ``patience_s``.
        channel: opens a channel to one coordinator address (TLS and token); None dials plaintext.
    """

    job: str
    coordinator: str
    node_id: str
    pod_id: str = ""
    node_index: int = 0
    host: str = field(default_factory=socket.gethostname)
    address: str = "127.0.0.1"
    device_count: int = 0
    spare: bool = False
    patience_s: float = 60.0
    form_timeout_s: float | None = None
    channel: Callable[[str], grpc.Channel] | None = None


class GrpcCoordinatorLink:
    """The coordinator link over gRPC (implements :class:`~trainguard.agent.parts.CoordinatorLink`).

    Args:
        config: identity and address.
        on_generation_lost: called when the coordinator does not know the node's generation any more (its
            workers must stop before the node registers again); None for a member without workers.
        qualifier: the node's pre-flight qualification (:class:`~trainguard.agent.qualify.agent_side.NodeQualifier`):
            its verdict goes with the registration, and a node without workers sends each re-check's verdict with
            a heartbeat; None: the node does not qualify.
    """

    def __init__(self, config: LinkConfig, on_generation_lost: Callable[[], None] | None = None,
                 qualifier: "NodeQualifier | None" = None) -> None:
        self.config = config
        self.qualifier = qualifier
        self.reports = NodeReportLedger()
        #: Default seconds between heartbeats until the coordinator says otherwise.
        self.interval_s = 0.5
        self._on_generation_lost = on_generation_lost
        self._master_port = MasterPortOffer(config.address)
        self._life: Lifecycle[LinkState, LinkTrigger] = Lifecycle("coordinator link", LINK_TRANSITIONS,
                                                                  LinkState.UNREGISTERED)
        self._channel: grpc.Channel | None = None
        self._target = ""  # the coordinator address dialled now (one of config.coordinator's)
        self._target_index = 0
        self._stub: coordinator_pb2_grpc.CoordinatorStub | None = None
        self._lease = ""
        self._generation = -1
        self._unreachable_since: float | None = None  # first failed heartbeat of the current outage
        self._outage_said_at: float | None = None  # when the outage was last logged at WARNING (see _say_outage)
        self._outage_what: set[str] = set()  # the kinds of failure said since then
        # Reports the coordinator never got (it was down or did not answer in time): sent again before the next
        # heartbeat. The heartbeat of a node whose workers were stopped says "no generation", which a
        # coordinator that never heard of the failure answers with START of the same generation: without the
        # report it would rerun that generation with its old port and restart count, uncounted.
        self._unsent: list[coordinator_pb2.ReportEventRequest] = []
        self._last_heartbeat = 0.0
        self._in_keepalive = False
        self._told = ""  # the last STOP/WAIT message logged: a standing one is logged once, not every heartbeat
        self._cancelled = threading.Event()  # a stop was asked for: a registration still waiting gives up
        # When this node began to join (open()): the first generation must form within patience_s of it, the
        # bound torchrun's join_timeout puts on its rendezvous. A node that once ran a generation never times out.
        self._joining_since: float | None = None
        self._leave_why = "its node agent stopped"  # what close() tells the coordinator of a node that never ran
        self._told_outcome = False  # a STOP carried the job's outcome: close() says this node leaves the ended job
        self._forming: coordinator_pb2.NodeHeartbeatResponse | None = None  # the last reply while forming
        # Tells a restarted agent of this node apart from a second agent claiming the same node id.
        self._instance = uuid.uuid4().hex

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def state(self) -> LinkState:
        """The current lifecycle state."""
        return self._life.state

    @property
    def generation(self) -> int:
        """The generation this node runs for the coordinator (RUNNING), or the last one; -1 before."""
        return self._generation

    @property
    def connected(self) -> bool:
        """Whether a coordinator is dialled."""
        return self._stub is not None

    @property
    def lease(self) -> str:
        """The lease of the current registration ("" before)."""
        return self._lease

    # -- membership ----------------------------------------------------------------------------------------
    def open(self) -> None:
        """Dials the coordinator and registers (UNREGISTERED -> WAITING).

        Raises:
            CoordinatorUnavailableError: it refused, or stayed unreachable for ``patience_s``.
        """
        self._joining_since = time.monotonic()
        self._dial()
        self._register()

    def _dial(self) -> None:
        """Opens a channel to the current coordinator address (a fresh one: its name is resolved again, and it
        carries no reconnect backoff)."""
        targets = coordinator_targets(self.config.coordinator)
        target = targets[self._target_index % len(targets)]
        dial = self.config.channel or grpc.insecure_channel
        self._channel = dial(target)
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)
        self._target = target

    def _redial(self) -> None:
        """After a call found the coordinator unreachable: dials the next address of the list (the same one when
        there is one), on a new channel.

        Why a new channel: gRPC's own channel re-resolves a DNS name after a failed connection at most every 30 s
        (``grpc.dns_min_time_between_resolutions_ms``) and backs its reconnects off up to 120 s
        (``grpc.max_reconnect_backoff_ms``), so a coordinator restarted on another host under the same name, or
        at its old address after a long outage, was reached tens of seconds to minutes late: longer than a
        lease, so its nodes were lost. A new channel resolves the name now (the system resolver, its cache
        included) and connects at once.
        """
        old, before = self._channel, self._target
        self._target_index += 1
        self._dial()
        if old is not None:
            old.close()
        if self._target != before:
            log.info("coordinator %s unreachable; trying %s", before, self._target)

    def _node_info(self) -> common_pb2.NodeInfo:
        c = self.config
        return common_pb2.NodeInfo(
            node_id=c.node_id,
            topology=common_pb2.Topology(pod_id=c.pod_id, node_index=c.node_index, host=c.host,
                                         device_count=c.device_count),
            address=c.address,
            spare=c.spare,
        )

    def _register(self) -> None:
        assert self._stub is not None, "open() first"
        patience_s = self.config.patience_s
        deadline = time.monotonic() + patience_s
        delay = 0.1
        while True:
            try:
                resp = self._stub.RegisterNode(
                    coordinator_pb2.RegisterNodeRequest(
                        job=self.config.job, node=self._node_info(), free_port=self._master_port.port(),
                        agent_instance=self._instance,
                        qualification=self.qualifier.registration(self._stub) if self.qualifier else None),
                    timeout=RPC_TIMEOUT_S,
                )
                self._lease = resp.lease_id
                self._life.fire(_T.REGISTERED)
                log.info("registered node %s with coordinator %s", self.config.node_id, self._target)
                return
            except grpc.RpcError as exc:
                code = exc.code()
                foreign = foreign_listener(code, exc.details() or "")
                if foreign is not None and (code == grpc.StatusCode.UNIMPLEMENTED
                                            or len(coordinator_targets(self.config.coordinator)) == 1):
                    # At once, not after the whole patience: a program that is no coordinator will not become one
                    # (it said "not reachable yet" for up to join_timeout, then "unreachable"). Of a list, another
                    # address may hold the coordinator: tried in turn, as for one that is down.
                    raise CoordinatorUnavailableError(
                        foreign_listener_message(self._target, foreign, exc.details() or "")) from exc
                if plaintext_peer(code, exc.details() or "") \
                        and len(coordinator_targets(self.config.coordinator)) == 1:
                    # At once, as for a foreign listener: a plaintext coordinator will not start speaking TLS (it
                    # said "not reachable yet" until join_timeout, like a coordinator restarting).
                    raise CoordinatorUnavailableError(plaintext_peer_message(self._target)) from exc
                untrusted = untrusted_peer(code, exc.details() or "")
                if untrusted is not None and len(coordinator_targets(self.config.coordinator)) == 1:
                    # At once: the coordinator will not present another certificate, nor this node trust another
                    # CA, while it waits (it said "not reachable yet" until join_timeout).
                    raise CoordinatorUnavailableError(untrusted_peer_message(self._target, untrusted)) from exc
                if "Socket closed" in (exc.details() or "") and len(coordinator_targets(self.config.coordinator)) == 1:
                    # gRPC's "Socket closed" alone is also a coordinator killed mid-connection (waited for): a TLS
                    # handshake of our own tells a TLS server (dialled in plaintext), or one that refuses this
                    # node's client certificate, from it.
                    tls = self._client_tls()
                    if tls is None and speaks_tls(self._target):
                        raise CoordinatorUnavailableError(tls_peer_message(self._target)) from exc
                    if tls is not None and client_cert_refused(self._target, tls.cert_file, tls.key_file):
                        raise CoordinatorUnavailableError(
                            client_cert_refused_message(self._target, bool(tls.cert_file))) from exc
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise CoordinatorUnavailableError(
                        f"coordinator {self.config.coordinator} refused registration: {code.name}: {exc.details()}"
                    ) from exc
                unresolved = unresolved_host(code, exc.details() or "")
                if time.monotonic() > deadline:
                    if unresolved:
                        raise CoordinatorUnavailableError(
                            f"coordinator {self.config.coordinator} unreachable for {patience_s:.0f}s: its host "
                            f"{self._target.rpartition(':')[0]!r} does not resolve; check the name (--rdzv-endpoint, "
                            "--coordinator or --master-addr), or raise --rdzv-conf join_timeout if it appears later"
                        ) from exc
                    raise CoordinatorUnavailableError(
                        f"coordinator {self.config.coordinator} unreachable for {patience_s:.0f}s; "
                        "check the address and that it runs"
                    ) from exc
                failed = self._target
                self._redial()
                if delay == 0.1 and unresolved:
                    # Waited for, not an error at once: a Kubernetes headless service's name (the coordinator's
                    # pod) resolves only once that pod is ready, as torchrun's c10d store waits for it too.
                    log.warning("coordinator host %r (%s) does not resolve yet; waiting up to %.0f s for the name "
                                "to appear (a Kubernetes service's name appears once its pod is ready; the bound "
                                "is --rdzv-conf join_timeout)", failed.rpartition(":")[0], failed, patience_s)
                elif delay == 0.1:
                    # Once: the wait for a coordinator that is down (or not up yet, or at a wrong address) was
                    # silent for the whole patience, a minute by default, before its error.
                    log.warning("coordinator %s not reachable yet (%s: %s); retrying for up to %.0f s (the bound "
                                "is --rdzv-conf join_timeout)", self.config.coordinator, code.name,
                                (exc.details() or "").split("\n", 1)[0][:300], patience_s)
                if self._cancelled.wait(delay):
                    raise RegistrationCancelledError(
                        f"registration with coordinator {self.config.coordinator} cancelled: a stop was asked for"
                    ) from exc
                delay = min(2.0, delay * 2)

    def _client_tls(self):
        """The TLS files this link's channels dial with (the channel factory of an
        :class:`~trainguard.recovery.rpc_security.RpcSecurity` with client TLS); None when it dials plaintext."""
        owner = getattr(self.config.channel, "__self__", None)
        return owner.tls if getattr(owner, "client_tls", False) else None

    def cancel(self) -> None:
        """Ends a registration still waiting for an unreachable coordinator (a signal asked the node to stop):
        :meth:`open` then raises :class:`RegistrationCancelledError` within one retry delay (2 s at most)
        instead of retrying until ``patience_s`` (SIGTERM used to be obeyed only after the whole patience)."""
        self._cancelled.set()

    def heartbeat(self, content: HeartbeatContent) -> coordinator_pb2.NodeHeartbeatResponse | None:
        """Sends one heartbeat.

        Returns:
            The reply, or None when the coordinator was unreachable (the outage is timed, see
            :meth:`check_patience`) or forgot this node (the node registered again, in WAITING).

        Raises:
            CoordinatorUnavailableError: registering again failed.
        """
        assert self._stub is not None, "open() first"
        self._last_heartbeat = time.monotonic()
        if self._unsent and self._send_unsent() is grpc.StatusCode.UNAVAILABLE:
            self._unreachable_since = self._unreachable_since or time.monotonic()
            self._say_outage(f"coordinator still unreachable: {len(self._unsent)} failure report(s) wait",
                             f"unsent {len(self._unsent)}")
            self._redial()
            return None  # down: the heartbeat would fail as well
        fields = dict(content.heartbeat_fields())
        if self.qualifier is not None:  # a re-check's verdict, while the node runs no generation (spare, standby)
            fields["qualification"] = self.qualifier.for_heartbeat(idle=fields.get("generation", -1) < 0)
        req = coordinator_pb2.NodeHeartbeatRequest(
            job=self.config.job, node_id=self.config.node_id, lease_id=self._lease,
            free_port=self._master_port.port(), **fields)
        try:
            resp = self._stub.Heartbeat(req, timeout=RPC_TIMEOUT_S)
            if resp.HasField("rank_table"):
                self._master_port.seen(resp.rank_table.generation, resp.rank_table.master_port)
            if self._outage_said_at is not None and self._unreachable_since is not None:
                log.warning("coordinator %s answers again after %.0f s", self._target,
                            time.monotonic() - self._unreachable_since)
            self._unreachable_since = self._outage_said_at = None
            failed = max((r.generation for r in self._unsent), default=-1)
            if resp.command in (coordinator_pb2.NODE_COMMAND_START, coordinator_pb2.NODE_COMMAND_RESTART) \
                    and 0 <= resp.rank_table.generation <= failed:
                # The coordinator has not heard of this node's failure in that generation yet (the report
                # timed out): starting it again would rerun a failed generation, uncounted. Wait for the report.
                log.warning("not starting generation %d again: this node's failure report about it has not "
                            "reached the coordinator yet", resp.rank_table.generation)
                return None
            return resp
        except grpc.RpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                if self._unreachable_since is None:
                    self._unreachable_since = time.monotonic()
                self._redial()
            else:
                self._unreachable_since = None
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                log.warning("coordinator forgot this node (%s); registering again", exc.details())
                self._life.fire_if(_T.FORGOTTEN)
                self._register()
            elif code == grpc.StatusCode.OUT_OF_RANGE:
                log.warning("coordinator does not know our generation (%s); stopping workers and registering "
                            "again", exc.details())
                if self._on_generation_lost is not None:
                    self._on_generation_lost()
                self._life.fire_if(_T.FORGOTTEN)
                self._register()
            else:
                running = fields.get("workers_running", 0)
                # The coordinator's reason ("... could not be made durable (the store's filesystem is full)")
                # was left out: the node's log said only UNAVAILABLE.
                details = " ".join((exc.details() or "").split())[:300]
                self._say_outage(f"coordinator heartbeat failed: {code.name}" + (f" ({details})" if details else "")
                                 + ("; workers keep running" if running else ""), code.name)
            return None

    def _say_outage(self, text: str, what: str) -> None:
        """Logs a heartbeat failure at WARNING when ``what`` (its kind: a status code, the count of failure
        reports waiting) is new in the outage, and every 30 s of it; each repeat in between at DEBUG. Every
        failure at WARNING, twice a heartbeat interval, was ~7,000 lines per node per hour of an outage."""
        now = time.monotonic()
        if self._outage_said_at is None or now - self._outage_said_at >= _OUTAGE_LOG_EVERY_S:
            self._outage_what = set()
        if what not in self._outage_what:
            since = self._unreachable_since
            log.warning("%s%s", text, f" (unreachable for {now - since:.0f} s; said every "
                                      f"{_OUTAGE_LOG_EVERY_S:.0f} s)" if since is not None and now - since >= 1
                        else "")
            self._outage_said_at = now
            self._outage_what.add(what)
        else:
            log.debug("%s", text)

    def keepalive(self, content: HeartbeatContent) -> None:
        """Renews the lease while the owner's loop is busy (stopping hung workers); commands in the reply are
        left to the loop's next heartbeat, which gets them again."""
        if self._stub is not None and not self._in_keepalive \
                and time.monotonic() - self._last_heartbeat >= self.interval_s:
            self._in_keepalive = True
            try:
                self.heartbeat(content)
            finally:
                self._in_keepalive = False

    def follow(self, resp: coordinator_pb2.NodeHeartbeatResponse, node_id: str | None = None,
               now: float | None = None) -> None:
        """Moves the link after the command in a heartbeat reply.

        START/RESTART of a table that gives ``node_id`` ranks: RUNNING(generation); STOP: STOPPING, then DONE
        when the job is over, else back to WAITING (the job goes on without this node's workers).

        Raises:
            JoinTimeoutError: the job's first generation still misses nodes ``form_timeout_s`` after this node began
                to join (``now``: monotonic time, default now).
        """
        node_id = node_id or self.config.node_id
        cmd = resp.command
        if cmd in (coordinator_pb2.NODE_COMMAND_START, coordinator_pb2.NODE_COMMAND_RESTART):
            if any(n.node_id == node_id for n in resp.rank_table.nodes):
                self._life.fire_if(_T.GENERATION)
                self._generation = resp.rank_table.generation
                self._joining_since = None
        elif cmd == coordinator_pb2.NODE_COMMAND_STOP:
            self._life.fire_if(_T.STOP)
            if resp.job_state in (coordinator_pb2.JOB_STATE_SUCCEEDED, coordinator_pb2.JOB_STATE_FAILED):
                self._life.fire_if(_T.JOB_ENDED)
                self._told_outcome = True
                self._leave_why = ("the job " + ("succeeded" if resp.job_state == coordinator_pb2.JOB_STATE_SUCCEEDED
                                                 else "failed") + "; its agent is done")
            else:
                self._life.fire_if(_T.IDLE)  # the job goes on without this node's workers for now
        self._log_standing(resp)
        if resp.job_state == coordinator_pb2.JOB_STATE_FORMING:
            self._check_join(resp, time.monotonic() if now is None else now)

    def _check_join(self, resp: coordinator_pb2.NodeHeartbeatResponse, now: float) -> None:
        """Gives up when the first generation has not formed ``form_timeout_s`` after this node began to join."""
        self._forming = resp  # the last word on the formation: the bound holds while the coordinator is away too
        since = self._joining_since
        # Only while too few nodes registered: a job past --nnodes MIN waits out its last call (bounded by the
        # coordinator), and a coordinator that does not count (0) is never given up on for it.
        if since is None or self._generation >= 0 or resp.forming_missing <= 0 \
                or now - since < self.form_timeout_s:
            return
        why = resp.message or "the coordinator did not say why"
        self._leave_why = f"its agent gave up after join_timeout {self.form_timeout_s:.0f} s"
        raise JoinTimeoutError(
            f"job {self.config.job}: the first generation did not form within {self.form_timeout_s:.0f} s of "
            f"node {self.config.node_id} joining (coordinator {self.config.coordinator}: {why}); start the missing "
            "nodes, lower --nnodes MIN[:MAX] to the nodes you have, or wait longer with --rdzv-conf "
            "join_timeout=SECONDS")

    @property
    def form_timeout_s(self) -> float:
        """How long after joining this node waits for the first generation to form, seconds."""
        f = self.config.form_timeout_s
        return self.config.patience_s if f is None else f

    def _log_standing(self, resp: coordinator_pb2.NodeHeartbeatResponse) -> None:
        """Logs why the coordinator keeps this node idle (cordoned, or a recovery waiting for capacity), once per
        message: without it a cordoned node that registered again, or every node of a job waiting for a spare,
        sat silent for up to ``--membership-timeout`` while only the coordinator's log said why."""
        cmd = resp.command
        if cmd not in (coordinator_pb2.NODE_COMMAND_STOP, coordinator_pb2.NODE_COMMAND_WAIT) or not resp.message \
                or resp.message == self._told \
                or resp.job_state in (coordinator_pb2.JOB_STATE_SUCCEEDED, coordinator_pb2.JOB_STATE_FAILED):
            return
        self._told = resp.message
        (log.warning if cmd == coordinator_pb2.NODE_COMMAND_STOP else log.info)("coordinator: %s", resp.message)

    def check_patience(self, workers_running: int, now: float | None = None,
                       local_succeeded: int | None = None) -> None:
        """Ends a member that runs no workers and has not reached its coordinator for ``patience_s``: with
        nothing to keep alive it would otherwise heartbeat into a coordinator that is gone, forever. Running
        workers are never stopped for an outage (a restarted coordinator picks the job up again).

        Args:
            workers_running: the node's live workers.
            now: monotonic time (default now).
            local_succeeded: the generation whose local workers all exited 0, if they did (the message then
                says the job may well be over, and that this node must not simply be started again).

        Raises:
            CoordinatorUnavailableError: the bound passed.
            JoinTimeoutError: the first generation still missed nodes when the coordinator was last heard, and
                ``form_timeout_s`` has passed since this node began to join.
        """
        now = time.monotonic() if now is None else now
        since = self._unreachable_since
        if since is not None and not workers_running and self._forming is not None:
            # Nodes were missing when the coordinator was last heard (it may be gone with a node that gave up):
            # the join bound holds, not a second patience counted from the outage.
            self._check_join(self._forming, now)
        if since is None or now - since < self.config.patience_s or workers_running:
            return
        bound = f"(the bound is {self.config.patience_s:.0f}s, --rdzv-conf join_timeout)"
        if local_succeeded is not None:
            raise CoordinatorUnavailableError(
                f"every local worker of generation {local_succeeded} exited 0, but coordinator "
                f"{self.config.coordinator} has been unreachable for {now - since:.0f}s {bound}, so whether the "
                "whole job succeeded is unknown here: check the coordinator or the other nodes; start this node "
                "again only if the job did not finish (a rerun of a finished job starts it over)")
        raise CoordinatorUnavailableError(
            f"coordinator {self.config.coordinator} unreachable for {now - since:.0f}s with no workers running "
            f"on this node {bound}; check that it runs, then start this node again")

    # -- reports -------------------------------------------------------------------------------------------
    def report(self, event: HealthEvent, level: int, generation: int, rank: int = -1, code: int = 0) -> None:
        """Reports ``event`` about ``generation`` with a proposed recovery level (nothing without a
        coordinator; an unreachable one learns from heartbeats)."""
        if self._stub is None:
            return  # standalone: no coordinator to tell
        req = coordinator_pb2.ReportEventRequest(
            job=self.config.job, node_id=self.config.node_id, lease_id=self._lease, generation=generation,
            event=event.to_proto(), proposed_level=level, failed_rank=rank, exit_code=code,
        )
        try:
            resp = self._stub.ReportEvent(req, timeout=RPC_TIMEOUT_S)
            log.info("coordinator: %s", resp.message)
        except grpc.RpcError as exc:
            if exc.code() in _UNREACHED:
                # A report the coordinator may have taken (a lost answer) is safe to send again: a report
                # about a generation it already left changes nothing.
                self._unsent = (self._unsent + [req])[-MAX_UNSENT_REPORTS:]
                log.warning("could not report the failure to the coordinator (%s); it is sent again before the "
                            "next heartbeat", exc.code().name)
            else:
                log.warning("the coordinator refused the failure report (%s: %s)", exc.code().name, exc.details())

    def _send_unsent(self) -> grpc.StatusCode | None:
        """Sends the reports the coordinator did not get, oldest first.

        Returns:
            None when none is left; else the code that stopped it (UNAVAILABLE: down; DEADLINE_EXCEEDED: up but
            slow, so the heartbeat still goes out and keeps the lease). A report the coordinator refuses (e.g.
            about a generation it never had) is dropped, logged.
        """
        assert self._stub is not None
        while self._unsent:
            req = self._unsent[0]
            req.lease_id = self._lease  # the node may have registered again since
            try:
                resp = self._stub.ReportEvent(req, timeout=RPC_TIMEOUT_S)
                log.info("coordinator (failure report sent again): %s", resp.message)
            except grpc.RpcError as exc:
                if exc.code() in _UNREACHED:
                    return exc.code()
                log.warning("the coordinator refused a failure report sent again (%s: %s); dropped",
                            exc.code().name, exc.details())
            self._unsent.pop(0)
        return None

    def report_node(self, event: HealthEvent, generation: int, rank: int = -1, code: int = 0) -> None:
        """Reports a node- (or job-) level fault of ``generation`` and notes it, so it goes out once."""
        self.report(event, self.reports.record(event, generation), generation, rank, code)

    def ask_checkpoint(self, event: HealthEvent, generation: int) -> bool:
        """Asks the coordinator for a job-wide checkpoint (``event`` says why).

        Returns:
            True when the coordinator took the request; False without a coordinator or when the call failed.
        """
        if self._stub is None:
            return False
        req = coordinator_pb2.ReportEventRequest(
            job=self.config.job, node_id=self.config.node_id, lease_id=self._lease, generation=generation,
            event=event.to_proto(), proposed_level=coordinator_pb2.RECOVERY_LEVEL_NONE, failed_rank=-1)
        try:
            resp = self._stub.ReportEvent(req, timeout=RPC_TIMEOUT_S)
            log.info("coordinator: %s", resp.message)
            return True
        except grpc.RpcError as exc:
            log.warning("could not ask the coordinator for a job-wide checkpoint (%s); advising the local "
                        "workers only", exc.code().name)
            return False

    def close(self, reason: str = "") -> None:
        """Leaves: any state -> DONE; closes the channel. A node that registered but never ran a generation tells
        the coordinator it leaves (``reason``), so no generation forms with it in the lease it had left; so does
        a node told the job's outcome, which the coordinator otherwise reaped, a lease later, as a lost node."""
        never_ran = self._generation < 0 and self._life.state is LinkState.WAITING
        # Keyed on the outcome heard, not on DONE: close() itself moves every state to DONE, so a second close() of
        # a running node's link would have sent LeaveNode, a node-level failure of a job that goes on.
        told = self._told_outcome
        leaves = never_ran or told
        self._told_outcome = False  # said once
        if self._stub is not None and self._lease and leaves:
            try:
                self._stub.LeaveNode(coordinator_pb2.LeaveNodeRequest(
                    job=self.config.job, node_id=self.config.node_id, lease_id=self._lease,
                    reason=reason or self._leave_why),
                    timeout=LEAVE_TIMEOUT_S)
            except grpc.RpcError as exc:  # an older coordinator, or one gone: the lease runs out there instead
                if told and exc.code() == grpc.StatusCode.UNAVAILABLE:
                    # The job is over and its coordinator gone (--exit-when-done, or the embedding launcher):
                    # there is no lease left to run out, and every successful run ended on that line.
                    log.debug("the coordinator of the ended job is gone already; nothing to tell it")
                else:
                    log.info("could not tell the coordinator this node leaves (%s); its lease runs out instead",
                             exc.code().name)
        self._life.fire(_T.CLOSE)
        if self._channel is not None:
            self._channel.close()
        self._master_port.close()


__all__ = ["GrpcCoordinatorLink", "JoinTimeoutError", "coordinator_targets", "LinkConfig", "MAX_UNSENT_REPORTS", "RPC_TIMEOUT_S",
           "find_free_port", "foreign_listener", "foreign_listener_message", "plaintext_peer",
           "plaintext_peer_message", "speaks_tls", "tls_peer_message", "untrusted_peer", "untrusted_peer_message",
           "unresolved_host", "client_cert_refused", "client_cert_refused_message"]

"""``trainguard run`` where clusters run it: Slurm's environment, coordinator TLS and token, /metrics, health.

- **Slurm.** Under ``srun`` (one task per node), ``SLURM_*`` fill in the flags left at their defaults: job
  ``slurm-<SLURM_JOB_ID>``; node id, host and address from the node list (``SLURM_STEP_NODELIST``, else
  ``SLURM_JOB_NODELIST``, compressed form ``gpu[01-04]`` expanded by python-hostlist) at ``SLURM_NODEID``;
  ``--node-index`` = ``SLURM_NODEID`` (so GROUP_RANK follows Slurm's node order); ``--nnodes`` = the step's node
  count less ``--slurm-spares`` (the last nodes of the list, which join as spares: a lost node's slot is taken
  by one of them, since srun starts no new task in a running step); ``--nproc-per-node`` = ``SLURM_GPUS_ON_NODE``
  when set. The first node of the list embeds the
  coordinator on ``0.0.0.0:<--coordinator-port>``, the others join it at ``<first node>:<port>``. So one
  script runs unchanged under ``srun``; ``--no-slurm`` ignores the variables.
- **Security.** ``--coordinator-ca`` (verify the coordinator: TLS), ``--coordinator-cert/--coordinator-key``
  (mutual TLS) and the job token (``--token-file``, ``$TRAINGUARD_JOB_TOKEN_FILE``, ``$TRAINGUARD_JOB_TOKEN``)
  secure this node's calls; an embedded coordinator serves with ``--tls-cert/--tls-key/--tls-client-ca`` and
  the same token.
- **Observability.** ``--metrics-listen HOST:PORT`` serves Prometheus ``/metrics`` (generation, workers per
  state, faults, recovery times, restarts, last checkpoint step); ``--health-listen HOST:PORT`` serves
  ``grpc.health.v1`` only (Kubernetes gRPC probes): SERVING while the job runs. The run also registers its
  socket so ``trainguard status`` on the same host finds it without flags (:mod:`trainguard.agent.job_registry`).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from trainguard.agent.run_args import flag_given
from trainguard.agent.tls import TlsFiles
from trainguard.agent.config import hostport_arg
from trainguard.cli_support import whole_number
from trainguard.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.agent.node import NodeAgent
    from trainguard.recovery.rpc_security import RpcSecurity

log = logging.getLogger(__name__)

#: Port the embedded coordinator of a Slurm job listens on (``--coordinator-port``).
DEFAULT_SLURM_COORDINATOR_PORT = 29400
#: Default of ``--coordinator-port``.
COORDINATOR_PORT_ENV = "TRAINGUARD_COORDINATOR_PORT"
#: Default of ``--slurm-spares``.
SLURM_SPARES_ENV = "TRAINGUARD_SLURM_SPARES"
#: Health service name of the job this ``trainguard run`` runs.
RUN_SERVICE = "trainguard.run"


def _port_arg(text: str) -> int:
    """argparse type of ``--coordinator-port``: a TCP port, 1-65535 (every other node dials it: 0 picks none).

    Raises:
        argparse.ArgumentTypeError: not a whole number in range (argparse names the flag).
    """
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port in 1-65535")
    return port


def slurm_coordinator_port(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """The port the first Slurm node embeds the coordinator on: ``--coordinator-port``, else
    ``$TRAINGUARD_COORDINATOR_PORT``, else :data:`DEFAULT_SLURM_COORDINATOR_PORT`.

    Raises:
        UsageError: the variable is set to something that is not a port.
    """
    given = getattr(args, "coordinator_port", None)
    if given is not None:
        return int(given)
    text = (os.environ if environ is None else environ).get(COORDINATOR_PORT_ENV, "").strip()
    if not text:
        return DEFAULT_SLURM_COORDINATOR_PORT
    try:
        return _port_arg(text)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"${COORDINATOR_PORT_ENV}: {exc}; set it to the coordinator's port or unset it") from None


#: ``--slurm-spares``: a whole number of nodes, 0 or more.
_spares_arg = whole_number(0, "nodes")


def slurm_spares(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """How many nodes at the end of the Slurm step join as spares: ``--slurm-spares``, else
    ``$TRAINGUARD_SLURM_SPARES``, else 0.

    Raises:
        UsageError: the variable is set to something that is not a whole number >= 0.
    """
    given = getattr(args, "slurm_spares", None)
    if given is not None:
        return int(given)
    text = (os.environ if environ is None else environ).get(SLURM_SPARES_ENV, "").strip()
    if not text:
        return 0
    try:
        return _spares_arg(text)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"${SLURM_SPARES_ENV}: {exc}; set it to the number of spare nodes or unset it") from None


def add_run_deploy_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the Slurm, security and observability flags of ``trainguard run``."""
    g = p.add_argument_group("Slurm")
    g.add_argument("--no-slurm", dest="slurm", action="store_false",
                   help="ignore SLURM_* variables (default: use them to fill flags left at their defaults)")
    # The environment is read when the port is used (slurm_coordinator_port): read here, at parser build time, a
    # $TRAINGUARD_COORDINATOR_PORT that is no number was a ValueError traceback from every trainguard command.
    g.add_argument("--coordinator-port", type=_port_arg, metavar="PORT", default=None,
                   help=f"port of the coordinator the first Slurm node embeds (default ${COORDINATOR_PORT_ENV} or "
                        f"{DEFAULT_SLURM_COORDINATOR_PORT})")
    g.add_argument("--slurm-spares", type=_spares_arg, metavar="K", default=None,
                   help=f"the last K nodes of the step join as spares, --nnodes defaults to the other nodes "
                        f"(default ${SLURM_SPARES_ENV} or 0); allocate K nodes more than the job trains on")
    g.add_argument("--cordon-command", default=None, metavar="TEMPLATE",
                   help="embedded coordinator: run this per node it cordons, e.g. 'sudo scontrol update "
                        "nodename={host} state=drain reason={reason}' (fields {node} {host} {job} {reason}); "
                        "`trainguard uncordon` does not lift the mark it makes (scontrol ... state=resume does)")
    g = p.add_argument_group("joining a coordinator over TLS / mutual TLS")
    g.add_argument("--coordinator-ca", default=None, metavar="FILE",
                   help="PEM CA bundle: dial the coordinator over TLS and verify it")
    g.add_argument("--coordinator-cert", default=None, metavar="FILE", help="PEM client certificate (mutual TLS)")
    g.add_argument("--coordinator-key", default=None, metavar="FILE", help="PEM key of --coordinator-cert")
    g.add_argument("--coordinator-server-name", default=None, metavar="NAME",
                   help="name expected in the coordinator's certificate (default: the dialled host)")
    from trainguard.recovery.deploy_cli import add_coordinator_security_arguments

    add_coordinator_security_arguments(p)  # --tls-* of an embedded coordinator, --token-file for both
    g = p.add_argument_group("observability")
    g.add_argument("--metrics-listen", default=None, metavar="HOST:PORT", type=hostport_arg,
                   help="serve Prometheus /metrics here (generation, workers, faults, recovery times)")
    g.add_argument("--health-listen", default=None, metavar="HOST:PORT", type=hostport_arg,
                   help="serve grpc.health.v1 here (SERVING while the job runs)")


# ------------------------------------------------------------------------------------------------------ Slurm


@dataclass(frozen=True)
class SlurmPlacement:
    """Where this ``trainguard run`` sits in a Slurm step.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        nodes: the step's host names in Slurm order.
        node_index: ``SLURM_NODEID`` (index into ``nodes``).
        gpus_on_node: ``SLURM_GPUS_ON_NODE`` (0 when unset).
    """

    job_id: str
    nodes: tuple[str, ...]
    node_index: int
    gpus_on_node: int = 0

    @property
    def host(self) -> str:
        """This node's host name."""
        return self.nodes[self.node_index]

    @property
    def first(self) -> bool:
        """True on the node that embeds the coordinator."""
        return self.node_index == 0


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "")
    if not raw:
        return None
    head = raw.split("(")[0].split(",")[0]  # SLURM_TASKS_PER_NODE-style "2(x3)" and SLURM_GPUS "4,4"
    try:
        return int(head)
    except ValueError:
        raise UsageError(f"${name}={raw!r} is not a number; is this a Slurm job step?") from None


def slurm_placement(environ: Mapping[str, str] | None = None) -> SlurmPlacement | None:
    """Reads the placement from ``SLURM_*`` variables; None outside Slurm.

    Raises:
        UsageError: inconsistent variables (node id outside the list, several tasks per node).
    """
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    nodelist_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v)),
                        None)
    if nodelist_var is None:
        raise UsageError("$SLURM_JOB_ID is set but no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: start "
                         "`trainguard run` with srun, or pass --no-slurm")
    import hostlist

    try:
        nodes = tuple(hostlist.expand_hostlist(env[nodelist_var]))
    except hostlist.BadHostlist as exc:
        raise UsageError(f"${nodelist_var}={env[nodelist_var]!r} is not a Slurm host list ({exc})") from exc
    node_index = _int_env(env, "SLURM_NODEID")
    if node_index is None:
        raise UsageError("$SLURM_NODEID is not set: start `trainguard run` with srun (one task per node), "
                         "or pass --no-slurm")
    if not 0 <= node_index < len(nodes):
        raise UsageError(f"$SLURM_NODEID={node_index} is outside ${nodelist_var} ({len(nodes)} nodes)")
    step_nodes = _int_env(env, "SLURM_STEP_NUM_NODES") or _int_env(env, "SLURM_NNODES") or len(nodes)
    tasks = _int_env(env, "SLURM_STEP_NUM_TASKS") or _int_env(env, "SLURM_NTASKS")
    if tasks is not None and tasks > step_nodes:
        raise UsageError(f"{tasks} Slurm tasks on {step_nodes} node(s): trainguard run starts the workers of a "
                         "node itself, so run one task per node (srun --ntasks-per-node=1)")
    return SlurmPlacement(job_id=job_id, nodes=nodes, node_index=node_index,
                          gpus_on_node=_int_env(env, "SLURM_GPUS_ON_NODE") or 0)


def _unset(value: object, default: object) -> bool:
    """True when a flag was left alone: None (no default) or its default, as a number or as text."""
    return value is None or value == default or str(value) == str(default)


def _like(current: object, value: int) -> object:
    """``value`` in the type the flag holds (text for torchrun-style ``N|MIN:MAX`` flags, else a number)."""
    return str(value) if isinstance(current, str) else value


def apply_slurm(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> SlurmPlacement | None:
    """Fills the ``trainguard run`` flags left at their defaults from Slurm's variables (in place).

    Returns:
        The placement, or None outside Slurm or with ``--no-slurm``.

    Raises:
        UsageError: see :func:`slurm_placement`; a ``$TRAINGUARD_COORDINATOR_PORT`` that is no port.
    """
    place = slurm_placement(environ) if getattr(args, "slurm", True) else None
    if place is None:
        if getattr(args, "slurm_spares", None):  # silently ignored, the nodes meant as spares trained instead
            raise UsageError(f"--slurm-spares {args.slurm_spares}: " + (
                "--no-slurm ignores Slurm's variables" if not getattr(args, "slurm", True) else
                "this is not a Slurm job step (no $SLURM_JOB_ID)") + "; give --spare to the nodes that are spares")
        return None
    n = len(place.nodes)
    if args.job is None:
        args.job = f"slurm-{place.job_id}"
    if args.node_id is None:
        args.node_id = place.host
    if args.host is None:
        args.host = place.host
    if _unset(args.address, "127.0.0.1"):
        args.address = place.host
    if _unset(args.node_index, 0):
        args.node_index = place.node_index
    # A torchrun flag given as its default (--nproc-per-node 1: one process driving every GPU) is the user's
    # choice: it was replaced (8 workers where 1 was asked for, as SLURM_GPUS_ON_NODE said 8).
    if _unset(getattr(args, "node_rank", None), 0) and not flag_given(args, "node_rank"):
        args.node_rank = place.node_index
    if _unset(args.nproc_per_node, 1) and place.gpus_on_node > 1 and not flag_given(args, "nproc_per_node"):
        args.nproc_per_node = _like(args.nproc_per_node, place.gpus_on_node)
    # torchrun's own rendezvous flags win over the Slurm mapping: it only fills a job that named no coordinator.
    explicit = args.coordinator or getattr(args, "rdzv_endpoint", "") or getattr(args, "standalone", False)
    spares = slurm_spares(args, environ)
    if spares:
        from trainguard.agent.run_torchrun import parse_nnodes

        trains = n - spares
        most = trains if _unset(args.nnodes, 1) else parse_nnodes(args.nnodes)[1]
        why = ("spares are for the job the Slurm step forms itself; with --coordinator/--rdzv-endpoint/--standalone "
               "give --spare to the nodes that are spares" if explicit else
               f"the step has {n} node(s), which leaves {trains} to train on; spares stand in for nodes of a job "
               "of 2 or more (one node restarts in place, its spares would wait unused): allocate more nodes "
               "(sbatch --nodes)" if trains < 2 else
               f"--nnodes {args.nnodes} asks for more nodes than the {trains} that train (the step has {n}, "
               f"{spares} of them spares); the job would wait for them until its form timeout"
               if most > trains else "")
        if why:
            raise UsageError(f"--slurm-spares {spares}: {why}")
    # A spare is a node of the step the job does not place until a node is lost: the last ones, so the first
    # node, which embeds the coordinator, always trains and ranks follow Slurm's order on the others.
    if spares and place.node_index >= n - spares:
        args.spare = True
    if not explicit and n > 1:
        port = slurm_coordinator_port(args, environ)
        if _unset(args.nnodes, 1):
            args.nnodes = _like(args.nnodes, n - spares)
        if place.first:
            if _unset(args.coordinator_listen, "127.0.0.1:0"):
                args.coordinator_listen = f"0.0.0.0:{port}"
        else:
            args.coordinator = f"{place.nodes[0]}:{port}"
    log.info("slurm job %s: node %d of %d (%s%s), job %s, coordinator %s", place.job_id, place.node_index, n,
             place.host, ", spare" if args.spare else "", args.job,
             args.coordinator or f"embedded on {args.coordinator_listen}")
    return place


# --------------------------------------------------------------------------------------------------- security


def run_security(args: argparse.Namespace) -> tuple["RpcSecurity", "RpcSecurity"]:
    """The embedded coordinator's server security and this node's client security.

    Raises:
        SecurityConfigError: inconsistent flags or an unusable token.
    """
    from trainguard.recovery.rpc_security import RpcSecurity, token_from

    token = token_from(getattr(args, "token_file", None))
    server = RpcSecurity(TlsFiles(getattr(args, "tls_cert", None) or "", getattr(args, "tls_key", None) or "",
                                  getattr(args, "tls_client_ca", None) or ""), token)
    server.check_server()
    client = RpcSecurity(TlsFiles(getattr(args, "coordinator_cert", None) or "",
                                  getattr(args, "coordinator_key", None) or "",
                                  getattr(args, "coordinator_ca", None) or ""),
                         token, getattr(args, "coordinator_server_name", None) or "")
    if getattr(args, "coordinator", None) is None and server.server_tls and not client.client_tls:
        raise UsageError("the embedded coordinator serves TLS (--tls-cert) but this node would dial it in "
                         "plaintext: add --coordinator-ca (and --coordinator-cert/--coordinator-key for mTLS)")
    if getattr(args, "coordinator", None) and client.client_tls:
        for target in args.coordinator.split(","):  # a list: the coordinator and where it may be restarted
            if target.strip():
                probe_coordinator(client, target.strip())
    return server, client


def probe_coordinator(client: "RpcSecurity", target: str, timeout_s: float = 3.0) -> None:
    """One health check against a remote coordinator, so a TLS mistake fails at once instead of after the
    registration patience (a coordinator that is not up yet is fine: the agent waits for it).

    Raises:
        SecurityConfigError: this node does not trust the coordinator's certificate.
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from trainguard.recovery.rpc_security import SecurityConfigError

    with client.channel(target) as ch:
        try:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            details = exc.details() or ""
            from trainguard.agent.coordinator_link import plaintext_peer, plaintext_peer_message

            if plaintext_peer(exc.code(), details):  # not a CA problem: the coordinator serves plaintext
                raise SecurityConfigError(plaintext_peer_message(target)) from exc
            if "handshake failed" in details.lower():
                why = details.rsplit(": ", 2)[-2] if details.count(": ") >= 2 else details
                raise SecurityConfigError(
                    f"TLS with the coordinator {target} failed ({why.strip()[:160]}): check --coordinator-ca (the CA "
                    "that signed its certificate) and --coordinator-server-name") from exc
            if "Socket closed" in details:
                from trainguard.agent.coordinator_link import client_cert_refused, client_cert_refused_message

                if client_cert_refused(target, client.tls.cert_file, client.tls.key_file):
                    raise SecurityConfigError(
                        client_cert_refused_message(target, bool(client.tls.cert_file))) from exc
                log.warning("coordinator %s closed the connection while it was set up: if it serves TLS this node "
                            "needs --coordinator-ca, and for mutual TLS --coordinator-cert/--coordinator-key from "
                            "its client CA", target)


# ------------------------------------------------------------------------------------------- observability


class RunMetrics:
    """Prometheus metrics of one ``trainguard run``, read from the node agent at scrape time.

    Series: ``trainguard_run_info{version,job,node}``, ``trainguard_run_generation``,
    ``trainguard_run_workers{state}``, ``trainguard_run_faults_total``, ``trainguard_run_restarts_total``
    (generations after the first), ``trainguard_run_recovery_seconds`` (fault -> first resumed step; summary of
    every recovery), ``trainguard_run_last_checkpoint_step``, ``trainguard_run_predictor_score``, the
    ``trainguard_failslow_*`` gauges (:func:`~trainguard.agent.metrics.failslow_families`); with peer
    replication ``trainguard_run_replica_bytes``, ``..._limit_bytes``, ``..._pushes_total``,
    ``..._push_failures_total``, ``..._evictions_total``, ``..._push_seconds``.
    """

    def __init__(self, agent: "NodeAgent") -> None:
        from prometheus_client import CollectorRegistry, disable_created_metrics

        disable_created_metrics()
        self.agent = agent
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self):
        """Yields the metric families (prometheus-client collector API)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

        from trainguard._version import __version__
        from trainguard.agent.workers import WorkerState

        a = self.agent
        info = GaugeMetricFamily("trainguard_run_info", "Identity of this trainguard run (always 1).",
                                 labels=["version", "job", "node"])
        info.add_metric([__version__, a.config.job, a.config.node_id], 1)
        yield info
        yield GaugeMetricFamily("trainguard_run_generation", "Generation the local workers run (-1 before).",
                                value=a.generation)
        counts = {s: 0 for s in WorkerState}
        group = a.group
        for w in (group.workers if group is not None else []):
            counts[w.state] += 1
        workers = GaugeMetricFamily("trainguard_run_workers", "Local workers per state.", labels=["state"])
        for state, n in counts.items():
            workers.add_metric([state.name.lower()], n)
        yield workers
        records = list(a.fault_records)
        yield CounterMetricFamily("trainguard_run_faults", "Worker failures seen on this node.", value=len(records))
        yield CounterMetricFamily("trainguard_run_restarts", "Generations started after the first.",
                                  value=max(a.generation - 1, 0))
        times = [r.recovery_s for r in records if r.recovery_s is not None]
        yield SummaryMetricFamily("trainguard_run_recovery_seconds", "Fault to first resumed step, seconds.",
                                  count_value=len(times), sum_value=float(sum(times)))
        yield GaugeMetricFamily("trainguard_run_last_checkpoint_step", "Newest step reported durable.",
                                value=a.last_checkpoint_step)
        yield GaugeMetricFamily("trainguard_run_predictor_score", "Failure risk in [0, 1].", value=a.predictor_score)
        from trainguard.agent.metrics import failslow_families

        yield from failslow_families(a.failslow.status, a.config.node_id)  # the coordinator's fail-slow findings
        rep = getattr(a, "replicas", None)
        if rep is not None:  # peer replication of the in-memory checkpoints (agent/replica_agent.py)
            yield GaugeMetricFamily("trainguard_run_replica_bytes", "Memory other nodes' checkpoint replicas hold "
                                    "on this node.", value=rep.store.bytes_held())
            yield GaugeMetricFamily("trainguard_run_replica_limit_bytes", "Bound on that memory.",
                                    value=rep.store.max_bytes)
            yield CounterMetricFamily("trainguard_run_replica_pushes", "Snapshots replicated to a buddy node.",
                                      value=rep.stats.pushes)
            yield CounterMetricFamily("trainguard_run_replica_push_failures", "Replications that failed.",
                                      value=rep.stats.push_failures)
            yield CounterMetricFamily("trainguard_run_replica_evictions", "Replicas evicted to stay within the "
                                      "bound.", value=rep.store.evicted)
            secs = rep.stats.push_seconds
            yield SummaryMetricFamily("trainguard_run_replica_push_seconds", "Time to replicate one snapshot "
                                      "(recent pushes).", count_value=len(secs), sum_value=float(sum(secs)))


@dataclass
class RunExtras:
    """What :func:`start_run_extras` started around a ``trainguard run``; :meth:`stop` ends it."""

    metrics_server: object | None = None
    health_server: grpc.Server | None = None
    health_port: int = 0
    health: object | None = None
    registration: str | None = None
    coordinator: object | None = None
    own_node: str = ""
    cordon: object | None = None
    _watch: object | None = field(default=None, repr=False)

    def stop(self) -> None:
        """Lets an embedded coordinator tell the other nodes the job's end, marks health NOT_SERVING, stops the
        servers, removes the status registration."""
        from trainguard.agent.job_registry import unregister

        if self.coordinator is not None:
            linger_until_peers_told(self.coordinator, own_node=self.own_node)
        if self.cordon is not None:
            self.cordon.stop()  # type: ignore[attr-defined]
        if self._watch is not None:
            self._watch.set()  # type: ignore[attr-defined]
        if self.health is not None:
            self.health.shutdown()  # type: ignore[attr-defined]
        if self.health_server is not None:
            self.health_server.stop(0.5).wait(2)
        if self.metrics_server is not None:
            self.metrics_server.close()  # type: ignore[attr-defined]
        if self.registration:
            unregister(self.registration)


def linger_until_peers_told(server, timeout_s: float | None = None, own_node: str = "") -> bool:
    """Keeps an embedded coordinator serving until a heartbeat answer told every other live node that the job
    ended (:meth:`~trainguard.recovery.coordinator.JobCoordinator.not_told_of_end`).

    The first node of a multi-node job embeds the coordinator; if it went away as soon as its own workers
    finished, the other nodes would never hear that the job is over and would keep heartbeating into the void.

    Args:
        server: the embedded :class:`~trainguard.recovery.service.CoordinatorServer`.
        timeout_s: longest wait, seconds (default: the job's lease timeout).
        own_node: this launcher's node id, which needs no telling.

    Returns:
        True when every live node was told (or the job is not over, so there is nothing to tell).
    """
    import time

    from trainguard.recovery.policy import Phase

    core = server.core
    # Whatever the job's size: an elastic job (--nnodes 1:2) has peers with nnodes 1, and a one-node job has spares
    # (a second `trainguard run` on the same endpoint joins as one). Lingering only for nnodes > 1 left them
    # unaware that the job ended: a spare warned for a minute, then exited 2 saying "start this node again".
    if core.state.phase not in (Phase.SUCCEEDED, Phase.FAILED):
        return True
    deadline = time.monotonic() + (core.spec.lease_timeout_s if timeout_s is None else timeout_s)
    while time.monotonic() < deadline:
        # Told, not heard from since this call: a node told by an earlier answer exits without another
        # heartbeat, and waiting for one kept every multi-node job's first node up for a lease (10 s).
        if not [nid for nid in core.not_told_of_end() if nid != own_node]:
            return True
        time.sleep(0.05)
    log.warning("stopping the embedded coordinator before every node heard that the job ended")
    return False


def cordon_hooks_for(coordinator, template: str):
    """Runs ``--cordon-command`` for every node the embedded ``coordinator`` cordons, as ``trainguard
    coordinator`` does: a node it returns to service (``trainguard uncordon``, or its daemon's healthy reports) is
    forgotten, so that cordoning it again runs the command again.

    The scheduler's mark the command made is not lifted by the uncordon (``scontrol update state=resume``,
    ``kubectl uncordon``: the operator's, as the repair was).

    Returns:
        The started :class:`~trainguard.recovery.cordon.CordonDispatcher` (stop it at the end).
    """
    from trainguard.recovery.cordon import CommandCordon, CordonDispatcher

    dispatcher = CordonDispatcher([CommandCordon(template)]).start()
    coordinator.watch.add_cordon_listener(dispatcher.submit)
    # Without this the dispatcher remembered the node for good: repaired, resumed in Slurm, uncordoned and then
    # failing again, it was cordoned by trainguard but left schedulable in Slurm.
    coordinator.watch.add_uncordon_listener(dispatcher.forget)
    return dispatcher


def _refuse_taken_listeners(args: argparse.Namespace) -> None:
    """Refuses --metrics-listen and --health-listen on one port, or --health-listen on a port already taken,
    before either binds: the second bind failed with gRPC's C++ log line and a message that named neither the
    other flag nor the cause.

    Raises:
        UsageError: naming the flag(s).
    """
    from trainguard.agent.config import same_port
    from trainguard.agent.run_torchrun import port_free

    metrics, health = getattr(args, "metrics_listen", None), getattr(args, "health_listen", None)
    if metrics and health and same_port(metrics, health):
        raise UsageError(f"--metrics-listen {metrics} and --health-listen {health} are the same port; give each "
                         "its own")
    if health and not port_free(health):
        raise UsageError(f"--health-listen {health}: the port is in use by another process; pick another")


def start_run_extras(args: argparse.Namespace, agent: "NodeAgent", socket_path: str | None,
                     coordinator=None) -> RunExtras:
    """Starts /metrics and the health port the flags ask for, and registers the run for ``trainguard status``.

    Args:
        args: parsed ``trainguard run`` flags.
        agent: this node's agent.
        socket_path: its unix socket (registered for ``trainguard status``).
        coordinator: the embedded coordinator server, if any (kept up at the end until the peers know).

    Raises:
        UsageError: an address cannot be bound.
    """
    import threading

    from trainguard.agent.config import AgentConfigError
    from trainguard.agent.job_registry import register
    from trainguard.agent.metrics import MetricsServer
    from trainguard.recovery.observe import ServingStatus, serve_health_only

    extras = RunExtras(coordinator=coordinator, own_node=agent.config.node_id)
    _refuse_taken_listeners(args)
    try:
        if getattr(args, "metrics_listen", None):
            try:
                extras.metrics_server = MetricsServer(RunMetrics(agent), args.metrics_listen,  # type: ignore[arg-type]
                                                      setting="--metrics-listen")
            except AgentConfigError as exc:
                raise UsageError(str(exc)) from exc
            log.info("metrics on %s", extras.metrics_server.url)  # type: ignore[attr-defined]
        if getattr(args, "health_listen", None):
            health = ServingStatus(("", RUN_SERVICE))
            server, extras.health_port = serve_health_only(health, args.health_listen, "run-health")
            extras.health, extras.health_server = health, server
            stop = threading.Event()
            extras._watch = stop

            def follow() -> None:
                # SERVING from the moment the agent runs until it stops (the job ended or was stopped).
                while not stop.wait(0.25):
                    health.set(not agent.stopping)

            health.set(True)
            threading.Thread(target=follow, name="run-health", daemon=True).start()
            log.info("grpc.health.v1 on port %d", extras.health_port)
        if socket_path:
            extras.registration = register(agent.config.job, socket_path)
        if coordinator is not None and getattr(args, "cordon_command", None):
            extras.cordon = cordon_hooks_for(coordinator, args.cordon_command)
    except BaseException:
        extras.stop()
        raise
    return extras


__all__ = ["DEFAULT_SLURM_COORDINATOR_PORT", "RUN_SERVICE", "RunExtras", "RunMetrics", "SlurmPlacement",
           "add_run_deploy_arguments", "apply_slurm", "cordon_hooks_for", "run_security", "slurm_placement",
           "start_run_extras"]

"""Deployment flags of ``trainguard coordinator``: TLS and the job token, /metrics, a health-only port, cordon hooks.

Kept apart from :mod:`trainguard.recovery.cli` so the job logic's flags and the operator's deployment flags
change independently. :func:`start_coordinator_extras` starts what the flags ask for around a built
:class:`~trainguard.recovery.service.CoordinatorServer` and returns one object to stop it all.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

import grpc

from trainguard.agent.tls import TlsFiles
from trainguard.agent.config import hostport_arg
from trainguard.errors import UsageError
from trainguard.recovery.cordon import CommandCordon, CordonDispatcher, CordonHook, KubeAccess, KubernetesCordon
from trainguard.recovery.rpc_security import RpcSecurity, token_from

log = logging.getLogger(__name__)


def add_coordinator_security_arguments(p: argparse.ArgumentParser) -> None:
    """``--tls-cert/--tls-key/--tls-client-ca/--token-file``."""
    g = p.add_argument_group("security (see README: Security model)")
    g.add_argument("--tls-cert", default=None, metavar="FILE", help="PEM server certificate: serve TLS only")
    g.add_argument("--tls-key", default=None, metavar="FILE", help="PEM private key of --tls-cert")
    g.add_argument("--tls-client-ca", default=None, metavar="FILE",
                   help="PEM CA bundle: demand client certificates signed by it (mutual TLS)")
    g.add_argument("--token-file", default=None, metavar="FILE",
                   help="file holding the job token every call must carry (default $TRAINGUARD_JOB_TOKEN_FILE "
                        "or $TRAINGUARD_JOB_TOKEN; none: no token check)")


def add_coordinator_deploy_arguments(p: argparse.ArgumentParser) -> None:
    """Every deployment flag of ``trainguard coordinator``."""
    add_coordinator_security_arguments(p)
    g = p.add_argument_group("observability")
    g.add_argument("--metrics-listen", default=None, metavar="HOST:PORT", type=hostport_arg,
                   help="serve Prometheus /metrics here (job phase, generation, restarts, recovery times, nodes)")
    g.add_argument("--health-listen", default=None, metavar="HOST:PORT", type=hostport_arg,
                   help="also serve grpc.health.v1 alone, in plaintext, here (Kubernetes gRPC probes cannot "
                        "speak TLS); the main port serves it too")
    g = p.add_argument_group("scheduler cordon hooks (when the coordinator cordons a node)")
    g.add_argument("--cordon-command", default=None, metavar="TEMPLATE",
                   help="run this per cordoned node, e.g. 'scontrol update nodename={host} state=drain "
                        "reason={reason}' (fields {node} {host} {job} {reason}; no shell)")
    g.add_argument("--cordon-kubernetes", action="store_true",
                   help="cordon and taint the Kubernetes node (trainguard.dev/unhealthy=<job>:NoSchedule)")
    g.add_argument("--kube-api", default=None, metavar="URL", help="API server (default: in-cluster)")
    g.add_argument("--kube-token-file", default=None, metavar="FILE", help="bearer token for --kube-api")
    g.add_argument("--kube-ca", default=None, metavar="FILE", help="PEM CA of --kube-api")
    g.add_argument("--cordon-taint-effect", default="NoSchedule",
                   choices=["NoSchedule", "PreferNoSchedule", "NoExecute"],
                   help="effect of the taint (default NoSchedule: running pods stay)")


def coordinator_security(args: argparse.Namespace) -> RpcSecurity:
    """The server-side security the flags ask for.

    Raises:
        SecurityConfigError: inconsistent TLS flags or an unusable token.
    """
    sec = RpcSecurity(tls=TlsFiles(getattr(args, "tls_cert", None) or "", getattr(args, "tls_key", None) or "",
                                   getattr(args, "tls_client_ca", None) or ""),
                      token=token_from(getattr(args, "token_file", None)))
    sec.check_server()
    return sec


def cordon_hooks(args: argparse.Namespace) -> list[CordonHook]:
    """The cordon hooks the flags configure (possibly none).

    Raises:
        CordonConfigError: a malformed template, or no reachable API server configuration.
    """
    hooks: list[CordonHook] = []
    if getattr(args, "cordon_command", None):
        hooks.append(CommandCordon(args.cordon_command))
    if getattr(args, "cordon_kubernetes", False):
        access = KubeAccess.resolve(args.kube_api, args.kube_token_file, args.kube_ca)
        hooks.append(KubernetesCordon(access, taint_effect=args.cordon_taint_effect))
    elif getattr(args, "kube_api", None):
        raise UsageError("--kube-api applies to --cordon-kubernetes; add it or drop --kube-api")
    return hooks


@dataclass
class CoordinatorExtras:
    """What :func:`start_coordinator_extras` started; :meth:`stop` ends all of it."""

    dispatcher: CordonDispatcher
    metrics_server: object | None = None
    health_server: grpc.Server | None = None
    health_port: int = 0
    notes: list[str] = field(default_factory=list)

    def stop(self) -> None:
        """Stops the servers and lets queued cordon hooks finish."""
        if self.health_server is not None:
            self.health_server.stop(0.5).wait(2)
        if self.metrics_server is not None:
            self.metrics_server.close()  # type: ignore[attr-defined]
        self.dispatcher.stop()


def start_coordinator_extras(args: argparse.Namespace, server) -> CoordinatorExtras:
    """Starts the cordon dispatcher, /metrics and the health-only port around a built coordinator server.

    Args:
        args: parsed flags (those of :func:`add_coordinator_deploy_arguments`; missing ones mean off).
        server: the :class:`~trainguard.recovery.service.CoordinatorServer` (before or after ``start()``).

    Raises:
        UsageError: an address cannot be bound or a hook is misconfigured.
    """
    from trainguard.agent.config import AgentConfigError, parse_hostport
    from trainguard.agent.metrics import MetricsServer
    from trainguard.recovery.observe import CoordinatorMetrics, serve_health_only

    dispatcher = CordonDispatcher(cordon_hooks(args)).start()
    server.watch.add_cordon_listener(dispatcher.submit)
    server.watch.add_uncordon_listener(dispatcher.forget)
    extras = CoordinatorExtras(dispatcher)
    try:
        if getattr(args, "metrics_listen", None):
            metrics = CoordinatorMetrics(server.watch, dispatcher)
            try:
                parse_hostport(args.metrics_listen)
            except ValueError as exc:  # a traceback before: the metrics server only checks a parsed address
                raise UsageError(f"--metrics-listen {exc}") from exc
            try:
                extras.metrics_server = MetricsServer(metrics, args.metrics_listen,  # type: ignore[arg-type]
                                                      setting="--metrics-listen")
            except AgentConfigError as exc:
                raise UsageError(str(exc)) from exc
            extras.notes.append(f"metrics on {extras.metrics_server.url}")  # type: ignore[attr-defined]
        if getattr(args, "health_listen", None):
            hs, extras.health_port = serve_health_only(server.watch.health, args.health_listen, "coordinator-health")
            extras.health_server = hs
            extras.notes.append(f"grpc.health.v1 on port {extras.health_port}")
    except BaseException:
        extras.stop()
        raise
    for hook in dispatcher.hooks:
        extras.notes.append(f"cordon hook {hook.name}")
    return extras


__all__ = ["CoordinatorExtras", "add_coordinator_deploy_arguments", "add_coordinator_security_arguments",
           "coordinator_security", "cordon_hooks", "start_coordinator_extras"]

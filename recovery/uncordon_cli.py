"""``trainguard uncordon``: an operator returns a cordoned node to a running job's service.

Example::

    trainguard uncordon n17 --coordinator coord:29400 --job llm-7b --reason "GPU 3 replaced, ticket 4711"

A node the coordinator cordoned (a fatal fault, a lost lease, repeated crashes, a straggler, a failed pre-flight
check) stays out of the job until something vouches for it. A restarted node daemon does so by itself (its
healthy report); this command is the way for a machine without a daemon, or to overrule a pre-flight refusal.
The node then serves as a spare and may fill a vacancy at once. The scheduler's own mark (a Slurm drain, the
Kubernetes taint of ``--cordon-kubernetes``) is not lifted: that stays the operator's, as the repair was.

Exit status: 0 when the node was uncordoned, 1 when the coordinator kept it out (not cordoned, its
replacement runs now, or its node daemon still reports a fatal fault: the message says which), 2 on a bad flag or a coordinator that cannot be reached.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from trainguard.agent.config import hostport_arg
from trainguard.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the ``uncordon`` subcommand.

    Args:
        sub: the top-level subparsers.
    """
    p = sub.add_parser("uncordon", help="return a cordoned node to a job's service (an operator's repair)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("node", help="the node id the coordinator cordoned")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT", type=hostport_arg,
                   help="the job's coordinator")
    p.add_argument("--job", required=True, help="the job name")
    p.add_argument("--reason", default="", help="one line for the coordinator's log (what was repaired, by whom)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds to wait for the answer (10)")
    g = p.add_argument_group("security (as the job's agents use)")
    g.add_argument("--token-file", default=None, metavar="FILE",
                   help="the job token (else $TRAINGUARD_JOB_TOKEN_FILE, $TRAINGUARD_JOB_TOKEN)")
    g.add_argument("--coordinator-ca", default=None, metavar="FILE", help="PEM CA that signed the coordinator's cert")
    g.add_argument("--coordinator-cert", default=None, metavar="FILE", help="PEM client certificate (mutual TLS)")
    g.add_argument("--coordinator-key", default=None, metavar="FILE", help="PEM key of --coordinator-cert")
    g.add_argument("--coordinator-server-name", default=None, metavar="NAME",
                   help="name to verify in the coordinator's certificate (default: the host dialled)")
    p.set_defaults(handler=handle_uncordon)


def handle_uncordon(args: argparse.Namespace) -> int:
    """Asks the coordinator to uncordon ``args.node``; prints its answer.

    Returns:
        0 uncordoned, 1 kept out.

    Raises:
        UsageError: bad security flags, or the coordinator refused or could not be reached.
    """
    from trainguard.agent.tls import TlsFiles
    from trainguard.proto import coordinator_pb2, coordinator_pb2_grpc
    from trainguard.recovery.rpc_security import RpcSecurity, SecurityConfigError, token_from

    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout}: expected seconds > 0")
    req = coordinator_pb2.UncordonNodeRequest(job=args.job, node_id=args.node, reason=args.reason)
    try:
        security = RpcSecurity(TlsFiles(args.coordinator_cert or "", args.coordinator_key or "",
                                        args.coordinator_ca or ""), token_from(args.token_file),
                               args.coordinator_server_name or "")
        with security.channel(args.coordinator) as ch:
            resp = coordinator_pb2_grpc.CoordinatorStub(ch).UncordonNode(req, timeout=args.timeout)
    except SecurityConfigError as exc:
        raise UsageError(str(exc)) from exc
    except grpc.RpcError as exc:
        from trainguard.agent.coordinator_link import foreign_listener, foreign_listener_message

        foreign = foreign_listener(exc.code(), exc.details() or "")
        if foreign is not None:
            raise UsageError(foreign_listener_message(args.coordinator, foreign, exc.details() or "",
                                                      "--coordinator")) from exc
        raise UsageError(f"coordinator {args.coordinator}: {exc.code().name}: {exc.details()}") from exc
    print(f"trainguard: {resp.message}", file=sys.stdout if resp.uncordoned else sys.stderr)
    return 0 if resp.uncordoned else 1

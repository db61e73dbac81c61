"""``trainguard coordinator``: run a job's coordinator as its own process (multi-node jobs).

Example::

    trainguard coordinator --job llm-7b --listen 0.0.0.0:29400 --nnodes 64 --max-restarts 10 \\
        --store sqlite:///var/lib/trainguard/llm-7b.db

Node agents then join with ``trainguard run --coordinator HOST:29400 --job llm-7b ...``. Killed and started
again with the same ``--job`` and ``--store``, the coordinator continues the job where it was: same
generation, restart budget, rank table and leases, so running agents simply keep heartbeating.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.agent.config import hostport_arg
from trainguard.cli_support import whole_number
from trainguard.errors import UsageError

if TYPE_CHECKING:
    from trainguard.recovery.spec import JobSpec

log = logging.getLogger("trainguard.coordinator")


#: ``--max-cordoned``: at least 1 (0 read as "the default" in the job spec, so ``--max-cordoned 0`` ran silently
#: with 1024).
_cordon_bound = whole_number(1, "nodes", "leave it out for the default")


def default_store(job: str) -> str:
    """The store URL used without ``--store``: a SQLite file under ``$XDG_STATE_HOME/trainguard``.

    Args:
        job: the job name.

    Returns:
        ``sqlite:///<state dir>/coordinator-<job>.db``.
    """
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return f"sqlite://{os.path.join(base, 'trainguard', f'coordinator-{job}.db')}"


def register(sub: argparse._SubParsersAction) -> None:
    """Adds the ``coordinator`` subcommand.

    Args:
        sub: the top-level subparsers.
    """
    from trainguard.recovery.spec import MAX_CORDONED

    p = sub.add_parser("coordinator", help="run a job's coordinator (membership, ranks, recovery) as a server",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--job", required=True, help="job name the node agents use")
    p.add_argument("--listen", default="0.0.0.0:29400", metavar="HOST:PORT", type=hostport_arg,
                   help="address to serve gRPC on (default 0.0.0.0:29400; port 0 picks one)")
    p.add_argument("--store", default=None, metavar="URL",
                   help="state store: sqlite:///path.db (default under ~/.local/state/trainguard), "
                        "file:///dir, etcd://host:port[,host:port][/prefix], memory://")
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="nodes needed before the first generation (default 1); MIN:MAX as torchrun: once MIN "
                        "registered, wait --last-call-timeout for up to MAX, at once with MAX")
    p.add_argument("--last-call-timeout", type=float, default=30.0, metavar="S",
                   help="with --nnodes MIN:MAX, seconds to wait for more nodes once MIN registered (default 30)")
    p.add_argument("--max-restarts", type=int, default=3, help="job-wide restart budget (default 3)")
    p.add_argument("--group-size", type=int, default=1,
                   help="ranks per parallel group kept consecutive inside one pod (default 1: no constraint)")
    p.add_argument("--allow-shrink", action=argparse.BooleanOptionalAction, default=None,
                   help="drop a lost node's slot when no spare is left, down to --min-nodes (default: on with "
                        "--nnodes MIN:MAX, as `trainguard run`, off with a fixed --nnodes N; --no-allow-shrink: "
                        "never, a lost node waits for a spare)")
    p.add_argument("--min-nodes", type=int, default=0,
                   help="fewest nodes after shrinking (default: --nnodes N, or MIN of MIN:MAX)")
    p.add_argument("--memory-replicas", type=int, default=1,
                   help="buddy nodes (another pod's first) holding each node's in-memory checkpoint (1; 0: none)")
    p.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds between node heartbeats (1.0)")
    p.add_argument("--lease-timeout", type=float, default=10.0,
                   help="seconds without heartbeat after which a node is lost (default 10)")
    p.add_argument("--backoff", type=float, default=0.5,
                   help="seconds before the 2nd consecutive restart without progress, doubling (default 0.5)")
    p.add_argument("--repeat-window", type=float, default=600.0, metavar="S",
                   help="seconds over which repeated failures escalate (2 process failures of one node -> node "
                        "level, 3 node-level failures -> job level; default 600)")
    p.add_argument("--max-heartbeat-rate", type=float, default=4000.0,
                   help="heartbeats/s the coordinator invites at most; more nodes get a longer interval (4000: "
                        "about one core, see bench/bench_coordinator.py)")
    p.add_argument("--membership-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a recovery waits for a valid membership (a spare of the right pod, a lost node "
                        "back) before the job fails (default 600)")
    p.add_argument("--max-cordoned", type=_cordon_bound, default=MAX_CORDONED, metavar="N",
                   help=f"nodes the job state's cordon list holds at most, slot holders apart; past it a node that "
                        f"must be kept out is refused membership (default {MAX_CORDONED}, the most with an etcd "
                        "store, whose request limit the state record must fit)")
    p.add_argument("--failslow-action", choices=["report", "replace"], default="report",
                   help="straggler nodes: report them, or replace them with a spare when that pays (default report)")
    p.add_argument("--failslow-ratio", type=float, default=1.3, metavar="X",
                   help="a rank whose own work per step is X times the others' median is slow (default 1.3)")
    p.add_argument("--failslow-horizon", type=float, default=3600.0, metavar="S",
                   help="seconds over which a replacement's saving is projected (default 3600)")
    p.add_argument("--failslow-cooldown", type=float, default=300.0, metavar="S",
                   help="at least this long between two straggler replacements (default 300)")
    p.add_argument("--port-file", default=None, help="write the bound port to this file once serving")
    p.add_argument("--exit-when-done", action="store_true",
                   help="exit once the job succeeded (0) or failed (1) and every node was told")
    from trainguard.recovery.deploy_cli import add_coordinator_deploy_arguments

    add_coordinator_deploy_arguments(p)  # TLS, token, /metrics, health port, cordon hooks
    p.set_defaults(handler=handle_coordinator)
    from trainguard.recovery.uncordon_cli import register as register_uncordon

    register_uncordon(sub)  # the operator's `trainguard uncordon NODE` against a running coordinator


def coordinator_spec(args: argparse.Namespace) -> JobSpec:
    """The job spec ``trainguard coordinator`` serves, from its parsed flags.

    ``--nnodes MIN:MAX`` allows shrinking down to MIN unless ``--no-allow-shrink`` says otherwise, as the
    coordinator ``trainguard run --nnodes MIN:MAX`` embeds does: the same range failed the job at the first lost
    node without a spare here, and shrank and continued there. With a fixed ``--nnodes N``, ``--allow-shrink``
    needs a ``--min-nodes`` below N (the default floor is N itself, so it never shrank, without a word).

    Raises:
        UsageError: bad or contradictory flags.
    """
    from trainguard.agent.run_torchrun import parse_nnodes
    from trainguard.recovery.spec import JobSpec
    from trainguard.recovery.straggler import StragglerConfig

    if not args.failslow_ratio > 1 or not args.failslow_horizon > 0 or args.failslow_cooldown < 0:
        raise UsageError(f"--failslow-ratio {args.failslow_ratio} must be > 1, --failslow-horizon "
                         f"{args.failslow_horizon} > 0 and --failslow-cooldown {args.failslow_cooldown} >= 0")
    lo, hi = parse_nnodes(args.nnodes)
    if not (args.last_call_timeout >= 0 and args.last_call_timeout < float("inf")):
        raise UsageError(f"--last-call-timeout {args.last_call_timeout}: expected seconds >= 0")
    shrink = hi > lo if args.allow_shrink is None else args.allow_shrink
    if args.allow_shrink and hi == lo and args.min_nodes in (0, lo):
        raise UsageError(f"--allow-shrink with --nnodes {args.nnodes} never shrinks: the job shrinks down to "
                         f"--min-nodes, which is {lo} too; give --min-nodes M (1 <= M < {lo}), or --nnodes M:{lo} "
                         f"(which also lets the first generation start with M nodes)")
    return JobSpec(job=args.job, nnodes=lo, max_nodes=hi, last_call_s=args.last_call_timeout,
                   max_restarts=args.max_restarts,
                   heartbeat_interval_s=args.heartbeat_interval, group_size=args.group_size,
                   allow_shrink=shrink, min_nodes=args.min_nodes, lease_timeout_s=args.lease_timeout,
                   backoff_initial_s=args.backoff, max_heartbeat_rate=args.max_heartbeat_rate,
                   repeat_window_s=args.repeat_window, membership_timeout_s=args.membership_timeout,
                   store=args.store or default_store(args.job), memory_replicas=args.memory_replicas,
                   max_cordoned=args.max_cordoned,
                   failslow=StragglerConfig(action=args.failslow_action, slow_ratio=args.failslow_ratio,
                                            clear_ratio=min(1.1, (1.0 + args.failslow_ratio) / 2),
                                            horizon_s=args.failslow_horizon, cooldown_s=args.failslow_cooldown))


def handle_coordinator(args: argparse.Namespace) -> int:
    """Runs the coordinator until SIGTERM/SIGINT (or the job's end with ``--exit-when-done``).

    Returns:
        0 on a clean stop or job success, 1 when the job failed, 3 when another coordinator took the job over.

    Raises:
        UsageError: bad flags, unusable store or address.
    """
    from trainguard.errors import ConfigError
    from trainguard.recovery.deploy_cli import coordinator_security, start_coordinator_extras
    from trainguard.recovery.errors import RecoveryError
    from trainguard.recovery.durability import DURABLE_WAIT_S
    from trainguard.recovery.policy import Phase
    from trainguard.recovery.service import CoordinatorServer

    spec = coordinator_spec(args)
    try:
        if spec.store.startswith("sqlite://") and not args.store:
            Path(spec.store[len("sqlite://"):]).parent.mkdir(parents=True, exist_ok=True)
        security = coordinator_security(args)
        server = CoordinatorServer(spec, listen=args.listen, security=security)
    except (RecoveryError, ConfigError, OSError) as exc:
        raise UsageError(f"cannot start the coordinator: {exc}") from exc
    try:
        extras = start_coordinator_extras(args, server)
    except BaseException:
        server.stop(0)
        raise
    server.start()
    if args.port_file:
        tmp = args.port_file + ".tmp"
        try:
            Path(tmp).write_text(str(server.port))
            os.replace(tmp, args.port_file)
        except OSError as exc:
            # A folder it may not write (or none) was a PermissionError traceback with the server left serving
            # until the interpreter ended; whoever reads the file would wait for it forever.
            extras.stop()
            server.stop(0)
            raise UsageError(f"--port-file {args.port_file}: cannot write it ({exc.strerror or exc}); pick a "
                             "writable path") from exc
    log.info("coordinator for job %r serving on %s:%d (%s), store %s (fence epoch %d)%s", spec.job, server.host,
             server.port, security.describe(), spec.store, server.core.fence.epoch,
             "".join("; " + n for n in extras.notes))
    if not security.token and not security.tls.ca_file and server.host not in ("127.0.0.1", "localhost", "[::1]"):
        log.warning("anyone who reaches %s:%d can order restarts and drains of job %r: set a job token "
                    "($TRAINGUARD_JOB_TOKEN_FILE) and/or mutual TLS (--tls-client-ca)", server.host, server.port,
                    spec.job)
    print(f"trainguard: coordinator for job {spec.job!r} listening on {server.host}:{server.port}", file=sys.stderr,
          flush=True)
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    code = 0
    done_since = None
    try:
        while not stop.wait(0.2):
            core = server.core
            if core.fenced:
                print(f"trainguard: error: {core.fenced}", file=sys.stderr)
                code = 3
                break
            phase = core.state.phase
            if args.exit_when_done and phase in (Phase.SUCCEEDED, Phase.FAILED):
                # Every live node learns the outcome before the coordinator goes away: told once the outcome is
                # durable (a node gone meanwhile is lost within a lease). A fixed 3 heartbeats left nodes untold
                # whenever the store took longer than that to write the outcome.
                done_since = done_since or time.monotonic()
                waited = time.monotonic() - done_since
                # A job that had ended before this coordinator started: the nodes started with it (--nnodes of
                # them, or as many as come within the bound below) are told why nothing runs and how to run it
                # again before it goes. It exited at once, and they waited out their join timeout against a
                # closed port ("unreachable"); under a supervisor, a restart loop.
                unheard = core.ended_before_start() and core.told_of_end() < spec.nnodes
                if (not unheard and not core.not_told_of_end()) or waited > spec.lease_timeout_s + DURABLE_WAIT_S:
                    code = 0 if phase is Phase.SUCCEEDED else 1
                    print(f"trainguard: job {spec.job} {phase.name.lower()}: {core.state.message}", file=sys.stderr)
                    break
    finally:
        if received:
            # Said, as the node agent says it: a log that just ended read the same as a crash.
            log.info("coordinator for job %s stopping (%s, phase %s)", spec.job, received[0],
                     server.core.state.phase.name.lower())
        extras.stop()
        server.stop(1.0)
        if received:
            log.info("coordinator for job %s stopped", spec.job)
    return code

"""``trainguard run``: launch a training script on this node under trainguard.

Without ``--coordinator`` it embeds the job's coordinator (single-node jobs, or the first node of a small job
with ``--nnodes``); with it, the node joins a coordinator running elsewhere. Either way the node agent spawns the
workers with torchrun's environment, restarts every rank in a new generation when one fails, and prints the
failure timeline at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

from trainguard.agent.errors import JobFailedError
from trainguard.agent.guard import guard
from trainguard.agent.node import FaultPlan, FaultRecord, NodeAgent, NodeConfig, install_signal_handlers
from trainguard.agent.workers import python_argv
from trainguard.errors import UsageError

log = logging.getLogger(__name__)


def parse_fault(text: str) -> FaultPlan:
    """Parses ``RANK:STEP[:SIGNAL[:GENERATION]]`` (e.g. ``1:57:KILL``) into a :class:`FaultPlan`.

    Raises:
        UsageError: malformed text or unknown signal.
    """
    parts = text.split(":")
    if len(parts) < 2 or len(parts) > 4:
        raise UsageError(f"--fault {text!r}: expected RANK:STEP[:SIGNAL[:GENERATION]], e.g. 1:57:KILL")
    try:
        rank, step = int(parts[0]), int(parts[1])
        generation = int(parts[3]) if len(parts) == 4 else 1
    except ValueError:
        raise UsageError(f"--fault {text!r}: RANK, STEP and GENERATION must be integers") from None
    sig = signal.SIGKILL
    if len(parts) >= 3 and parts[2]:
        name = parts[2].upper()
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise UsageError(f"--fault {text!r}: unknown signal {parts[2]!r}") from None
    if rank < 0 or step < 0 or generation < 1:
        raise UsageError(f"--fault {text!r}: rank and step must be >= 0, generation >= 1")
    return FaultPlan(rank=rank, step=step, sig=sig, generation=generation)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the ``trainguard run`` flags to ``p``."""
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers on this node (default 1)")
    p.add_argument("--max-restarts", type=int, default=3, help="job-wide restart budget (default 3)")
    p.add_argument("--job", default=None, help="job name (default: script name + time)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="checkpoint directory or fsspec URL given to every worker as $TRAINGUARD_CHECKPOINT_DIR")
    p.add_argument("--log-dir", default=None, help="write each rank's output to LOG_DIR/rank<R>.log")
    p.add_argument("--fault", action="append", default=[], metavar="RANK:STEP[:SIGNAL[:GEN]]",
                   help="inject a fault: send SIGNAL (default KILL) to RANK once it reports STEP (repeatable)")
    g = p.add_argument_group("multi-node")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="join this coordinator instead of embedding one")
    g.add_argument("--nnodes", type=int, default=1, help="nodes the embedded coordinator waits for (default 1)")
    g.add_argument("--coordinator-listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the embedded coordinator listens (default 127.0.0.1:0)")
    g.add_argument("--node-id", default=None, help="stable node identity (default: host name)")
    g.add_argument("--pod", default="", help="pod / supernode id of this node")
    g.add_argument("--node-index", type=int, default=0, help="index of this node inside its pod")
    g.add_argument("--host", default=None, help="host name used for rank ordering (default: host name)")
    g.add_argument("--address", default="127.0.0.1", help="address peers reach this node at (default 127.0.0.1)")
    g.add_argument("--spare", action="store_true", help="join as a spare node")
    p.add_argument("--hang-floor-s", type=float, default=60.0,
                   help="a worker with no step for max(this, 5x its slowest recent step) seconds is hung (default 60)")
    p.add_argument("--detectors", default="process",
                   help="comma-separated detectors the agent runs (default: process; see `trainguard detect`)")
    p.add_argument("--no-standby", dest="standby", action="store_false",
                   help="do not keep warm standby worker processes (slower restarts, less memory)")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


@dataclass
class RunResult:
    """What a finished ``trainguard run`` reports."""

    exit_code: int
    message: str
    faults: list[FaultRecord]
    generations: int
    wall_s: float


def _check_checkpoint_dir(path: str) -> None:
    if "://" in path and not path.startswith("file://"):
        return  # remote URLs are checked by the checkpointer in each worker
    local = path[len("file://"):] if path.startswith("file://") else path
    try:
        os.makedirs(local, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=local, prefix=".tg-probe-", delete=True)
        probe.close()
    except OSError as exc:
        raise UsageError(f"checkpoint directory {local!r} is not writable: {exc.strerror or exc}; "
                         "pick another --checkpoint-dir or fix its permissions") from exc


def run_job(args: argparse.Namespace) -> RunResult:
    """Runs the job described by parsed ``trainguard run`` arguments on this node.

    Raises:
        UsageError: bad arguments (missing script, bad counts, unwritable checkpoint directory).
    """
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {args.nproc_per_node}")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.hang_floor_s <= 0:
        raise UsageError(f"--hang-floor-s must be > 0, got {args.hang_floor_s}")
    if args.nnodes < 1:
        raise UsageError(f"--nnodes must be >= 1, got {args.nnodes}")
    if not args.module and not os.path.isfile(args.script):
        raise UsageError(f"training script not found: {args.script}")
    faults = [parse_fault(f) for f in args.fault]
    if args.checkpoint_dir:
        _check_checkpoint_dir(args.checkpoint_dir)
    job = args.job or f"{os.path.splitext(os.path.basename(args.script))[0]}-{int(time.time())}"

    server = None
    coordinator = args.coordinator
    if coordinator is None:
        from trainguard.recovery import CoordinatorServer, JobSpec

        server = CoordinatorServer(
            JobSpec(job=job, nnodes=args.nnodes, max_restarts=args.max_restarts, heartbeat_interval_s=0.2),
            listen=args.coordinator_listen,
        ).start()
        coordinator = server.target
        if args.nnodes > 1:
            print(f"trainguard: coordinator for job {job!r} listening on {server.target}", file=sys.stderr)

    rundir = tempfile.mkdtemp(prefix="tg-")
    extra_env = {}
    ckpt_service = None
    if args.checkpoint_dir:
        extra_env["TRAINGUARD_CHECKPOINT_DIR"] = os.path.abspath(args.checkpoint_dir) \
            if "://" not in args.checkpoint_dir else args.checkpoint_dir
        # The agent owns the job's persist process and shared-memory tier, so both outlive crashed workers:
        # a restarted worker restores from memory, and the dead worker's last snapshot still gets persisted.
        from trainguard.checkpoint.config import CHECKPOINT_SERVICE_ENV
        from trainguard.checkpoint.service import CheckpointService

        ckpt_service = CheckpointService(job=job, socket_path=os.path.join(rundir, "ckpt.sock")).start()
        guard().watch(ckpt_service.pid)
        extra_env[CHECKPOINT_SERVICE_ENV] = ckpt_service.address
    config = NodeConfig(
        job=job,
        coordinator=coordinator,
        argv=python_argv(args.script, args.script_args, module=args.module),
        nproc_per_node=args.nproc_per_node,
        node_id=args.node_id or socket.gethostname(),
        pod_id=args.pod,
        node_index=args.node_index,
        host=args.host or socket.gethostname(),
        address=args.address,
        spare=args.spare,
        max_restarts=args.max_restarts,
        socket_path=os.path.join(rundir, "agent.sock"),
        log_dir=args.log_dir,
        extra_env=extra_env,
        standby=args.standby,
        detectors=tuple(d for d in args.detectors.split(",") if d),
        detector_config={"process": {"hang_floor_s": args.hang_floor_s}} if "process" in args.detectors else {},
    )
    agent = NodeAgent(config, faults=faults)
    from trainguard.agent.local_server import serve

    grpc_server, _ = serve(agent, config.socket_path)
    restore = install_signal_handlers(agent)
    t0 = time.time()
    try:
        try:
            code = agent.run()
            message = agent.final_message or ("stopped by signal" if code == 130 else "")
        except JobFailedError as exc:
            code, message = 1, str(exc)
    finally:
        restore()
        grpc_server.stop(0.5).wait()
        if server is not None:
            server.stop()
        if ckpt_service is not None:
            pid = ckpt_service.pid
            ckpt_service.stop(remove_memory=True)
            guard().forget(pid)
        guard().close()
        shutil.rmtree(rundir, ignore_errors=True)
    return RunResult(exit_code=code, message=message, faults=agent.fault_records,
                     generations=max(agent.generation, 0), wall_s=time.time() - t0)


def format_summary(result: RunResult) -> str:
    """The end-of-run report: outcome, then one line per fault with its timeline."""
    lines = []
    status = {0: "succeeded", 130: "stopped"}.get(result.exit_code, "FAILED")
    lines.append(f"trainguard: job {status} after {result.wall_s:.1f}s, {result.generations} generation(s), "
                 f"{len(result.faults)} fault(s)" + (f": {result.message}" if result.message else ""))
    for i, f in enumerate(result.faults, 1):
        t_fault = f.injected_at or f.detected_at
        parts = [f"  fault {i}: generation {f.generation}, rank {f.rank} ended with {f.cause}"]
        parts.append(f"detected +{(f.detected_at - t_fault) * 1000:.0f} ms")
        if f.restarted_at:
            parts.append(f"restarted +{f.restarted_at - t_fault:.2f} s")
        if f.resumed_at is not None:
            parts.append(f"first step {f.resumed_step} +{f.recovery_s:.2f} s")
        lines.append(", ".join(parts))
    return "\n".join(lines)


def handle_run(args: argparse.Namespace) -> int:
    """``trainguard run`` handler."""
    result = run_job(args)
    print(format_summary(result), file=sys.stderr)
    return result.exit_code

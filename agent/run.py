"""``trainguard run``: launch a training script on this node under trainguard.

It takes torchrun's command line (see :mod:`trainguard.agent.run_torchrun` for how each flag maps): the node
either embeds the job's coordinator (``--standalone``, one node, or the node named by the rendezvous endpoint)
or joins one running elsewhere. Either way the node agent spawns the workers with torchrun's environment,
hosts each generation's store, restarts every rank in a new generation when one fails (the failed worker's
``@record`` error is the reason given), and prints the failure timeline at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainguard.agent.errors import JobFailedError
from trainguard.agent.guard import guard
from trainguard.agent.fault_records import FaultRecord
from trainguard.agent.node import NodeAgent, NodeConfig, handle_signals, install_signal_handlers
from trainguard.agent.run_args import flag_given, parse_fault
from trainguard.agent.qualify.cli import qualify_for_run
from trainguard.agent.run_detectors import run_detector_settings
from trainguard.errors import UsageError
from trainguard.checkpoint.location import CheckpointLocation
from trainguard.worker_env import CHECKPOINT_DIR_ENV, CHECKPOINT_SERVICE_ENV

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.agent.run_torchrun import Rendezvous
    from trainguard.drill.inject import FaultPlan

log = logging.getLogger(__name__)

#: Exit codes of a run stopped by a signal (128 + the signal: 129 SIGHUP, 130 SIGINT, 131 SIGQUIT, 143 SIGTERM, or
#: another of --signals-to-handle), reported as "stopped", not failed. A run's own codes are 0, 1 and 2 (usage):
#: only a handled signal gives one above 128. SIGHUP and SIGQUIT, handled by default, read "job FAILED".
STOPPED_CODES = frozenset(range(129, 129 + 64))


@dataclass
class RunResult:
    """What a finished ``trainguard run`` reports."""

    exit_code: int
    message: str
    faults: list[FaultRecord]
    generations: int
    wall_s: float


def _listening(host: str, port: int, dial: str) -> str:
    """Where an embedded coordinator listens, as bound: a wildcard bind said it listened on the loopback address
    this node dials, and an operator whose other nodes could not reach it concluded it was bound to loopback."""
    bare = host.strip("[]")
    if bare not in ("", "0.0.0.0", "::"):
        return f"listening on {dial}"
    bound = f"[{bare}]:{port}" if ":" in bare else f"{bare or '0.0.0.0'}:{port}"
    return f"listening on {bound} (every interface; this node dials {dial})"


def _refuse_a_second_job(job: str, script: str, checkpoint_dir: str | None, named: bool) -> None:
    """A one-node job's default name follows its checkpoint directory (so a rerun resumes it); a second live
    run under that name would restore from the first one's memory and then be refused every checkpoint (one
    writer per job and rank). So would a second one-node run given the same ``--job``/``--rdzv-id`` (``named``)
    whose workers write in the same shared-memory root: a host's in-memory tier is keyed by job name. Say so
    before anything starts.

    Raises:
        UsageError: a live ``trainguard run`` of this user already runs ``job``.
    """
    from trainguard.agent.job_registry import live_runs

    for rec in live_runs():
        if rec.job == job and rec.pid != os.getpid():
            if named:
                from trainguard.checkpoint.arena import live_writers
                from trainguard.checkpoint.config import MemoryTierConfig

                # Only where both would share one arena: runs given their own shm root (drills) are apart.
                shm = MemoryTierConfig().directory
                writers = live_writers(shm, job)
                if not writers:
                    continue
                raise UsageError(
                    f"job {job} is already running here as pid {rec.pid} and writes checkpoints in {shm} (pid "
                    f"{sorted(set(writers.values()))[0]}); runs on one host share their in-memory checkpoints by "
                    "job name, so this one could write none: give it another --job/--rdzv-id")
            raise UsageError(
                f"job {job} (the default name of {os.path.basename(script)} on --checkpoint-dir {checkpoint_dir}) "
                f"is already running here as pid {rec.pid}; a second trainer on the same checkpoint directory "
                "cannot write checkpoints: give it --job NAME or another --checkpoint-dir")


def _check_checkpoint_dir(path: str, flag: str = "--checkpoint-dir") -> None:
    from trainguard.checkpoint.config import check_durable_url
    from trainguard.checkpoint.errors import CheckpointConfigError

    try:
        location = CheckpointLocation.parse(path, flag)
        if not location.is_local:
            # memory:// or an unknown scheme failed every worker at trainguard.init, restart after restart, and
            # the run ended FAILED with only "exit code 1" in its summary.
            check_durable_url(location.url, flag)
        problem = location.check_writable()
    except CheckpointConfigError as exc:
        raise UsageError(str(exc)) from exc
    if problem is not None:
        raise UsageError(f"{problem}; pick another {flag} or fix its permissions")


def _refuse_url(path: str, flag: str, what: str) -> None:
    """Refuses a URL given to a flag that takes a local path: ``--log-dir s3://bucket/logs`` made a folder
    ``./s3:/bucket/logs`` under the working directory, and the run went on writing its logs there.

    Raises:
        UsageError: ``path`` has a ``scheme://`` prefix.
    """
    scheme, sep, _ = path.partition("://")
    if sep and scheme and "/" not in scheme:
        raise UsageError(f"{flag} {path}: a URL; give a local {what} path (it would be made as ./{scheme}:/... "
                         "under the working directory)")


def _check_log_dir(path: str) -> None:
    """Creates ``--log-dir`` now, as torchrun does at its start: made only when the first worker started, a path
    that cannot be a folder (under a file, on /proc) ended the run with a traceback after it had registered."""
    _refuse_url(path, "--log-dir", "folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--log-dir {path}: cannot create it ({exc.strerror or exc}); pick another folder") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"--log-dir {path}: not writable; pick another folder or fix its permissions")


def _check_metric_history(path: str) -> None:
    """Checks now that ``--metric-history`` can be written: opened only once the node had registered, a file in a
    folder the user may not write ended the run after the coordinator had formed a generation and counted the
    node lost (a restart spent), saying "move the file aside to start anew"."""
    _refuse_url(path, "--metric-history", "file")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--metric-history {path}: cannot create its folder {folder} ({exc.strerror or exc}); "
                         "pick a path in a writable folder") from exc
    if os.path.isdir(path):
        raise UsageError(f"--metric-history {path}: is a folder; give the SQLite file's path")
    # SQLite writes its -wal and -shm files beside the database, so the folder must be writable too.
    target, mode = (path, os.R_OK | os.W_OK) if os.path.exists(path) else (folder, os.W_OK | os.X_OK)
    if not os.access(target, mode) or not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--metric-history {path}: not writable (SQLite also writes beside it in {folder}); pick "
                         "another path or fix its permissions")


def _check_fault_ranks(args: argparse.Namespace, faults: list[FaultPlan], nproc: int, rdzv: Rendezvous) -> None:
    """Refuses a ``--fault`` naming a rank the job cannot have: it was never injected, silently.

    The job's ranks are known on one node (``--nproc-per-node``) and with ``--nnodes`` (at most MAX nodes of
    ``--nproc-per-node`` each); a node joining a coordinator without ``--nnodes`` learns the size from it.

    Raises:
        UsageError: a fault's rank is >= the world size, naming it.
    """
    if rdzv.coordinator is not None and not flag_given(args, "nnodes"):
        return  # joining a coordinator (--coordinator, a c10d endpoint another agent serves) without --nnodes:
        # the job's size is the coordinator's
    world = nproc * rdzv.max_nodes
    for plan, text in zip(faults, args.fault):
        if plan.rank >= world:
            how = (f"--nproc-per-node {nproc} on one node" if rdzv.max_nodes == 1
                   else f"at most {rdzv.max_nodes} nodes (--nnodes) x --nproc-per-node {nproc}")
            raise UsageError(f"--fault {text!r}: rank {plan.rank} does not exist: the world size is {world} ({how}), "
                             f"ranks 0..{world - 1}")


def _check_node_id(node_id: str) -> None:
    """Refuses a ``--node-id`` the coordinator would refuse at registration, by the coordinator's own rule, before
    anything starts (the embedded coordinator was up and the workers' setup under way when it failed).

    Raises:
        UsageError: the id is not a valid node id.
    """
    from trainguard.recovery.errors import InvalidRequestError
    from trainguard.recovery.service import check_node_id as coordinator_rule

    try:
        coordinator_rule("--node-id", node_id)
    except InvalidRequestError as exc:
        raise UsageError(f"{exc}; the coordinator refuses it") from exc


def run_job(args: argparse.Namespace) -> RunResult:
    """Runs the job described by parsed ``trainguard run`` arguments on this node.

    Raises:
        UsageError: bad arguments (missing script, bad counts, unwritable checkpoint or log directory).
        ConfigError: unknown detector, or an unusable ``--detector-config`` file.
    """
    from trainguard.agent import run_torchrun as tr
    from trainguard.agent.run_deploy import apply_slurm, run_security, start_run_extras

    # The store's torch import runs in a background thread (worker_store.preload); a job that ends before it
    # finishes would otherwise let torch's atexit hooks (FakeTensor cache stats) log at INFO through our root
    # logger before torch configured its own loggers. torch resets this from TORCH_LOGS once imported.
    logging.getLogger("torch").setLevel(logging.WARNING)
    apply_slurm(args)  # SLURM_* fill the flags left at their defaults (no-op outside Slurm)
    server_security, client_security = run_security(args)
    nproc = tr.resolve_nproc(args.nproc_per_node)
    from trainguard.recovery.spec import MAX_LOCAL_WORKERS, MAX_RESTARTS_LIMIT

    if nproc > MAX_LOCAL_WORKERS:  # the coordinator refused it at registration, naming a protobuf field
        raise UsageError(f"--nproc-per-node {args.nproc_per_node}: {nproc} worker processes on one node; at most "
                         f"{MAX_LOCAL_WORKERS}")
    if not 0 <= args.max_restarts <= MAX_RESTARTS_LIMIT:
        raise UsageError(f"--max-restarts must be 0..{MAX_RESTARTS_LIMIT}, got {args.max_restarts}")
    if args.hang_floor_s <= 0:
        raise UsageError(f"--hang-floor-s must be > 0, got {args.hang_floor_s}")
    if args.monitor_interval is not None and not args.monitor_interval > 0:
        raise UsageError(f"--monitor-interval must be > 0 seconds, got {args.monitor_interval}")
    if args.shutdown_timeout is not None and args.shutdown_timeout < 0:
        raise UsageError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if not args.predictor_interval_s > 0:
        raise UsageError(f"--predictor-interval-s must be > 0 seconds, got {args.predictor_interval_s}")
    if not args.drain_grace_s >= 0:
        raise UsageError(f"--drain-grace-s must be >= 0 seconds, got {args.drain_grace_s}")
    argv = tr.worker_command(args)
    streams = tr.stream_specs(args, nproc)
    signals = tr.parse_signals(args.signals_to_handle)
    rdzv = tr.resolve_rendezvous(args)
    node_index = args.node_index if args.node_index is not None else args.node_rank
    if not 0 <= node_index <= 2**31 - 1:  # an int32 on the wire: a larger one crashed the registration
        flag = "--node-index" if args.node_index is not None else "--node-rank"
        raise UsageError(f"{flag} {node_index}: expected 0..{2**31 - 1}")
    address = tr.default_address(rdzv, args.address or args.local_addr)
    for flag in tr.ignored_flags(args):
        log.warning("torchrun flag accepted but not applied: %s", flag)
    faults = [parse_fault(f) for f in args.fault]
    _check_fault_ranks(args, faults, nproc, rdzv)
    if args.node_id is not None:
        _check_node_id(args.node_id)
    if args.predictor_model and not os.path.isfile(args.predictor_model):
        raise UsageError(f"--predictor-model {args.predictor_model}: no such file")
    if args.predictor_model:
        # Loaded (and verified) now: loaded only once the node had registered, a corrupt or foreign file ended
        # the run after its coordinator had formed a generation and counted the node lost.
        from trainguard.predictor.errors import ModelFileError
        from trainguard.predictor.model import PredictorModel

        try:
            PredictorModel.load(args.predictor_model)
        except ModelFileError as exc:
            raise UsageError(f"--predictor-model: {exc}") from exc
    flag = "--checkpoint-dir"
    if args.checkpoint_dir is None and os.environ.get(CHECKPOINT_DIR_ENV, "").strip():
        # The workers inherit it, and the hook checkpoints there: named after the start time instead of this
        # directory, each relaunch of the same command was a new job that resumed nothing.
        args.checkpoint_dir = os.environ[CHECKPOINT_DIR_ENV].strip()
        flag = f"${CHECKPOINT_DIR_ENV}"
    if args.checkpoint_dir:
        _check_checkpoint_dir(args.checkpoint_dir, flag)
    if args.log_dir:
        _check_log_dir(args.log_dir)
    if args.metric_history:
        _check_metric_history(args.metric_history)
    detectors = tuple(d.strip() for d in args.detectors.split(",") if d.strip())
    detector_config = run_detector_settings(detectors, args.detector_config, args.hang_floor_s)
    qualify = qualify_for_run(args)  # [qualify] of --qualify-config (checked before anything starts)
    job = rdzv.job or tr.default_job_name(args.script, rdzv, time.time(), args.checkpoint_dir,
                                          module=args.module and not args.no_python)
    if not rdzv.endpoint and (not rdzv.job or args.checkpoint_dir):
        _refuse_a_second_job(job, args.script, args.checkpoint_dir, named=bool(rdzv.job))
    from trainguard.recovery.errors import InvalidRequestError
    from trainguard.recovery.straggler import StragglerConfig

    failslow = StragglerConfig(action=args.failslow_action, slow_ratio=args.failslow_ratio,
                               clear_ratio=min(1.1, (1.0 + args.failslow_ratio) / 2))
    try:
        failslow.validate()
    except InvalidRequestError as exc:
        raise UsageError(f"--failslow-ratio {args.failslow_ratio}: must be > 1") from exc

    server = None
    coordinator = rdzv.coordinator
    if coordinator is None:
        from trainguard.recovery import CoordinatorServer, JobSpec
        from trainguard.recovery.errors import CoordinatorError

        where = rdzv.bind or rdzv.listen
        if not rdzv.join_if_taken and where and not tr.port_free(where):
            # Said before gRPC tries: its own failure is a raw C++ log line on stderr ahead of ours.
            raise UsageError(f"cannot embed the coordinator on {rdzv.listen}: port {where.rpartition(':')[2]} is in "
                             "use by another process; pick another --rdzv-endpoint/--master-port or "
                             "--coordinator-listen")
        try:
            server = CoordinatorServer(
                # One node has nowhere else to go: a hardware fault restarts the job on it (the budget still
                # bounds it). --nnodes MIN:MAX: start on MIN to MAX (those there at the last call); later nodes
                # wait as standbys for lost ones.
                JobSpec(job=job, nnodes=rdzv.min_nodes, max_nodes=rdzv.max_nodes, last_call_s=rdzv.last_call_s,
                        max_restarts=args.max_restarts, heartbeat_interval_s=0.2,
                        hold_unhealthy=rdzv.max_nodes > 1, allow_shrink=rdzv.max_nodes > rdzv.min_nodes,
                        min_nodes=rdzv.min_nodes, failslow=failslow),
                listen=rdzv.bind or rdzv.listen, security=server_security,
            ).start()
        except CoordinatorError as exc:
            if not rdzv.join_if_taken:
                raise UsageError(f"cannot embed the coordinator on {rdzv.listen}: {exc}; pick another "
                                 "--rdzv-endpoint/--master-port or --coordinator-listen") from exc
            log.info("the coordinator's port %s is taken on this host: joining it", rdzv.listen)
            coordinator = rdzv.listen
        if server is not None:
            coordinator = tr.dial_target(server.target)
            if rdzv.multi_node:
                print(f"trainguard: coordinator for job {job!r} {_listening(server.host, server.port, coordinator)}",
                      file=sys.stderr)

    if server is None and getattr(args, "coordinator", None) and flag_given(args, "max_restarts"):
        # The budget is the job's, kept by its coordinator: a node's --max-restarts 4 ran "restart 1/3" (the
        # coordinator's default) without a word.
        from trainguard.agent.run_args import env_source

        source = env_source(args, "max_restarts")
        log.warning("--max-restarts %d%s is not this node's to set: the job's restart budget is the coordinator's "
                    "(`trainguard coordinator --max-restarts N`); its log and this node's say which applies",
                    args.max_restarts, f" (from ${source})" if source else "")
    node_id = args.node_id or tr.default_node_id(rdzv, None if server is not None else coordinator,
                                                 socket.gethostname(), os.getpid())
    # With a node daemon: its detectors, predictor and memory-tier keeper serve this job (only the worker
    # detectors run here); without one, this launcher runs them itself.
    from trainguard.agent.health_source import WORKER_DETECTORS, attach_daemon

    daemon = attach_daemon(job, coordinator, node_id, client_security, bool(args.checkpoint_dir))
    if daemon is not None:
        detectors = tuple(d for d in detectors if d in WORKER_DETECTORS)
        detector_config = {k: v for k, v in detector_config.items() if k in detectors}
    from trainguard.agent.rundir import make_rundir, reap_stale_rundirs, remove_rundir

    reap_stale_rundirs()  # folders of launchers that died by SIGKILL (they cannot remove their own)
    rundir = make_rundir()
    extra_env = {}
    ckpt_service = None
    if args.checkpoint_dir:
        extra_env[CHECKPOINT_DIR_ENV] = CheckpointLocation.parse(args.checkpoint_dir).for_workers()
        # The agent owns the job's persist process and shared-memory tier, so both outlive crashed workers:
        # a restarted worker restores from memory, and the dead worker's last snapshot still gets persisted.
        from trainguard.checkpoint.service import CheckpointService

        def _rewatch(old_pid: int, new_pid: int) -> None:
            guard().forget(old_pid)  # its group is gone, and group ids are reused
            guard().watch(new_pid)

        ckpt_service = CheckpointService(job=job, socket_path=os.path.join(rundir, "ckpt.sock"),
                                         on_restart=_rewatch).start()
        guard().watch(ckpt_service.pid)
        extra_env[CHECKPOINT_SERVICE_ENV] = ckpt_service.address
    config = NodeConfig(
        job=job,
        coordinator=coordinator,
        argv=argv,
        nproc_per_node=nproc,
        node_id=node_id,
        pod_id=args.pod,
        node_index=node_index,
        host=args.host or socket.gethostname(),
        address=address,
        spare=args.spare,
        max_restarts=args.max_restarts,
        socket_path=os.path.join(rundir, "agent.sock"),
        log_dir=args.log_dir,
        extra_env=extra_env,
        # One node with its own coordinator and no restart budget never starts a second generation: warm
        # standbys (each importing torch and torch._dynamo) would wait for a restart that cannot come.
        standby=args.standby and not (server is not None and not rdzv.multi_node and args.max_restarts == 0),
        detectors=detectors,
        detector_config=detector_config,
        predictor_model=args.predictor_model,
        history_path=args.metric_history,
        checkpoint_dir=args.checkpoint_dir,
        predictor_interval_s=args.predictor_interval_s,
        drain_grace_s=args.drain_grace_s,
        coordinator_patience_s=rdzv.join_timeout_s,
        coordinator_form_timeout_s=rdzv.form_timeout_s,
        role=args.role,
        job_by_start_time=not rdzv.job and not rdzv.endpoint and not args.checkpoint_dir,
        signals_to_handle=",".join(sig.name for sig in signals),
        streams=streams,
        error_dir=os.path.join(rundir, "errors"),
        virtual_local_rank=args.virtual_local_rank,
        **({"poll_s": args.monitor_interval} if args.monitor_interval is not None else {}),
        **({"stop_grace_s": float(args.shutdown_timeout)} if args.shutdown_timeout is not None else {}),
        coordinator_channel=client_security.channel,
        qualify=qualify,
        daemon=daemon,
        replica=replica_config(args, client_security.token),
        memory_tier=args.memory_tier,
    )
    from trainguard.agent.sdnotify import SystemdNotifier

    # Under systemd (a job unit of Type=notify) the launcher speaks sd_notify; workers never inherit the socket.
    hooks = []
    if faults:  # --fault: the drill's injector strikes the workers (the agent itself injects nothing)
        from trainguard.drill.inject import StepFaultInjector

        hooks.append(StepFaultInjector(faults))
    agent = NodeAgent(config, hooks=hooks, notifier=SystemdNotifier.from_env(unset=True))
    from trainguard.agent.local_server import serve

    grpc_server, _ = serve(agent, config.socket_path)
    restore = install_signal_handlers(agent, signals)
    t0 = time.monotonic()  # the job's wall time is a duration: no clock step in it
    extras = None
    code = None
    try:
        extras = start_run_extras(args, agent, config.socket_path, server)  # /metrics, health, status, linger
        try:
            code = agent.run()
            message = agent.final_message or ("stopped by signal" if code in STOPPED_CODES else "")
        except JobFailedError as exc:
            code, message = 1, str(exc)
    finally:
        # The cleanup keeps a handler until its end: with the default ones restored first, a second SIGTERM or
        # Ctrl-C while the coordinator, the local server and the persist process stopped killed the launcher
        # mid-way (exit -15, no summary, its run folder left behind). Logged once; the cleanup goes on.
        restore()
        restore = _hold_signals_during_cleanup(signals)
        if extras is not None:
            extras.stop()
        grpc_server.stop(0.5).wait()
        if server is not None:
            # extras.stop() kept it serving until every peer heard of the end (linger_until_peers_told). Lingering
            # here again waited 10 s more for a peer that had gone, and as long after a signal, when the job is
            # not over and every live peer counts as untold.
            server.stop()
        if daemon is not None:  # the job is over unless a signal stopped it: a restart finds its arena
            daemon.detach(ended=code in (0, 1))
            daemon.close()
        if ckpt_service is not None:
            pid = ckpt_service.pid
            ckpt_service.stop(remove_memory=daemon is None or code in (0, 1))
            guard().forget(pid)
        guard().close()
        remove_rundir(rundir)
        restore()
    return RunResult(exit_code=code, message=message, faults=agent.fault_records,
                     generations=max(agent.generation, 0), wall_s=time.monotonic() - t0)


def _hold_signals_during_cleanup(signals: Sequence[int]) -> Callable[[], None]:
    """Makes ``signals`` log once that the launcher is cleaning up, and do nothing else, until the returned
    function restores the handlers found (a launcher stopped mid-cleanup leaves its run folder and sockets)."""
    told = []

    def handler(signum: int, _frame: object) -> None:
        if not told:
            told.append(signum)
            log.warning("received %s while cleaning up: finishing the cleanup first (the coordinator, the "
                        "sockets, the run folder)", signal.Signals(signum).name)

    return handle_signals(signals, handler)


def replica_config(args: argparse.Namespace, token: str = ""):
    """The ``--replica-*`` flags as a validated :class:`~trainguard.agent.replica_agent.ReplicaConfig`; the
    replica servers demand the job ``token`` (the coordinator's) when there is one.

    Raises:
        UsageError: a value out of range (the message names the flag).
    """
    from trainguard.agent.replica_agent import ReplicaConfig, ReplicaConfigError

    cfg = ReplicaConfig(enabled=args.replica, bandwidth_mib_s=args.replica_bandwidth_mib_s,
                        memory_mib=args.replica_memory_mib, token=token)
    try:
        cfg.validate()
    except ReplicaConfigError as exc:
        raise UsageError(str(exc)) from exc
    return cfg


def _let_nodes_hear_the_end(server, own_node: str, patience_s: float = 10.0) -> None:
    """:func:`~trainguard.agent.run_deploy.linger_until_peers_told` under its former name (tests/recovery call
    it); :func:`run_job` lingers once, in ``RunExtras.stop``."""
    from trainguard.agent.run_deploy import linger_until_peers_told

    linger_until_peers_told(server, patience_s, own_node)


def format_summary(result: RunResult) -> str:
    """The end-of-run report: outcome, then one line per fault with its timeline."""
    lines = []
    status = "succeeded" if result.exit_code == 0 else "stopped" if result.exit_code in STOPPED_CODES else "FAILED"
    lines.append(f"trainguard: job {status} after {result.wall_s:.1f}s, {result.generations} generation(s), "
                 f"{len(result.faults)} fault(s)" + (f": {result.message}" if result.message else ""))
    for i, f in enumerate(result.faults, 1):
        t_fault = f.injected_at or f.detected_at
        at = f" at step {f.step}" if f.step is not None else ""
        if f.hang:
            # The rank found silent first is often one waiting for the stuck one (in its all-reduce): the headline
            # named it, and the stuck rank came last, as "hang localised to ..." (black-box review).
            parts = [f"  fault {i}: generation {f.generation}, a hang localised to {f.hang}, found when {f.cause}{at}"]
        else:
            parts = [f"  fault {i}: generation {f.generation}, rank {f.rank} ended with {f.cause}{at}"]
        parts.append(f"detected +{(f.detected_at - t_fault) * 1000:.0f} ms")
        if f.restarted_at:
            parts.append(f"restarted +{f.restarted_at - t_fault:.2f} s")
        if f.resumed_at is not None:
            parts.append(f"first step {f.resumed_step} +{f.recovery_s:.2f} s")
        if f.hardware:
            parts.append(f"node fault {f.hardware}")
        lines.append(", ".join(parts))
    return "\n".join(lines)


def summary_record(result: RunResult) -> dict:
    """The end-of-run report as one JSON-ready object (``--log-format json``): the same facts as
    :func:`format_summary`, times in seconds relative to each fault."""
    faults = []
    for f in result.faults:
        t_fault = f.injected_at or f.detected_at
        faults.append({
            "generation": f.generation, "rank": f.rank, "cause": f.cause, "step": f.step, "error": f.error,
            "detected_after_s": round(f.detected_at - t_fault, 4),
            "restarted_after_s": round(f.restarted_at - t_fault, 4) if f.restarted_at else None,
            "first_step": f.resumed_step if f.resumed_at is not None else None,
            "first_step_after_s": round(f.recovery_s, 4) if f.resumed_at is not None else None,
            "node_fault": f.hardware, "hang_localised": f.hang})
    # Shaped like the JSON log records around it (ts, level, logger, msg: the summary's first text line), plus
    # the structured fields.
    stopped = result.exit_code in STOPPED_CODES
    return {"ts": time.time(), "level": "info" if result.exit_code == 0 or stopped else "error",
            "logger": "trainguard.run", "msg": format_summary(result).splitlines()[0],
            "event": "run.summary",
            "status": "succeeded" if result.exit_code == 0 else "stopped" if stopped else "failed",
            "exit_code": result.exit_code, "wall_s": round(result.wall_s, 3), "generations": result.generations,
            "message": result.message, "faults": faults}


def handle_run(args: argparse.Namespace) -> int:
    """``trainguard run`` handler: runs the job, then prints its summary (one JSON object with
    ``--log-format json``, else text lines)."""
    from trainguard.cli_support import chosen_log_format

    from trainguard.agent.run_args import name_env_source

    try:
        result = run_job(args)
    except UsageError as exc:
        raise name_env_source(exc, args) from exc
    if chosen_log_format(args) == "json":
        import json

        print(json.dumps(summary_record(result), sort_keys=True), file=sys.stderr)
    else:
        print(format_summary(result), file=sys.stderr)
    return result.exit_code

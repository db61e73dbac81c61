"""What the node daemon does for coordinators and jobs: one health reporter per coordinator, the attached jobs'
launchers, and the kept memory-tier arenas.

Coordinators come from the daemon's configuration (``[coordinator]``, reported to for the daemon's whole life)
or from a job ``trainguard run`` attached (``AttachJob``: reported to while a launcher of the job lives). A job
whose launchers all died without ``DetachJob`` (SIGKILL) stops being reported to; its arena is aged by the
:class:`~trainguard.agent.arena_keeper.ArenaKeeper`. See :mod:`trainguard.agent.coordinator_report` for the
verdict and the reporters' states.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass

from trainguard.agent.arena_keeper import ArenaKeeper
from trainguard.agent.coordinator_report import CoordinatorReporter, NodeVerdict, ReporterState, ReportTarget
from trainguard.agent.pids import pid_alive
from trainguard.agent.tls import TlsFiles
from trainguard.proto import agent_pb2
from trainguard.recovery.rpc_security import RpcSecurity, SecurityConfigError
from trainguard.recovery.spec import JOB_NAME_RE

log = logging.getLogger(__name__)

_UP = (ReporterState.REPORTING, ReporterState.CORDONED)

#: Largest PEM file the daemon keeps for an attached job (as the launcher's limit).
MAX_PEM_BYTES = 1 << 20

#: Trailing-metadata key of an ``AttachJob`` refusal saying what was refused (``arena``: only the arena root, so
#: the launcher may attach again without it; ``held``: live launchers hold the job with another coordinator, so
#: the launcher may try again once they are gone).
REFUSED_METADATA_KEY = "trainguard-refused"


class JobTlsPathRefused(SecurityConfigError):
    """A launcher named a TLS file by path, outside the folders the daemon's config lets jobs name
    (``coordinator.job_tls_dirs``): the root daemon would open it on behalf of any socket user."""


class JobHeldElsewhere(Exception):
    """An ``AttachJob`` names another coordinator (address or TLS server name) for a job that live launchers of
    this node attached: accepted, it replaced the job's reporter, and the job's real coordinator no longer heard
    of this node's health while ``trainguard status`` still said "coordinator ok". Other credentials for the same
    coordinator are no conflict (each pod's own certificate, a rotated one)."""


@dataclass(frozen=True)
class Detached:
    """What a launcher's ``DetachJob`` did."""

    ignored: bool  #: it said the job ended but is not one of the job's live launchers
    arena_removed: bool
    summary: str  #: what happened, as logged


class DaemonJobs:
    """The daemon's reporters, attached jobs and kept arenas; thread-safe.

    Args:
        node_id: the daemon's ``agent.node_id``.
        host: this host's name (the scheduler's node name).
        instance: random id of the daemon process.
        verdict: the node's verdict now.
        arenas: the keeper of the jobs' arenas.
        interval_s: seconds between reports (``coordinator.heartbeat_interval_s``).
        timeout_s: deadline of each report (``coordinator.timeout_s``).
        alive: whether a launcher still lives, by its key (:func:`launcher_key`). Default: by pid.
        tls_dirs: folders whose files a launcher may name by path instead of sending their contents
            (``coordinator.job_tls_dirs``). Default: none.
    """

    def __init__(self, node_id: str, host: str, instance: str, verdict: Callable[[], NodeVerdict],
                 arenas: ArenaKeeper, interval_s: float, timeout_s: float,
                 alive: Callable[[int | str], bool] = pid_alive, tls_dirs: tuple[str, ...] = ()) -> None:
        self.node_id, self.host, self.instance = node_id, host, instance
        self._verdict = verdict
        self.arenas = arenas
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._lock = threading.Lock()
        self._reporters: dict[str, CoordinatorReporter] = {}
        self._alive = alive
        self.tls_dirs = tuple(os.path.realpath(d) for d in tls_dirs)
        self._pem_root: str | None = None  # the attached jobs' TLS files, as their launchers sent them
        self._jobs: dict[str, set[int | str]] = {}  # job -> its live launchers' keys
        self._targets: dict[str, tuple[str, str]] = {}  # job -> where its reporter reports (address, server name)
        # One attach, leave or sweep at a time: a leave that found no launcher left and then removed the job's
        # reporter and target raced an attach between the two, which stayed with neither (and then any
        # coordinator was taken for the job).
        self._serial = threading.RLock()
        # The configured coordinators as started: addresses, job, security, and what their files held.
        self._configured: tuple[list[str], str, RpcSecurity | None, bytes] = ([], "", None, b"")

    # -- reporters ------------------------------------------------------------------------------------------
    def add_reporter(self, key: str, target: ReportTarget) -> CoordinatorReporter:
        """Starts reporting to ``target`` under ``key`` (replacing a reporter with the same key).

        Raises:
            SecurityConfigError: a TLS file of the target is unreadable.
        """
        reporter, old = self._swap_reporter(key, target)
        if old is not None:
            old.stop()
        return reporter

    def _swap_reporter(self, key: str, target: ReportTarget) -> tuple[CoordinatorReporter, CoordinatorReporter | None]:
        """Starts a reporter to ``target`` under ``key``; returns it and the one it replaced (not stopped yet: a
        stop waits up to its report's deadline, which the caller does outside its locks)."""
        reporter = CoordinatorReporter(target, self._verdict, self.node_id, self.host, self.instance,
                                       interval_s=self.interval_s, timeout_s=self.timeout_s)
        reporter.start()
        with self._lock:
            old = self._reporters.pop(key, None)
            self._reporters[key] = reporter
        return reporter, old

    def remove_reporter(self, key: str) -> None:
        """Stops the reporter under ``key``, if any."""
        with self._lock:
            old = self._reporters.pop(key, None)
        if old is not None:
            old.stop()

    def reporters(self) -> list[CoordinatorReporter]:
        """Every running reporter."""
        with self._lock:
            return list(self._reporters.values())

    def start_configured(self, targets: list[str], job: str, security: RpcSecurity) -> None:
        """Starts one reporter per configured coordinator.

        Raises:
            SecurityConfigError: a TLS file is unreadable.
        """
        for address in targets:
            self.add_reporter(f"config:{address}", ReportTarget(address, job=job, security=security))
        self._configured = (list(targets), job, security, _fingerprint(security))
        if targets:
            log.info("reporting node health to %d coordinator(s): %s", len(targets), ", ".join(targets))

    def reload_configured(self, security: RpcSecurity) -> bool:
        """Re-reads the configured coordinators' TLS files and token (a reload): when their contents changed (a
        rotated client certificate), the reporters start over with them; the addresses stay as started.

        Returns:
            True when the reporters were restarted.

        Raises:
            SecurityConfigError: a TLS file is unreadable or malformed (the running reporters are kept).
        """
        targets, job, _, fingerprint = self._configured
        new = _fingerprint(security)
        if not targets or new == fingerprint:
            return False
        for address in targets:  # a bad file raises at the first, before any reporter was replaced
            self.add_reporter(f"config:{address}", ReportTarget(address, job=job, security=security))
        self._configured = (targets, job, security, new)
        log.info("coordinators' TLS files or token changed: reporting to %s with them", ", ".join(targets))
        return True

    def poke(self) -> None:
        """Every reporter reports now (the verdict changed)."""
        for reporter in self.reporters():
            reporter.poke()

    def set_timing(self, interval_s: float, timeout_s: float) -> None:
        """Applies reloaded report settings to every reporter."""
        self.interval_s, self.timeout_s = interval_s, timeout_s
        for reporter in self.reporters():
            reporter.set_timing(interval_s, timeout_s)

    def configured_ok(self) -> bool:
        """Whether every configured coordinator answers (attached jobs' coordinators come and go)."""
        with self._lock:
            configured = [r for k, r in self._reporters.items() if k.startswith("config:")]
        return all(r.state in _UP for r in configured)

    def configured_problems(self) -> list[str]:
        """``ADDRESS: state: why`` of each configured coordinator that does not take this node's reports (empty
        when :meth:`configured_ok`)."""
        with self._lock:
            configured = [r for k, r in self._reporters.items() if k.startswith("config:")]
        return [f"{r.target.address}: {r.state.value}" + (f": {r.message}" if r.message else "")
                for r in configured if r.state not in _UP]

    def summary(self) -> str:
        """``coordinators U/N reporting`` for the status line ("" when there are none)."""
        reporters = self.reporters()
        up = sum(1 for r in reporters if r.state in _UP)
        return f"coordinators {up}/{len(reporters)} reporting" if reporters else ""

    # -- jobs ----------------------------------------------------------------------------------------------
    def attach(self, req: agent_pb2.AttachJobRequest) -> agent_pb2.AttachJobResponse:
        """A launcher attaches its job: report to its coordinator, keep its arena (see ``AttachJob``).

        Raises:
            ArenaRootError: the launcher's arena root is not ``memory_tier.root``.
            JobHeldElsewhere: live launchers of the job attached with another coordinator, token or TLS files.
            JobTlsPathRefused: a TLS file named by path lies outside ``tls_dirs``.
            SecurityConfigError: a TLS file of the job's coordinator is unreadable.
        """
        replaced: list[CoordinatorReporter] = []
        try:
            with self._serial:
                return self._attach(req, replaced)
        finally:
            for old in replaced:  # outside the lock: a stop waits up to a report's deadline (7 s by default)
                old.stop()

    def _attach(self, req: agent_pb2.AttachJobRequest,
                replaced: list[CoordinatorReporter]) -> agent_pb2.AttachJobResponse:
        key = launcher_key(req)
        target = (req.coordinator, req.tls_server_name)
        if req.coordinator:
            self._check_target(req, key, target)
        kept = self.arenas.attach(req.job, req.arena_root, key) if req.arena_root else False
        if req.coordinator:
            try:
                security = self._job_security(req)
                _, old = self._swap_reporter(f"job:{req.job}", ReportTarget(
                    req.coordinator, job=req.job, node_id=req.node_id, security=security, origin=f"job {req.job}"))
                if old is not None:
                    replaced.append(old)
            except Exception:
                # Refused: the arena must not stay held for a launcher that is not attached and never detaches.
                if req.arena_root:
                    self.arenas.detach(req.job, key, ended=False)
                raise
        with self._lock:
            self._jobs.setdefault(req.job, set()).add(key)
            if req.coordinator:
                self._targets[req.job] = target
        log.info("job %s attached by launcher %s (coordinator %s, node %s%s)", req.job, describe_launcher(req),
                 req.coordinator or "none", req.node_id or self.node_id, ", arena kept" if kept else "")
        return agent_pb2.AttachJobResponse(node_id=self.node_id, arena_kept=kept, arena_ttl_s=self.arenas.ttl_s)

    def _check_target(self, req: agent_pb2.AttachJobRequest, key: int | str, target: tuple[str, str]) -> None:
        """Refuses a coordinator other than the one the job's other live launchers attached with (the same
        launcher attaching again, after a daemon restart, may name any).

        Raises:
            JobHeldElsewhere: live launchers of the job report to another coordinator address or server name.
        """
        with self._lock:
            held = self._targets.get(req.job)
            others = [k for k in self._jobs.get(req.job, ()) if k != key]
        if held is None or held == target:
            return
        live = [k for k in others if self._alive(k)]
        if not live:
            return
        named = f"coordinator {held[0]}" + (f" (TLS server name {held[1]})" if held[1] else "")
        asked = f"coordinator {req.coordinator[:128]}" + (f" (TLS server name {req.tls_server_name[:128]})"
                                             if req.tls_server_name else "")
        raise JobHeldElsewhere(f"job {req.job} is attached on this node by {len(live)} live launcher(s) reporting to "
                               f"{named}; this attachment names {asked}. One job's launchers on a node report to "
                               "one coordinator: a job started again under the same name attaches once the old "
                               "launchers are gone (trainguard run retries for a while); another job needs another "
                               "name (--rdzv-id / --job)")

    def _job_security(self, req: agent_pb2.AttachJobRequest) -> RpcSecurity:
        """The TLS and token the launcher reaches its coordinator with. PEM contents in the request are written
        to a folder only this daemon reads and used instead of the launcher's paths (which name files in the
        launcher's container). A path sent without contents is opened only under ``tls_dirs``.

        Raises:
            JobTlsPathRefused: a path sent without contents lies outside ``tls_dirs``.
            SecurityConfigError: a file cannot be written here, or a PEM is too large.
        """
        files = TlsFiles(req.tls_cert_file, req.tls_key_file, req.tls_ca_file)
        pems = (("ca.pem", req.tls_ca_pem), ("cert.pem", req.tls_cert_pem), ("key.pem", req.tls_key_pem))
        if any(data for _, data in pems):
            written: dict[str, str] = {}
            try:
                with self._lock:
                    if self._pem_root is None:
                        self._pem_root = tempfile.mkdtemp(prefix="trainguard-job-tls-")  # mode 0700
                folder = self._job_folder(req.job)
                os.makedirs(folder, mode=0o700, exist_ok=True)
                for name, data in pems:
                    if not data:
                        continue
                    if len(data) > MAX_PEM_BYTES:
                        raise SecurityConfigError(f"job {req.job}: its {name} is {len(data)} bytes; at most "
                                                  f"{MAX_PEM_BYTES}")
                    path = os.path.join(folder, name)
                    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
                    with os.fdopen(fd, "wb") as fh:
                        fh.write(data)
                    os.replace(path + ".tmp", path)
                    written[name] = path
            except OSError as exc:
                raise SecurityConfigError(f"job {req.job}: cannot keep its TLS files here ({exc})") from exc
            files = TlsFiles(written.get("cert.pem", files.cert_file), written.get("key.pem", files.key_file),
                             written.get("ca.pem", files.ca_file))
        files = TlsFiles(self._allowed(files.cert_file, "tls_cert_file", req.tls_cert_pem),
                         self._allowed(files.key_file, "tls_key_file", req.tls_key_pem),
                         self._allowed(files.ca_file, "tls_ca_file", req.tls_ca_pem))
        return RpcSecurity(tls=files, token=req.token, server_name=req.tls_server_name)

    def _allowed(self, path: str, field: str, pem: bytes) -> str:
        """``path`` resolved (what the reporter opens), when the launcher sent ``pem`` (then ``path`` is the
        daemon's own copy) or it lies under ``tls_dirs``.

        Raises:
            JobTlsPathRefused: a path sent without contents, outside ``tls_dirs``.
        """
        if not path or pem:
            return path
        # Resolved first: a symlink in a folder of the caller's must not lead the check into an allowed folder's
        # name while the open follows it elsewhere.
        real = os.path.realpath(path)
        if any(os.path.commonpath((real, d)) == d for d in self.tls_dirs):
            return real
        allowed = ", ".join(self.tls_dirs) or "none configured"
        raise JobTlsPathRefused(f"{field} {path[:256]!r}: this daemon opens a launcher's TLS file by path only under "
                                f"coordinator.job_tls_dirs ({allowed}); send its contents in "
                                f"{field.replace('_file', '_pem')} (trainguard run does) or add its folder to "
                                "coordinator.job_tls_dirs in the daemon's config")

    def _job_folder(self, job: str) -> str:
        """The folder of ``job``'s TLS files under the daemon's own 0700 folder.

        Raises:
            SecurityConfigError: ``job`` is not a job name, so not one plain path element.
        """
        if self._pem_root is None or not JOB_NAME_RE.match(job):
            raise SecurityConfigError(f"job {job[:64]!r} is not a job name")
        return os.path.join(self._pem_root, job)

    def _forget_pems(self, job: str) -> None:
        if self._pem_root is None or not JOB_NAME_RE.match(job):
            return  # nothing of a non-job-name was ever written, and rmtree must never leave the folder
        shutil.rmtree(self._job_folder(job), ignore_errors=True)

    def detach(self, job: str, key: int | str, ended: bool) -> bool:
        """Launcher ``key`` leaves ``job`` (``ended``: the job is over); returns whether the arena was removed."""
        return self.leave(job, key, ended).arena_removed

    def leave(self, job: str, key: int | str, ended: bool, launcher: str = "") -> Detached:
        """Launcher ``key`` (described as ``launcher`` in the log, by its key if unsaid) leaves ``job``
        (``ended``: the job is over), logged as attaching is.

        Returns:
            Whether the request was ignored, whether the job's arena was removed, and the line logged.
        """
        with self._serial:
            stale, left = self._leave(job, key, ended, launcher)
        if isinstance(stale, Detached):
            return stale
        # Outside the lock, so that no attach waits behind them: a reporter's stop (up to its report's deadline)
        # and the arena's removal.
        if stale is not None:
            stale.stop()
        who = launcher or str(key)
        removed = self.arenas.detach(job, key, ended)
        outcome = (("its arena removed" if removed else "no arena of it removed") if ended
                   else f"{left} launcher(s) of it left")
        summary = f"job {job} detached by launcher {who} (the job {'ended' if ended else 'goes on'}; {outcome})"
        log.info("%s", summary)
        return Detached(ignored=False, arena_removed=removed, summary=summary)

    def _leave(self, job: str, key: int | str, ended: bool,
               launcher: str) -> tuple[CoordinatorReporter | Detached | None, int]:
        """The job's state after ``key`` leaves: the refusal (a :class:`Detached`), or the job's reporter taken
        out when no launcher is left or the job ended (to stop), and how many launchers are left."""
        who = launcher or str(key)
        with self._lock:
            keys = self._jobs.get(job, set())
            if ended and key not in keys and keys:
                # Not one of the job's launchers while one lives: its coordinator's reports and TLS files stay
                # (the arena keeper refuses the same).
                summary = (f"launcher {who}, not one of job {job}'s, said the job ended; ignored while its launchers "
                           "live")
                log.warning("%s", summary)
                return Detached(ignored=True, arena_removed=False, summary=summary), 0
            keys.discard(key)
            left = len(keys)
            if not left:
                self._jobs.pop(job, None)
            stale = None
            if not left or ended:
                self._targets.pop(job, None)
                stale = self._reporters.pop(f"job:{job}", None)
        if not left or ended:
            self._forget_pems(job)
        return stale, left

    def sweep(self) -> None:
        """Forgets jobs whose launchers all died without detaching (SIGKILL); ages the kept arenas."""
        with self._serial:
            stale = self._sweep()
        for reporter in stale:  # outside the lock, as in leave()
            reporter.stop()
        self.arenas.sweep()

    def _sweep(self) -> list[CoordinatorReporter]:
        with self._lock:
            gone = []
            for job, keys in self._jobs.items():
                keys.intersection_update({k for k in keys if self._alive(k)})
                if not keys:
                    gone.append(job)
            stale = []
            for job in gone:
                del self._jobs[job]
                self._targets.pop(job, None)
                reporter = self._reporters.pop(f"job:{job}", None)
                if reporter is not None:
                    stale.append(reporter)
        for job in gone:
            log.warning("every launcher of job %s is gone without detaching; no more reports to its coordinator",
                        job)
            self._forget_pems(job)
        return stale

    def stop(self) -> None:
        """Stops every reporter and removes the jobs' TLS files."""
        with self._lock:
            keys = list(self._reporters)
        for key in keys:
            self.remove_reporter(key)
        if self._pem_root is not None:
            shutil.rmtree(self._pem_root, ignore_errors=True)


def _fingerprint(security: RpcSecurity) -> bytes:
    """What the coordinators' connection presents: the token and the TLS files' contents (a rotated file changes
    it; an unreadable one reads as empty, and the channel built from it says why)."""
    parts = [security.token.encode()]
    for path in (security.tls.ca_file, security.tls.cert_file, security.tls.key_file):
        try:
            with open(path, "rb") as fh:
                parts.append(hashlib.sha256(fh.read()).digest())
        except OSError:
            parts.append(b"")
    return b"\0".join(parts)


def launcher_key(req: agent_pb2.AttachJobRequest | agent_pb2.DetachJobRequest) -> int | str:
    """How the daemon knows a launcher: its lock file's name when it holds one (valid across pid namespaces),
    else its pid."""
    return req.launcher_lock or req.launcher_pid


def describe_launcher(req: agent_pb2.AttachJobRequest | agent_pb2.DetachJobRequest) -> str:
    """``pid 123`` or ``pid 1, lock job.1.ab12.lock`` for logs and events."""
    return f"pid {req.launcher_pid}" + (f", lock {req.launcher_lock}" if req.launcher_lock else "")


__all__ = ["DaemonJobs", "Detached", "JobTlsPathRefused", "REFUSED_METADATA_KEY", "describe_launcher", "launcher_key"]

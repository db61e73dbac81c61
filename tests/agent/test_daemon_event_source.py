"""The daemon-backed event source against a real daemon in this process (real gRPC over its unix socket): events
published after the attachment reach ``on_event`` (those before it never do), a daemon predictor alarm goes to
``on_alarm`` (the checkpoint-then-drain path), and a refused arena root still attaches the job without it."""

from __future__ import annotations

import threading
import time

import pytest

from trainguard.agent.agentd import AgentDaemon, config_loader
from trainguard.agent.health_source import DaemonEventSource, attach_daemon
from trainguard.agent.sdnotify import SystemdNotifier
from trainguard.detectors.events import Action, HealthEvent, Severity
from trainguard.recovery.rpc_security import RpcSecurity


@pytest.fixture
def daemon(tmp_path):
    (tmp_path / "fake").mkdir()
    shm = tmp_path / "shm"
    config = tmp_path / "agent.toml"
    config.write_text(f'[metrics]\nlisten = ""\n[grpc]\nlisten = ""\n[detectors]\nenabled = ["host"]\n'
                      f'root = "{tmp_path / "fake"}"\n[predictor]\nenabled = false\n[agent]\nloop_interval_s = 0.1\n'
                      f'[memory_tier]\nroot = "{shm}"\n')
    d = AgentDaemon(config_loader(str(config), None, str(tmp_path / "agent.sock"), str(tmp_path / "state")),
                    SystemdNotifier(None))
    d.start()
    loop = threading.Thread(target=d.run)
    loop.start()
    yield d, tmp_path
    d.request_stop()
    loop.join(20)


def _event(kind: str, action: Action = Action.WATCH, severity: Severity = Severity.WARNING) -> HealthEvent:
    return HealthEvent(source="pcie" if kind != "predictor.alarm" else "predictor", kind=kind, severity=severity,
                       action=action, message=f"{kind} happened")


def _wait(cond, what: str, timeout: float = 30.0) -> None:  # a daemon stop + start on a loaded 2-core CI box
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_events_since_the_attachment_and_the_daemons_alarm_take_their_paths(daemon, monkeypatch):
    d, tmp = daemon
    d._on_event(_event("pcie.link_narrow"))  # before the attachment: not this launcher's business
    time.sleep(0.05)
    monkeypatch.setenv("TRAINGUARD_AGENT_SOCKET_PATH", str(tmp / "agent.sock"))
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_SHM_DIR", str(tmp / "elsewhere"))  # not the daemon's root
    link = attach_daemon("j1", "", "node-a", RpcSecurity(), checkpointing=True)
    assert link is not None and link.attached is not None and not link.attached.arena_kept
    assert "j1" not in d.jobs.arenas.kept()  # the arena root was refused; the job is attached without it
    # An event between the attachment and the stream's start is replayed, not lost.
    d._on_event(_event("pcie.aer_fatal", Action.DRAIN_NODE, Severity.CRITICAL))
    events, alarms = [], []
    source = DaemonEventSource(link, on_alarm=alarms.append)
    source.start(events.append)
    try:
        d._on_event(_event("predictor.alarm", Action.DRAIN_NODE, Severity.CRITICAL))
        _wait(lambda: len(alarms) == 1 and len(events) >= 1, "the alarm and the fault")
        time.sleep(0.3)
        kinds = [e.kind for e in events]
        assert "pcie.link_narrow" not in kinds and kinds.count("pcie.aer_fatal") == 1, kinds
        assert alarms[0].kind == "predictor.alarm" and "predictor.alarm" not in kinds
    finally:
        source.stop()
        link.detach(ended=True)
        link.close()


def test_no_daemon_on_the_socket_means_running_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_AGENT_SOCKET_PATH", str(tmp_path / "absent.sock"))
    assert attach_daemon("j", "", "n", RpcSecurity(), checkpointing=False) is None
    monkeypatch.setenv("TRAINGUARD_AGENT_SOCKET_PATH", "")
    assert attach_daemon("j", "", "n", RpcSecurity(), checkpointing=False) is None


def test_a_tls_file_the_daemon_cannot_read_is_named_and_holds_no_arena(daemon, monkeypatch, caplog):
    from trainguard.agent.tls import TlsFiles

    d, tmp = daemon
    monkeypatch.setenv("TRAINGUARD_AGENT_SOCKET_PATH", str(tmp / "agent.sock"))
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_SHM_DIR", str(tmp / "shm"))  # the daemon's root: not the problem
    security = RpcSecurity(tls=TlsFiles(ca_file=str(tmp / "not-in-the-daemons-container.crt")))
    with caplog.at_level("WARNING", logger="trainguard.agent.health_source"):
        assert attach_daemon("j2", "127.0.0.1:1", "node-a", security, checkpointing=True) is None
    text = caplog.text
    # Named by path without its contents, outside coordinator.job_tls_dirs (none here): refused before the daemon
    # opens anything, naming the field, the file and both ways out.
    assert "tls_ca_file" in text and "not-in-the-daemons-container.crt" in text, text
    assert "tls_ca_pem" in text and "coordinator.job_tls_dirs" in text, text
    assert "keeps no arena" not in text, text  # the arena root was never the problem
    assert d.jobs.arenas.kept().get("j2") is None or not d.jobs.arenas.kept()["j2"].launchers
    assert not list((tmp / "launchers").glob("j2.*.lock"))  # the refused launcher dropped its lock


def test_the_daemon_reaches_a_jobs_mtls_coordinator_with_the_pems_the_launcher_sent(daemon, monkeypatch, tmp_path):
    """In Kubernetes the daemon runs in another container and cannot open the launcher's certificate paths: the
    launcher sends the PEM contents, the daemon keeps them in a folder of its own. The launcher's files are
    deleted right after the attachment, and the daemon still reports over mutual TLS with the job token."""
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from agent_testutil import make_pki

    from trainguard.agent.coordinator_report import ReporterState
    from trainguard.agent.tls import TlsFiles
    from trainguard.recovery import CoordinatorServer, JobSpec

    d, tmp = daemon
    pki = make_pki(tmp_path / "pki")
    token = "0123456789abcdef0123456789abcdef"
    server = CoordinatorServer(JobSpec(job="j4", nnodes=1, heartbeat_interval_s=0.2, store="memory://"),
                               listen="127.0.0.1:0",
                               security=RpcSecurity(TlsFiles(str(pki.server_cert), str(pki.server_key), str(pki.ca)),
                                                    token)).start()
    mine = tmp_path / "launcher-only"  # the files as only the launcher's container has them
    mine.mkdir()
    for f in (pki.ca, pki.client_cert, pki.client_key):
        shutil.copy(f, mine / f.name)
    monkeypatch.setenv("TRAINGUARD_AGENT_SOCKET_PATH", str(tmp / "agent.sock"))
    security = RpcSecurity(TlsFiles(str(mine / pki.client_cert.name), str(mine / pki.client_key.name),
                                    str(mine / pki.ca.name)), token, server_name="localhost")
    link = None
    try:
        link = attach_daemon("j4", server.target, "node-a", security, checkpointing=False)
        assert link is not None
        shutil.rmtree(mine)
        reporter = next(r for r in d.jobs.reporters() if r.target.job == "j4")
        assert not reporter.target.security.tls.ca_file.startswith(str(mine))  # the daemon's own copy
        assert oct(Path(reporter.target.security.tls.key_file).stat().st_mode & 0o777) == "0o600"
        _wait(lambda: reporter.state in (ReporterState.REPORTING, ReporterState.CORDONED), "a report over mTLS", 20)
        pem_dir = Path(reporter.target.security.tls.key_file).parent
    finally:
        if link is not None:
            link.detach(ended=True)
            link.close()
        server.stop(0)
    assert not pem_dir.exists()  # the job ended: its key is not kept


def test_a_restarted_daemon_is_attached_again_and_not_called_back_before_it_answers(daemon, monkeypatch):
    """While the daemon is down the launcher said, every retry, that it was "back ... (not attached)" (a
    reattach that found nobody), three lines a second; it is back when it answers, and then attached again."""
    import logging

    d, tmp = daemon
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # the daemon's start resets the root's
    logger = logging.getLogger("trainguard.agent.health_source")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    monkeypatch.setenv("TRAINGUARD_AGENT_SOCKET_PATH", str(tmp / "agent.sock"))
    link = attach_daemon("j1", "", "node-a", RpcSecurity(), checkpointing=False)
    assert link is not None
    source = DaemonEventSource(link, retry_s=0.05)
    source.start(lambda e: None)
    again = None
    try:
        d.request_stop()  # the daemon goes away under the job
        _wait(lambda: any("event stream ended" in m for m in lines), "the launcher to see the daemon gone")
        # Its state folder's lock is let go last, after the socket is removed: a start before that was refused
        # as a second agent on the folder (seen under load).
        _wait(lambda: not (tmp / "agent.sock").exists() and d._state_lock is None, "the daemon's stop")
        for _ in range(5):  # a few retry periods without a daemon
            time.sleep(0.05)
        assert not [m for m in lines if "is back" in m or "again failed" in m], lines
        again = AgentDaemon(d._load_config, SystemdNotifier(None))
        again.start()
        _wait(lambda: "j1" in again.jobs._jobs, "the job attached to the restarted daemon")
        _wait(lambda: any("is back; following its events again" in m for m in lines), "the launcher's log")
        assert not [m for m in lines if "(not attached)" in m], lines
    finally:
        logger.removeHandler(handler)
        source.stop()
        link.close()
        if again is not None:
            again.stop()


def test_a_launcher_outlives_the_daemons_runtime_folder(daemon, monkeypatch):
    """systemd removes RuntimeDirectory= (the socket's folder, with the launchers' lock files) when the daemon
    stops; the restarted daemon, not finding the lock named in the re-attachment, counted the live launcher dead
    at its first sweep and dropped its job (no reports to its coordinator, its arena orphaned)."""
    import shutil

    d, tmp = daemon
    monkeypatch.setenv("TRAINGUARD_AGENT_SOCKET_PATH", str(tmp / "agent.sock"))
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_SHM_DIR", str(tmp / "shm"))
    link = attach_daemon("j1", "", "node-a", RpcSecurity(), checkpointing=True)
    assert link is not None and link.lock is not None
    d.request_stop()
    _wait(lambda: not (tmp / "agent.sock").exists() and d._state_lock is None, "the daemon's stop")  # lock last
    shutil.rmtree(tmp / "launchers")  # as systemd does between stop and start
    again = AgentDaemon(d._load_config, SystemdNotifier(None))
    again.start()
    try:
        assert link.reattach()
        again.jobs.sweep()
        assert "j1" in again.jobs._jobs and again.jobs.arenas.kept()["j1"].state.name == "HELD"
    finally:
        link.close()
        again.stop()


def test_an_empty_shm_dir_variable_tells_the_daemon_the_default_arena_root():
    """Workers read an empty $TRAINGUARD_CHECKPOINT_SHM_DIR as the default root; the launcher told the daemon ""
    (no arena), so the daemon did not keep the job's arena across a launcher restart."""
    from trainguard.agent.health_source import launcher_arena_root
    from trainguard.checkpoint.config import CheckpointConfig

    for env in ({}, {"TRAINGUARD_CHECKPOINT_SHM_DIR": ""}):
        assert launcher_arena_root(env) == "/dev/shm/trainguard"
    assert launcher_arena_root({"TRAINGUARD_CHECKPOINT_SHM_DIR": "/mnt/shm"}) == "/mnt/shm"
    # the workers read a file:// URL as its path, so the daemon must be told that path, not "file:///mnt/shm"
    for url in ("file:///mnt/shm", "file:/mnt/shm"):
        assert launcher_arena_root({"TRAINGUARD_CHECKPOINT_SHM_DIR": url}) == "/mnt/shm"
        assert CheckpointConfig.from_dict({"directory": "/tmp/x", "memory": {"directory": url}}).memory.directory \
            == launcher_arena_root({"TRAINGUARD_CHECKPOINT_SHM_DIR": url})
    assert launcher_arena_root({"TRAINGUARD_CHECKPOINT_SHM_DIR": "s3://b/x"}) == "s3://b/x"  # workers refuse it
    import os

    assert CheckpointConfig.from_dict({"directory": "/tmp/x"}).memory.directory == launcher_arena_root(os.environ)


def test_a_launcher_refused_a_stream_for_the_daemons_limit_waits_for_a_slot_without_reattaching(tmp_path, monkeypatch):
    """More launchers (one per job on a node shared by small jobs) than the daemon's `grpc.max_watchers`: the one
    refused (RESOURCE_EXHAUSTED) took the refusal for a restarted daemon, and attached its job again every retry
    (each time replacing the daemon's reporter to its coordinator and announcing it to every other launcher),
    logging "event stream ended" / "is back" a pair a second, with nothing naming the limit. It now says once that
    the daemon's limit is reached and which setting raises it, and follows the events as soon as a slot frees."""
    import logging

    import grpc

    from trainguard.proto import agent_pb2, agent_pb2_grpc

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[metrics]\nlisten = ""\n[grpc]\nlisten = ""\nmax_workers = 2\nmax_watchers = 1\n'
                      f'[detectors]\nenabled = ["host"]\nroot = "{tmp_path / "fake"}"\n[predictor]\nenabled = false\n'
                      f'[agent]\nloop_interval_s = 0.1\n[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    d = AgentDaemon(config_loader(str(config), None, str(tmp_path / "agent.sock"), str(tmp_path / "state")),
                    SystemdNotifier(None))
    d.start()
    loop = threading.Thread(target=d.run)
    loop.start()
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # the daemon's start resets the root's
    logger = logging.getLogger("trainguard.agent.health_source")
    logger.addHandler(handler)
    monkeypatch.setattr(logger, "level", logging.INFO)
    channel = grpc.insecure_channel(f"unix:{tmp_path / 'agent.sock'}")
    link = source = None
    try:
        # Another launcher's stream holds the one slot: established once it has the replayed agent.started event.
        holder = agent_pb2_grpc.NodeAgentStub(channel).WatchEvents(agent_pb2.WatchEventsRequest(replay=5), timeout=60)
        holding = threading.Event()
        threading.Thread(target=_drain, args=(holder, holding), daemon=True).start()
        _wait(holding.is_set, "the other launcher's stream to hold the slot")
        monkeypatch.setenv("TRAINGUARD_AGENT_SOCKET_PATH", str(tmp_path / "agent.sock"))
        link = attach_daemon("j1", "", "node-a", RpcSecurity(), checkpointing=False)
        assert link is not None
        events: list[HealthEvent] = []
        source = DaemonEventSource(link, retry_s=0.05)
        source.start(events.append)
        _wait(lambda: any("grpc.max_watchers" in m for m in lines), "the launcher naming the daemon's limit")
        time.sleep(0.5)  # ten retries
        attached = [e for e in d.node_health.bus.recent(100) if e.kind == "agent.job_attached"]
        assert len(attached) == 1, [e.message for e in attached]
        assert sum("grpc.max_watchers" in m for m in lines) == 1, lines
        assert not [m for m in lines if "is back" in m or "event stream ended" in m], lines
        holder.cancel()  # the slot frees: the refused launcher gets the node's events (replayed from its attachment)
        d._on_event(_event("pcie.aer_fatal", Action.DRAIN_NODE, Severity.CRITICAL))
        _wait(lambda: any(e.kind == "pcie.aer_fatal" for e in events), "the fault reaching the launcher")
    finally:
        logger.removeHandler(handler)
        if source is not None:
            source.stop()
        if link is not None:
            link.close()
        channel.close()
        d.request_stop()
        loop.join(20)


def _drain(stream, first: threading.Event) -> None:
    """Reads a stream until it ends (cancelled: quietly); sets ``first`` at its first message."""
    import grpc

    try:
        for _ in stream:
            first.set()
    except grpc.RpcError:
        pass

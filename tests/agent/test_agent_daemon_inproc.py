"""The daemon in-process: watchdog pings stop when the gRPC server is wedged; metrics see real calls."""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from trainguard.agent.agentd import AgentDaemon, config_loader
from trainguard.agent.config import AgentConfigError
from trainguard.agent.sdnotify import SystemdNotifier, Watchdog
from trainguard.proto import agent_pb2, agent_pb2_grpc


def recv_until(sock: socket.socket, key: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            msg = sock.recv(4096).decode()
        except socket.timeout:
            break
        if f"{key}=" in msg:
            return msg
    raise AssertionError(f"no {key} within {timeout}s")


def _daemon_under_watchdog(tmp_path, detectors_and_more: str, grpc_listen: str, sock: str):
    """A daemon (not started) on a fake detector root, its sd_notify messages arriving on the returned datagram
    socket and a keep-alive due every 0.2 s; ``detectors_and_more`` continues the ``[detectors]`` table."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    if "[memory_tier]" not in detectors_and_more:  # the default /dev/shm/trainguard is every daemon's on the box
        detectors_and_more += f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n'
    config.write_text(f'[detectors]\nroot = "{tmp_path / "fake"}"\n' + detectors_and_more)
    notifier = SystemdNotifier(str(tmp_path / "notify.sock"))
    daemon = AgentDaemon(config_loader(str(config), grpc_listen, sock, str(tmp_path / "state")), notifier)
    daemon.watchdog = Watchdog(notifier, 0.4)
    return daemon, notify


def test_watchdog_withheld_when_server_wedged_and_metrics_count_calls(tmp_path):
    sock_path = tmp_path / "agent.sock"
    daemon, notify = _daemon_under_watchdog(tmp_path, '[metrics]\nlisten = "127.0.0.1:0"\n'
                                            '[agent]\nloop_interval_s = 0.1\n', "", str(sock_path))
    daemon.start()
    loop = threading.Thread(target=daemon.run)
    loop.start()
    try:
        recv_until(notify, "READY")
        recv_until(notify, "WATCHDOG", 5)
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            stub.ReportCheckpoint(agent_pb2.CheckpointReport(rank=0, step=7, tier="disk", bytes=1 << 20,
                                                             stall_s=0.1, persist_s=0.5), timeout=5)
            stub.GetHealth(agent_pb2.GetHealthRequest(), timeout=5)
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon._metrics_server.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "trainguard_checkpoint_last_step 7.0" in text
        assert 'trainguard_checkpoint_size_bytes_count{tier="disk"} 1.0' in text
        assert 'trainguard_grpc_requests_total{code="OK",method="GetHealth"} 1.0' in text
        assert 'trainguard_health_events_total{kind="agent.started",severity="info",source="agent"} 1.0' in text
        assert "trainguard_watchdog_pings_total" in text
        # Wedge the gRPC server behind the daemon's back: its self-check fails, so keep-alives stop.
        daemon._server.stop(None)
        time.sleep(0.5)  # a ping already on its way may still arrive
        notify.setblocking(False)
        try:
            while notify.recv(4096):
                pass
        except BlockingIOError:
            pass
        notify.settimeout(2.0)
        deadline = time.monotonic() + 2.0
        seen = []
        while time.monotonic() < deadline:
            try:
                seen.append(notify.recv(4096).decode())
            except socket.timeout:
                break
        assert not [m for m in seen if "WATCHDOG=1" in m], seen
    finally:
        daemon.request_stop()
        loop.join(30)
        notify.close()
    assert not loop.is_alive()
    assert not sock_path.exists()


def test_a_burst_of_health_checks_queues_instead_of_being_refused(tmp_path):
    """500 simultaneous grpc.health.v1 checks (probes from many pods, a monitoring burst) are all answered: the
    concurrency bound belongs to the expensive calls (event streams), not to cheap health checks."""
    from concurrent.futures import ThreadPoolExecutor

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    # No /metrics: the default port 9477 is anyone's on a shared box (the test failed when another process held it).
    config.write_text(f'[detectors]\nroot = "{tmp_path / "fake"}"\n[agent]\nloop_interval_s = 0.1\n'
                      '[metrics]\nlisten = ""\n[grpc]\nmax_workers = 4\nmax_watchers = 2\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    sock_path = tmp_path / "agent.sock"
    daemon = AgentDaemon(config_loader(str(config), "", str(sock_path), str(tmp_path / "state")),
                         SystemdNotifier(None))
    daemon.start()
    loop = threading.Thread(target=daemon.run)
    loop.start()
    try:
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            grpc.channel_ready_future(channel).result(timeout=10)
            calls = [stub.Check.future(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(500)]

            def outcome(f):
                try:
                    return f.result().status
                except grpc.RpcError as exc:
                    return exc.code()

            with ThreadPoolExecutor(8) as pool:
                results = list(pool.map(outcome, calls))
        refused = [r for r in results if isinstance(r, grpc.StatusCode)]
        assert not refused, f"{len(refused)} of 500 refused, e.g. {refused[:3]}"
    finally:
        daemon.request_stop()
        loop.join(30)


def _quiet_daemon(tmp_path):
    """A daemon (not started) on a socket in ``tmp_path`` with no detectors, predictor or metrics port, its
    memory-tier root in ``tmp_path``; returns it and its socket path."""
    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nroot = "{tmp_path / "fake"}"\nenabled = []\n[predictor]\nenabled = false\n'
                      '[metrics]\nlisten = ""\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    sock_path = tmp_path / "agent.sock"
    return AgentDaemon(config_loader(str(config), "", str(sock_path), str(tmp_path / "state")),
                       SystemdNotifier(None)), sock_path


def test_detach_job_with_a_path_for_a_job_name_deletes_nothing(tmp_path):
    """DetachJob's job name names a folder the daemon removes (the job's TLS files): a path instead of a name
    ("/elsewhere", "../..") is refused, and the folder it names survives."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("x")
    daemon, sock_path = _quiet_daemon(tmp_path)
    daemon.start()
    try:
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            # A job sending its CA's contents gives the daemon its folder of jobs' TLS files (refused here: the
            # bytes are no CA, but the folder is made).
            with pytest.raises(grpc.RpcError) as refused:
                stub.AttachJob(agent_pb2.AttachJobRequest(job="j1", coordinator="127.0.0.1:1", launcher_pid=1,
                                                          tls_ca_pem=b"not a certificate"), timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            for name in (str(victim), os.path.relpath(victim, tempfile.gettempdir() + "/x"), ""):
                with pytest.raises(grpc.RpcError) as bad:
                    stub.DetachJob(agent_pb2.DetachJobRequest(job=name, launcher_pid=1), timeout=10)
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert "is not a job name" in bad.value.details()
            assert (victim / "precious").exists()
            stub.DetachJob(agent_pb2.DetachJobRequest(job="j1", launcher_pid=1), timeout=10)  # a name still works
    finally:
        daemon.stop()
    assert (victim / "precious").exists()


def test_daemon_jobs_never_removes_a_folder_outside_its_own(tmp_path):
    """The same bound one level down: DaemonJobs itself removes only a job name's folder under its own."""
    from trainguard.agent.arena_keeper import ArenaKeeper
    from trainguard.agent.coordinator_report import NodeVerdict
    from trainguard.agent.daemon_jobs import DaemonJobs

    victim = tmp_path / "victim"
    victim.mkdir()
    jobs = DaemonJobs("n1", "h", "i", NodeVerdict, ArenaKeeper(str(tmp_path / "shm"), 60.0), 1.0, 1.0)
    jobs._pem_root = str(tmp_path / "pems")
    os.makedirs(jobs._pem_root)
    for name in (str(victim), "../victim", ""):
        jobs.detach(name, 1, ended=True)
    assert victim.exists() and os.path.isdir(jobs._pem_root)



def test_a_job_is_ended_only_by_its_own_launchers_while_one_lives(tmp_path):
    """Any user of the socket may send DetachJob: one that is not the job's launcher ended it for the daemon (its
    coordinator no longer reported to, its TLS files and its arena removed) while its launcher still ran."""
    from trainguard.agent.arena_keeper import ArenaKeeper
    from trainguard.agent.coordinator_report import NodeVerdict
    from trainguard.agent.daemon_jobs import DaemonJobs

    (tmp_path / "shm").mkdir()
    jobs = DaemonJobs("n1", "h", "i", NodeVerdict, ArenaKeeper(str(tmp_path / "shm"), 60.0), 1.0, 1.0)
    jobs.attach(agent_pb2.AttachJobRequest(job="j1", launcher_pid=os.getpid(), arena_root=str(tmp_path / "shm")))
    (tmp_path / "shm" / "j1").mkdir()
    assert jobs.detach("j1", 999_999, ended=True) is False
    assert "j1" in jobs._jobs and (tmp_path / "shm" / "j1").is_dir()
    assert jobs.detach("j1", os.getpid(), ended=True) is True
    assert "j1" not in jobs._jobs and not (tmp_path / "shm" / "j1").exists()


def test_idle_reflection_streams_leave_a_thread_for_health_checks(tmp_path):
    """Reflection streams (grpcurl sessions, or anyone who connects) each hold a serving thread while open: they
    count against grpc.max_watchers, so more than max_workers of them idle still leave health checks answered."""
    import queue

    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nroot = "{tmp_path / "fake"}"\nenabled = []\n[predictor]\nenabled = false\n'
                      '[metrics]\nlisten = ""\n'
                      '[grpc]\nmax_workers = 3\nmax_watchers = 2\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    sock_path = tmp_path / "agent.sock"
    daemon = AgentDaemon(config_loader(str(config), "", str(sock_path), str(tmp_path / "state")),
                         SystemdNotifier(None))
    daemon.start()
    feeds: list[queue.Queue] = []

    def requests(feed: queue.Queue):
        while (item := feed.get()) is not None:
            yield item

    streams = []
    try:
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = reflection_pb2.ServerReflectionRequest(list_services="")
            for _ in range(5):  # more than the serving threads, every one kept open
                feeds.append(queue.Queue())
                feeds[-1].put(ask)
                streams.append(stub.ServerReflectionInfo(requests(feeds[-1]), timeout=10))
            # Asked after the streams on the same connection, so queued behind them for a serving thread.
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            codes = []
            for stream in streams:
                try:
                    next(stream)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as exc:
                    codes.append(exc.code())
            assert sorted(c.name for c in codes) == ["OK", "OK", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED",
                                                     "RESOURCE_EXHAUSTED"]
    finally:
        for feed in feeds:
            feed.put(None)
        for stream in streams:
            stream.cancel()
        daemon.stop()


def test_a_second_daemon_on_the_socket_path_is_refused_even_with_the_socket_file_gone(tmp_path):
    """One daemon per socket path: its socket file removed under it (a cleaner, a hand), a second daemon's probe
    finds nothing, yet it must not start beside the first (both would keep the arenas and report the node)."""
    from trainguard.agent.errors import AgentError

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nroot = "{tmp_path / "fake"}"\nenabled = []\n[predictor]\nenabled = false\n'
                      '[metrics]\nlisten = ""\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    sock_path = tmp_path / "run" / "agent.sock"

    def daemon(state: str = "state", sock: Path = sock_path) -> AgentDaemon:
        return AgentDaemon(config_loader(str(config), "", str(sock), str(tmp_path / state)), SystemdNotifier(None))

    first = daemon()
    first.start()
    try:
        sock_path.unlink()
        second = daemon("state2")
        with pytest.raises(AgentError, match=rf"another trainguard agent \(pid {os.getpid()}\) holds "):
            second.start()
        assert not sock_path.exists()  # the refused one left nothing behind
        # another socket, the same state folder: both ran, wrote one history and reported one node id
        other = daemon(sock=tmp_path / "run" / "other.sock")
        with pytest.raises(AgentError, match=rf"another trainguard agent \(pid {os.getpid()}\) uses the state "
                                             rf"folder {tmp_path / 'state'} "):
            other.start()
        assert not (tmp_path / "run" / "other.sock").exists()
    finally:
        first.stop()
    third = daemon()  # the locks are released with the first daemon
    third.start()
    third.stop()


def test_a_job_whose_coordinator_ca_is_a_system_bundle_attaches(tmp_path):
    """The launcher sends its coordinator TLS files' contents (up to 1 MiB each) with AttachJob; a CA bundle of a
    few hundred certificates (200 KiB) is over grpc.max_request_bytes, and was refused as oversized, so the job
    ran without the daemon (no kept arena). The bound of the other methods still holds."""
    from trainguard.agent.health_source import DaemonAttachError, DaemonLink, JobAttachment
    from trainguard.agent.rpc_limits import ATTACH_MAX_REQUEST_BYTES

    daemon, sock_path = _quiet_daemon(tmp_path)
    daemon.start()
    try:
        # Bytes that are no CA keep the test off certificate generation: past the size bound, the daemon reads
        # them as the job's CA and refuses them by their contents (FAILED_PRECONDITION), not by their size.
        bundle = tmp_path / "bundle.pem"
        bundle.write_bytes(b"# " + b"x" * 200 * 1024 + b"\n")
        link = DaemonLink.connect(str(sock_path))
        assert link is not None
        with pytest.raises(DaemonAttachError, match="FAILED_PRECONDITION: the job's coordinator TLS files") as refused:
            link.attach(JobAttachment(job="bundle-job", coordinator="127.0.0.1:1", node_id="n1",
                                      tls_ca_file=str(bundle)))
        assert "exceeds" not in str(refused.value)
        link.close()
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            attach = channel.unary_unary("/trainguard.v1.NodeAgent/AttachJob")
            with pytest.raises(grpc.RpcError) as big:
                attach(b"\x0a\x01j" + b"\x5a\x00" * (ATTACH_MAX_REQUEST_BYTES // 2), timeout=10)
            assert big.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds" in big.value.details()
            # Only the PEM contents get the larger bound: a text field that large is refused, naming it.
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            with pytest.raises(grpc.RpcError) as long_id:
                stub.AttachJob(agent_pb2.AttachJobRequest(job="j2", launcher_pid=1, node_id="n" * 100_000),
                               timeout=10)
            assert long_id.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "node_id is 100000 characters; at most 253" in long_id.value.details()
            health = channel.unary_unary("/trainguard.v1.NodeAgent/GetHealth")
            with pytest.raises(grpc.RpcError) as oversized:
                health(b"\x08\x01" + b"\x5a\x00" * 40_000, timeout=10)
            assert oversized.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "65536" in oversized.value.details()
    finally:
        daemon.stop()


def test_a_job_attaching_while_the_daemon_still_starts_is_attached(tmp_path, monkeypatch):
    """The socket answers before the daemon is READY (its predictor, detectors, qualification start after); a
    launcher re-attaching the moment a restarted daemon answers got UNKNOWN (an AssertionError: no jobs table
    yet) and went on with its job unattached: no arena kept, no reports to its coordinator."""
    from trainguard.agent import node_health

    (tmp_path / "fake").mkdir()
    (tmp_path / "shm").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nroot = "{tmp_path / "fake"}"\nenabled = []\n[metrics]\nlisten = ""\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    sock_path = tmp_path / "agent.sock"
    still_starting = threading.Event()
    go_on = threading.Event()
    start_predictor = node_health.LocalNodeHealth.start_predictor

    def held_start(self, *args, **kwargs):  # the start-up step after the socket serves, held open
        still_starting.set()
        go_on.wait(30)
        return start_predictor(self, *args, **kwargs)

    monkeypatch.setattr(node_health.LocalNodeHealth, "start_predictor", held_start)
    daemon = AgentDaemon(config_loader(str(config), "", str(sock_path), str(tmp_path / "state")),
                         SystemdNotifier(None))
    starting = threading.Thread(target=daemon.start)
    starting.start()
    try:
        assert still_starting.wait(30)
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            reply = stub.AttachJob(agent_pb2.AttachJobRequest(job="j1", launcher_pid=os.getpid(),
                                                              arena_root=str(tmp_path / "shm")), timeout=10)
        assert reply.node_id and reply.arena_ttl_s > 0
    finally:
        go_on.set()
        starting.join(30)
        daemon.stop()


def test_a_withheld_keep_alive_is_retried_after_a_loop_interval_not_at_once(tmp_path):
    """A keep-alive that cannot go out (self-check failing, systemd's socket refusing it) stays due; the loop
    re-checked every 10 ms, logging an error each time (about 100 lines a second), instead of once per
    agent.loop_interval_s."""
    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nroot = "{tmp_path / "fake"}"\nenabled = []\n[predictor]\nenabled = false\n'
                      '[metrics]\nlisten = ""\n[agent]\nloop_interval_s = 0.2\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    notifier = SystemdNotifier(str(tmp_path / "nobody-listens.sock"))  # every keep-alive fails to send
    daemon = AgentDaemon(config_loader(str(config), "", str(tmp_path / "agent.sock"), str(tmp_path / "state")),
                         notifier)
    daemon.watchdog = Watchdog(notifier, 0.4)
    waits: list[float] = []

    class Recorded(threading.Event):
        def wait(self, timeout=None):  # the loop's pause, recorded; ends the loop after a few
            waits.append(timeout)
            if len(waits) >= 4:
                daemon.request_stop()
            return super().wait(0)

    daemon.start()
    daemon._wake = Recorded()
    daemon.run()
    assert waits and all(w == 0.2 for w in waits), waits


def test_the_self_check_reaches_a_tcp_only_daemon_on_ipv6_loopback(tmp_path):
    """No socket, TCP on [::1]: the self-check dialled 127.0.0.1, never answered, so the watchdog was never
    pinged and systemd would restart the daemon every WatchdogSec."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    daemon, notify = _daemon_under_watchdog(tmp_path, 'enabled = []\n[predictor]\nenabled = false\n[metrics]\n'
                                            'listen = ""\n[agent]\nloop_interval_s = 0.1\n', "[::1]:0", "")
    try:
        daemon.start()
    except AgentConfigError as exc:  # an IPv6-less host
        pytest.skip(str(exc))
    loop = threading.Thread(target=daemon.run)
    loop.start()
    try:
        recv_until(notify, "READY")
        recv_until(notify, "WATCHDOG", 10)
    finally:
        daemon.request_stop()
        loop.join(30)
        notify.close()


def test_detach_job_is_logged_and_announced_as_attach_job_is(tmp_path, capfd):
    """AttachJob is logged and announced on the event stream; DetachJob was neither, so an operator could not see
    when, or by which launcher, a job left the daemon, nor whether it ended (arena removed) or only left."""
    from trainguard.proto import common_pb2

    daemon, sock_path = _quiet_daemon(tmp_path)
    (tmp_path / "shm").mkdir()
    daemon.start()
    try:
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            for lock in ("j1.1.aa.lock", "j1.2.bb.lock"):
                stub.AttachJob(agent_pb2.AttachJobRequest(job="j1", launcher_pid=1, launcher_lock=lock,
                                                          arena_root=str(tmp_path / "shm")), timeout=10)
            (tmp_path / "shm" / "j1").mkdir()
            stub.DetachJob(agent_pb2.DetachJobRequest(job="j1", launcher_pid=1, launcher_lock="j1.9.zz.lock",
                                                      ended=True), timeout=10)
            stub.DetachJob(agent_pb2.DetachJobRequest(job="j1", launcher_pid=1, launcher_lock="j1.1.aa.lock"),
                           timeout=10)
            reply = stub.DetachJob(agent_pb2.DetachJobRequest(job="j1", launcher_pid=1, launcher_lock="j1.2.bb.lock",
                                                              ended=True), timeout=10)
            assert reply.arena_removed
            events = []
            stream = stub.WatchEvents(agent_pb2.WatchEventsRequest(replay=50), timeout=5)
            try:
                for ev in stream:  # the replay, then live events: stops at the last detach's
                    events.append(ev)
                    if ev.kind == "agent.job_detached" and ev.evidence["arena_removed"] == "True":
                        break
            except grpc.RpcError as exc:  # without that event the stream waits for more until its deadline
                assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
            stream.cancel()
    finally:
        daemon.stop()
    detached = [(e.severity, e.message, dict(e.evidence)) for e in events if e.kind == "agent.job_detached"]
    assert detached == [
        (common_pb2.SEVERITY_WARNING, "launcher pid 1, lock j1.9.zz.lock, not one of job j1's, said the job "
                                     "ended; ignored while its launchers live",
         {"job": "j1", "ended": "True", "ignored": "True", "arena_removed": "False"}),
        (common_pb2.SEVERITY_INFO, "job j1 detached by launcher pid 1, lock j1.1.aa.lock (the job goes on; 1 "
                                  "launcher(s) of it left)",
         {"job": "j1", "ended": "False", "ignored": "False", "arena_removed": "False"}),
        (common_pb2.SEVERITY_INFO, "job j1 detached by launcher pid 1, lock j1.2.bb.lock (the job ended; its "
                                  "arena removed)",
         {"job": "j1", "ended": "True", "ignored": "False", "arena_removed": "True"}),
    ], detached
    logged = capfd.readouterr().err  # the daemon's log, to its stderr as under systemd
    for severity, message, _ in detached:
        level = "WARNING" if severity == common_pb2.SEVERITY_WARNING else "INFO"
        assert f"{level} trainguard.agent.daemon_jobs: {message}" in logged, logged


def test_the_status_line_counts_detectors_without_hardware_apart_from_ok(tmp_path):
    """systemd's STATUS= said "detectors 3/3 ok" for three detectors with no hardware to watch (an empty fake
    root), and the same before any had sampled."""
    from trainguard.detectors.base import DetectorState
    from trainguard.detectors.runner import DetectorStatus

    daemon, notify = _daemon_under_watchdog(
        tmp_path, 'enabled = ["nvidia", "edac", "thermal"]\n[predictor]\nenabled = false\n[metrics]\nlisten = ""\n'
        f'[agent]\nloop_interval_s = 0.1\n[memory_tier]\nroot = "{tmp_path / "shm"}"\n', "",
        str(tmp_path / "agent.sock"))
    daemon.start()
    loop = threading.Thread(target=daemon.run)
    loop.start()
    try:
        deadline = time.monotonic() + 20
        while "detectors 0 ok, 3 no hardware;" not in recv_until(notify, "STATUS"):
            assert time.monotonic() < deadline, "no status line counting the detectors without hardware"
    finally:
        daemon.request_stop()
        loop.join(30)
    from trainguard.agent.agentd import detector_counts

    statuses = [DetectorStatus("a", DetectorState.FAILED, samples=2), DetectorStatus("b", DetectorState.OK),
                DetectorStatus("c", DetectorState.OK, samples=1), DetectorStatus("d", DetectorState.ERROR)]
    assert detector_counts(statuses) == "detectors 1 ok, 1 not sampled yet, 1 failed, 1 error"


@pytest.mark.parametrize("detectors", ['enabled = ["nosuch"]\n', 'enabled = ["roce"]\n[detectors.roce]\nnosuch = 1\n',
                                       'enabled = ["roce"]\n[detectors.roce]\ninterval_s = -1\n'])
def test_reload_refuses_detector_settings_that_start_refuses(tmp_path, detectors):
    """detectors.* apply only after a restart, but a reload must check them as the start does: the reload took a
    table naming an unknown detector or field ('apply only after a restart'), and the unit's next restart failed."""
    daemon, _ = _quiet_daemon(tmp_path)
    daemon.start()
    try:
        config = tmp_path / "agent.toml"
        good = config.read_text()
        config.write_text(good.replace("enabled = []\n", "").replace("[predictor]", detectors + "[predictor]"))
        restarted = AgentDaemon(config_loader(str(config), "", str(tmp_path / "next.sock"), str(tmp_path / "state")),
                                SystemdNotifier(None))
        with pytest.raises(AgentConfigError):  # the unit's next start
            restarted.start()
        daemon.reload()
        kinds = [e.kind for e in daemon.node_health.bus.recent(20)]
        assert kinds[-1] == "agent.reload_failed", kinds
        config.write_text(good)
        daemon.reload()
        assert daemon.node_health.bus.recent(1)[0].kind == "agent.reloaded"
    finally:
        daemon.stop()


def test_a_stopped_daemon_leaves_no_grpc_handler_threads(tmp_path):
    """grpc does not shut down the executor it is given: each daemon stopped in a process left its handler threads
    (``trainguard-grpc_N``) behind for the life of the process, which a daemon restarted in-process piles up."""
    sock_path = tmp_path / "agent.sock"
    daemon, notify = _daemon_under_watchdog(tmp_path, '[metrics]\nlisten = ""\n[agent]\nloop_interval_s = 0.1\n',
                                            "", str(sock_path))
    before = {t for t in threading.enumerate() if t.name.startswith("trainguard-grpc")}
    daemon.start()
    loop = threading.Thread(target=daemon.run)
    loop.start()
    try:
        recv_until(notify, "READY")
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            stub = agent_pb2_grpc.NodeAgentStub(channel)
            for _ in range(3):
                stub.GetHealth(agent_pb2.GetHealthRequest(), timeout=5)
        assert {t for t in threading.enumerate() if t.name.startswith("trainguard-grpc")} - before
    finally:
        daemon.request_stop()
        loop.join(30)
        notify.close()
    deadline = time.monotonic() + 5
    left = [t for t in threading.enumerate() if t.name.startswith("trainguard-grpc") and t not in before]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [t for t in left if t.is_alive()]
    assert not left, [t.name for t in left]

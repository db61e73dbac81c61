"""Two coordinators started on one store for one job, as an operator does by accident: real processes."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from coordinator_client import CoordinatorProcess, node_info

from trainguard.proto import coordinator_pb2 as pb


def test_a_second_coordinator_that_cannot_listen_leaves_the_running_one_the_owner(tmp_path, tg_env) -> None:
    """The second took the job's fence before binding its port: it exited with 'cannot listen', and the running
    coordinator's next store write found itself fenced off, so it stopped and nobody owned the job."""
    store = f"sqlite://{tmp_path}/sb.db"
    first = CoordinatorProcess(tmp_path, tg_env, "sb", "--nnodes", "1", "--heartbeat-interval", "0.1",
                               "--store", store)
    try:
        second = subprocess.run(
            [sys.executable, "-m", "trainguard.cli", "coordinator", "--job", "sb", "--listen", first.target,
             "--nnodes", "1", "--store", store], env=tg_env, capture_output=True, text=True, timeout=60)
        assert second.returncode != 0 and "cannot listen" in second.stderr, second.stderr[-2000:]
        node = first.agent(node_info("n0"))  # a durable registration: a fenced coordinator refuses it
        assert node.beat().command in (pb.NODE_COMMAND_START, pb.NODE_COMMAND_WAIT), node.last
        assert first.proc.poll() is None, first.log()[-2000:]
        assert "took over" not in first.log(), first.log()[-2000:]
    finally:
        first.stop()


def test_a_coordinator_whose_job_another_took_over_stops_without_a_write(tmp_path, tg_env) -> None:
    """A coordinator learned it was fenced off only from its next store write: while the job just trained
    (heartbeats are not written) it kept serving its agents beside the new owner, without a word."""
    store = f"sqlite://{tmp_path}/sb2.db"
    flags = ("--nnodes", "1", "--heartbeat-interval", "0.1", "--store", store)
    first = CoordinatorProcess(tmp_path, tg_env, "sb2", *flags)
    try:
        node = first.agent(node_info("n0"))
        node.beat()
        second = CoordinatorProcess(tmp_path, tg_env, "sb2", *flags)
        try:
            deadline = time.monotonic() + 20
            while first.proc.poll() is None and time.monotonic() < deadline:
                try:
                    node.beat()  # the node stays alive at the first: heartbeats are not written
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
            assert first.proc.wait(timeout=5) == 3, first.log()[-2000:]
            first._reader.join(timeout=5)
            assert any("took over" in ln and "sb2.db" in ln for ln in first.lines), first.log()[-2000:]
            assert second.proc.poll() is None, second.log()[-2000:]
        finally:
            second.stop()
    finally:
        first.stop()


def test_etcd_going_away_mid_run_is_said_once_and_its_return_is_served(tmp_path, tg_env) -> None:
    """A real etcd killed under a running coordinator and started again: one line names the store while it is
    away (not one per reaper pass), one says it answers again, and a registration then is durable."""
    from recovery_fixtures import ETCD_BINARY, ETCD_SKIP_REASON, free_port, start_etcd
    if ETCD_BINARY is None:
        pytest.skip(ETCD_SKIP_REASON)
    client, peer = free_port(), free_port()
    with open(tmp_path / "etcd.log", "wb") as log:
        etcd = start_etcd(tmp_path, client, peer, log)
        coord = None
        try:
            coord = CoordinatorProcess(tmp_path, tg_env, "away", "--nnodes", "2", "--store",
                                       f"etcd://127.0.0.1:{client}/away")
            etcd.kill()
            etcd.wait()
            _wait_for(lambda: any("cannot read store etcd://" in ln for ln in coord.lines), coord)
            time.sleep(3)  # several reaper passes with etcd still away
            assert sum("cannot read store" in ln for ln in coord.lines) == 1, coord.log()[-3000:]
            etcd = start_etcd(tmp_path, client, peer, log)
            _wait_for(lambda: any("answers again" in ln for ln in coord.lines), coord)
            assert coord.agent(node_info("n0")).lease
            assert coord.proc.poll() is None
        finally:
            if coord is not None:
                coord.stop()
            etcd.kill()
            etcd.wait()


def _wait_for(cond, coord: CoordinatorProcess, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not cond():
        assert time.monotonic() < deadline and coord.proc.poll() is None, coord.log()[-3000:]
        time.sleep(0.1)


def test_a_coordinator_stopped_by_sigterm_says_so(tmp_path, tg_env) -> None:
    """The node agent logs its stop; the coordinator's log just ended, as on a crash."""
    coord = CoordinatorProcess(tmp_path, tg_env, "termed", "--nnodes", "1")
    coord.stop()  # SIGTERM, as systemd and Kubernetes stop it
    coord._reader.join(timeout=5)
    assert coord.proc.returncode == 0, coord.log()[-2000:]
    stopping = [ln for ln in coord.lines if "coordinator for job termed stopping (SIGTERM" in ln]
    assert stopping and any(ln.endswith("coordinator for job termed stopped") for ln in coord.lines), coord.log()

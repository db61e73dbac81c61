"""Uploads honour the unreachable remote's back-off, and the remote catches up once it answers again."""

from __future__ import annotations

import socket
import threading
import time

import torch

from ftp_stub import FtpStub
from trainguard.checkpoint import Checkpointer
from trainguard.checkpoint.service import CheckpointService
from trainguard.checkpoint.storage import step_dirname


class Events(list):
    def __call__(self, ev) -> None:
        self.append(ev)


class Stall:
    """An endpoint that accepts connections and never answers (a stalled object-store endpoint)."""

    def __init__(self, port: int = 0) -> None:
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", port))
        self.srv.listen(64)
        self.port = self.srv.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.srv.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        try:  # wakes the accept() blocked in the other thread; a bare close() leaves the port listening
            self.srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.srv.close()
        for c in self.conns:
            c.close()


def test_saves_do_not_dial_a_backing_off_remote_and_the_newest_step_catches_up(make_config, tmp_path):
    # Against a dead remote each save's upload waited out the connect timeout in the background and sent its own
    # health event (one per step), and nothing reached the remote after it came back until the next save.
    stall = Stall()
    stub = None
    retry_s = 1.0
    cfg = make_config(remote={"url": f"ftp://127.0.0.1:{stall.port}/ckpt", "storage_options": {"timeout": 0.3},
                              "retry_s": retry_s})
    events = Events()
    try:
        with Checkpointer(cfg, job="bo", on_event=events) as ck:
            down_since = time.monotonic()
            assert len(stall.conns) == 1  # the constructor's probe found it unreachable
            assert [e.kind for e in events] == ["checkpoint.remote_unreachable"]
            tried = len(stall.conns)
            for step in range(1, 5):
                h = ck.save({"w": torch.full((1000,), float(step))}, step)
                assert h.wait(timeout=30) is False  # not on the remote; on memory and disk at once
                assert set(h.tiers_done) == {"memory", "disk"}
                if time.monotonic() < down_since + retry_s:  # still backing off: not dialed, nothing said
                    assert len(stall.conns) == tried, "a save dialed the backing-off remote"
            assert [e.kind for e in events] == ["checkpoint.remote_unreachable"], [e.message for e in events]

            # The remote answers again on the same address: the newest step (4) is uploaded without a new save.
            stall.close()
            stub = FtpStub(tmp_path / "remote", port=stall.port)
            marker = tmp_path / "remote" / "ckpt" / "bo" / step_dirname(4) / "rank_00000.commit"
            deadline = time.monotonic() + 4 * retry_s + 5
            while not marker.exists():
                assert time.monotonic() < deadline, "the remote never caught up with the newest step"
                time.sleep(0.05)
            deadline = time.monotonic() + 5
            while not any(s.step == 4 and "remote" in s.tiers for s in ck.steps()):  # listed again too
                assert time.monotonic() < deadline, [(s.step, s.tiers) for s in ck.steps()]
                time.sleep(0.05)
            assert ck.save({"w": torch.full((1000,), 5.0)}, 5).wait(timeout=30)  # uploads as usual
            assert [e.kind for e in events] == ["checkpoint.remote_unreachable"], [e.message for e in events]
    finally:
        stall.close()
        if stub is not None:
            stub.close()


def test_a_remote_restarted_under_a_running_job_is_listed_again(make_config, tmp_path):
    # fsspec keeps one filesystem per URL: after the FTP server restarted, the kept one held a dead control
    # connection and every listing (and restore) of the remote failed with EOFError for the rest of the job.
    stub = FtpStub(tmp_path / "remote")
    cfg = make_config(remote={"url": f"ftp://127.0.0.1:{stub.port}/ckpt", "storage_options": {"timeout": 2},
                              "retry_s": 0.2})
    try:
        with Checkpointer(cfg, job="rs") as ck:
            assert ck.save({"w": torch.ones(100)}, 1).wait(timeout=30)
            assert [(s.step, "remote" in s.tiers) for s in ck.steps()] == [(1, True)]
            stub.close()
            stub = FtpStub(tmp_path / "remote", port=stub.port)  # the server restarted
            deadline = time.monotonic() + 10
            while [(s.step, "remote" in s.tiers) for s in ck.steps()] != [(1, True)]:
                assert time.monotonic() < deadline, "the remote was never listed again"
                time.sleep(0.05)
    finally:
        stub.close()


def test_inline_saves_do_not_dial_a_backing_off_remote_and_close_catches_up(make_config, tmp_path):
    # persist.service = "inline" uploads in the caller's thread: against a dead remote every save dialed it and
    # the training step waited out the connect timeout inside save(), each time, with one health event per step.
    stall = Stall()
    stub = None
    retry_s = 1.0
    cfg = make_config(remote={"url": f"ftp://127.0.0.1:{stall.port}/ckpt", "storage_options": {"timeout": 0.3},
                              "retry_s": retry_s}, persist={"service": "inline"})
    events = Events()
    try:
        ck = Checkpointer(cfg, job="il", on_event=events)
        try:
            down_since = time.monotonic()
            assert len(stall.conns) == 1  # the constructor's probe found it unreachable
            tried = len(stall.conns)
            for step in range(1, 4):
                t0 = time.monotonic()
                h = ck.save({"w": torch.full((1000,), float(step))}, step)
                assert h.wait(timeout=30) is False
                blocked = time.monotonic() - t0
                assert set(h.tiers_done) == {"memory", "disk"}
                if time.monotonic() < down_since + retry_s:  # still backing off: not dialed, no timeout waited
                    assert len(stall.conns) == tried, "an inline save dialed the backing-off remote"
                    assert blocked < 0.3, f"an inline save waited {blocked:.2f} s for the backing-off remote"
            assert [e.kind for e in events] == ["checkpoint.remote_unreachable"], [e.message for e in events]

            # The remote answers again: close() (the back-off over) uploads the newest skipped step, 3.
            stall.close()
            stub = FtpStub(tmp_path / "remote", port=stall.port)
            # The back-off must be over for close() to dial it (it began at the first save's upload decision,
            # after that save's disk write, so a little later than down_since + retry_s).
            deadline = down_since + retry_s + 5
            while ck.channel._uploads.backing_off(cfg.remote_url) > 0:
                assert time.monotonic() < deadline, "the back-off never ended"
                time.sleep(0.02)
        finally:
            ck.close()
        root = tmp_path / "remote" / "ckpt" / "il"
        assert (root / step_dirname(3) / "rank_00000.commit").exists(), "close() did not catch up with step 3"
        assert not (root / step_dirname(2)).exists()  # older skipped steps are not uploaded
        assert [e.kind for e in events] == ["checkpoint.remote_unreachable"], [e.message for e in events]
    finally:
        stall.close()
        if stub is not None:
            stub.close()


def test_every_rank_of_a_shared_service_hears_of_the_outage_once(make_config, shm_dir, tmp_path):
    # One agent-owned service uploads for every rank of the node. Only the rank whose upload first found the
    # remote dead got the outage's event; the others' steps were skipped quietly (a debug log line), so their
    # Session.errors and logs said nothing while their steps were not reaching the remote.
    stub = FtpStub(tmp_path / "remote")
    stall = None
    svc = CheckpointService(job="sh", shm_dir=shm_dir, nice=0).start()
    cfg = make_config(remote={"url": f"ftp://127.0.0.1:{stub.port}/ckpt", "storage_options": {"timeout": 0.3},
                              "retry_s": 30.0}, persist={"service": svc.address})
    ev0, ev1 = Events(), Events()
    try:
        with Checkpointer(cfg, job="sh", rank=0, world_size=2, on_event=ev0) as ck0, \
                Checkpointer(cfg, job="sh", rank=1, world_size=2, on_event=ev1) as ck1:
            assert ck0.save({"w": torch.ones(100)}, 1).wait(timeout=30)
            assert ck1.save({"w": torch.ones(100)}, 1).wait(timeout=30)
            stub.close()
            stall = Stall(port=stub.port)  # the remote stalls from now on
            assert ck0.save({"w": torch.ones(100)}, 2).wait(timeout=30) is False  # rank 0's upload finds it dead
            assert [e.kind for e in ev0] == ["checkpoint.remote_unreachable"], [e.message for e in ev0]
            dialed = len(stall.conns)
            for step in (2, 3):  # rank 1: not dialed (backing off), but told once
                assert ck1.save({"w": torch.ones(100)}, step).wait(timeout=30) is False
            assert len(stall.conns) == dialed, "rank 1's upload dialed the backing-off remote"
            assert [e.kind for e in ev1] == ["checkpoint.remote_unreachable"], [e.message for e in ev1]
            assert [e.kind for e in ev0] == ["checkpoint.remote_unreachable"], [e.message for e in ev0]
    finally:
        svc.stop()
        stub.close()
        if stall is not None:
            stall.close()


def test_a_restart_pays_a_silent_remotes_timeout_once_not_again_in_restore(make_config, tmp_path, caplog):
    # Found by a review: against an FTP endpoint that accepts and never answers, a restarting job waited its 30 s
    # connect timeout in the Checkpointer's constructor and 30 s more in restore() before resuming from disk.
    stall = Stall()
    cfg = make_config(remote={"url": f"ftp://127.0.0.1:{stall.port}/ckpt", "storage_options": {"timeout": 1.5},
                              "retry_s": 60.0})
    try:
        with Checkpointer(make_config(), job="rs") as ck:  # an earlier run of the job left step 4 on disk
            ck.save({"w": torch.full((8,), 4.0)}, 4)
            assert ck.wait(timeout=30)
        with Checkpointer(cfg, job="rs") as ck:
            assert len(stall.conns) == 1  # the constructor's dial: it took the timeout to fail
            live = {"w": torch.zeros(8)}
            with caplog.at_level("WARNING", logger="trainguard.checkpoint.checkpointer"):
                assert ck.restore(live) == 4 and ck.last_restore_tier == "disk"
            assert len(stall.conns) == 1, "restore() dialled the silent remote again"
            assert torch.equal(live["w"], torch.full((8,), 4.0))
            assert "without asking it again" in caplog.text
    finally:
        stall.close()

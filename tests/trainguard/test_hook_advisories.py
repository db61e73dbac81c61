"""The hook's checkpoint advisories: a job-wide one saves exactly at its step (so every rank holds the same
step), a late one is skipped with a warning, a plain one saves at the next step."""

from __future__ import annotations

import logging

import torch

from trainguard.hook import Session
from trainguard.proto import agent_pb2


class _Link:
    """The agent side of the hook's link, holding advisories to hand over (the hook code under test is real)."""

    def __init__(self) -> None:
        self.queue: list[agent_pb2.Advisory] = []
        self.reported: list[int] = []

    def beat(self, step: int, dt: float) -> None:
        pass

    def take_advisories(self) -> list[agent_pb2.Advisory]:
        out, self.queue = self.queue, []
        return out

    def report_checkpoint(self, step: int, tier: str, nbytes: int, stall_s: float) -> None:
        self.reported.append(step)


def _adv(i: int, at_step: int = 0) -> agent_pb2.Advisory:
    return agent_pb2.Advisory(kind=agent_pb2.ADVISORY_KIND_CHECKPOINT_NOW, reason="predicted", advisory_id=str(i),
                              at_step=at_step)


def test_job_wide_checkpoint_at_its_step_late_one_skipped_plain_one_next_step(tmp_path, caplog) -> None:
    s = Session(checkpoint_dir=str(tmp_path / "ck"), save_every=0, job="adv")
    link = _Link()
    s._agent = link
    state = {"w": torch.arange(4.0)}
    try:
        link.queue.append(_adv(1, at_step=5))
        for step in range(0, 5):
            s.step_done(step, state)
        assert link.reported == []  # not before its step
        s.step_done(5, state)
        assert link.reported == [5]
        link.queue.append(_adv(2, at_step=6))  # heard of only after step 6 was done
        s.step_done(7, state)
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            link.queue.append(_adv(3, at_step=7))
            s.step_done(8, state)
        assert link.reported == [5] and "too late" in caplog.text
        link.queue.append(_adv(4))  # node-local advice: the next step
        s.step_done(9, state)
        assert link.reported == [5, 9]
        link.queue.append(_adv(4))  # an id is acted on once
        s.step_done(10, state)
        assert link.reported == [5, 9]
    finally:
        s._agent = None
        s.close()


def test_job_wide_checkpoint_is_taken_at_the_first_step_reaching_it_when_steps_jump(tmp_path, caplog) -> None:
    """The coordinator sets a job-wide checkpoint at the furthest step plus a margin; a loop whose steps jump
    (samples seen: 0, 32, 64, ...) never reported that exact step, so no rank saved and each warned 'too late'."""
    s = Session(checkpoint_dir=str(tmp_path / "ck"), save_every=0, job="advjump")
    link = _Link()
    s._agent = link
    state = {"w": torch.arange(4.0)}
    try:
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            s.step_done(0, state)
            link.queue.append(_adv(1, at_step=70))
            for step in (32, 64):
                s.step_done(step, state)
            assert link.reported == []
            s.step_done(96, state)
            assert link.reported == [96]
            s.step_done(128, state)
            assert link.reported == [96]
        assert "too late" not in caplog.text
    finally:
        s._agent = None
        s.close()


class _Node:
    """The agent behind the local gRPC service: queues advisories per rank and hands each out once, in the answer
    to the worker's next heartbeat (as LocalSupervisor.on_heartbeat does)."""

    generation = 1
    stopping = False

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.queue: list[agent_pb2.Advisory] = []
        self.beats: list[tuple[int, bool]] = []  # (step, finished) as received
        self.checkpoints: list[int] = []

    def on_worker_heartbeat(self, rank, pid, generation, step, step_time_s, finished=False, sections=None,
                            acked=None):
        with self.lock:
            self.beats.append((step, finished))
            out, self.queue = self.queue, []
        return out

    def on_checkpoint_report(self, report) -> None:
        self.checkpoints.append(report.step)


def test_an_advisory_sent_during_a_pause_is_acted_on_once_at_the_first_step_after_it(tmp_path) -> None:
    # Real hook, real link and local gRPC service: while hang detection is paused the worker sends nothing, so
    # the advisory waits at the agent; the message ending the pause brings it back, and the next step saves.
    import time

    from trainguard.agent.local_server import serve
    from trainguard.hook import _AgentLink

    node = _Node()
    sock = str(tmp_path / "a.sock")
    server, _ = serve(node, sock)
    s = Session(checkpoint_dir=str(tmp_path / "ck"), save_every=0, job="advpause")
    link = _AgentLink(sock, rank=0, generation=1)
    s._agent = link
    state = {"w": torch.arange(4.0)}
    try:
        for step in range(3):
            s.step_done(step, state)
        with s.pause_hang_detection("evaluation"):
            assert node.beats[-1][1]  # the pause reached the agent (finished=True)
            with node.lock:
                node.queue.append(_adv(7))  # a drain's checkpoint, advised mid-evaluation
        assert not node.queue, "the end of the pause did not reach the agent"
        s.step_done(3, state)
        s.wait(30)
        deadline = time.monotonic() + 30
        while node.checkpoints != [3] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert node.checkpoints == [3]
        s.step_done(4, state)
        s.wait(30)
        assert node.checkpoints == [3] and s.last_saved_step == 3  # once, not again at the next step
    finally:
        s._agent = None
        s.close()
        link.close()
        server.stop(0).wait()

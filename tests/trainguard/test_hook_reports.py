"""What the hook reports: a failed background tier latched in ``Session.errors`` (the README's promise), not
only a failed ``save()`` call; the first step after the hello sent to the agent at once."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest
import torch
from tg_testutil import HookLinkFake

from trainguard.checkpoint.errors import StorageUnavailableError
from trainguard.hook import MAX_LATCHED_ERRORS, Session


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_disk_write_that_fails_in_the_background_is_latched(tmp_path, monkeypatch) -> None:
    """Found by checking the README against behaviour: with the checkpoint folder on a full disk, the persist
    process's writes failed (ENOSPC, logged) and session.errors was still [] after close()."""
    shm = f"/dev/shm/trainguard-test-{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("TRAINGUARD_CHECKPOINT_SHM_DIR", shm)
    disk = tmp_path / "full"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=True)
    try:
        s = Session(checkpoint_dir=str(disk), save_every=1, job="full")
        state = {"w": torch.ones(256, 1024)}  # 1 MiB: no room on the 64 KiB disk
        assert s.save(state, 1)  # the snapshot is taken; the disk write fails later, in the persist process
        s.close()
        assert s.errors and all(isinstance(e, StorageUnavailableError) for e in s.errors), s.errors
        assert any("No space left" in str(e) or "disk" in str(e) for e in s.errors), s.errors
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
        shutil.rmtree(shm, ignore_errors=True)


def test_the_latched_errors_keep_the_newest(tmp_path) -> None:
    s = Session(job="many")
    for i in range(MAX_LATCHED_ERRORS + 5):
        s._latch(StorageUnavailableError(f"failure {i}"), "save")
    assert len(s.errors) == MAX_LATCHED_ERRORS and str(s.errors[-1]) == f"failure {MAX_LATCHED_ERRORS + 4}"
    s.close()


def test_the_first_step_after_the_hello_is_reported_at_once(tmp_path, monkeypatch) -> None:
    """The hello went out at start and the first step waited out the heartbeat interval behind it (0.25 s),
    folded into a later step: the agent's "first resumed step" after a restart read 203 for a restore to 200
    (seen in `make demo`). Real gRPC over a unix socket to a recording agent."""
    import time
    from concurrent import futures

    import grpc

    import trainguard.hook as hook_mod
    from trainguard.hook import _AgentLink
    from trainguard.proto import agent_pb2, agent_pb2_grpc

    # A long interval, so that "at once" and "after the interval" stay apart on a loaded box too.
    monkeypatch.setattr(hook_mod, "HEARTBEAT_MIN_INTERVAL_S", 5.0)
    steps: list[int] = []

    class Agent(agent_pb2_grpc.NodeAgentServicer):
        def WorkerHeartbeat(self, request, context):  # noqa: N802
            steps.append(request.step)
            return agent_pb2.WorkerHeartbeatResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    agent_pb2_grpc.add_NodeAgentServicer_to_server(Agent(), server)
    sock = tmp_path / "agent.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        link = _AgentLink(str(sock), rank=0, generation=2)
        deadline = time.monotonic() + 10
        while not steps and time.monotonic() < deadline:  # the hello (step -1)
            time.sleep(0.005)
        link.beat(200, 0.01)
        deadline = time.monotonic() + 3  # well inside the 5 s interval
        while len(steps) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        for step in range(201, 210):
            link.beat(step, 0.01)
        link.close()
    finally:
        server.stop(0)
    assert steps[:2] == [-1, 200], steps


def test_a_step_that_does_not_grow_is_named_once_and_latched(tmp_path, caplog) -> None:
    """Found running a loop that passes the index within the epoch (`for step, batch in enumerate(loader)`)
    under `trainguard run`: the agent took every step of the second epoch as no progress, killed the healthy
    worker as hung ("sent no step heartbeat for 8.4 s after step 19") three times and failed the job; nothing
    in the worker's log said why."""
    import logging

    from trainguard.errors import UsageError

    s = Session(job="epochs")
    try:
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            for _epoch in range(3):
                for step in range(4):
                    s.step_done(step)
        assert len(s.errors) == 1 and isinstance(s.errors[0], UsageError), s.errors
        msg = str(s.errors[0])
        assert "step_done(0) after step_done(3)" in msg and "global step" in msg, msg
        assert caplog.text.count("steps must grow") == 1, caplog.text
        s.step_done(9)  # growing again is fine, and says nothing more
        assert len(s.errors) == 1
    finally:
        s.close()


def test_a_step_past_the_coordinators_bound_is_latched_not_sent(tmp_path, caplog) -> None:
    """A step past 2**53-1 went to the node agent, whose coordinator refused every later heartbeat of the node:
    the node lost its lease and its slot in the job (fuzzing review). It is latched and logged once, neither
    reported nor saved; steps in range go on as before."""
    import logging

    import torch

    from trainguard.errors import UsageError
    from trainguard.steps import MAX_STEP

    link = HookLinkFake()
    s = Session(job="bigstep", checkpoint_dir=str(tmp_path / "ck"), save_every=1)
    s._agent = link
    try:
        with caplog.at_level(logging.WARNING, logger="trainguard"):
            s.step_done(5, {"w": torch.ones(2)})
            for step in (MAX_STEP + 1, 2**63, -3):
                s.step_done(step, {"w": torch.ones(2)})
        assert [b[0] for b in link.beats] == [5]
        assert len(s.errors) == 1 and isinstance(s.errors[0], UsageError), s.errors
        assert f"step_done({MAX_STEP + 1}): a step is in 0..{MAX_STEP}" in str(s.errors[0])
        assert caplog.text.count("a step is in 0..") == 1, caplog.text
        s.step_done(MAX_STEP, {"w": torch.ones(2)})
        assert [b[0] for b in link.beats] == [5, MAX_STEP] and len(s.errors) == 1
        s.wait()
        assert s.last_saved_step == MAX_STEP
    finally:
        s.close()


class _Clock:
    """The hook's clock, moved by the test (only the hook module's ``time`` is replaced)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def perf_counter(self) -> float:
        return self.t


def test_a_paused_phase_is_not_counted_in_the_next_steps_time(monkeypatch) -> None:
    """Found with a real `trainguard run` job (hang floor 8 s): after a 5 s evaluation inside
    pause_hang_detection, the next step was reported as 5.06 s, the agent's hang bound became 5x that, and a rank
    that hung two steps later was found after 25.4 s instead of 8 (a 10 min evaluation: 50 min)."""
    from trainguard import hook

    clock = _Clock()
    monkeypatch.setattr(hook, "time", clock)
    link = HookLinkFake()
    s = Session(job="pause")
    s._agent = link
    try:
        clock.t += 0.05
        s.step_done(0)
        with s.pause_hang_detection("evaluation"):
            clock.t += 300.0
        clock.t += 0.05
        s.step_done(1)
        assert link.quiet == [True, False]
        assert link.beats[-1][:2] == (1, pytest.approx(0.05)) and s.last_step_time_s == pytest.approx(0.05)
        with s.pause_hang_detection("evaluation"):  # a step inside the block counts as usual, from the last one
            clock.t += 0.05
            s.step_done(2)
            clock.t += 10.0
        clock.t += 0.05
        s.step_done(3)
        assert [dt for _, dt, _ in link.beats[-2:]] == [pytest.approx(0.05), pytest.approx(10.05)]
        s._agent = None
        with s.pause_hang_detection("evaluation"):  # no agent: still left out of last_step_time_s
            clock.t += 60.0
        clock.t += 0.05
        s.step_done(4)
        assert s.last_step_time_s == pytest.approx(0.05)
    finally:
        s._agent = None
        s.close()


def test_the_first_steps_time_since_init_is_sent_as_unknown(monkeypatch) -> None:
    """Found with a real `trainguard run` job (hang floor 8 s) that spent 6 s building its model after init(): the
    first step was reported as 6.35 s, the agent's hang bound became 5x that, and a rank that hung at step 5 was
    found after 32 s instead of 8 (a model and data set loaded in 5 min: 25 min)."""
    from trainguard import hook

    clock = _Clock()
    monkeypatch.setattr(hook, "time", clock)
    link = HookLinkFake()
    s = Session(job="first")
    s._agent = link
    try:
        clock.t += 360.0  # set-up after init
        s.step_done(0)
        clock.t += 0.05
        s.step_done(1)
        assert [b[:2] for b in link.beats] == [(0, 0.0), (1, pytest.approx(0.05))]
        assert s.last_step_time_s == pytest.approx(0.05)
    finally:
        s._agent = None
        s.close()


def test_an_agent_that_is_away_is_warned_about_in_one_line(tmp_path, caplog) -> None:
    """Found running the hook with $TRAINGUARD_AGENT_SOCKET naming a socket no agent serves: training went on (as it
    should), but the warning was gRPC's five-line error repr, debug string included."""
    import logging
    import time

    from trainguard.hook import _AgentLink

    with caplog.at_level(logging.WARNING, logger="trainguard.hook"):
        link = _AgentLink(str(tmp_path / "no-agent.sock"), rank=0, generation=1)
        deadline = time.monotonic() + 20
        while not link.failures and time.monotonic() < deadline:
            time.sleep(0.01)
        link.close()
    lines = [r.getMessage() for r in caplog.records if "heartbeat to the agent failed" in r.getMessage()]
    assert lines and all("\n" not in m for m in lines), lines
    assert "UNAVAILABLE" in lines[0] and "no-agent.sock" in lines[0], lines[0]


@pytest.mark.parametrize("value", ["20", None, 2.5, -1, True])
def test_a_save_every_that_is_not_a_step_count_is_a_one_line_error(value) -> None:
    """Found calling trainguard.init as a new user would, with a value read from the environment or argparse:
    save_every="20" or None raised TypeError ('<' not supported between 'str' and 'int'), and 2.5 was taken
    (saving at steps 4, 9, 14...)."""
    from trainguard.errors import TrainguardError

    with pytest.raises(TrainguardError, match=r"save_every must be a whole number of steps >= 0.*got"):
        Session(save_every=value, job="every")


def test_a_numpy_save_every_is_taken_as_its_int() -> None:
    import numpy as np

    s = Session(save_every=np.int64(5), job="every")
    assert s.save_every == 5 and type(s.save_every) is int
    s.close()


def test_save_every_saves_steps_that_jump_over_its_multiples(tmp_path) -> None:
    """A loop counting its step in samples (0, 32, 64, ...) with save_every=10 never landed on a step with
    (step + 1) % 10 == 0, so it saved nothing at all and a restart began at 0, with session.errors == []. A save is
    now due at the first step that crosses a multiple; steps one apart save where they always did."""
    state = {"w": torch.zeros(2)}
    s = Session(checkpoint_dir=str(tmp_path / "jump"), save_every=10, job="jump")
    try:
        saved = []
        for step in range(0, 100, 32):
            s.step_done(step, state)
            saved.append(s.last_saved_step)
        assert saved == [None, 32, 64, 96], saved
        assert s.errors == []
    finally:
        s.close()
    again = Session(checkpoint_dir=str(tmp_path / "jump"), save_every=10, job="jump")
    try:
        assert again.restore(state) == 97
    finally:
        again.close()
    s = Session(checkpoint_dir=str(tmp_path / "plain"), save_every=10, job="plain")
    try:
        saves = []
        for step in range(25):
            before = s.last_saved_step
            s.step_done(step, state)
            if s.last_saved_step != before:
                saves.append(step)
        assert saves == [9, 19], saves
    finally:
        s.close()


def test_a_step_reported_per_micro_batch_is_named_as_such(tmp_path) -> None:
    """Gradient accumulation with step_done after every micro-batch repeats each step; the latched error told
    the user to 'pass a global step counter, not the index within an epoch', which they already did. It now
    names the fix: once per optimizer step."""
    from trainguard.errors import UsageError

    s = Session(job="accum")
    try:
        for opt_step in range(3):
            for _micro in range(4):
                s.step_done(opt_step)
        assert len(s.errors) == 1 and isinstance(s.errors[0], UsageError), s.errors
        msg = str(s.errors[0])
        assert "step_done(0) called again for the same step" in msg and "once per optimizer step" in msg, msg
        assert "\n" not in msg and "epoch" not in msg, msg
    finally:
        s.close()


def test_a_second_init_for_the_same_job_while_the_first_is_open_is_refused_at_once(tmp_path) -> None:
    """Calling trainguard.init() twice (a helper that sets up training, called again) gave a second session whose
    every save failed ('already writes checkpoints for this job and rank'), one logged error per save while
    training went on saving nothing, and whose restore missed the first session's newest step. It is now one
    UsageError at the second init; once the first is closed, or for another job, init works."""
    import trainguard
    from trainguard.errors import UsageError

    state = {"w": torch.zeros(2)}
    first = trainguard.init(checkpoint_dir=str(tmp_path / "ck"), save_every=1, job="twice")
    try:
        first.step_done(0, state)
        with pytest.raises(UsageError, match=r"already called in this process for job 'twice' rank 0.*close\(\)"):
            trainguard.init(checkpoint_dir=str(tmp_path / "ck"), save_every=1, job="twice")
        other = trainguard.init(checkpoint_dir=str(tmp_path / "ck"), save_every=1, job="other")
        other.close()
    finally:
        first.close()
    with trainguard.init(checkpoint_dir=str(tmp_path / "ck"), save_every=1, job="twice") as again:
        assert again.restore(state) == 1
        again.step_done(1, state)
        assert again.errors == [] and again.last_saved_step == 1


def test_a_tensor_step_counter_incremented_in_place_is_taken_by_value(tmp_path) -> None:
    """A loop keeping its step in a tensor (gstep += 1 after each step_done) changed the hook's kept last step
    with it: the next step_done latched 'called again for the same step' and last_saved_step named a step that
    was never saved. Integer steps of any kind are now taken as plain ints."""
    state = {"w": torch.zeros(2)}
    with Session(checkpoint_dir=str(tmp_path / "ck"), save_every=2, job="inplace") as s:
        gstep = torch.tensor(0)
        for _ in range(4):
            s.step_done(gstep, state)
            gstep += 1
        assert s.errors == [], s.errors
        assert s.last_saved_step == 3 and type(s.last_saved_step) is int


def test_a_step_after_finish_turns_hang_detection_back_on_and_says_so() -> None:
    """finish() called before each epoch's evaluation (instead of pause_hang_detection) left the agent expecting
    no steps for the rest of the run: a rank hanging in a later epoch was never found, and nothing said why."""
    from trainguard.errors import UsageError

    class _Link(HookLinkFake):
        def finish(self) -> None:  # as the real link: the end of the loop is a lasting quiet
            self.set_quiet(True)

    link = _Link()
    s = Session(job="finish")
    s._agent = link
    try:
        s.step_done(0)
        s.finish()
        assert link.quiet == [True]
        s.step_done(1)
        assert link.quiet == [True, False]
        assert len(s.errors) == 1 and isinstance(s.errors[0], UsageError), s.errors
        assert "pause_hang_detection()" in str(s.errors[0]) and "\n" not in str(s.errors[0])
        s.finish()
        assert link.quiet == [True, False, True]
    finally:
        s._agent = None
        s.close()

"""The hook's step timing: sections summed per step and handed out at step_done, names checked, CUDA only
where it is initialised."""

from __future__ import annotations

import time

import pytest

from tg_testutil import HookLinkFake

from trainguard.errors import TrainguardError
from trainguard.hook import Session
from trainguard.step_timer import StepTimer


def test_sections_are_summed_per_step_and_reset(tmp_path):
    s = Session(job="sections")
    link = HookLinkFake()
    s._agent = link
    measured = []
    for step in range(2):
        for _ in range(3):
            with s.section("forward"):
                time.sleep(0.01)
        with s.section("comm"):
            time.sleep(0.02)
        s.step_done(step)
        measured.append(s.last_step_time_s)
    (_, sent, sec), (_, dt2, sec2) = link.beats
    dt = measured[0]  # the first step's time runs from init(): sent as 0 (unknown)
    assert sent == 0.0 and dt2 == measured[1]
    assert set(sec) == {"forward", "comm"}
    assert 0.03 <= sec["forward"] < dt and 0.02 <= sec["comm"] < dt
    assert sec["forward"] + sec["comm"] <= dt
    assert 0.03 <= sec2["forward"] <= dt2 - sec2["comm"]  # reset between steps, not accumulated
    assert s.last_sections == sec2 and s.last_step_time_s > 0
    s.step_done(2)  # a step without sections: the plain heartbeat
    assert link.beats[-1][2] is None and s.last_sections == {}
    s.close()


def test_bad_section_names_are_refused_at_once():
    t = StepTimer()
    for bad in ("", "a b", "x" * 33, "fwd/bwd"):
        with pytest.raises(TrainguardError, match="section name"):
            t.section(bad)
    for i in range(16):
        t.section(f"s{i}")
    with pytest.raises(TrainguardError, match="at most 16"):
        t.section("one-more")


def test_no_cuda_here_means_wall_time_and_forcing_it_is_an_error():
    import torch

    t = StepTimer()
    with t.section("optim"):
        pass
    # By default CUDA events are used only once the process has initialised CUDA (another test may have).
    cuda_on = torch.cuda.is_available() and torch.cuda.is_initialized()
    assert (t.cuda is not None) == cuda_on and "optim" in t.collect()

    if not torch.cuda.is_available():
        with pytest.raises(TrainguardError, match="CUDA is not initialised"):
            StepTimer(use_cuda=True).section("forward")

"""The watchdog self-check times the detector sampler on a clock that never steps: an NTP step of the wall clock
neither stops the keep-alives of a working agent nor keeps them going for a stalled one. The daemon runs in-process
on a fake clock; the detector runner's statuses (a leaf) carry the stamps a stepped wall clock would give them."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from trainguard.agent.agentd import AgentDaemon, config_loader
from trainguard.agent.sdnotify import SystemdNotifier


class FakeClock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _daemon(tmp_path: Path, clock: FakeClock) -> AgentDaemon:
    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nenabled = ["process"]\nroot = "{tmp_path / "fake"}"\n[metrics]\nlisten = ""\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    daemon = AgentDaemon(config_loader(str(config), "", str(tmp_path / "agent.sock"), str(tmp_path / "state")),
                         SystemdNotifier(None), clock=clock)
    daemon.start()
    return daemon


def test_a_wall_clock_step_neither_trips_nor_masks_the_sampler_check(tmp_path: Path) -> None:
    clock = FakeClock()
    daemon = _daemon(tmp_path, clock)
    try:
        real = daemon.detector_statuses()
        assert real, "the daemon runs a detector"
        samples = 100

        def sampled(stamp: float) -> list:
            return [dataclasses.replace(s, sampled_at=stamp, samples=samples) for s in real]

        # The wall clock stepped an hour forward after the latest samples: they keep coming, stamped an hour
        # "ago". The old check (time.time() - newest stamp) called that a stall and withheld every keep-alive.
        for _ in range(5):
            samples += 1
            clock.now += 1.0
            stamp = time.time() - 3600
            daemon.detector_statuses = lambda: sampled(stamp)
            assert daemon._healthy(), "a sampler making progress was judged stalled after a clock step"
        # The wall clock stepped an hour back, then the sampler wedged: its last stamp lies in the "future", and
        # the old check saw no stall for an hour. Counted on the monotonic clock, it is one once the bound passes.
        stamp = time.time() + 3600
        daemon.detector_statuses = lambda: sampled(stamp)
        assert daemon._healthy()  # just sampled
        clock.now += 5.0
        assert daemon._healthy()  # within the bound
        clock.now += 3600.0
        assert not daemon._healthy(), "a wedged sampler passed the self-check after the clock stepped back"
    finally:
        daemon.stop()

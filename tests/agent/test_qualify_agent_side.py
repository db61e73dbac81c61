"""The agent's side: one verdict at registration, re-checks while idle handed to one heartbeat each."""

from __future__ import annotations

import time

from trainguard.agent.node import NodeConfig
from trainguard.agent.qualify import QualifySection, Verdict
from trainguard.agent.qualify.agent_side import NodeQualifier
from trainguard.testing.sysfs import FakeNodeHardware


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_registration_once_then_an_idle_recheck_reports_a_link_that_narrowed(tmp_path) -> None:
    hw = FakeNodeHardware(tmp_path)
    section = QualifySection(checks=["pcie"], root=str(tmp_path), recheck_s=60.0)
    config = NodeConfig(job="j", coordinator="127.0.0.1:1", argv=["x"], node_id="s1", spare=True, qualify=section,
                        detectors=())
    clock = Clock()
    q = NodeQualifier.for_node(config)
    q._clock = clock  # the re-check period is the unit here, not wall time
    first = q.registration()
    assert first is not None and first.passed and q.registration() == first  # kept, not re-run
    assert q.for_heartbeat(idle=True) is None  # not due yet
    hw.narrow_link(4)
    clock.t = 61.0
    assert q.for_heartbeat(idle=False) is None  # running workers: no re-check
    assert q.for_heartbeat(idle=True) is None  # due: starts on its own thread
    deadline = time.monotonic() + 10
    got = None
    while got is None and time.monotonic() < deadline:
        time.sleep(0.02)
        got = q.for_heartbeat(idle=True)
    assert got is not None and not got.passed and "x4, below its x16" in got.reason
    assert not Verdict.from_pb("s1", got).passed and q.latest is not None and not q.latest.passed
    assert q.for_heartbeat(idle=True) is None  # handed over once


def test_no_qualify_section_sends_nothing() -> None:
    q = NodeQualifier.for_node(NodeConfig(job="j", coordinator="127.0.0.1:1", argv=["x"]))
    assert q.registration() is None and q.for_heartbeat(idle=True) is None

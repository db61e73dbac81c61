"""The node agent's predictor loop: an alarm advises a checkpoint at once and asks for a drain after a grace."""

from __future__ import annotations

import time

from trainguard.agent.node import NodeAgent, NodeConfig
from trainguard.agent.parts import HealthState
from trainguard.detectors.events import Action


def test_rules_alarm_advises_checkpoint_then_schedules_drain() -> None:
    agent = NodeAgent(NodeConfig(job="j", coordinator="", argv=[], node_id="n1"))
    agent.start_predictor(model_path=None, history_path=None, interval_s=0.0, drain_grace_s=0.2)
    sub = agent.bus.subscribe()
    agent.predictor_tick({"roce.link_up[eth0]": 1.0})
    assert sub.get(timeout=0.1) is None and agent.predictor_score < 1.0
    agent.predictor_tick({"roce.link_up[eth0]": 0.0})  # the NIC went down: the rules tier fires at once
    ev = sub.get(timeout=1.0)
    assert ev is not None and ev.kind == "predictor.alarm" and ev.action == Action.DRAIN_NODE
    assert "rule.nic-down" in ev.evidence and agent.predictor_score == 1.0
    assert agent.health.drain_pending and agent.health.state == HealthState.ALARMED
    time.sleep(0.25)
    agent.drain_if_due()  # standalone (no coordinator): the request is dropped, the schedule cleared
    assert not agent.health.drain_pending and agent.health.state == HealthState.WATCHING


def test_history_records_samples(tmp_path) -> None:
    agent = NodeAgent(NodeConfig(job="j", coordinator="", argv=[], node_id="n1"))
    agent.start_predictor(model_path=None, history_path=str(tmp_path / "h.sqlite"), interval_s=0.0)
    for _ in range(3):
        agent.predictor_tick({"pcie.aer_correctable[0000:01:00.0]": 1.0})
        time.sleep(0.01)
    assert agent.predictor.history is not None and agent.predictor.history.count() >= 3

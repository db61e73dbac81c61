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


def test_drain_with_a_file_url_ends_once_the_asked_step_is_committed(tmp_path) -> None:
    """Regression: the agent listed the raw ``--checkpoint-dir``, so with a ``file://`` URL a predicted-failure
    drain never saw the job-wide checkpoint complete and always waited its whole grace."""
    from trainguard.checkpoint.location import CheckpointLocation
    from trainguard.proto import common_pb2, coordinator_pb2

    url = f"file://{tmp_path}/ck"
    agent = NodeAgent(NodeConfig(job="j", coordinator="", argv=[], node_id="n1", checkpoint_dir=url))
    agent.start_predictor(model_path=None, history_path=None, interval_s=0.0, drain_grace_s=600.0)
    agent.supervisor.table = common_pb2.RankTable(job="j", generation=agent.generation, world_size=2)
    agent.predictor_tick({"roce.link_up[eth0]": 0.0})  # rules alarm: checkpoint now, drain after the grace
    assert agent.health.drain_pending
    agent._relay_checkpoint(coordinator_pb2.CheckpointRequest(at_step=7, reason="alarm", request_id="r1",
                                                              generation=agent.generation))
    store = CheckpointLocation.parse(url).open_store("j")  # the workers' own layout, written for real
    store.commit_rank(7, 0, 2, "d0")
    agent.drain_if_due()
    assert agent.health.drain_pending  # rank 1 has not committed: keep training within the grace
    store.commit_rank(7, 1, 2, "d1")
    agent.drain_if_due()
    assert not agent.health.drain_pending  # the asked step is complete: drain now, not 600 s later

"""Node health: the configured predictor threshold drives alarms, status and metrics; the lifecycle table."""

from __future__ import annotations

import logging
import math
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from trainguard.agent.errors import IllegalTransitionError
from trainguard.agent.lifecycle import Lifecycle
from trainguard.agent.node_health import LocalNodeHealth
from trainguard.agent.parts import HEALTH_TRANSITIONS, HealthState, HealthTrigger
from trainguard.proto import agent_pb2, agent_pb2_grpc

NORMAL_C, HOT_C = 60.0, 95.0


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> str:
    """A real robust-z model of GPU temperature (trained in ~0.3 s) with online per-node calibration: a fresh
    node's own threshold is infinite for its first day, so only a configured threshold can make it alarm."""
    from trainguard.predictor.features import FeatureConfig
    from trainguard.predictor.table import MetricTable
    from trainguard.predictor.training import TrainConfig, train

    rng = np.random.default_rng(0)
    ts, nodes, vals = [], [], []
    for k in range(3):
        for i in range(400):
            ts.append(1e9 + i * 5.0)
            nodes.append(f"n{k}")
            vals.append([NORMAL_C + rng.normal(0, 1)])
    table = MetricTable(columns=["gpu_temp_c"], ts=np.array(ts), node=np.array(nodes, dtype=object),
                        values=np.array(vals))
    model = train(table, None, TrainConfig(method="robust-z", features=FeatureConfig(interval_s=5.0, peer=False)))
    assert model.calibration is not None  # per-node thresholds, the default since they exist
    path = tmp_path_factory.mktemp("model") / "temp.tgm"
    model.save(path, key=b"")
    return str(path)


def _feed(monitor, temps: list[float], t0: float) -> list:
    """Ticks the node's real predictor monitor with detector metrics (one GPU's temperature), 5 s apart."""
    return [monitor.tick(t0 + i * 5.0, {"nvidia.temp_c[0]": c}) for i, c in enumerate(temps)]


def _alarms(health: LocalNodeHealth) -> list:
    return [e for e in health.bus.recent(50) if e.kind == "predictor.alarm"]


def test_configured_threshold_drives_the_alarm(model_file: str) -> None:
    health = LocalNodeHealth("n1", threshold=0.5)
    health.start_predictor(model_file, None, interval_s=0.0)
    scores = _feed(health.predictor, [NORMAL_C] * 40 + [HOT_C] * 4, time.time())
    hot = scores[-1]
    assert hot is not None and hot.score >= 0.5, hot
    assert health.threshold == 0.5 and hot.threshold == 0.5
    alarms = _alarms(health)
    assert len(alarms) == 1 and alarms[0].evidence["threshold"] == "0.5000", alarms
    assert health.state == HealthState.ALARMED and health.drain_pending
    # The realised alarm rate counts at the threshold in force: one alarm event in 43 observed intervals; the
    # runtime's own count (against the model's infinite threshold) has none.
    assert health.predictor.runtime.realised_alarms_per_day() == 0.0
    assert health.alarms_per_day == pytest.approx(86400.0 / (43 * 5.0))


def test_configured_threshold_without_a_model_alarms_only_on_a_rule_hit() -> None:
    # `predictor.threshold = 0.5` with no model file (the daemon's default: rules tier only) alarmed on every
    # quiet tick, "failure risk 0.00 >= 0.50 (rules)": checkpoint-now and a drain request for a healthy node.
    health = LocalNodeHealth("n1", threshold=0.5)
    health.start_predictor(None, None, interval_s=0.0)
    t0 = time.time()
    quiet = [health.predictor.tick(t0 + i * 5.0, {"pcie.aer_fatal[0000:3b:00.0]": 0.0}) for i in range(3)]
    assert all(s is not None and not s.alarm and s.score == 0.0 for s in quiet), quiet
    assert not _alarms(health) and health.state == HealthState.INIT and not health.drain_pending
    hit = health.predictor.tick(t0 + 15.0, {"pcie.aer_fatal[0000:3b:00.0]": 1.0})  # a fatal AER error: the rules fire
    assert hit is not None and hit.alarm and hit.rule_hits, hit
    assert len(_alarms(health)) == 1 and health.state == HealthState.ALARMED


def test_unset_threshold_keeps_the_models_calibrated_one(model_file: str) -> None:
    health = LocalNodeHealth("n1")
    health.start_predictor(model_file, None, interval_s=0.0)
    scores = _feed(health.predictor, [NORMAL_C] * 40 + [HOT_C] * 4, time.time())
    # The same hot score: the node's own threshold is still calibrating (infinite), so no alarm.
    assert scores[-1].score >= 0.5 and math.isinf(scores[-1].threshold)
    assert math.isinf(health.threshold) and not _alarms(health) and health.state == HealthState.INIT
    assert health.alarms_per_day == 0.0  # the model's own count: no alarm at its threshold


def test_threshold_set_later_applies_from_the_next_score(model_file: str) -> None:
    health = LocalNodeHealth("n1")
    health.start_predictor(model_file, None, interval_s=0.0)
    t0 = time.time()
    _feed(health.predictor, [NORMAL_C] * 40, t0)
    health.threshold = 0.3  # a reload
    _feed(health.predictor, [HOT_C] * 2, t0 + 40 * 5.0)
    assert health.threshold == 0.3 and len(_alarms(health)) == 1
    health.threshold = float("nan")  # unset again: back to the model's own
    assert health.threshold == 0.3  # the last score was judged at 0.3; the next one shows the model's
    _feed(health.predictor, [HOT_C], t0 + 42 * 5.0)
    assert math.isinf(health.threshold)
    assert health.alarms_per_day == 0.0  # unset: the rate is the model's own again


def test_daemon_status_metrics_and_alarms_use_the_configured_threshold(tmp_path: Path, model_file: str) -> None:
    """The finding: ``predictor.threshold`` in the daemon's configuration had no effect (status, metrics and
    alarms used the model's own threshold)."""
    from trainguard.agent.agentd import AgentDaemon, config_loader
    from trainguard.agent.sdnotify import SystemdNotifier

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    body = (f'[metrics]\nlisten = "127.0.0.1:0"\n[detectors]\nroot = "{tmp_path / "fake"}"\n'
            f'[predictor]\nmodel = "{model_file}"\nthreshold = {{}}\n[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    config.write_text(body.format("0.5"))
    sock_path = tmp_path / "agent.sock"
    daemon = AgentDaemon(config_loader(str(config), "", str(sock_path), str(tmp_path / "state")),
                         SystemdNotifier(None))
    daemon.start()
    try:
        node = daemon.node_health
        _feed(node.predictor, [NORMAL_C] * 40 + [HOT_C] * 4, time.time())
        daemon._refresh()  # what the daemon's loop does each turn: live state into metrics and health
        alarms = [e for e in node.bus.recent(50) if e.kind == "predictor.alarm"]
        assert len(alarms) == 1, [e.kind for e in node.bus.recent(50)]
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            h = agent_pb2_grpc.NodeAgentStub(channel).GetHealth(agent_pb2.GetHealthRequest(), timeout=5)
        assert h.predictor_threshold == 0.5 and h.predictor_score >= 0.5
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon._metrics_server.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "trainguard_predictor_threshold 0.5" in text, [ln for ln in text.splitlines() if "threshold" in ln]
        # SIGHUP with a new threshold: status and metrics follow at once.
        config.write_text(body.format("0.95"))
        daemon.reload()
        daemon._refresh()
        with grpc.insecure_channel(f"unix:{sock_path}") as channel:
            h = agent_pb2_grpc.NodeAgentStub(channel).GetHealth(agent_pb2.GetHealthRequest(), timeout=5)
        assert h.predictor_threshold == pytest.approx(0.95)
    finally:
        daemon.stop()


def test_health_lifecycle_refuses_illegal_moves() -> None:
    life = Lifecycle("node health", HEALTH_TRANSITIONS, HealthState.INIT)
    with pytest.raises(IllegalTransitionError, match="no transition from INIT on drain_due"):
        life.fire(HealthTrigger.DRAIN_DUE)
    assert life.fire(HealthTrigger.START) == HealthState.WATCHING
    with pytest.raises(IllegalTransitionError):
        life.fire(HealthTrigger.DRAINED)  # nothing to drain
    assert life.fire(HealthTrigger.ALARM) == HealthState.ALARMED
    assert life.fire(HealthTrigger.DRAIN_DUE) == HealthState.DRAINING
    assert life.fire(HealthTrigger.DRAINED) == HealthState.WATCHING
    assert life.fire(HealthTrigger.STOP) == HealthState.STOPPED
    with pytest.raises(IllegalTransitionError):
        life.fire(HealthTrigger.START)  # a stopped watch does not come back


class StreamSource:
    """An event source that is not the local detectors (as a node daemon's event stream would be): events are
    pushed in from another thread; its statuses carry the conditions still active."""

    hardware_names = ("pcie",)

    def __init__(self) -> None:
        self.on_event = None
        self.sampled: list = []
        self.conditions: tuple = ()

    def start(self, on_event) -> None:
        self.on_event = on_event

    def stop(self) -> None:
        self.on_event = None

    def latest_metrics(self) -> dict[str, float]:
        return {"pcie.aer_correctable[0000:01:00.0]": 3.0}

    def statuses(self) -> list:
        from trainguard.detectors.base import DetectorState
        from trainguard.detectors.runner import DetectorStatus

        return [DetectorStatus(name="pcie", state=DetectorState.OK, conditions=self.conditions)]

    def sample_now(self, names, timeout_s: float):
        self.sampled.append(tuple(names))
        return []


def test_event_source_is_swappable() -> None:
    import threading

    from trainguard.agent.node_faults import NodeReportLedger
    from trainguard.detectors.events import Action, HealthEvent, Severity

    woken = threading.Event()
    source = StreamSource()
    health = LocalNodeHealth("n7", on_actionable=woken.set)
    health.start(source)
    assert health.state == HealthState.WATCHING
    sub = health.bus.subscribe()
    fatal = HealthEvent(source="pcie", kind="pcie.aer_fatal", severity=Severity.CRITICAL, action=Action.DRAIN_NODE,
                        message="AER fatal")
    exited = HealthEvent(source="process", kind="process.killed", severity=Severity.ERROR,
                         action=Action.RESTART_PROCESS, subject="rank:0", message="killed")
    for ev in (fatal, exited):
        threading.Thread(target=source.on_event, args=(ev,)).start()
    seen = [sub.get(timeout=2.0), sub.get(timeout=2.0)]
    assert {e.kind for e in seen} == {"pcie.aer_fatal", "process.killed"} and {e.node_id for e in seen} == {"n7"}
    assert woken.wait(2.0)
    # The supervisor sees worker exits itself: only the node-level fault waits for action.
    assert [e.kind for e in health.take_actionable()] == ["pcie.aer_fatal"] and health.take_actionable() == []
    # A worker failure asks the source for a fresh sample and finds the condition that still holds.
    assert health.hardware_cause(NodeReportLedger(), generation=1) is None and source.sampled == [("pcie",)]
    source.conditions = (fatal,)
    cause = health.hardware_cause(NodeReportLedger(), generation=1)
    assert cause is not None and cause.kind == "pcie.aer_fatal" and cause.node_id == "n7"
    health.stop()
    assert health.state == HealthState.STOPPED and source.on_event is None


def test_threshold_zero_alarms_on_no_quiet_tick_and_no_warming_up_score() -> None:
    # `predictor.threshold = 0` (valid: in [0, 1]) alarmed, asked for a checkpoint and drained the node on every
    # tick without a model ("failure risk 0.00 >= 0.00 (rules)"), and with one on every tick whose score was no
    # score yet (the baselines warming up, read as 0).
    from trainguard.predictor.online_feed import with_threshold
    from trainguard.predictor.runtime import WARMING_UP, Score

    health = LocalNodeHealth("n1", threshold=0.0)
    health.start_predictor(None, None, interval_s=0.0)
    t0 = time.time()
    quiet = [health.predictor.tick(t0 + i * 5.0, {"pcie.aer_fatal[0000:3b:00.0]": 0.0}) for i in range(3)]
    assert all(s is not None and not s.alarm for s in quiet), quiet
    assert not _alarms(health) and not health.drain_pending
    warming = Score("n1", t0, 0.0, math.inf, False, degraded=(WARMING_UP,))
    assert not with_threshold(warming, 0.0).alarm
    assert with_threshold(Score("n1", t0, 0.0, math.inf, False), 0.0).alarm  # a real score of 0 reaches 0


def test_a_clock_stepped_back_does_not_blind_the_rules_tier() -> None:
    # The samples were stamped with the raw wall clock; the predictor refuses a time that does not increase, so
    # after NTP stepped the clock back 10 minutes every tick was skipped for 10 minutes, and a fatal AER error
    # in them raised no alarm (no checkpoint advisory, no drain).
    walls = iter([1_000_000.0, 1_000_005.0, 999_405.0, 999_410.0])
    health = LocalNodeHealth("n1", wall_clock=lambda: next(walls))
    health.start_predictor(None, None, interval_s=0.0)
    fatal = "pcie.aer_fatal[0000:3b:00.0]"
    health.tick(metrics={fatal: 0.0})
    health.tick(metrics={fatal: 0.0})
    health.tick(metrics={fatal: 0.0})  # the clock stepped back
    health.tick(metrics={fatal: 1.0})
    last = health.predictor.last_score
    assert last is not None and last.alarm and last.rule_hits and last.ts > 1_000_005.0, last
    assert len(_alarms(health)) == 1 and health.drain_pending


def test_a_tick_interval_other_than_the_models_is_named(model_file: str, caplog) -> None:
    # `trainguard run --predictor-interval-s 0.5` with a model trained at 5 s scored in silence on features the
    # model never saw (coverage, gaps and baselines count rows against the trained interval).
    with caplog.at_level("WARNING", logger="trainguard.agent.node_health"):
        LocalNodeHealth("n1").start_predictor(model_file, None, interval_s=5.0)
        assert not caplog.records
        LocalNodeHealth("n1").start_predictor(model_file, None, interval_s=0.5)
    assert any("every 5 s but scores every 0.5 s" in r.getMessage() for r in caplog.records), caplog.records


def test_daemon_threshold_gauge_does_not_read_0_before_the_first_score(tmp_path: Path) -> None:
    # The metrics start at NaN so that an alert rule `score >= threshold` does not fire on 0 >= 0 at start-up,
    # but the daemon copied the node health's threshold of 0.0 (no score yet, none configured) over it at once.
    from prometheus_client.parser import text_string_to_metric_families

    from trainguard.agent.agentd import AgentDaemon, config_loader
    from trainguard.agent.sdnotify import SystemdNotifier

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[metrics]\nlisten = "127.0.0.1:0"\n[detectors]\nroot = "{tmp_path / "fake"}"\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    daemon = AgentDaemon(config_loader(str(config), "", str(tmp_path / "agent.sock"), str(tmp_path / "state")),
                         SystemdNotifier(None))
    daemon.start()
    try:
        daemon._refresh()
        with urllib.request.urlopen(f"http://127.0.0.1:{daemon._metrics_server.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        daemon.stop()
    value = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    score, threshold = value["trainguard_predictor_score"], value["trainguard_predictor_threshold"]
    assert not score >= threshold, (score, threshold)


def test_a_rules_alarm_for_a_reported_fault_is_about_the_faults_generation() -> None:
    # A fatal AER error: the pcie detector's event had the node reported at once (generation 1) and the
    # coordinator restarted the job (generation 2); a tick later the rules tier alarmed on the same counter,
    # stamped generation 2, and its drain (which stands down only for a report since the alarm's generation)
    # restarted the job a second time: two restarts of the budget for one fault (seen with `trainguard run`).
    from trainguard.detectors.events import Action, HealthEvent, Severity

    generation = [1]
    health = LocalNodeHealth("n1", generation=lambda: generation[0])
    health.start_predictor(None, None, interval_s=0.0, drain_grace_s=0.0)
    fatal = "pcie.aer_fatal[0000:3b:00.0]"
    health.tick(metrics={fatal: 0.0})
    health.observe(HealthEvent(source="pcie", kind="pcie.aer_fatal", severity=Severity.CRITICAL,
                               action=Action.DRAIN_NODE, message="1 new uncorrectable fatal error(s)",
                               subject="0000:3b:00.0"))
    generation[0] = 2  # the coordinator restarted the job for it
    health.tick(metrics={fatal: 1.0})
    due = health.due_drain(lambda step: False)
    assert due is not None and due[1] == 1, due
    health.drained()
    for _ in range(3):  # a later fault the detectors did not report is about the generation it happens in
        health.tick(metrics={fatal: 1.0})
    health.tick(metrics={fatal: 2.0})
    due = health.due_drain(lambda step: False)
    assert due is not None and due[1] == 2, due


def test_a_failure_after_a_clock_step_back_is_stamped_on_the_samples_clock(tmp_path: Path) -> None:
    # After a step back the samples are stamped on continued time, but the failure's time (the supervisor's
    # detected_at, time.time()) went into the history as is: its label sat the step (here 600 s) before the
    # samples around it, so training and evaluation read the wrong samples as "before the failure".
    from trainguard.predictor.history import MetricHistory

    wall = [1_000_000.0]
    health = LocalNodeHealth("n1", wall_clock=lambda: wall[0])
    health.start_predictor(None, str(tmp_path / "h.sqlite"), interval_s=0.0)
    fatal = "pcie.aer_fatal[0000:3b:00.0]"
    health.tick(metrics={fatal: 0.0})
    wall[0] = 1_000_005.0
    health.tick(metrics={fatal: 0.0})
    wall[0] = 999_405.0  # the clock stepped back 600 s
    health.tick(metrics={fatal: 0.0})
    health.record_failure(wall[0], "process.exit")  # stamped by the supervisor on the stepped-back clock
    health.tick(metrics={fatal: 0.0})
    samples, events = MetricHistory(tmp_path / "h.sqlite", readonly=True).to_tables()
    assert len(samples.ts) == 4 and len(events) == 1
    # the failure lies among the samples it came with: after the third, not 600 s before all of them
    assert samples.ts[2] <= events.ts[0] <= samples.ts[3], (samples.ts, events.ts)


def test_a_restart_after_a_clock_step_back_goes_on_recording_history(tmp_path: Path, caplog) -> None:
    # The history's newest sample of the node was ahead of the wall clock after an agent restart (the clock had
    # stepped back 600 s): every append was refused until the clock passed it, logged once, so for the length of
    # the step the history (the next model's training data) recorded nothing while scoring went on.
    from trainguard.predictor.history import MetricHistory

    path = tmp_path / "h.sqlite"
    with MetricHistory(path) as h:
        for i in range(3):
            h.append(1_000_600.0 + i * 5.0, "n1", {"gpu_temp_c": 60.0})
    wall = [1_000_000.0]
    health = LocalNodeHealth("n1", wall_clock=lambda: wall[0])
    with caplog.at_level("WARNING"):
        health.start_predictor(None, str(path), interval_s=0.0)
        for _ in range(3):
            health.tick(metrics={"pcie.aer_fatal[0000:3b:00.0]": 0.0})
            wall[0] += 5.0
    samples, _ = MetricHistory(path, readonly=True).to_tables()
    assert len(samples.ts) == 6 and np.all(np.diff(samples.ts) > 0), samples.ts
    steps = [r.getMessage() for r in caplog.records if "ahead of the wall clock" in r.getMessage()]
    assert len(steps) == 1 and "610.0 s" in steps[0] and str(path) in steps[0], caplog.records
    assert not [r for r in caplog.records if "cannot store" in r.getMessage()], caplog.records


def test_daemon_scores_at_its_configured_predictor_interval(tmp_path: Path, model_file: str) -> None:
    # The daemon had no [predictor] interval_s: it always scored every 5 s, and a model trained at another
    # interval got only a warning pointing at a `trainguard run` flag the daemon does not have.
    from trainguard.agent.agentd import AgentDaemon, config_loader
    from trainguard.agent.sdnotify import SystemdNotifier

    (tmp_path / "fake").mkdir()
    config = tmp_path / "agent.toml"
    config.write_text(f'[detectors]\nroot = "{tmp_path / "fake"}"\n'
                      f'[predictor]\nmodel = "{model_file}"\ninterval_s = 2.5\n'
                      f'[memory_tier]\nroot = "{tmp_path / "shm"}"\n')
    daemon = AgentDaemon(config_loader(str(config), "", str(tmp_path / "agent.sock"), str(tmp_path / "state")),
                         SystemdNotifier(None))
    records: list[logging.LogRecord] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = records.append  # type: ignore[method-assign]  # the daemon's log set-up stops propagation
    logging.getLogger("trainguard.agent.node_health").addHandler(catch)
    try:
        daemon.start()
        assert daemon.node_health.interval_s == 2.5
        assert any("every 5 s but scores every 2.5 s" in r.getMessage() and "(predictor.interval_s)" in r.getMessage()
                   for r in records), records
    finally:
        logging.getLogger("trainguard.agent.node_health").removeHandler(catch)
        daemon.stop()

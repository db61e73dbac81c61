"""The trace-driven ETTR model: Young/Daly agreement, monotonicity, accounting, defaults, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from trainguard.drill.components import (
    Components,
    baseline_defaults,
    load_components,
    trainguard_defaults,
)
from trainguard.drill.errors import ComponentsError, TraceError
from trainguard.drill.ettr import JobSize, build_timeline, evaluate, optimise_interval, simulate, young_daly
from trainguard.faultfacts.taxonomy import LLAMA3_CATEGORIES, FaultClass, classify_stepfun
from trainguard.drill.trace import DAY_S, Fault, FaultTrace, llama3_trace, load_stepfun, poisson_trace, trace_dir

STEPFUN = trace_dir()
needs_stepfun = pytest.mark.skipif(
    not (STEPFUN / "fault_trace.json").is_file(),
    reason=f"StepFun fault trace not found at {STEPFUN} (set TRAINGUARD_FAULT_TRACE_DIR to its folder)",
)


def _plain(**kw) -> Components:
    """Components with no detection, recovery or prediction: only checkpoint stall and lost work remain."""
    zero = {f"detect_{c.value}_s": 0.0 for c in FaultClass}
    base = dict(name="plain", checkpoint_stall_s=100.0, persist_s=0.0, memory_restore=False,
                recovery_process_s=0.0, recovery_node_s=0.0, recovery_job_s=0.0, predicted_share=0.0, **zero)
    base.update(kw)
    return Components(**base)


def _exp_trace(mtbf_s: float, faults: int, seed: int = 1) -> FaultTrace:
    days = mtbf_s * faults / DAY_S
    return poisson_trace("exp", DAY_S / mtbf_s, 1, days, {FaultClass.CRASH: 1.0}, seed=seed)


def test_optimum_agrees_with_young_daly_on_exponential_faults():
    comp = _plain()
    tl = build_timeline(_exp_trace(10_000.0, 20_000), comp)
    best = optimise_interval(tl, comp)
    yd = young_daly(tl, comp)
    assert yd.young_s == pytest.approx(math.sqrt(2 * 100.0 * yd.mtbf_s))
    assert yd.mtbf_s == pytest.approx(10_000.0, rel=0.03)
    # Young: 1414 s; Daly's refinement: ~1350 s. The numerical optimum must sit with them.
    assert best == pytest.approx(yd.daly_s, rel=0.12)
    assert best == pytest.approx(yd.young_s, rel=0.15)
    # And the ETTR there is what first-order theory predicts: 1 - d/tau - tau/(2M) (within a point).
    theory = 1 - 100.0 / best - best / (2 * yd.mtbf_s)
    assert evaluate(tl, comp, best).ettr == pytest.approx(theory, abs=0.01)


def test_accounting_adds_up_to_wall_time():
    tr = llama3_trace(days=30, seed=3)
    for comp in (trainguard_defaults(), baseline_defaults()):
        rep = simulate(tr, JobSize(), comp)
        r = rep.result
        assert r.useful_s + r.stall_s + r.lost_s + r.down_s == pytest.approx(r.span_s)
        assert min(r.useful_s, r.stall_s, r.lost_s, r.down_s) >= 0
        assert 0 < r.ettr < 1


def test_ettr_falls_as_recovery_time_grows():
    tr = llama3_trace(days=60, seed=2)
    job = JobSize()
    fixed, optimised = [], []
    for rec in (0.0, 30.0, 120.0, 600.0, 3600.0):
        comp = trainguard_defaults(recovery_node_s=rec, recovery_process_s=rec)
        tl = build_timeline(tr.for_job(job.nodes), comp)
        fixed.append(evaluate(tl, comp, 300.0).ettr)
        optimised.append(simulate(tr, job, comp).result.ettr)
    assert all(a > b for a, b in zip(fixed, fixed[1:])), fixed
    assert all(a > b for a, b in zip(optimised, optimised[1:])), optimised


def test_prediction_and_fast_persist_help():
    tr = llama3_trace(days=60, seed=4)
    job = JobSize()
    by_share = [simulate(tr, job, trainguard_defaults(predicted_share=s)).result.ettr for s in (0.0, 0.5, 1.0)]
    assert by_share[0] < by_share[1] < by_share[2]
    by_persist = [simulate(tr, job, trainguard_defaults(persist_s=p, checkpoint_interval_s=120.0)).result.ettr
                  for p in (0.0, 60.0, 600.0)]
    assert by_persist[0] > by_persist[1] > by_persist[2]


def test_baseline_below_trainguard_with_shipped_defaults_llama3():
    tr = llama3_trace()
    tg = simulate(tr, JobSize(), trainguard_defaults()).result.ettr
    bl = simulate(tr, JobSize(), baseline_defaults()).result.ettr
    assert bl < tg


@needs_stepfun
def test_stepfun_trace_replayed_whole_and_baseline_below_trainguard():
    tr = load_stepfun()
    assert len(tr.faults) == 584 and tr.population_nodes == 400
    assert tr.span_s / DAY_S == pytest.approx(349.0, abs=0.1)
    scaled = tr.for_job(2048)
    assert scaled.rate_per_node_day == pytest.approx(tr.rate_per_node_day)
    assert [f.label for f in scaled.faults] == [f.label for f in tr.faults]
    tg = simulate(tr, JobSize(), trainguard_defaults()).result
    bl = simulate(tr, JobSize(), baseline_defaults()).result
    assert tg.faults == bl.faults == 584
    assert bl.ettr < tg.ettr


@needs_stepfun
def test_every_stepfun_fault_type_has_a_class():
    stats = json.loads((STEPFUN / "fault_statistics.json").read_text())
    for level, classes in stats.items():
        for cls, descs in classes.items():
            if cls == "LevelTotal":
                continue
            for desc in descs:
                if desc != "ClassTotal":
                    assert classify_stepfun(level, cls, desc) is not None, (level, cls, desc)


def test_llama3_figures():
    assert sum(n for n, _ in LLAMA3_CATEGORIES.values()) == 419
    tr = llama3_trace(days=348)
    # 419 per 54 days on 2,048 nodes, within Poisson noise of ~2,700 draws
    assert len(tr.faults) == pytest.approx(419 / 54 * 348, rel=0.06)


def test_bad_component_values_are_refused():
    for bad in ({"recovery_node_s": -1.0}, {"checkpoint_stall_s": float("nan")}, {"detect_hang_s": "5"},
                {"predicted_share": 1.5}, {"checkpoint_interval_s": 0.0}, {"levels": {"crash": "reboot"}},
                {"predictable": ["gpu"]}, {"no_such_field": 1}):
        with pytest.raises(ComponentsError):
            trainguard_defaults(**bad)
    comp = trainguard_defaults()
    tl = build_timeline(llama3_trace(days=5), comp)
    with pytest.raises(ComponentsError):
        evaluate(tl, comp, -5.0)
    with pytest.raises(ComponentsError):
        JobSize(gpus=0)


def test_components_file(tmp_path):
    f = tmp_path / "measured.json"
    f.write_text(json.dumps({"_source": "bench", "trainguard": {"recovery_process_s": 3.5, "levels": {"hang": "job"}},
                             "baseline": {"checkpoint_stall_s": 2.0}}))
    tg, bl = load_components(f)
    assert tg.recovery_process_s == 3.5 and tg.levels["hang"] == "job" and tg.levels["crash"] == "process"
    assert bl.checkpoint_stall_s == 2.0 and bl.recovery_job_s == baseline_defaults().recovery_job_s
    for text in ("[]", "{not json", json.dumps({"torchrun": {}}), json.dumps({"trainguard": {"stall": 1}}),
                 json.dumps({"baseline": {"recovery_job_s": -3}})):
        f.write_text(text)
        with pytest.raises(ComponentsError):
            load_components(f)
    with pytest.raises(ComponentsError, match="not found"):
        load_components(tmp_path / "missing.json")


def test_bad_traces_are_refused(tmp_path):
    with pytest.raises(TraceError, match="no faults"):
        FaultTrace(name="empty", faults=(), span_s=10.0, population_nodes=1)
    with pytest.raises(TraceError, match="sorted"):
        FaultTrace(name="x", faults=(Fault(5.0, FaultClass.CRASH, "a"), Fault(1.0, FaultClass.CRASH, "b")),
                   span_s=10.0, population_nodes=1)
    f = tmp_path / "fault_trace.json"
    for text, match in (("[]", "no fault_start"), ("{}", "JSON list"), ("nope", "not readable|cannot read"),
                        (json.dumps([{"event_time": 1.0}]), "malformed"),
                        (json.dumps([{"event_time": 1.0, "event_type": "fault_start",
                                      "fault_type": {"Level": "Cosmic", "Class": "Ray", "Desc": "?"}}]),
                         "no fault class")):
        f.write_text(text)
        with pytest.raises(TraceError, match=match):
            load_stepfun(tmp_path)
    with pytest.raises(TraceError, match="not found"):
        load_stepfun(tmp_path / "nowhere")
    with pytest.raises(TraceError):
        poisson_trace("x", -1.0, 1, 1.0, {"crash": 1.0})
    with pytest.raises(TraceError):
        llama3_trace().for_job(0)


def test_timeline_restarts_recovery_on_overlapping_fault():
    faults = (Fault(1000.0, FaultClass.CRASH, "a"), Fault(1010.0, FaultClass.CRASH, "b"))
    tr = FaultTrace(name="two", faults=faults, span_s=5000.0, population_nodes=1)
    comp = _plain(recovery_process_s=100.0)
    tl = build_timeline(tr, comp)
    assert tl.run_s[1] < 0  # the second fault struck during the first recovery
    assert tl.end_run_s == pytest.approx(5000.0 - 1110.0)
    r = evaluate(tl, comp, 200.0)
    assert r.down_s == pytest.approx(110.0)
    assert np.all(r.retained_s >= 0)


def test_shipped_measured_components_load_and_merge() -> None:
    """The component files the README's 16k-GPU figures come from are valid and merge in order."""
    from trainguard.drill.components import load_components

    root = Path(__file__).resolve().parents[2] / "bench" / "components"
    files = [root / "drill-cluster.json", root / "checkpoint-2gib.json"]
    tg, bl = load_components(files)
    assert tg.checkpoint_stall_s < 0.1 and tg.recovery_node_s > 30.0  # measured stall; restarts carry the scale term
    assert tg.detect_node_down_s >= 10.0 and bl.checkpoint_stall_s == 60.0
    only_drill, _ = load_components([files[0]])
    assert only_drill.checkpoint_stall_s == 1.0  # the default until the checkpoint file is merged

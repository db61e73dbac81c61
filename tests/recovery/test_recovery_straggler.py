"""Straggler detection (recovery/straggler.py): scores, persistence, hysteresis, job-wide slowdowns, replace policy."""

from __future__ import annotations

import random

import pytest

from trainguard.recovery.errors import InvalidRequestError
from trainguard.recovery.straggler import (TRANSITIONS, FlagState, ReplacePolicy, StragglerConfig, StragglerDetector,
                                           Timing)


def _beat(det: StragglerDetector, now: float, own: dict[int, float], wait_extra: float = 0.0, gen: int = 1,
          ranks_per_node: int = 1, steps: int = 4):
    """One heartbeat per rank: own work given; every rank's step is the slowest own work (synchronous)."""
    step = max(own.values()) + wait_extra
    ts = [Timing(r, f"n{r // ranks_per_node}", 0, step, step - v, v, steps) for r, v in own.items()]
    return det.observe(gen, ts, now)


def _run(det, seconds, own_fn, t0=0.0, dt=0.5, **kw):
    results = []
    t = t0
    while t < t0 + seconds:
        r = _beat(det, t, own_fn(t), **kw)
        if r is not None:
            results.append(r)
        t += dt
    return results, t


def test_transition_table_covers_every_state_and_move():
    for st in FlagState:
        assert (st, "over") in TRANSITIONS and (st, "under") in TRANSITIONS
    assert TRANSITIONS[(FlagState.SUSPECT, "persisted")] is FlagState.SLOW
    assert TRANSITIONS[(FlagState.SLOW, "cleared")] is FlagState.HEALTHY


def test_a_slow_rank_is_flagged_after_persistence_with_its_ratio_and_cost():
    det = StragglerDetector(StragglerConfig(window_s=2.0, persist_windows=4))
    res, t = _run(det, 20, lambda t: {0: 0.10, 1: 0.10, 2: 0.10, 3: 0.10})
    assert all(not r.slow_ranks for r in res)
    res, t = _run(det, 6, lambda t: {0: 0.10, 1: 0.10, 2: 0.20, 3: 0.10}, t0=t)
    assert not any(r.slow_ranks for r in res), "flagged before persist_windows windows"
    res, t = _run(det, 6, lambda t: {0: 0.10, 1: 0.10, 2: 0.20, 3: 0.10}, t0=t)
    slow = res[-1].slow_ranks
    assert [f.rank for f in slow] == [2]
    assert slow[0].ratio == pytest.approx(2.0)
    assert slow[0].excess_s == pytest.approx(0.10)
    assert slow[0].node_id == "n2" and slow[0].basis == "wait"
    assert [f.node_id for f in res[-1].slow_nodes] == ["n2"]


def test_one_noisy_window_never_fires():
    det = StragglerDetector(StragglerConfig(window_s=2.0, persist_windows=4))
    t = 0.0
    for i in range(200):
        own = {0: 0.1, 1: 0.1, 2: 0.1}
        if i % 12 == 5:  # one window's worth of a 5x spike on a rotating rank, then normal again
            own[i % 3] = 0.5
        r = _beat(det, t, own)
        assert r is None or not r.slow_ranks
        t += 0.5


def test_job_wide_slowdown_is_not_a_straggler_but_shows_in_the_individual_score():
    det = StragglerDetector(StragglerConfig(window_s=2.0))
    _, t = _run(det, 20, lambda t: {0: 0.1, 1: 0.1, 2: 0.1})
    res, t = _run(det, 30, lambda t: {0: 0.3, 1: 0.3, 2: 0.3}, t0=t)
    assert not any(r.slow_ranks for r in res)
    assert res[-1].job_slowdown == pytest.approx(3.0, rel=0.05)


def test_flag_clears_only_after_clear_windows_below_clear_ratio():
    cfg = StragglerConfig(window_s=2.0, persist_windows=2, clear_windows=3, slow_ratio=1.3, clear_ratio=1.1)
    det = StragglerDetector(cfg)
    _, t = _run(det, 12, lambda t: {0: 0.1, 1: 0.2})
    assert det.state_of(1) is FlagState.SLOW
    # Between clear_ratio and slow_ratio: stays flagged (hysteresis), however long.
    _, t = _run(det, 20, lambda t: {0: 0.1, 1: 0.12}, t0=t)
    assert det.state_of(1) is FlagState.SLOW
    res, t = _run(det, 4, lambda t: {0: 0.1, 1: 0.1}, t0=t)
    assert det.state_of(1) is FlagState.SLOW
    _, t = _run(det, 6, lambda t: {0: 0.1, 1: 0.1}, t0=t)
    assert det.state_of(1) is FlagState.HEALTHY


def test_two_ranks_leave_one_out_and_node_scores():
    det = StragglerDetector(StragglerConfig(window_s=1.0, persist_windows=2))
    res, _ = _run(det, 10, lambda t: {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.25}, ranks_per_node=2)
    last = res[-1]
    assert last.node_ratios["n1"] == pytest.approx(0.175 / 0.1)
    assert [f.node_id for f in last.slow_nodes] == ["n1"]


def test_new_generation_starts_fresh_and_old_generations_are_ignored():
    det = StragglerDetector(StragglerConfig(window_s=1.0, persist_windows=2))
    _run(det, 8, lambda t: {0: 0.1, 1: 0.3})
    assert det.state_of(1) is FlagState.SLOW
    assert _beat(det, 100.0, {0: 0.1, 1: 0.1}, gen=2) is None
    assert det.state_of(1) is FlagState.HEALTHY
    assert det.observe(1, [Timing(1, "n1", 0, 1.0, 0.0, 1.0, 5)], 200.0) is None


def test_without_sections_only_the_individual_score_is_kept():
    det = StragglerDetector(StragglerConfig(window_s=1.0))
    for i in range(20):
        r = det.observe(1, [Timing(0, "a", i, 0.1, -1, -1, 4), Timing(1, "b", i, 0.1, -1, -1, 4)], i * 0.5)
        assert r is None or (not r.ratios and not r.slow_ranks)


def test_healthy_noisy_run_raises_no_alarm_over_a_long_soak():
    """8 ranks, heavy-tailed noise on each rank's own work (descheduling on a shared 2-core machine), periodic
    job-wide slowdowns: 4 simulated hours of heartbeats, no straggler may be flagged."""
    rng = random.Random(18)
    det = StragglerDetector()
    t, alarms, windows = 0.0, 0, 0
    while t < 4 * 3600:
        job = 2.0 if (t // 600) % 7 == 3 else 1.0  # a job-wide slowdown for 10 minutes now and then
        own = {}
        for r in range(8):
            x = 0.1 * job * rng.lognormvariate(0, 0.08)
            if rng.random() < 0.05:
                x *= rng.uniform(1.5, 4.0)  # a descheduled rank: one bad heartbeat summary
            own[r] = x
        res = _beat(det, t, own)
        if res is not None:
            windows += 1
            alarms += len(res.slow_ranks) + len(res.slow_nodes)
        t += 0.5
    assert windows > 5000
    assert alarms == 0


def test_config_errors_name_the_field():
    for bad, field in [({"slow_ratio": 1.0}, "slow_ratio"), ({"clear_ratio": 2.0}, "clear_ratio"),
                       ({"persist_windows": 0}, "persist_windows"), ({"action": "evict"}, "action"),
                       ({"window_s": 0}, "window_s")]:
        with pytest.raises(InvalidRequestError, match=field):
            StragglerDetector(StragglerConfig(**bad))


def test_replace_policy_pays_off_only_beyond_the_restart_cost_and_respects_cooldown():
    cfg = StragglerConfig(window_s=1.0, persist_windows=2, action="replace", horizon_s=600, restart_cost_s=30,
                          margin=2.0, cooldown_s=100)
    det = StragglerDetector(cfg)
    pol = ReplacePolicy(cfg)
    res, t = _run(det, 8, lambda t: {0: 0.1, 1: 0.1, 2: 0.2})
    r = res[-1]
    # 100 ms lost per 200 ms step over 600 s = 300 s saved >= 2 x 30 s.
    d = pol.decide(r, t, spares=1)
    assert d is not None and d.node_id == "n2" and d.saved_s == pytest.approx(300.0)
    assert pol.decide(r, t, spares=0) is None
    pol.applied(d, t, step_reached=500, generation=1)
    assert pol.decide(r, t + 1, spares=1) is None  # one replacement at a time
    assert pol.progress(2, 400, t + 5) is None       # not back at step 500 yet
    assert pol.progress(2, 500, t + 12) == pytest.approx(12.0)
    assert pol.measured and pol.cost_s == pytest.approx(12.0)
    assert pol.decide(r, t + 50, spares=1) is None  # cooldown
    assert pol.decide(r, t + 200, spares=1) is not None
    small = ReplacePolicy(StragglerConfig(action="replace", horizon_s=10, restart_cost_s=30))
    assert small.decide(r, t, spares=1) is None  # 5 s saved over 10 s does not pay a 30 s restart
    report_only = ReplacePolicy(StragglerConfig(action="report"))
    assert report_only.decide(r, t, spares=1) is None


def test_a_slow_link_is_valued_at_the_job_slowdown_it_causes():
    """Measured shape of the tbf drill: the capped node waits ~40 ms less in a 1.5 s all-reduce (own work 70 vs
    35 ms) while every step went from 0.2 s to 1.5 s."""
    cfg = StragglerConfig(window_s=1.0, persist_windows=2, action="replace", horizon_s=600, restart_cost_s=30,
                          min_excess=0.0)  # the default 0.1 keeps such a small own-work excess from ever firing
    det = StragglerDetector(cfg)
    _, t = _run(det, 10, lambda t: {0: 0.035, 1: 0.035, 2: 0.035}, wait_extra=0.165)
    res, t = _run(det, 6, lambda t: {0: 0.035, 1: 0.07, 2: 0.035}, wait_extra=1.43, t0=t)
    r = res[-1]
    assert [f.node_id for f in r.slow_nodes] == ["n1"] and r.job_slowdown > 5
    d = ReplacePolicy(cfg).decide(r, t, spares=1)
    assert d is not None and d.saved_s > 500  # the own-work excess alone (35 ms of 1.5 s) would say ~14 s


def test_min_excess_keeps_a_sliver_of_a_communication_bound_step_from_firing():
    det = StragglerDetector(StragglerConfig(window_s=1.0, persist_windows=2))
    res, _ = _run(det, 12, lambda t: {0: 0.01, 1: 0.01, 2: 0.02}, wait_extra=0.5)  # 2x own work, 2% of the step
    assert res and not any(r.slow_ranks or r.slow_nodes for r in res)


def test_leave_one_out_medians_match_the_definition():
    from trainguard.recovery.straggler import _leave_one_out_medians

    rng = random.Random(3)
    for n in (2, 3, 4, 7, 10):
        vals = {i: rng.choice([0.1, 0.2, 0.3, rng.random()]) for i in range(n)}
        fast = _leave_one_out_medians(vals)
        for k in vals:
            import statistics

            assert fast[k] == pytest.approx(statistics.median(v for q, v in vals.items() if q != k))


def _window(det: StragglerDetector, t: float, gen: int = 1, own: float = 0.1):
    """Feeds heartbeats until a window closes; returns (snapshot, time)."""
    while True:
        ts = [Timing(r, f"n{r}", 0, 0.2, 0.2 - own, own, 4) for r in range(3)]
        snap = det.collect(gen, ts, t)
        t += 0.5
        if snap is not None:
            return snap, t


def test_a_window_scored_after_a_new_generation_began_is_dropped_not_applied():
    # The coordinator closes a window under its lock and scores it outside; a restart may come in between.
    det = StragglerDetector(StragglerConfig(window_s=2.0))
    snap, t = _window(det, 0.0)
    assert snap.generation == 1 and set(snap.samples) == {0, 1, 2}
    det.collect(2, [], t)  # generation 2 starts (reset) before the generation-1 window is scored
    assert det.score(snap) is None and det.last is None
    snap2, t = _window(det, t, gen=2)
    res = det.score(snap2)
    assert res is not None and res.generation == 2 and det.is_current(res) and det.last is res


def test_an_older_window_scored_after_a_newer_one_is_dropped():
    det = StragglerDetector(StragglerConfig(window_s=2.0))
    older, t = _window(det, 0.0)
    newer, t = _window(det, t)
    assert newer.seq == older.seq + 1
    assert det.score(newer) is not None
    assert det.score(older) is None, "a late, older window must not overwrite the newer findings"


def test_collect_then_score_gives_the_same_findings_as_observe():
    cfg = StragglerConfig(window_s=2.0, persist_windows=3)
    a, b = StragglerDetector(cfg), StragglerDetector(cfg)
    last_a = last_b = None
    t = 0.0
    for i in range(80):
        own = {0: 0.1, 1: 0.1, 2: 0.3 if i > 30 else 0.1}
        ts = [Timing(r, f"n{r}", i, 0.3, 0.3 - v, v, 4) for r, v in own.items()]
        last_a = a.observe(1, ts, t) or last_a
        snap = b.collect(1, ts, t)
        last_b = (b.score(snap) if snap else None) or last_b
        t += 0.5
    assert [f.rank for f in last_a.slow_ranks] == [f.rank for f in last_b.slow_ranks] == [2]
    assert last_a.ratios == last_b.ratios


def test_a_lone_slow_node_is_valued_at_what_the_job_lost_even_below_the_slowdown_ratio():
    """The replace-drill flake (2 nodes + spare, horizon 600 s, 60 s assumed restart, margin 2: a saving must be
    >= 120 s). Under background load the healthy step is already 200 ms and the CPU-starved rank is starved inside
    its `comm` section too, so its own-work excess is 50 ms of a 255 ms step (600 x 50/255 = 118 s: never worth
    it) while the job's step grew by 55 ms (129 s). It used to be reported for ever and never replaced."""
    cfg = StragglerConfig(window_s=1.0, persist_windows=2, action="replace", horizon_s=600, restart_cost_s=60)
    det = StragglerDetector(cfg)
    _, t = _run(det, 12, lambda t: {0: 0.15, 1: 0.15}, wait_extra=0.05)
    res, t = _run(det, 6, lambda t: {0: 0.15, 1: 0.20}, wait_extra=0.055, t0=t)
    r = res[-1]
    assert [f.node_id for f in r.slow_nodes] == ["n1"] and r.slow_nodes[0].excess_s == pytest.approx(0.05)
    assert 1.0 < r.job_slowdown < cfg.slow_ratio
    pol = ReplacePolicy(cfg)
    d = pol.decide(r, t, spares=1)
    assert d is not None and d.node_id == "n1" and d.saved_s == pytest.approx(600 * 0.055 / 0.255, rel=0.02)
    # Below the margin, the policy says why (the coordinator logs it and puts it in the status message).
    stingy = ReplacePolicy(StragglerConfig(action="replace", horizon_s=600, restart_cost_s=100))
    assert stingy.decide(r, t, spares=1) is None
    assert stingy.verdict.startswith("not replacing node n1") and "less than 2 x the assumed restart cost" in \
        stingy.verdict


def test_a_closed_windows_node_map_is_not_changed_by_later_beats():
    # The snapshot shares the detector's rank -> node map (no 16k-entry copy under the lock); a later change
    # must copy first, or a window being scored would see ranks move under it.
    det = StragglerDetector(StragglerConfig(window_s=2.0))
    snap, t = _window(det, 0.0)
    assert snap.node_of[1] == "n1"
    det.collect(1, [Timing(1, "n9", 0, 0.2, 0.1, 0.1, 4)], t)
    assert snap.node_of[1] == "n1" and det._node_of[1] == "n9"


def test_a_window_waits_for_min_steps_from_every_rank_then_closes_anyway_after_five_lengths():
    det = StragglerDetector(StragglerConfig(window_s=1.0, min_steps=3))
    t, snap = 0.0, None
    while snap is None:  # rank 1 completes 1 step per beat, rank 0 ten: rank 1 holds the window open
        snap = det.collect(1, [Timing(0, "a", 0, 0.1, 0.05, 0.05, 10), Timing(1, "b", 0, 0.1, 0.05, 0.05, 1)], t)
        t += 0.5
    assert t - 0.5 == 1.0 and sum(x.steps for x in snap.samples[1]) == 3
    det2 = StragglerDetector(StragglerConfig(window_s=1.0, min_steps=100))
    closed = [det2.collect(1, [Timing(r, "a", 0, 0.1, 0.05, 0.05, 1) for r in range(2)], k * 0.5) for k in range(12)]
    assert any(c is not None for c in closed)  # by 5 window lengths, even short

"""Slow-link localisation (recovery/link_locator.py): the pairing schedule, who is named, the campaign's state
machine, and the coordinator asking for probes and naming/replacing the node (on plain types, simulated clock)."""

from __future__ import annotations

import itertools
import random

import pytest

from trainguard.recovery.domain import LinkProbeResult
from trainguard.recovery.errors import InvalidRequestError
from trainguard.recovery.link_locator import (TRANSITIONS, LinkLocator, LinkProbeConfig, ProbeState, localise_links,
                                              pair_rounds)
from trainguard.recovery.straggler import StragglerConfig

MB = 1e6


@pytest.mark.parametrize("n", [3, 4, 5, 8])
def test_rounds_are_matchings_and_cover_every_pair_repeats_times(n):
    nodes = [f"n{i}" for i in range(n)]
    rounds = pair_rounds(nodes, max_peers=n, repeats=2)
    seen: dict[frozenset, int] = {}
    for r in rounds:
        busy = [x for pair in r for x in pair]
        assert len(busy) == len(set(busy)), "a node runs two probes in one round"
        for a, b in r:
            seen[frozenset((a, b))] = seen.get(frozenset((a, b)), 0) + 1
    assert set(seen) == {frozenset(p) for p in itertools.combinations(nodes, 2)}
    assert set(seen.values()) == {2}


def test_a_large_job_pairs_each_node_with_max_peers_others_only():
    nodes = [f"n{i:03d}" for i in range(64)]
    rounds = pair_rounds(nodes, max_peers=4, repeats=1)
    assert len(rounds) == 4
    per_node: dict[str, int] = {}
    for r in rounds:
        for a, b in r:
            per_node[a] = per_node.get(a, 0) + 1
            per_node[b] = per_node.get(b, 0) + 1
    assert set(per_node.values()) == {4} and len(per_node) == 64


def test_the_common_end_of_the_slow_pairs_is_named_and_only_it():
    rates = {frozenset(("a", "b")): 5 * MB, frozenset(("b", "c")): 4 * MB, frozenset(("a", "c")): 900 * MB}
    named = localise_links(rates, link_ratio=4.0)
    assert [n[0] for n in named] == ["b"]
    node, ratio, med, ref, pairs = named[0]
    assert ref == 900 * MB and med == pytest.approx(4.5 * MB) and pairs == 2 and ratio == pytest.approx(200)


def test_noisy_healthy_links_name_no_one():
    rng = random.Random(7)
    nodes = [f"n{i}" for i in range(5)]
    for _ in range(500):  # best-of-2 rates of healthy pairs, each within a factor of 3 of the others
        rates = {frozenset(p): max(rng.uniform(300, 900), rng.uniform(300, 900)) * MB
                 for p in itertools.combinations(nodes, 2)}
        assert localise_links(rates, link_ratio=4.0) == []


def test_two_nodes_cannot_be_told_apart_and_name_no_one():
    assert localise_links({frozenset(("a", "b")): 1 * MB}, link_ratio=4.0) == []


def test_transition_table():
    assert TRANSITIONS[(ProbeState.IDLE, "trigger")] is ProbeState.PROBING
    assert TRANSITIONS[(ProbeState.PROBING, "done")] is ProbeState.IDLE
    assert (ProbeState.IDLE, "done") not in TRANSITIONS


@pytest.mark.parametrize("field,value", [("repeats", 0), ("probe_bytes", 10), ("link_ratio", 1.0),
                                         ("timeout_s", 0), ("clear_ratio", 2.0)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        LinkProbeConfig(**{field: value}).validate()


def _campaign(loc: LinkLocator, rate_of, t: float, lost: set[str] = frozenset()) -> tuple:
    """Answers every round's asks with bytes / rate_of(client, server); returns (finding, time)."""
    finding = None
    while loc.state is ProbeState.PROBING:
        results = []
        for node in ("a", "b", "c", "d"):
            for ask in loc.asks_for(node):
                if node in lost:
                    continue
                s = ask.bytes / rate_of(node, ask.peer_node)
                results.append(LinkProbeResult(ask.probe_id, ask.peer_node, ask.bytes, s / 2, s / 2))
        t += 1.0
        finding = loc.on_results(results, t) or loc.tick(t) or finding
    return finding, t


EP = {n: ("10.0.0." + str(i), 5000 + i) for i, n in enumerate("abcd")}


def test_locator_probes_only_after_a_persistent_slowdown_without_a_compute_straggler():
    loc = LinkLocator(LinkProbeConfig(trigger_windows=3, cooldown_s=0))
    assert not loc.on_window(3.0, False, EP, 0.0) and not loc.on_window(3.0, False, EP, 1.0)
    assert not loc.on_window(1.0, False, EP, 2.0), "one window back at the baseline restarts the count"
    for t in (3.0, 4.0):
        assert not loc.on_window(3.0, False, EP, t)
    assert not loc.on_window(3.0, True, EP, 5.0), "a compute straggler explains the slowdown: no probe"
    for t in (6.0, 7.0):
        loc.on_window(3.0, False, EP, t)
    assert loc.on_window(3.0, False, EP, 8.0) and loc.state is ProbeState.PROBING


def test_locator_names_the_capped_node_then_clears_when_the_job_is_back():
    loc = LinkLocator(LinkProbeConfig(trigger_windows=1, cooldown_s=30, clear_windows=2))
    assert loc.on_window(8.0, False, EP, 0.0)
    slow = "c"
    finding, t = _campaign(loc, lambda x, y: 5 * MB if slow in (x, y) else 800 * MB, 0.0)
    assert finding is not None and finding.node_id == "c" and finding.pairs == 3
    assert "node c: slow in all 3" in loc.last_outcome
    assert not loc.on_window(8.0, False, EP, t + 1), "no new campaign while a finding stands"
    loc.on_window(1.0, False, EP, t + 2)
    loc.on_window(1.0, False, EP, t + 3)
    assert loc.finding is None and "cleared" in loc.last_outcome


def test_a_peer_that_never_answers_counts_as_a_failed_probe():
    loc = LinkLocator(LinkProbeConfig(trigger_windows=1, timeout_s=5))
    loc.on_window(5.0, False, {n: EP[n] for n in "abc"}, 0.0)
    t = 0.0
    while loc.state is ProbeState.PROBING:  # b's agent is wedged: its asks are never answered
        res = []
        for node in "ac":
            res += [LinkProbeResult(a.probe_id, a.peer_node, a.bytes, 0.001, 0.001) for a in loc.asks_for(node)
                    if a.peer_node != "b"]
        loc.on_results(res, t)
        t += 6.0
        loc.tick(t)
    assert loc.finding is not None and loc.finding.node_id == "b"


def test_healthy_campaign_names_no_one_and_waits_its_cooldown():
    loc = LinkLocator(LinkProbeConfig(trigger_windows=1, cooldown_s=60))
    loc.on_window(2.0, False, EP, 0.0)
    rng = random.Random(1)
    finding, t = _campaign(loc, lambda x, y: rng.uniform(200, 900) * MB, 0.0)
    assert finding is None and loc.finding is None and "named no node" in loc.last_outcome
    assert not loc.on_window(2.0, False, EP, t + 1), "inside the cooldown"
    assert loc.on_window(2.0, False, EP, t + 61)


def test_too_few_probe_listeners_is_said_not_probed():
    loc = LinkLocator(LinkProbeConfig(trigger_windows=1))
    assert not loc.on_window(3.0, False, {"a": ("x", 1), "b": ("y", 2), "c": ("z", 0)}, 0.0)
    assert "needs >= 3 nodes" in loc.last_outcome


# -- the coordinator core on plain types, simulated clock --------------------------------------------------------
_ports = itertools.count(31000)


class _Core3:
    """A JobCoordinator with nodes a, b, c (+ spares) that announce probe listeners; the test answers probes."""

    def __init__(self, spares: int = 0, action: str = "replace", timed: bool = True) -> None:
        from trainguard.recovery.coordinator import JobCoordinator
        from trainguard.recovery.domain import NodeRecord
        from trainguard.recovery.spec import JobSpec
        from trainguard.recovery.store import MemoryStore

        self.t = 0.0
        self.timed = timed  # False: ranks report step times only (a loop without sections)
        self.own: dict[str, float] = {}  # node -> its rank's own work per step (default 0.05 s)
        fs = StragglerConfig(window_s=0.3, persist_windows=3, clear_windows=3, min_steps=1, action=action,
                             horizon_s=600, restart_cost_s=5, cooldown_s=0,
                             link=LinkProbeConfig(trigger_windows=2, cooldown_s=5, timeout_s=3))
        self.core = JobCoordinator(JobSpec(job="lj", nnodes=3, heartbeat_interval_s=0.1, lease_timeout_s=30,
                                           backoff_initial_s=0.0, failslow=fs), store=MemoryStore(),
                                   clock=lambda: self.t)
        self.names = ["a", "b", "c"] + [f"s{i}" for i in range(spares)]
        self.lease = {n: self.core.register("lj", NodeRecord(n, "p", i, n, 1, f"10.1.0.{i}",
                                                             spare=n.startswith("s")), next(_ports))[0]
                      for i, n in enumerate(self.names)}
        self.gen = dict.fromkeys(self.names, -1)
        self.step = dict.fromkeys(self.names, 0)
        self.results: dict[str, list] = {n: [] for n in self.names}
        self.asked: list = []
        for _ in range(3):
            for n in self.names:
                self.beat(n, 0.2)

    def beat(self, n: str, step_s: float, rate_of=None):
        from trainguard.recovery.domain import Beat, Command, RankTiming

        timings: tuple = ()
        if self.gen[n] > 0 and self.core.layout.slot_of(n) is not None:
            self.step[n] += 3
            rank = self.core.layout.slot_of(n).first_rank
            own = self.own.get(n, 0.05)
            timings = (RankTiming(rank, self.step[n], step_s, step_s - own, own, 3) if self.timed
                       else RankTiming(rank, self.step[n], step_s, -1.0, -1.0, 3),)
        res, self.results[n] = tuple(self.results[n]), []
        ins = self.core.heartbeat(Beat("lj", n, self.lease[n], self.gen[n], 1 if self.gen[n] > 0 else 0, False,
                                       self.step[n] if self.gen[n] > 0 else -1, next(_ports), timings,
                                       link_probe_port=7000 + self.names.index(n), link_results=res)).response
        for a in ins.link_probes:
            self.asked.append((n, a))
            s = a.bytes / rate_of(n, a.peer_node)
            self.results[n].append(LinkProbeResult(a.probe_id, a.peer_node, a.bytes, s, s / 10))
        if ins.command in (Command.START, Command.RESTART):
            self.gen[n], self.step[n] = ins.table.generation, 0
        elif ins.command is Command.STOP:
            self.gen[n] = -1
        return ins

    def run(self, seconds: float, step_s: float, rate_of=None):
        last = {}
        end = self.t + seconds
        while self.t < end:
            self.t += 0.1
            for n in self.names:
                last[n] = self.beat(n, step_s, rate_of)
        return last


def _slow_b(x: str, y: str) -> float:
    return 4 * MB if "b" in (x, y) else 600 * MB


def test_core_a_job_slowed_by_one_node_link_probes_names_it_and_replaces_it_with_the_spare():
    c = _Core3(spares=1)
    c.run(4.0, 0.2, _slow_b)  # healthy: baselines form, no probe
    assert not c.asked
    c.run(6.0, 2.0, _slow_b)  # 10x slower steps, flat own work everywhere: no compute straggler
    assert c.asked, "the coordinator never asked for a link probe"
    assert {a.peer_address for _, a in c.asked} <= {"10.1.0.0", "10.1.0.1", "10.1.0.2"}
    assert all(a.peer_port in (7000, 7001, 7002) for _, a in c.asked)
    st = c.core.state
    assert "b" in st.cordoned and st.generation == 2, (st, c.core._failslow.links.last_outcome)
    assert c.core.layout.slot_of("s0") is not None and c.core.layout.slot_of("b") is None
    assert c.core._failslow.policy.replaced == ["b"]
    c.core.close()


def test_core_report_only_lists_the_node_as_a_link_finding_in_every_reply():
    c = _Core3(spares=0, action="report")
    c.run(4.0, 0.2, _slow_b)
    last = c.run(8.0, 2.0, _slow_b)
    fs = last["a"].failslow
    assert fs is not None and [(r.rank, r.node_id, r.basis) for r in fs.slow] == [(-1, "b", "link")]
    assert fs.slow[0].ratio > 50 and fs.slow[0].individual > 5 and "node b: slow in all 2" in fs.link_probe
    assert c.core.state.generation == 1 and not c.core.state.cordoned
    c.core.close()


def test_core_a_slowdown_with_untimed_ranks_says_no_rank_was_compared_not_that_none_is_slow():
    # A loop without session.section reports step times only: every rank's step is the slow rank's, so no
    # rank can be compared. The outcome said "no compute straggler" (found by a user's review: examples/train.py
    # with one worker CPU-throttled to 5% read "job 4.52x slower with no compute straggler").
    c = _Core3(spares=0, action="report", timed=False)
    c.run(4.0, 0.2, lambda x, y: 500 * MB)
    last = c.run(6.0, 2.0, lambda x, y: 500 * MB)
    fs = last["a"].failslow
    assert c.asked and fs is not None and fs.ranks_observed == 0
    assert "named no node" in fs.link_probe and "no rank times its own work" in fs.link_probe, fs.link_probe
    assert "no compute straggler" not in fs.link_probe
    c.core.close()


def test_two_nodes_without_timed_ranks_are_told_why_no_rank_is_named():
    loc = LinkLocator(LinkProbeConfig(trigger_windows=1, cooldown_s=0))
    two = {n: EP[n] for n in "ab"}
    assert not loc.on_window(3.0, False, two, 0.0, ranks_compared=False)
    assert "no rank times its own work" in loc.last_outcome and "session.section" in loc.last_outcome
    assert not loc.on_window(3.0, False, two, 1.0)
    assert "no compute straggler" in loc.last_outcome and "needs >= 3 nodes" in loc.last_outcome


def test_the_cannot_probe_line_goes_once_a_compute_straggler_is_flagged():
    # Found by a user's review (2 nodes, one worker CPU-throttled): `trainguard status` listed the slow rank and,
    # below it, "link probe: job 3.81x slower with no compute straggler", written while the flag was persisting.
    loc = LinkLocator(LinkProbeConfig(trigger_windows=1, cooldown_s=0))
    two = {n: EP[n] for n in "ab"}
    loc.on_window(3.0, False, two, 0.0)
    assert "no compute straggler" in loc.last_outcome
    assert not loc.on_window(3.0, True, two, 1.0) and loc.last_outcome == ""


def test_the_cannot_probe_line_goes_once_the_job_is_back_at_its_baseline():
    # Found by a review: "link probe: job 3.26x slower with no compute straggler ..." stayed in `trainguard status`
    # for minutes, through a restart, beside "fail-slow: ... 0.97x its own baseline".
    loc = LinkLocator(LinkProbeConfig(trigger_windows=1, cooldown_s=0, clear_windows=2))
    two = {n: EP[n] for n in "ab"}
    loc.on_window(3.26, False, two, 0.0)
    assert "3.26x slower" in loc.last_outcome
    loc.on_window(0.97, False, two, 1.0)
    assert "3.26x slower" in loc.last_outcome, "one window back is not yet a recovery"
    loc.on_window(0.97, False, two, 2.0)
    assert loc.last_outcome == ""
    loc.on_window(3.0, False, two, 3.0)  # slowed again: said again
    assert "3.00x slower" in loc.last_outcome


def test_core_healthy_links_under_a_job_slowdown_name_no_one():
    c = _Core3(spares=1)
    rng = random.Random(3)
    c.run(4.0, 0.2, lambda x, y: 500 * MB)
    last = c.run(6.0, 2.0, lambda x, y: rng.uniform(200, 800) * MB)  # e.g. a slower input pipeline everywhere
    assert c.asked and "named no node" in c.core._failslow.links.last_outcome
    assert c.core.state.generation == 1 and not c.core.state.cordoned
    fs = last["a"].failslow
    assert fs is None or not fs.slow
    c.core.close()


def test_core_a_compute_straggler_still_persisting_starts_no_link_probe():
    # Found in a real 3-rank gloo job with one rank sleeping 0.1 s in its step: while the rank's flag persisted
    # (2.8x the others for 6 windows), `trainguard status` said "job 2.33x slower with no compute straggler" and,
    # with >= 3 nodes, a probe campaign ran (and its 60 s cooldown then held back a real one).
    c = _Core3(spares=0, action="report")
    c.run(4.0, 0.2, lambda x, y: 500 * MB)
    c.own["b"] = 1.9  # b's own work makes every rank's step 2 s; a and c wait for it
    last = c.run(6.0, 2.0, lambda x, y: 500 * MB)
    fs = last["a"].failslow
    assert fs is not None and [(r.rank, r.node_id) for r in fs.slow if r.rank >= 0] == [(1, "b")], fs
    assert not c.asked, f"a link probe ran for a compute straggler: {c.core._failslow.links.last_outcome}"
    assert "no compute straggler" not in fs.link_probe, fs.link_probe
    c.core.close()

"""The coordinator's collaborators on their own: store records, admission rules, the checkpoint relay.

The coordinator's tests (test_recovery_service, test_recovery_stateful, ...) cover them through the coordinator;
these pin the edges that are awkward to reach through it (corrupt records, the step-rate arithmetic).
"""

from __future__ import annotations

import json
import zlib

import pytest

from trainguard.recovery.checkpoint_relay import CheckpointRelay
from trainguard.recovery.domain import NodeRecord
from trainguard.recovery.errors import DuplicateNodeError, SlotTakenError, StoreError
from trainguard.recovery.job_records import decode_node, decode_state, node_value, state_value
from trainguard.recovery.membership import Member, check_slot_claim, superseded_instances
from trainguard.recovery.policy import Phase, PolicyState
from trainguard.recovery.ranks import assign_ranks


def test_records_round_trip_and_corrupt_ones_name_the_key() -> None:
    info = NodeRecord("n1", pod_id="p", address="10.0.0.1", host="h1")
    n = decode_node("k", node_value(info, "lease", "inst", "x4, below its x16"))
    assert (n.info, n.lease, n.instance, n.refused) == (info, "lease", "inst", "x4, below its x16")
    assert not n.lost and decode_node("k", node_value(info, "lease", "inst", "", lost=True)).lost
    assert b'"lost"' not in node_value(info, "lease", "inst", "")  # a live node's record reads as before
    bad = json.loads(node_value(info, "lease", "inst", ""))
    bad["lost"] = "yes"  # a hand edit: refused as corrupt, naming the key, not taken as true
    with pytest.raises(StoreError, match="node record 'k' is corrupt .*'lost' is 'yes'.*delete it"):
        decode_node("k", json.dumps(bad).encode())
    layout = assign_ranks([info.spec()], group_size=1)
    st = PolicyState(phase=Phase.RUNNING, generation=3)
    d = decode_state("job", state_value(st, layout, 1, 29500, {29500, 29501}))
    assert d.policy == st and d.layout == layout and d.master_port == 29500 and d.used_ports == {29500, 29501}
    assert decode_state("job", state_value(st, None, 4, 0, set())).layout is None
    with pytest.raises(StoreError, match="node record 'k' is corrupt"):
        decode_node("k", b"{not json")
    with pytest.raises(StoreError, match="job state of 'job' is corrupt"):
        decode_state("job", zlib.compress(json.dumps({"policy": {}}).encode()))


def test_admission_rules() -> None:
    info = NodeRecord("n1", address="a", host="h")
    assert superseded_instances(None, info, "i2", False, 0.0, lambda: 9.0) == set()
    prev = Member(info, "lease", "i1", last_seen=0.0, superseded={"i0"})
    assert superseded_instances(prev, info, "i1", True, 1.0, lambda: 9.0) is None  # the same agent again
    assert superseded_instances(prev, info, "i2", True, 1.0, lambda: 9.0) == {"i0", "i1"}  # same host: takes over
    with pytest.raises(DuplicateNodeError, match="taken over by a newer agent"):
        superseded_instances(prev, info, "i0", True, 1.0, lambda: 9.0)
    with pytest.raises(DuplicateNodeError, match="wait 9 s"):
        superseded_instances(prev, NodeRecord("n1", address="b", host="h2"), "i2", True, 1.0, lambda: 9.0)
    holder = Member(NodeRecord("old"), "l", "", 0.0)
    layout = assign_ranks([holder.spec()], group_size=1)
    claim = NodeRecord("new", replaces="old")
    with pytest.raises(SlotTakenError, match="alive and holds it"):
        check_slot_claim(claim, holder, [holder], layout, [], lambda m: True)
    check_slot_claim(claim, holder, [holder], layout, ["old"], lambda m: True)  # cordoned: may be taken over
    rival = Member(NodeRecord("other", replaces="old"), "l", "", 0.0)
    with pytest.raises(SlotTakenError, match="one replacement per slot"):
        check_slot_claim(claim, holder, [holder, rival], layout, ["old"], lambda m: True)


def test_checkpoint_relay_sets_a_step_ahead_of_the_job_and_keeps_a_pending_one() -> None:
    relay = CheckpointRelay("job")
    for t in range(5):  # 10 steps/s
        relay.observe_step(float(t), 10 * t, 1)
    st = PolicyState(phase=Phase.RUNNING, generation=1)
    assert relay.request(st, [40, 38], 1.0, "n1: drain") == "job-wide checkpoint at step 66"  # 40 + ceil(25) + 1
    ask = relay.pending(1)
    assert ask is not None and ask.at_step == 66 and ask.reason == "n1: drain" and relay.pending(2) is None
    assert "already pending" in relay.request(st, [50], 1.0, "n2: again")
    assert relay.request(PolicyState(phase=Phase.RECOVERING, generation=1), [50], 1.0, "x").startswith(
        "no checkpoint requested: the job is recovering")


def test_a_cordoned_node_back_under_its_id_is_told_why_and_named_while_a_vacancy_waits() -> None:
    """Found by a user's review (3 real nodes): n1 was SIGKILLed and replaced by the spare s0, its agent was started
    again under the same id, then s0 died. The job waited for a spare for --membership-timeout, saying only
    "register a spare node", while n1 (cordoned, never given a slot again) heard "node n1 is cordoned: <the latest
    restart's message about s0>"."""
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.domain import Beat, Command
    from trainguard.recovery.spec import JobSpec
    from trainguard.recovery.store import MemoryStore

    t = [0.0]
    store = MemoryStore()
    spec = JobSpec(job="cj", nnodes=2, heartbeat_interval_s=1.0, lease_timeout_s=5.0, backoff_initial_s=0.0)
    core = JobCoordinator(spec, store=store, clock=lambda: t[0], wall=lambda: 1000.0 + t[0])
    lease: dict[str, str] = {}
    gen: dict[str, int] = {}

    def register(nid: str, idx: int, spare: bool = False) -> None:
        # Each write waited for as the service waits: on the fake clock a write that landed after time moved on
        # held its node that long (not silent meanwhile), and the loss came late (about one run in six).
        lease[nid], _, fut = core.register("cj", NodeRecord(nid, "p", idx, nid, 1, "127.0.0.1", spare=spare),
                                           20000 + idx)
        core.wait_durable(fut)
        gen[nid] = -1

    def beat(nid: str):
        reply = core.heartbeat(Beat("cj", nid, lease[nid], gen[nid], 1 if gen[nid] > 0 else 0,
                                    free_port=30000 + int(t[0])))
        core.wait_durable(reply.durable)
        ins = reply.response
        if ins.command in (Command.START, Command.RESTART):
            gen[nid] = ins.table.generation
        elif ins.command is Command.STOP:
            gen[nid] = -1
        return ins

    def run(seconds: int, nodes: tuple[str, ...]) -> dict:
        last = {}
        for _ in range(seconds):
            t[0] += 1.0
            core.reap()
            last = {n: beat(n) for n in nodes}
        return last

    register("n0", 0)
    register("n1", 1)
    register("s0", 2, spare=True)
    run(2, ("n0", "n1", "s0"))
    run(8, ("n0", "s0"))  # n1 silent: lost, its slot goes to s0
    assert [s.node_id for s in core.layout.slots] == ["n0", "s0"] and "n1" in core.state.cordoned
    register("n1", 1)  # its agent started again under the same id
    last = run(8, ("n0", "n1"))  # s0 silent: lost, no spare left
    assert last["n1"].command is Command.STOP
    assert last["n1"].message == "node n1 is cordoned: node n1 node lost (no heartbeat for 6.0 s)", last["n1"].message
    waits = last["n0"].message
    assert "no spare node for 1 rank slot(s)" in waits and "registered but cordoned for this job" in waits, waits
    assert "'n1' (node n1 node lost" in waits and "restart its node daemon" in waits and "trainguard uncordon" in waits
    core.close()
    # The reason survives a coordinator restart (state record), and a record written before it existed still loads.
    again = JobCoordinator(spec, store=store, clock=lambda: t[0], wall=lambda: 1000.0 + t[0])
    assert again.state.cordon_why["n1"] == "node n1 node lost (no heartbeat for 6.0 s)"
    again.close()
    old = PolicyState(phase=Phase.RUNNING, cordoned=["n1"]).to_dict()
    del old["cordon_why"]
    assert PolicyState.from_dict(old).cordon_why == {}


@pytest.mark.parametrize("field, value, said", [
    ("heartbeat_interval_s", float("nan"), "heartbeat interval nan"),
    ("lease_timeout_s", float("inf"), "lease timeout inf"),
    ("lease_timeout_s", float("nan"), "lease timeout nan"),
    ("backoff_initial_s", float("inf"), "backoff inf"),
    ("backoff_initial_s", -1.0, "backoff -1.0"),
    ("backoff_max_s", float("nan"), "backoff maximum nan"),
    ("max_heartbeat_rate", float("nan"), "max heartbeat rate nan"),
])
def test_a_job_spec_refuses_non_finite_times(field: str, value: float, said: str) -> None:
    """Found by a user's review: `trainguard coordinator --heartbeat-interval nan` served (nodes were told a NaN
    interval), and `--lease-timeout inf` or `--backoff inf` served a job whose dead node is never replaced, or
    whose second restart never starts."""
    from trainguard.recovery.errors import InvalidRequestError
    from trainguard.recovery.spec import JobSpec

    JobSpec(job="ok").validate()
    with pytest.raises(InvalidRequestError, match=said):
        JobSpec(job="ok", **{field: value}).validate()


def test_a_job_spec_refuses_a_minimum_above_its_node_count() -> None:
    """`trainguard coordinator --nnodes 2 --min-nodes 3 --allow-shrink` served; every shrink was then refused as
    "below the minimum", so the first lost node left the job waiting with no word about the flag."""
    from trainguard.recovery.errors import InvalidRequestError
    from trainguard.recovery.spec import JobSpec

    JobSpec(job="ok", nnodes=3, min_nodes=3).validate()
    with pytest.raises(InvalidRequestError, match=r"min nodes 3 exceeds nnodes 2.*--min-nodes <= 2"):
        JobSpec(job="ok", nnodes=2, min_nodes=3).validate()


def test_a_restart_with_another_node_count_warns_that_the_stored_layout_is_kept(caplog) -> None:
    """A coordinator restarted with a different --nnodes served the stored 2-node layout without a word."""
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.domain import Beat, Command
    from trainguard.recovery.spec import JobSpec
    from trainguard.recovery.store import MemoryStore

    t = [0.0]
    store = MemoryStore()
    spec = JobSpec(job="rj", nnodes=2, heartbeat_interval_s=1.0, lease_timeout_s=5.0, backoff_initial_s=0.0)
    core = JobCoordinator(spec, store=store, clock=lambda: t[0], wall=lambda: 1000.0 + t[0])
    leases = {nid: core.register("rj", NodeRecord(nid, "p", i, nid, 1, "127.0.0.1"), 20000 + i)[0]
              for i, nid in enumerate(("n0", "n1"))}
    for _ in range(2):
        t[0] += 1.0
        commands = {nid: core.heartbeat(Beat("rj", nid, lease, -1, 0, free_port=30000)).response.command
                    for nid, lease in leases.items()}
    assert set(commands.values()) == {Command.START}
    core.close()
    with caplog.at_level("WARNING", logger="trainguard.recovery.coordinator"):
        JobCoordinator(spec, store=store, clock=lambda: t[0], wall=lambda: 1000.0 + t[0]).close()
    assert "stored rank layout" not in caplog.text
    with caplog.at_level("WARNING", logger="trainguard.recovery.coordinator"):
        again = JobCoordinator(JobSpec(job="rj", nnodes=3, heartbeat_interval_s=1.0, lease_timeout_s=5.0),
                               store=store, clock=lambda: t[0], wall=lambda: 1000.0 + t[0])
    assert [s.node_id for s in again.layout.slots] == ["n0", "n1"]
    again.close()
    assert "the stored rank layout has 2 node(s) with group size 1, this coordinator was started with --nnodes 3" \
        in caplog.text and "new --job name or --store" in caplog.text


def test_the_embedding_launcher_stops_once_every_node_was_told_the_end(caplog) -> None:
    """Found by a review (two `trainguard run` agents, c10d or static rendezvous): the agent embedding the
    coordinator kept it up for its whole 10 s patience after every job, and logged the other node as lost. It
    waited for a heartbeat *after the moment it noticed the end* (past its own shutdown steps), but the other
    agent had already been told the end by the answer to an earlier heartbeat and exited at once."""
    import logging
    import time
    from types import SimpleNamespace

    from trainguard.agent.run import _let_nodes_hear_the_end
    from trainguard.agent.run_deploy import linger_until_peers_told
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.domain import Beat, Command
    from trainguard.recovery.spec import JobSpec
    from trainguard.recovery.store import MemoryStore

    spec = JobSpec(job="ej", nnodes=2, heartbeat_interval_s=1.0, lease_timeout_s=60.0)
    core = JobCoordinator(spec, store=MemoryStore(), clock=time.monotonic)
    lease = {nid: core.register("ej", NodeRecord(nid, "p", i, nid, 1, "127.0.0.1"), 20000 + i)[0]
             for i, nid in enumerate(("n0", "n1"))}
    gen = {nid: core.heartbeat(Beat("ej", nid, lease[nid], -1, 0, free_port=30000)).response.table.generation
           for nid in ("n0", "n1")}

    def done(nid: str):  # answered as the service answers: once the outcome is durable
        return core.answered(Beat("ej", nid, lease[nid], gen[nid], 0, workers_succeeded=True)).response

    done("n1")
    assert core.not_told_of_end() == ["n0", "n1"]  # still running: nobody was told
    assert done("n0").command is Command.STOP  # the job ended inside this heartbeat, which says so
    assert core.not_told_of_end() == ["n1"]
    assert done("n1").command is Command.STOP  # n1 is told, and its agent exits without another heartbeat
    assert core.not_told_of_end() == []
    # n0's launcher noticing the end later: both of its waits (the run extras', then the launcher's) end at once.
    with caplog.at_level(logging.WARNING, logger="trainguard.agent"):
        assert linger_until_peers_told(SimpleNamespace(core=core), timeout_s=1.0)
        _let_nodes_hear_the_end(SimpleNamespace(core=core), "n0", patience_s=1.0)
    assert "before every node heard" not in caplog.text
    core.close()


def test_the_embedding_launcher_of_a_one_node_job_waits_until_its_spare_is_told_the_end() -> None:
    """A second `trainguard run` on a one-node job's c10d endpoint joins as a spare. The embedding launcher
    lingered only for jobs of more than one node, so it stopped the coordinator at once: the spare warned for a
    minute, then exited 2 saying "start this node again". It now waits until the spare heard the end."""
    import time
    from types import SimpleNamespace

    from trainguard.agent.run_deploy import linger_until_peers_told
    from trainguard.recovery.coordinator import JobCoordinator
    from trainguard.recovery.domain import Beat, Command
    from trainguard.recovery.spec import JobSpec
    from trainguard.recovery.store import MemoryStore

    core = JobCoordinator(JobSpec(job="one", nnodes=1, heartbeat_interval_s=1.0, lease_timeout_s=60.0),
                          store=MemoryStore(), clock=time.monotonic)
    lease = {nid: core.register("one", NodeRecord(nid, "p", i, nid, 1, "127.0.0.1"), 20000 + i)[0]
             for i, nid in enumerate(("n0", "spare"))}
    gen = core.heartbeat(Beat("one", "n0", lease["n0"], -1, 0, free_port=30000)).response.table.generation
    core.heartbeat(Beat("one", "spare", lease["spare"], -1, 0, free_port=30001))
    assert core.answered(Beat("one", "n0", lease["n0"], gen, 0, workers_succeeded=True)).response.command \
        is Command.STOP
    assert core.not_told_of_end() == ["spare"]
    assert linger_until_peers_told(SimpleNamespace(core=core), timeout_s=0.2, own_node="n0") is False
    assert core.answered(Beat("one", "spare", lease["spare"], -1, 0, free_port=30001)).response.command \
        is Command.STOP
    assert linger_until_peers_told(SimpleNamespace(core=core), timeout_s=0.2, own_node="n0") is True
    core.close()

"""The job state record at the coordinator's scale: the rank layout names its slot holders by a digest of their ids
(each id is in its node record already), so the record fits etcd's request limit with room to spare.

Before, the layout was one JSON row per slot with the full node id: at 12,500 nodes of random 128-character ids
(the longest id the service accepts) the record was ~1.45 MB compressed, 1.87 MB with a full cordon list, past etcd's
default 1.5 MiB ``--max-request-bytes``; every state write after the first generation formed, so every recovery,
would have failed.
"""

from __future__ import annotations

import json
import random
import string
import zlib

import pytest

from trainguard.recovery.coordinator import JobCoordinator
from trainguard.recovery.domain import FaultReport, NodeRecord
from trainguard.recovery.errors import StoreError
from trainguard.recovery.job_records import (ID_DIGEST_BYTES, decode_state, id_digest, layout_doc, node_value,
                                             state_value)
from trainguard.recovery.policy import Cause, Failure, Level, Phase, PolicyState
from trainguard.recovery.ranks import assign_ranks, layout_to_rows
from trainguard.recovery.spec import JobSpec, MAX_CORDONED
from trainguard.recovery.store import Put, SQLiteStore

JOB = "big"
PREFIX = f"trainguard/jobs/{JOB}/"
ALPHABET = string.ascii_letters + string.digits + "._:@-"
NODES = 12_500


def _ids(rnd: random.Random, n: int, length: int = 128) -> list[str]:
    """Random node ids of the longest form the service accepts (first character alphanumeric): incompressible."""
    return [rnd.choice(string.ascii_letters) + "".join(rnd.choices(ALPHABET, k=length - 1)) for _ in range(n)]


def _nodes(ids: list[str]) -> list[NodeRecord]:
    return [NodeRecord(nid, pod_id=f"pod-{i // 64}", node_index=i % 64, host=f"h{i}", device_count=8,
                       address=f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}") for i, nid in enumerate(ids)]


def _full_cordon_list(rnd: random.Random, st: PolicyState) -> None:
    """Every cordoned node at its longest: id, a failure of a 4 KB reason, a 64-character daemon instance."""
    for nid in _ids(rnd, MAX_CORDONED):
        st.cordoned.append(nid)
        st.cordon_why[nid] = Failure(nid, 1, Cause.NODE_CRITICAL, Level.NODE,
                                     detail="".join(rnd.choices(ALPHABET, k=4096))).describe()
        st.cordon_daemon[nid] = "".join(rnd.choices(ALPHABET, k=64))


def test_a_recovery_at_12500_nodes_of_the_longest_ids_writes_a_state_record_under_1_mib(tmp_path) -> None:
    """A store an older coordinator wrote (format 1: the layout as rows of full ids) is read back, and the state
    written by the next recovery is under 1 MiB even with the cordon list full; a coordinator started again on it
    reads the same layout back from the digests."""
    rnd = random.Random(11)
    nodes = _nodes(_ids(rnd, NODES))
    layout = assign_ranks([n.spec() for n in nodes])
    st = PolicyState(phase=Phase.RUNNING, generation=1)
    _full_cordon_list(rnd, st)
    old = {"policy": st.to_dict(), "layout": layout_to_rows(layout), "group_size": 1, "master_port": 29500,
           "used_ports": [29500]}
    store = SQLiteStore(tmp_path / "s.db")
    puts = [Put(PREFIX + "nodes/" + n.node_id, node_value(n, f"lease{i}", "", "")) for i, n in enumerate(nodes)]
    puts.append(Put(PREFIX + "state", zlib.compress(json.dumps(old, separators=(",", ":")).encode(), 3)))
    assert store.commit([], puts).ok
    spec = JobSpec(job=JOB, nnodes=NODES, store=f"sqlite://{tmp_path}/s.db")
    coord = JobCoordinator(spec, store=store)
    try:
        assert coord.layout == layout and coord.state.generation == 1  # format 1 still reads
        level, gen, _, fut = coord.report(FaultReport(JOB, nodes[5].node_id, "lease5", 1, Cause.WORKER_EXIT,
                                                      detail="exit 1"))
        assert (level, gen) == (Level.PROCESS, 2) and fut is not None
        coord.wait_durable(fut)
        value = store.get(PREFIX + "state").value
        assert len(value) < 1024 * 1024, f"the state record is {len(value)} bytes"
    finally:
        coord.close()
    again = JobCoordinator(spec, store=SQLiteStore(tmp_path / "s.db"))
    try:
        assert again.layout == layout and again.state.plan is not None and again.state.plan.generation == 2
    finally:
        again.close()


def test_slot_holders_without_a_stored_record_are_named_in_full_and_a_lost_record_cannot_be_claimed() -> None:
    """A holder the writer may not name by digest (its record's write is not known to have landed) keeps its full
    id; a digest no record resolves becomes an id no node can register under, and a corrupt layout is refused."""
    nodes = _nodes(["a", "b", "c"])
    layout = assign_ranks([n.spec() for n in nodes])
    doc = layout_doc(layout, lambda nid: nid != "b")
    assert doc["ids"] == {"1": "b"} and len(doc["refs"]) == 4 * -(-3 * ID_DIGEST_BYTES // 3)
    value = state_value(PolicyState(), layout, 1, 29500, set(), lambda nid: nid != "b")
    assert decode_state(JOB, value, ["a", "b", "c", "zz"]).layout == layout
    lost = decode_state(JOB, value, ["a"]).layout
    assert lost is not None and lost.node_ids == ("a", "b", "?lost-record-" + id_digest("c").hex())
    old = json.loads(zlib.decompress(value))  # format 2: addresses and pods as plain lists, read as before
    for column in ("addr", "pod"):
        table = old["slots"].pop(column + "_t")
        old["slots"][column] = table if isinstance(table, list) else [table["v"][i] for i in table["i"]]
    old["slots"]["format"] = 2
    assert decode_state(JOB, zlib.compress(json.dumps(old).encode()), ["a", "b", "c"]).layout == layout
    for column, broken in (("pod_t", {"v": ["p0"], "i": [0, 0]}), ("addr_t", {"v": ["x"], "i": [0, 1, 0]}),
                           ("addr_t", {"v": ["x"], "i": [0, True, 0]}), ("lws", [[1, 10**12]]),
                           ("refs", "not base64!")):
        bad = json.loads(zlib.decompress(value))
        bad["slots"][column] = broken  # a count of 10**12 is refused before it is expanded
        with pytest.raises(StoreError, match="job state of 'big' is corrupt"):
            decode_state(JOB, zlib.compress(json.dumps(bad).encode()), ["a", "b", "c"])


def test_a_slot_holder_without_a_node_record_after_a_restart_is_lost_when_its_lease_would_run_out(tmp_path) -> None:
    """The job state names a slot holder whose node record is not in the store (its write was lost to an outage
    and the coordinator stopped before writing it again): a coordinator started on that store never heard of it
    as a member, so it was never lost either, and the job ran on without it until its peers' collectives broke.
    Now it gets the lease every known node gets after a restart, then it is a lost node, replaced as any other."""
    from trainguard.recovery.domain import Beat

    t = [0.0]

    def clock() -> float:
        return t[0]

    spec = JobSpec(job=JOB, nnodes=2, lease_timeout_s=2.0, heartbeat_interval_s=0.5,
                   store=f"sqlite://{tmp_path}/s.db")
    core = JobCoordinator(spec, store=SQLiteStore(tmp_path / "s.db"), clock=clock, wall=clock)
    leases = {}
    try:
        for i, nid in enumerate(("a", "b")):
            lease, _, fut = core.register(JOB, NodeRecord(nid, host=nid, address=nid), 30001 + i)
            core.wait_durable(fut)
            leases[nid] = lease
        for nid in ("a", "b"):
            reply = core.heartbeat(Beat(JOB, nid, leases[nid], -1, free_port=30001))
        core.wait_durable(reply.durable)
        assert core.state.phase is Phase.RUNNING and core.layout.node_ids == ("a", "b")
    finally:
        core.close()
    store = SQLiteStore(tmp_path / "s.db")
    assert store.commit([], [Put(PREFIX + "nodes/b", None)]).ok
    core = JobCoordinator(spec, store=store, clock=clock, wall=clock)
    try:
        lost = "?lost-record-" + id_digest("b").hex()  # named by digest, and no record resolves it
        assert sorted(core.members()) == ["a"] and core.layout.node_ids == ("a", lost)
        for _ in range(3):  # within the lease: nothing yet
            t[0] += 0.5
            core.heartbeat(Beat(JOB, "a", leases["a"], 1, workers_running=1))
            core.reap()
        assert core.state.plan is None
        for _ in range(3):
            t[0] += 0.5
            core.heartbeat(Beat(JOB, "a", leases["a"], 1, workers_running=1))
            core.reap()
        plan = core.state.plan
        # No spare to take its slot: the node-level failure is a job-level restart, as for any lost node.
        assert plan is not None and plan.failed_nodes == [lost] and plan.level in (Level.NODE, Level.JOB), core.state
        assert "no node record in the store" in core.state.cordon_why[lost]
    finally:
        core.close()


def test_a_formation_while_the_registrations_are_still_being_written_names_the_nodes_by_digest(tmp_path) -> None:
    """Records still waiting for the store are committed before the state that names them (the committer keeps
    the order): at a 12,500-node formation a third were pending, and naming those in full made the formation's
    state record 0.5 MB, all 1.45 MB of it when the store is slow. Here the store is held by another writer (a
    real SQLite lock) while every node registers."""
    import sqlite3

    rnd = random.Random(5)
    nodes = _nodes(_ids(rnd, 50))
    store = SQLiteStore(tmp_path / "s.db")
    core = JobCoordinator(JobSpec(job=JOB, nnodes=len(nodes), store=f"sqlite://{tmp_path}/s.db"), store=store)
    other = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # the committer's next commit waits for this writer
        futs = [core.register(JOB, n, 30000 + i)[2] for i, n in enumerate(nodes)]
        assert core.layout is not None and len(core.layout.slots) == len(nodes)  # formed, records not yet stored
        assert not any(f.done() for f in futs)
        other.execute("ROLLBACK")
        for f in futs:
            core.wait_durable(f)
        core.wait_durable(core._state_fut)
        doc = json.loads(zlib.decompress(store.get(PREFIX + "state").value))
        assert doc["slots"]["ids"] == {}, f"{len(doc['slots']['ids'])} of {len(nodes)} ids stored in full"
    finally:
        other.close()
        core.close()


def test_pod_ids_shared_by_interleaved_slots_are_stored_once_each() -> None:
    """12,500 slots of 196 pods with 128-character ids, the pods' slots interleaved (replacements from other pods
    over a long run): as a plain column the pod ids compressed only within zlib's 32 KiB window, ~385 KB of the
    record; stored once per distinct value with an index per slot, ~38 KB. The layout reads back the same."""
    from trainguard.recovery.ranks import layout_from_mapping

    rnd = random.Random(7)
    ids, pods = _ids(rnd, NODES), _ids(rnd, -(-NODES // 64))
    order = list(range(NODES))
    rnd.shuffle(order)
    rows = [{"node_id": ids[i], "group_rank": r, "first_rank": 8 * r, "local_world_size": 8,
             "address": f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}", "pod_id": pods[i // 64]}
            for r, i in enumerate(order)]
    layout = layout_from_mapping(rows, 1)
    value = state_value(PolicyState(phase=Phase.RUNNING, generation=1), layout, 1, 29500, {29500}, lambda _: True)
    assert len(value) < 256 * 1024, f"the state record is {len(value)} bytes"
    assert decode_state(JOB, value, ids).layout == layout

"""`trainguard coordinator --nnodes MIN:MAX` shrinks down to MIN when a node is lost with no spare, as the coordinator
`trainguard run --nnodes MIN:MAX` embeds does. Before, the standalone coordinator shrank only with --allow-shrink:
the same range failed the job there and shrank and continued under `trainguard run`."""

from __future__ import annotations

import pytest

from trainguard.cli import build_parser
from trainguard.errors import UsageError
from trainguard.recovery.cli import coordinator_spec
from trainguard.recovery.coordinator import JobCoordinator
from trainguard.recovery.domain import Beat, Command, NodeRecord
from trainguard.recovery.policy import Phase
from trainguard.recovery.spec import JobSpec
from trainguard.recovery.store import MemoryStore


def _spec(*flags: str) -> JobSpec:
    args = build_parser().parse_args(["coordinator", "--job", "sh", "--store", "memory://", *flags])
    return coordinator_spec(args)


@pytest.mark.parametrize("flags, shrink, floor", [
    (("--nnodes", "2:3"), True, 2),  # as `trainguard run --nnodes 2:3`
    (("--nnodes", "2:3", "--allow-shrink"), True, 2),
    (("--nnodes", "3:5", "--min-nodes", "2"), True, 2),
    (("--nnodes", "2:3", "--no-allow-shrink"), False, 2),  # the user says otherwise
    (("--nnodes", "3",), False, 3),
    (("--nnodes", "3", "--allow-shrink", "--min-nodes", "1"), True, 1),
])
def test_the_node_range_allows_shrinking_to_its_minimum_unless_told_otherwise(flags, shrink, floor) -> None:
    spec = _spec(*flags)
    spec.validate()
    assert spec.allow_shrink is shrink and spec.policy_config().min_nodes == floor, spec


@pytest.mark.parametrize("flags", [("--nnodes", "3", "--allow-shrink"),
                                   ("--nnodes", "3", "--allow-shrink", "--min-nodes", "3")])
def test_allow_shrink_that_can_never_shrink_is_refused_naming_min_nodes(flags) -> None:
    # With a fixed --nnodes N the floor defaults to N: the flag was accepted and never shrank anything.
    with pytest.raises(UsageError, match=r"--allow-shrink with --nnodes 3 never shrinks.*--min-nodes M"):
        _spec(*flags)


def test_a_lost_node_without_a_spare_shrinks_a_min_max_job_and_it_continues() -> None:
    """The coordinator the flags make: 3 nodes of 2:3, one goes silent, no spare: generation 2 has 2 nodes."""
    t = [100.0]
    spec = _spec("--nnodes", "2:3", "--last-call-timeout", "0", "--heartbeat-interval", "1",
                 "--lease-timeout", "4", "--backoff", "0")
    core = JobCoordinator(spec, store=MemoryStore(), clock=lambda: t[0], wall=lambda: 1.7e9 + t[0])
    leases = {nid: core.register("sh", NodeRecord(nid, "p", i, nid, 1), 20000 + i)[0]
              for i, nid in enumerate(("n1", "n2", "n3"))}
    gen = dict.fromkeys(leases, -1)
    world = {}

    def beat(nid: str) -> None:
        ins = core.heartbeat(Beat("sh", nid, leases[nid], gen[nid], 1 if gen[nid] > 0 else 0,
                                  free_port=30000 + int(t[0]))).response
        if ins.command in (Command.START, Command.RESTART):
            gen[nid], world[nid] = ins.table.generation, ins.table.world_size

    for nid in leases:
        beat(nid)
    assert set(gen.values()) == {1} and set(world.values()) == {3}, (gen, world, core.state)
    for _ in range(12):  # n2 is silent from here
        t[0] += 1.0
        core.reap()
        beat("n1")
        beat("n3")
    assert core.state.phase is not Phase.FAILED, core.state.message
    assert (gen["n1"], gen["n3"], world["n1"], world["n3"]) == (2, 2, 2, 2), (gen, world, core.state)
    core.close()

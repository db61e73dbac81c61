"""What a node must do now: the instruction a heartbeat reply carries.

:func:`command_for` answers a heartbeat from the job's state: STOP when the job ended (once that is durable) or
the node is cordoned, WAIT (or STOP, for a node that ran workers) while the next generation is planned or formed, the pending job-wide
checkpoint for nodes running the current generation, and START/RESTART with the rank table and the restore plan
once the generation is durable and every node's memory holdings are fresh. Pure: the coordinator calls it with
its lock held and passes the two memory-tier answers as callables, computed only for a START.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from trainguard.recovery.domain import CheckpointAsk, Command, GenerationTable, Instruction
from trainguard.recovery.memory_plan import RestorePlan
from trainguard.recovery.membership import Member
from trainguard.recovery.policy import Phase, PolicyState
from trainguard.recovery.ranks import RankLayout


@dataclass(frozen=True)
class HeartbeatReply:
    """A heartbeat's answer, plus the store write the answer depends on (None when durable already)."""

    response: Instruction
    durable: Future | None = None


def command_for(m: Member, st: PolicyState, layout: RankLayout | None, table: GenerationTable | None,
                interval_s: float, form_note: str, checkpoint: CheckpointAsk | None, full_table_max_nodes: int,
                holdings_fresh: Callable[[], bool], restore_plan: Callable[[], RestorePlan | None],
                state_fut: Future | None, form_missing: int = 0) -> HeartbeatReply:
    """The answer to member ``m``'s heartbeat.

    Args:
        m: the node, its heartbeat recorded.
        st: the policy state.
        layout: the current layout; ``table`` its rank table.
        interval_s: the heartbeat interval told to nodes now.
        form_note: why the first generation is not formed yet ("" when unknown).
        checkpoint: the job-wide checkpoint pending for the current generation, or None.
        full_table_max_nodes: above this many nodes a START carries only the node's own entry.
        holdings_fresh: whether every node's memory holdings are fresh for the table (asked before a START).
        restore_plan: the table's restore plan (asked for a START).
        state_fut: the last job state write; a START, and the job's outcome, wait on it while it is pending or
            failed.
        form_missing: nodes the first generation still needs (0: enough registered, or it waits for another reason).
    """
    ins = Instruction(Command.NONE, st.phase, interval_s, st.message)
    nid = m.info.node_id
    slot = layout.slot_of(nid) if layout is not None else None
    idle = Command.STOP if m.generation >= 0 else Command.WAIT
    pending = state_fut is not None and (not state_fut.done() or state_fut.exception() is not None)
    if st.phase in (Phase.SUCCEEDED, Phase.FAILED):
        # Told only once durable: told at once, a coordinator killed before the outcome's write landed came back
        # RUNNING with every node gone (they had exited), and failed the succeeded job after its membership wait.
        return HeartbeatReply(replace(ins, command=Command.STOP), state_fut if pending else None)
    if nid in st.cordoned:
        return HeartbeatReply(replace(ins, command=Command.STOP,
                                      message=f"node {nid} is cordoned: "
                                              f"{m.refused or st.cordon_why.get(nid) or st.message}"))
    if st.plan is not None or layout is None:
        if layout is None and form_note:
            ins = replace(ins, message=form_note, missing=form_missing)
        elif st.plan is not None and st.plan.waiting:
            ins = replace(ins, message=f"generation {st.plan.generation} waits: {st.plan.waiting}")
        return HeartbeatReply(replace(ins, command=idle))
    if slot is None:
        return HeartbeatReply(replace(ins, command=idle, message="spare: no ranks in this generation"))
    if m.generation == st.generation:
        if checkpoint is not None:
            ins = replace(ins, checkpoint=checkpoint)
        return HeartbeatReply(ins)
    # Up to full_table_max_nodes every START carries the whole table (the service builds its wire form
    # once per generation); above it, only the receiving node's entry.
    big = table is not None and len(table.slots) > full_table_max_nodes
    if not holdings_fresh():
        return HeartbeatReply(replace(ins, message=f"generation {st.generation}: waiting for every node's "
                                      "in-memory checkpoint holdings"))
    ins = replace(ins, command=Command.START if m.generation < 0 else Command.RESTART, table=table,
                  only_node=nid if big else "", restore_plan=restore_plan())
    return HeartbeatReply(ins, state_fut if pending else None)

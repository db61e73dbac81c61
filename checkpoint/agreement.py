"""One step for every rank: the exchange :meth:`Checkpointer.restore` runs inside a process group.

Each rank picks the newest step its own copies can serve; a rank whose copy of the newest step is torn or corrupt
falls back to an older step on its own. Without an exchange the others would load the newest one and the job
would train from a mix of two steps (an FSDP model with shards of steps 5 and 4), then save mismatched steps.
A round is one ``all_reduce`` (MIN) of ``[mine, -mine]``: every rank learns the lowest and the highest step
restored, or that some rank failed (:data:`FAILED`) or has nothing (:data:`NOTHING`).
"""

from __future__ import annotations

#: A rank's report when its restore raised: every rank then raises.
FAILED = -2
#: A rank's report when it found no committed step.
NOTHING = -1


def in_group(world_size: int) -> bool:
    """Whether the default process group is up with ``world_size`` (> 1) ranks: the checkpointer's ranks are its
    members, so they can agree. A lone process, or one that restores another layout on its own (an evaluation
    job of 1 rank inside a bigger group), has nothing to agree with."""
    if world_size <= 1:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size


def exchange(mine: int) -> tuple[int, int]:
    """One round: returns ``(lowest, highest)`` of the values every rank passed (a collective: every rank calls it).

    Args:
        mine: this rank's restored step, :data:`NOTHING` or :data:`FAILED`.
    """
    import torch
    import torch.distributed as dist

    # A pure NCCL group reduces device tensors only; gloo (and "cpu:gloo,cuda:nccl") takes host ones.
    device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t[0]), -int(t[1])

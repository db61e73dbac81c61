"""One step for every rank: the exchange :meth:`Checkpointer.restore` runs inside a process group.

Each rank picks the newest step its own copies can serve; a rank whose copy of the newest step is torn or corrupt
falls back to an older step on its own. Without an exchange the others would load the newest one and the job
would train from a mix of two steps (an FSDP model with shards of steps 5 and 4), then save mismatched steps.
A round is one ``all_reduce`` (MIN) of ``[mine, -mine]``: every rank learns the lowest and the highest step
restored, or that some rank failed (:data:`FAILED`) or has nothing (:data:`NOTHING`). When a rank failed,
:func:`gather_text` tells every rank which ranks failed and why, so they all raise the same error.
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


def _device() -> str:
    import torch
    import torch.distributed as dist

    # A pure NCCL group reduces device tensors only; gloo (and "cpu:gloo,cuda:nccl") takes host ones.
    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def exchange(mine: int) -> tuple[int, int]:
    """One round: returns ``(lowest, highest)`` of the values every rank passed (a collective: every rank calls it).

    Args:
        mine: this rank's restored step, :data:`NOTHING` or :data:`FAILED`.
    """
    import torch
    import torch.distributed as dist

    t = torch.tensor([mine, -mine], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t[0]), -int(t[1])


#: Bytes of text per rank :func:`gather_text` sends at most.
TEXT_LIMIT = 2000


def gather_text(mine: str, limit: int = TEXT_LIMIT) -> list[str]:
    """Every rank's ``mine``, indexed by rank (a collective: every rank calls it).

    Raw UTF-8 bytes in tensors, not ``all_gather_object``: nothing a peer sends is unpickled.

    Args:
        mine: this rank's text; only its first ``limit`` bytes are sent.
        limit: bytes per rank at most.
    """
    import torch
    import torch.distributed as dist

    device = _device()
    raw = mine.encode("utf-8", "replace")[:limit]
    world = dist.get_world_size()
    size = torch.tensor([len(raw)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(1, max(int(s) for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    if raw:
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buf = buf.to(device)
    out = [torch.zeros_like(buf) for _ in range(world)]
    dist.all_gather(out, buf)
    return [bytes(t[:int(n)].cpu().tolist()).decode("utf-8", "replace") for t, n in zip(out, sizes)]

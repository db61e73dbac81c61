"""Writing a step's files directly from in-memory tensors, without a Checkpointer (import, tools, tests)."""

from __future__ import annotations

import json
import time
from typing import Any, Sequence

import torch

from trainguard.checkpoint.manifest import Manifest, compute_checksums, plan_layout
from trainguard.checkpoint.storage import LocalStore, manifest_name


def write_rank_step(store: LocalStore, step: int, rank: int, world_size: int, tree: dict[str, Any],
                    tensors: Sequence[tuple[str, torch.Tensor]], replicated: bool = False,
                    alignment: int = 4096, chunk_bytes: int = 4 << 20, sharded: bool = False) -> Manifest:
    """Writes and commits one rank's copy of ``step`` in the disk layout.

    Args:
        store: destination disk tier.
        step: step number.
        rank: rank of this copy; world_size: ranks in the step.
        tree: the JSON tree (see :mod:`.tree`) whose tensor indices refer to ``tensors``.
        tensors: ``(key, tensor)`` in index order.
        replicated: mark the state as identical on every rank.
        sharded: the tree holds ``"dtensor"`` nodes (shards with global offsets; any world size may restore).
        alignment: byte alignment of tensors; chunk_bytes: checksum chunk size.

    Returns:
        The manifest written.

    Raises:
        OSError: the write failed.
    """
    entries, data_bytes = plan_layout(
        ((k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in tensors), alignment)
    buf = torch.zeros(data_bytes, dtype=torch.uint8)
    for (_, t), e in zip(tensors, entries):
        if e.nbytes:
            buf[e.offset:e.offset + e.nbytes].view(t.dtype).view(t.shape).copy_(t)
    view = memoryview(buf.numpy())
    man = Manifest(job=store.job_dir.rsplit("/", 1)[-1], step=step, rank=rank, world_size=world_size,
                   tensors=entries, tree=tree, data_bytes=data_bytes, alignment=alignment, chunk_bytes=chunk_bytes,
                   replicated=replicated, sharded=sharded, created=time.time())
    man.chunks = compute_checksums(view, data_bytes, chunk_bytes)
    raw = man.to_json()
    try:
        store.write_data(step, rank, view, data_bytes, chunk_bytes, None)
        store.write_small(step, manifest_name(rank), raw)
        store.commit_rank(step, rank, world_size, json.loads(raw)["self_xxh3"])
    except OSError:
        # A full disk's failed import left an empty or half-written step folder that listings showed as a step.
        try:
            store.discard_rank(step, rank)
        except OSError:
            pass  # the write's own error says what is wrong
        raise
    return man

"""Placing saved sharded tensors into any live layout: same mesh, another world size, or one unsharded tensor.

Each rank's manifest tree records, for every DTensor or :class:`~.tree.LocalShard` it saved, the global shape
and the offsets of its local block (see :mod:`.tree`). A restoring rank asks, for each live tensor, for the
global box it holds (its own DTensor shard or LocalShard block, or the whole tensor when the live value is a
plain tensor), and copies in the overlap of every saved shard with that box. Saved shards are memory-mapped
without read-ahead and only the checksum chunks covering the bytes read are verified, so a rank reads only the
byte ranges it needs (plus chunk rounding). When the live shard is exactly the one this rank saved, it is copied
straight from this rank's own (fully verified) copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trainguard.checkpoint.errors import CorruptCheckpointError, StateMismatchError
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.reader import RankCopy, check_fits
from trainguard.checkpoint.tree import LocalShard, dtensor_nodes, dtensor_region, is_dtensor


@dataclass(frozen=True)
class SavedShard:
    """One saved shard of a tensor: which rank's copy holds it, its index there, and its global box."""

    rank: int
    index: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


def shard_index(manifests: dict[int, Manifest]) -> dict[str, list[SavedShard]]:
    """``key -> saved shards`` over every rank's manifest; shards with identical boxes (replicas) appear once."""
    out: dict[str, list[SavedShard]] = {}
    seen: set[tuple[str, tuple[int, ...], tuple[int, ...]]] = set()
    for rank in sorted(manifests):
        man = manifests[rank]
        for node in dtensor_nodes(man.tree):
            i = int(node["i"])
            e = man.tensors[i]
            box = (e.key, tuple(node["o"]), tuple(e.shape))
            if box in seen:
                continue
            seen.add(box)
            out.setdefault(e.key, []).append(SavedShard(rank, i, tuple(node["o"]), tuple(e.shape)))
    return out


def _overlap(a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: tuple[int, ...],
             b_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape))
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return lo, tuple(h - l for l, h in zip(lo, hi))


def _box(t: torch.Tensor, start: tuple[int, ...], size: tuple[int, ...]) -> torch.Tensor:
    for d, (s, n) in enumerate(zip(start, size)):
        t = t.narrow(d, s, n)
    return t


def _byte_span(shape: tuple[int, ...], itemsize: int, start: tuple[int, ...], size: tuple[int, ...]) -> tuple[int, int]:
    """``[first, last+1)`` byte offsets a row-major box touches inside a contiguous tensor of ``shape``."""
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    first = sum(s * st for s, st in zip(start, strides))
    last = sum((s + n - 1) * st for s, n, st in zip(start, size, strides))
    return first * itemsize, (last + 1) * itemsize


class ShardedLoader:
    """The ``TensorLoader`` of a sharded restore (see module docstring).

    Args:
        own: this rank's source copy (the one whose tree is decoded; fully verified by the caller).
        open_rank: opens another rank's copy of the same step without read-ahead (cached by the caller).
        manifests: returns every rank's manifest of the step (read once, on the first reshard).
        verify: check the checksum chunks of every byte range read (``own`` only when ``own_verified`` is
            False: a reshard maps its source copy lazily too instead of verifying all of it).
        own_verified: ``own`` was verified whole before loading.
    """

    def __init__(self, own: RankCopy, open_rank: Callable[[int], RankCopy],
                 manifests: Callable[[], dict[int, Manifest]], verify: bool = True, own_verified: bool = True) -> None:
        self.own = own
        self.open_rank = open_rank
        self._manifests = manifests
        self._index: dict[str, list[SavedShard]] | None = None
        self.verify = verify
        self.own_verified = own_verified
        self._plain = own.loader()
        self.resharded = 0

    def _check_own(self, index: int) -> None:
        if self.verify and not self.own_verified:
            e = self.own.manifest.tensors[index]
            self.own.verify_range(e.offset, e.offset + e.nbytes)

    def __call__(self, index: int, target: Any, node: dict[str, Any] | None = None) -> Any:
        if node is None:
            self._check_own(index)
            return self._plain(index, target)
        e = self.own.manifest.tensors[index]
        dtype = getattr(torch, e.dtype)
        gshape = tuple(int(x) for x in node["g"])
        if target is None:
            dst, off, result = torch.empty(gshape, dtype=dtype), (0,) * len(gshape), None
        elif isinstance(target, LocalShard):
            if target.global_shape != gshape or target.tensor.dtype != dtype:
                raise StateMismatchError(
                    f"{e.key}: the checkpoint holds {str(dtype).removeprefix('torch.')}{list(gshape)}, the live "
                    f"LocalShard is of {str(target.tensor.dtype).removeprefix('torch.')}{list(target.global_shape)}")
            dst, off, result = target.tensor, target.offsets, target
        elif is_dtensor(target):
            check_fits(e.key, target, gshape, dtype)
            lshape, off = dtensor_region(target)
            dst, result = target.to_local(), target
            if tuple(dst.shape) != lshape:
                raise StateMismatchError(f"{e.key}: the live DTensor's local tensor is {list(dst.shape)} but its "
                                         f"placements give {list(lshape)}; restore into evenly placed shards")
        else:
            check_fits(e.key, target, gshape, dtype)
            dst, off, result = target, (0,) * len(gshape), target
        with torch.no_grad():
            if tuple(node["o"]) == tuple(off) and tuple(e.shape) == tuple(dst.shape):
                self._check_own(index)
                dst.copy_(self.own.tensor(index))  # same layout: this rank's own shard
            else:
                self._assemble(e.key, dst, off)
        return dst if result is None else result

    def _assemble(self, key: str, dst: torch.Tensor, off: tuple[int, ...]) -> None:
        if self._index is None:
            self._index = shard_index(self._manifests())
        covered = 0
        for sh in self._index.get(key, []):
            ov = _overlap(off, tuple(dst.shape), sh.offsets, sh.shape)
            if ov is None:
                continue
            lo, size = ov
            copy = self.own if sh.rank == self.own.manifest.rank else self.open_rank(sh.rank)
            entry = copy.manifest.tensors[sh.index]
            if entry.key != key:
                raise CorruptCheckpointError(f"{copy.where}: tensor {sh.index} is {entry.key}, expected {key}")
            src_start = tuple(a - b for a, b in zip(lo, sh.offsets))
            if self.verify and (copy is not self.own or not self.own_verified):
                itemsize = torch.empty((), dtype=dst.dtype).element_size()
                a, b = _byte_span(sh.shape, itemsize, src_start, size)
                copy.verify_range(entry.offset + a, entry.offset + b)
            _box(dst, tuple(a - b for a, b in zip(lo, off)), size).copy_(_box(copy.tensor(sh.index), src_start, size))
            covered += math.prod(size)
        self.resharded += 1
        if covered != dst.numel():
            raise CorruptCheckpointError(f"{key}: the saved shards cover {covered} of the {dst.numel()} elements "
                                         f"this rank needs at offsets {list(off)}; a rank's copy is missing")


__all__ = ["SavedShard", "ShardedLoader", "shard_index"]

"""Placing saved sharded tensors into any live layout: same mesh, another world size, or one unsharded tensor.

Each rank's manifest tree records, for every DTensor or :class:`~.tree.LocalShard` it saved, the global shape
and the offsets of its local block (see :mod:`.tree`). A restoring rank asks, for each live tensor, for the
global box it holds (its own DTensor shard or LocalShard block, or the whole tensor when the live value is a
plain tensor), and copies in the overlap of every saved shard with that box. Saved shards are memory-mapped
without read-ahead and only the checksum chunks covering the bytes read are verified, so a rank reads only the
byte ranges it needs (plus chunk rounding). When the live shard is exactly the one this rank saved, it is copied
straight from this rank's own (fully verified) copy.

The ranks' saved shards of a tensor must tile it: every element saved by exactly one box (a box saved
identically by several ranks, a replica, counts once). Nothing at save time can check that (each rank knows only
its own :class:`~.tree.LocalShard` offsets), so :func:`shard_layout_problems` is the one check that restore,
``ckpt verify``/``gc`` and ``ckpt export`` apply: a reshard runs it before writing anything into the live state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trainguard.checkpoint.errors import CorruptCheckpointError, StateMismatchError
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.reader import RankCopy, check_fits
from trainguard.checkpoint.tree import (
    LocalShard,
    dtensor_nodes,
    dtensor_region,
    is_dtensor,
    placed_as_saved,
    sharded_targets,
)


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


def _region(lo: tuple[int, ...], size: tuple[int, ...]) -> str:
    """``[4:6, 0:3]``: a box as the index a user would slice it with."""
    return "[" + ", ".join(f"{a}:{a + n}" for a, n in zip(lo, size)) + "]"


_LAYOUT_HINT = ("the ranks' saved shards (their LocalShard offsets and shapes) do not tile the tensor, so the step "
                "cannot be resharded or exported; restore it in the layout that saved it, or restore an older step, "
                "and give each rank's LocalShard the block that rank alone holds")


def _key_problem(key: str, shards: list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], str]]
                 ) -> str | None:
    """Why the saved shards ``(rank, offsets, shape, global shape, dtype)`` of ``key`` do not tile it, or None."""
    r0, _, _, g, dtype = shards[0]
    for r, off, shape, g2, dt in shards[1:]:
        if g2 != g:
            return (f"{key}: rank {r0} saved it as a block of a {list(g)} tensor, rank {r} of a {list(g2)} one; "
                    "every rank must save the same global shape")
        if dt != dtype:
            return f"{key}: rank {r0} saved it as {dtype}, rank {r} as {dt}; every rank must save one dtype"
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for r, off, shape, _, _ in shards:
        if len(off) != len(g) or len(shape) != len(g) or any(
                o < 0 or n < 0 or o + n > m for o, n, m in zip(off, shape, g)):
            return (f"{key}: rank {r} saved the block {_region(off, shape)}, which lies outside its global shape "
                    f"{list(g)}; the manifest is damaged")
        if (off, shape) not in seen and math.prod(shape) > 0:  # a replica (same box) counts once
            seen.add((off, shape))
            boxes.append((r, off, shape))
    total = math.prod(g)
    if g:
        # Sweep along the dimension the shards split most finely (Shard(0), Shard(1), a 2-D grid): the boxes still
        # open at each start are then few, and the pairwise test stays near linear in the number of shards.
        d = max(range(len(g)), key=lambda i: len({b[1][i] for b in boxes}))
        active: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        for b in sorted(boxes, key=lambda b: b[1][d]):
            active = [a for a in active if a[1][d] + a[2][d] > b[1][d]]
            for a in active:
                ov = _overlap(a[1], a[2], b[1], b[2])
                if ov is not None:
                    ranks = sorted({a[0], b[0]})
                    return (f"{key}: ranks {ranks[0]} and {ranks[-1]} both saved {_region(*ov)} of its {list(g)} "
                            f"(their blocks {_region(a[1], a[2])} and {_region(b[1], b[2])} overlap); {_LAYOUT_HINT}")
            active.append(b)
    covered = sum(math.prod(b[2]) for b in boxes)
    if covered >= total:
        return None
    where = ""
    for dim in range(len(g)):  # a slab no shard touches along some dimension names the gap; else the count does
        pos = 0
        for lo, hi in sorted((b[1][dim], b[1][dim] + b[2][dim]) for b in boxes) + [(g[dim], g[dim])]:
            if lo > pos:
                where = " " + "[" + ", ".join(f"{pos}:{lo}" if i == dim else ":" for i in range(len(g))) + "]"
                break
            pos = max(pos, hi)
        if where:
            break
    return (f"{key}: no rank saved{where or ' some elements'} of its {list(g)} ({total - covered} of {total} "
            f"elements are in no saved shard); {_LAYOUT_HINT}")


def shard_layout_problems(manifests: dict[int, Manifest], limit: int = 3) -> list[str]:
    """Why the shards every rank saved of a sharded step do not tile their tensors: one line per tensor with a
    gap (elements no rank saved), an overlap (elements two ranks saved, which are named), a global shape or dtype
    the ranks disagree on, or a box outside the tensor; at most ``limit`` lines, then a count of the others.
    Empty when the layout is consistent. Plain (unsharded) tensors are not shards and are not looked at.

    The one check restore (before a reshard writes anything), ``ckpt verify``, ``ckpt gc`` and ``ckpt export``
    apply, so that they cannot disagree on a step.
    """
    by_key: dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], str]]] = {}
    for rank in sorted(manifests):
        man = manifests[rank]
        for node in dtensor_nodes(man.tree):
            e = man.tensors[int(node["i"])]
            by_key.setdefault(e.key, []).append((rank, tuple(int(x) for x in node["o"]), tuple(e.shape),
                                                 tuple(int(x) for x in node["g"]), e.dtype))
    problems = [p for p in (_key_problem(k, v) for k, v in by_key.items()) if p is not None]
    if len(problems) > limit:
        problems = problems[:limit] + [f"and {len(problems) - limit} more tensor(s) alike"]
    return problems


def check_shard_layout(manifests: dict[int, Manifest], what: str) -> None:
    """Raises :class:`CorruptCheckpointError` (``what: `` and each of :func:`shard_layout_problems`) unless the
    saved shards of every tensor tile it."""
    problems = shard_layout_problems(manifests)
    if problems:
        raise CorruptCheckpointError(f"{what}: " + "; ".join(problems))


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
        self.tree = own.manifest.tree
        self._layout_checked = False

    def check_before_loading(self, state: Any) -> None:
        """Before anything is loaded into ``state``: when some sharded tensor of it is not the very block this
        rank's copy holds (a reshard), checks that the saved shards tile every tensor of the step.

        Before, each tensor's coverage was counted after its overlaps were copied in, so a gap or an overlap
        between the ranks' ``LocalShard`` blocks raised with the live tensor half written (with
        ``corrupt_ok=True`` too). Raised here, the step counts as corrupt like one failing its checksums: restore
        tries the next tier and older steps, and with ``corrupt_ok=True`` and none left the state is untouched.
        A restore in the saving layout reads no other rank's manifest and so does not check (it reads only its
        own, complete, block); ``ckpt verify`` does.

        Raises:
            CorruptCheckpointError: see :func:`shard_layout_problems`.
        """
        if self._layout_checked:
            return
        entries = self.own.manifest.tensors
        if not all(placed_as_saved(node, entries[int(node["i"])], target)
                   for node, target in sharded_targets(self.tree, state)):
            self._check_layout()

    def _check_layout(self) -> None:
        manifests = self._manifests()
        check_shard_layout(manifests, f"step {self.own.manifest.step}")
        self._index = shard_index(manifests)
        self._layout_checked = True

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
        if not self._layout_checked:
            # Not foreseen by check_before_loading (an optimizer's moment of another dtype, reloaded whole):
            # still checked before this tensor is written. The tiling makes each box exactly covered.
            self._check_layout()
        assert self._index is not None
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
        self.resharded += 1


__all__ = ["SavedShard", "ShardedLoader", "check_shard_layout", "shard_index", "shard_layout_problems"]

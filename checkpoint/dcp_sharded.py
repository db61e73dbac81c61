"""Streaming conversion between sharded trainguard steps and sharded ``torch.distributed.checkpoint`` (DCP) ones.

Export: one saved rank at a time, each DTensor shard becomes a DCP chunk (global offsets and sizes from our
manifest tree), replicated and non-tensor values are written once (from rank 0), and the ``.metadata`` file
is DCP's own ``Metadata`` (flattened keys from DCP's own ``flatten_state_dict``), so ``dcp.load`` places the
chunks into any world size or mesh with its own planner. Files follow ``FileSystemWriter``'s layout
(``__<rank>_0.distcp``, each item a ``torch.save`` blob at a recorded offset).

Import: the ``.metadata`` is read with the restricted unpickler of :mod:`.dcp`; for each target rank in turn,
each tensor's dim-0 shard (torch.chunk placement, like FSDP2's ``Shard(0)``) is assembled from the DCP chunks
overlapping it, one chunk in memory at a time, and written as a sharded step that any world size restores.
Neither direction ever holds more than one rank's data.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from typing import Any, Callable

import torch

from trainguard.checkpoint.dcp import numpy_as_tensors
from trainguard.checkpoint.errors import CheckpointError, CorruptCheckpointError
from trainguard.checkpoint.manifest import Manifest
from trainguard.checkpoint.reader import RankCopy
from trainguard.checkpoint.shards import check_shard_layout
from trainguard.checkpoint.storage import LocalStore, manifest_name
from trainguard.checkpoint.tree import capture, decode


#: Written beside a sharded export's ``.metadata``: DCP's ``Metadata`` has no field for the step, and without it
#: ``ckpt import`` of the export came back as step 0 (a resumed run restarted its schedule).
EXPORT_RECORD = "trainguard-export.json"


def exported_step(src_dir: str) -> int | None:
    """The step a sharded ``ckpt export`` wrote to ``src_dir`` (its :data:`EXPORT_RECORD`); None without one.

    Raises:
        CorruptCheckpointError: the record is there but unreadable or holds no step.
    """
    path = os.path.join(src_dir, EXPORT_RECORD)
    try:
        with open(path) as f:
            step = json.load(f)["step"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{path} is not a trainguard export record ({exc}); pass --step") from exc
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CorruptCheckpointError(f"{path} holds step {step!r}, not a step number; pass --step")
    return step


def _flatten(nested: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(nested)


def export_sharded(store: LocalStore, step: int, world_size: int, out_dir: str,
                   progress: Callable[[int], None] | None = None) -> None:
    """Writes committed sharded ``step`` of ``store`` as a DCP checkpoint in ``out_dir``, one rank at a time.

    Raises:
        CorruptCheckpointError: a rank's copy fails verification, or the ranks' shards do not tile a tensor
            (checked before anything is written).
        OSError: the output cannot be written.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    mans = {r: Manifest.from_json(store.read_small(step, manifest_name(r)), f"step {step} rank {r} manifest"
                                  ).check_place(step, r, f"step {step} rank {r}") for r in range(world_size)}
    # Before any file is written: DCP's load refuses (or misplaces) chunks that leave a gap or overlap.
    check_shard_layout(mans, f"step {step}")
    os.makedirs(out_dir, exist_ok=True)
    md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner_data: dict[str, Any] = {}
    written: set[tuple[str, tuple[int, ...]]] = set()
    for r in range(world_size):
        man = mans[r]
        rel = f"__{r}_0.distcp"
        with RankCopy(man, store.local_data_path(step, r), f"step {step} rank {r}", populate=False,
                      advisory_lock=True) as copy:
            copy.verify(progress)
            views: dict[int, tuple[int, dict[str, Any] | None]] = {}

            def load(i: int, _t: Any, node: Any = None, c: RankCopy = copy) -> torch.Tensor:
                v = c.tensor(i)
                views[id(v)] = (i, node)
                return v

            nested = decode(numpy_as_tensors(man.tree), load, None)
            flat, mapping = _flatten(nested)
            planner_data.update(mapping)
            tmp = os.path.join(out_dir, rel + ".tmp")
            with open(tmp, "wb") as f:
                for fqn, value in flat.items():
                    info = views.get(id(value)) if isinstance(value, torch.Tensor) else None
                    if info is None:
                        if r != 0 or isinstance(value, torch.Tensor):
                            if isinstance(value, torch.Tensor):
                                raise CheckpointError(f"cannot export {fqn}: a tensor outside the checkpoint tree")
                            continue  # non-tensor values are the same on every rank: written once
                        off = f.tell()
                        torch.save(value, f)
                        md[fqn] = BytesStorageMetadata()
                        storage[MetadataIndex(fqn)] = _StorageInfo(rel, off, f.tell() - off)
                        continue
                    _, node = info
                    if node is None:  # a plain tensor of a sharded step: replicated, written by rank 0
                        if r != 0:
                            continue
                        gshape, offsets = tuple(value.shape), (0,) * value.dim()
                    else:
                        gshape, offsets = tuple(node["g"]), tuple(node["o"])
                    if (fqn, offsets) in written:
                        continue  # a replica of a shard already written
                    written.add((fqn, offsets))
                    off = f.tell()
                    torch.save(value.clone(), f)  # a clone: saving the view would write its whole storage
                    entry = md.get(fqn)
                    if entry is None:
                        entry = md[fqn] = TensorStorageMetadata(TensorProperties(dtype=value.dtype),
                                                                torch.Size(gshape), [])
                    entry.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(value.shape)))
                    storage[MetadataIndex(fqn, offsets)] = _StorageInfo(rel, off, f.tell() - off)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(out_dir, rel))
            views.clear()
            del nested, flat
    meta = Metadata(state_dict_metadata=md, planner_data=planner_data, storage_data=storage,
                    storage_meta=StorageMeta(), version="1.0.0")
    for name, blob in ((".metadata", pickle.dumps(meta)),
                       (EXPORT_RECORD, json.dumps({"step": step, "world_size": world_size}).encode())):
        tmp = os.path.join(out_dir, name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(out_dir, name))


def dim0_shard(size: tuple[int, ...], rank: int, world_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, shape)`` of ``rank``'s dim-0 shard with torch.chunk placement (as DTensor ``Shard(0)``)."""
    if not size:
        return (), ()
    per = math.ceil(size[0] / world_size) if size[0] else 0
    start = min(rank * per, size[0])
    n = max(0, min(size[0], start + per) - start)
    return (start,) + (0,) * (len(size) - 1), (n,) + tuple(size[1:])


def import_sharded(src_dir: str, md: Any, store: LocalStore, step: int, world_size: int) -> None:
    """Writes DCP checkpoint ``src_dir`` (its parsed metadata ``md``) as sharded ``step`` over ``world_size`` ranks.

    Raises:
        CorruptCheckpointError: an item cannot be read or needs unsafe unpickling; chunks do not cover a tensor.
    """
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex, TensorStorageMetadata

    from trainguard.checkpoint.writer import write_rank_step

    def read_item(index: Any, what: str) -> Any:
        info = md.storage_data.get(index)
        if info is None:
            raise CorruptCheckpointError(f"{src_dir}: no storage entry for {what}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{src_dir}: {what} is stored with extensions {info.transform_descriptors}; "
                                  "import reads plain FileSystemWriter checkpoints only")
        with open(os.path.join(src_dir, info.relative_path), "rb") as f:
            f.seek(info.offset)
            raw = f.read(info.length)
        try:
            return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        except Exception as exc:
            # The type only: torch's message runs on for lines, with terminal escapes, into the one-line error.
            raise CorruptCheckpointError(f"{src_dir}: {what} is a pickled object that needs unsafe unpickling "
                                         f"({type(exc).__name__}); import refuses it") from exc

    mapping = md.planner_data if isinstance(md.planner_data, dict) else {}
    others = {fqn: read_item(MetadataIndex(fqn), fqn) for fqn, sm in md.state_dict_metadata.items()
              if isinstance(sm, BytesStorageMetadata)}
    tensors_md = {fqn: sm for fqn, sm in md.state_dict_metadata.items() if isinstance(sm, TensorStorageMetadata)}
    for rank in range(world_size):
        flat: dict[str, Any] = dict(others)
        regions: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        for fqn, sm in tensors_md.items():
            gsize = tuple(int(x) for x in sm.size)
            off, shape = dim0_shard(gsize, rank, world_size)
            local = torch.empty(shape, dtype=sm.properties.dtype)
            covered = 0
            for ci, chunk in enumerate(sm.chunks):
                c_off, c_size = tuple(chunk.offsets), tuple(chunk.sizes)
                lo = tuple(max(a, b) for a, b in zip(off, c_off))
                hi = tuple(min(a + n, b + m) for a, n, b, m in zip(off, shape, c_off, c_size))
                if any(h <= l for l, h in zip(lo, hi)) and gsize:
                    continue
                data = read_item(MetadataIndex(fqn, c_off, ci), f"{fqn} chunk at {list(c_off)}")
                if tuple(data.shape) != c_size:
                    raise CorruptCheckpointError(f"{src_dir}: {fqn} chunk at {list(c_off)} is "
                                                 f"{list(data.shape)}, metadata says {list(c_size)}")
                dst, src = local, data
                for d, (l, h) in enumerate(zip(lo, hi)):
                    dst = dst.narrow(d, l - off[d], h - l)
                    src = src.narrow(d, l - c_off[d], h - l)
                dst.copy_(src)
                covered += math.prod(h - l for l, h in zip(lo, hi))
                del data
            if covered != local.numel():
                raise CorruptCheckpointError(f"{src_dir}: the chunks of {fqn} cover {covered} of the "
                                             f"{local.numel()} elements of rank {rank}'s shard")
            flat[fqn] = local
            if gsize:
                regions[fqn] = (gsize, off)
        nested = unflatten_state_dict(flat, {k: mapping.get(k, (k,)) for k in flat})
        cap = capture(nested)
        # capture() names each tensor by its dotted path, which is DCP's flattened key.
        sharded = {i: regions[c.key] for i, c in enumerate(cap.tensors) if c.key in regions}
        tree = _mark_sharded(cap.tree, sharded, world_size)
        write_rank_step(store, step, rank, world_size, tree, [(c.key, c.tensor) for c in cap.tensors],
                        sharded=True)
        del flat, nested, cap


def _mark_sharded(node: Any, sharded: dict[int, tuple[tuple[int, ...], tuple[int, ...]]], world_size: int) -> Any:
    if isinstance(node, dict):
        if node.get("t") == "tensor" and int(node["i"]) in sharded and not node.get("np"):
            g, o = sharded[int(node["i"])]
            return {"t": "dtensor", "i": node["i"], "g": list(g), "o": list(o), "mesh": [world_size],
                    "pl": ["S(0)"]}
        return {k: _mark_sharded(v, sharded, world_size) for k, v in node.items()}
    if isinstance(node, list):
        return [_mark_sharded(v, sharded, world_size) for v in node]
    return node


__all__ = ["dim0_shard", "export_sharded", "import_sharded"]

"""The on-disk format: a flat aligned data file of raw tensor bytes per rank, plus a JSON manifest.

Data file: every tensor's bytes at an offset aligned to ``alignment`` (default 4096), so a reader can
``readinto``/``mmap`` straight into place (and O_DIRECT works); the file length is a multiple of the alignment.
A tensor smaller than the alignment sits at a :data:`SMALL_ALIGNMENT` boundary instead: page-aligned, 40,000
16-byte tensors (a model of small parameters and its Adam state) took 164 MB per copy, in every memory slot too,
for 0.6 MB of values. Readers take each offset from the manifest, so both layouts read alike.

Manifest (JSON, no pickle anywhere): format tag, trainguard version, job, step, rank, world size, replication
flag, data-file length, chunk size and one xxh3_64 checksum per chunk of the data file, one entry per tensor
(key, dtype, shape, offset, nbytes), and the JSON tree of the non-tensor state (see :mod:`.tree`). ``sharded``
marks a copy holding DTensor shards (their global shape, offsets, mesh and placements are in the tree), which
any world size may restore. The manifest
carries its own checksum (``self_xxh3``) over its canonical JSON, so a flipped byte in it is detected too.

This module must not import torch: the persist process uses it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Iterable, Mapping, Sequence

import xxhash

from trainguard._version import __version__
from trainguard.checkpoint.errors import CorruptCheckpointError

FORMAT = "trainguard-ckpt/1"
CHECKSUM_ALGO = "xxh3_64"
#: Offset alignment of tensors smaller than the manifest's ``alignment``: a cache line, and a multiple of every
#: stored dtype's element size.
SMALL_ALIGNMENT = 64

#: bytes per element of the dtype names we store (``str(torch.float32)`` without the ``torch.`` prefix).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    # MX formats (MXFP8's e8m0 block scales, FP4 weights packed two per byte): refused before, so a model trained
    # with them could not be checkpointed at all. Raw bytes like the others.
    "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1,
}


@dataclass
class TensorEntry:
    """Where one tensor lives in the data file.

    Attributes:
        key: dotted path of the tensor in the state (``model.fc.weight``).
        dtype: dtype name (``float32``).
        shape: sizes.
        offset: byte offset in the data file (a multiple of the alignment; of :data:`SMALL_ALIGNMENT` for a
            tensor smaller than the alignment).
        nbytes: length in bytes.
    """

    key: str
    dtype: str
    shape: list[int]
    offset: int
    nbytes: int


@dataclass
class Manifest:
    """Everything needed to read, verify and place one rank's data file (see module docstring)."""

    job: str
    step: int
    rank: int
    world_size: int
    tensors: list[TensorEntry]
    tree: dict[str, Any]
    data_bytes: int
    alignment: int = 4096
    chunk_bytes: int = 4 << 20
    chunks: list[str] = field(default_factory=list)
    replicated: bool = False
    sharded: bool = False
    version: str = __version__
    format: str = FORMAT
    checksum: str = CHECKSUM_ALGO
    created: float = 0.0
    #: the checkpoint location (``CheckpointConfig.location``) of the Checkpointer that wrote the copy; a
    #: memory-tier copy is restored only by a Checkpointer of the same location ("" in older copies).
    location: str = ""

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> bytes:
        """Canonical JSON with a ``self_xxh3`` checksum of everything else.

        Runs on the training thread at every save, so each field is encoded once and nothing is copied: with
        ``dataclasses.asdict`` (a deep copy) and the body encoded twice, a state of 40,000 small tensors spent
        seconds per save here. The bytes are those of ``json.dumps(body, sort_keys=True, separators=(",", ":"))``,
        which :meth:`from_json` checks.
        """
        parts = {f.name: _dumps(getattr(self, f.name)) for f in fields(self) if f.name != "tensors"}
        parts["tensors"] = _dumps([vars(t) for t in self.tensors])
        digest = xxhash.xxh3_64_hexdigest(_join(parts).encode())
        parts["self_xxh3"] = _dumps(digest)
        return _join(parts).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str = "manifest") -> "Manifest":
        """Parses and verifies a manifest.

        Args:
            raw: the file content.
            where: path or description used in error messages.

        Raises:
            CorruptCheckpointError: not JSON, wrong format, or the self checksum does not match.
        """
        try:
            body = json.loads(raw)
            declared = body.pop("self_xxh3")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{where} is not a valid manifest ({exc}); it is torn or damaged") from exc
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        if xxhash.xxh3_64_hexdigest(text.encode()) != declared:
            raise CorruptCheckpointError(f"{where} fails its checksum; the manifest is damaged")
        if body.get("format") != FORMAT:
            raise CorruptCheckpointError(f"{where} has format {body.get('format')!r}, expected {FORMAT!r}")
        try:
            body["tensors"] = [TensorEntry(**t) for t in body["tensors"]]
            return cls(**body)
        except (TypeError, KeyError) as exc:  # KeyError: no tensor list (it escaped as an uncaught error)
            raise CorruptCheckpointError(f"{where} has unexpected fields ({exc})") from exc

    def check_place(self, step: int, rank: int, where: str) -> "Manifest":
        """Returns this manifest when it names ``step`` and ``rank``, the step folder and file it was read from.

        Every reader of a persistent tier checks this, so a step folder copied or renamed to another step (its
        checksums all pass) is refused alike by restore, ``ckpt verify``, ``ckpt gc`` and ``ckpt export``.

        Raises:
            CorruptCheckpointError: the manifest names another step or rank.
        """
        if self.step != step or self.rank != rank:
            raise CorruptCheckpointError(f"{where}: manifest names step {self.step} rank {self.rank}; the step "
                                         "folder was copied or renamed, delete it")
        return self

    @property
    def n_chunks(self) -> int:
        """Number of checksummed chunks covering the data file."""
        return math.ceil(self.data_bytes / self.chunk_bytes) if self.data_bytes else 0


def complete_world_size(world_sizes: Mapping[int, int]) -> int:
    """The world size of a step when every one of its ranks wrote a copy, else 0.

    Args:
        world_sizes: ``{rank: world size its copy declares}`` (commit markers or in-memory manifests).

    Returns:
        ``W`` when rank 0 declares ``W`` and ranks ``0..W-1`` all declare ``W``; 0 otherwise. Copies of ranks
        ``>= W`` are not the step's: they were left by an earlier save of the same step number at a larger world
        size. A job that lost a node and shrank resaves the steps that node never finished, where the surviving
        node's higher ranks had already committed; those stale copies made the step incomplete for ever (its
        ``wait()`` returned True, yet no restore could load it).
    """
    ws = world_sizes.get(0, 0)
    if not isinstance(ws, int) or ws <= 0:
        return 0
    return ws if all(world_sizes.get(r) == ws for r in range(ws)) else 0


def _dumps(value: Any) -> str:
    """One value in the manifest's canonical JSON."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _join(parts: Mapping[str, str]) -> str:
    """The canonical JSON object of already encoded values (keys sorted, as ``json.dumps`` sorts them)."""
    return "{" + ",".join(f"{_dumps(k)}:{parts[k]}" for k in sorted(parts)) + "}"


def align_up(n: int, alignment: int) -> int:
    """Rounds ``n`` up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


def plan_layout(specs: Iterable[tuple[str, str, Sequence[int]]], alignment: int) -> tuple[list[TensorEntry], int]:
    """Assigns aligned offsets to tensors.

    Args:
        specs: ``(key, dtype name, shape)`` per tensor, in order.
        alignment: byte alignment of the offset of every tensor of at least this many bytes (the others are
            aligned to :data:`SMALL_ALIGNMENT`) and of the total length.

    Returns:
        The entries and the data-file length in bytes.

    Raises:
        ValueError: unknown dtype name.
    """
    entries: list[TensorEntry] = []
    offset = 0
    for key, dtype, shape in specs:
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {key} has dtype {dtype}, which the checkpoint format does not store")
        n = DTYPE_SIZES[dtype] * math.prod(shape)
        offset = align_up(offset, alignment if n >= alignment else min(SMALL_ALIGNMENT, alignment))
        entries.append(TensorEntry(key, dtype, list(shape), offset, n))
        offset += n
    return entries, max(align_up(offset, alignment), alignment)


def chunk_checksum(buf: Any) -> str:
    """xxh3_64 hex digest of a buffer (bytes, memoryview, mmap slice)."""
    return xxhash.xxh3_64_hexdigest(buf)


def compute_checksums(view: memoryview, data_bytes: int, chunk_bytes: int) -> list[str]:
    """Checksums of each ``chunk_bytes`` piece of ``view[:data_bytes]``."""
    return [chunk_checksum(view[o:min(o + chunk_bytes, data_bytes)]) for o in range(0, data_bytes, chunk_bytes)]


_PIECE_BYTES = 1 << 20  # verify_file_checksums's read size


def verify_file_checksums(fd: int, manifest: Manifest, where: str) -> None:
    """Checks every chunk of the data file open at ``fd`` against the manifest, reading with ``pread``.

    Not through an mmap: a file truncated under a mapping (a slot cut back after a failed grow, an operator, a
    tmpfs cleanup) raises SIGBUS on the next page touched, which kills the reading process (the node agent and
    every job it serves). ``pread`` returns a short read there instead, reported as a torn copy.

    Raises:
        CorruptCheckpointError: the file ends before ``manifest.data_bytes`` (the message says where), or a chunk
            mismatches.
        OSError: the file cannot be read.
    """
    if len(manifest.chunks) != manifest.n_chunks:
        raise CorruptCheckpointError(f"{where}: manifest lists {len(manifest.chunks)} checksums, "
                                     f"expected {manifest.n_chunks}")
    cb = manifest.chunk_bytes
    # Read in pieces that stay in the CPU cache, hashed as a stream (same digest as one call on the chunk): one
    # chunk-sized buffer made the copy out of the page cache go through memory, 1.6x slower than the mapping.
    buf = bytearray(min(_PIECE_BYTES, cb, manifest.data_bytes))
    view = memoryview(buf)
    try:
        for i, expected in enumerate(manifest.chunks):
            o = i * cb
            end = min(o + cb, manifest.data_bytes)
            h = xxhash.xxh3_64()
            at = o
            while at < end:
                n = os.preadv(fd, [view[:min(len(buf), end - at)]], at)
                if n == 0:
                    raise CorruptCheckpointError(
                        f"{where}: data file ends at byte {at}, manifest says {manifest.data_bytes}; "
                        "the data file is torn (truncated)")
                h.update(view[:n])
                at += n
            if h.hexdigest() != expected:
                raise CorruptCheckpointError(f"{where}: chunk {i} (bytes {o}..{end}) fails its {CHECKSUM_ALGO} "
                                             "checksum; the data is corrupt")
    finally:
        view.release()


def verify_checksums(view: memoryview, manifest: Manifest, where: str, progress: Any = None) -> None:
    """Checks every chunk of a data buffer against the manifest.

    Args:
        view: the data (at least ``manifest.data_bytes`` long).
        manifest: its manifest.
        where: description for error messages.
        progress: optional callable ``(nbytes)`` called after each chunk (progress bars).

    Raises:
        CorruptCheckpointError: short data or a chunk mismatch (the message names the chunk and offset).
    """
    if len(view) < manifest.data_bytes:
        raise CorruptCheckpointError(
            f"{where} is {len(view)} bytes, manifest says {manifest.data_bytes}; the data file is torn")
    if len(manifest.chunks) != manifest.n_chunks:
        raise CorruptCheckpointError(f"{where}: manifest lists {len(manifest.chunks)} checksums, "
                                     f"expected {manifest.n_chunks}")
    cb = manifest.chunk_bytes
    for i, expected in enumerate(manifest.chunks):
        o = i * cb
        end = min(o + cb, manifest.data_bytes)
        if chunk_checksum(view[o:end]) != expected:
            raise CorruptCheckpointError(f"{where}: chunk {i} (bytes {o}..{end}) fails its {CHECKSUM_ALGO} "
                                         "checksum; the data is corrupt")
        if progress is not None:
            progress(end - o)

"""Reading one rank's copy of a step from any tier: verify every checksum first, then load in place.

A :class:`RankCopy` reads the data (a shared-memory slot, a local data file, or a downloaded remote file) with
``pread``, never through a mapping, straight into the live tensors or into private memory; :meth:`RankCopy.loader`
gives the ``TensorLoader`` :func:`trainguard.checkpoint.tree.restore_into` needs.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
from typing import Any, Callable

import torch
import xxhash

from trainguard.checkpoint.errors import CorruptCheckpointError, StateMismatchError
from trainguard.checkpoint.fileio import NotARegularFileError, open_for_reading
from trainguard.checkpoint.manifest import CHECKSUM_ALGO, Manifest
from trainguard.checkpoint.tree import dtensor_region, is_dtensor


_PIECE_BYTES = 1 << 20  # a slot is read in pieces that stay in the CPU cache until hashed


def _writable(t: torch.Tensor) -> memoryview:
    """A writable byte view of the memory of contiguous CPU tensor ``t`` (for ``preadv``; no numpy needed)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def check_fits(key: str, target: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Raises :class:`StateMismatchError` naming ``key`` unless ``target`` has ``shape`` and ``dtype``."""
    if tuple(target.shape) != tuple(shape) or target.dtype != dtype:
        raise StateMismatchError(
            f"{key}: the checkpoint holds {str(dtype).removeprefix('torch.')}{list(shape)}, the live tensor is "
            f"{str(target.dtype).removeprefix('torch.')}{list(target.shape)}; restore into a state of the same "
            "shapes and dtypes (or leave the key out)")


class RankCopy:
    """A verified-on-demand view of one rank's data.

    Args:
        manifest: the parsed (self-checked) manifest.
        data_path: local path of the data file / slot.
        where: description for messages (``"disk step 120 rank 0"``).
        shared_lock: hold ``flock(LOCK_SH)`` while open (shared-memory slots).
        advisory_lock: hold ``flock(LOCK_SH)`` while open where the filesystem supports it (disk copies: the
            persist process making room on a full disk leaves a step being read in place).
        populate: the whole file will be read: ask the kernel for sequential read-ahead. Off for copies of which
            only some byte ranges are read (another rank's shards during a reshard): no read-ahead beyond them.

    Every copy is read with ``pread``, never mapped: a slot or a data file is a plain file that anyone may
    truncate (an operator's cleanup, another job's gc, a tmpfs cleanup), and a truncation ignores the locks; under
    a mapping it raised SIGBUS in the restoring trainer on the next page past the new end. A cut file now fails
    the read with :class:`CorruptCheckpointError` naming the byte where it ends, and restore falls back (another
    tier, an older step) as for other damage. :meth:`verify` streams the file through a small buffer, and the
    loader reads each tensor straight into the live CPU tensor it restores (no copy of the whole file); other
    reads go through private memory filled chunk by chunk on first use.

    Raises:
        CorruptCheckpointError: the data file is missing or shorter than the manifest says.
    """

    def __init__(self, manifest: Manifest, data_path: str, where: str, shared_lock: bool = False,
                 populate: bool = True, advisory_lock: bool = False) -> None:
        self.manifest = manifest
        self.where = where
        self.path = data_path
        self._verified: set[int] = set()
        self._loaded: set[int] = set()  # chunks read into ``self._mem`` so far
        self._mem: torch.Tensor | None = None
        self.bytes_touched = 0
        try:
            self.fd = open_for_reading(data_path)  # a FIFO there hung the open
        except NotARegularFileError as exc:  # mmap of a folder failed as "[Errno 19] No such device", no path
            raise CorruptCheckpointError(f"{where}: data file {data_path} is {exc.strerror}") from exc
        except OSError as exc:
            raise CorruptCheckpointError(f"{where}: data file {data_path} is missing ({exc.strerror})") from exc
        try:
            if shared_lock:
                fcntl.flock(self.fd, fcntl.LOCK_SH)
            elif advisory_lock:
                try:
                    fcntl.flock(self.fd, fcntl.LOCK_SH)
                except OSError:
                    pass  # no flock on this filesystem: readable all the same
            size = os.fstat(self.fd).st_size
            if size < manifest.data_bytes:
                raise CorruptCheckpointError(
                    f"{where}: data file is {size} bytes, manifest says {manifest.data_bytes}; it is torn")
            try:  # a cold file read whole is read ahead in large pieces; a reshard's ranges are not
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL if populate else os.POSIX_FADV_RANDOM)
            except OSError:
                pass  # only advice
        except BaseException:
            os.close(self.fd)
            raise

    def _pread_into(self, dst: memoryview, at: int, check: str | None) -> None:
        """Fills ``dst`` with the file's bytes from offset ``at``, in pieces hashed right after they land (still
        in the CPU cache); with ``check``, the digest of all of ``dst`` must equal it.

        Raises:
            CorruptCheckpointError: the file ends early (cut short since it was opened) or the digest differs.
        """
        h = xxhash.xxh3_64() if check is not None else None
        done = 0
        while done < len(dst):
            piece = dst[done:done + _PIECE_BYTES]
            try:
                n = os.preadv(self.fd, [piece], at + done)
                if h is not None:
                    h.update(piece[:n])
            finally:
                piece.release()
            if n == 0:
                raise CorruptCheckpointError(
                    f"{self.where}: data file ends at byte {at + done}, manifest says {self.manifest.data_bytes}; "
                    f"{self.path} is torn (truncated while it was read)")
            done += n
        if h is not None and h.hexdigest() != check:
            i = at // self.manifest.chunk_bytes
            raise CorruptCheckpointError(f"{self.where}: chunk {i} (bytes {at}..{at + len(dst)}) fails its "
                                         f"{CHECKSUM_ALGO} checksum; the data is corrupt")

    def _chunk(self, i: int) -> tuple[int, int]:
        cb = self.manifest.chunk_bytes
        return i * cb, min((i + 1) * cb, self.manifest.data_bytes)

    def _load(self, i: int) -> None:
        """Reads chunk ``i`` into ``self._mem`` (checked when it was verified before, or
        when :meth:`verify_range` asks: see there)."""
        if self._mem is None:
            self._mem = torch.empty(self.manifest.data_bytes, dtype=torch.uint8)  # pages come on first write
        o, e = self._chunk(i)
        check = self.manifest.chunks[i] if i in self._verified else None  # the bytes must still be those
        self._pread_into(_writable(self._mem[o:e]), o, check)
        self._loaded.add(i)

    def verify(self, progress: Callable[[int], None] | None = None) -> None:
        """Checks every chunk checksum.

        Raises:
            CorruptCheckpointError: a mismatch (the message names the chunk), or a file cut short.
        """
        man = self.manifest
        if len(man.chunks) != man.n_chunks:
            raise CorruptCheckpointError(f"{self.where}: manifest lists {len(man.chunks)} checksums, "
                                         f"expected {man.n_chunks}")
        # Streamed through one small buffer (no copy of the file is kept): the loader then reads each tensor
        # straight into place, checking nothing changed (see _load_into).
        buf = bytearray(min(_PIECE_BYTES, man.chunk_bytes, max(man.data_bytes, 1)))
        view = memoryview(buf)
        try:
            for i in range(man.n_chunks):
                o, e = self._chunk(i)
                h = xxhash.xxh3_64()
                for at in range(o, e, len(buf)):
                    n = min(len(buf), e - at)
                    self._pread_into(view[:n], at, None)
                    h.update(view[:n])  # still in the CPU cache
                if h.hexdigest() != man.chunks[i]:
                    raise CorruptCheckpointError(f"{self.where}: chunk {i} (bytes {o}..{e}) fails its "
                                                 f"{CHECKSUM_ALGO} checksum; the data is corrupt")
                self._verified.add(i)
                if progress is not None:
                    progress(e - o)
        finally:
            view.release()
        self.bytes_touched = man.data_bytes

    def verify_range(self, start: int, end: int) -> None:
        """Checks only the chunks covering bytes ``[start, end)`` (each chunk once per open copy).

        Raises:
            CorruptCheckpointError: a covering chunk fails its checksum, or the manifest lists too few.
        """
        man = self.manifest
        if end <= start:
            return
        if len(man.chunks) != man.n_chunks:
            raise CorruptCheckpointError(f"{self.where}: manifest lists {len(man.chunks)} checksums, "
                                         f"expected {man.n_chunks}")
        cb = man.chunk_bytes
        for i in range(start // cb, (end - 1) // cb + 1):
            if i in self._verified:
                continue
            o, e = self._chunk(i)
            self._verified.add(i)  # _load checks it now, in the same pass as the read
            try:
                self._load(i)
            except BaseException:
                self._verified.discard(i)
                raise
            self.bytes_touched += e - o

    def tensor(self, index: int) -> torch.Tensor:
        """Tensor ``index``, a view of this copy's private memory (its chunks are read on first use).

        Raises:
            CorruptCheckpointError: the file was cut short, or changed since it was verified.
        """
        e = self.manifest.tensors[index]
        if e.nbytes:
            cb = self.manifest.chunk_bytes
            for i in range(e.offset // cb, (e.offset + e.nbytes - 1) // cb + 1):
                if i not in self._loaded:
                    self._load(i)
        dtype = getattr(torch, e.dtype)
        if self._mem is None:
            return torch.empty(e.shape, dtype=dtype)  # no bytes (nbytes 0)
        return self._mem[e.offset:e.offset + e.nbytes].view(dtype).view(e.shape)

    def _load_into(self, index: int, target: torch.Tensor) -> bool:
        """Reads tensor ``index`` straight into ``target`` when it is a plain, contiguous CPU
        tensor (one copy, as from a mapping; no private memory). Chunks wholly inside it that were verified are
        checked again as they land (the bytes must still be those verified). Returns False when ``target`` does
        not qualify.

        Raises:
            CorruptCheckpointError: the file was cut short, or changed since it was verified.
        """
        if target.device.type != "cpu" or not target.is_contiguous() or is_dtensor(target):
            return False
        e = self.manifest.tensors[index]
        if not e.nbytes:
            return True
        if any(i in self._loaded for i in self._chunks_of(e.offset, e.offset + e.nbytes)):
            return False  # already read into private memory (a reshard): copied from there
        dst = _writable(target)
        at, end = e.offset, e.offset + e.nbytes
        while at < end:
            i = at // self.manifest.chunk_bytes
            o, ce = self._chunk(i)
            stop = min(ce, end)
            whole = at == o and stop == ce and i in self._verified
            self._pread_into(dst[at - e.offset:stop - e.offset], at, self.manifest.chunks[i] if whole else None)
            at = stop
        return True

    def _chunks_of(self, start: int, end: int) -> range:
        cb = self.manifest.chunk_bytes
        return range(start // cb, (end - 1) // cb + 1) if end > start else range(0)

    def loader(self) -> Callable[..., torch.Tensor]:
        """A ``TensorLoader`` for plain (unsharded) tensors: copies into the live tensor, clones without one.

        Raises (from the loader):
            StateMismatchError: the live tensor's shape or dtype differs from the saved one (names the key).
        """

        def load(index: int, target: torch.Tensor | None, node: Any = None) -> torch.Tensor:
            if target is not None:
                e = self.manifest.tensors[index]
                check_fits(e.key, target, tuple(e.shape), getattr(torch, e.dtype))
                with torch.no_grad():
                    if self._load_into(index, target):
                        return target
            src = self.tensor(index)
            if target is None:
                return src.clone()
            check_fits(self.manifest.tensors[index].key, target, tuple(src.shape), src.dtype)
            with torch.no_grad():
                if is_dtensor(target):
                    # A plain checkpoint (DDP, one GPU) restored into a sharded model (FSDP2, tensor parallel): each
                    # rank copies its own region of the full tensor; copy_ into the DTensor raised "got mixed
                    # torch.Tensor and DTensor".
                    shape, offsets = dtensor_region(target)
                    target.to_local().copy_(src[tuple(slice(o, o + n) for o, n in zip(offsets, shape))])
                else:
                    target.copy_(src)
            return target

        return load

    def close(self) -> None:
        """Releases the file and its lock."""
        self._mem = None  # views handed out keep their memory alive
        os.close(self.fd)

    def __enter__(self) -> "RankCopy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

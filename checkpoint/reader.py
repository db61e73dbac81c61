"""Reading one rank's copy of a step from any tier: verify every checksum first, then load in place.

A :class:`RankCopy` maps the data (a tmpfs slot, a local data file, or a downloaded remote file) privately
(copy-on-write, never written) and exposes it as a uint8 tensor; :meth:`RankCopy.loader` gives the
``TensorLoader`` :func:`trainguard.checkpoint.tree.restore_into` needs.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat
import warnings
from typing import Any, Callable

import torch

from trainguard.checkpoint.errors import CorruptCheckpointError, StateMismatchError
from trainguard.checkpoint.manifest import CHECKSUM_ALGO, Manifest, chunk_checksum, verify_checksums
from trainguard.checkpoint.tree import dtensor_region, is_dtensor


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
        populate: pre-fault the whole mapping (read it all ahead). Off for copies of which only some byte ranges
            are read (another rank's shards during a reshard): pages are then read on first touch.

    Raises:
        CorruptCheckpointError: the data file is missing or shorter than the manifest says.
    """

    def __init__(self, manifest: Manifest, data_path: str, where: str, shared_lock: bool = False,
                 populate: bool = True, advisory_lock: bool = False) -> None:
        self.manifest = manifest
        self.where = where
        self._verified: set[int] = set()
        self.bytes_touched = 0
        try:
            self.fd = os.open(data_path, os.O_RDONLY)
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
            st = os.fstat(self.fd)
            if not stat.S_ISREG(st.st_mode):  # mmap of a folder failed as "[Errno 19] No such device", no path
                raise CorruptCheckpointError(f"{where}: data file {data_path} is not a regular file "
                                             f"(mode {stat.filemode(st.st_mode)})")
            size = st.st_size
            if size < manifest.data_bytes:
                raise CorruptCheckpointError(
                    f"{where}: data file is {size} bytes, manifest says {manifest.data_bytes}; it is torn")
            # Read-only shared mapping, pre-faulted in one kernel call (MAP_POPULATE also reads a cold file
            # ahead sequentially); nothing ever writes through it.
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self.map = mmap.mmap(self.fd, manifest.data_bytes, flags=flags, prot=mmap.PROT_READ)
            if not populate:
                self.map.madvise(mmap.MADV_RANDOM)  # no read-ahead beyond the ranges asked for
        except BaseException:
            os.close(self.fd)
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "non-writable buffer": we only ever read from it
            self.buf = torch.frombuffer(self.map, dtype=torch.uint8)

    def verify(self, progress: Callable[[int], None] | None = None) -> None:
        """Checks every chunk checksum.

        Raises:
            CorruptCheckpointError: a mismatch (the message names the chunk).
        """
        view = memoryview(self.map)
        try:
            verify_checksums(view, self.manifest, self.where, progress)
        finally:
            view.release()
        self._verified.update(range(self.manifest.n_chunks))
        self.bytes_touched = self.manifest.data_bytes

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
            o, e = i * cb, min((i + 1) * cb, man.data_bytes)
            if chunk_checksum(self.map[o:e]) != man.chunks[i]:
                raise CorruptCheckpointError(f"{self.where}: chunk {i} (bytes {o}..{e}) fails its {CHECKSUM_ALGO} "
                                             "checksum; the data is corrupt")
            self._verified.add(i)
            self.bytes_touched += e - o

    def tensor(self, index: int) -> torch.Tensor:
        """A zero-copy view of tensor ``index`` (valid while this copy is open)."""
        e = self.manifest.tensors[index]
        dtype = getattr(torch, e.dtype)
        return self.buf[e.offset:e.offset + e.nbytes].view(dtype).view(e.shape)

    def loader(self) -> Callable[..., torch.Tensor]:
        """A ``TensorLoader`` for plain (unsharded) tensors: copies into the live tensor, clones without one.

        Raises (from the loader):
            StateMismatchError: the live tensor's shape or dtype differs from the saved one (names the key).
        """

        def load(index: int, target: torch.Tensor | None, node: Any = None) -> torch.Tensor:
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
        """Releases the mapping and the lock."""
        del self.buf
        try:
            self.map.close()
        except BufferError:
            pass
        os.close(self.fd)

    def __enter__(self) -> "RankCopy":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

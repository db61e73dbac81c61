"""Reading one rank's copy of a step from any tier: verify every checksum first, then load in place.

A :class:`RankCopy` maps the data (a tmpfs slot, a local data file, or a downloaded remote file) privately
(copy-on-write, never written) and exposes it as a uint8 tensor; :meth:`RankCopy.loader` gives the
``TensorLoader`` :func:`trainguard.checkpoint.tree.restore_into` needs.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import warnings
from typing import Any, Callable

import torch

from trainguard.checkpoint.errors import CorruptCheckpointError
from trainguard.checkpoint.manifest import Manifest, verify_checksums


class RankCopy:
    """A verified-on-demand view of one rank's data.

    Args:
        manifest: the parsed (self-checked) manifest.
        data_path: local path of the data file / slot.
        where: description for messages (``"disk step 120 rank 0"``).
        shared_lock: hold ``flock(LOCK_SH)`` while open (shared-memory slots).

    Raises:
        CorruptCheckpointError: the data file is missing or shorter than the manifest says.
    """

    def __init__(self, manifest: Manifest, data_path: str, where: str, shared_lock: bool = False) -> None:
        self.manifest = manifest
        self.where = where
        try:
            self.fd = os.open(data_path, os.O_RDONLY)
        except OSError as exc:
            raise CorruptCheckpointError(f"{where}: data file {data_path} is missing ({exc.strerror})") from exc
        try:
            if shared_lock:
                fcntl.flock(self.fd, fcntl.LOCK_SH)
            size = os.fstat(self.fd).st_size
            if size < manifest.data_bytes:
                raise CorruptCheckpointError(
                    f"{where}: data file is {size} bytes, manifest says {manifest.data_bytes}; it is torn")
            # Read-only shared mapping, pre-faulted in one kernel call (MAP_POPULATE also reads a cold file
            # ahead sequentially); nothing ever writes through it.
            self.map = mmap.mmap(self.fd, manifest.data_bytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                 prot=mmap.PROT_READ)
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

    def tensor(self, index: int) -> torch.Tensor:
        """A zero-copy view of tensor ``index`` (valid while this copy is open)."""
        e = self.manifest.tensors[index]
        dtype = getattr(torch, e.dtype)
        return self.buf[e.offset:e.offset + e.nbytes].view(dtype).view(e.shape)

    def loader(self) -> Callable[[int, Any], torch.Tensor]:
        """A ``TensorLoader`` copying into compatible live tensors, cloning otherwise."""

        def load(index: int, target: torch.Tensor | None) -> torch.Tensor:
            src = self.tensor(index)
            if target is not None and target.shape == src.shape and target.dtype == src.dtype:
                with torch.no_grad():
                    target.copy_(src)
                return target
            return src.clone()

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

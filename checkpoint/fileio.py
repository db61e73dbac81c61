"""Durable local file writes: temp file, fsync, rename, directory fsync; a bandwidth throttle.

No torch here: the persist process uses it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import time
from collections.abc import Collection
from typing import Callable

from trainguard.checkpoint.errors import StorageUnavailableError


def fsync_dir(path: str) -> None:
    """fsyncs a directory so a rename or unlink in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def storage_error(exc: OSError, what: str) -> StorageUnavailableError:
    """Wraps an OSError into a one-line :class:`StorageUnavailableError` telling what to do."""
    if exc.errno == errno.ENOSPC:
        hint = "the filesystem is full; free space or lower the retention"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "permission denied or read-only; fix the permissions or choose another directory"
    elif exc.errno == errno.ENOTDIR:
        hint = "a file stands where a folder of the path should be; give a directory, not a file"
    else:
        hint = "check the path and the storage"
    return StorageUnavailableError(f"cannot {what}: {exc.strerror or exc} ({hint})")


#: A temporary file of :func:`atomic_write`, :class:`PendingFile` or :func:`write_file_from`: ``<name>.tmp.<pid>``.
TMP_RE = re.compile(r"^(.+)\.tmp\.(\d+)$")


def open_tmp(tmp: str) -> int:
    """Creates (truncates) the temporary file ``tmp`` for writing and holds an exclusive ``flock`` on it until the
    descriptor is closed, so :func:`remove_stale_tmp` never takes it for a dead writer's.

    A flock belongs to the open file, not the process, and the kernel drops it when its writer dies (SIGKILL
    included). A sweeper that removed the file between its creation and the lock leaves it unlinked: it is then
    created again.

    Raises:
        OSError: the file cannot be created.
    """
    while True:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            return fd  # a filesystem without flock: unlocked, and the sweeper there removes nothing (see below)
        if os.fstat(fd).st_nlink:
            return fd
        os.close(fd)


def remove_stale_tmp(directory: str, targets: Collection[str]) -> list[str]:
    """Removes the temporary files of ``targets`` (final file names) in ``directory`` left by writers that died
    mid-write (``kill -9``).

    A file is stale when no open file holds its flock (see :func:`open_tmp`): its writer is gone, on this host or
    another sharing the filesystem. Files named after this process's pid are left alone (on NFS a flock is a
    record lock, which never excludes its own process), and so is every file where flock is not supported.

    Returns:
        The names removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        m = TMP_RE.match(name)
        if m is None or m.group(1) not in targets or int(m.group(2)) == os.getpid():
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone already (committed or removed), or not a plain file of ours
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)  # while locked: a writer that opened it since sees it unlinked and starts over
                removed.append(name)
        except OSError:
            pass  # a live writer holds it (EWOULDBLOCK), it was renamed into place, or no flock here
        finally:
            os.close(fd)
    return removed


class NotARegularFileError(OSError):
    """A checkpoint file's path holds something else (a folder, a FIFO, a device); ``strerror`` says what."""


def open_for_reading(path: str) -> int:
    """Opens ``path`` read-only without blocking on what is not a file: a FIFO (or a device) put where a
    checkpoint file belongs hung the open, so a restore, ``ckpt verify`` and ``ckpt gc`` hung for good. The
    descriptor is switched back to blocking once it is known to be a regular file.

    Raises:
        FileNotFoundError: nothing is there.
        NotARegularFileError: it is not a regular file (``strerror`` gives its type).
        OSError: it cannot be opened.
    """
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFileError(errno.EINVAL, f"not a regular file (mode {stat.filemode(st.st_mode)})", path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(path: str) -> bytes:
    """The whole content of the regular file ``path`` (see :func:`open_for_reading`).

    Raises:
        FileNotFoundError: nothing is there.
        OSError: it cannot be read, or it is not a regular file.
    """
    with os.fdopen(open_for_reading(path), "rb") as f:
        return f.read()


def atomic_write(path: str, data: bytes, fsync: bool = True) -> None:
    """Writes ``data`` to ``path`` atomically (temp file, fsync, rename, directory fsync).

    Raises:
        OSError: the write failed; the previous content of ``path`` (if any) is intact.
    """
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        fd = open_tmp(tmp)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(path) or ".")


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Throttle:
    """Token-bucket pacing of a byte stream.

    Args:
        bytes_per_s: cap in bytes per second; 0 or less disables pacing.
    """

    def __init__(self, bytes_per_s: float) -> None:
        self.rate = float(bytes_per_s)
        self._t0 = time.monotonic()
        self._sent = 0

    def account(self, nbytes: int) -> None:
        """Records ``nbytes`` written and sleeps as long as needed to stay under the cap."""
        if self.rate <= 0:
            return
        self._sent += nbytes
        ahead = self._sent / self.rate - (time.monotonic() - self._t0)
        if ahead > 0:
            time.sleep(ahead)


class PendingFile:
    """A file being written under a temporary name; :meth:`commit` makes it durable and visible atomically.

    Args:
        path: final path.
        fsync: fsync the file and its directory on commit.

    Raises:
        OSError: the temporary file cannot be created.
    """

    def __init__(self, path: str, fsync: bool = True) -> None:
        self.path = path
        self.tmp = f"{path}.tmp.{os.getpid()}"
        self.fsync = fsync
        self.fd = open_tmp(self.tmp)

    def commit(self) -> None:
        """fsync, close, rename into place, fsync the directory.

        Raises:
            OSError: any step failed; the temporary file is removed and ``path`` keeps its old content.
        """
        try:
            if self.fsync:
                os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            os.replace(self.tmp, self.path)
        except BaseException:
            self.abort()
            raise
        if self.fsync:
            fsync_dir(os.path.dirname(self.path) or ".")

    def abort(self) -> None:
        """Closes and removes the temporary file."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        _unlink_quiet(self.tmp)


def write_file_from(path: str, view: memoryview, nbytes: int, chunk_bytes: int, throttle: Throttle | None,
                    fsync: bool = True, progress: Callable[[int], None] | None = None) -> None:
    """Writes ``view[:nbytes]`` durably to ``path`` (temp file, fsync, rename, directory fsync).

    Args:
        path: destination.
        view: source bytes (e.g. a shared-memory staging slot).
        nbytes: how many bytes of ``view`` to write.
        chunk_bytes: size of each write call in bytes.
        throttle: optional pacing.
        fsync: fsync file and directory.
        progress: optional callable ``(nbytes)`` after each chunk.

    Raises:
        OSError: the write failed (ENOSPC...); no partial file is left at ``path``.
    """
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        fd = open_tmp(tmp)
        try:
            off = 0
            while off < nbytes:
                end = min(off + chunk_bytes, nbytes)
                piece = view[off:end]
                while piece:
                    n = os.write(fd, piece)
                    piece = piece[n:]
                if throttle is not None:
                    throttle.account(end - off)
                if progress is not None:
                    progress(end - off)
                off = end
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(path) or ".")

"""Typed, validated configuration of the checkpointer (loadable from TOML).

Layout in a TOML file (every key optional except ``directory``)::

    [checkpoint]
    directory = "/data/ckpt"          # local path (or file:// URL) of the disk tier, or a remote fsspec URL
    [checkpoint.memory]
    enabled = true
    keep = 1
    [checkpoint.disk]
    keep = 3
    [checkpoint.remote]
    url = "s3://bucket/ckpt"
    keep = 5
    retry_s = 30                      # an unreachable remote is tried again after this (doubling, bounded)
    [checkpoint.persist]
    bandwidth_mib_s = 0               # 0 = unthrottled

The file is read by the shared loader (:mod:`trainguard.config_loader`: types, unknown keys, nan/inf); the
ranges and consistency rules are :meth:`CheckpointConfig.validate`'s.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from trainguard.checkpoint.errors import CheckpointConfigError
from trainguard.checkpoint.location import (  # noqa: F401 (re-exported)
    CheckpointLocation,
    canonical_url,
    check_local_url,
    is_local_url,
    split_url,
)
from trainguard.config_loader import build, check_fields, read_toml, select_table

# Re-exported (listed in __all__, so linters see them used): the worker environment (trainguard.worker_env) owns
# these names, and the agent and the persist channel import them from here.
from trainguard.worker_env import CHECKPOINT_SERVICE_ENV, RESTORE_PLAN_ENV

__all__ = [
    "CheckpointConfig", "MemoryTierConfig", "DiskTierConfig", "RemoteTierConfig", "PersistConfig",
    "CheckpointConfigError", "check_durable_url", "local_directory",
    "CHECKPOINT_SHM_DIR_ENV", "DEFAULT_SHM_ROOT", "CHECKPOINT_SERVICE_ENV", "RESTORE_PLAN_ENV",
    "CheckpointLocation", "canonical_url", "check_local_url", "is_local_url", "split_url",
]

#: Environment variable overriding where the shared-memory tier lives (default ``/dev/shm/trainguard``).
CHECKPOINT_SHM_DIR_ENV = "TRAINGUARD_CHECKPOINT_SHM_DIR"
#: The shared-memory tier's root when that variable is unset or empty.
DEFAULT_SHM_ROOT = "/dev/shm/trainguard"

#: fsspec protocols whose files live inside the writing process: uploads there vanish with the persist process,
#: so they can never be a durable tier.
_IN_PROCESS_SCHEMES = ("memory",)


@dataclass
class MemoryTierConfig:
    """Host shared-memory tier (survives a worker crash, not a node reboot).

    Attributes:
        enabled: keep the newest snapshots restorable from shared memory. Default True.
        keep: snapshots kept in memory (retention K); the arena holds ``keep + 1`` staging slots so a snapshot
            never overwrites a slot being persisted. Default 1.
        directory: tmpfs directory of the arena. Default ``$TRAINGUARD_CHECKPOINT_SHM_DIR`` or
            ``/dev/shm/trainguard``.
        keep_on_close: leave the arena in place on a clean ``close()`` (normally removed). Default False.
        fallback: where snapshots are staged when ``directory`` is too small for the staging slots (a
            container's 64 MiB /dev/shm); the memory tier is then off for this process and checkpoints still
            reach disk. ``"disk"``: files under ``fallback_directory``; ``"host"``: anonymous shared memory
            (``memfd``, not bounded by /dev/shm), page-locked for DMA where CUDA is present; ``"auto"``: host
            when CUDA is available (the state lives on the GPU, host memory is free), else disk (the state
            already fills host memory). Default ``"auto"``.
        fallback_directory: directory of the fallback's slot files (disk) or slot tags (host). Default
            ``<disk tier directory>/.trainguard-staging`` (``<tmpdir>/trainguard-staging`` without a disk tier).
    """

    enabled: bool = True
    keep: int = 1
    directory: str = field(default_factory=lambda: os.environ.get(CHECKPOINT_SHM_DIR_ENV) or DEFAULT_SHM_ROOT)
    keep_on_close: bool = False
    fallback: str = "auto"
    fallback_directory: str | None = None


@dataclass
class DiskTierConfig:
    """Local disk tier.

    Attributes:
        enabled: write every checkpoint to local disk. Default True (required when a remote tier is on, since
            uploads go from the local copy).
        keep: committed steps kept on disk (retention K). Default 3.
        fsync: fsync files and directories before a commit (turning it off voids crash safety; benchmarks only).
            Default True.
    """

    enabled: bool = True
    keep: int = 3
    fsync: bool = True


@dataclass
class RemoteTierConfig:
    """Remote tier through fsspec, uploaded from the local copy.

    Attributes:
        url: fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``file:///mnt/nfs``...); None disables it. In-process
            filesystems (``memory://``) are refused: nothing written there outlives the persist process.
        keep: committed steps kept remotely (retention K). Default 5.
        storage_options: keyword arguments for the fsspec filesystem (credentials, endpoint...). Default {}.
        retry_s: seconds an unreachable remote is left alone after a failure before it is tried again; doubles
            while it keeps failing, up to 10 times this. Meanwhile listings (``steps()``) leave it out and saves
            do not upload to it (the step stays in memory and on disk; one health event per rank and outage); once it
            answers, the newest step skipped is uploaded. ``restore()`` tries it regardless. Default 30.
    """

    url: str | None = None
    keep: int = 5
    storage_options: dict[str, Any] = field(default_factory=dict)
    retry_s: float = 30.0


@dataclass
class PersistConfig:
    """Background persist process.

    Attributes:
        bandwidth_mib_s: cap on persist write bandwidth in MiB/s so it does not starve training; 0 = no cap.
            Default 0.
        nice: niceness added to the persist process (0..19). Default 10.
        chunk_mib: size of a checksummed chunk and of one write, in MiB. Default 4.
        alignment: byte alignment of every tensor of at least this many bytes in the data file (a power of two
            >= 64; smaller tensors are packed on 64-byte boundaries). Default 4096.
        service: unix socket of a running checkpoint service; None reads ``$TRAINGUARD_CHECKPOINT_SERVICE`` and,
            when that is unset too, starts a private persist process. ``"inline"`` persists in the calling
            thread instead: ``save()`` returns after the disk write and the remote upload. Against an unreachable
            remote that costs the training step up to the connect timeout (``remote.storage_options``) once per
            back-off period (``remote.retry_s``, growing to 10x), not once per save: saves in between skip the
            upload (about 2 s blocked per save before, 0.01-0.06 s after, measured with a 2 s timeout against a
            stalled endpoint); ``close()`` uploads the newest skipped step if the back-off is over by then.
            Default None.
    """

    bandwidth_mib_s: float = 0.0
    nice: int = 10
    chunk_mib: int = 4
    alignment: int = 4096
    service: str | None = None


@dataclass
class CheckpointConfig:
    """Everything a :class:`~trainguard.checkpoint.Checkpointer` needs.

    Attributes:
        directory: the checkpoint root: a local path / ``file://`` URL (disk tier) or a remote fsspec URL (then
            the remote tier uses it and the disk tier lives under ``local_cache``).
        local_cache: local directory for the disk tier when ``directory`` is remote. Default
            ``<tmpdir>/trainguard-ckpt-cache/<hash>``, ``<hash>`` being 12 hex digits of the SHA-256 of the URL
            in its canonical spelling (:func:`canonical_url`), so each remote location has one, however spelled. Steps found there that another location
            wrote (a ``local_cache`` shared by two URLs) are skipped by restore with a warning.
        replicated: every rank holds the same state (plain DDP), so a checkpoint may be restored with another
            world size from any rank's copy. Default False.
        verify_on_restore: check every chunk's checksum before loading. Default True.
        overwrite: let a run that saves without having restored replace the job's checkpoints of higher steps at
            this location (its first lower step removes each rank's copies of them, as after going back). Default
            False: such a first save raises, naming the steps, since it would silently delete an earlier run's
            newer checkpoints (a fresh run started in an old job name and directory).
        memory, disk, remote, persist: per-tier and persist settings.
    """

    directory: str
    local_cache: str | None = None
    replicated: bool = False
    verify_on_restore: bool = True
    overwrite: bool = False
    memory: MemoryTierConfig = field(default_factory=MemoryTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)
    persist: PersistConfig = field(default_factory=PersistConfig)

    def __post_init__(self) -> None:
        for name, cls in (("memory", MemoryTierConfig), ("disk", DiskTierConfig), ("remote", RemoteTierConfig),
                          ("persist", PersistConfig)):
            value = getattr(self, name)
            if not isinstance(value, cls):  # CheckpointConfig(memory={"keep": 2}) in code
                setattr(self, name, build(cls, value, table=f"checkpoint.{name}", error=CheckpointConfigError))
        self.validate()

    # ------------------------------------------------------------------ derived
    @property
    def disk_directory(self) -> str:
        """Local directory of the disk tier."""
        return CheckpointLocation.parse(self.directory).disk_directory(self.local_cache)

    @property
    def location(self) -> str:
        """Identity of this checkpoint location (absolute real path, or the :func:`canonical_url`).

        The shared-memory tier is keyed by job name only; its copies record this, so a Checkpointer of another
        directory that shares the job name never restores them.
        """
        return CheckpointLocation.parse(self.directory).identity

    @property
    def remote_url(self) -> str | None:
        """fsspec URL of the remote tier (its :func:`canonical_url`: one folder per location however it is
        spelled), or None."""
        if not is_local_url(self.directory):
            return canonical_url(self.directory)
        return None if self.remote.url is None else canonical_url(self.remote.url)

    def validate(self) -> None:
        """Checks every field.

        A ``file://`` URL in a field that takes a local directory (``local_cache``, ``memory.directory``,
        ``memory.fallback_directory``) is replaced by its path, as for ``directory``.

        Raises:
            CheckpointConfigError: a value is out of range or inconsistent (the message names it).
        """
        for obj, where in ((self, "checkpoint"), (self.memory, "checkpoint.memory"), (self.disk, "checkpoint.disk"),
                           (self.remote, "checkpoint.remote"), (self.persist, "checkpoint.persist")):
            # A config made in code has not been through the loader: the same type checks, then ours.
            check_fields(obj, where, error=CheckpointConfigError)
            _check_non_empty(obj, where)
        self.local_cache = local_directory(self.local_cache, "checkpoint.local_cache")
        self.memory.directory = local_directory(
            self.memory.directory, f"checkpoint.memory.directory (or ${CHECKPOINT_SHM_DIR_ENV})")
        self.memory.fallback_directory = local_directory(self.memory.fallback_directory,
                                                          "checkpoint.memory.fallback_directory")
        check_local_url(self.directory, "checkpoint.directory")
        CheckpointLocation.parse(self.directory, "checkpoint.directory")  # an unset $VAR in it: said here, named
        if isinstance(self.remote.url, str):
            check_local_url(self.remote.url, "checkpoint.remote.url")
        for name, value in (("memory.keep", self.memory.keep), ("disk.keep", self.disk.keep),
                            ("remote.keep", self.remote.keep)):
            if not isinstance(value, int) or value < 1:
                raise CheckpointConfigError(f"checkpoint.{name} is {value!r}; it must be an integer >= 1")
        if self.memory.fallback not in ("auto", "disk", "host"):
            raise CheckpointConfigError(f"checkpoint.memory.fallback is {self.memory.fallback!r}; use \"auto\", "
                                        "\"disk\" or \"host\"")
        if not self.remote.retry_s > 0:
            raise CheckpointConfigError(f"checkpoint.remote.retry_s is {self.remote.retry_s!r}; it must be > 0 "
                                        "(seconds an unreachable remote is left out of listings)")
        if self.persist.bandwidth_mib_s < 0:
            raise CheckpointConfigError("checkpoint.persist.bandwidth_mib_s must be >= 0 (0 = unthrottled)")
        if not 0 <= int(self.persist.nice) <= 19:
            raise CheckpointConfigError("checkpoint.persist.nice must be within 0..19")
        if not 1 <= int(self.persist.chunk_mib) <= 1024:
            raise CheckpointConfigError("checkpoint.persist.chunk_mib must be within 1..1024 MiB")
        a = int(self.persist.alignment)
        if a < 64 or a & (a - 1):
            raise CheckpointConfigError("checkpoint.persist.alignment must be a power of two >= 64")
        if (not is_local_url(self.directory) and self.remote.url is not None
                and canonical_url(self.remote.url) != canonical_url(self.directory)):
            # remote_url is the directory's URL then: the second URL was ignored without a word, and a user who
            # set both believed the steps reached it too. One remote tier per checkpointer.
            raise CheckpointConfigError(
                f"checkpoint.directory = {self.directory!r} is a remote URL, so it is the remote tier (a local "
                f"cache holds the disk copies); checkpoint.remote.url = {self.remote.url!r} would be a second "
                "remote tier, which is not supported: leave checkpoint.remote.url out (checkpoint.local_cache "
                "chooses where the local copies go), or set checkpoint.directory to a local path and keep the URL "
                "in checkpoint.remote.url")
        if self.remote_url is not None:
            check_durable_url(self.remote_url, "checkpoint.remote.url" if is_local_url(self.directory)
                              else "checkpoint.directory")
        try:
            # They travel to the persist process as JSON with every save request.
            json.dumps(self.remote.storage_options)
        except (TypeError, ValueError) as exc:
            raise CheckpointConfigError(
                f"checkpoint.remote.storage_options cannot be sent to the persist process ({exc}); give strings, "
                "numbers, booleans, lists and tables only (e.g. seconds as a number, not a timedelta)") from exc
        if self.remote_url is not None and not self.disk.enabled:
            raise CheckpointConfigError("the remote tier uploads from the local copy: enable checkpoint.disk too")
        if self.remote_url is not None and is_local_url(self.remote_url):
            remote = CheckpointLocation.parse(self.remote_url, "checkpoint.remote.url").identity
            if remote == os.path.realpath(self.disk_directory):
                # The upload opened the disk copy's own file for writing, truncating it before reading it: every
                # step was committed with a 0-byte data file, and no tier could restore it.
                raise CheckpointConfigError(
                    f"checkpoint.remote.url = {self.remote.url!r} is the disk tier's own folder ({remote}): the "
                    "upload would overwrite each step's files with themselves, emptied; point it at other storage "
                    "(an NFS mount, s3://...) or leave it out")
        if not (self.memory.enabled or self.disk.enabled or self.remote_url):
            raise CheckpointConfigError("every checkpoint tier is disabled; enable memory, disk or remote")

    # ------------------------------------------------------------------ loaders
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "", table: str = "checkpoint") -> "CheckpointConfig":
        """Builds a config from a mapping such as a TOML ``[checkpoint]`` table.

        Args:
            data: the table.
            source: the file it was read from, first in every error message (``""``: none).
            table: how the file names the table (``""``: its top level), in error messages.

        Raises:
            CheckpointConfigError: not a table, unknown key, missing ``directory`` or bad value.
        """
        try:
            return build(cls, data, source=source, table=table, error=CheckpointConfigError)
        except CheckpointConfigError as exc:
            if source and not str(exc).startswith(f"{source}: "):  # a range or consistency rule of validate()
                raise CheckpointConfigError(f"{source}: {exc}") from exc
            raise

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str], table: str = "checkpoint") -> "CheckpointConfig":
        """Loads the ``[checkpoint]`` table (or the whole file when it has no such table) of a TOML file.

        Raises:
            CheckpointConfigError: missing or unreadable file, not UTF-8, TOML syntax error, unknown key or bad
                value (each naming the file).
        """
        source = os.fspath(path)
        document = read_toml(source, error=CheckpointConfigError, what="checkpoint config file")
        section = select_table(document, table, source, error=CheckpointConfigError)
        if section is None:
            return cls.from_dict(document, source=source, table="")
        return cls.from_dict(section, source=source, table=table)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (JSON/TOML-ready) of every field."""
        return dataclasses.asdict(self)


def check_durable_url(url: str, key: str) -> None:
    """Refuses an fsspec URL whose protocol fsspec does not know, or whose filesystem lives inside the writing
    process (``memory://``).

    A protocol fsspec knows whose package is missing here (``s3://`` without s3fs) passes: the processes that
    write may have it, and each save that cannot reach the tier reports it.

    Raises:
        CheckpointConfigError: unknown protocol, or a filesystem that cannot outlive the persist process (the
            message names ``key``).
    """
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    in_process = False
    for protocol in split_url(url)[0].split("::"):  # a chained URL (simplecache::s3://...) names several
        try:
            in_process |= protocol in _IN_PROCESS_SCHEMES or issubclass(fsspec.get_filesystem_class(protocol),
                                                                        MemoryFileSystem)
        except ImportError:
            pass
        except ValueError:
            # Unchecked, a typo in the scheme passed here and failed every save, one health event at a time.
            raise CheckpointConfigError(
                f"{key} = {url!r}: fsspec knows no protocol {protocol!r}; use a local path, a file:// URL or a "
                "protocol fsspec supports (s3://, gs://, az://... see fsspec.available_protocols())") from None
    if in_process:
        raise CheckpointConfigError(
            f"{key} = {url!r} is an in-process filesystem: its files die with the persist process, so no step "
            "saved there would be durable; use a path, file:// on shared storage, or an object store (s3://...)")


def local_directory(value: str | None, key: str) -> str | None:
    """The local path a local-directory field names: a path as given, ``file:///abs`` or ``file:/abs`` as ``/abs``.

    Before, such a field was used as a path verbatim: ``TRAINGUARD_CHECKPOINT_SHM_DIR=file:///dev/shm/tg`` put the
    "shared-memory" arena in a folder ``./file:/dev/shm/tg`` on the disk of each process's working directory.

    Raises:
        CheckpointConfigError: another URL (``s3://``, ``memory://``) or a ``file://`` URL with a host part,
            naming ``key``.
    """
    if value is None:
        return None
    location = CheckpointLocation.parse(value, key)
    if not location.is_local:
        raise CheckpointConfigError(f"{key} = {value!r}: takes a local directory (a path or file:///abs/dir), "
                                    "not a URL")
    return location.local_path


def _check_non_empty(obj: Any, where: str) -> None:
    """Refuses an empty string, or one with leading or trailing whitespace, where a path or URL goes (the loader
    has checked the types already).

    Raises:
        CheckpointConfigError: naming ``where.field``.
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, str) and not value.strip():
            if f.name == "directory" and where == "checkpoint":
                raise CheckpointConfigError("checkpoint.directory is empty; set it to a local path or an fsspec URL")
            what = "a non-empty string (or left out)" if f.default is None else "a non-empty string"
            raise CheckpointConfigError(f"{where}.{f.name} is {value!r}; it must be {what}")
        if isinstance(value, str) and value != value.strip():
            # Every such field is a path, URL, socket or keyword: a stray space from a config file or an
            # environment variable (CKPT=" /data/ckpt") made a folder " " under the working directory, or a
            # sibling "ckpt " of the intended one, and checkpoints went there with no word.
            raise CheckpointConfigError(f"{where}.{f.name} is {value!r}: it begins or ends with whitespace; remove "
                                        "it (a path that truly has such a name is not supported)")

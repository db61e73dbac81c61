"""Where a job's checkpoints live, as every process reads it: the one parser of a checkpoint location.

A location is what ``--checkpoint-dir`` / ``checkpoint.directory`` / ``$TRAINGUARD_CHECKPOINT_DIR`` hold: a local
path, a ``file://`` URL, or any other fsspec URL (``s3://bucket/prefix``, ``memory://``...). The launcher, the
workers' checkpointer, the operator CLI and the node agent's drain all parse it here, and ask layout questions
("is step S complete?") through :class:`~trainguard.checkpoint.storage.StepStore`, so a URL works wherever a path
does and no caller lists raw directories.

No torch import: the agent and the CLI use this module.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainguard.checkpoint.errors import CheckpointConfigError, CheckpointError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.checkpoint.storage import StepStore

#: Schemes naming the local filesystem (no scheme is a plain path).
LOCAL_SCHEMES = ("", "file", "local")


def split_url(url: str) -> tuple[str, str]:
    """Splits ``scheme://rest`` into ``(scheme, rest)`` (scheme lower-cased); a plain path gives ``("", path)``.

    ``file:/abs`` and ``local:/abs`` (no ``//``) give ``("file", "/abs")`` and ``("local", "/abs")``: fsspec reads
    them as the local path ``/abs``, so they must not become a folder named ``file:`` under the working directory.
    """
    if "://" in url:
        scheme, rest = url.split("://", 1)
        return scheme.lower(), rest
    head, sep, rest = url.partition(":")
    if sep and head.lower() in LOCAL_SCHEMES:
        return head.lower(), rest
    return "", url


def canonical_url(url: str) -> str:
    """One spelling per location for a ``scheme://`` URL: the scheme lower-cased, runs of ``/`` in the path made
    one and a trailing ``/`` dropped (a leading ``/``, as in ``file:///abs``, is kept). A plain path, or a ``file:``
    URL without ``//``, is returned as given (local locations are identified by their real path instead).

    ``s3://bucket/x/``, ``s3://bucket//x`` and ``S3://bucket/x`` all name ``s3://bucket/x``: before, each hashed to
    its own disk cache and job name and opened its own folder in the bucket (``bucket//x/job`` is another key in
    S3), so a relaunch spelled differently found none of the job's checkpoints. A URL chaining several ``://``
    (``zip://member::s3://bucket/a.zip``) or with a query or fragment only loses its trailing ``/``: its slashes
    may mean something.
    """
    if "://" not in url:
        return url
    scheme, rest = split_url(url)
    if any(c in rest for c in ("://", "::", "?", "#")):
        return f"{scheme}://{rest.rstrip('/')}"
    lead = "/" if rest.startswith("/") else ""
    return f"{scheme}://{lead}{'/'.join(p for p in rest.split('/') if p)}"


def check_local_url(url: str, key: str) -> None:
    """Refuses a ``file://`` (or ``local://``) URL with a host part: ``file://localhost/data`` or the typo
    ``file://data/ckpt``.

    fsspec reads what follows ``//`` as a path relative to the working directory (``./localhost/data``), so such
    a URL silently put checkpoints in a folder of whatever directory each process was started in.

    Raises:
        CheckpointConfigError: the URL has a host part (the message names ``key`` and the absolute form).
    """
    if "://" not in url:
        return
    scheme, rest = split_url(url)
    if scheme in LOCAL_SCHEMES and not rest.startswith("/"):
        raise CheckpointConfigError(
            f"{key} = {url!r}: a {scheme}:// URL takes an absolute path after '//' ({scheme}:///abs/dir); "
            f"{rest.split('/', 1)[0]!r} would be a folder under the working directory, not a host")


def is_local_url(url: str) -> bool:
    """True when ``url`` names the local filesystem (a plain path, ``file://`` or ``file:``)."""
    return split_url(url)[0] in LOCAL_SCHEMES


_VAR_RE = re.compile(r"\$(\w+|\{[^}]*\})")


def _expand_vars(path: str, text: str, key: str) -> str:
    """``$NAME`` and ``${NAME}`` in a local location, expanded as a shell would, where no shell did (a TOML value,
    a unit file's or a pod's environment): kept verbatim, ``$SCRATCH/ck`` wrote the steps into a folder literally
    named ``$SCRATCH`` under each process's working directory, where a relaunch from elsewhere never looked.

    Raises:
        CheckpointConfigError: a variable is not set in this process (the message names it and ``key``).
    """
    expanded = os.path.expandvars(path)
    left = _VAR_RE.search(expanded)
    if left is not None:
        raise CheckpointConfigError(
            f"{key} = {text!r}: the environment variable {left.group(0)} is not set in this process, so the path "
            "cannot be expanded; set it, or write the path out")
    return expanded


@dataclass(frozen=True)
class CheckpointLocation:
    """A parsed checkpoint root.

    Attributes:
        text: the location as given.
        scheme: the URL scheme, lower-cased; empty for a plain path.
        rest: what follows ``scheme://`` or ``file:`` (the path itself for a plain path; ``~`` expanded in a local
            location).
    """

    text: str
    scheme: str
    rest: str

    @classmethod
    def parse(cls, text: str, key: str = "checkpoint directory") -> CheckpointLocation:
        """Parses a path or fsspec URL.

        Args:
            text: the location.
            key: what the user set (flag or config key), named in the error.

        Raises:
            CheckpointConfigError: the location is empty.
        """
        if not isinstance(text, str) or not text.strip():
            raise CheckpointConfigError(f"{key} is empty; set it to a local path or an fsspec URL")
        check_local_url(text, key)
        scheme, rest = split_url(text)
        if scheme in LOCAL_SCHEMES:
            # What no shell expanded (file:~/ck and local:~/ck as well) (a TOML value, an environment variable in a unit file or a pod spec,
            # --checkpoint-dir=~/ck): a folder literally named "~" under each process's working directory put
            # the steps where a relaunch from elsewhere never looked, though the job's name hashed $HOME's path.
            rest = os.path.expanduser(rest)
            if "$" in rest:
                rest = _expand_vars(rest, text, key)
        return cls(text=text, scheme=scheme, rest=rest)

    @property
    def is_local(self) -> bool:
        """Whether the location is on the local filesystem (a path or ``file://``)."""
        return self.scheme in LOCAL_SCHEMES

    @property
    def local_path(self) -> str:
        """The local directory of a local location.

        Raises:
            CheckpointError: the location is remote.
        """
        if not self.is_local:
            raise CheckpointError(f"{self.text} is not on the local filesystem; pass a local checkpoint root")
        return self.rest

    @property
    def url(self) -> str:
        """The location as fsspec is given it: the :func:`canonical_url` of a URL, a plain path as given."""
        return canonical_url(self.text)

    @property
    def identity(self) -> str:
        """What identifies this location across processes (and what job names and cache folders are hashed from):
        the absolute real path, or the :func:`canonical_url`."""
        if self.is_local:
            return os.path.realpath(self.rest)
        return self.url

    def for_workers(self) -> str:
        """How a launcher hands the location to workers (``$TRAINGUARD_CHECKPOINT_DIR``): a plain path made
        absolute (workers may run elsewhere), a URL as given."""
        return os.path.abspath(self.rest) if self.scheme == "" else self.text

    def disk_directory(self, local_cache: str | None) -> str:
        """The local directory of the disk tier: the location itself when local, else ``local_cache``, by default
        ``<tmp>/trainguard-ckpt-cache/<12 hex digits of the SHA-256 of identity>``: one per remote location."""
        if self.is_local:
            return self.rest
        if local_cache:
            return local_cache
        # Keyed by the URL, not shared: jobs of one name on two URLs would otherwise restore each other's steps.
        digest = hashlib.sha256(self.identity.encode()).hexdigest()[:12]
        return os.path.join(tempfile.gettempdir(), "trainguard-ckpt-cache", digest)

    def check_writable(self) -> str | None:
        """Creates a local location and checks a file can be written there; remote ones are checked by each
        worker's checkpointer. Returns why it is unusable (one line), None when it is fine."""
        if not self.is_local:
            return None
        try:
            os.makedirs(self.rest, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=self.rest, prefix=".tg-probe-", delete=True)
            probe.close()
        except OSError as exc:
            return f"checkpoint directory {self.rest!r} is not writable: {exc.strerror or exc}"
        return None

    def open_store(self, job: str, storage_options: dict[str, Any] | None = None, fsync: bool = True) -> StepStore:
        """The :class:`~trainguard.checkpoint.storage.StepStore` of ``job`` at this location: a
        :class:`LocalStore` for a local one, an :class:`FsspecStore` otherwise.

        Raises:
            StorageUnavailableError: the remote filesystem cannot be created.
        """
        from trainguard.checkpoint.storage import FsspecStore, LocalStore

        if self.is_local:
            return LocalStore(self.rest, job, fsync=fsync)
        return FsspecStore(self.url, job, storage_options)


def step_committed(store: StepStore, step: int, world_size: int) -> bool:
    """Whether every rank ``0..world_size-1`` has its commit marker in ``step`` (one listing, no reads: cheap
    enough to poll). False when the step or the storage cannot be listed."""
    from trainguard.checkpoint.storage import marker_name

    if world_size <= 0:
        return False
    try:
        names = set(store.list_names(step))
    except (OSError, CheckpointError):
        return False
    return all(marker_name(rank) in names for rank in range(world_size))


def job_step_committed(location: str, job: str, step: int, world_size: int, or_later: bool = False) -> bool:
    """:func:`step_committed` for a location as given (path or URL); False when it cannot be opened.

    Args:
        or_later: any step from ``step`` on will do (a job-wide checkpoint asked for at ``step`` is taken by the
            hook at the first step reaching it, which a loop whose steps jump makes a later one).
    """
    try:
        store = CheckpointLocation.parse(location).open_store(job)
    except CheckpointError:
        return False
    if not or_later:
        return step_committed(store, step, world_size)
    try:
        steps = store.list_steps()
    except (OSError, CheckpointError):
        return False
    return any(step_committed(store, s, world_size) for s in sorted((s for s in steps if s >= step), reverse=True))


__all__ = ["CheckpointLocation", "LOCAL_SCHEMES", "canonical_url", "check_local_url", "is_local_url", "job_step_committed", "split_url",
           "step_committed"]

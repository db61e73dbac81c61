"""The coordinator's durable state store: a small key-value interface with atomic compare-and-set.

Why compare-and-set plus a fencing token (the pattern of TorchElastic's ``RendezvousBackend.get_state /
set_state``): a coordinator that was presumed dead (SIGKILLed, partitioned, paused) and a newly started one may
both try to write the same job's state. Every record carries a *version* (the store revision of its last
write). A :meth:`Store.commit` applies its writes only if every listed key still has the version the writer
read, atomically. A new coordinator first bumps the job's *fence* key (:func:`acquire_fence`); a
:class:`FencedStore` adds "the fence key is still at my version" to every commit, so the old coordinator's
next write fails with :class:`~trainguard.recovery.errors.FencedError` instead of clobbering the new one's.

Backends, chosen by URL (:func:`open_store`), registered by scheme in :data:`BACKENDS`:

=====================================  ==========================================================================
``sqlite:///abs/path/state.db``        Default for a standalone coordinator. One SQLite file, WAL journal,
                                       ``synchronous=FULL``: a commit is on disk when it returns.
``file:///abs/path/dir``               One JSON document rewritten per commit (write temp, fsync, rename,
                                       fsync dir) under an ``flock``; simple and inspectable, for small jobs.
``etcd://host:port[,host:port][/prefix]``  etcd v3 (3.4+) through its JSON gRPC gateway (``/v3/kv/*``) with the
                                       standard library; a commit is one etcd transaction. TLS, client
                                       certificates and etcd users: ``?ca=&cert=&key=``, ``user@host``
                                       (:mod:`trainguard.recovery.etcd_security`).
``memory://``                          In-process only (the coordinator embedded in a single-node ``trainguard
                                       run``, and tests): nothing survives the process.
=====================================  ==========================================================================

Why the etcd JSON gateway and not a client package: the ``etcd3`` PyPI package is unmaintained and pins an old
protobuf that conflicts with our generated modules; the official gRPC API would need etcd's protos (with
gogoproto imports) vendored and compiled. The gateway is part of every etcd 3.4+ server, speaks the same
``Range``/``Txn`` messages as JSON, and needs nothing beyond ``http.client``.
"""

from __future__ import annotations

import base64
import fcntl
import http.client
import json
import os
import sqlite3
import tempfile
import threading
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.recovery.errors import FencedError, StoreError, StoreURLError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.recovery.etcd_security import EtcdSecurity


@dataclass(frozen=True)
class Record:
    """A stored value and its version.

    Attributes:
        value: the bytes stored.
        version: store revision of the record's last write (> 0); what a later compare names.
    """

    value: bytes
    version: int


@dataclass(frozen=True)
class Compare:
    """A commit precondition: ``key`` is at ``version`` (0: the key must not exist)."""

    key: str
    version: int


@dataclass(frozen=True)
class Put:
    """A commit write: set ``key`` to ``value``, or delete it when ``value`` is None."""

    key: str
    value: bytes | None


@dataclass(frozen=True)
class CommitResult:
    """What a commit did.

    Attributes:
        ok: True when every compare held and every write was applied; False when nothing was written.
        revision: the version every written key now has (when ok); the store's revision otherwise.
        conflicts: for a failed commit, the current version (0: absent) of each key whose compare failed.
    """

    ok: bool
    revision: int
    conflicts: Mapping[str, int] = field(default_factory=dict)


class Store(ABC):
    """A key-value store with atomic multi-key compare-and-set. Implementations are thread-safe.

    Keys are ``/``-separated strings; values are opaque bytes.
    """

    #: Most writes one commit may carry (etcd's default ``--max-txn-ops`` is 128). Callers split larger batches.
    max_ops_per_commit: int = 1 << 30
    #: Bytes of keys and values a batch of writes should carry at most (etcd refuses requests over its
    #: ``--max-request-bytes``, 1.5 MiB by default); the group committer closes a batch there. One write larger
    #: than this is still committed, alone.
    max_bytes_per_commit: int = 1 << 62

    @abstractmethod
    def get(self, key: str) -> Record | None:
        """Reads one key.

        Args:
            key: the key.

        Returns:
            The record, or None when the key does not exist.

        Raises:
            StoreError: the store cannot be read.
        """

    @abstractmethod
    def scan(self, prefix: str) -> dict[str, Record]:
        """Reads every key starting with ``prefix``.

        Args:
            prefix: key prefix ("" for everything).

        Returns:
            Key to record.

        Raises:
            StoreError: the store cannot be read.
        """

    @abstractmethod
    def commit(self, compares: Sequence[Compare], puts: Sequence[Put]) -> CommitResult:
        """Applies ``puts`` atomically if and only if every compare holds; durable when it returns.

        Args:
            compares: preconditions on key versions.
            puts: writes and deletes, applied in order.

        Returns:
            The outcome; ``ok=False`` means nothing was written.

        Raises:
            StoreError: the store cannot be written (the commit may or may not have been applied only if the
                connection broke mid-request; versions tell on the next read).
        """

    def close(self) -> None:
        """Releases connections and files; the store is unusable afterwards."""

    def compare_and_set(self, key: str, expected_version: int, value: bytes | None) -> CommitResult:
        """Sets (or deletes, value None) one key if it is still at ``expected_version`` (0: absent).

        Args:
            key: the key.
            expected_version: version read before (0 when the key was absent).
            value: new value, or None to delete.

        Returns:
            The commit outcome.

        Raises:
            StoreError: the store cannot be written.
        """
        return self.commit([Compare(key, expected_version)], [Put(key, value)])


# ----------------------------------------------------------------------------------------------------- memory


class _MapStore(Store):
    """Shared logic of stores that hold the whole map in memory (memory and file backends)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._kv: dict[str, Record] = {}
        self._revision = 0

    def _refresh(self) -> None:
        """Reloads from durable storage if another process changed it (no-op in memory)."""

    def _persist(self) -> None:
        """Makes the current map durable (no-op in memory)."""

    def get(self, key: str) -> Record | None:
        with self._lock:
            self._refresh()
            return self._kv.get(key)

    def scan(self, prefix: str) -> dict[str, Record]:
        with self._lock:
            self._refresh()
            return {k: r for k, r in self._kv.items() if k.startswith(prefix)}

    def _apply(self, compares: Sequence[Compare], puts: Sequence[Put]) -> CommitResult:
        conflicts = {}
        for c in compares:
            cur = self._kv.get(c.key)
            have = cur.version if cur else 0
            if have != c.version:
                conflicts[c.key] = have
        if conflicts:
            return CommitResult(False, self._revision, conflicts)
        if not puts:
            return CommitResult(True, self._revision)
        old_kv, old_rev = dict(self._kv), self._revision
        self._revision += 1
        for p in puts:
            if p.value is None:
                self._kv.pop(p.key, None)
            else:
                self._kv[p.key] = Record(bytes(p.value), self._revision)
        try:
            self._persist()
        except BaseException:
            self._kv, self._revision = old_kv, old_rev  # nothing was written: keep memory equal to disk
            raise
        return CommitResult(True, self._revision)

    def commit(self, compares: Sequence[Compare], puts: Sequence[Put]) -> CommitResult:
        with self._lock:
            self._refresh()
            return self._apply(compares, puts)


class MemoryStore(_MapStore):
    """In-process store: correct CAS semantics, no durability. URL ``memory://``."""


# ------------------------------------------------------------------------------------------------------- file


class FileStore(_MapStore):
    """The whole map as one JSON document, replaced atomically per commit. URL ``file:///dir``.

    A commit takes an exclusive ``flock`` on ``dir/lock``, reloads ``dir/state.json`` if another process
    replaced it, checks the compares, writes ``state.json.tmp``, fsyncs it, renames it over ``state.json`` and
    fsyncs the directory. A crash at any instant leaves either the old or the new document.
    """

    FILE = "state.json"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__()
        self._dir = Path(directory)
        try:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self._dir / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot use {self._dir} as a file store ({exc}): pick a writable directory") from exc
        self._stamp: tuple[int, int, int] | None = None
        with self._flock():
            # A writer killed between mkstemp and rename left its temp document behind, one per crash; none can be
            # in flight while the lock is held.
            for tmp in self._dir.glob(self.FILE + ".*.tmp"):
                tmp.unlink(missing_ok=True)
            self._refresh()

    def _flock(self) -> "_Flock":
        return _Flock(self._lock_fd)

    def _refresh(self) -> None:
        path = self._dir / self.FILE
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        try:
            doc = json.loads(path.read_bytes())
            self._kv = {k: Record(base64.b64decode(v), int(ver)) for k, (ver, v) in doc["kv"].items()}
            self._revision = int(doc["revision"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"file store {path} is unreadable or corrupt ({exc}): restore it from a backup "
                             "or start the job with a fresh store") from exc
        self._stamp = stamp

    def _persist(self) -> None:
        path = self._dir / self.FILE
        doc = {"revision": self._revision,
               "kv": {k: [r.version, base64.b64encode(r.value).decode()] for k, r in self._kv.items()}}
        data = json.dumps(doc, separators=(",", ":")).encode()
        try:
            fd, tmp = tempfile.mkstemp(prefix=self.FILE + ".", suffix=".tmp", dir=self._dir)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            dfd = os.open(self._dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            st = path.stat()
            self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError as exc:
            raise StoreError(f"cannot write file store {path} ({exc}): check disk space and permissions") from exc

    def get(self, key: str) -> Record | None:
        with self._lock, self._flock():
            self._refresh()
            return self._kv.get(key)

    def scan(self, prefix: str) -> dict[str, Record]:
        with self._lock, self._flock():
            self._refresh()
            return {k: r for k, r in self._kv.items() if k.startswith(prefix)}

    def commit(self, compares: Sequence[Compare], puts: Sequence[Put]) -> CommitResult:
        with self._lock, self._flock():
            self._refresh()
            return self._apply(compares, puts)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


class _Flock:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)


# ----------------------------------------------------------------------------------------------------- sqlite


class SQLiteStore(Store):
    """One SQLite database file. URL ``sqlite:///abs/path.db``.

    ``journal_mode=WAL`` with ``synchronous=FULL``: a commit is durable when it returns, and a reader never
    blocks the writer. A commit is one ``BEGIN IMMEDIATE`` transaction, so two coordinators on the same file
    serialize and the compares see each other's writes.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._lock = threading.Lock()
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a plain file where a directory should be, an unwritable parent
            raise StoreError(f"cannot create the directory of SQLite store {self._path} ({exc}): pick a path "
                             "under a writable directory") from exc
        try:
            self._db = sqlite3.connect(self._path, timeout=30.0, isolation_level=None, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value BLOB NOT NULL, "
                             "version INTEGER NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS meta (id INTEGER PRIMARY KEY CHECK (id = 0), "
                             "revision INTEGER NOT NULL)")
            self._db.execute("INSERT OR IGNORE INTO meta (id, revision) VALUES (0, 0)")
            # A page damaged inside (header intact) opened fine and failed every later commit: the coordinator
            # served, health SERVING, refusing every heartbeat. The store is small, so the check costs little.
            problems = [" ".join(str(r[0]).split()) for r in self._db.execute("PRAGMA quick_check").fetchall()]
        except sqlite3.Error as exc:
            self._db_close_quietly()
            raise StoreError(f"cannot open SQLite store {self._path} ({exc}): {_sqlite_advice(exc)}") from exc
        if problems != ["ok"]:
            self._db_close_quietly()
            raise StoreError(f"cannot open SQLite store {self._path} (damaged: {'; '.join(problems)[:300]}): the file "
                             "is not a SQLite database or is damaged: move it (and its -wal file) aside and restore "
                             "a backup, or start the job with a fresh --store")
        self._file = self._file_id()

    def _db_close_quietly(self) -> None:
        """Closes the connection of a store refused at open (its file is left as it was)."""
        db = getattr(self, "_db", None)
        if db is not None:
            try:
                db.close()
            except sqlite3.Error:
                pass

    def _file_id(self) -> tuple[int, int] | None:
        """The (device, inode) the store's path names now, None when nothing is there."""
        try:
            st = os.stat(self._path)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _check_file(self) -> None:
        """Raises when the path no longer names the file this store opened (lock held).

        Why: SQLite keeps writing to a database file that was deleted (or renamed and replaced) under it; every
        commit succeeded, and the coordinator started again found an empty store and ran the job from generation
        1, handing out generation numbers and MASTER_PORTs twice. A stat per call is nothing next to an fsync.
        """
        if self._file_id() != self._file:
            raise StoreError(f"SQLite store {self._path} was deleted or replaced while this coordinator ran: its "
                             "writes would go to a file no later start reads. Put the file back (a deleted one can "
                             f"still be copied from /proc/{os.getpid()}/fd while this process runs), or stop this "
                             "coordinator")

    def get(self, key: str) -> Record | None:
        with self._lock:
            self._check_file()
            try:
                row = self._db.execute(f"SELECT {_VALUE}, version FROM kv WHERE key = ?", (key,)).fetchone()
            except sqlite3.Error as exc:
                raise StoreError(f"cannot read SQLite store {self._path} ({exc}): {_sqlite_advice(exc)}") from exc
        return self._record(key, *row) if row else None

    def scan(self, prefix: str) -> dict[str, Record]:
        # Range scan instead of LIKE so "%" and "_" in keys are literal and the primary key index is used.
        with self._lock:
            self._check_file()
            try:
                if prefix:
                    rows = self._db.execute(f"SELECT key, {_VALUE}, version FROM kv WHERE key >= ? AND key < ?",
                                            (prefix, _prefix_end(prefix))).fetchall()
                else:
                    rows = self._db.execute(f"SELECT key, {_VALUE}, version FROM kv").fetchall()
            except sqlite3.Error as exc:
                raise StoreError(f"cannot read SQLite store {self._path} ({exc}): {_sqlite_advice(exc)}") from exc
        return {k: self._record(k, v, ver) for k, v, ver in rows}

    def _record(self, key: str, value: bytes | None, version: object) -> Record:
        """A row read back, its value already a BLOB (see :data:`_VALUE`); a version that is no whole number (a hand
        edit) is refused naming the key, as a damaged value is by the coordinator's decoders."""
        if value is None or not isinstance(version, int):
            raise StoreError(f"SQLite store {self._path}: key {key!r} has the value {value!r:.60} and version "
                             f"{version!r:.60} (a version must be a whole number): the row was edited by hand or "
                             "is damaged: delete it (sqlite3 FILE \"DELETE FROM kv WHERE key = '...'\"), or use a "
                             "fresh store")
        return Record(value, version)

    def commit(self, compares: Sequence[Compare], puts: Sequence[Put]) -> CommitResult:
        with self._lock:
            self._check_file()
            db = self._db
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    revision = int(db.execute("SELECT revision FROM meta WHERE id = 0").fetchone()[0])
                    conflicts = {}
                    for c in compares:
                        row = db.execute(f"SELECT {_VALUE}, version FROM kv WHERE key = ?", (c.key,)).fetchone()
                        have = self._record(c.key, *row).version if row else 0
                        if have != c.version:
                            conflicts[c.key] = have
                    if conflicts or not puts:
                        db.execute("ROLLBACK")
                        return CommitResult(not conflicts, revision, conflicts)
                    revision += 1
                    db.execute("UPDATE meta SET revision = ? WHERE id = 0", (revision,))
                    for p in puts:
                        if p.value is None:
                            db.execute("DELETE FROM kv WHERE key = ?", (p.key,))
                        else:
                            db.execute("INSERT INTO kv (key, value, version) VALUES (?, ?, ?) ON CONFLICT(key) "
                                       "DO UPDATE SET value = excluded.value, version = excluded.version",
                                       (p.key, bytes(p.value), revision))
                    db.execute("COMMIT")
                    return CommitResult(True, revision)
                except BaseException:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                raise StoreError(f"cannot write SQLite store {self._path} ({exc}): {_sqlite_advice(exc)}") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()


#: A row's value as read: a BLOB whatever its SQL type. A hand edit in the sqlite3 shell
#: (``UPDATE kv SET value = '{...}'``) stores TEXT, which bytes() refused with a TypeError traceback (an INTEGER it
#: took as a length); cast, the value reaches the record decoders, whose "is corrupt ...: delete it" names the key.
_VALUE = "CAST(value AS BLOB)"


def _sqlite_advice(exc: sqlite3.Error) -> str:
    """What an operator does about a SQLite error (a corrupt file used to be answered with "check the path and
    permissions", a read with no advice at all)."""
    name = getattr(exc, "sqlite_errorname", "")
    if name in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
        return ("the file is not a SQLite database or is damaged: move it (and its -wal file) aside and restore "
                "a backup, or start the job with a fresh --store")
    if name == "SQLITE_FULL":
        return "its filesystem is full: free space there"
    if name in ("SQLITE_BUSY", "SQLITE_LOCKED"):
        return "another program holds a lock on it (another coordinator of this job?): stop it"
    return ("check the path and permissions (its directory must be writable: SQLite keeps the -wal and -shm "
            "files beside it)")


def _prefix_end(prefix: str) -> str:
    """The smallest string greater than every string starting with ``prefix``."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


# ------------------------------------------------------------------------------------------------------- etcd


#: gRPC-gateway header carrying etcd's ``hasleader`` metadata: a member without a leader refuses at once.
_REQUIRE_LEADER = "Grpc-Metadata-hasleader"


class _EndpointUnavailable(Exception):
    """An etcd endpoint answered but cannot serve now (5xx): the next endpoint is tried."""


def _etcd_error(payload: bytes) -> str:
    """The message of an etcd gateway error body, or the start of the raw body."""
    try:
        return str(json.loads(payload).get("message") or payload[:200].decode(errors="replace"))
    except (ValueError, AttributeError):
        return payload[:200].decode(errors="replace")


class EtcdStore(Store):
    """etcd v3 through its JSON gateway. URL ``etcd://host:port[,host:port...][/key-prefix]``.

    Record versions are etcd ``mod_revision`` values; a commit is one ``/v3/kv/txn`` whose compares are
    ``MOD == version`` (``CREATE == 0`` for absent keys). Endpoints are tried in order; a connection error or a
    member that cannot serve (5xx: no leader after losing quorum, a request timeout) moves to the next one.
    """

    max_ops_per_commit = 127  # etcd --max-txn-ops default 128, one slot kept for the fencing compare
    # etcd's default --max-request-bytes is 1.5 MiB: 1 MiB of keys and values leaves room for the transaction's
    # compares and framing, and for a state record near the coordinator's 1 MiB warning committed on its own.
    max_bytes_per_commit = 1 << 20

    def __init__(self, endpoints: Sequence[tuple[str, int]], prefix: str = "", timeout_s: float = 10.0,
                 security: "EtcdSecurity | None" = None) -> None:
        if not endpoints:
            raise StoreURLError("etcd store needs at least one host:port endpoint, e.g. etcd://127.0.0.1:2379")
        from trainguard.recovery.etcd_security import EtcdSecurity

        self._endpoints = list(endpoints)
        self._prefix = prefix
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._current = 0
        self._security = security or EtcdSecurity()  # TLS / client certificate / user (etcd_security.py)
        self._ssl = self._security.ssl_context()
        self._auth_token = ""

    # -- transport
    def _post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        data = json.dumps(body).encode()
        errors = []
        with self._lock:
            attempts, reused_retry = len(self._endpoints), True
            while attempts > 0:
                attempts -= 1
                host, port = self._endpoints[self._current]
                reused = self._conn is not None
                try:
                    if self._conn is None:
                        self._conn = http.client.HTTPSConnection(host, port, timeout=self._timeout_s,
                                                                 context=self._ssl) if self._ssl else \
                            http.client.HTTPConnection(host, port, timeout=self._timeout_s)
                    resp, payload = self._request(path, data)
                    if resp.status == 401 and self._security.user and path != "/v3/auth/authenticate":
                        self._auth_token = ""  # expired (etcd's simple tokens live 5 minutes): log in again
                        resp, payload = self._request(path, data)
                    if resp.status >= 500:
                        # A member without a leader (lost quorum, partitioned away, mid-election) or a proxy in
                        # front of a dead one cannot serve, like a closed port; it was reported as the store's
                        # failure while the next listed member could answer.
                        raise _EndpointUnavailable(f"answered {resp.status}: {_etcd_error(payload)}")
                    if resp.status != 200:
                        raise StoreError(f"etcd at {host}:{port} answered {resp.status} to {path}: "
                                         f"{payload[:200].decode(errors='replace')}")
                    return json.loads(payload)
                except _EndpointUnavailable as exc:
                    self._conn.close()
                    self._conn = None
                    errors.append(f"{host}:{port}: {exc}")
                    self._current = (self._current + 1) % len(self._endpoints)
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
                    if reused and reused_retry:
                        # A kept-alive connection dies with the etcd process that accepted it (a restart, a
                        # proxy's idle timeout): the first request after that failed with "no etcd endpoint
                        # answered" although etcd was up again. One fresh connection to the same endpoint tells.
                        reused_retry = False
                        attempts += 1
                        continue
                    errors.append(f"{host}:{port}: {exc}")
                    self._current = (self._current + 1) % len(self._endpoints)
        raise StoreError(f"no etcd endpoint answered ({'; '.join(errors)}): check that etcd runs, that its members "
                         "have quorum, and that the store URL lists their client addresses")

    def _request(self, path: str, data: bytes) -> tuple[http.client.HTTPResponse, bytes]:
        """One POST on the open connection, logging in first when a user is configured (lock held)."""
        assert self._conn is not None
        # Without this header a member that lost its leader holds every request for etcd's request timeout
        # (5 s and more) before failing it; with it, the member refuses at once with 503 "no leader".
        headers = {"Content-Type": "application/json", _REQUIRE_LEADER: "true"}
        if self._security.user and path != "/v3/auth/authenticate":
            if not self._auth_token:
                body = json.dumps({"name": self._security.user, "password": self._security.password}).encode()
                resp, payload = self._request("/v3/auth/authenticate", body)
                if resp.status >= 500:  # a login needs a leader too: not the password's fault, try the next member
                    raise _EndpointUnavailable(f"answered {resp.status} to the login: {_etcd_error(payload)}")
                if resp.status != 200:
                    raise StoreError(f"etcd refused the login of user {self._security.user!r} ({resp.status}: "
                                     f"{payload[:200].decode(errors='replace')}); check the password file")
                self._auth_token = str(json.loads(payload).get("token", ""))
            headers["Authorization"] = self._auth_token
        self._conn.request("POST", path, data, headers)
        resp = self._conn.getresponse()
        return resp, resp.read()

    @staticmethod
    def _b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    def _k(self, key: str) -> bytes:
        return (self._prefix + key).encode()

    def _records(self, kvs: Iterable[Mapping[str, str]]) -> dict[str, Record]:
        out = {}
        n = len(self._prefix.encode())
        for kv in kvs:
            key = base64.b64decode(kv["key"])[n:].decode()
            out[key] = Record(base64.b64decode(kv.get("value", "")), int(kv["mod_revision"]))
        return out

    # -- Store
    def get(self, key: str) -> Record | None:
        resp = self._post("/v3/kv/range", {"key": self._b64(self._k(key))})
        return self._records(resp.get("kvs", [])).get(key)  # type: ignore[arg-type]

    def scan(self, prefix: str) -> dict[str, Record]:
        start = self._k(prefix)
        # range_end "\0" means "to the end of the key space" when the prefix is empty.
        end = (start[:-1] + bytes([start[-1] + 1])) if start else b"\0"
        resp = self._post("/v3/kv/range", {"key": self._b64(start or b"\0"), "range_end": self._b64(end)})
        return self._records(resp.get("kvs", []))  # type: ignore[arg-type]

    def commit(self, compares: Sequence[Compare], puts: Sequence[Put]) -> CommitResult:
        if len(puts) > self.max_ops_per_commit:
            raise StoreError(f"an etcd commit carries at most {self.max_ops_per_commit} writes, got {len(puts)}: "
                             "split the batch")
        cmp = []
        for c in compares:
            if c.version == 0:
                cmp.append({"key": self._b64(self._k(c.key)), "target": "CREATE", "result": "EQUAL",
                            "create_revision": "0"})
            else:
                cmp.append({"key": self._b64(self._k(c.key)), "target": "MOD", "result": "EQUAL",
                            "mod_revision": str(c.version)})
        success = []
        # etcd refuses a txn that names a key twice; applying puts in order means the last one per key wins.
        for p in {p.key: p for p in puts}.values():
            if p.value is None:
                success.append({"request_delete_range": {"key": self._b64(self._k(p.key))}})
            else:
                success.append({"request_put": {"key": self._b64(self._k(p.key)), "value": self._b64(p.value)}})
        failure = [{"request_range": {"key": self._b64(self._k(c.key))}} for c in compares]
        resp = self._post("/v3/kv/txn", {"compare": cmp, "success": success, "failure": failure})
        revision = int(resp.get("header", {}).get("revision", 0))  # type: ignore[union-attr]
        if resp.get("succeeded"):
            return CommitResult(True, revision)
        current: dict[str, int] = {}
        for r in resp.get("responses", []):  # type: ignore[union-attr]
            current.update({k: rec.version for k, rec in self._records(r["response_range"].get("kvs", [])).items()})
        conflicts = {c.key: current.get(c.key, 0) for c in compares if current.get(c.key, 0) != c.version}
        return CommitResult(False, revision, conflicts)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


# ---------------------------------------------------------------------------------------------------- fencing


@dataclass(frozen=True)
class Fence:
    """Proof that this writer owns a job's state.

    Attributes:
        key: the fence key.
        epoch: how many writers took the state over so far, this one included.
        version: the fence key's version after this writer's bump; later commits compare against it.
    """

    key: str
    epoch: int
    version: int


def acquire_fence(store: Store, key: str, attempts: int = 100) -> Fence:
    """Takes over a fence key by bumping its epoch with compare-and-set.

    Args:
        store: the store.
        key: the fence key (one per job).
        attempts: CAS retries against concurrent takeovers.

    Returns:
        This writer's fence.

    Raises:
        StoreError: the store failed, the stored epoch is corrupt, or every attempt lost a race.
    """
    for _ in range(attempts):
        rec = store.get(key)
        try:
            epoch = int(rec.value) + 1 if rec else 1
        except ValueError as exc:
            raise StoreError(f"fence key {key!r} holds {rec.value[:40]!r}, not an epoch: the store is corrupt") \
                from exc
        res = store.compare_and_set(key, rec.version if rec else 0, str(epoch).encode())
        if res.ok:
            return Fence(key, epoch, res.revision)
    raise StoreError(f"could not take fence {key!r} after {attempts} attempts: other coordinators keep racing "
                     "for the same job; run only one")


class FencedStore(Store):
    """A store view whose every commit also requires the fence to be unchanged.

    Reads pass through. A commit that fails because the fence moved raises
    :class:`~trainguard.recovery.errors.FencedError`: another coordinator owns the job now.
    """

    def __init__(self, inner: Store, fence: Fence) -> None:
        self.inner = inner
        self.fence = fence
        self.max_ops_per_commit = inner.max_ops_per_commit
        self.max_bytes_per_commit = inner.max_bytes_per_commit

    def get(self, key: str) -> Record | None:
        return self.inner.get(key)

    def scan(self, prefix: str) -> dict[str, Record]:
        return self.inner.scan(prefix)

    def commit(self, compares: Sequence[Compare], puts: Sequence[Put]) -> CommitResult:
        res = self.inner.commit([Compare(self.fence.key, self.fence.version), *compares], puts)
        if not res.ok and self.fence.key in res.conflicts:
            raise FencedError(f"another coordinator took over this job (fence {self.fence.key!r} moved from "
                              f"version {self.fence.version} to {res.conflicts[self.fence.key]}): this one stops")
        return res

    def close(self) -> None:
        self.inner.close()


# --------------------------------------------------------------------------------------------------- registry

#: Store constructors by URL scheme; each takes the parsed URL.
BACKENDS: dict[str, Callable[[urllib.parse.SplitResult], Store]] = {}


def register_backend(scheme: str) -> Callable[[Callable[[urllib.parse.SplitResult], Store]],
                                               Callable[[urllib.parse.SplitResult], Store]]:
    """Registers a store constructor for a URL scheme.

    Args:
        scheme: the URL scheme, e.g. ``"sqlite"``.

    Returns:
        A decorator that records the constructor and returns it unchanged.
    """
    def deco(fn: Callable[[urllib.parse.SplitResult], Store]) -> Callable[[urllib.parse.SplitResult], Store]:
        BACKENDS[scheme] = fn
        return fn
    return deco


def _local_path(url: urllib.parse.SplitResult) -> str:
    # A relative path ("sqlite:state.db") resolved against whatever directory the coordinator was started in:
    # restarted elsewhere (systemd, another shell) it opened an empty store and ran the job from generation 0
    # again. Options are not read, so one given ("?mode=ro") would be ignored without a word.
    path = urllib.parse.unquote(url.path)
    if url.netloc not in ("", "localhost") or not path.startswith("/") or url.query or url.fragment:
        raise StoreURLError(f"store URL {url.geturl()!r} needs an absolute local path and no options, e.g. "
                            f"{url.scheme}:///var/lib/trainguard/job")
    return path


@register_backend("memory")
def _open_memory(url: urllib.parse.SplitResult) -> Store:
    return MemoryStore()


@register_backend("file")
def _open_file(url: urllib.parse.SplitResult) -> Store:
    return FileStore(_local_path(url))


@register_backend("sqlite")
def _open_sqlite(url: urllib.parse.SplitResult) -> Store:
    return SQLiteStore(_local_path(url))


@register_backend("etcd")
def _open_etcd(url: urllib.parse.SplitResult) -> Store:
    from trainguard.recovery.etcd_security import etcd_security

    security = etcd_security(url)  # ?ca=&cert=&key=&password_file= and user@ (see etcd_security.py)
    endpoints = []
    for part in url.netloc.rpartition("@")[2].split(","):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreURLError(f"etcd endpoint {part!r} in {url.geturl()!r} is not host:port, e.g. "
                                "etcd://127.0.0.1:2379")
        endpoints.append((host.strip("[]"), int(port)))
    prefix = url.path.lstrip("/")
    return EtcdStore(endpoints, prefix=(prefix.rstrip("/") + "/") if prefix else "", security=security)


def open_store(url: str) -> Store:
    """Opens a store from its URL (see the module docstring for the syntax).

    Args:
        url: e.g. ``sqlite:///var/lib/trainguard/job.db``, ``file:///var/lib/trainguard/job``,
            ``etcd://10.0.0.5:2379,10.0.0.6:2379/trainguard``, ``memory://``.

    Returns:
        The opened store.

    Raises:
        StoreURLError: unknown scheme or malformed URL.
        StoreError: the backend cannot be opened.
    """
    parts = urllib.parse.urlsplit(url)
    factory = BACKENDS.get(parts.scheme)
    if factory is None:
        raise StoreURLError(f"unknown store URL {url!r}: use one of "
                            f"{', '.join(s + '://' for s in sorted(BACKENDS))}")
    return factory(parts)

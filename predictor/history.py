"""The agent's metric history: fixed-interval samples and observed hard failures in one SQLite file.

The agent appends one flat ``dict[str, float]`` per node per interval (e.g. every 5 s) and records each hard
failure it observes; this is the predictor's training data, and users export it to the CSV interchange
format (:mod:`.table`). Layout: a table of metric-name lists ("schemas", stored once) and one row per sample
holding ``(ts, node id, schema id, values)`` with the values packed as little-endian float64 (about 150 bytes
per sample of 16 metrics, ~2.6 MB per node-day at 5 s). WAL journal, ``synchronous=NORMAL``: an append costs
well under a millisecond and a crash loses at most the last few appends, never the file.

Retention: every ``prune_every`` appends, samples and events older than ``retention_s`` before the newest
sample are deleted, then, while the live data exceeds ``max_bytes``, the oldest 10% of samples go too. Freed
pages return to the file system (``auto_vacuum=INCREMENTAL``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sqlite3
import threading
import uuid
import weakref
from pathlib import Path

import numpy as np

from trainguard.predictor.catalog import RESERVED_COLUMNS, UNKNOWN_KIND
from trainguard.predictor.errors import HistoryError
from trainguard.predictor.table import EventTable, MetricTable

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS nodes (id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL);
CREATE TABLE IF NOT EXISTS schemas (id INTEGER PRIMARY KEY, names TEXT UNIQUE NOT NULL);
CREATE TABLE IF NOT EXISTS samples (ts REAL NOT NULL, node_id INTEGER NOT NULL, schema_id INTEGER NOT NULL,
                                    vals BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS samples_ts ON samples (ts);
CREATE INDEX IF NOT EXISTS samples_node_ts ON samples (node_id, ts);
CREATE TABLE IF NOT EXISTS events (ts REAL NOT NULL, node_id INTEGER NOT NULL, kind TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_ts ON events (ts);
CREATE TABLE IF NOT EXISTS writers (node TEXT PRIMARY KEY, writer TEXT NOT NULL, host TEXT NOT NULL,
                                    boot TEXT NOT NULL, pid INTEGER NOT NULL);
"""

log = logging.getLogger(__name__)

#: The writable stores open in this process, by writer id: a claim of this process is live only while its store is
#: (one dropped without close() left a claim that a live pid kept up).
_OPEN: "weakref.WeakValueDictionary[str, MetricHistory]" = weakref.WeakValueDictionary()


def _boot_id() -> str:
    """This boot's id (a pid of an earlier boot names no live process); "" where the kernel does not say."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _claim_alive(writer: str, host: str, boot: str, pid: int) -> bool:
    """Whether the writer of a claim still writes: a store open in this process, or a live process of this boot on
    this host (a writer on another host cannot be judged, and is not taken for live)."""
    if host != socket.gethostname() or boot != _boot_id():
        return False
    if pid == os.getpid():
        return writer in _OPEN
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class MetricHistory:
    """A bounded local store of metric samples and failure events (see the module docstring).

    Safe to use from several threads of one process (one connection behind a lock).

    Each writable store is a writer of its own: the first to write a node claims it (table ``writers``: writer id,
    host, boot id, pid; released on :meth:`close`). Another store writing the same node while that writer lives
    (two runs on one host with the same node id and file) stores under ``<node>#2`` (``#3``, ...) and logs one
    warning: interleaved under one node, the export showed one node sampled twice as often, its series mixing two
    runs. A claim whose process is gone (closed, killed, an earlier boot) is taken over in silence; a writer on
    another host (a shared file system) is not detected.
    """

    def __init__(self, path: str | Path, retention_s: float = 30 * 86400.0, max_bytes: int = 512 * 2**20,
                 prune_every: int = 720, readonly: bool = False) -> None:
        """Opens or creates a store.

        Args:
            path: SQLite file (created with its folder if absent).
            retention_s: keep this much history before the newest sample, seconds (default 30 days).
            max_bytes: bound on the live data size, bytes (default 512 MiB).
            prune_every: appends between two retention passes (default 720, one hour at 5 s).
            readonly: only read an existing store (an export): nothing is created or written, so a read-only
                file or mount works and a mistyped path is an error, not a new empty store.

        Raises:
            HistoryError: the file cannot be opened or is not a history store (or, ``readonly``, does not exist).
        """
        if retention_s <= 0 or max_bytes <= 0 or prune_every <= 0:
            raise HistoryError("retention_s, max_bytes and prune_every must be positive")
        self.path = Path(path)
        self.retention_s = float(retention_s)
        self.max_bytes = int(max_bytes)
        self.prune_every = int(prune_every)
        self._lock = threading.Lock()
        self._since_prune = 0
        self._readonly = readonly
        self._writer = uuid.uuid4().hex
        self._stored: dict[str, str] = {}  # node -> the node name this store writes it under
        if not readonly:
            _OPEN[self._writer] = self
        if readonly:
            self._open_readonly()
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file where the folder goes, a read-only or absent mount
            raise HistoryError(f"{self.path}: cannot create the metric history's folder {self.path.parent} "
                               f"({exc.strerror or exc}); pick a path in a writable folder") from exc
        try:
            self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA auto_vacuum = INCREMENTAL")
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
            self._db.executescript(_SCHEMA)
            self._load_tables()
        except sqlite3.DatabaseError as exc:
            raise HistoryError(f"{self.path}: cannot open metric history ({exc}); move the file aside to start anew") from exc

    def _open_readonly(self) -> None:
        if not self.path.is_file():
            raise HistoryError(f"{self.path}: no metric history there (the agent writes it where --metric-history "
                               "or its state directory says); check the path")
        try:
            self._db = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False,
                                       isolation_level=None)
            self._load_tables()
        except sqlite3.DatabaseError as exc:
            raise HistoryError(f"{self.path}: cannot read metric history ({exc}); is it a trainguard history "
                               "file (--metric-history)?") from exc

    def _load_tables(self) -> None:
        self._nodes = {n: i for i, n in self._db.execute("SELECT id, name FROM nodes")}
        self._schemas = {tuple(json.loads(s)): i for i, s in self._db.execute("SELECT id, names FROM schemas")}
        self._last = {n: t for n, t in self._db.execute(
            "SELECT nodes.name, MAX(samples.ts) FROM samples JOIN nodes ON nodes.id = samples.node_id GROUP BY node_id")}

    def close(self) -> None:
        """Closes the store, releasing its claims on nodes (further calls fail)."""
        _OPEN.pop(self._writer, None)
        with self._lock:
            if self._stored and not self._readonly:
                try:
                    self._db.execute("DELETE FROM writers WHERE writer = ?", (self._writer,))
                except sqlite3.DatabaseError:
                    pass  # the claims die with this process anyway (judged by pid)
            self._db.close()

    def _stored_name(self, node: str) -> str:
        """The node name this store writes ``node`` under: ``node`` unless another live writer claimed it (see the
        class docstring). Call with the lock held.

        Raises:
            HistoryError: the claim could not be written.
        """
        name = self._stored.get(node)
        if name is not None or self._readonly:
            return name or node
        host, boot, pid = socket.gethostname(), _boot_id(), os.getpid()
        try:
            self._db.execute("BEGIN IMMEDIATE")
            k, owner_pid = 1, 0
            while True:
                name = node if k == 1 else f"{node}#{k}"
                row = self._db.execute("SELECT writer, host, boot, pid FROM writers WHERE node = ?",
                                       (name,)).fetchone()
                if row is None or row[0] == self._writer or not _claim_alive(row[0], row[1], row[2], int(row[3])):
                    break
                owner_pid = int(row[3])
                k += 1
            self._db.execute("INSERT OR REPLACE INTO writers VALUES (?, ?, ?, ?, ?)",
                             (name, self._writer, host, boot, pid))
            self._db.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            self._rollback()
            raise HistoryError(f"{self.path}: cannot record this run as the writer of node {node!r} ({exc}); "
                               "check disk space") from exc
        if name != node:
            log.warning("metric history %s: node %r is written by another live run (pid %d on this host), so this "
                        "run stores its samples and failures as node %r to keep the two series apart; give each run "
                        "its own history file (--metric-history) or node id (--node-id)", self.path, node, owner_pid,
                        name)
        self._stored[node] = name
        return name

    def __enter__(self) -> "MetricHistory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _node_id(self, node: str) -> int:
        nid = self._nodes.get(node)
        if nid is None:
            # OR IGNORE, then read: another process on the same file (a second run, an export) may have added it
            # since this one read the table; a plain INSERT failed its UNIQUE constraint on every later append.
            self._db.execute("INSERT OR IGNORE INTO nodes (name) VALUES (?)", (node,))
            nid = int(self._db.execute("SELECT id FROM nodes WHERE name = ?", (node,)).fetchone()[0])
            self._nodes[node] = nid
        return nid

    def _schema_id(self, names: tuple[str, ...]) -> int:
        sid = self._schemas.get(names)
        if sid is None:
            text = json.dumps(names)
            self._db.execute("INSERT OR IGNORE INTO schemas (names) VALUES (?)", (text,))  # as in _node_id
            sid = int(self._db.execute("SELECT id FROM schemas WHERE names = ?", (text,)).fetchone()[0])
            self._schemas[names] = sid
        return sid

    def append(self, ts: float, node: str, metrics: dict[str, float]) -> None:
        """Stores one sample.

        Args:
            ts: sample time, Unix seconds; must be after the node's previous sample.
            node: node name.
            metrics: flat metric name -> value (NaN allowed for a value that could not be read).

        Raises:
            HistoryError: time not increasing, non-numeric value, or the write failed.
        """
        if not math.isfinite(ts):
            raise HistoryError(f"node {node!r}: timestamp {ts!r} is not finite")
        names = tuple(sorted(metrics))
        unfit = [n for n in names if not n or n in RESERVED_COLUMNS]
        if unfit:
            # each name becomes a column of the export, which could then not be written or read back
            raise HistoryError(f"node {node!r}: metric name(s) {unfit} cannot be stored (empty, or a column the CSV "
                               f"format reserves: {sorted(RESERVED_COLUMNS)}); rename the metric")
        try:
            vals = np.array([float(metrics[n]) for n in names], dtype="<f8")
        except (TypeError, ValueError) as exc:
            raise HistoryError(f"node {node!r}: a metric value is not a number ({exc}); pass floats") from exc
        if np.isinf(vals).any():
            # the CSV format (and PredictorRuntime.observe) refuses an infinite value: one stored here made every
            # later export of the whole store fail
            bad = names[int(np.argmax(np.isinf(vals)))]
            raise HistoryError(f"node {node!r}: metric {bad!r} is infinite; pass NaN for a value that is unknown")
        with self._lock:
            node = self._stored_name(node)
            last = self._last.get(node)
            if last is not None and ts <= last:
                raise HistoryError(
                    f"node {node!r}: sample at {ts} is not after the stored {last}; samples must be appended in time order"
                )
            try:
                self._db.execute("BEGIN IMMEDIATE")  # the write lock first: another writer waits, not fails
                sid = self._schema_id(names)
                self._db.execute("INSERT INTO samples VALUES (?, ?, ?, ?)", (ts, self._node_id(node), sid, vals.tobytes()))
                self._db.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                self._rollback()
                self._schemas.pop(names, None)  # ids read in a rolled-back transaction may not exist
                self._nodes.pop(node, None)
                raise HistoryError(f"{self.path}: cannot store sample ({exc}); check disk space") from exc
            self._last[node] = ts
            self._since_prune += 1
            if self._since_prune >= self.prune_every:
                self._prune_locked()

    def record_event(self, ts: float, node: str, kind: str) -> None:
        """Stores an observed hard failure.

        Args:
            ts: failure time, Unix seconds.
            node: node name.
            kind: failure kind (free text, e.g. ``"GPU Lost"``).

        Raises:
            HistoryError: the write failed, the time is not finite or the kind is empty.
        """
        if not math.isfinite(ts):
            raise HistoryError(f"event on node {node!r}: timestamp {ts!r} is not finite")
        if not isinstance(kind, str) or not kind.strip():
            # stored, it was exported as an events row with an empty kind cell
            raise HistoryError(f"event on node {node!r} at {ts!r}: kind {kind!r} is empty; name the failure "
                               "(\"unknown\" when the cause is not known)")
        with self._lock:
            node = self._stored_name(node)
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("INSERT INTO events VALUES (?, ?, ?)", (ts, self._node_id(node), str(kind)))
                self._db.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                self._rollback()
                self._nodes.pop(node, None)
                raise HistoryError(f"{self.path}: cannot store event ({exc}); check disk space") from exc

    def _rollback(self) -> None:
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.DatabaseError:
            pass

    def live_bytes(self) -> int:
        """Bytes of pages in use (file size less free pages)."""
        with self._lock:
            return self._live_bytes_locked()

    def _live_bytes_locked(self) -> int:
        ps = self._db.execute("PRAGMA page_size").fetchone()[0]
        pc = self._db.execute("PRAGMA page_count").fetchone()[0]
        fl = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        return int(ps * (pc - fl))

    def prune(self) -> int:
        """Applies retention now.

        Returns:
            Samples deleted.
        """
        with self._lock:
            return self._prune_locked()

    def _prune_locked(self) -> int:
        self._since_prune = 0
        newest = self._db.execute("SELECT MAX(ts) FROM samples").fetchone()[0]
        if newest is None:
            return 0
        cutoff = newest - self.retention_s
        deleted = self._db.execute("DELETE FROM samples WHERE ts < ?", (cutoff,)).rowcount
        self._db.execute("DELETE FROM events WHERE ts < ?", (cutoff,))
        while self._live_bytes_locked() > self.max_bytes:
            n = self._db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]
            if n == 0:
                break
            cut = self._db.execute("SELECT ts FROM samples ORDER BY ts LIMIT 1 OFFSET ?", (max(1, n // 10),)).fetchone()
            cut_ts = cut[0] if cut else newest + 1
            deleted += self._db.execute("DELETE FROM samples WHERE ts < ?", (cut_ts,)).rowcount
            self._db.execute("DELETE FROM events WHERE ts < ?", (cut_ts,))
            if n // 10 == 0:
                break
        self._db.execute("PRAGMA incremental_vacuum")
        return int(deleted)

    def last_ts(self, node: str) -> float | None:
        """The time of the node's newest sample stored by this store's writes of it (under ``<node>#2`` while
        another live writer holds the node), Unix seconds (None: none stored). :meth:`append` refuses samples at
        or before it.

        Raises:
            HistoryError: the store's claim on the node could not be written.
        """
        with self._lock:
            node = self._stored_name(node)
            row = self._db.execute("SELECT MAX(samples.ts) FROM samples JOIN nodes ON nodes.id = samples.node_id "
                                   "WHERE nodes.name = ?", (node,)).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def count(self) -> int:
        """Samples stored."""
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM samples").fetchone()[0])

    def span(self) -> tuple[float, float] | None:
        """``(oldest, newest)`` sample time over every node, Unix seconds; None when no sample is stored."""
        with self._lock:
            row = self._db.execute("SELECT MIN(ts), MAX(ts) FROM samples").fetchone()
        return None if row is None or row[0] is None else (float(row[0]), float(row[1]))

    def to_tables(self, since: float | None = None) -> tuple[MetricTable, EventTable]:
        """Reads the store into tables (metric columns: the union of all names, sorted; absent = NaN).

        Args:
            since: only samples and events at or after this time, Unix seconds.

        Returns:
            ``(metrics, events)``.
        """
        lo = -math.inf if since is None else since
        with self._lock:
            # From the file, not this object's caches (another process may have added names and schemas), in one
            # read transaction so that every row's schema and node are in the snapshot.
            self._db.execute("BEGIN")
            try:
                names_of = {i: json.loads(s) for i, s in self._db.execute("SELECT id, names FROM schemas")}
                node_of = {i: n for i, n in self._db.execute("SELECT id, name FROM nodes")}
                rows = self._db.execute("SELECT ts, node_id, schema_id, vals FROM samples WHERE ts >= ? "
                                        "ORDER BY ts, node_id", (lo,)).fetchall()
                evs = self._db.execute("SELECT ts, node_id, kind FROM events WHERE ts >= ? ORDER BY ts",
                                       (lo,)).fetchall()
            finally:
                self._rollback()
        columns = sorted({n for names in names_of.values() for n in names})
        pos = {c: i for i, c in enumerate(columns)}
        idx_of = {sid: np.array([pos[n] for n in names], dtype=np.int64) for sid, names in names_of.items()}
        values = np.full((len(rows), len(columns)), np.nan)
        for r, (_, _, sid, blob) in enumerate(rows):
            values[r, idx_of[sid]] = np.frombuffer(blob, dtype="<f8")
        inf = np.isinf(values)
        if inf.any():
            # written before append refused them: exported as missing cells (the CSV format has no infinity),
            # said once, rather than no export at all
            r, c = (int(i[0]) for i in np.nonzero(inf))
            log.warning("metric history %s: %d infinite value(s) exported as missing (empty) cells, e.g. node %r "
                        "metric %r at %r", self.path, int(inf.sum()), node_of[rows[r][1]], columns[c], rows[r][0])
            values[inf] = np.nan
        metrics = MetricTable(columns, np.array([r[0] for r in rows], dtype=np.float64),
                              np.array([node_of[r[1]] for r in rows], dtype=object), values)
        named = [isinstance(e[2], str) and bool(e[2].strip()) for e in evs]
        kinds = [e[2] if ok else UNKNOWN_KIND for e, ok in zip(evs, named)]
        blank = named.count(False)
        if blank:
            # stored before record_event refused them: exported as an unknown failure, still a label
            log.warning("metric history %s: %d event(s) stored without a kind exported as %r", self.path, blank,
                        UNKNOWN_KIND)
        events = EventTable(np.array([e[0] for e in evs], dtype=np.float64),
                            np.array([node_of[e[1]] for e in evs], dtype=object), np.array(kinds, dtype=object))
        return metrics, events

    def export(self, metrics_csv: str | Path, events_csv: str | Path, since: float | None = None) -> tuple[int, int]:
        """Writes the store in the CSV interchange format.

        Args:
            metrics_csv: destination of ``timestamp,node,<metrics...>``.
            events_csv: destination of ``timestamp,node,kind``.
            since: only data at or after this time, Unix seconds.

        Returns:
            ``(samples written, events written)``.
        """
        metrics, events = self.to_tables(since)
        metrics.to_csv(metrics_csv)
        events.to_csv(events_csv)
        return len(metrics.ts), len(events)

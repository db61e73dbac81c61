"""The CSV interchange format: a metrics table and an events table, validated on the way in.

Metrics: a header ``timestamp,node[,job],<metric columns...>`` then one row per node per interval.
``timestamp`` is Unix time in seconds (a float) or an ISO 8601 time (a time without zone is read as UTC).
``job`` is optional; nodes of the same job are each other's peers (without it, all nodes are one job). An
empty cell or ``nan`` is a missing value (kept as NaN; the features forward-fill it and count it as a
telemetry gap). Rows of different nodes may interleave, but each node's timestamps must strictly increase.

Events: a header ``timestamp,node,kind``, one row per observed hard failure (``kind`` is free text, e.g.
``GPU Lost``). Anything else (a missing column, a non-numeric cell, an infinite value, a node going back in
time) is a :class:`~.errors.DataFormatError` that names the file, line and column.
"""

from __future__ import annotations

import csv
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from trainguard.predictor.catalog import RESERVED_COLUMNS
from trainguard.predictor.errors import DataFormatError


def _plain(text: str) -> bool:
    """Whether float() may read ``text``: it also takes '6_5' (65) and other scripts' digits ('٦٥'), so such
    cells were scored as numbers the file never held. Two C-speed checks, not a regex: a regex per cell made
    loading a 1.6-million-cell file 46% slower."""
    return text.isascii() and "_" not in text


def _parse_time(text: str, where: str) -> float:
    try:
        if not _plain(text):
            raise ValueError(text)
        t = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(t):
            raise DataFormatError(f"{where}: timestamp {text!r} is not a time; every row needs its Unix seconds or "
                                  "ISO 8601 time")
        return t
    try:
        iso = text.strip()
        if len(iso) > 10 and iso[10] == "t":  # RFC 3339 allows a lower-case separator and zone letter
            iso = iso[:10] + "T" + iso[11:]
        if iso[-1:] in ("Z", "z"):
            iso = iso[:-1] + "+00:00"
        dt = datetime.fromisoformat(iso)
    except ValueError:
        raise DataFormatError(f"{where}: timestamp {text!r} is neither Unix seconds nor ISO 8601; fix the cell") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _parse_value(text: str, where: str) -> float:
    t = text.strip()
    if t == "" or t.lower() == "nan":
        return math.nan
    try:
        if not _plain(t):
            raise ValueError(t)
        v = float(t)
    except ValueError:
        raise DataFormatError(f"{where}: value {text!r} is not a number; leave the cell empty if it is missing") from None
    if math.isinf(v):
        raise DataFormatError(f"{where}: value {text!r} is infinite; leave the cell empty if it is missing")
    return v


@dataclass
class NodeSeries:
    """One node's samples in time order.

    Attributes:
        node: node name.
        job: job name ("" when the table has no job column).
        ts: timestamps, seconds, strictly increasing, shape (n,).
        values: samples, shape (n, len(columns)); NaN where missing.
    """

    node: str
    job: str
    ts: np.ndarray
    values: np.ndarray


def _bin_keep(v: np.ndarray, valid: np.ndarray, starts: np.ndarray, ends: np.ndarray, mean: np.ndarray, how: str,
              c: float | None) -> np.ndarray:
    """One column's bins merged as a value rule needs (see :meth:`MetricTable.resample`); ``mean`` where the bin
    holds nothing the rule looks for."""
    if how in ("max", "min"):
        filled = np.where(valid, v, -np.inf if how == "max" else np.inf)
        ext = (np.maximum if how == "max" else np.minimum).reduceat(filled, starts)
        return np.where(np.isfinite(ext), ext, mean)
    if how == "eq":
        hit = np.add.reduceat((valid & (v == c)).astype(np.int64), starts) > 0
        return np.where(hit, c, mean)
    # "ne": the bin's last sample that differs from c
    idx = np.where(valid & (v != c), np.arange(len(v)), -1)
    np.maximum.accumulate(idx, out=idx)
    last = idx[ends - 1]
    return np.where(last >= starts, v[np.maximum(last, 0)], mean)


@dataclass
class MetricTable:
    """Samples of many nodes.

    Attributes:
        columns: metric column names, in file order.
        ts: timestamps, seconds, shape (n,).
        node: node names, shape (n,), dtype object.
        values: shape (n, len(columns)), float64, NaN where missing.
        job: job names, shape (n,), or None (all nodes are one job).
        text_columns: non-numeric columns :meth:`from_csv` left out (not among ``columns``).
        ts_text: each row's timestamp cell as the file wrote it (:meth:`from_csv` only; None for a table made
            otherwise, e.g. resampled), so that output rows can carry the input's own time and join back to it.
    """

    columns: list[str]
    ts: np.ndarray
    node: np.ndarray
    values: np.ndarray
    job: np.ndarray | None = None
    text_columns: list[str] = field(default_factory=list)
    ts_text: list[str] | None = None

    def __post_init__(self) -> None:
        self.ts = np.asarray(self.ts, dtype=np.float64)
        self.node = np.asarray(self.node, dtype=object)
        self.values = np.asarray(self.values, dtype=np.float64).reshape(len(self.ts), len(self.columns))
        self.validate()

    def validate(self, source: str = "metrics", check_order: bool = True, lines: Sequence[int] | None = None) -> None:
        """Checks shapes, finiteness of timestamps and per-node strictly increasing time.

        Args:
            source: name used in error messages (a file path).
            check_order: also check that each node's timestamps strictly increase (False for a table that is
                only resampled, which sorts and merges, or whose columns are only classified).
            lines: the file line of each row, for messages as ``source:LINE`` (default: the row's number).

        Raises:
            DataFormatError: on the first problem found.
        """
        if len(set(self.columns)) != len(self.columns):
            dup = sorted({c for c in self.columns if self.columns.count(c) > 1})
            raise DataFormatError(f"{source}: duplicate metric columns {dup}; give each column a unique name")
        bad = [c for c in self.columns if c in RESERVED_COLUMNS]
        if bad:
            raise DataFormatError(f"{source}: {bad} are reserved column names and cannot be metrics")
        if len(self.node) != len(self.ts):
            raise DataFormatError(f"{source}: {len(self.ts)} timestamps but {len(self.node)} node names")
        if not np.all(np.isfinite(self.ts)):
            raise DataFormatError(f"{source}: a timestamp is NaN or infinite; every row needs a finite timestamp")
        if np.isinf(self.values).any():
            raise DataFormatError(f"{source}: a metric value is infinite; use NaN (an empty cell) for missing values")
        if len(self.ts) == 0 or not check_order:
            return
        order = np.lexsort((np.arange(len(self.ts)), self.node.astype(str)))
        n_sorted, t_sorted = self.node[order], self.ts[order]
        same = n_sorted[1:] == n_sorted[:-1]
        back = same & (np.diff(t_sorted) <= 0)
        if back.any():
            i = int(np.argmax(back))
            row, prev = int(order[i + 1]), int(order[i])
            where, before = ((f"{source}:{lines[row]}", f"line {lines[prev]}") if lines is not None
                             else (f"{source}: row {row + 1}", f"row {prev + 1}"))
            raise DataFormatError(
                f"{where}: node {str(n_sorted[i])!r} has timestamp {format_timestamp(t_sorted[i + 1])}, not after its "
                f"previous {format_timestamp(t_sorted[i])} ({before}); timestamps of each node must strictly increase: sort "
                "the rows and drop repeats, or pass --resample SECONDS, which sorts them and merges a bin's samples"
            )

    @property
    def nodes(self) -> list[str]:
        """Node names, sorted."""
        return sorted({str(n) for n in self.node})

    def per_node(self) -> Iterator[NodeSeries]:
        """Yields each node's series, nodes in sorted order, rows in time order."""
        if len(self.ts) == 0:
            return
        keys = self.node.astype(str)
        order = np.lexsort((self.ts, keys))
        keys_sorted = keys[order]
        starts = np.flatnonzero(np.r_[True, keys_sorted[1:] != keys_sorted[:-1]])
        ends = np.r_[starts[1:], len(order)]
        for s, e in zip(starts, ends):
            idx = order[s:e]
            job = "" if self.job is None else str(self.job[idx[0]])
            yield NodeSeries(str(keys_sorted[s]), job, self.ts[idx], self.values[idx])

    def select_rows(self, mask: np.ndarray) -> "MetricTable":
        """Returns the rows where ``mask`` is true (same columns)."""
        return MetricTable(
            list(self.columns), self.ts[mask], self.node[mask], self.values[mask],
            None if self.job is None else self.job[mask],
        )

    @property
    def node_days(self) -> float:
        """Observed node-days: per node, the covered time span plus one interval, summed."""
        total = 0.0
        for s in self.per_node():
            step = float(np.median(np.diff(s.ts))) if len(s.ts) > 1 else 0.0
            total += float(s.ts[-1] - s.ts[0]) + step
        return total / 86400.0

    def column_steps(self) -> dict[str, np.ndarray]:
        """Per column, the differences between consecutive values of each node (nodes concatenated; missing
        cells skipped): the evidence :func:`~.catalog.classify_columns` reads counters, and columns without
        values, from. Taken row to row, a metric exported every other interval (a cell, a gap, a cell) had no
        step at all and was left out as holding no values."""
        parts: list[list[np.ndarray]] = [[] for _ in self.columns]
        for s in self.per_node():
            present = ~np.isnan(s.values)
            for i in range(len(self.columns)):
                v = s.values[present[:, i], i]
                if len(v) > 1:
                    parts[i].append(np.diff(v))
        return {c: np.concatenate(p) if p else np.zeros(0) for c, p in zip(self.columns, parts)}

    def duplicate_rows(self) -> int:
        """Rows whose node already has a row at the same timestamp (what :meth:`resample` merges)."""
        if len(self.ts) == 0:
            return 0
        keys = np.rec.fromarrays([self.node.astype(str), self.ts])
        return int(len(keys) - len(np.unique(keys)))

    def median_interval(self) -> float | None:
        """Median spacing between consecutive samples of a node, seconds (None with fewer than two samples)."""
        gaps = [np.diff(s.ts) for s in self.per_node() if len(s.ts) > 1]
        return float(np.median(np.concatenate(gaps))) if gaps else None

    def resample(self, interval_s: float, counters: set[str] | frozenset[str] = frozenset(),
                 keep: Mapping[str, tuple[str, float | None]] | None = None) -> "MetricTable":
        """Brings every node onto a regular grid of ``interval_s`` seconds.

        A bin ``[k*i, (k+1)*i)`` becomes one row stamped at its end ``(k+1)*i`` (the time its values are all
        known, so no row looks into its future). Gauges take the mean of the bin's values, counters (and any
        column in ``counters``) the last value; a bin with no sample of a node has no row (a gap stays a gap);
        a cell missing in every sample of a bin stays missing. Rows need not be in order: each node is sorted
        by time first (stable, so of two samples with the same timestamp the later row counts as the later
        one), and samples sharing a timestamp are merged into their bin like any other two samples.

        A column in ``keep`` is merged so that a value rule reading it still sees what it looks for in the bin
        (a mean hid a 2-minute ``nic_up == 0`` in a 5-minute bin as 0.6, and the fatal rule never fired):
        ``("max", None)`` / ``("min", None)`` the bin's extreme, ``("eq", c)`` ``c`` when a sample equals it,
        ``("ne", c)`` the last sample that differs from ``c``; otherwise the mean.

        Args:
            interval_s: grid spacing, seconds (> 0).
            counters: columns to treat as counters (last value).
            keep: columns a value rule reads, and how to merge them (see :meth:`RulesTier.bin_aggregates`).

        Returns:
            A new table.

        Raises:
            DataFormatError: ``interval_s`` is not positive.
        """
        if not interval_s > 0:
            raise DataFormatError(f"--resample {interval_s!r}: the interval must be a positive number of seconds")
        is_counter = np.array([c in counters for c in self.columns], dtype=bool)
        kept = [(j, keep[c]) for j, c in enumerate(self.columns)
                if keep and c in keep and c not in counters and keep[c][0] != "last"]
        ts_out: list[np.ndarray] = []
        node_out: list[np.ndarray] = []
        job_out: list[np.ndarray] = []
        val_out: list[np.ndarray] = []
        for s in self.per_node():
            b = np.floor(s.ts / interval_s).astype(np.int64)
            starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
            ends = np.r_[starts[1:], len(b)]
            v = s.values
            valid = ~np.isnan(v)
            sums = np.add.reduceat(np.where(valid, v, 0.0), starts, axis=0) if len(b) else v[:0]
            counts = np.add.reduceat(valid.astype(np.float64), starts, axis=0) if len(b) else v[:0]
            with np.errstate(invalid="ignore", divide="ignore"):
                mean = sums / counts
            # last valid value in each bin: forward-fill inside the node, then take the bin's last row, and blank
            # bins that had no valid value of their own
            idx = np.where(valid, np.arange(len(b))[:, None], -1)
            np.maximum.accumulate(idx, axis=0, out=idx)
            last_idx = idx[ends - 1]
            own = last_idx >= starts[:, None]
            last = np.where(own, v[np.maximum(last_idx, 0), np.arange(v.shape[1])[None, :]], np.nan)
            out = np.where(is_counter[None, :], last, mean)
            for j, (how, c) in kept:
                out[:, j] = _bin_keep(v[:, j], valid[:, j], starts, ends, out[:, j], how, c)
            ts_out.append((b[starts] + 1).astype(np.float64) * interval_s)
            node_out.append(np.full(len(starts), s.node, dtype=object))
            job_out.append(np.full(len(starts), s.job, dtype=object))
            val_out.append(out)
        if not ts_out:
            return self.select_rows(np.zeros(len(self.ts), dtype=bool))
        return MetricTable(
            list(self.columns), np.concatenate(ts_out), np.concatenate(node_out), np.vstack(val_out),
            None if self.job is None else np.concatenate(job_out),
        )

    @classmethod
    def from_csv(cls, path: str | Path, check_order: bool = True, ignore_text: bool = False,
                 used: Callable[[str], bool] | None = None) -> "MetricTable":
        """Reads a metrics CSV file.

        A cell that is not a number is refused, except with ``ignore_text``: then its column is left out (named
        in ``text_columns``) when it is not ``used``, or, with ``used`` None, when none of its cells is a number
        (a text column such as a status); a bad cell in any other column is still refused.

        Args:
            path: file path.
            check_order: refuse a node whose timestamps do not strictly increase (default). False only for a
                table that is resampled next (:meth:`resample` sorts each node and merges samples of one bin)
                or whose columns are only classified.
            ignore_text: leave non-numeric columns out instead of refusing them (default False).
            used: with ``ignore_text``, whether the caller reads a metric column (a model's, the rules'); None
                when it cannot know yet (training).

        Returns:
            The validated table.

        Raises:
            DataFormatError: unreadable file, missing ``timestamp``/``node`` columns, bad cell, time going back.
        """
        path = Path(path)
        try:
            # utf-8-sig: a spreadsheet's byte-order mark is not part of the first column's name
            with path.open(newline="", encoding="utf-8-sig") as fh:
                # skipinitialspace: in 'timestamp, "node"' the quotes after the space were kept as part of the
                # name ('"node"'), and the file was refused for lacking a node column its header shows
                reader = csv.reader(fh, skipinitialspace=True)
                header = next(reader, None)
                if header is None:
                    raise DataFormatError(f"{path}: file is empty; expected a header 'timestamp,node,<metrics...>'")
                header = [h.strip() for h in header]
                missing = [c for c in ("timestamp", "node") if c not in header]
                if missing:
                    raise DataFormatError(
                        f"{path}: missing column(s) {missing}; the header must start 'timestamp,node,<metrics...>'"
                        f"{_header_hint(header, missing)}"
                    )
                _refuse_repeated(path, header, ("timestamp", "node", "job"))
                i_ts, i_node = header.index("timestamp"), header.index("node")
                i_job = header.index("job") if "job" in header else None
                metric_idx = [i for i, h in enumerate(header) if h not in RESERVED_COLUMNS]
                columns = [header[i] for i in metric_idx]
                ts: list[float] = []
                ts_text: list[str] = []
                nodes: list[str] = []
                jobs: list[str] = []
                rows: list[list[float]] = []
                lines: list[int] = []
                bad: dict[int, tuple[int, DataFormatError]] = {}  # column -> first non-numeric cell
                numeric = [False] * len(metric_idx)
                for line_no, row in enumerate(reader, start=2):
                    if not row:
                        continue
                    lines.append(line_no)
                    if len(row) != len(header):
                        raise DataFormatError(f"{path}:{line_no}: {len(row)} cells but the header has {len(header)}")
                    where = f"{path}:{line_no}"
                    ts.append(_parse_time(row[i_ts], where))
                    ts_text.append(row[i_ts].strip())
                    if not row[i_node].strip():
                        raise DataFormatError(f"{where}: empty node name; every row needs its node")
                    nodes.append(row[i_node].strip())
                    if i_job is not None:
                        jobs.append(row[i_job].strip())
                    cells: list[float] = []
                    for k, i in enumerate(metric_idx):
                        try:
                            v = _parse_value(row[i], f"{where} column {header[i]!r}")
                        except DataFormatError as exc:
                            bad.setdefault(k, (line_no, exc))
                            v = math.nan
                        numeric[k] = numeric[k] or v == v
                        cells.append(v)
                    rows.append(cells)
        except OSError as exc:
            raise DataFormatError(f"{path}: cannot read metrics file ({exc.strerror}); check the path") from exc
        except UnicodeDecodeError as exc:
            raise DataFormatError(_not_utf8(path, exc)) from exc
        if not ts:
            raise DataFormatError(f"{path}: no data rows after the header; give at least a row per node and interval")
        _check_seconds(path, ts, lines)
        _check_serial_days(path, ts)
        # pandas reads a column without a name as 'Unnamed: N' and writes it back under that name: the same row
        # index one round trip later
        unnamed = [k for k, c in enumerate(columns) if not c or _PANDAS_UNNAMED.fullmatch(c)]
        for k in unnamed:
            # a row index (pandas' to_csv without index=False, a spreadsheet's first column) was taken as a metric
            # named '' (an increasing counter), which every file scored later had to have too
            if numeric[k] or k in bad:
                named = f" is {columns[k]!r}, pandas' name for a column without one," if columns[k] else " has no name"
                raise DataFormatError(
                    f"{path}:1: column {metric_idx[k] + 1} of the header{named} but holds values (a row index?); "
                    "name it, or leave it out (pandas: to_csv(..., index=False))")
        refused = [bad[k] for k in bad
                   if not ignore_text or (used(columns[k]) if used is not None else numeric[k])]
        if refused:
            raise min(refused, key=lambda b: b[0])[1]
        # an unnamed column left here holds no value (a trailing comma on every line): left out
        keep = [k for k in range(len(columns)) if k not in bad and k not in unnamed]
        values = np.array(rows, dtype=np.float64).reshape(len(rows), len(columns))[:, keep]
        table = cls.__new__(cls)
        table.columns, table.ts, table.node, table.values = ([columns[k] for k in keep], np.array(ts),
                                                             np.array(nodes, dtype=object), values)
        table.job = np.array(jobs, dtype=object) if i_job is not None else None
        table.text_columns = [columns[k] for k in sorted(bad)]
        table.ts_text = ts_text
        table.validate(str(path), check_order, lines)
        return table

    def to_csv(self, path: str | Path) -> None:
        """Writes the table in the interchange format (rows in time order, NaN as an empty cell).

        Args:
            path: destination file (overwritten).
        """
        order = np.lexsort((self.node.astype(str), self.ts))
        with Path(path).open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["timestamp", "node"] + (["job"] if self.job is not None else []) + self.columns)
            for i in order:
                cells = ["" if math.isnan(v) else repr(float(v)) for v in self.values[i]]
                head = [repr(float(self.ts[i])), str(self.node[i])]
                if self.job is not None:
                    head.append(str(self.job[i]))
                w.writerow(head + cells)


@dataclass
class EventTable:
    """Observed hard failures.

    Attributes:
        ts: failure times, seconds.
        node: node names.
        kind: failure kinds (free text).
    """

    ts: np.ndarray
    node: np.ndarray
    kind: np.ndarray

    def __post_init__(self) -> None:
        self.ts = np.asarray(self.ts, dtype=np.float64)
        self.node = np.asarray(self.node, dtype=object)
        self.kind = np.asarray(self.kind, dtype=object)
        if not (len(self.ts) == len(self.node) == len(self.kind)):
            raise DataFormatError("events: timestamp, node and kind columns differ in length")
        if not np.all(np.isfinite(self.ts)):
            raise DataFormatError("events: a timestamp is NaN or infinite; every event needs a finite time")
        # An empty kind was written out as '1700000000.0,n1,' (an export, a generated trace): the failure's cause
        # lost without a word, and a spreadsheet's blank cell for whoever reads the labels.
        blank = [i for i, k in enumerate(self.kind.tolist()) if not isinstance(k, str) or not k.strip()]
        if blank:
            i = blank[0]
            raise DataFormatError(f"events: {len(blank)} event(s) without a kind, e.g. node {self.node[i]!r} at "
                                  f"{self.ts[i]!r}; every failure needs one (\"unknown\" when the cause is not known)")

    @classmethod
    def empty(cls) -> "EventTable":
        """An events table with no rows."""
        return cls(np.zeros(0), np.zeros(0, dtype=object), np.zeros(0, dtype=object))

    def __len__(self) -> int:
        return len(self.ts)

    def unique(self) -> tuple["EventTable", int]:
        """The events without rows that repeat an earlier one's node and time (one failure logged twice, e.g. by two
        detectors), and how many were left out."""
        seen: set[tuple[str, float]] = set()
        keep = np.zeros(len(self.ts), dtype=bool)
        for i, key in enumerate(zip(self.node.astype(str).tolist(), self.ts.tolist())):
            keep[i] = key not in seen
            seen.add(key)
        return EventTable(self.ts[keep], self.node[keep], self.kind[keep]), int((~keep).sum())

    def for_node(self, node: str) -> np.ndarray:
        """Failure times of one node, sorted."""
        return np.sort(self.ts[self.node.astype(str) == node]) if len(self.ts) else np.zeros(0)

    @classmethod
    def from_csv(cls, path: str | Path) -> "EventTable":
        """Reads an events CSV file (``timestamp,node,kind``).

        Raises:
            DataFormatError: unreadable file, missing column, bad timestamp.
        """
        path = Path(path)
        try:
            with path.open(newline="", encoding="utf-8-sig") as fh:
                reader = csv.reader(fh, skipinitialspace=True)  # as in a metrics file
                header = [h.strip() for h in (next(reader, None) or [])]
                missing = [c for c in ("timestamp", "node", "kind") if c not in header]
                if missing:
                    raise DataFormatError(f"{path}: missing column(s) {missing}; the header must be "
                                          f"'timestamp,node,kind'{_header_hint(header, missing)}")
                _refuse_repeated(path, header, ("timestamp", "node", "kind"))
                it, inode, ikind = header.index("timestamp"), header.index("node"), header.index("kind")
                ts, nodes, kinds = [], [], []
                lines: list[int] = []
                for line_no, row in enumerate(reader, start=2):
                    if not row:
                        continue
                    lines.append(line_no)
                    if len(row) != len(header):
                        raise DataFormatError(f"{path}:{line_no}: {len(row)} cells but the header has {len(header)}")
                    ts.append(_parse_time(row[it], f"{path}:{line_no}"))
                    if not row[inode].strip():  # as in a metrics file: it matched no node and was never counted
                        raise DataFormatError(f"{path}:{line_no}: empty node name; every event needs the node it "
                                              "happened on")
                    nodes.append(row[inode].strip())
                    if not row[ikind].strip():  # as the node: the table refuses a blank kind, said with its line here
                        raise DataFormatError(f"{path}:{line_no}: empty kind; name the failure (\"unknown\" when the "
                                              "cause is not known)")
                    kinds.append(row[ikind].strip())
        except OSError as exc:
            raise DataFormatError(f"{path}: cannot read events file ({exc.strerror}); check the path") from exc
        except UnicodeDecodeError as exc:
            raise DataFormatError(_not_utf8(path, exc)) from exc
        _check_seconds(path, ts, lines)
        return cls(np.array(ts), np.array(nodes, dtype=object), np.array(kinds, dtype=object))

    def to_csv(self, path: str | Path) -> None:
        """Writes the events in time order."""
        order = np.argsort(self.ts, kind="stable")
        with Path(path).open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["timestamp", "node", "kind"])
            for i in order:
                w.writerow([repr(float(self.ts[i])), str(self.node[i]), str(self.kind[i])])


def concat_tables(tables: Sequence[MetricTable]) -> MetricTable:
    """Stacks tables with identical columns.

    Raises:
        DataFormatError: the tables' columns differ.
    """
    cols = tables[0].columns
    for t in tables[1:]:
        if t.columns != cols:
            raise DataFormatError("cannot stack metric tables with different columns; align the columns first")
    jobs = None if any(t.job is None for t in tables) else np.concatenate([t.job for t in tables])
    return MetricTable(
        list(cols), np.concatenate([t.ts for t in tables]), np.concatenate([t.node for t in tables]),
        np.concatenate([t.values for t in tables]), jobs,
    )


#: How pandas names a column whose header cell is empty (``Unnamed: 0`` for a row index written without a name).
_PANDAS_UNNAMED = re.compile(r"Unnamed: \d+")

#: Unix seconds beyond this (the year 5138) are taken for a finer unit: no recorded data lies there, while
#: milliseconds since the epoch (1.7e12 in 2024) and microseconds (1.7e15) always do.
_MAX_SECONDS = 1e11


def _check_seconds(path: Path, ts: list[float], lines: list[int] | None = None) -> None:
    """Refuses timestamps that are epoch milliseconds, microseconds or nanoseconds, naming the conversion
    (read as seconds they would be thousands of years ahead, and the interval 1000x too long).

    When most of the file's times are Unix seconds and only some rows lie far beyond them (a garbage row, or
    rows written in another unit), the first such row is named instead: converting the whole file would break
    the good rows. ``lines`` are the file's line numbers of ``ts`` (1-based, the header is line 1).
    """
    finite = [t for t in ts if math.isfinite(t)]
    big = max(finite, default=0.0)
    if big <= _MAX_SECONDS:
        return
    if float(np.median(finite)) <= _MAX_SECONDS:
        k = next(i for i, t in enumerate(ts) if math.isfinite(t) and t > _MAX_SECONDS)
        where = f"{path}:{lines[k]}" if lines is not None else f"{path} (data row {k + 1})"
        raise DataFormatError(
            f"{where}: timestamp {ts[k]:.0f} lies in the year {1970 + ts[k] / 31_557_600:.0f} while most rows are "
            "Unix seconds; fix or drop that row (rows in milliseconds or finer: convert them to seconds)"
        )
    units = (("milliseconds", 1_000), ("microseconds", 1_000_000), ("nanoseconds", 1_000_000_000))
    found = next(((u, f) for u, f in units if big / f <= _MAX_SECONDS), None)
    if found is None:
        raise DataFormatError(
            f"{path}: timestamps such as {big:.0f} are not Unix times in seconds, nor in milliseconds, microseconds "
            "or nanoseconds; write Unix seconds or ISO 8601 dates"
        )
    unit, factor = found
    raise DataFormatError(
        f"{path}: timestamps look like {unit} since the epoch ({big:.0f} would be the year "
        f"{1970 + big / 31_557_600:.0f} in seconds); divide them by {factor} (the format takes Unix seconds)"
    )


#: Spreadsheet serial dates (days since 1899-12-30) of the years 1954-2173. Read as Unix seconds they all fall on
#: 1970-01-01/02, where no recorded telemetry lies.
_SERIAL_DAYS = (20_000.0, 100_000.0)
#: Unix days of the spreadsheet epoch 1899-12-30.
_SERIAL_EPOCH_DAYS = 25_569


def _check_serial_days(path: Path, ts: list[float]) -> None:
    """Refuses metrics timestamps that are spreadsheet serial dates (a date column saved as a number), naming the
    conversion: read as seconds, a minute apart was 0.0007 s apart, ``train`` fitted a model at that interval on
    "0.0 node-days" and ``score`` advised ``--resample 60``, which would merge each day into one row.

    Only when every time lies in the serial range and the times are at most a day (1.0) apart: Unix seconds of
    the first day of 1970 at one sample a second or faster are no real telemetry either.

    Raises:
        DataFormatError: naming the conversion to Unix seconds.
    """
    lo, hi = _SERIAL_DAYS
    if not ts or not all(lo <= t < hi for t in ts):
        return
    distinct = np.unique(np.asarray(ts, dtype=np.float64))
    if len(distinct) < 2 or float(np.median(np.diff(distinct))) > 1.0:
        return
    first = datetime.fromtimestamp((distinct[0] - _SERIAL_EPOCH_DAYS) * 86400.0, timezone.utc)
    raise DataFormatError(
        f"{path}: timestamps look like spreadsheet serial dates (days since 1899-12-30: {distinct[0]:g} is "
        f"{first:%Y-%m-%d %H:%M} UTC), not Unix seconds; save the time column as ISO 8601 dates, or convert: "
        f"(value - {_SERIAL_EPOCH_DAYS}) * 86400"
    )


def _refuse_repeated(path: Path, header: list[str], names: Sequence[str]) -> None:
    """Refuses a header naming one of the columns read by name twice (two exports joined side by side): the first
    was read and the second ignored, whatever it held.

    Raises:
        DataFormatError: naming the column and where it appears.
    """
    for name in names:
        at = [i + 1 for i, h in enumerate(header) if h == name]
        if len(at) > 1:
            raise DataFormatError(f"{path}:1: column {name!r} appears {len(at)} times in the header (columns "
                                  f"{', '.join(map(str, at))}); keep one, or rename the others")


def _header_hint(header: list[str], missing: list[str]) -> str:
    """The end of a missing-column message for a header that visibly has the columns: one cell holding another
    separator (a spreadsheet saved with ';' in a locale whose decimal mark is ',', or tabs), or the names in
    other case (CloudWatch's 'Timestamp')."""
    if len(header) == 1:
        for sep, what in ((";", "semicolons"), ("\t", "tabs"), ("|", "'|'")):
            if sep in header[0]:
                return f" (its columns are separated by {what}, not commas: save it as comma-separated CSV)"
    other = [h for h in header if h.lower() in missing]
    if other:
        return (f" (the header has {', '.join(map(repr, other))}: column names are case-sensitive, rename "
                f"{'it' if len(other) == 1 else 'them'} in lower case)")
    return ""


def _not_utf8(path: Path, exc: UnicodeDecodeError) -> str:
    """The message for a file that is not UTF-8, naming the line and column of the first bad byte (the decoder's
    own offset is within a read buffer, so the file is read again as bytes to find it)."""
    where, byte = str(path), exc.object[exc.start]
    try:
        with path.open("rb") as fh:
            lines = fh.read().split(b"\n")
    except OSError:
        lines = []
    for line_no, raw in enumerate(lines, start=1):
        try:
            raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
        except UnicodeDecodeError as bad:
            byte = raw[bad.start]
            where = f"{path}:{line_no}"
            try:  # the column too, where the header and the line parse (not in a binary file)
                header = next(csv.reader([lines[0].decode("utf-8-sig", "replace").rstrip("\r")]), [])
                cells = next(csv.reader([raw.decode("utf-8", "replace").rstrip("\r")]), [])
            except csv.Error:
                header = cells = []
            col = next((i for i, c in enumerate(cells) if "\ufffd" in c), None)
            if col is not None and line_no > 1 and col < len(header):
                where += f" column {header[col].strip()!r}"
            break
    return (f"{where}: not UTF-8 text (byte 0x{byte:02x} cannot be decoded; a binary file, or text in "
            "another encoding such as Latin-1?); save it as a UTF-8 CSV")


def format_timestamp(t: float) -> str:
    """A timestamp for an error message: seconds as written (no numpy repr) and the UTC time they mean."""
    import datetime

    t = float(t)
    try:
        when = datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):
        return f"{t:.3f}"
    return f"{t:.3f} ({when})"


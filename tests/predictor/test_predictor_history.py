"""Metric history store: real SQLite files, schema changes, ordering, retention by age and by size, export."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest

from trainguard.predictor.errors import DataFormatError, HistoryError
from trainguard.predictor.history import MetricHistory
from trainguard.predictor.table import EventTable, MetricTable


def test_append_export_round_trip_with_changing_metrics(tmp_path):
    db = tmp_path / "h.sqlite"
    with MetricHistory(db) as h:
        h.append(0.0, "n1", {"gpu_temp_c": 60.0, "step_time_s": 1.0})
        h.append(0.0, "n2", {"gpu_temp_c": 61.0, "step_time_s": 1.1})
        h.append(5.0, "n1", {"gpu_temp_c": 62.0, "step_time_s": 1.0, "nic_up": 1.0})  # a detector was added
        h.append(5.0, "n2", {"gpu_temp_c": float("nan"), "step_time_s": 1.2})
        h.record_event(7.0, "n2", "GPU Lost")
        n, e = h.export(tmp_path / "m.csv", tmp_path / "e.csv")
    assert (n, e) == (4, 1)
    m = MetricTable.from_csv(tmp_path / "m.csv")
    assert m.columns == ["gpu_temp_c", "nic_up", "step_time_s"]
    series = {s.node: s for s in m.per_node()}
    assert series["n1"].values[1].tolist() == [62.0, 1.0, 1.0]
    assert math.isnan(series["n1"].values[0, 1]) and math.isnan(series["n2"].values[1, 0])
    ev = EventTable.from_csv(tmp_path / "e.csv")
    assert list(ev.node) == ["n2"] and list(ev.kind) == ["GPU Lost"]


def test_order_is_enforced_across_reopen(tmp_path):
    db = tmp_path / "h.sqlite"
    with MetricHistory(db) as h:
        h.append(10.0, "n", {"a": 1.0})
        with pytest.raises(HistoryError, match="not after"):
            h.append(10.0, "n", {"a": 2.0})
        with pytest.raises(HistoryError, match="not a number"):
            h.append(11.0, "n", {"a": "x"})  # type: ignore[dict-item]
    with MetricHistory(db) as h:
        with pytest.raises(HistoryError, match="not after"):
            h.append(9.0, "n", {"a": 1.0})
        h.append(11.0, "n", {"a": 1.0})
        assert h.count() == 2


def test_retention_by_age(tmp_path):
    with MetricHistory(tmp_path / "h.sqlite", retention_s=100.0, prune_every=10) as h:
        for i in range(60):
            h.append(float(i * 5), "n", {"a": float(i)})
        h.record_event(1.0, "n", "old")
        h.prune()
        metrics, events = h.to_tables()
    assert metrics.ts.min() >= 295 - 100 and len(events) == 0


def test_retention_by_size_bounds_the_file(tmp_path):
    names = [f"metric_{k}" for k in range(40)]
    with MetricHistory(tmp_path / "h.sqlite", max_bytes=200_000, prune_every=200) as h:
        for i in range(3000):
            h.append(float(i), "node-a", {n: float(i + k) for k, n in enumerate(names)})
        h.prune()
        live = h.live_bytes()
        kept = h.count()
        metrics, _ = h.to_tables()
    assert live <= 200_000
    assert 0 < kept < 3000
    assert metrics.ts.max() == 2999.0  # the newest data is the data kept
    assert (tmp_path / "h.sqlite").stat().st_size < 600_000


def test_not_a_database(tmp_path):
    p = tmp_path / "junk.sqlite"
    p.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(HistoryError, match="cannot open"):
        MetricHistory(p)


def test_a_folder_that_cannot_be_created_is_a_history_error(tmp_path):
    # `trainguard run --metric-history afile/h.sqlite` (a file where the folder goes) ended in a FileExistsError
    # traceback instead of the one-line error the CLI prints for a HistoryError.
    (tmp_path / "afile").write_text("")
    with pytest.raises(HistoryError, match="afile.*writable folder"):
        MetricHistory(tmp_path / "afile" / "h.sqlite")


def test_a_history_shared_by_two_stores_keeps_both_writers(tmp_path):
    # Two runs on one --metric-history file: the second writer's cached tables missed the node and schema the
    # first had added, its INSERT failed their UNIQUE constraint, and every one of its samples and events was
    # lost ("cannot store sample ...; check disk space"); the first's export missed the second's rows.
    path = tmp_path / "h.sqlite"
    first, second = MetricHistory(path), MetricHistory(path)
    first.append(1.0, "vm", {"a": 1.0})
    second.append(2.0, "vm", {"a": 2.0})
    second.append(3.0, "vm", {"b": 3.0})
    second.record_event(3.5, "vm", "GPU Lost")
    first.append(4.0, "vm", {"b": 4.0})
    metrics, events = first.to_tables()
    assert metrics.columns == ["a", "b"] and list(metrics.ts) == [1.0, 2.0, 3.0, 4.0]
    # both live: the second writer's rows are kept apart under a node of its own (see the next test)
    assert list(metrics.node) == ["vm", "vm#2", "vm#2", "vm"] and list(events.kind) == ["GPU Lost"]
    first.close()
    second.close()


def test_two_live_writers_of_one_node_are_kept_apart_and_named(tmp_path, caplog):
    # Two runs on one host with the same node id (the hostname) and one history file interleaved their samples
    # under one node: the export showed one node sampled twice as often, in silence, and its series (gaps,
    # baselines, the failure labels) mixed two runs. The second live writer now stores under a node of its own.
    path = tmp_path / "h.sqlite"
    first = MetricHistory(path)
    first.append(1.0, "vm", {"a": 1.0})
    second = MetricHistory(path)
    with caplog.at_level("WARNING", logger="trainguard.predictor.history"):
        second.append(2.0, "vm", {"a": 2.0})
        second.record_event(2.5, "vm", "GPU Lost")
        second.append(3.0, "vm", {"a": 3.0})
    first.append(4.0, "vm", {"a": 4.0})
    metrics, events = first.to_tables()
    assert list(metrics.node) == ["vm", "vm#2", "vm#2", "vm"], metrics.node
    assert list(events.node) == ["vm#2"]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "'vm'" in warned[0] and str(path) in warned[0] and "vm#2" in warned[0], warned
    assert "--metric-history" in warned[0] and "--node-id" in warned[0]
    second.close()
    # a writer that is gone (closed, or its process dead) does not keep its node: the next run writes under it
    caplog.clear()
    third = MetricHistory(path)
    first.close()
    with caplog.at_level("WARNING", logger="trainguard.predictor.history"):
        third.append(5.0, "vm", {"a": 5.0})
    assert not caplog.records and list(third.to_tables()[0].node)[-1] == "vm"
    del third  # dropped without close(), in this live process: its claim goes with it
    gc.collect()
    with caplog.at_level("WARNING", logger="trainguard.predictor.history"), MetricHistory(path) as fourth:
        fourth.append(6.0, "vm", {"a": 6.0})
        assert list(fourth.to_tables()[0].node)[-1] == "vm"
    assert not caplog.records


def test_a_killed_writers_node_is_taken_over_in_silence(tmp_path, caplog):
    # An agent restarted after kill -9 left its claim on the node in the file; the new run must write on under
    # the same node, not be taken for a second live writer.
    import subprocess
    import sys

    path = tmp_path / "h.sqlite"
    code = (f"from trainguard.predictor.history import MetricHistory; h = MetricHistory({str(path)!r}); "
            "h.append(1.0, 'vm', {'a': 1.0}); import os; os._exit(0)")
    subprocess.run([sys.executable, "-c", code], check=True)
    with caplog.at_level("WARNING", logger="trainguard.predictor.history"), MetricHistory(path) as h:
        h.append(2.0, "vm", {"a": 2.0})
        assert list(h.to_tables()[0].node) == ["vm", "vm"]
    assert not caplog.records


def test_no_event_is_exported_without_a_kind(tmp_path):
    """An empty kind was stored and exported as '7.0,n,': a failure row whose cause is a blank cell. The store
    refuses it, the events table refuses it (so no writer of the CSV can produce one), the online monitor names
    it "unknown" (a failure is still a label), and a kind stored empty before is exported as "unknown"."""
    from trainguard.predictor.online_feed import PredictorMonitor
    from trainguard.predictor.runtime import PredictorRuntime

    db = tmp_path / "h.sqlite"
    with MetricHistory(db) as h:
        for kind in ("", "  ", None):
            with pytest.raises(HistoryError, match="empty"):
                h.record_event(7.0, "n", kind)
        mon = PredictorMonitor(PredictorRuntime.load(None), "m", history=h)
        mon.record_failure(8.0, "")
        assert not mon.problems
        h.record_event(9.0, "n", "GPU Lost")
        h._db.execute("UPDATE events SET kind = '' WHERE ts = 9.0")  # as a version before the check stored it
        assert h.export(tmp_path / "m.csv", tmp_path / "e.csv") == (0, 2)
    assert (tmp_path / "e.csv").read_text().splitlines()[1:] == ["8.0,m,unknown", "9.0,n,unknown"]
    with pytest.raises(DataFormatError, match="without a kind"):
        EventTable(np.array([1.0]), np.array(["n"], dtype=object), np.array([""], dtype=object))
    (tmp_path / "e.csv").write_text("timestamp,node,kind\n1.0,n,GPU Lost\n2.0,n, \n")
    with pytest.raises(DataFormatError, match="e.csv:3: empty kind"):
        EventTable.from_csv(tmp_path / "e.csv")

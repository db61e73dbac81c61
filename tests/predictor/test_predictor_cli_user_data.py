"""Regression tests of a new user's review of the CLI with their own telemetry (NAB-style files: timestamps as
``2014-02-14 14:30:00``, ISO with ``Z`` or an offset, integer Unix seconds; a history store written through the
API; a file with a byte that is not UTF-8)."""

from __future__ import annotations

import csv
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest

from trainguard.cli import main

T0 = 1_700_000_000


def _formats(t: int, k: int) -> str:
    """Node ``k``'s way of writing Unix second ``t``: the four a user's exports come in."""
    utc = datetime.fromtimestamp(t, timezone.utc)
    if k == 0:
        return utc.strftime("%Y-%m-%d %H:%M:%S")  # NAB's format, no zone (UTC)
    if k == 1:
        return utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    if k == 2:
        return utc.astimezone(timezone(timedelta(hours=2))).isoformat()  # 2023-11-14T23:13:20+02:00
    return str(t)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Four nodes of one gauge at 60 s, each node's timestamps written in another format, and a model of it."""
    d = tmp_path_factory.mktemp("userdata")
    rng = np.random.default_rng(0)
    metrics = d / "m.csv"
    with metrics.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["timestamp", "node", "cpu"])
        for i in range(300):
            for k in range(4):
                w.writerow([_formats(T0 + 60 * i, k), f"n{k}", round(50 + rng.standard_normal(), 3)])
    model = d / "model.json"
    assert main(["predictor", "train", "--metrics", str(metrics), "--out", str(model), "--method", "robust-z"]) == 0
    return d, metrics, model


def test_score_rows_carry_the_input_timestamp_text_and_join_back(fleet, tmp_path, capsys):
    """The scores were stamped ``1700000000.0`` whatever the input wrote (``2023-11-14 22:13:20``, ``...Z``,
    ``+02:00``, ``1700000000``): no score row joined back to its input row on (timestamp, node) as written,
    against the README's "the written scores keep the file's timestamps"."""
    _, metrics, model = fleet
    out = tmp_path / "s.csv"
    assert main(["predictor", "score", "--model", str(model), "--metrics", str(metrics), "--out", str(out)]) == 0
    with metrics.open() as fh:
        inp = [(r["timestamp"], r["node"]) for r in csv.DictReader(fh)]
    with out.open() as fh:
        got = [(r["timestamp"], r["node"]) for r in csv.DictReader(fh)]
    assert len(got) == len(inp) == 1200
    assert sorted(got) == sorted(inp)
    # resampled rows are bins, not input rows: Unix seconds at the bin's end
    capsys.readouterr()
    assert main(["predictor", "score", "--model", str(model), "--metrics", str(metrics), "--out", str(out),
                 "--resample", "60"]) == 0
    with out.open() as fh:
        assert all(float(r["timestamp"]) % 60 == 0 for r in csv.DictReader(fh))


def test_history_refuses_an_infinite_value_and_still_exports_a_store_holding_one(tmp_path, capsys):
    """``MetricHistory.append`` stored ``inf`` (the API documents NaN for unknown values, and ``observe`` refuses
    inf); from then on ``trainguard predictor export`` of the whole store failed with "metrics: a metric value is
    infinite", naming no node or time. Now append refuses it by name, and a store that already holds one (written
    before) exports every row with that cell empty."""
    import sqlite3

    from trainguard.predictor.errors import HistoryError
    from trainguard.predictor.history import MetricHistory

    path = tmp_path / "h.sqlite"
    with MetricHistory(path) as h:
        for i in range(5):
            h.append(T0 + 60.0 * i, "n0", {"cpu": 1.0 + i, "gpu_xid_79_total": 0.0})
        with pytest.raises(HistoryError, match="'cpu' is infinite"):
            h.append(T0 + 600.0, "n0", {"cpu": float("inf"), "gpu_xid_79_total": 0.0})
        assert h.count() == 5
    # a store written before the refusal: one stored value turned to -inf
    db = sqlite3.connect(path)
    db.execute("UPDATE samples SET vals = ? WHERE ts = ?",
               (np.array([float("-inf"), 0.0], dtype="<f8").tobytes(), T0 + 120.0))
    db.commit()
    db.close()
    out, ev = tmp_path / "m.csv", tmp_path / "e.csv"
    assert main(["predictor", "export", "--history", str(path), "--metrics", str(out), "--events", str(ev)]) == 0
    assert "exported 5 samples" in capsys.readouterr().out
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["cpu"] for r in rows] == ["1.0", "2.0", "", "4.0", "5.0"]


def test_a_byte_that_is_not_utf8_is_named_by_line_and_column(fleet, tmp_path, capsys):
    """A Latin-1 byte on line 1000 of a metrics file (past the decoder's first buffer) and in an events file's
    ``kind``: the error said only "FILE: not UTF-8 text", leaving the user to search the whole file."""
    _, metrics, model = fleet
    bad = tmp_path / "latin.csv"
    lines = metrics.read_bytes().split(b"\n")
    lines[999] = lines[999].rsplit(b",", 1)[0] + b",5\xe90"
    bad.write_bytes(b"\n".join(lines))
    assert main(["predictor", "metrics", "--metrics", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad}:1000 column 'cpu': not UTF-8 text (byte 0xe9" in err and len(err.splitlines()) == 1
    events = tmp_path / "e.csv"
    events.write_bytes(b"timestamp,node,kind\n" + str(T0 + 6000).encode() + b",n0,GPU \xe9 lost\n")
    assert main(["predictor", "eval", "--model", str(model), "--metrics", str(metrics), "--events", str(events)]) == 2
    assert f"{events}:2 column 'kind': not UTF-8" in capsys.readouterr().err


def test_an_output_path_that_is_an_input_is_refused_before_anything_is_written(fleet, tmp_path, capsys):
    """``score --metrics m.csv --out m.csv`` replaced the user's telemetry with its scores, ``train --out`` the
    metrics with the model, ``export`` with one path for ``--metrics`` and ``--events`` kept only the events (and
    reported the samples as exported)."""
    from trainguard.predictor.history import MetricHistory

    _, metrics, model = fleet
    mine = tmp_path / "mine.csv"
    mine.write_bytes(metrics.read_bytes())
    link = tmp_path / "link.csv"
    link.symlink_to(mine)
    before, model_before = mine.read_bytes(), model.read_bytes()
    cases = [
        ["score", "--model", str(model), "--metrics", str(mine), "--out", str(mine)],
        ["score", "--model", str(model), "--metrics", str(mine), "--out", str(link)],
        ["score", "--model", str(model), "--metrics", str(mine), "--out", str(model)],
        ["train", "--metrics", str(mine), "--out", str(mine), "--method", "robust-z"],
    ]
    for args in cases:
        assert main(["predictor", *args]) == 2, args
        err = capsys.readouterr().err.strip()
        assert "--out" in err and "is the same file as" in err and len(err.splitlines()) == 1
    assert mine.read_bytes() == before and model.read_bytes() == model_before
    store = tmp_path / "h.sqlite"
    with MetricHistory(store) as h:
        h.append(float(T0), "n0", {"cpu": 1.0})
    both = tmp_path / "both.csv"
    assert main(["predictor", "export", "--history", str(store), "--metrics", str(both), "--events", str(both)]) == 2
    assert "--events" in capsys.readouterr().err and not both.exists()


def test_train_names_events_it_cannot_use_and_refuses_a_file_of_none(fleet, tmp_path, capsys):
    """``train --events`` took events on nodes absent from the metrics, or years away from them, without a word
    (and a file of only such events trained a model on no failure at all, its summary counting them); ``eval``
    already named them."""
    _, metrics, _ = fleet
    events = tmp_path / "e.csv"
    events.write_text("timestamp,node,kind\n"
                      f"{T0 + 60 * 200},n1,GPU Lost\n"
                      f"{T0 + 60 * 200},n9,GPU Lost\n"
                      "2019-02-20T10:00:00Z,n0,GPU Lost\n")
    model = tmp_path / "m.json"
    args = ["predictor", "train", "--metrics", str(metrics), "--out", str(model), "--method", "robust-z"]
    assert main(args + ["--events", str(events)]) == 0
    err = capsys.readouterr().err
    assert f"{events}: 2 of 3 events not counted as failures: 1 on nodes absent from the metrics, 1 outside" in err
    model.unlink()
    events.write_text("timestamp,node,kind\n2019-02-20T10:00:00Z,n0,GPU Lost\n")
    assert main(args + ["--events", str(events)]) == 2
    err = capsys.readouterr().err
    assert "none of its 1 events falls on a node and time" in err and not model.exists()
    # the file's ISO times were read: the hint named only Unix seconds, as if they had not been
    assert "(timestamps in Unix seconds or ISO 8601; a time without an offset is read as UTC)" in err


def test_an_event_without_a_node_is_refused_by_line(tmp_path):
    """A metrics row with an empty node is refused (FILE:LINE); an event with one was read as node '' and could
    never match a node."""
    from trainguard.predictor.errors import DataFormatError
    from trainguard.predictor.table import EventTable

    events = tmp_path / "e.csv"
    events.write_text(f"timestamp,node,kind\n{T0},n0,GPU Lost\n{T0 + 60}, ,GPU Lost\n")
    with pytest.raises(DataFormatError, match=r"e\.csv:3: empty node name"):
        EventTable.from_csv(events)


def test_an_unnamed_column_with_values_is_refused_and_an_empty_one_left_out(fleet, tmp_path, capsys):
    """pandas' ``to_csv`` writes its row index as a first column with an empty name: ``train`` took it as a
    counter metric named '', and every file scored with that model then had to have a column '' ("the data
    lacks metric(s) ['']"). An unnamed column without values (a trailing comma on every line) stays harmless."""
    from trainguard.predictor.model import PredictorModel

    _, metrics, _ = fleet
    lines = metrics.read_text().splitlines()
    indexed = tmp_path / "indexed.csv"
    indexed.write_text("\n".join([f",{lines[0]}"] + [f"{i},{ln}" for i, ln in enumerate(lines[1:])]) + "\n")
    model = tmp_path / "m.json"
    assert main(["predictor", "train", "--metrics", str(indexed), "--out", str(model), "--method", "robust-z"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{indexed}:1: column 1 of the header has no name but holds values" in err and not model.exists()
    trailing = tmp_path / "trailing.csv"
    trailing.write_text("\n".join(f"{ln}," for ln in lines) + "\n")
    assert main(["predictor", "train", "--metrics", str(trailing), "--out", str(model), "--method", "robust-z"]) == 0
    assert list(PredictorModel.load(model).spec.metrics) == ["cpu"]


def test_export_to_a_path_it_cannot_write_is_a_one_line_error(tmp_path, capsys):
    """``export --metrics missing/m.csv`` (or ``--events`` naming a folder) ended in a FileNotFoundError /
    IsADirectoryError traceback, the second after the metrics file was already written."""
    from trainguard.predictor.history import MetricHistory

    store = tmp_path / "h.sqlite"
    with MetricHistory(store) as h:
        h.append(float(T0), "n0", {"cpu": 1.0})
    base = ["predictor", "export", "--history", str(store)]
    assert main(base + ["--metrics", str(tmp_path / "no" / "m.csv"), "--events", str(tmp_path / "e.csv")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainguard: error: --metrics") and "does not exist" in err and len(err.splitlines()) == 1
    assert main(base + ["--metrics", str(tmp_path / "m.csv"), "--events", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    # a folder is refused before the metrics file is written, as a folder (09a5955)
    assert err.startswith(f"trainguard: error: --events {tmp_path} is a folder") and len(err.splitlines()) == 1
    assert not (tmp_path / "m.csv").exists()


def test_eval_counts_a_failure_logged_twice_once(fleet, tmp_path, capsys):
    """An events file with the same node and time on two rows (one failure logged by two detectors) counted two
    failures, caught or missed together, so one repeated event moved recall (1 of 3 caught read 3 of 5)."""
    import json

    _, metrics, model = fleet
    t1, t2 = T0 + 60 * 250, T0 + 60 * 260
    events = tmp_path / "e.csv"
    events.write_text("timestamp,node,kind\n" + "".join(f"{t1},n1,GPU Lost\n" for _ in range(3)) + f"{t2},n2,PSU\n")
    capsys.readouterr()
    assert main(["predictor", "eval", "--model", str(model), "--metrics", str(metrics), "--events", str(events),
                 "--json"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert (out["failures"], out["events_total"], out["events_repeated"]) == (2, 4, 2)
    assert f"{events}: 2 event(s) repeat the node and time of an earlier one" in cap.err


@pytest.mark.parametrize("name", ["job", "node", "timestamp", ""])
def test_history_refuses_a_metric_name_the_export_cannot_write(tmp_path, name):
    """A sample with a metric named ``job`` (or ``node``, ``timestamp``, '') was stored; every export of the
    store then failed ("metrics: ['job'] are reserved column names")."""
    from trainguard.predictor.errors import HistoryError
    from trainguard.predictor.history import MetricHistory

    with MetricHistory(tmp_path / "h.sqlite") as h:
        with pytest.raises(HistoryError, match="rename the metric"):
            h.append(float(T0), "n0", {name: 1.0, "cpu": 2.0})
        h.append(float(T0), "n0", {"cpu": 2.0})
        metrics, _ = h.to_tables()
    assert metrics.columns == ["cpu"] and len(metrics.ts) == 1


def test_a_refused_sample_changes_no_state_so_a_fatal_counter_still_alarms(fleet):
    """``observe`` ran the rules tier before checking the sample: a sample refused for a repeated timestamp that
    carried an XID 79 increase left the rules tier holding the new count, so the next sample showed no increase
    and the fatal fault never alarmed. ``observe_many`` took in the nodes before the one refused, so the round
    could not be sent again ("not after the previous")."""
    import math

    from trainguard.predictor.errors import DataFormatError
    from trainguard.predictor.runtime import PredictorRuntime

    _, _, model = fleet
    rt = PredictorRuntime.load(str(model))
    for i in range(3):
        assert not rt.observe(T0 + 60.0 * i, "n0", {"cpu": 50.0, "gpu_xid_79_total": 0.0}).alarm
    with pytest.raises(DataFormatError, match="not after the previous"):
        rt.observe(T0 + 120.0, "n0", {"cpu": 50.0, "gpu_xid_79_total": 1.0})
    s = rt.observe(T0 + 180.0, "n0", {"cpu": 50.0, "gpu_xid_79_total": 1.0})
    assert s.alarm and s.source == "rules" and [h.rule for h in s.rule_hits] == ["xid79-fell-off-bus"]
    with pytest.raises(DataFormatError, match="'cpu' is infinite"):
        rt.observe(T0 + 240.0, "n0", {"cpu": math.inf, "gpu_xid_79_total": 2.0})
    assert [h.rule for h in rt.observe(T0 + 240.0, "n0", {"cpu": math.nan, "gpu_xid_79_total": 2.0}).rule_hits] \
        == ["xid79-fell-off-bus"]
    good = {"cpu": 50.0}
    rt.observe_many(T0, {"a": good, "b": good, "c": good})
    with pytest.raises(DataFormatError, match="'cpu' is infinite"):
        rt.observe_many(T0 + 60.0, {"a": good, "b": {"cpu": math.inf}, "c": good})
    out = rt.observe_many(T0 + 60.0, {"a": good, "b": {"cpu": math.nan}, "c": good})  # the round again
    assert sorted(out) == ["a", "b", "c"]


@pytest.mark.parametrize("flag", ["--long-window", "--short-window"])
def test_a_feature_window_longer_than_the_data_is_refused_by_flag(fleet, tmp_path, capsys, flag):
    """``train --long-window 1e12`` (or a short window that large, which the long one then doubled) trained; the
    runtime keeps a buffer of the long window per node, so every ``score`` with the model then died of a
    MemoryError traceback (24.8 GiB asked for)."""
    _, metrics, _ = fleet
    model = tmp_path / "m.json"
    assert main(["predictor", "train", "--metrics", str(metrics), "--out", str(model), "--method", "robust-z",
                 flag, "1e12"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{flag} 1e+12 s is longer than the data's 17940 s" in err and len(err.splitlines()) == 1
    assert not model.exists()


def test_score_of_a_fleet_prints_a_summary_not_a_line_per_node(fleet, tmp_path, capsys):
    """One stderr line per node: 2000 nodes printed 2000 lines around the summary. Beyond 20 nodes score prints
    the fleet's figures and only the nodes over their budget (or with rules-tier alarms)."""
    _, _, model = fleet
    rng = np.random.default_rng(1)
    metrics = tmp_path / "fleet.csv"
    with metrics.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["timestamp", "node", "cpu"])
        for i in range(120):
            for k in range(30):
                w.writerow([T0 + 60 * i, f"n{k:02d}", round(50 + rng.standard_normal(), 3)])
    capsys.readouterr()
    assert main(["predictor", "score", "--model", str(model), "--metrics", str(metrics),
                 "--out", str(tmp_path / "s.csv")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("scored 3600 rows") and err[1].startswith("30 nodes, "), err[:3]
    assert "over their budget" in err[1] and not any(line.startswith("node n") for line in err), err


def test_names_from_the_file_are_printed_without_control_or_bidi_characters(fleet, tmp_path, capsys):
    """Column and node names are the user's text: 'metrics' listed a column holding ESC raw (it recoloured the
    terminal), 'score' a node named with U+202E (its line read backwards), 'train' an unused text column."""
    _, _, model = fleet
    metrics = tmp_path / "m.csv"
    with metrics.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["timestamp", "node", "cpu", "err\x1b[31m_total", "note\u2066"])
        for i in range(120):
            w.writerow([T0 + 60 * i, "n\u202e1", 50.0 + i % 3, i, "x"])
    capsys.readouterr()
    assert main(["predictor", "metrics", "--metrics", str(metrics), "--model", str(model)]) == 0
    assert main(["predictor", "score", "--model", str(model), "--metrics", str(metrics), "--out",
                 str(tmp_path / "s.csv")]) == 0
    assert main(["predictor", "train", "--metrics", str(metrics), "--out", str(tmp_path / "m.json"),
                 "--method", "threshold"]) == 0
    out = capsys.readouterr()
    text = out.out + out.err
    assert "err\\x1b[31m_total" in text and "node n\\u202e1:" in text and "note\\u2066" in text, text
    assert [c for c in text if not c.isprintable() and c != "\n"] == []

    with metrics.open("w", newline="") as fh:  # a node sampled at another interval is named in the error
        w = csv.writer(fh)
        w.writerow(["timestamp", "node", "cpu"])
        w.writerows([[T0 + 60 * i, f"n{k}", 50.0] for k in range(3) for i in range(20)]
                    + [[T0 + 300 * i, "n\x1b[2J9", 50.0] for i in range(20)])
    assert main(["predictor", "score", "--model", str(model), "--metrics", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert "'n\\x1b[2J9' (300 s)" in err and "\x1b" not in err, err

"""CSV interchange: round trip and every kind of bad input gets a clear DataFormatError."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainguard.predictor.errors import DataFormatError
from trainguard.predictor.table import EventTable, MetricTable


def _write(tmp_path, text, name="m.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_round_trip_keeps_values_nan_and_jobs(tmp_path):
    t = MetricTable(["a", "b"], [1.0, 2.0, 1.0], ["n1", "n1", "n2"], [[1, math.nan], [2, 3], [5, 6]], ["j", "j", "j"])
    t.to_csv(tmp_path / "x.csv")
    back = MetricTable.from_csv(tmp_path / "x.csv")
    assert back.columns == ["a", "b"] and back.job is not None
    series = {s.node: s for s in back.per_node()}
    np.testing.assert_array_equal(series["n1"].ts, [1.0, 2.0])
    assert math.isnan(series["n1"].values[0, 1]) and series["n2"].values[0, 1] == 6


def test_iso_timestamps_are_read_as_utc(tmp_path):
    p = _write(tmp_path, "timestamp,node,a\n1970-01-01T00:00:10,n,1\n1970-01-01T00:00:20Z,n,2\n"
                         # RFC 3339's lower-case forms (some exporters write them) were refused as not ISO 8601
                         "1970-01-01T00:00:30z,n,3\n1970-01-01t00:00:40z,n,4\n")
    np.testing.assert_array_equal(MetricTable.from_csv(p).ts, [10.0, 20.0, 30.0, 40.0])


@pytest.mark.parametrize(
    "text, needle",
    [
        ("time,node,a\n1,n,1\n", "missing column"),
        ("timestamp,node,a\n2,n,1\n1,n,2\n", "strictly increase"),
        ("timestamp,node,a\n1,n,1\n1,n,2\n", "strictly increase"),
        ("timestamp,node,a\n1,n,abc\n", "not a number"),
        ("timestamp,node,a\n1,n,inf\n", "infinite"),
        # float() took these: '6_5' and '٦٥' were scored as 65
        ("timestamp,node,a\n1,n,6_5\n", "value '6_5' is not a number"),
        ("timestamp,node,a\n1,n,\u0666\u0665\n", "is not a number"),
        ("timestamp,node,a\n1_7,n,1\n", "neither Unix seconds nor ISO"),
        ("timestamp,node,a\nyesterday,n,1\n", "neither Unix seconds nor ISO"),
        ("timestamp,node,a\n1,n\n", "cells but the header"),
        ("timestamp,node,a,a\n1,n,1,2\n", "duplicate"),
        ("", "empty"),
    ],
)
def test_bad_metrics_files_are_refused_with_the_reason(tmp_path, text, needle):
    with pytest.raises(DataFormatError, match=needle):
        MetricTable.from_csv(_write(tmp_path, text))


def test_interleaved_nodes_are_fine(tmp_path):
    p = _write(tmp_path, "timestamp,node,a\n1,n1,1\n1,n2,1\n2,n1,2\n2,n2,3\n")
    assert MetricTable.from_csv(p).nodes == ["n1", "n2"]


def test_events_file(tmp_path):
    p = _write(tmp_path, "timestamp,node,kind\n5,n1,GPU Lost\n3,n2,Link Down\n", "e.csv")
    ev = EventTable.from_csv(p)
    assert len(ev) == 2 and list(ev.for_node("n1")) == [5.0]
    with pytest.raises(DataFormatError, match="missing column"):
        EventTable.from_csv(_write(tmp_path, "timestamp,node\n1,n\n", "bad.csv"))
    with pytest.raises(DataFormatError, match="cannot read"):
        EventTable.from_csv(tmp_path / "absent.csv")


def test_order_error_prints_plain_times_not_numpy_reprs(tmp_path):
    with pytest.raises(DataFormatError) as ei:
        MetricTable.from_csv(_write(tmp_path, "timestamp,node,a\n1764667200,n1,1\n1764667200,n1,2\n"))
    msg = str(ei.value)
    assert "np.float64" not in msg and "1764667200.000 (2025-12-02T09:20:00Z)" in msg
    assert ".csv:3: node 'n1'" in msg  # the file line (data row 2)

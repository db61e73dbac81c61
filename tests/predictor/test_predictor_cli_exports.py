"""Regression tests of a review with files as other tools export them (a spreadsheet saved with ';', a pandas
round trip, a series without data in the range) and outputs given as folders; every run is a real subprocess
of the ``trainguard`` CLI on real files, checked for one error line, exit code 2 and no traceback."""

from __future__ import annotations

import csv
import subprocess
import sys

import numpy as np
import pytest

T0 = 1_700_000_000
COLUMNS = ["gpu_temp_c", "retries_total", "latency_ms"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "trainguard.cli", "predictor", *args], capture_output=True,
                          text=True, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _error(done: subprocess.CompletedProcess) -> str:
    """The one error line of a refused run (exit code 2, nothing else on stderr)."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainguard: error: "), done.stderr
    return lines[0]


def _rows(nodes: int = 3, n: int = 240, seed: int = 0) -> list[list]:
    rng = np.random.default_rng(seed)
    rows, total = [], [0.0] * nodes
    for i in range(n):
        for k in range(nodes):
            total[k] += float(rng.integers(0, 3))
            rows.append([T0 + 60 * i, f"n{k}", round(60 + rng.standard_normal(), 2), total[k],
                         round(20 + rng.standard_normal(), 3)])
    return rows


def _write(path, header, rows, **fmt) -> str:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh, **fmt)
        w.writerow(header)
        w.writerows(rows)
    return str(path)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Three nodes at 60 s and a robust-z model of them, trained through the CLI."""
    d = tmp_path_factory.mktemp("exports")
    metrics = _write(d / "m.csv", ["timestamp", "node", *COLUMNS], _rows())
    events = _write(d / "e.csv", ["timestamp", "node", "kind"], [[T0 + 60 * 200, "n1", "GPU Lost"]])
    model = str(d / "model.json")
    done = _cli("train", "--metrics", metrics, "--out", model, "--method", "robust-z")
    assert done.returncode == 0, done.stderr
    return d, metrics, events, model


def test_an_output_that_is_a_folder_is_refused_before_training(fleet, tmp_path):
    """``train --out DIR`` trained for the whole run, then failed to write with 'DIR: cannot write model file (Is a
    directory); check that its folder exists' (no flag named, and the folder does exist); ``export`` to a folder
    the same way, after reading the history."""
    _, metrics, _, _ = fleet
    folder = tmp_path / "models"
    folder.mkdir()
    for out in (str(folder), str(folder) + "/"):
        line = _error(_cli("train", "--metrics", metrics, "--out", out))
        assert f"--out {out} is a folder" in line and str(folder / "model.json") in line
    assert list(folder.iterdir()) == []
    from trainguard.predictor.history import MetricHistory

    store = tmp_path / "h.sqlite"
    with MetricHistory(str(store)) as h:
        h.append(float(T0), "n0", {"gpu_temp_c": 60.0})
    line = _error(_cli("export", "--history", str(store), "--metrics", str(folder), "--events",
                       str(tmp_path / "e.csv")))
    assert f"--metrics {folder} is a folder" in line and str(folder / "metrics.csv") in line
    assert not (tmp_path / "e.csv").exists()


@pytest.mark.parametrize("sep, what", [(";", "semicolons"), ("\t", "tabs")])
def test_a_file_separated_by_semicolons_or_tabs_is_named_as_such(fleet, tmp_path, sep, what):
    """A spreadsheet saved as CSV in a locale whose decimal mark is a comma separates cells by ';' (and a TSV by
    tabs): the whole header was one cell, and the error said the header lacked 'timestamp' and 'node', which it
    visibly starts with."""
    _, _, _, model = fleet
    metrics = _write(tmp_path / "m.csv", ["timestamp", "node", *COLUMNS], _rows(n=30), delimiter=sep)
    events = _write(tmp_path / "e.csv", ["timestamp", "node", "kind"], [[T0, "n0", "GPU Lost"]], delimiter=sep)
    hint = f"separated by {what}, not commas: save it as comma-separated CSV"
    line = _error(_cli("train", "--metrics", metrics, "--out", str(tmp_path / "x.json")))
    assert f"{metrics}: missing column(s) ['timestamp', 'node']" in line and hint in line
    line = _error(_cli("eval", "--model", model, "--metrics", fleet[1], "--events", events))
    assert f"{events}: missing column(s) ['timestamp', 'node', 'kind']" in line and hint in line
    # a comma-separated header that lacks the columns gets no such hint
    plain = _write(tmp_path / "p.csv", ["time", "host", *COLUMNS], _rows(n=30))
    assert "separated by" not in _error(_cli("metrics", "--metrics", plain))


def test_a_pandas_unnamed_index_column_is_refused_like_an_unnamed_one(fleet, tmp_path):
    """``pd.read_csv`` of a file written with its row index names that column ``Unnamed: 0``, and ``to_csv``
    writes it back under that name: ``train`` took the row index as a counter metric (listed by ``metrics`` as
    'Unnamed: 0  counter  (values)'), which every file scored later had to carry too. It is refused like the
    unnamed index column it is; one left empty is left out."""
    _, _, _, model = fleet
    rows = _rows()
    indexed = _write(tmp_path / "i.csv", ["Unnamed: 0", "timestamp", "node", *COLUMNS],
                     [[i, *r] for i, r in enumerate(rows)])
    out = tmp_path / "x.json"
    for args in (("train", "--metrics", indexed, "--out", str(out)), ("metrics", "--metrics", indexed),
                 ("score", "--model", model, "--metrics", indexed)):
        line = _error(_cli(*args))
        assert f"{indexed}:1: column 1 of the header is 'Unnamed: 0'" in line and "index=False" in line
    assert not out.exists()
    blank = _write(tmp_path / "b.csv", ["timestamp", "node", *COLUMNS, "Unnamed: 5"], [[*r, ""] for r in rows])
    done = _cli("train", "--metrics", blank, "--out", str(out), "--method", "robust-z")
    assert done.returncode == 0, done.stderr
    from trainguard.predictor.model import PredictorModel

    assert list(PredictorModel.load(out).spec.metrics) == COLUMNS


def test_a_model_metric_without_any_value_is_a_missing_metric(fleet, tmp_path):
    """A column the model reads that is empty in every row (a Grafana series with no data in the range) was scored
    as if the model had never read it, under the default ``--missing error`` too, with nothing saying so. It is
    now a missing metric: refused naming ``--missing nan``, and with it named in each score's ``degraded`` and in
    eval's ``degraded_missing_metrics``."""
    _, _, events, model = fleet
    rows = [[*r[:2], "", *r[3:]] for r in _rows()]
    metrics = _write(tmp_path / "m.csv", ["timestamp", "node", *COLUMNS], rows)
    for cmd, extra in (("score", ()), ("eval", ("--events", events))):
        line = _error(_cli(cmd, "--model", model, "--metrics", metrics, *extra))
        assert f"{metrics}: column(s) ['gpu_temp_c']" in line and "hold no value in any row" in line
        assert "--missing nan" in line
    out = tmp_path / "s.csv"
    done = _cli("score", "--model", model, "--metrics", metrics, "--missing", "nan", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "['gpu_temp_c'] hold no value in any row" in done.stderr
    with out.open() as fh:
        scored = list(csv.DictReader(fh))
    assert len(scored) == len(rows)
    assert all("missing metrics: gpu_temp_c" in r["degraded"] for r in scored)
    done = _cli("eval", "--model", model, "--metrics", metrics, "--events", events, "--missing", "nan", "--json")
    assert done.returncode == 0, done.stderr
    import json

    assert json.loads(done.stdout)["degraded_missing_metrics"] == ["gpu_temp_c"]


def test_a_cooldown_of_0_finishes(fleet, tmp_path):
    """``--cooldown 0`` (accepted: "least time between two alarms", so an event on every row above the
    threshold) never finished: the search for the next event found the last event's own row again, forever, and
    ``train`` grew to 11 GiB in six minutes on two days of four nodes (the hindsight calibration of ``eval`` too).
    The subprocess's timeout fails the test in the old code."""
    _, metrics, events, model = fleet
    done = _cli("train", "--metrics", metrics, "--out", str(tmp_path / "x.json"), "--cooldown", "0")
    assert done.returncode == 0, done.stderr
    done = _cli("eval", "--model", model, "--metrics", metrics, "--events", events, "--cooldown", "0", "--json")
    assert done.returncode == 0, done.stderr
    import json

    assert json.loads(done.stdout)["eval_config"]["cooldown_s"] == 0.0
    from trainguard.predictor.evaluation import alarm_events

    ts = np.arange(10.0) * 60
    score = np.array([0, 1, 1, 0, 1, 1, 1, 0, 0, 1.0])
    assert alarm_events(ts, score, 0.5, 0.0).tolist() == [60.0, 120.0, 240.0, 300.0, 360.0, 540.0]
    assert alarm_events(ts, score, 0.5, 120.0).tolist() == [60.0, 240.0, 360.0, 540.0]


def test_resampling_finer_than_the_data_is_refused_with_the_data_interval(fleet, tmp_path):
    """``train --resample 7`` on 60 s data left most 7 s bins empty, and the error then named the spacing of the
    bins it had made as the interval to train with: 'the data is sampled every 63 s, coarser than the 7 s ...
    train with --interval 63' (the data's interval is 60 s, and a model at 63 s could not score it)."""
    _, metrics, events, model = fleet
    line = _error(_cli("train", "--metrics", metrics, "--out", str(tmp_path / "x.json"), "--resample", "7"))
    assert f"--resample 7 is finer than the data's 60 s sampling ({metrics})" in line
    assert "--resample 60 or more" in line and "--interval" not in line
    for cmd, extra in (("score", ()), ("eval", ("--events", events))):
        line = _error(_cli(cmd, "--model", model, "--metrics", metrics, "--resample", "30", *extra))
        assert "--resample 30 is finer than the data's 60 s sampling" in line
    # repeated timestamps (spacing 0) do not make the data look finer than it is: 60 s still resamples at 60 s
    with open(metrics) as fh:
        rows = list(csv.reader(fh))
    doubled = _write(tmp_path / "d.csv", rows[0], rows[1:] + rows[1:])
    done = _cli("train", "--metrics", doubled, "--out", str(tmp_path / "x.json"), "--resample", "60",
                "--method", "robust-z")
    assert done.returncode == 0, done.stderr


def test_daily_data_names_the_calibration_flag_before_fitting(tmp_path):
    """Daily samples (a CloudWatch export at 1-day resolution, 60 days of 4 nodes) failed at the end of ``train``
    with the calibration's own 'calibration windows 86400.0, 604800.0, 86400.0, 3600.0 s: need block_s > 0,
    window_s >= 10 blocks, ...', naming no flag; the per-node thresholds keep a week of scores, ten samples at
    least. The error now names ``--calibration fixed``, which trains."""
    rng = np.random.default_rng(4)
    rows = [[T0 + 86400 * i, f"n{k}", round(60 + rng.standard_normal(), 2)] for i in range(60) for k in range(4)]
    metrics = _write(tmp_path / "daily.csv", ["timestamp", "node", "cpu_pct"], rows)
    out = tmp_path / "m.json"
    for mode in ("online", "online-family"):
        line = _error(_cli("train", "--metrics", metrics, "--out", str(out), "--calibration", mode))
        assert "data sampled every 86400 s is too coarse for the per-node thresholds" in line
        assert "--calibration fixed" in line
    done = _cli("train", "--metrics", metrics, "--out", str(out), "--calibration", "fixed")
    assert done.returncode == 0 and "interval 86400 s" in done.stdout, done.stderr
    # 12-hourly data still calibrates per node (14 samples a week)
    half = _write(tmp_path / "h.csv", ["timestamp", "node", "cpu_pct"],
                  [[T0 + 43200 * i, f"n{k}", round(60 + rng.standard_normal(), 2)] for i in range(120) for k in range(4)])
    done = _cli("train", "--metrics", half, "--out", str(out))
    assert done.returncode == 0 and "thresholds per node, online" in done.stdout, done.stderr


def test_a_space_after_each_comma_before_quotes_is_read(fleet, tmp_path):
    """``timestamp, "node", "gpu_temp_c"`` (a space after each comma, names quoted: scripts and some exporters
    write this) kept the quotes as part of each name, and was refused for lacking a 'node' column its header
    shows; in an events file a quoted kind with a comma in it ('"GPU Lost, XID 79"') split into two cells."""
    _, metrics, _, model = fleet
    with open(metrics) as fh:
        rows = list(csv.reader(fh))
    spaced = tmp_path / "s.csv"
    spaced.write_bytes(b"\xef\xbb\xbf" + "".join(
        ", ".join(f'"{c}"' if not c[:1].isdigit() else c for c in r) + "\r\n" for r in rows).encode())
    out = tmp_path / "scores.csv"
    done = _cli("score", "--model", model, "--metrics", str(spaced), "--out", str(out))
    assert done.returncode == 0, done.stderr
    with out.open() as fh:
        assert len(list(csv.DictReader(fh))) == len(rows) - 1
    events = tmp_path / "e.csv"
    events.write_text(f'timestamp, node, kind\n{T0 + 60 * 200}, "n1", "GPU Lost, XID 79"\n')
    done = _cli("eval", "--model", model, "--metrics", str(spaced), "--events", str(events), "--json")
    assert done.returncode == 0, done.stderr
    import json

    assert json.loads(done.stdout)["failures"] == 1


def test_a_header_naming_timestamp_or_node_twice_is_refused(fleet, tmp_path):
    """Two exports joined side by side repeat 'timestamp' and 'node': the first column of each name was read and
    the second ignored, whatever it held (here other nodes' names and another hour), with nothing said."""
    _, metrics, _, model = fleet
    with open(metrics) as fh:
        rows = list(csv.reader(fh))
    for name, extra, cmd in (("timestamp", lambda r: str(int(r[0]) + 3600), ("metrics",)),
                             ("node", lambda r: "m" + r[1][1:], ("score", "--model", model))):
        joined = _write(tmp_path / f"{name}.csv", rows[0] + [name], [r + [extra(r)] for r in rows[1:]])
        line = _error(_cli(*cmd, "--metrics", joined))
        assert f"{joined}:1: column '{name}' appears 2 times in the header" in line
    events = _write(tmp_path / "e.csv", ["timestamp", "node", "kind", "node"], [[T0 + 60 * 200, "n1", "PSU", "n2"]])
    line = _error(_cli("eval", "--model", model, "--metrics", metrics, "--events", events))
    assert f"{events}:1: column 'node' appears 2 times in the header (columns 2, 4)" in line



def test_too_few_rows_says_rows_not_hours(tmp_path):
    """Two days of four nodes sampled daily (8 rows) were told 'only 8 samples; train on at least a few hours of
    history' though they span two days: the limit is on rows."""
    rows = [[T0 + 86400 * i, f"n{k}", 50.0 + i + k] for i in range(2) for k in range(4)]
    metrics = _write(tmp_path / "daily.csv", ["timestamp", "node", "cpu_pct"], rows)
    line = _error(_cli("train", "--metrics", metrics, "--out", str(tmp_path / "x.json")))
    assert "only 8 rows (one per node and sample time); training needs at least 100" in line
    assert "few hours" not in line


def test_spreadsheet_serial_dates_are_named_with_the_conversion(fleet, tmp_path):
    """A spreadsheet's date column saved as numbers (days since 1899-12-30: 45992.000694 is a minute past
    midnight on 2025-12-01) was read as Unix seconds on 1970-01-01: ``train`` fitted a model at a 0.000694 s
    interval on '0.0 node-days', and ``score`` advised ``--resample 60``, which would merge each day into a row."""
    _, metrics, _, model = fleet
    with open(metrics) as fh:
        rows = list(csv.reader(fh))
    serial = _write(tmp_path / "x.csv", rows[0], [[repr(int(r[0]) / 86400 + 25569), *r[1:]] for r in rows[1:]])
    for args in (("train", "--metrics", serial, "--out", str(tmp_path / "m.json")),
                 ("score", "--model", model, "--metrics", serial)):
        line = _error(_cli(*args))
        assert f"{serial}: timestamps look like spreadsheet serial dates" in line
        assert "2023-11-14 22:13 UTC" in line and "(value - 25569) * 86400" in line
    assert not (tmp_path / "m.json").exists()
    # Unix seconds early in 1970 a minute apart are still read as they are
    early = _write(tmp_path / "e.csv", rows[0], [[int(r[0]) - T0 + 20_000, *r[1:]] for r in rows[1:]])
    assert _cli("metrics", "--metrics", early).returncode == 0


def test_a_header_in_other_case_is_named(fleet, tmp_path):
    """A CloudWatch-style header 'Timestamp,Node,...' was told it lacked 'timestamp' and 'node', which it shows
    in other case; the names it has are now quoted with what to do."""
    _, metrics, _, model = fleet
    with open(metrics) as fh:
        rows = list(csv.reader(fh))
    upper = _write(tmp_path / "u.csv", ["Timestamp", "Node", *rows[0][2:]], rows[1:])
    line = _error(_cli("score", "--model", model, "--metrics", upper))
    assert "missing column(s) ['timestamp', 'node']" in line
    assert "the header has 'Timestamp', 'Node': column names are case-sensitive, rename them in lower case" in line
    events = _write(tmp_path / "e.csv", ["timestamp", "node", "Kind"], [[T0 + 60 * 200, "n1", "PSU"]])
    line = _error(_cli("eval", "--model", model, "--metrics", metrics, "--events", events))
    assert "the header has 'Kind': column names are case-sensitive, rename it in lower case" in line

"""Regression tests of the CLI findings of issue 19: no silent row drops, eval flags, valid JSON, any numeric
column, ``predictor metrics``, ``--resample``, errors naming the flag to use, gaps handled as gaps."""

from __future__ import annotations

import argparse
import csv
import json
import math

import numpy as np
import pytest

from trainguard.cli import main
from trainguard.predictor.cli import _eval_config


def _write(path, columns, rows):
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["timestamp", "node", *columns])
        for r in rows:
            w.writerow(["" if isinstance(v, float) and np.isnan(v) else v for v in r])
    return str(path)


def _fleet(path, nodes=3, n=400, step=60.0, seed=0, extra=()):
    """``nodes`` healthy nodes: a noisy gauge, an increasing counter without a catalog name, a ``_total``."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(nodes):
        c = 0.0
        tot = 0.0
        for i in range(n):
            c += float(rng.random() < 0.05)
            tot += float(rng.integers(0, 3))
            rows.append([1_700_000_000.0 + step * i, f"n{k}", round(50 + rng.standard_normal(), 3), c, tot])
    rows += list(extra)
    rows.sort(key=lambda r: r[0])
    return _write(path, ["latency_ms", "retries", "req_total"], rows)


def _no_nan_json(text):
    def refuse(c):
        raise ValueError(f"invalid JSON constant {c}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("findings")
    metrics = _fleet(d / "m.csv")
    model = d / "model.json"
    assert main(["predictor", "train", "--metrics", metrics, "--out", str(model), "--method", "robust-z"]) == 0
    return d, metrics, str(model)


def test_any_numeric_column_is_used_and_listed(trained, capsys):
    d, metrics, model = trained
    from trainguard.predictor.model import PredictorModel

    m = PredictorModel.load(model)
    assert dict(zip(m.spec.metrics, m.spec.kinds)) == {"latency_ms": "gauge", "retries": "counter",
                                                       "req_total": "counter"}
    capsys.readouterr()
    assert main(["predictor", "metrics", "--metrics", metrics, "--gauge", "retries"]) == 0
    out = capsys.readouterr().out
    assert "gpu_ecc_sbe_total" in out and "counter" in out  # the catalog is listed
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ")}
    assert "gauge" in lines["latency_ms"] and "(values)" in lines["latency_ms"]
    assert "gauge" in lines["retries"] and "(declared)" in lines["retries"]
    assert "counter" in lines["req_total"] and "(name)" in lines["req_total"]
    assert main(["predictor", "metrics", "--metrics", metrics, "--gauge", "nope"]) == 2
    assert "--counter/--gauge" in capsys.readouterr().err


@pytest.mark.parametrize("peer", [True, False])
def test_score_writes_every_row_even_two_in_one_slot(tmp_path, capsys, peer):
    # node n1 reports twice inside one 60 s slot (at +10 s): both rows must be scored and written
    t_dup = 1_700_000_000.0 + 60 * 200 + 10
    metrics = _fleet(tmp_path / "m.csv", extra=[[t_dup, "n1", 50.0, 10.0, 400.0]])
    model = tmp_path / "model.json"
    args = ["predictor", "train", "--metrics", metrics, "--out", str(model), "--method", "robust-z",
            "--interval", "60"]
    assert main(args + ([] if peer else ["--no-peer"])) == 0
    capsys.readouterr()
    out = tmp_path / "scores.csv"
    assert main(["predictor", "score", "--model", str(model), "--metrics", metrics, "--out", str(out)]) == 0
    n_in = sum(1 for _ in open(metrics)) - 1
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == n_in == 1201
    assert f"scored {n_in} rows" in capsys.readouterr().err
    assert sorted((r["node"], float(r["timestamp"])) for r in rows) == sorted(
        (r["node"], float(r["timestamp"])) for r in csv.DictReader(open(metrics)))


def test_eval_flags_and_json_without_nan(trained, capsys):
    d, metrics, model = trained
    events = _write(d / "e.csv", ["kind"], [])  # no failure: recall is undefined (null, not NaN)
    capsys.readouterr()
    assert main(["predictor", "eval", "--model", model, "--metrics", metrics, "--events", events, "--json",
                 "--horizon", "3600", "--lead", "300", "--cooldown", "600", "--budget", "20"]) == 0
    said = capsys.readouterr()
    out = _no_nan_json(said.out)
    # 6.7 h of data: no node warms its online threshold up (a day), so nothing could alarm; "within budget: true"
    # said nothing about the model
    assert out["within_budget"] is None and "no node finished warming up" in said.err, said.err
    assert main(["predictor", "eval", "--model", model, "--metrics", metrics, "--events", events, "--json",
                 "--threshold", "0.5"]) == 0  # a fixed threshold alarms from the first row: judged
    assert isinstance(_no_nan_json(capsys.readouterr().out)["within_budget"], bool)
    assert out["eval_config"]["horizon_s"] == 3600 and out["eval_config"]["min_lead_s"] == 300
    assert out["eval_config"]["cooldown_s"] == 600 and out["budget_per_100_node_days"] == 20
    assert out["recall"] is None and out["threshold_mode"].startswith("online per node")
    assert main(["predictor", "eval", "--model", model, "--metrics", metrics, "--events", events,
                 "--lead", "4000"]) == 2
    assert "--min-lead 4000 must be below --horizon 1800" in capsys.readouterr().err
    # an infinite budget crashed with a traceback (OverflowError); an infinite horizon or cooldown was written
    # into the model as null and a later eval crashed on it (the parser refuses them before _eval_config sees
    # them; _eval_config refuses them too, for callers that build the namespace themselves)
    for flag in ("--budget", "--horizon", "--cooldown"):
        with pytest.raises(SystemExit):
            main(["predictor", "eval", "--model", model, "--metrics", metrics, "--events", events, flag, "inf"])
        assert f"argument {flag}: 'inf' is not a finite number" in capsys.readouterr().err
        with pytest.raises(Exception, match=f"{flag} inf: must be a finite number"):
            _eval_config(argparse.Namespace(**{"horizon": None, "min_lead": None, "cooldown": None, "budget": None,
                                               flag[2:]: math.inf}))


def test_resample_other_and_mixed_intervals(trained, tmp_path, capsys):
    _, _, model = trained  # trained at 60 s
    rng = np.random.default_rng(1)
    rows = []
    t = 1_700_000_000.0
    for i in range(1500):  # 10-20 s jittered samples of three nodes
        t += float(rng.uniform(10, 20))
        for k in range(3):
            rows.append([t + k * 0.1, f"n{k}", 50 + rng.standard_normal(), float(i // 30), float(2 * i)])
    fine = _write(tmp_path / "fine.csv", ["latency_ms", "retries", "req_total"], rows)
    capsys.readouterr()
    assert main(["predictor", "score", "--model", model, "--metrics", fine, "--out", str(tmp_path / "s.csv")]) == 2
    assert "--resample 60" in capsys.readouterr().err
    assert main(["predictor", "score", "--model", model, "--metrics", fine, "--out", str(tmp_path / "s.csv"),
                 "--resample", "60"]) == 0
    err = capsys.readouterr().err
    assert "resampled to 60 s" in err
    scored = list(csv.DictReader((tmp_path / "s.csv").open()))
    slots = {(r[1], int(r[0] // 60)) for r in rows}  # one row per node and occupied 60 s slot
    assert len(scored) == len(slots) and all(float(r["timestamp"]) % 60 == 0 for r in scored)


def test_a_steady_other_interval_is_refused_not_taken_for_jitter(trained, tmp_path, capsys):
    """Data every 45 s or 70 s was scored by a 60 s model without a word (the 0.25 jitter tolerance was applied
    to the median spacing, which jitter does not move), and so was `--resample 45`: every window then held a
    third more or fewer rows than the model was trained on."""
    _, _, model = trained  # trained at 60 s
    rng = np.random.default_rng(4)
    out = str(tmp_path / "s.csv")
    for step, flag in ((45.0, "--resample 60"), (70.0, "--interval 70")):
        rows = [[1_700_000_000.0 + step * i, "n0", 50 + rng.standard_normal(), 0.0, float(2 * i)] for i in range(600)]
        data = _write(tmp_path / f"d{step:g}.csv", ["latency_ms", "retries", "req_total"], rows)
        capsys.readouterr()
        assert main(["predictor", "score", "--model", model, "--metrics", data, "--out", out]) == 2, step
        err = capsys.readouterr().err
        assert f"every {step:g} s" in err and flag in err, err
    fine = _write(tmp_path / "d30.csv", ["latency_ms", "retries", "req_total"],
                  [[1_700_000_000.0 + 30 * i, "n0", 50.0, 0.0, float(i)] for i in range(900)])
    capsys.readouterr()
    assert main(["predictor", "score", "--model", model, "--metrics", fine, "--out", out, "--resample", "45"]) == 2
    assert "--resample 60" in capsys.readouterr().err


def test_hourly_data_error_names_the_window_flags(tmp_path, capsys):
    rng = np.random.default_rng(2)
    hourly = _write(tmp_path / "h.csv", ["cpu"], [[3600.0 * i, "a", 40 + rng.standard_normal()] for i in range(500)])
    assert main(["predictor", "train", "--metrics", hourly, "--out", str(tmp_path / "m.json"),
                 "--short-window", "300"]) == 2
    err = capsys.readouterr().err
    assert "--short-window" in err and "--long-window" in err and "\n" not in err.strip()
    # without window flags they are derived from the hourly interval
    assert main(["predictor", "train", "--metrics", hourly, "--out", str(tmp_path / "m.json")]) == 0
    assert "interval 3600 s, windows 18000/" in capsys.readouterr().out


def test_long_gap_is_a_gap_not_a_maximal_score(trained, tmp_path):
    from trainguard.predictor.runtime import PredictorRuntime

    _, _, model = trained
    rt = PredictorRuntime.load(model)
    rng = np.random.default_rng(3)
    t, c, tot = 1_800_000_000.0, 0.0, 0.0
    scores = []
    for i in range(300):
        t += 60.0 if i != 200 else 6 * 3600.0  # six hours without telemetry
        c += float(rng.random() < 0.05)
        tot += float(rng.integers(0, 3))
        s = rt.observe_many(t, {f"n{k}": {"latency_ms": 50 + rng.standard_normal(), "retries": c, "req_total": tot}
                                for k in range(3)})["n0"]
        scores.append(s)
    after = scores[200]
    assert not any(f.startswith("telemetry.") for f, _ in after.top_features)
    quiet = np.percentile([s.score for s in scores[100:200]], 99)
    assert after.score <= max(quiet, 0.5), (after.score, quiet)


def test_resample_merges_duplicate_timestamps_into_their_bin(trained, tmp_path, capsys):
    """Review finding: ``score --resample`` refused two samples of a node with the same timestamp; they are
    samples of one bin like any other two, so they are merged (gauges averaged) and the merge is reported."""
    _, _, model = trained
    rows = []
    t0 = 1_700_000_000.0
    for i in range(600):
        for k in range(3):
            rows.append([t0 + 20.0 * i, f"n{k}", 50.0, float(i // 30), float(2 * i)])
    rows.append([t0 + 20.0 * 300, "n1", 80.0, 10.0, 600.0])  # n1 repeats the timestamp of its row 300
    moved = [t0 + 20.0 * 301, "n2", 50.0, 10.0, 602.0]  # and n2 has a row out of order (moved last)
    rows.remove(moved)
    rows.append(moved)
    dup = _write(tmp_path / "dup.csv", ["latency_ms", "retries", "req_total"], rows)
    out = tmp_path / "s.csv"
    capsys.readouterr()
    assert main(["predictor", "score", "--model", model, "--metrics", dup, "--out", str(out)]) == 2
    assert "strictly increase" in capsys.readouterr().err  # without --resample: still refused, row named
    assert main(["predictor", "score", "--model", model, "--metrics", dup, "--out", str(out), "--resample", "60"]) == 0
    err = capsys.readouterr().err
    assert "merged 1 row(s) that repeat a node's timestamp into their 60 s bin" in err
    from trainguard.predictor.table import MetricTable

    table = MetricTable.from_csv(dup, check_order=False).resample(60.0, {"retries", "req_total"})
    n1 = table.values[(table.node == "n1") & (table.ts == (np.floor((t0 + 6000.0) / 60) + 1) * 60), 0]
    assert n1.tolist() == [pytest.approx((50.0 * 3 + 80.0) / 4)]  # the bin's 3 samples plus the repeat
    scored = list(csv.DictReader(out.open()))
    assert len(scored) == len(table.ts) == len({(r[1], int(r[0] // 60)) for r in rows})  # one row per bin


def test_metrics_classifies_columns_of_rows_out_of_order(tmp_path, capsys):
    """Review finding: ``predictor metrics`` refused a file whose rows go back in time, though it only
    classifies columns; it lists them (training still refuses the file, naming the row)."""
    rows = [[1_700_000_000.0 + 60.0 * i, "a", 40.0 + i % 7, float(i)] for i in range(100)]
    rows[10], rows[11] = rows[11], rows[10]
    rows.append(list(rows[50]))  # a duplicate
    path = _write(tmp_path / "m.csv", ["cpu", "ops"], rows)
    capsys.readouterr()
    assert main(["predictor", "metrics", "--metrics", path]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  ")}
    assert "gauge" in lines["cpu"] and "counter" in lines["ops"]
    assert main(["predictor", "train", "--metrics", path, "--out", str(tmp_path / "x.json")]) == 2
    assert f"{path}:13: " in capsys.readouterr().err  # data row 12, after the header


def test_train_per_node_and_family_then_eval_and_score(trained, tmp_path, capsys):
    """``--calibration online-family``: thresholds per node and metric family (latency, retries, req) are what
    ``eval`` evaluates and what ``score`` alarms on."""
    d, metrics, _ = trained
    model = tmp_path / "fam.json"
    capsys.readouterr()
    assert main(["predictor", "train", "--metrics", metrics, "--out", str(model), "--method", "robust-z",
                 "--calibration", "online-family"]) == 0
    assert "per node and metric family, online" in capsys.readouterr().out
    from trainguard.predictor.model import PredictorModel

    m = PredictorModel.load(model)
    assert m.calibration.per_family and [f for f, _ in m.spec.families] == ["retries", "req", "latency"]
    events = _write(tmp_path / "e.csv", ["kind"], [])
    assert main(["predictor", "eval", "--model", str(model), "--metrics", metrics, "--events", events, "--json"]) == 0
    assert _no_nan_json(capsys.readouterr().out)["threshold_mode"] == "online per node and metric family"
    out = tmp_path / "s.csv"
    assert main(["predictor", "score", "--model", str(model), "--metrics", metrics, "--out", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == sum(1 for _ in open(metrics)) - 1
    # each row names the family whose margin decided it (empty while the node warms up)
    assert {r["family"] for r in rows} - {""} <= {"retries", "req", "latency"}
    assert {r["family"] for r in rows} - {""}


def _fleet_rows(nodes=3, n=400, step=60.0, seed=0, t0=1_700_000_000.0):
    """Rows of ``nodes`` healthy nodes (latency gauge, retries and req_total counters), sorted by time."""
    rng = np.random.default_rng(seed)
    rows = []
    for k in range(nodes):
        c = tot = 0.0
        for i in range(n):
            c += float(rng.random() < 0.05)
            tot += float(rng.integers(0, 3))
            rows.append([t0 + step * i, f"n{k}", round(50 + rng.standard_normal(), 3), c, tot])
    rows.sort(key=lambda r: r[0])
    return rows


COLS = ["latency_ms", "retries", "req_total"]


def test_train_resample_accepts_unsorted_rows_and_repeated_timestamps(tmp_path, capsys):
    """Second review, finding 2: ``train --resample`` read the file unresampled first and refused rows out of
    order or repeating a timestamp, which the README promises --resample accepts (as score and eval did)."""
    rows = _fleet_rows()
    rows.append(list(rows[500]))  # a node repeats a timestamp
    rows[10], rows[40] = rows[40], rows[10]  # and rows go back in time
    path = _write(tmp_path / "m.csv", COLS, rows)
    capsys.readouterr()
    assert main(["predictor", "train", "--metrics", path, "--out", str(tmp_path / "m.json"), "--method", "robust-z",
                 "--resample", "60"]) == 0
    assert "merged 1 row(s) that repeat a node's timestamp" in capsys.readouterr().err


def _one_line_error(capsys, argv):
    """Runs the CLI expecting a refusal: exit 2 and one line on stderr (no traceback); returns the line."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # the parser's own refusals (argparse exits)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainguard: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_bad_inputs_and_outputs_are_one_line_errors(trained, tmp_path, capsys):
    """Second review, finding 3: a header-only or non-UTF-8 CSV, an output folder that does not exist, a bad
    ``--faults`` file, a model holding NaN and impossible ``gen-trace`` flags gave Python tracebacks (exit 1)."""
    d, metrics, model = trained
    events = _write(tmp_path / "e.csv", ["kind"], [])
    header_only = _write(tmp_path / "h.csv", COLS, [])
    binary = tmp_path / "b.csv"
    binary.write_bytes(b"timestamp,node,latency_ms\n1700000000,n\xf0\xff\x00,1\n")
    for argv in (["train", "--metrics", header_only, "--out", str(tmp_path / "x.json")],
                 ["score", "--model", model, "--metrics", header_only],
                 ["eval", "--model", model, "--metrics", header_only, "--events", events],
                 ["metrics", "--metrics", header_only]):
        assert "no data rows" in _one_line_error(capsys, ["predictor", *argv])
    for argv in (["train", "--metrics", str(binary), "--out", str(tmp_path / "x.json")],
                 ["score", "--model", model, "--metrics", str(binary)],
                 ["eval", "--model", model, "--metrics", str(binary), "--events", events],
                 ["eval", "--model", model, "--metrics", metrics, "--events", str(binary)],
                 ["score", "--model", model, "--metrics", metrics, "--rules", str(binary)],
                 ["metrics", "--metrics", str(binary)]):
        assert "UTF-8" in _one_line_error(capsys, ["predictor", *argv])
    nowhere = tmp_path / "no_such_dir"
    err = _one_line_error(capsys, ["predictor", "train", "--metrics", metrics, "--out", str(nowhere / "t.json")])
    assert "no_such_dir" in err and "folder" in err
    err = _one_line_error(capsys, ["predictor", "score", "--model", model, "--metrics", metrics,
                                   "--out", str(nowhere / "s.csv")])
    assert "no_such_dir" in err and "folder" in err
    not_faults = tmp_path / "x.json"
    not_faults.write_text('{"x": 1}')
    truncated = tmp_path / "t.json"
    truncated.write_text('{"faults": [{"node": "n1", "ts"')
    for faults in (str(nowhere / "faults.json"), str(not_faults), str(truncated)):
        err = _one_line_error(capsys, ["predictor", "eval", "--model", model, "--metrics", metrics,
                                       "--events", events, "--faults", faults])
        assert faults in err and "gen-trace" in err
    text = open(model).read()
    for lit in ("NaN", "Infinity"):
        bad = tmp_path / f"{lit}.json"
        bad.write_text(text.replace('"interval_s":60.0', f'"interval_s":{lit}', 1))
        assert lit in _one_line_error(capsys, ["predictor", "score", "--model", str(bad), "--metrics", metrics])
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for flags, what in ((["--nodes", "0"], "--nodes"), (["--days", "-1"], "--days"), (["--interval", "0"], "--interval"),
                        (["--rate-scale", "-1"], "--rate-scale"), (["--repair-scale", "0"], "--repair-scale"),
                        (["--days", "0.0001"], "shorter than one --interval")):
        err = _one_line_error(capsys, ["predictor", "gen-trace", "--out", str(tmp_path / "gt"), *flags])
        assert what in err
    err = _one_line_error(capsys, ["predictor", "gen-trace", "--out", str(a_file / "x"), "--nodes", "2"])
    assert str(a_file / "x") in err


@pytest.mark.parametrize("jitter", [0.0, 120.0])
def test_score_matches_offline_scores_on_jittered_timestamps(tmp_path, capsys, jitter):
    """Second review, finding 4: ``score`` scored every node of a peer slot at the earliest node's timestamp,
    so with jittered timestamps its scores drifted from ``eval``'s (``score_table``); each row is scored at its
    own time now. Regular timestamps are the control."""
    rng = np.random.default_rng(4)
    rows = _fleet_rows(nodes=4, n=700, step=300.0, seed=4, t0=1_700_000_100.0)
    for r in rows:
        r[0] += float(rng.uniform(-jitter, jitter))
    rows.sort(key=lambda r: r[0])
    path = _write(tmp_path / "m.csv", COLS, rows)
    model = tmp_path / "m.json"
    assert main(["predictor", "train", "--metrics", path, "--out", str(model), "--method", "robust-z",
                 "--interval", "300"]) == 0
    out = tmp_path / "s.csv"
    assert main(["predictor", "score", "--model", str(model), "--metrics", path, "--out", str(out)]) == 0
    from trainguard.predictor.model import PredictorModel
    from trainguard.predictor.table import MetricTable
    from trainguard.predictor.training import score_table

    m = PredictorModel.load(model)
    assert m.spec.config.peer
    frame, offline = score_table(m, MetricTable.from_csv(path))
    want = {(str(n), float(t)): s for n, t, s in zip(frame.node, frame.ts, np.nan_to_num(offline, nan=0.0))}
    got = {(r["node"], float(r["timestamp"])): float(r["score"]) for r in csv.DictReader(out.open())}
    assert got.keys() == want.keys()
    diff = max(abs(got[k] - want[k]) for k in got)
    assert diff < 5e-6, diff


def test_nodes_sampled_at_different_intervals_are_refused_by_name(trained, tmp_path, capsys):
    """Second review, finding 5: n0,n1 at 60 s and n2,n3 at 300 s gave a 60 s model without a word (the check
    read the fleet's median), and scoring then degraded most rows; each node's interval is checked now."""
    rows = _fleet_rows(nodes=2, n=1500, step=60.0) + [
        [t, f"n{int(n[1:]) + 2}", *v] for t, n, *v in _fleet_rows(nodes=2, n=300, step=300.0, seed=1)]
    rows.sort(key=lambda r: r[0])
    path = _write(tmp_path / "mixed.csv", COLS, rows)
    err = _one_line_error(capsys, ["predictor", "train", "--metrics", path, "--out", str(tmp_path / "m.json")])
    assert "'n2' (300 s)" in err and "'n3' (300 s)" in err and "n0" not in err and "--resample 300" in err
    _, _, model = trained  # 60 s
    err = _one_line_error(capsys, ["predictor", "score", "--model", model, "--metrics", path])
    assert "'n2' (300 s)" in err and "'n3' (300 s)" in err
    events = _write(tmp_path / "e.csv", ["kind"], [])
    err = _one_line_error(capsys, ["predictor", "eval", "--model", model, "--metrics", path, "--events", events])
    assert "'n2' (300 s)" in err
    assert main(["predictor", "train", "--metrics", path, "--out", str(tmp_path / "m.json"), "--method", "robust-z",
                 "--resample", "300"]) == 0


@pytest.mark.parametrize("unit, factor", [("milliseconds", 1000), ("microseconds", 1_000_000)])
def test_epoch_milliseconds_are_recognised(trained, tmp_path, capsys, unit, factor):
    """Second review, finding 6: timestamps in epoch milliseconds were read as seconds ("sampled every
    60000 s ... pass --resample 60"); the error now says what they are and how to convert them."""
    d, metrics, model = trained
    rows = [[int(r[0]) * factor, *r[1:]] for r in _fleet_rows()]
    path = _write(tmp_path / "ms.csv", COLS, rows)
    for argv in (["train", "--metrics", path, "--out", str(tmp_path / "m.json")],
                 ["score", "--model", model, "--metrics", path]):
        err = _one_line_error(capsys, ["predictor", *argv])
        assert f"look like {unit} since the epoch" in err and f"divide them by {factor}" in err, err
    events = _write(tmp_path / "e.csv", ["kind"], [[1_700_003_000 * factor, "n1", "XID 79"]])
    err = _one_line_error(capsys, ["predictor", "eval", "--model", model, "--metrics", metrics, "--events", events])
    assert f"look like {unit} since the epoch" in err and "e.csv" in err


def test_data_coarser_than_the_model_asks_for_a_model_at_its_interval(trained, tmp_path, capsys):
    """Second review, finding 7: 300 s data on a 60 s model suggested ``--resample 60``, which cannot make data
    finer (the same error again); the error says the data is coarser and a model at its interval is needed."""
    _, _, model = trained  # 60 s
    path = _write(tmp_path / "m5.csv", COLS, _fleet_rows(step=300.0))
    err = _one_line_error(capsys, ["predictor", "score", "--model", model, "--metrics", path])
    assert "coarser" in err and "--resample 60" not in err and "--interval 300" in err
    err = _one_line_error(capsys, ["predictor", "score", "--model", model, "--metrics", path, "--resample", "60"])
    assert "coarser" in err
    err = _one_line_error(capsys, ["predictor", "train", "--metrics", path, "--out", str(tmp_path / "m.json"),
                                   "--interval", "60"])
    assert "coarser" in err and "--interval 300" in err and "--resample 60" not in err
    # finer data still gets --resample to the model's interval
    fine = _write(tmp_path / "m1.csv", COLS, _fleet_rows(step=20.0))
    assert "--resample 60" in _one_line_error(capsys, ["predictor", "score", "--model", model, "--metrics", fine])


def test_eval_reports_events_it_cannot_match(trained, tmp_path, capsys):
    """Second review, finding 8: an event on a node absent from the metrics, or outside the data's time span,
    was dropped without a word ("failures": 0, exit 0); they are counted and named now, and an events file of
    which no event matches the metrics at all is refused."""
    d, metrics, model = trained  # n0..n2, 400 rows at 60 s from 1_700_000_000
    t0 = 1_700_000_000.0
    events = _write(tmp_path / "e.csv", ["kind"], [[t0 + 300 * 60, "n1", "XID 79"], [t0 + 200 * 60, "n9", "GPU Lost"],
                                                   [t0 + 86400 * 30, "n2", "GPU Lost"]])
    capsys.readouterr()
    assert main(["predictor", "eval", "--model", model, "--metrics", metrics, "--events", events, "--json"]) == 0
    cap = capsys.readouterr()
    out = _no_nan_json(cap.out)
    assert out["failures"] == 1 and out["events_total"] == 3
    assert out["events_not_counted"] == {"node_not_in_metrics": 1, "outside_node_data": 1,
                                         "warning_window_not_observed": 0}
    warn = [ln for ln in cap.err.splitlines() if "not counted" in ln]
    assert len(warn) == 1 and "2 of 3" in warn[0] and "node 'n9' at" in warn[0]
    none = _write(tmp_path / "none.csv", ["kind"], [[t0 + 200 * 60, "n9", "GPU Lost"],
                                                   [t0 - 86400, "n1", "GPU Lost"]])
    err = _one_line_error(capsys, ["predictor", "eval", "--model", model, "--metrics", metrics, "--events", none])
    assert "none of its 2 events" in err


def test_order_error_names_the_file_line_and_resample(tmp_path, capsys):
    """Second review, finding 9: a node going back in time was reported by its row index ("row 17"), where
    every other message names file:LINE, and without --resample, which accepts such rows."""
    rows = _fleet_rows(nodes=1, n=200)
    rows[20], rows[21] = rows[21], rows[20]  # data rows 21 and 22: the later one is on file line 23
    path = tmp_path / "m.csv"
    _write(path, COLS, rows)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:5] + ["\n"] + lines[5:]))  # a blank line before them: line 24 now
    err = _one_line_error(capsys, ["predictor", "train", "--metrics", str(path), "--out", str(tmp_path / "m.json")])
    assert f"{path}:24: node 'n0'" in err and "line 23" in err and "--resample" in err, err


def test_score_missing_metric_error_names_the_cli_flag(trained, tmp_path, capsys):
    """Second review, finding 10: ``score`` refused data lacking a model metric with the agent's advice
    ("enable those detectors ... missing='nan'"); it names ``--missing nan`` as ``eval`` does."""
    _, _, model = trained
    path = _write(tmp_path / "m.csv", COLS[:2], [r[:4] for r in _fleet_rows()])  # no req_total
    err = _one_line_error(capsys, ["predictor", "score", "--model", model, "--metrics", path])
    assert "req_total" in err and "--missing nan" in err and "agent" not in err and "missing='nan'" not in err
    assert main(["predictor", "score", "--model", model, "--metrics", path, "--missing", "nan",
                 "--out", str(tmp_path / "s.csv")]) == 0


def test_score_summary_counts_rules_tier_alarms(tmp_path, capsys):
    """Second review, finding 11: ``score`` printed "2 above threshold" and then "node n2: 0 alarms": the
    per-node lines left out the rules tier (a NIC down); they count it now, apart from the budgeted tier."""
    rows = [r + [0.0 if r[1] == "n2" and 300 <= (r[0] - 1_700_000_000.0) / 60 < 302 else 1.0] for r in _fleet_rows()]
    path = _write(tmp_path / "m.csv", [*COLS, "nic_up"], rows)
    model = tmp_path / "m.json"
    assert main(["predictor", "train", "--metrics", path, "--out", str(model), "--method", "robust-z"]) == 0
    capsys.readouterr()
    assert main(["predictor", "score", "--model", str(model), "--metrics", path, "--out", str(tmp_path / "s.csv")]) == 0
    err = capsys.readouterr().err
    scored = list(csv.DictReader((tmp_path / "s.csv").open()))
    rules = [r for r in scored if r["source"] == "rules" and r["alarm"] == "1"]
    assert {r["node"] for r in rules} == {"n2"} and len(rules) == 2
    line = next(ln for ln in err.splitlines() if ln.startswith("node n2:"))
    assert "0 learned-tier alarms" in line and "2 rules-tier alarm(s)" in line, err
    assert "2 rules-tier" in err.splitlines()[0]


@pytest.mark.parametrize("nodes", [1, 2])
def test_train_on_fewer_nodes_than_peers_need_turns_peer_features_off(tmp_path, capsys, nodes):
    """Second review, finding 12: a model trained on one node kept peer features, which need three nodes of a
    job, so every row it scored was degraded "peer features missing"; training turns them off and says so."""
    path = _write(tmp_path / "m.csv", COLS, _fleet_rows(nodes=nodes))
    model = tmp_path / "m.json"
    capsys.readouterr()
    assert main(["predictor", "train", "--metrics", path, "--out", str(model), "--method", "robust-z"]) == 0
    out = capsys.readouterr().out
    assert "peer features off" in out and "--no-peer" in out
    from trainguard.predictor.model import PredictorModel

    assert not PredictorModel.load(model).spec.config.peer
    scores = tmp_path / "s.csv"
    assert main(["predictor", "score", "--model", str(model), "--metrics", path, "--out", str(scores)]) == 0
    assert not any("peer" in r["degraded"] for r in csv.DictReader(scores.open()))


def test_bom_header_and_unused_text_columns_are_read(trained, tmp_path, capsys):
    """Second review, finding 13: a header starting with a UTF-8 BOM gave "missing column(s) ['timestamp']",
    and a text column no model reads (``status``) blocked scoring; the BOM is skipped and unused text columns
    are ignored with a line naming them, while a bad cell in a column the model uses is still refused."""
    d, metrics, model = trained
    rows = _fleet_rows()
    plain = tmp_path / "plain.csv"
    _write(plain, COLS, rows)
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert main(["predictor", "score", "--model", model, "--metrics", str(bom), "--out", str(tmp_path / "s.csv")]) == 0
    assert main(["predictor", "train", "--metrics", str(bom), "--out", str(tmp_path / "b.json"),
                 "--method", "robust-z"]) == 0
    text = _write(tmp_path / "text.csv", [*COLS, "status"], [r + ["ok" if i % 5 else "degraded"]
                                                             for i, r in enumerate(rows)])
    events = _write(tmp_path / "e.csv", ["kind"], [])
    capsys.readouterr()
    for argv in (["score", "--model", model, "--metrics", text, "--out", str(tmp_path / "s.csv")],
                 ["eval", "--model", model, "--metrics", text, "--events", events],
                 ["train", "--metrics", text, "--out", str(tmp_path / "t.json"), "--method", "robust-z"]):
        assert main(["predictor", *argv]) == 0, argv
        cap = capsys.readouterr()
        assert "ignored non-numeric column(s): status" in cap.out + cap.err, argv
    from trainguard.predictor.model import PredictorModel

    assert "status" not in PredictorModel.load(tmp_path / "t.json").spec.metrics
    bad = [list(r) for r in rows]
    bad[100][2] = "N/A"  # latency_ms, which the model uses
    bad_cell = _write(tmp_path / "bad.csv", COLS, bad)
    for argv in (["score", "--model", model, "--metrics", bad_cell],
                 ["train", "--metrics", bad_cell, "--out", str(tmp_path / "t.json")]):
        err = _one_line_error(capsys, ["predictor", *argv])
        assert f"{bad_cell}:102 column 'latency_ms': value 'N/A' is not a number" in err


def test_small_findings_urls_nan_timestamps_and_flag_names(trained, tmp_path, capsys):
    """Second review, finding 14: a URL was read as the local path "https:/..."; a NaN timestamp's error named
    no row; ``--interval nan`` advised "--short-window nan"; ``--calib-fraction 2`` did not name the flag."""
    d, metrics, model = trained
    url = "https://example.com/m.csv"
    for argv in (["score", "--model", model, "--metrics", url], ["train", "--metrics", url, "--out", "x.json"],
                 ["eval", "--model", "https://example.com/m.json", "--metrics", metrics, "--events", url]):
        capsys.readouterr()
        with pytest.raises(SystemExit) as ei:
            main(["predictor", *argv])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert "only local files" in err and "https://example.com/m." in err
    rows = _fleet_rows()
    rows[30][0] = float("nan")  # file line 32
    nan_ts = tmp_path / "nan_ts.csv"
    with open(nan_ts, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["timestamp", "node", *COLS])
        w.writerows([["nan" if r[0] != r[0] else r[0], *r[1:]] for r in rows])
    err = _one_line_error(capsys, ["predictor", "train", "--metrics", str(nan_ts), "--out", str(tmp_path / "m.json")])
    assert f"{nan_ts}:32:" in err and "timestamp" in err
    for flag, value in (("--interval", "nan"), ("--interval", "-5"), ("--short-window", "nan"),
                        ("--long-window", "0")):
        err = _one_line_error(capsys, ["predictor", "train", "--metrics", metrics, "--out", str(tmp_path / "m.json"),
                                       flag, value])
        if value == "nan":  # refused by the parser itself, as every float flag (trainguard.cli.finite_float)
            assert err.startswith(f"trainguard: error: argument {flag}: 'nan' is not a finite number"), err
        else:
            assert err.startswith(f"trainguard: error: {flag} {value}: must be a positive"), err
    for value in ("2", "0.01"):
        err = _one_line_error(capsys, ["predictor", "train", "--metrics", metrics, "--out", str(tmp_path / "m.json"),
                                       "--calib-fraction", value])
        assert f"--calib-fraction {value}" in err and "0.05" in err and "0.8" in err


def test_eval_and_score_help_texts(capsys):
    """Second review, finding 14: ``eval --help`` said "(default 1800; default: the model's)", and --model,
    --metrics and --events of eval and score had no help text."""
    for cmd in ("eval", "score"):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main(["predictor", cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split("options:")[1].split())
        for flag in ("--model MODEL", "--metrics METRICS") + (("--events EVENTS",) if cmd == "eval" else ()):
            assert text.split(flag)[1].split()[0] not in ("--metrics", "--events", "--out", "--faults"), (cmd, flag)
        if cmd == "eval":
            assert "(default: the model's)" in text and "default 1800" not in text


def test_metrics_reads_the_file_before_listing_the_catalog(tmp_path, capsys):
    """Second review, finding 14: ``metrics --metrics bad.csv`` printed the whole catalog, then the error."""
    bad = tmp_path / "bad.csv"
    bad.write_text("time,host,x\n1,a,2\n")
    capsys.readouterr()
    assert main(["predictor", "metrics", "--metrics", str(bad)]) == 2
    cap = capsys.readouterr()
    assert cap.out == "" and "missing column" in cap.err


def test_resample_reports_samples_merged_at_other_times(tmp_path, capsys):
    """Second review, finding 14: ``--resample`` reported samples repeating a timestamp that it merged, but
    not samples at other times merged into one bin; both are counted now."""
    rows = _fleet_rows(n=900, step=20.0)  # three samples of a node in each 60 s bin
    path = _write(tmp_path / "m.csv", COLS, rows + [list(rows[-1])])  # and one exact repeat
    model = tmp_path / "m.json"
    capsys.readouterr()
    assert main(["predictor", "train", "--metrics", path, "--out", str(model), "--method", "robust-z",
                 "--resample", "60"]) == 0
    err = capsys.readouterr().err
    assert "merged 1 row(s) that repeat a node's timestamp" in err
    # 2700 distinct samples in 900 bins (3 x 300, and a bin boundary may split none: t0 is a multiple of 20)
    bins = len({(r[1], int(r[0] // 60)) for r in rows})
    assert f"merged {len(rows) - bins} row(s) sampled at other times into the 60 s bin" in err, err


def test_eval_feeds_each_failure_back_to_its_nodes_calibration(tmp_path, capsys):
    """``eval`` judges the online thresholds as the agent runs them: each failure, once it has happened, takes the
    ``early_s`` before it out of its node's calibration history (``record_incident``); its figures are those of
    the offline calibration with that feedback, which differ here from those without it."""
    from dataclasses import replace

    from trainguard.predictor.calibration import calibrate_table
    from trainguard.predictor.evaluation import evaluate_events, failures_by_node
    from trainguard.predictor.model import PredictorModel
    from trainguard.predictor.table import MetricTable
    from trainguard.predictor.training import calibration_scores, score_table

    rng = np.random.default_rng(3)
    step, days = 300.0, 9
    t0 = 1_700_000_000.0
    rows, events = [], []
    for k in range(3):
        ts = t0 + step * np.arange(days * 288)
        v = 50 + rng.standard_normal(len(ts))
        for start in np.arange(1.5, days - 0.5, 1.5) * 86400.0:  # a 3-hour incident every 36 h, then a failure
            inside = (ts >= t0 + start) & (ts < t0 + start + 3 * 3600.0)
            v[inside] += 12 + 3 * rng.standard_normal(inside.sum())
            events.append([t0 + start + 3 * 3600.0, f"n{k}", "GPU Lost"])
        rows += [[t, f"n{k}", round(x, 3)] for t, x in zip(ts, v)]
    rows.sort(key=lambda r: r[0])
    metrics = _write(tmp_path / "m.csv", ["latency_ms"], rows)
    ev_file = _write(tmp_path / "e.csv", ["kind"], sorted(events))
    model = str(tmp_path / "model.json")
    assert main(["predictor", "train", "--metrics", metrics, "--out", model, "--method", "robust-z", "--no-peer"]) == 0
    capsys.readouterr()
    assert main(["predictor", "eval", "--model", model, "--metrics", metrics, "--events", ev_file, "--json",
                 "--budget", "50"]) == 0
    out = _no_nan_json(capsys.readouterr().out)
    m = PredictorModel.load(model)
    table = MetricTable.from_csv(metrics)
    frame, score = score_table(m, table)
    ev = replace(m.eval_config, budget_per_100_node_days=50.0)
    failures = failures_by_node(np.array([e[1] for e in events], object), np.array([e[0] for e in events]))
    cal = replace(m.calibration, budget_per_day=0.5)
    fed = {n: [(t - ev.early_s, t, t) for t in f.tolist()] for n, f in failures.items()}
    reports = {}
    for name, inc in (("fed", fed), ("alone", None)):
        margin, _ = calibrate_table(frame.ts, frame.node, calibration_scores(m, frame, score), cal, inc)
        reports[name] = evaluate_events(frame.ts, frame.node, margin, 0.0, failures, ev, step).summary()
    assert reports["fed"] != reports["alone"]  # the feedback matters on this data
    for key in ("caught", "false_alarms", "hits", "early"):
        assert out[key] == reports["fed"][key], (key, out, reports)


def test_a_node_whose_interval_changes_within_the_file_is_named(tmp_path, capsys):
    """n1 scraped every 300 s, then every 150 s for its last quarter: its median spacing (300 s) passed the check,
    and the model's windows counted twice the rows over that quarter without a word."""
    rows = _fleet_rows(nodes=3, n=400, step=300.0, seed=5, t0=1_700_000_100.0)
    fast = [r for r in rows if r[1] == "n1" and r[0] >= 1_700_000_100.0 + 300 * 300.0]
    extra = [[r[0] + 150.0, *r[1:]] for r in fast]
    path = _write(tmp_path / "m.csv", COLS, sorted(rows + extra, key=lambda r: r[0]))
    err = _one_line_error(capsys, ["predictor", "train", "--metrics", path, "--out", str(tmp_path / "m.json"),
                                   "--interval", "300"])
    assert "1 of 3 nodes are sampled more often than every 300 s over part of the data" in err
    assert "n1 (" in err and "--resample 300" in err


def test_a_column_is_judged_by_its_values_not_by_its_rows(tmp_path, capsys):
    """Steps were taken row to row: a metric exported every other interval (a cell, a gap, a cell) had no step
    and was left out as holding no values, a counter among them; and a catalog or counter-named column holding
    no value at all was used: train fitted and saved a model of nothing, which score then refused."""
    rows = [[1_700_000_000 + 60 * i, f"n{k}", "", "", 50 + i % 3 if i % 2 == 0 else "",
             3 * i if i % 2 == 0 else ""] for i in range(150) for k in range(3)]
    path = _write(tmp_path / "m.csv", ["gpu_temp_c", "xid_total", "slow_gauge", "slow_seen"], rows)
    capsys.readouterr()
    assert main(["predictor", "metrics", "--metrics", path]) == 0
    lines = {ln.split()[0]: ln.split(None, 1)[1] for ln in capsys.readouterr().out.splitlines()[-4:]}
    assert lines == {"gpu_temp_c": "unused   (fewer than two values on any node)",
                     "xid_total": "unused   (fewer than two values on any node)",
                     "slow_gauge": "gauge    (values)", "slow_seen": "counter  (values)"}
    empty = _write(tmp_path / "e.csv", ["gpu_temp_c", "xid_total"], [r[:4] for r in rows])
    assert main(["predictor", "train", "--metrics", empty, "--out", str(tmp_path / "model.json")]) == 2
    assert "holds numbers the learned tier can use" in capsys.readouterr().err
    assert not (tmp_path / "model.json").exists()


def test_one_far_future_row_is_named_not_the_whole_file_converted(trained, tmp_path, capsys):
    """A few rows far beyond the rest (a garbage row) were reported as "timestamps look like nanoseconds ...
    divide them by 1000000000", which would break every good row; now the first such line is named."""
    _, metrics, model = trained
    rows = [list(r) for r in _fleet_rows()]
    rows[7][0] = 1e20
    path = _write(tmp_path / "stray.csv", COLS, rows)
    err = _one_line_error(capsys, ["predictor", "score", "--model", model, "--metrics", path])
    assert "stray.csv:9:" in err and "most rows are Unix seconds" in err and "divide" not in err, err
    events = _write(tmp_path / "e.csv", ["kind"], [[1_700_003_000, "n1", "XID 79"], [1_700_003_000, "n1", "XID 79"],
                                                   [1e19, "n0", "XID 79"]])
    err = _one_line_error(capsys, ["predictor", "eval", "--model", model, "--metrics", metrics, "--events", events])
    assert "e.csv:4:" in err and "most rows are Unix seconds" in err, err


def test_times_beyond_every_epoch_unit_are_not_called_nanoseconds(trained, tmp_path, capsys):
    """Times that are no unit of Unix time (1e25) were called nanoseconds, whose conversion still left them
    thousands of years ahead."""
    _, _, model = trained
    rows = [[1e25 + 1e12 * k, *r[1:]] for k, r in enumerate(_fleet_rows())]
    path = _write(tmp_path / "far.csv", COLS, rows)
    err = _one_line_error(capsys, ["predictor", "score", "--model", model, "--metrics", path])
    assert "not Unix times" in err and "nanoseconds since" not in err, err


def test_resample_keeps_what_a_value_rule_looks_for(tmp_path, capsys):
    """Black-box review: a 2-minute ``nic_up == 0`` in 60 s data, scored with ``--resample 300``, was averaged to
    0.6 in its bin and the fatal NIC-down rule never fired (0 rules-tier alarms; 2 without resampling)."""
    rows = [r + [0.0 if r[1] == "n2" and 300 <= (r[0] - 1_700_000_000.0) / 60 < 302 else 1.0] for r in _fleet_rows()]
    path = _write(tmp_path / "m.csv", [*COLS, "nic_up"], rows)
    coarse = tmp_path / "coarse.csv"
    with open(path) as src, open(coarse, "w") as dst:  # the model at 300 s: every fifth row of the same fleet
        lines = src.readlines()
        dst.writelines([lines[0], *[ln for i, ln in enumerate(lines[1:]) if (i // 3) % 5 == 0]])
    model = tmp_path / "m.json"
    assert main(["predictor", "train", "--metrics", str(coarse), "--out", str(model), "--method", "robust-z",
                 "--resample", "300"]) == 0
    capsys.readouterr()
    assert main(["predictor", "score", "--model", str(model), "--metrics", path, "--out", str(tmp_path / "s.csv"),
                 "--resample", "300"]) == 0
    scored = list(csv.DictReader((tmp_path / "s.csv").open()))
    rules = [r for r in scored if r["source"] == "rules" and r["alarm"] == "1"]
    assert {r["node"] for r in rules} == {"n2"} and len(rules) == 1, rules
    assert "nic-down" in rules[0]["top_features"] or "nic_up" in rules[0]["top_features"], rules[0]


def test_resample_merges_value_rule_columns_as_the_rule_needs():
    from trainguard.predictor.rules import RulesTier
    from trainguard.predictor.table import MetricTable

    rules = RulesTier([{"name": "hot", "when": {"metric": "temp_*", "op": "gt", "value": 90}},
                       {"name": "low", "when": {"metric": "fan", "op": "lt", "value": 10}},
                       {"name": "mode", "when": {"any": [{"metric": "mode", "op": "ne", "value": 1},
                                                         {"metric": "link", "op": "eq", "value": 0}]}}])
    keep = rules.bin_aggregates(["temp_gpu0", "fan", "mode", "link", "load"])
    assert keep == {"temp_gpu0": ("max", None), "fan": ("min", None), "mode": ("ne", 1.0), "link": ("eq", 0.0)}
    ts = np.array([0.0, 60.0, 120.0, 180.0, 240.0, 300.0])
    values = np.array([[50, 30, 1, 1, 1], [95, 5, 1, 0, 3], [50, 30, 2, 1, 5], [50, 30, 1, 1, 7],
                       [np.nan, np.nan, np.nan, np.nan, np.nan], [60, 40, 1, 1, 9]], dtype=float)
    table = MetricTable(["temp_gpu0", "fan", "mode", "link", "load"], ts, np.array(["a"] * 6, dtype=object), values)
    out = table.resample(300.0, keep=keep)
    assert out.values[0].tolist() == [95.0, 5.0, 2.0, 0.0, 4.0]  # extremes, the odd mode, the link down; load mean
    assert out.values[1].tolist() == [60.0, 40.0, 1.0, 1.0, 9.0]


def test_train_counts_each_failure_once_and_only_on_the_data(tmp_path, capsys):
    """Black-box review: one failure written five times trained "hgb ... 5 failures" (``auto`` needs five), as did
    one failure beside four events of nodes the metrics lack; eval counted one."""
    path = _write(tmp_path / "m.csv", COLS, _fleet_rows())
    t = 1_700_000_000.0 + 60 * 200
    for name, extra in (("rep", [f"{t},n1,xid"] * 4), ("ghost", [f"{t},ghost-{i},xid" for i in range(4)])):
        events = tmp_path / f"{name}.csv"
        events.write_text("\n".join(["timestamp,node,kind", f"{t},n1,xid", *extra]) + "\n")
        model = tmp_path / f"{name}.json"
        assert main(["predictor", "train", "--metrics", path, "--events", str(events), "--out", str(model)]) == 0
        said = capsys.readouterr()
        out, err = said.out, said.err
        assert "trained robust-z" in out and "1 failures" in out, out
        if name == "rep":
            assert "4 event(s) repeat the node and time of an earlier one; each failure counted once" in err
        else:
            assert "4 of 5 events not counted as failures: 4 on nodes absent from the metrics" in err


def test_a_reserved_column_declared_a_metric_is_named_reserved(trained, capsys):
    """Black-box review: ``--gauge timestamp`` said the column "is not in the data", which it is."""
    _, metrics, _ = trained
    assert main(["predictor", "metrics", "--metrics", metrics, "--gauge", "timestamp"]) == 2
    err = capsys.readouterr().err
    assert "['timestamp']: reserved column(s) (the row's time, node or job), not metrics" in err, err


def test_a_full_out_file_is_named(trained, capsys):
    """Black-box review: ``--out /dev/full`` said "cannot write the output (standard output)"."""
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    _, metrics, model = trained
    assert main(["predictor", "score", "--model", model, "--metrics", metrics, "--out", "/dev/full"]) == 74
    assert "cannot write the output /dev/full: No space left on device" in capsys.readouterr().err


def test_resample_merges_a_model_metric_a_rule_reads_as_train_did(capsys):
    """Review: a gauge of the model that a custom rule also reads was merged as its maximum by `score --resample`
    and as its mean by `train --resample`: every feature of it shifted between training and scoring."""
    from trainguard.predictor.cli import _resampled
    from trainguard.predictor.rules import RulesTier
    from trainguard.predictor.table import MetricTable

    rules = RulesTier([{"name": "hot", "when": {"metric": "gpu_temp_c", "op": "gt", "value": 95}},
                       {"name": "xid", "when": {"metric": "gpu_xid_79_total", "op": "increased"}}])
    ts = np.arange(10) * 60.0
    temp = np.array([50.0, 90, 50, 50, 50, 50, 50, 50, 50, 50])
    xid = np.array([0.0, 0, 1, 1, 1, 1, 1, 1, 2, 2])
    table = MetricTable(["gpu_temp_c", "gpu_xid_79_total"], ts, np.array(["a"] * 10, dtype=object),
                        np.column_stack([temp, xid]))
    out = _resampled(table, "m.csv", 300.0, set(), rules, model_metrics=["gpu_temp_c"])
    assert out.values[:, 0].tolist() == [58.0, 50.0]  # the mean, as train merges it
    assert out.values[:, 1].tolist() == [1.0, 2.0]  # a rule-only counter keeps its last value


def test_a_value_rules_merge_wins_over_a_counter_rules_last_value():
    from trainguard.predictor.rules import RulesTier

    rules = RulesTier([{"name": "inc", "when": {"metric": "x_total", "op": "increased"}},
                       {"name": "big", "when": {"metric": "x_total", "op": "gt", "value": 9}}])
    assert rules.bin_aggregates(["x_total"]) == {"x_total": ("max", None)}

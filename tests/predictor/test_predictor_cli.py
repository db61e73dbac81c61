"""``trainguard predictor``: gen-trace -> train -> eval -> score -> export, and one-line errors (exit 2)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from trainguard.cli import main
from trainguard.predictor.errors import HistoryError
from trainguard.predictor.tracegen import default_trace_dir

needs_trace = pytest.mark.skipif(
    not (default_trace_dir() / "fault_trace.json").is_file(),
    reason=f"StepFun fault trace absent at {default_trace_dir()}",
)


@needs_trace
@pytest.mark.timeout(400)  # ~10 s of CPU; the shared 2-core CI box stretches wall time (scikit-learn import)
def test_end_to_end(tmp_path, capsys):
    d = tmp_path / "trace"
    assert main(["predictor", "gen-trace", "--out", str(d), "--nodes", "6", "--days", "0.6", "--interval", "60",
                 "--rate-scale", "300", "--repair-scale", "0.02", "--seed", "2"]) == 0
    model = tmp_path / "model.json"
    assert main(["predictor", "train", "--metrics", str(d / "metrics.csv"), "--events", str(d / "events.csv"),
                 "--out", str(model), "--interval", "60", "--no-peer"]) == 0
    out = capsys.readouterr().out
    assert "threshold" in out and "ignored columns" in out  # rules-tier columns are not features
    assert main(["predictor", "eval", "--model", str(model), "--metrics", str(d / "metrics.csv"), "--events",
                 str(d / "events.csv"), "--faults", str(d / "faults.json"), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert {"recall", "precision", "false_alarms_per_100_node_days", "lead_median_s", "predictable_recall"} <= set(figures)
    # a NIC going down in the middle of the stream: the rules tier must alarm on that very row
    lines = (d / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    cells = lines[500].split(",")
    cells[header.index("nic_up")] = "0.0"
    lines[500] = ",".join(cells)
    (d / "metrics2.csv").write_text("\n".join(lines) + "\n")
    scores = tmp_path / "scores.csv"
    assert main(["predictor", "score", "--model", str(model), "--metrics", str(d / "metrics2.csv"),
                 "--out", str(scores)]) == 0
    rows = list(csv.DictReader(scores.open()))
    assert len(rows) == len(lines) - 1 and all(0.0 <= float(r["score"]) <= 1.0 for r in rows)
    hit = [r for r in rows if r["node"] == cells[1] and float(r["timestamp"]) == float(cells[0])]
    assert hit[0]["source"] == "rules" and hit[0]["alarm"] == "1" and "rule:nic-down" in hit[0]["top_features"]


def test_export_from_history(tmp_path, capsys):
    from trainguard.predictor.history import MetricHistory

    with MetricHistory(tmp_path / "h.sqlite") as h:
        h.append(1.0, "n", {"gpu_temp_c": 50.0})
        h.record_event(2.0, "n", "GPU Lost")
    assert main(["predictor", "export", "--history", str(tmp_path / "h.sqlite"), "--metrics",
                 str(tmp_path / "m.csv"), "--events", str(tmp_path / "e.csv")]) == 0
    assert "1 samples and 1 events" in capsys.readouterr().out
    assert (tmp_path / "m.csv").read_text().startswith("timestamp,node,gpu_temp_c")


def test_errors_are_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("time,host,x\n1,a,2\n")
    assert main(["predictor", "train", "--metrics", str(bad), "--out", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainguard: error:") and "missing column" in err and "\n" not in err
    unknown = tmp_path / "unknown.csv"
    unknown.write_text("timestamp,node,frobs\n" + "".join(f"{i},a,\n" for i in range(200)))
    assert main(["predictor", "train", "--metrics", str(unknown), "--out", str(tmp_path / "m.json")]) == 2
    assert "none of the columns" in capsys.readouterr().err
    wrong_rate = tmp_path / "wrong.csv"
    wrong_rate.write_text("timestamp,node,gpu_temp_c\n" + "".join(f"{60 * i},a,50\n" for i in range(200)))
    assert main(["predictor", "train", "--metrics", str(wrong_rate), "--out", str(tmp_path / "m.json"),
                 "--interval", "5"]) == 2
    err = capsys.readouterr().err
    # coarser than --interval: resampling cannot help, a model at the data's interval can
    assert "sampled every 60 s, coarser than the 5 s" in err and "--resample" not in err
    assert "--interval 60" in err
    notmodel = tmp_path / "model.json"
    notmodel.write_text("{}")
    assert main(["predictor", "score", "--model", str(notmodel), "--metrics", str(unknown)]) == 2
    assert "not a trainguard predictor model" in capsys.readouterr().err


def test_console_script_help_is_fast_and_lists_commands():
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "predictor", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0
    for cmd in ("train", "eval", "score", "export", "gen-trace"):
        assert cmd in out.stdout
    probe = subprocess.run([sys.executable, "-c", "import sys, trainguard.predictor.cli, "
                            "trainguard.predictor; print('sklearn' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False"


def test_export_reads_only_and_refuses_a_mistyped_path(tmp_path, capsys):
    # `predictor export --history` opened the store for writing: a mistyped path made a new folder and an empty
    # store and exported "0 samples" with exit 0, and a read-only copy failed with "attempt to write a readonly
    # database; move the file aside to start anew" (advice that discards the data).
    from trainguard.predictor.history import MetricHistory

    typo = tmp_path / "hsitory" / "h.sqlite"
    assert main(["predictor", "export", "--history", str(typo), "--metrics", str(tmp_path / "m.csv"),
                 "--events", str(tmp_path / "e.csv")]) == 2
    assert "no metric history there" in capsys.readouterr().err and not typo.parent.exists()
    live = MetricHistory(tmp_path / "h.sqlite")  # an agent still writing it (the WAL not checkpointed)
    live.append(1.0, "n", {"gpu_temp_c": 50.0})
    reader = MetricHistory(tmp_path / "h.sqlite", readonly=True)
    with pytest.raises(HistoryError, match="cannot store sample"):
        reader.append(2.0, "n", {"gpu_temp_c": 51.0})
    assert list(reader.to_tables()[0].ts) == [1.0]
    reader.close()
    live.close()


def test_export_since_in_milliseconds_or_past_the_data_is_said(tmp_path, capsys):
    # `--since` in milliseconds (what dashboards give) wrote two empty CSVs and exit 0, like an empty store.
    from trainguard.predictor.history import MetricHistory

    with MetricHistory(tmp_path / "h.sqlite") as h:
        h.append(1_764_800_000.0, "n", {"gpu_temp_c": 50.0})
        h.append(1_764_800_060.0, "n", {"gpu_temp_c": 51.0})
    out = ["--history", str(tmp_path / "h.sqlite"), "--metrics", str(tmp_path / "m.csv"),
           "--events", str(tmp_path / "e.csv")]
    assert main(["predictor", "export", *out, "--since", "1764800000000"]) == 2
    err = capsys.readouterr().err
    assert "looks like milliseconds" in err and "1764800000 (ms)" in err and not (tmp_path / "m.csv").exists()
    assert main(["predictor", "export", *out, "--since", "1764900000"]) == 0
    cap = capsys.readouterr()
    assert "exported 0 samples" in cap.out
    assert "from 1764800000 to 1764800060" in cap.err and "earlier --since" in cap.err
    assert main(["predictor", "export", *out, "--since", "1764800030"]) == 0
    cap = capsys.readouterr()
    assert "exported 1 samples" in cap.out and cap.err == ""


@pytest.mark.parametrize("argv", [["score", "--model", "m.json", "--metrics", "-"],
                                  ["export", "--history", "h.sqlite", "--metrics", "-", "--events", "e.csv"]])
def test_a_dash_for_a_file_is_refused_as_a_pipe(argv, tmp_path, capsys, monkeypatch):
    # `--metrics -` was read as a file named "-" ("no such file"), and an output "-" wrote a stray file "-".
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["predictor", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "not read from or written to a pipe" in err and "give the path of a file" in err
    assert not (tmp_path / "-").exists()

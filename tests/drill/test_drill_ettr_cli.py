"""``trainguard ettr`` end to end, in-process: tables, JSON figures, the PNG, and one-line errors."""

from __future__ import annotations

import json

from trainguard.cli import main


def test_ettr_cli_writes_figures_and_plot(tmp_path, capsys):
    out, png = tmp_path / "ettr.json", tmp_path / "ettr.png"
    code = main(["ettr", "--traces", "llama3", "--llama-days", "30", "--gpus", "4096", "--json", str(out),
                 "--plot", str(png)])
    assert code == 0
    text = capsys.readouterr().out
    assert "trainguard" in text and "baseline" in text and "Young" in text
    data = json.loads(out.read_text())
    systems = data[0]["systems"]
    assert data[0]["nodes"] == 512
    assert systems["baseline"]["ettr"] < systems["trainguard"]["ettr"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ettr_cli_bad_input_is_one_line(tmp_path, capsys):
    assert main(["ettr", "--traces", "weibull"]) == 2
    assert main(["ettr", "--trace", str(tmp_path)]) == 2
    assert main(["ettr", "--traces", "llama3", "--gpus", "0"]) == 2
    # an endless span used to draw faults forever (the parser refuses inf itself: trainguard.cli.finite_float)
    assert main(["ettr", "--traces", "llama3", "--llama-days", "1e12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("trainguard: error:") for line in err)
    assert "--llama-days" in err[3] and "at most 36500" in err[3]


def test_ettr_cli_output_paths_that_cannot_be_files(tmp_path, capsys):
    # A folder as --json used to compute every figure, then die with a traceback leaving FOLDER.tmp beside it.
    folder = tmp_path / "out"
    folder.mkdir()
    assert main(["ettr", "--traces", "llama3", "--llama-days", "30", "--json", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("trainguard: error: --json") and "is a folder" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert main(["ettr", "--traces", "llama3", "--llama-days", "30", "--plot", str(folder)]) == 2
    assert "--plot" in capsys.readouterr().err and not (tmp_path / "out.png").exists()
    # a file where a parent folder should be
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["ettr", "--traces", "llama3", "--llama-days", "30", "--json", str(blocker / "a.json")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_ettr_cli_plot_is_written_where_named(tmp_path, capsys):
    # matplotlib appended .png to a path without a suffix, so the plot landed in PATH.png while PATH was printed
    png = tmp_path / "ettr-plot"
    assert main(["ettr", "--traces", "llama3", "--llama-days", "30", "--plot", str(png)]) == 0
    assert f"plot: {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "ettr-plot.png").exists()


def test_ettr_cli_components_of_the_wrong_type_are_one_line(tmp_path, capsys):
    # JSON types the model cannot use: a list as a level and a number as predictable crashed with a traceback,
    # a string as predictable was split into letters, and "no" / true passed as memory_restore / predicted_share.
    cases = [({"levels": {"crash": ["process"]}}, "levels"), ({"predictable": 5}, "predictable"),
             ({"predictable": "link"}, "predictable"), ({"memory_restore": "no"}, "memory_restore"),
             ({"predicted_share": True}, "predicted_share"), ({"name": ["a"]}, "name")]
    for i, (fields, named) in enumerate(cases):
        path = tmp_path / f"c{i}.json"
        path.write_text(json.dumps({"trainguard": fields}))
        code = main(["ettr", "--traces", "llama3", "--llama-days", "5", "--components", str(path)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("trainguard: error:"), (fields, err)
        assert named in err[0], (fields, err)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"trainguard": {"predictable": ["link"], "memory_restore": False}}))
    assert main(["ettr", "--traces", "llama3", "--llama-days", "5", "--components", str(good)]) == 0


def test_ettr_cli_json_is_strict_when_no_work_is_lost(tmp_path, capsys):
    # Every fault predicted: no work-losing fault, so Young/Daly's intervals are infinite; --json wrote the bare
    # token Infinity, which is not JSON (jq and JSON.parse reject the file). Such figures are now null.
    comps, out = tmp_path / "c.json", tmp_path / "figures.json"
    comps.write_text(json.dumps({"trainguard": {"predicted_share": 1.0, "predictable": [
        "crash", "node_fault", "node_down", "link", "hang", "degraded"]}}))
    assert main(["ettr", "--traces", "llama3", "--llama-days", "5", "--components", str(comps),
                 "--json", str(out)]) == 0

    def refuse(token):
        raise AssertionError(f"non-JSON token {token} in --json output")

    data = json.loads(out.read_text(), parse_constant=refuse)
    tg = data[0]["systems"]["trainguard"]
    assert tg["young_s"] is None and tg["mtbf_work_losing_s"] is None and 0 < tg["ettr"] <= 1


def test_ettr_interval_that_is_no_interval_names_the_flag(capsys):
    # Was "trainguard: error: trainguard: checkpoint_interval_s must be a finite number of seconds >= 0, got -5.0"
    # (the model's name, not the flag), and 0 "must be > 0 (or null to optimise)", a JSON spelling.
    for value in ("-5", "0"):
        assert main(["ettr", "--traces", "llama3", "--llama-days", "30", "--interval", value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"trainguard: error: --interval {float(value)}: "), err

"""`--log-format` on every subcommand (and its environment default), and the daemon following the flag."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging

import pytest

from trainguard.agent.config import LOG_FORMAT_ENV as AGENT_LOG_FORMAT_ENV
from trainguard.agent.config import AgentConfig
from trainguard.cli import build_parser, main
from trainguard.cli_support import chosen_log_format, setup_logging


def test_every_subcommand_takes_log_format_and_the_subcommand_flag_wins(monkeypatch) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        assert any("--log-format" in a.option_strings for a in p._actions), name
    monkeypatch.delenv("TRAINGUARD_LOG_FORMAT", raising=False)
    assert chosen_log_format(parser.parse_args(["--log-format", "text", "version", "--log-format", "json"])) == "json"
    assert chosen_log_format(parser.parse_args(["version"])) is None
    monkeypatch.setenv("TRAINGUARD_LOG_FORMAT", "json")
    assert chosen_log_format(parser.parse_args(["version"])) == "json"


def test_bad_environment_format_is_a_one_line_error(monkeypatch) -> None:
    monkeypatch.setenv("TRAINGUARD_LOG_FORMAT", "yaml")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["version"]) == 2
    assert err.getvalue().count("\n") == 1 and "TRAINGUARD_LOG_FORMAT" in err.getvalue()


def test_json_records_and_the_daemon_follows_the_flag(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(AGENT_LOG_FORMAT_ENV, "auto")  # so the undo removes what setup_logging sets
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out):
            setup_logging(build_parser().parse_args(["agent", "--log-format", "json"]))
            logging.getLogger("trainguard.test").warning("hello %s", "there")
        rec = json.loads(out.getvalue().splitlines()[-1])
        assert (rec["level"], rec["logger"], rec["msg"]) == ("warning", "trainguard.test", "hello there")
        cfg = tmp_path / "agent.toml"
        cfg.write_text('[log]\nformat = "text"\n')
        import os

        assert AgentConfig.load(cfg, env=dict(os.environ)).log.format == "json"
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])


def _leaf_parsers(parser: argparse.ArgumentParser, path: str = "trainguard"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaf_parsers(sub, f"{path} {name}")


def test_no_flag_takes_nan_or_infinity(capsys) -> None:
    """float() takes "nan" and "inf", and a NaN passes every range check: `trainguard coordinator --lease-timeout
    nan` served a job whose dead nodes never expired, `trainguard drill --minutes inf` never ended."""
    floats = [(p, a.option_strings[-1]) for _, p in _leaf_parsers(build_parser()) for a in p._actions
              if a.type is float and a.option_strings]
    assert len(floats) > 40
    for p, flag in floats:  # every float flag of every subcommand, argument groups' included
        with pytest.raises(SystemExit):
            p.parse_known_args([flag, "nan"])
        assert "is not a finite number" in capsys.readouterr().err, (p.prog, flag)
    for argv in (["coordinator", "--job", "j", "--store", "memory://", "--lease-timeout", "nan"],
                 ["drill", "--minutes", "inf"], ["ettr", "--llama-days=-inf"],
                 ["predictor", "train", "--metrics", "m.csv", "--out", "x.json", "--budget", "inf"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("trainguard: error: argument --") and "is not a finite number" in err, err
        assert len(err.splitlines()) == 1


def test_listen_flags_refuse_a_port_that_is_not_one(capsys) -> None:
    """`trainguard run --metrics-listen 127.0.0.1:abc` ended in a ValueError traceback; the coordinator's
    `--listen 127.0.0.1:99999` said "address in use or not local". (`trainguard agent --grpc-listen` is checked
    by the daemon's config loader, which names grpc.listen: '' there disables TCP.)"""
    flags = [(p, a.option_strings[0]) for _, p in _leaf_parsers(build_parser()) for a in p._actions
             if a.metavar == "HOST:PORT" and a.option_strings and a.option_strings[0].endswith("listen")
             and a.option_strings[0] != "--grpc-listen"]
    assert {f for _, f in flags} >= {"--listen", "--metrics-listen", "--health-listen", "--coordinator-listen"}
    for p, flag in flags:
        for bad, why in (("127.0.0.1:abc", "port must be a number"), ("127.0.0.1:99999", "port must be a number"),
                         ("nohost", "is not HOST:PORT"), ("http://127.0.0.1:9477", "is a URL; give HOST:PORT")):
            with pytest.raises(SystemExit):
                p.parse_known_args([flag, bad])
            err = capsys.readouterr().err
            assert f"argument {flag}" in err and why in err, (p.prog, flag, err)


def test_path_flags_in_the_equals_form_expand_home_and_script_arguments_stay(tmp_path, monkeypatch):
    # The shell leaves '~' alone in '--state-dir=~/x'; it was taken as the folder './~/x'.
    monkeypatch.setenv("HOME", str(tmp_path))
    args = build_parser().parse_args(["agent", "--state-dir=~/st", "--socket=~/a.sock", "--config", "~/a.toml"])
    assert (args.state_dir, args.socket, args.config) == (f"{tmp_path}/st", f"{tmp_path}/a.sock", f"{tmp_path}/a.toml")
    args = build_parser().parse_args(["run", "--checkpoint-dir=~/ck", "--log-dir=~/logs", "train.py", "--out=~/x"])
    assert (args.checkpoint_dir, args.log_dir) == (f"{tmp_path}/ck", f"{tmp_path}/logs")
    assert args.script_args == ["--out=~/x"]  # the script's own arguments are the script's business
    args = build_parser().parse_args(["uncordon", "n1", "--coordinator", "h:1", "--job", "j", "--reason=~/not-a-path"])
    assert args.reason == "~/not-a-path"


def test_path_flag_with_an_unknown_user_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["agent", "--state-dir=~no-such-user-tg/st"])
    assert exc.value.code == 2
    assert "--state-dir: '~no-such-user-tg/st': cannot expand '~': no user 'no-such-user-tg'" in capsys.readouterr().err


def test_ctrl_c_while_the_subcommands_load_is_one_line(monkeypatch, capsys):
    import trainguard.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        code = cli.main(["version"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped main(): Python printed a traceback")
    assert code == 130
    assert capsys.readouterr().err == "trainguard: interrupted\n"


def test_output_to_a_full_disk_is_one_line_and_its_own_exit_code() -> None:
    """`trainguard detect > /dev/full` was a traceback and exit 1, the code of a failed detector: a health
    probe read a full disk as a hardware fault. It is one line naming the cause, and exit 74 (EX_IOERR)."""
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "trainguard", "detect", "--only", "host", "--window", "0"],
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 74 and "cannot write the output (standard output): No space left on device" in r.stderr, \
        r.stderr

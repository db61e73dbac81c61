"""The one TOML loader (trainguard.config_loader): every error class it raises, from real files on disk, each a
single line naming the file, the table.key and what is expected."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainguard.config_loader import build, check_fields, config_field, read_toml, select_table
from trainguard.errors import ConfigError


class DemoError(ConfigError):
    """Stands for a subsystem's own ConfigError subclass."""


@dataclass
class Limits:
    retries: int = 3
    backoff_s: float = 1.0
    deadline_s: float = config_field(default=math.inf, inf=True)  # inf: no deadline
    target: float = config_field(default=math.nan, nan=True)  # nan: unset


@dataclass
class Demo:
    name: str
    enabled: bool = True
    hosts: list[str] = field(default_factory=list)
    weights: tuple[float, ...] = ()
    labels: dict[str, int] = field(default_factory=dict)
    cache: str | None = None
    limits: Limits = field(default_factory=Limits)
    kinds: list[str] = config_field(default_factory=list, expected="an array of kind names")
    origin: str = config_field(default="", internal=True)


def load(tmp_path: Path, text: str | bytes, table: str = "demo") -> Demo:
    path = tmp_path / "demo.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    doc = read_toml(path, error=DemoError)
    return build(Demo, select_table(doc, table, str(path), error=DemoError) or {}, source=str(path), table=table,
                 error=DemoError, extra={"origin": "test"})


def error_of(tmp_path: Path, text: str | bytes, table: str = "demo") -> str:
    with pytest.raises(DemoError) as info:
        load(tmp_path, text, table)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'demo.toml'}: ") and "\n" not in message, message
    return message


def test_a_good_file_builds_typed_values_and_nested_tables(tmp_path: Path) -> None:
    demo = load(tmp_path, '[demo]\nname = "a"\nhosts = ["h1"]\nweights = [1, 0.5]\nlabels = {x = 1}\n'
                          'cache = "/c"\n[demo.limits]\nretries = 5\nbackoff_s = 2\ndeadline_s = inf\n')
    assert demo == Demo(name="a", hosts=["h1"], weights=(1.0, 0.5), labels={"x": 1}, cache="/c",
                        limits=Limits(retries=5, backoff_s=2.0, deadline_s=math.inf), origin="test")
    assert isinstance(demo.limits.backoff_s, float) and isinstance(demo.weights[0], float)  # int taken for float
    assert math.isnan(demo.limits.target)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(DemoError, match=r"missing\.toml: config file not found; pass an existing --config PATH$"):
        read_toml(tmp_path / "missing.toml", error=DemoError, flag="--config")
    with pytest.raises(DemoError, match=r": is a directory; --config takes a TOML file$"):
        read_toml(tmp_path, error=DemoError, flag="--config")
    plain = tmp_path / "plain"
    plain.write_text("")
    with pytest.raises(DemoError, match=r"plain/x\.toml: cannot read config file \(Not a directory\)"):
        read_toml(plain / "x.toml", error=DemoError)


def test_bytes_that_are_not_utf8_are_named_by_offset_and_line(tmp_path: Path) -> None:
    message = error_of(tmp_path, b'[demo]\nname = "a"\ncache = "/caf\xe9"\n')
    assert "not UTF-8 text (invalid continuation byte at byte 31, line 3); save the file as UTF-8" in message


def test_a_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    message = error_of(tmp_path, '[demo]\nname = "a"\nhosts = ["h1" "h2"]\n')
    assert "not valid TOML at line 3, column 15: " in message and "fix the file" in message


@pytest.mark.parametrize("text, needle", [
    # tables
    ("demo = 3\n", "demo: expected a table [demo], got an integer 3"),
    ('[demo]\nname = "a"\nlimits = 2\n', "demo.limits: expected a table [demo.limits] of retries, backoff_s"),
    # keys
    ('[demo]\nname = "a"\nhost = ["h"]\n', "unknown key 'host' in [demo]; did you mean 'hosts'? known tables and keys: name,"),
    ('[demo]\nname = "a"\nzzz = 1\n', "unknown key 'zzz' in [demo]; known tables and keys: name, enabled"),
    ('[demo]\nname = "a"\n[demo.limits]\nretry = 1\n', "unknown key 'retry' in [demo.limits]; did you mean 'retries'? known keys: retries,"),
    ('[demo]\nname = "a"\norigin = "x"\n', "unknown key 'origin' in [demo]"),  # internal: the program sets it
    ("[demo]\nenabled = true\n", "demo.name: required key missing from [demo]; set it"),
    # types
    ('[demo]\nname = 7\n', "demo.name: expected a string, got an integer 7"),
    ('[demo]\nname = "a"\nenabled = "false"\n', "demo.enabled: expected a boolean (true or false), got a string"),
    ('[demo]\nname = "a"\n[demo.limits]\nretries = true\n', "demo.limits.retries: expected an integer, got a boolean"),
    ('[demo]\nname = "a"\n[demo.limits]\nretries = 2.0\n', "demo.limits.retries: expected an integer, got a float"),
    ('[demo]\nname = "a"\n[demo.limits]\nbackoff_s = "1s"\n', "demo.limits.backoff_s: expected a number, got a str"),
    ('[demo]\nname = "a"\nhosts = "h1"\n', "demo.hosts: expected an array of strings, got a string 'h1'"),
    ('[demo]\nname = "a"\nhosts = ["h1", 2]\n', "demo.hosts[1]: expected a string, got an integer 2"),
    ('[demo]\nname = "a"\nkinds = "x"\n', "demo.kinds: expected an array of kind names, got a string 'x'"),
    ('[demo]\nname = "a"\nlabels = {x = "1"}\n', "demo.labels.x: expected an integer, got a string '1'"),
    ('[demo]\nname = "a"\ncache = 1\n', "demo.cache: expected a string, got an integer 1"),
    # nan and inf: refused unless the field allows them
    ('[demo]\nname = "a"\n[demo.limits]\nbackoff_s = nan\n', "demo.limits.backoff_s: expected a finite number (nan"),
    ('[demo]\nname = "a"\n[demo.limits]\nbackoff_s = -inf\n', "demo.limits.backoff_s: expected a finite number (inf"),
    ('[demo]\nname = "a"\n[demo.limits]\ndeadline_s = nan\n', "demo.limits.deadline_s: expected a finite number (nan"),
    ('[demo]\nname = "a"\n[demo.limits]\ntarget = inf\n', "demo.limits.target: expected a finite number (inf"),
    ('[demo]\nname = "a"\nweights = [1.0, nan]\n', "demo.weights[1]: expected a finite number (nan"),
])
def test_each_bad_value_is_one_line_naming_file_key_and_what_is_expected(tmp_path: Path, text: str,
                                                                          needle: str) -> None:
    message = error_of(tmp_path, text)
    assert needle in message, message


def test_top_level_keys_and_a_missing_table(tmp_path: Path) -> None:
    path = tmp_path / "demo.toml"
    path.write_text('nmae = "a"\n')
    with pytest.raises(DemoError, match=r"unknown key 'nmae' at the top level; did you mean 'name'\?"):
        build(Demo, read_toml(path, error=DemoError), source=str(path), error=DemoError)
    path.write_text('name = "a"\n[limit]\nretries = 1\n')
    with pytest.raises(DemoError, match=r"unknown table \[limit\]; did you mean 'limits'\?"):
        build(Demo, read_toml(path, error=DemoError), source=str(path), error=DemoError)
    assert select_table(read_toml(path, error=DemoError), "demo", str(path)) is None
    assert select_table(read_toml(path, error=DemoError), "limit", str(path)) == {"retries": 1}


def test_allowed_nan_and_inf_pass(tmp_path: Path) -> None:
    demo = load(tmp_path, '[demo]\nname = "a"\n[demo.limits]\ndeadline_s = inf\ntarget = nan\n')
    assert demo.limits.deadline_s == math.inf and math.isnan(demo.limits.target)


def test_objects_made_in_code_get_the_same_checks() -> None:
    check_fields(Limits(retries=1), "demo.limits")
    with pytest.raises(ConfigError, match=r"^demo\.limits\.retries: expected an integer, got a boolean True$"):
        check_fields(Limits(retries=True), "demo.limits")
    with pytest.raises(DemoError, match=r"^x\.toml: demo\.limits\.backoff_s: expected a finite number"):
        check_fields(Limits(backoff_s=math.nan), "demo.limits", source="x.toml", error=DemoError)


def test_integers_past_what_python_or_a_float_takes_are_one_line_errors(tmp_path: Path) -> None:
    # past float's range where a float goes: float() raised OverflowError (a traceback from `trainguard agent`)
    message = error_of(tmp_path, f'[demo]\nname = "a"\n[demo.limits]\nbackoff_s = 1{"0" * 400}\n')
    assert "demo.limits.backoff_s: expected a number within a float's range, got an integer 1000" in message
    # more digits than int() converts: tomllib's ValueError escaped the loader
    message = error_of(tmp_path, f'[demo]\nname = "a"\n[demo.limits]\nretries = 1{"0" * 5000}\n')
    assert "not valid TOML: Exceeds the limit (4300 digits) for integer string conversion" in message


def test_empty_and_comment_only_files_and_arrays_of_tables(tmp_path: Path) -> None:
    for text in ("", "# nothing\n\n# here\n"):
        assert select_table(read_toml(_write(tmp_path, text), error=DemoError), "demo", "x", error=DemoError) is None
    assert "demo: expected a table [demo], got an array" in error_of(tmp_path, '[[demo]]\nname = "a"\n')
    assert "expected a number, got datetime" in error_of(tmp_path, '[demo]\nname = "a"\n[demo.limits]\n'
                                                                  'backoff_s = 1979-05-27T07:32:00Z\n')


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "other.toml"
    path.write_text(text)
    return path


def test_a_file_saved_with_a_byte_order_mark_reads(tmp_path: Path) -> None:
    # Windows editors save UTF-8 with a BOM; tomllib said "Invalid statement (at line 1, column 1)" of it
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + '[demo]\nname = "caf\u00e9"\n'.encode())
    assert read_toml(path, error=DemoError) == {"demo": {"name": "caf\u00e9"}}


def test_a_fifo_without_a_writer_is_refused_not_waited_on_forever(tmp_path: Path, monkeypatch) -> None:
    import os
    import time

    import trainguard.config_loader as loader

    fifo = tmp_path / "agent.toml"
    os.mkfifo(fifo)
    monkeypatch.setattr(loader, "PIPE_READ_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="agent.toml: the pipe gave no end of its config file within 0.5 s"):
        read_toml(str(fifo))  # the open itself blocked forever: the command never started
    assert time.monotonic() - t0 < 5


def test_a_pipe_with_a_writer_is_read_like_a_file(tmp_path: Path) -> None:
    # `--config <(envsubst < agent.toml.in)`: bash hands the command a pipe whose writer is already there
    import subprocess
    import sys

    code = ("import sys; from trainguard.config_loader import read_toml; "
            "print(read_toml(sys.argv[1]))")
    out = subprocess.run(["bash", "-c", f'{sys.executable} -c "{code}" <(sleep 0.3; printf "[a]\\nx = 1\\n")'],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "'a': {'x': 1}" in out.stdout


def test_a_file_far_larger_than_any_config_is_refused_before_it_is_read(tmp_path: Path) -> None:
    big = tmp_path / "train.log"
    with open(big, "wb") as fh:
        fh.truncate(300 << 20)  # sparse: reading it whole took seconds and 300 MiB of memory
    with pytest.raises(ConfigError, match=r"train.log: 300 MiB is no config file \(at most 4 MiB\)"):
        read_toml(str(big))

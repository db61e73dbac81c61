"""``CheckpointConfig.from_toml`` through the shared loader: every problem in the file is one line that names the
file, the key and what to do (before, a ``checkpoint = 5`` line was a TypeError, a missing ``directory`` a Python
signature, and no range error named the file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.checkpoint import CheckpointConfig
from trainguard.checkpoint.errors import CheckpointConfigError


def error_of(path: Path, text: str | bytes) -> str:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    with pytest.raises(CheckpointConfigError) as info:
        CheckpointConfig.from_toml(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


@pytest.mark.parametrize("text, needle", [
    # was: TypeError: 'int' object is not iterable
    ("checkpoint = 5\n", "checkpoint: expected a table [checkpoint], got an integer 5"),
    # was: bad [checkpoint] table: CheckpointConfig.__init__() missing 1 required positional argument
    ("[checkpoint]\nreplicated = true\n", "checkpoint.directory: required key missing from [checkpoint]"),
    # was: "checkpoint.directory is empty", for a number
    ("[checkpoint]\ndirectory = 5\n", "checkpoint.directory: expected a string, got an integer 5"),
    # was: no file, no suggestion
    ('[checkpoint]\ndirectory = "/data/ck"\n[checkpoint.disk]\nkep = 3\n',
     "unknown key 'kep' in [checkpoint.disk]; did you mean 'keep'?"),
    # range and consistency rules of the class itself now name the file too
    ('[checkpoint]\ndirectory = "/data/ck"\n[checkpoint.disk]\nkeep = 0\n', "checkpoint.disk.keep is 0"),
    ('[checkpoint]\ndirectory = "/data/ck"\n[checkpoint.persist]\nbandwidth_mib_s = nan\n',
     "checkpoint.persist.bandwidth_mib_s: expected a finite number (nan is not allowed"),
    # a file without a [checkpoint] table is read from its top level, and its keys are named as written
    ("directory = 5\n", "directory: expected a string, got an integer 5"),
    # was: "cannot read checkpoint config FILE: Invalid statement (at line 2, column 5)" / a codec message
    ('[checkpoint]\ndir ectory = "x"\n', "not valid TOML at line 2, column 5"),
    (b'[checkpoint]\ndirectory = "/caf\xe9"\n', "not UTF-8 text (invalid continuation byte at byte 30, line 2)"),
])
def test_a_bad_file_is_one_line_naming_file_and_key(tmp_path: Path, text: str | bytes, needle: str) -> None:
    message = error_of(tmp_path / "ckpt.toml", text)
    assert needle in message, message


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointConfigError, match=r"nope\.toml: checkpoint config file not found; check the path$"):
        CheckpointConfig.from_toml(tmp_path / "nope.toml")


def test_numbers_are_typed_as_the_fields(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.toml"
    path.write_text('[checkpoint]\ndirectory = "/data/ck"\n[checkpoint.persist]\nbandwidth_mib_s = 100\n')
    cfg = CheckpointConfig.from_toml(path)
    assert cfg.persist.bandwidth_mib_s == 100.0 and isinstance(cfg.persist.bandwidth_mib_s, float)

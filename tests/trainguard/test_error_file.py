"""A hook user's uncaught exception reaches the launcher's summary (``$TORCHELASTIC_ERROR_FILE``, as ``@record``
writes it): a restore that raised in every generation of a shrunk job read only "exit code 1" four times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trainguard.agent.generation import read_error_file
from trainguard.error_file import record


def test_the_exception_is_written_as_record_writes_it_and_a_written_file_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "rank0" / "error.json"
    try:
        raise ValueError("step 19 was saved by 2 ranks but this job has 1")
    except ValueError as exc:
        assert record(exc, str(path))
    assert read_error_file(str(path)) == "ValueError: step 19 was saved by 2 ranks but this job has 1"
    assert "Traceback" in json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"]
    assert not record(RuntimeError("later"), str(path))  # @record's own file (written first) stays
    assert read_error_file(str(path)).startswith("ValueError")
    assert not record(RuntimeError("nowhere"), "")


def test_a_hook_users_uncaught_exception_is_recorded(tmp_path: Path, tg_env: dict) -> None:
    script = tmp_path / "train.py"
    script.write_text("import trainguard\nsession = trainguard.init()\nraise RuntimeError('disk full on /data/7')\n")
    err = tmp_path / "errors" / "error.json"
    r = subprocess.run([sys.executable, str(script)], env={**tg_env, "TORCHELASTIC_ERROR_FILE": str(err)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "disk full on /data/7" in r.stderr  # still reported as before
    assert read_error_file(str(err)) == "RuntimeError: disk full on /data/7"


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ itself is broken")


def test_an_exception_whose_str_raises_is_recorded_and_still_reported(tmp_path: Path, monkeypatch) -> None:
    import trainguard.error_file as error_file

    path = tmp_path / "error.json"
    reported: list[BaseException] = []
    monkeypatch.setattr(error_file, "_installed", False)
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: reported.append(exc))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    error_file.install()
    exc = _Unprintable()
    sys.excepthook(type(exc), exc, None)  # before: the hook's own RuntimeError replaced the worker's error
    assert reported == [exc]
    assert read_error_file(str(path)) == "_Unprintable: <exception str() failed>"

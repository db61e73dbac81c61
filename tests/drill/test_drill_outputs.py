"""`trainguard drill`/`ettr` output paths: refused before the work when they cannot be written."""

from __future__ import annotations

import contextlib
import io

import pytest

from trainguard.cli import main
from trainguard.drill.report import DrillError, check_output_file


def test_an_output_whose_folder_cannot_be_made_is_refused_before_the_drill(tmp_path):
    # /proc refuses a new folder even to root, as a folder a user may not write refuses them: --json or --plot
    # there passed the check and the drill ran its minutes, then failed writing the report.
    with pytest.raises(DrillError, match=r"--json /proc/tg-no-such/out.json: cannot write in /proc/tg-no-such"):
        check_output_file("/proc/tg-no-such/out.json", "--json")
    check_output_file(str(tmp_path / "new" / "out.json"), "--json")  # a folder it can make is fine
    assert [p.name for p in (tmp_path / "new").iterdir()] == []  # and the probe leaves nothing behind
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["drill", "--minutes", "0.1", "--plot", "/proc/tg-no-such/soak.png"])
    assert rc == 2 and "--plot /proc/tg-no-such/soak.png: cannot write" in err.getvalue(), err.getvalue()

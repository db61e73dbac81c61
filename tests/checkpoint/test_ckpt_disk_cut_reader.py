"""A checkpoint data file on the disk tier (or fetched from a ``file://`` remote) cut short by another process
(truncate(1): an operator's cleanup, another job's gc) while a restore reads it: that copy fails as damaged and
restore falls back to an older step, never a SIGBUS.

The restore mapped the data file; a page past the new end raised SIGBUS and killed the training process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "disk_cut_reader_worker.py"


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_restore_falls_back_when_the_data_file_is_cut_under_it(tmp_path, tier) -> None:
    p = subprocess.run([sys.executable, str(WORKER), tier, str(tmp_path), "1"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, f"the restoring process died (rc {p.returncode}): {p.stderr[-2000:]}"
    # Step 2's copy was cut: step 1 is restored whole from the same tier (it reads intact files right too).
    assert f"restored=1 tier={tier} same=True" in p.stdout, p.stdout + p.stderr[-2000:]
    # The failed copy is named: its tier, step, the byte where it ends and the file.
    assert (f"not restoring step 2 from the {tier} tier: {tier} copy of step 2 rank 0: data file ends at "
            "byte 4096, manifest says 8388608; ") in p.stderr
    name = "disk/j/step_000000000002/rank_00000.data" if tier == "disk" else "trainguard-restore-"
    assert f"{name}" in p.stderr and "is torn (truncated while it was read)" in p.stderr

"""A shared-memory slot cut short (truncate(1) from another process) while the persist process or a restore reads
it: the read fails as a damaged copy, never a SIGBUS.

Both mapped the slot at its size; a page past the new end raised SIGBUS, which killed the trainer in the middle
of a restore, or the persist process (leaving a torn temporary data file on disk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "slot_cut_readers_worker.py"


def _run(mode: str, shm: str, disk: str, cut: bool) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, str(WORKER), mode, shm, disk, "1" if cut else "0"], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, f"the {mode} process died (rc {p.returncode}): {p.stderr[-2000:]}"
    return p


@pytest.mark.parametrize("cut", [False, True])
def test_restore_falls_back_to_disk_when_the_slot_is_cut_under_it(shm_dir, tmp_path, cut) -> None:
    p = _run("restore", shm_dir, str(tmp_path / "ckpt"), cut)
    assert f"restored=1 tier={'disk' if cut else 'memory'} same=True" in p.stdout
    if cut:
        assert "data file ends at byte 4096, manifest says 8388608" in p.stderr


@pytest.mark.parametrize("cut", [False, True])
def test_persist_reports_a_cut_slot_and_writes_no_torn_file(shm_dir, tmp_path, cut) -> None:
    disk = tmp_path / "ckpt"
    p = _run("persist", shm_dir, str(disk), cut)
    reports = [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("report ")]
    tiers = {r["tier"]: r for r in reports if r["op"] == "tier"}
    assert set(tiers) == {"memory", "disk"}
    assert [r["op"] for r in reports if r["op"] != "tier"] == ["slot_free", "released"]
    files = sorted(f.name for f in disk.rglob("*") if f.is_file())
    slot_manifest = os.path.join(shm_dir, "job", "rank_00000", "slot_0.manifest.json")
    if not cut:
        assert tiers["memory"]["ok"] and tiers["disk"]["ok"]
        assert "rank_00000.data" in files and os.path.exists(slot_manifest)
        return
    for r in tiers.values():
        assert not r["ok"] and "ends at byte 2097152" in r["error"] and "cut short" in r["error"]
    assert not [f for f in files if ".data" in f], files  # no torn data file, temporary or final
    assert not os.path.exists(slot_manifest)  # the memory tier does not list a copy it could not read

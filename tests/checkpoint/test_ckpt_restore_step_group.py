"""``Checkpointer.restore(state, step=N)`` inside a process group is a collective, as a restore without ``step`` is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tg_testutil import communicate_all

HERE = Path(__file__).parent


def test_restore_of_a_named_step_raises_on_every_rank_when_one_rank_cannot_load_it(tmp_path):
    # Rank 1's copy of step 2 is gone and rank 0's copy of step 1 is corrupt. restore(step=2) used to return 2 on
    # rank 0 while rank 1 raised alone, so the job went on with half its ranks. Now both raise the same error,
    # naming the rank that failed and why, and the group stays usable (the barrier after each restore returns).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "restore_step_worker.py"), str(r), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    facts = []
    for r, (rc, stdout, stderr) in enumerate(communicate_all(procs, 120)):
        assert rc == 0, f"rank {r} failed:\n{stderr[-4000:]}"
        facts.append(json.loads(stdout.strip().splitlines()[-1]))
    by_rank = [f["restores"] for f in facts]
    for r in (0, 1):
        first, two, one, last = by_rank[r]
        assert first["got"] == [3] and first["w"] == 10 * r + 3
        assert last["got"] == [3] and last["w"] == 10 * r + 3
        assert two["got"][0] == "NoCheckpointError", two
        assert one["got"][0] == "NoCheckpointError", one
    # The same message on every rank, naming the failing rank and its reason.
    for i in (1, 2):
        assert by_rank[0][i]["got"][1] == by_rank[1][i]["got"][1]
    two_msg, one_msg = by_rank[0][1]["got"][1], by_rank[0][2]["got"][1]
    assert "1 of 2 ranks could not load step 2" in two_msg and "rank 1: NoCheckpointError" in two_msg
    assert "missing" in two_msg and "rank 0:" not in two_msg
    assert "rank 0: NoCheckpointError" in one_msg and "checksum" in one_msg and "rank 1:" not in one_msg


def test_a_long_reason_reaches_every_rank_whole_enough(tmp_path):
    # Under a deep checkpoint folder the failing rank's reason (it names the missing file) made the JSON report
    # longer than gather_text sends; cut at the byte limit it parsed on no rank, and every rank raised
    # "JSONDecodeError: Unterminated string" instead of the restore's error.
    deep = tmp_path.joinpath(*(["d" * 200] * 12))
    deep.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(HERE / "restore_step_worker.py"), str(r), str(deep)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    msgs = []
    for r, (rc, stdout, stderr) in enumerate(communicate_all(procs, 120)):
        assert rc == 0, f"rank {r} failed:\n{stderr[-4000:]}"
        two = json.loads(stdout.strip().splitlines()[-1])["restores"][1]
        assert two["got"][0] == "NoCheckpointError", two
        msgs.append(two["got"][1])
    assert msgs[0] == msgs[1] and "rank 1: NoCheckpointError" in msgs[0] and "..." in msgs[0], msgs[0]

"""The persist process's unix socket under a temp directory whose path is too long for a socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, tempfile, torch
    from trainguard.checkpoint import Checkpointer, CheckpointConfig
    from trainguard.checkpoint.service import CheckpointService

    cfg = CheckpointConfig(directory=sys.argv[1], memory={"directory": sys.argv[2]})
    with Checkpointer(cfg, job="longtmp") as ck:
        saved = [ck.save({"w": torch.full((4,), float(s))}, s).wait() for s in range(2)]
        steps = [(i.step, "disk" in i.tiers) for i in ck.steps()]
    svc = CheckpointService(job="agent-owned", shm_dir=sys.argv[2]).start()
    agent_owned = svc.proc.poll() is None
    svc.stop()
    print(json.dumps({"saved": saved, "steps": steps, "agent_owned": agent_owned, "tmp": tempfile.gettempdir()}))
""")


def test_a_temp_directory_too_long_for_a_socket_still_persists(tmp_path, shm_dir):
    # $TMPDIR on a scratch filesystem (/lustre/scratch/<user>/tmp/<job id>/...): the private persist process could
    # not bind its socket there (AF_UNIX path too long), exited at start, and not one checkpoint was saved.
    long_tmp = tmp_path / ("t" * max(1, 110 - len(str(tmp_path))))
    long_tmp.mkdir()
    assert len(str(long_tmp)) > 107
    env = dict(os.environ, TMPDIR=str(long_tmp))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt"), shm_dir], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["tmp"] == str(long_tmp)
    assert facts["saved"] == [True, True] and facts["steps"] == [[0, True], [1, True]]
    assert facts["agent_owned"]

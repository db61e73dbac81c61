"""A finished DDP-style worker must exit 0, not die with SIGABRT while the interpreter shuts down (gloo)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import tg_testutil
from tg_testutil import REPO, communicate_all
from trainguard import gloo_exit

# The race made certain: a collective issued in a backward pass completes on the gloo thread while the main
# thread holds the GIL (a long switch interval keeps the waiting thread from asking for it), the script ends,
# and an object finalized during shutdown releases the GIL. Rank 1 joins the collective late so that rank 0's
# Python side has dropped the work before it completes, as DDP does once a bucket's result is in.
SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    import torch.distributed as dist

    sys.setswitchinterval(30)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    if sys.argv[1] == "hook":
        import trainguard
        trainguard.init()
    futures = []

    class AllReduceGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            if rank == 1:
                time.sleep(0.5)
            futures.append(dist.all_reduce(grad.clone(), async_op=True).get_future())
            return grad

    x = torch.ones(3, requires_grad=True)
    AllReduceGrad.apply(x).sum().backward()
    while not futures[0].done():
        pass

    class ReleasesTheGilWhenFinalized:
        def __del__(self):
            time.sleep(0.05)

    cycle = ReleasesTheGilWhenFinalized()
    cycle.me = cycle
""")


def _run_pair(tmp_path: Path, env: dict, mode: str) -> list[subprocess.CompletedProcess]:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    port = tg_testutil.free_port()
    procs = [subprocess.Popen([sys.executable, str(script), mode], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env=dict(env, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port)))
             for r in range(2)]
    return [subprocess.CompletedProcess(p.args, rc, stdout, "")
            for p, (rc, stdout, _) in zip(procs, communicate_all(procs, timeout=90))]


@pytest.mark.timeout(180)
def test_a_worker_with_the_hook_exits_cleanly_after_its_last_collective(tmp_path: Path, tg_env: dict) -> None:
    for r in _run_pair(tmp_path, tg_env, "hook"):
        assert r.returncode == 0, r.stdout[-2000:]


@pytest.mark.timeout(180)
def test_the_same_worker_without_the_hook_aborts_on_this_torch(tmp_path: Path, tg_env: dict) -> None:
    """The control: shows the scenario above is the torch bug the guard exists for."""
    results = _run_pair(tmp_path, tg_env, "none")
    if all(r.returncode == 0 for r in results):
        pytest.skip("this torch no longer aborts at exit in this scenario; trainguard.gloo_exit may be dropped")
    assert any(r.returncode == -6 and "terminate called" in r.stdout for r in results), \
        [(r.returncode, r.stdout[-500:]) for r in results]


def test_gloo_worker_threads_are_counted_by_name(tmp_path: Path) -> None:
    for tid, name in ((100, "python"), (101, gloo_exit.GLOO_WORKER_THREAD), (102, gloo_exit.GLOO_WORKER_THREAD),
                      (103, "gloo_tcp_loop")):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "comm").write_text(name + "\n")
    (tmp_path / "104").mkdir()  # a thread that ended between the listing and the read
    assert gloo_exit.gloo_worker_threads(str(tmp_path)) == 2
    assert gloo_exit.gloo_worker_threads(str(tmp_path / "missing")) is None

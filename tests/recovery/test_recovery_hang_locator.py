"""Hang localisation (recovery/hang_locator.py) on real stacks: a gloo job where one rank is stuck in its data
loader while the others wait for it in an all-reduce, dumped with py-spy and with faulthandler."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tg_testutil import until
from trainguard.agent.step_timing import stack_evidence
from trainguard.detectors.stackdump import find_py_spy
from trainguard.recovery.hang_locator import HangCollection, is_waiting, localise, parse_main_stack

SCRIPT = Path(__file__).parent / "scripts" / "hang_ranks.py"


@pytest.fixture()
def hung_job(tmp_path):
    """3 real ranks over gloo; rank 2 hangs in load_batch(), ranks 0 and 1 wait in all_reduce."""
    ready = tmp_path / "ready"
    ready.mkdir()
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(r), "3", str(tmp_path / "store"), "2", str(ready)])
             for r in range(3)]
    try:
        assert until(lambda: len(list(ready.iterdir())) == 3, timeout=60), "ranks never reached their places"
        yield {r: p.pid for r, p in enumerate(procs)}
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@pytest.mark.timeout(120)
@pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")
def test_py_spy_stacks_of_a_real_hung_job_name_the_stuck_rank(hung_job):
    import time

    time.sleep(0.3)  # the waiting ranks enter the all-reduce right after touching their marker
    ev = stack_evidence(hung_job, timeout_s=10.0)
    assert {ev[f"method.{r}"] for r in range(3)} == {"py-spy"}
    loc = localise({r: ev[f"stack.{r}"] for r in range(3)}, {0: "a", 1: "a", 2: "b"})
    assert loc.outlier_ranks == (2,)
    assert loc.outlier_nodes == ("b",)
    assert loc.outlier_frame.startswith("load_batch")
    assert "all_reduce" in loc.majority_frame or is_waiting(parse_main_stack(ev["stack.0"]))
    assert loc.groups == 2 and loc.ranks_seen == 3
    # A tie (one waiting rank against the stuck one) still names the stuck rank.
    tie = localise({0: ev["stack.0"], 2: ev["stack.2"]}, {0: "a", 2: "b"})
    assert tie.outlier_ranks == (2,)


# The signal landed on the heartbeat thread ("Current thread"); the main thread, listed last, is what counts.
FAULTHANDLER_DUMP = '''Current thread 0x00007f3a2b7fe640 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/repo/trainguard/hook.py", line 93 in _loop

Thread 0x00007f3a3c1b4740 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/repo/train.py", line 40 in train_step
  File "/repo/train.py", line 60 in <module>
'''


def test_faulthandler_dumps_parse_to_the_current_thread_without_line_numbers():
    sig = parse_main_stack(FAULTHANDLER_DUMP)
    assert sig[0] == "all_reduce (distributed_c10d.py)"
    assert sig == parse_main_stack(FAULTHANDLER_DUMP.replace("line 2501", "line 2502"))
    frozen = FAULTHANDLER_DUMP.replace('  File "/repo/train.py", line 60 in <module>',
                                       '  File "<frozen runpy>", line 88 in _run_code')
    assert parse_main_stack(frozen)[-1] == "_run_code (runpy.py)"
    assert is_waiting(sig)
    assert parse_main_stack("no stack: pid 1 exited") == ("<no stack>",)


def test_all_alike_has_no_outlier_and_a_missing_stack_is_an_outlier():
    same = localise({0: FAULTHANDLER_DUMP, 1: FAULTHANDLER_DUMP, 2: FAULTHANDLER_DUMP}, {0: "a", 1: "a", 2: "b"})
    assert same.outlier_ranks == () and same.groups == 1
    missing = localise({0: FAULTHANDLER_DUMP, 1: FAULTHANDLER_DUMP, 2: "no stack: timeout"}, {0: "a", 1: "a", 2: "b"})
    assert missing.outlier_ranks == (2,) and missing.outlier_frame == "<no stack>"


def test_collection_completes_when_every_rank_answered_or_at_the_deadline():
    col = HangCollection(3, "id", 0.0, 8.0, frozenset({0, 1, 2}))
    assert col.add("a", {"stack.0": "x", "stack.1": "y", "method.0": "py-spy", "request_id": "id"}) == 2
    assert not col.complete(1.0)
    assert col.complete(8.0)
    col.add("b", {"stack.2": "z"})
    assert col.complete(1.0) and col.node_of == {0: "a", 1: "a", 2: "b"}


def test_a_collection_keeps_stacks_only_of_the_generations_ranks():
    col = HangCollection(3, "id", 0.0, 8.0, frozenset({0, 1}))
    assert col.add("a", {"stack.0": "x", "stack.7": "y", "stack.-1": "z", "stack.99999999": "w" * 1000}) == 1
    assert col.stacks == {0: "x"} and col.node_of == {0: "a"}

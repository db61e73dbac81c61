"""Stack dumps: the worker-side handler, the signal safety check, and the dump file protocol."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trainguard.detectors.stackdump import (
    MAX_DUMP_CHARS,
    STACK_DUMP_SIGNAL,
    catches_signal,
    dump_stack,
    find_py_spy,
    install_stack_dump_handler,
    process_state,
    stack_dump_path,
)

WORKER = """
import sys, time
from trainguard.detectors.stackdump import install_stack_dump_handler
print(install_stack_dump_handler(sys.argv[1]), flush=True)
def deep_inside_allreduce():
    time.sleep(3600)
deep_inside_allreduce()
"""


def test_dump_from_a_worker_with_the_handler(tmp_path) -> None:
    p = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        path = p.stdout.readline().strip()
        assert path == stack_dump_path(p.pid, str(tmp_path))
        time.sleep(0.1)
        assert catches_signal(p.pid, STACK_DUMP_SIGNAL)
        first = dump_stack(p.pid, directory=str(tmp_path), use_py_spy=False)
        second = dump_stack(p.pid, directory=str(tmp_path), use_py_spy=False)
        assert first.method == "faulthandler" and "deep_inside_allreduce" in first.text
        assert second.text.count("deep_inside_allreduce") == 1  # only the new dump, not the file's history
        assert p.poll() is None  # the worker lives on
    finally:
        p.kill()
        p.wait()


def test_worker_without_handler_is_never_signalled(tmp_path) -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    try:
        time.sleep(0.2)
        assert not catches_signal(p.pid, STACK_DUMP_SIGNAL)
        dump = dump_stack(p.pid, directory=str(tmp_path), use_py_spy=False)
        assert dump.method == "none" and "install_stack_dump_handler" in dump.text
        time.sleep(0.2)
        assert p.poll() is None, "SIGUSR2's default action would have killed it"
    finally:
        p.kill()
        p.wait()
    assert dump_stack(p.pid, use_py_spy=False).method == "none"  # gone: no crash


def test_install_in_this_process(tmp_path) -> None:
    import faulthandler
    import os

    path = install_stack_dump_handler(str(tmp_path))
    try:
        assert catches_signal(os.getpid(), STACK_DUMP_SIGNAL)
        signal.raise_signal(STACK_DUMP_SIGNAL)  # dumps this test's own stack into the file
        with open(path, encoding="utf-8") as f:
            assert "test_install_in_this_process" in f.read()
    finally:
        faulthandler.unregister(STACK_DUMP_SIGNAL)


def test_py_spy_dumps_a_worker_that_registered_nothing(tmp_path) -> None:
    if find_py_spy() is None:
        pytest.skip("py-spy is not installed")
    p = subprocess.Popen([sys.executable, "-c", "import time\ndef spinning_in_c():\n    time.sleep(3600)\n"
                          "print('ready', flush=True)\nspinning_in_c()"], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        dump = dump_stack(p.pid, directory=str(tmp_path), timeout_s=30.0)
        if dump.method != "py-spy":
            pytest.skip(f"py-spy cannot attach here (no ptrace rights?): {dump.text[:200]}")
        assert "spinning_in_c" in dump.text and p.poll() is None
    finally:
        p.kill()
        p.wait()


MANY_THREADS = """
import sys, threading, time
from trainguard.detectors.stackdump import install_stack_dump_handler
install_stack_dump_handler(sys.argv[1])
def helper(depth, ev):
    if depth:
        return helper(depth - 1, ev)
    ev.wait()
stop = threading.Event()
for i in range(60):
    threading.Thread(target=helper, args=(8, stop), daemon=True).start()
def stuck_in_load_batch():
    print("stuck", flush=True)
    time.sleep(3600)
stuck_in_load_batch()
"""


@pytest.mark.parametrize("py_spy", [False, True])
def test_a_long_dump_keeps_the_main_thread(py_spy, tmp_path) -> None:
    """A worker with 60 helper threads dumps ~30k characters, past MAX_DUMP_CHARS. py-spy prints MainThread first
    and its tail was kept: the main thread was lost and the stuck rank read as waiting in a helper's wait.
    (faulthandler lists it last, where the tail is kept.)"""
    from trainguard.recovery.hang_locator import parse_main_stack

    if py_spy and find_py_spy() is None:
        pytest.skip("py-spy is not installed")
    p = subprocess.Popen([sys.executable, "-c", MANY_THREADS, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "stuck"
        time.sleep(0.1)
        dump = dump_stack(p.pid, directory=str(tmp_path), use_py_spy=py_spy, timeout_s=10.0)
    finally:
        p.kill()
        p.wait()
    assert dump.method == ("py-spy" if py_spy else "faulthandler") and len(dump.text) == MAX_DUMP_CHARS
    assert parse_main_stack(dump.text)[0].startswith("stuck_in_load_batch"), dump.text[:500]


def test_a_stopped_worker_is_named_at_once_not_waited_for(tmp_path) -> None:
    """A SIGSTOPped worker cannot run its handler: the dump waited out its whole limit (5 s in a hang
    localisation, held before every restart of it) and then said only that no file was written."""
    p = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        p.stdout.readline()
        assert catches_signal(p.pid, STACK_DUMP_SIGNAL)
        p.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while process_state(p.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        dump = dump_stack(p.pid, directory=str(tmp_path), use_py_spy=False, timeout_s=10.0)
        assert dump.method == "none" and "is stopped" in dump.text, dump.text
        p.send_signal(signal.SIGCONT)
        assert p.poll() is None  # still alive; the dump signal was never sent to a process that could not take it
    finally:
        p.kill()
        p.wait()


def test_an_ended_workers_empty_dump_file_is_discarded(tmp_path) -> None:
    """The handler opens its file at start; every worker left an empty one in /tmp for good. Whoever reaps the
    worker discards it once the pid is gone; a written dump stays."""
    from trainguard.detectors.stackdump import discard_empty_dump

    dumped = subprocess.run([sys.executable, "-c", "import signal, sys\n"
                             "from trainguard.detectors.stackdump import install_stack_dump_handler\n"
                             "install_stack_dump_handler(sys.argv[1])\nsignal.raise_signal(signal.SIGUSR2)\n"
                             "print(flush=True)\n", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert dumped.returncode == 0, dumped.stderr
    [written] = list(tmp_path.iterdir())
    p = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        path = p.stdout.readline().strip()
        assert not discard_empty_dump(p.pid, str(tmp_path))  # alive: its handler may still write there
    finally:
        p.kill()
        p.wait()
    assert os.path.exists(path) and discard_empty_dump(p.pid, str(tmp_path)) and not os.path.exists(path)
    written_pid = int(written.stem.rsplit("-", 1)[1])
    assert written.stat().st_size > 0 and not discard_empty_dump(written_pid, str(tmp_path)) and written.exists()

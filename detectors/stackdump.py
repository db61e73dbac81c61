"""Stack dumps of a hung worker: py-spy where installed, else faulthandler through a signal.

Worker side (the training hook calls this once, early)::

    from trainguard.detectors.stackdump import install_stack_dump_handler
    install_stack_dump_handler()       # registers faulthandler on SIGUSR2

It makes :data:`STACK_DUMP_SIGNAL` (SIGUSR2) write every thread's Python stack to
``$TRAINGUARD_STACK_DIR/trainguard-stack-<pid>.txt`` (the system temp directory when the variable is unset).
faulthandler's handler is C code that runs even while the interpreter is stuck inside a C call holding the GIL,
which is exactly the hung-collective case.

Agent side, :func:`dump_stack` prefers ``py-spy dump`` (no cooperation needed) and otherwise sends the signal
only if ``/proc/<pid>/status`` shows the worker catches it: SIGUSR2's default action would kill the worker.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import IO

#: Signal a worker registers with faulthandler; the agent sends it to obtain a stack dump.
STACK_DUMP_SIGNAL = signal.SIGUSR2
#: Environment variable naming the directory of dump files; the agent sets it for the workers it spawns.
STACK_DIR_ENV = "TRAINGUARD_STACK_DIR"
#: At most this many characters of a dump go into an event's evidence: the end where the main thread is
#: (faulthandler lists the threads newest first, the main thread last; py-spy lists MainThread first).
MAX_DUMP_CHARS = 16_000

_dump_files: dict[int, IO[str]] = {}


def stack_dir(directory: str | None = None) -> str:
    """The directory of dump files.

    Args:
        directory: explicit directory; else ``$TRAINGUARD_STACK_DIR``; else the system temp directory.

    Returns:
        The directory path.
    """
    return directory or os.environ.get(STACK_DIR_ENV) or tempfile.gettempdir()


def stack_dump_path(pid: int, directory: str | None = None) -> str:
    """Path of the file a worker's faulthandler writes to.

    Args:
        pid: the worker's process id.
        directory: see :func:`stack_dir`.

    Returns:
        ``<dir>/trainguard-stack-<pid>.txt``.
    """
    return os.path.join(stack_dir(directory), f"trainguard-stack-{pid}.txt")


def install_stack_dump_handler(directory: str | None = None, signum: int = STACK_DUMP_SIGNAL) -> str:
    """Worker side: makes ``signum`` dump all threads' stacks to this process's dump file.

    Safe to call more than once (later calls re-register with the same file).

    Args:
        directory: see :func:`stack_dir`.
        signum: the signal to register; keep the default unless the agent is configured alike.

    Returns:
        The dump file path.
    """
    pid = os.getpid()
    path = stack_dump_path(pid, directory)
    f = _dump_files.get(signum)
    if f is None or f.name != path or f.closed:
        # faulthandler writes to the file descriptor at signal time, so the file must stay open for good.
        f = open(path, "a", encoding="utf-8")  # noqa: SIM115
        _dump_files[signum] = f
    faulthandler.register(signum, file=f, all_threads=True, chain=False)
    return path


def discard_empty_dump(pid: int, directory: str | None = None) -> bool:
    """Removes ``pid``'s dump file when nothing was ever dumped into it and ``pid`` is gone (the handler opens
    the file when the worker starts: every worker left an empty ``trainguard-stack-<pid>.txt`` in /tmp for good,
    ~1,100 after one run of the test suite). A written dump stays, for the operator. The launcher calls it for
    the workers it reaped; a worker does not remove its own at exit, as a hang in its exit (a process group's
    teardown) is exactly when the agent asks for its stacks.

    Args:
        pid: the worker's process id; a live process of that id (the worker, or a new one given its pid) keeps
            the file.
        directory: see :func:`stack_dir`.

    Returns:
        Whether a file was removed.
    """
    try:
        os.kill(pid, 0)
        return False  # alive: its handler may still write there
    except ProcessLookupError:
        pass
    except OSError:  # another user's process of that id: not ours to judge
        return False
    path = stack_dump_path(pid, directory)
    try:
        if os.path.getsize(path) == 0:
            os.unlink(path)
            return True
    except OSError:
        pass
    return False


def process_state(pid: int, proc_root: str = "/proc") -> str:
    """The one-letter scheduler state of process ``pid`` (``R``, ``S``, ``D``, ``T``, ``t``, ``Z``...) from
    ``/proc/<pid>/stat``; empty when the process is gone or the file is unreadable."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0] if fields else ""
    except (OSError, IndexError):
        return ""


def catches_signal(pid: int, signum: int, proc_root: str = "/proc") -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (bit ``signum-1`` of ``SigCgt``).

    Args:
        pid: process id.
        signum: signal number.
        proc_root: where procfs is mounted.

    Returns:
        True when the signal is caught; False when not, or when the process is gone.
    """
    try:
        with open(os.path.join(proc_root, str(pid), "status"), encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def find_py_spy() -> str | None:
    """Locates ``py-spy``: on PATH, else beside this interpreter (a virtualenv's ``bin/``).

    Returns:
        Its path, or None when not installed.
    """
    found = shutil.which("py-spy")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else None


@dataclass(frozen=True)
class StackDump:
    """A stack dump, or why there is none.

    Attributes:
        method: ``"py-spy"``, ``"faulthandler"`` or ``"none"``.
        text: the dump (cut to :data:`MAX_DUMP_CHARS` keeping the main thread's end), or the reason there is none.
    """

    method: str
    text: str


def dump_stack(
    pid: int,
    *,
    directory: str | None = None,
    signum: int = STACK_DUMP_SIGNAL,
    timeout_s: float = 2.0,
    use_py_spy: bool = True,
    proc_root: str = "/proc",
) -> StackDump:
    """Agent side: obtains the Python stacks of a running worker.

    Args:
        pid: the worker's process id.
        directory: dump directory the worker uses (see :func:`stack_dir`).
        signum: the signal the worker registered.
        timeout_s: seconds to wait for py-spy or for the dump file to be written.
        use_py_spy: try ``py-spy dump`` first when it is on PATH.
        proc_root: where procfs is mounted.

    Returns:
        The dump and the method that produced it; never raises for a missing or dead worker.
    """
    py_spy = find_py_spy() if use_py_spy else None
    if py_spy:
        try:
            done = subprocess.run(
                [py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s, check=False
            )
            if done.returncode == 0 and done.stdout.strip():
                # py-spy prints MainThread first: its tail, kept before, lost the main thread behind ~30 helper
                # threads (wandb, tqdm, pinning, thread pools), and the stuck rank read as waiting in a helper's wait.
                return StackDump("py-spy", done.stdout[:MAX_DUMP_CHARS])
        except (OSError, subprocess.TimeoutExpired):
            pass  # fall back to the worker's own handler
    if not catches_signal(pid, signum, proc_root):
        return StackDump(
            "none",
            f"no stack: py-spy is not installed and pid {pid} does not catch {signal.Signals(signum).name} "
            "(the worker should call trainguard.detectors.stackdump.install_stack_dump_handler())",
        )
    state = process_state(pid, proc_root)
    if state in ("T", "t"):
        # A stopped process runs no handler until it is continued: waiting out the timeout held a hang
        # localisation (and, before the agent kept its lease through it, the node's lease) for nothing.
        return StackDump("none", f"no stack: pid {pid} is stopped (state {state}: SIGSTOP or a tracer), so it "
                                 "cannot run its stack-dump handler")
    path = stack_dump_path(pid, directory)
    try:
        start = os.path.getsize(path)
    except OSError:
        start = 0
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return StackDump("none", f"no stack: pid {pid} exited before it could be signalled")
    deadline = time.monotonic() + timeout_s
    size, stable_since = start, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.01)
        try:
            now_size = os.path.getsize(path)
        except OSError:
            continue
        if now_size != size:
            size, stable_since = now_size, time.monotonic()
        elif size > start and time.monotonic() - stable_since >= 0.05:
            break
    if size <= start:
        return StackDump("none", f"no stack: pid {pid} did not write {path} within {timeout_s:.1f} s")
    with open(path, encoding="utf-8", errors="replace") as f:
        f.seek(start)
        return StackDump("faulthandler", f.read()[-MAX_DUMP_CHARS:])

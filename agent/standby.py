"""Warm standby workers: processes that have already paid for ``import torch`` when a restart needs them.

Most of a process-level restart is interpreter start-up and imports (seconds for torch on a busy node). While a
generation trains, the agent keeps one standby process per local rank: it has imported the heavy modules and
blocks reading one JSON line from its stdin. A restart hands it the new worker's argv and environment; it then
runs the training script exactly as ``python script.py`` would (``__main__``, ``sys.argv``, ``sys.path[0]``).

A standby is spawned with the environment of the current generation's worker of the same local rank, because
some libraries read variables once at load time (OpenMP reads ``OMP_NUM_THREADS`` when it is loaded); the
variables that change between generations (RANK, MASTER_PORT, ...) are only read when the script runs.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

#: Modules a standby imports before it waits (what a typical torch training script needs first; DDP imports
#: torch._dynamo in its constructor, the most expensive import of all).
DEFAULT_PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "trainguard.hook")

_STANDBY_CODE = r"""
import importlib, json, os, runpy, sys
for name in sys.argv[1].split(","):
    if name:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a missing optional module must not cost the standby
            print(f"trainguard standby: cannot preload {name}: {exc}", file=sys.stderr)
line = sys.stdin.readline()
if not line:
    sys.exit(0)  # the agent went away or no longer needs this standby
order = json.loads(line)
os.environ.clear()
os.environ.update(order["env"])
for path, target in ((order.get("stdout"), 1), (order.get("stderr"), 2)):
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)
sys.stdin.close()
sys.stdin = open(os.devnull)
argv = order["argv"]
if argv[0] == "-m":
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
    runpy.run_path(argv[0], run_name="__main__")
"""


def spawn_standby(env: Mapping[str, str], preload: Sequence[str], preexec_fn=None) -> subprocess.Popen:
    """Starts one standby process.

    Args:
        env: the environment it starts with (that of the worker it will most likely replace).
        preload: modules to import before waiting.
        preexec_fn: run in the child before exec (the agent passes its PDEATHSIG setup).

    Returns:
        The process; its stdin is the order pipe.
    """
    from trainguard.agent.guard import guard

    return subprocess.Popen(
        [sys.executable, "-u", "-c", _STANDBY_CODE, ",".join(preload)],
        env=guard().marked(dict(env)),
        stdin=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=preexec_fn,
    )


def script_argv(worker_argv: Sequence[str]) -> list[str] | None:
    """The script part of a worker command line (``[script, args...]`` or ``["-m", module, args...]``).

    Returns:
        None when the command is not ``python [-u] script ...`` with this interpreter (no standby possible).
    """
    argv = list(worker_argv)
    if not argv or argv[0] != sys.executable:
        return None
    rest = argv[1:]
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if not rest or (rest[0].startswith("-") and rest[0] != "-m"):
        return None
    return rest


def activate(proc: subprocess.Popen, argv: Sequence[str], env: Mapping[str, str], stdout_path: str | None,
             stderr_path: str | None = None) -> bool:
    """Hands a standby its order; returns False when it is no longer usable.

    Args:
        stdout_path: file the worker's stdout is appended to (``os.devnull`` to drop it); None keeps the console.
        stderr_path: the same for stderr.
    """
    if proc.poll() is not None or proc.stdin is None:
        return False
    order = {"argv": list(argv), "env": dict(env), "stdout": stdout_path, "stderr": stderr_path}
    try:
        proc.stdin.write((json.dumps(order) + "\n").encode())
        proc.stdin.close()
        return True
    except (BrokenPipeError, OSError):
        return False


class StandbyPool:
    """One warm standby per local rank, kept by the node agent for the next generation.

    Armed once the current generation trains: when a worker reported its first step through the hook, or,
    for plain scripts that never report (no worker of the job ever has), once the generation has run
    ``config.standby_after_s`` seconds (its start-up is over by then; arming earlier makes the standbys' imports
    compete with the workers').
    A spare node that never ran a generation arms as soon as it is registered.
    """

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen] = {}
        self._hook_seen = False  # some worker of this job reported a step through the hook

    def ensure(self, config, group, group_started: float, spare_waiting: bool) -> None:
        """Arms the standbys when due (see the class docstring); a no-op once armed.

        Args:
            config: the agent's :class:`~trainguard.agent.node.NodeConfig`.
            group: the current :class:`~trainguard.agent.workers.WorkerGroup`, or None.
            group_started: ``time.monotonic()`` when ``group`` started.
            spare_waiting: this node is a registered spare without a generation yet.
        """
        import os
        import time

        from trainguard.agent.guard import guard
        from trainguard.agent.workers import child_setup

        if self._procs:
            return
        preload = config.preload or DEFAULT_PRELOAD
        if group is None:
            if spare_waiting and script_argv(config.argv) is not None:
                env = {**os.environ, **config.extra_env}
                for local_rank in range(config.nproc_per_node):
                    proc = spawn_standby(env, preload, preexec_fn=child_setup)
                    guard().watch(proc.pid)
                    self._procs[local_rank] = proc
            return
        workers = group.workers
        if not workers:
            return
        started = any(w.last_step >= 0 for w in workers)
        self._hook_seen = self._hook_seen or started
        # Workers that reported steps before will again: wait for theirs (a restore can outlast the delay).
        if not started and (self._hook_seen or time.monotonic() - group_started < config.standby_after_s):
            return
        for w in workers:
            if script_argv(w.spec.argv) is None:
                return
            proc = spawn_standby(w.spec.env, preload, preexec_fn=child_setup)
            guard().watch(proc.pid)
            self._procs[w.spec.local_rank] = proc

    def take(self) -> dict[int, subprocess.Popen]:
        """Hands the armed standbys over (local rank -> process); the pool is empty afterwards."""
        procs, self._procs = self._procs, {}
        return procs

    def drop(self) -> None:
        """Kills and reaps every standby still in the pool."""
        self.drop_all(self._procs)

    @staticmethod
    def drop_all(procs: dict[int, subprocess.Popen]) -> None:
        """Kills and reaps ``procs`` (standbys nobody used), emptying the dict."""
        from trainguard.agent.guard import guard

        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            guard().forget(proc.pid)
        procs.clear()

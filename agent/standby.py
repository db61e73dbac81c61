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
if order.get("log"):
    fd = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
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
    return subprocess.Popen(
        [sys.executable, "-u", "-c", _STANDBY_CODE, ",".join(preload)],
        env=dict(env),
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


def activate(proc: subprocess.Popen, argv: Sequence[str], env: Mapping[str, str], log_path: str | None) -> bool:
    """Hands a standby its order; returns False when it is no longer usable."""
    if proc.poll() is not None or proc.stdin is None:
        return False
    try:
        proc.stdin.write((json.dumps({"argv": list(argv), "env": dict(env), "log": log_path}) + "\n").encode())
        proc.stdin.close()
        return True
    except (BrokenPipeError, OSError):
        return False

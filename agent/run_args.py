"""The flags of ``trainguard run``, kept apart from the launcher so ``trainguard --help`` stays cheap."""

from __future__ import annotations

import argparse
import signal
from typing import TYPE_CHECKING

from trainguard.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.agent.node import FaultPlan


def parse_fault(text: str) -> "FaultPlan":
    """Parses ``RANK:STEP[:SIGNAL[:GENERATION]]`` (e.g. ``1:57:KILL``) into a :class:`FaultPlan`.

    Raises:
        UsageError: malformed text or unknown signal.
    """
    parts = text.split(":")
    if len(parts) < 2 or len(parts) > 4:
        raise UsageError(f"--fault {text!r}: expected RANK:STEP[:SIGNAL[:GENERATION]], e.g. 1:57:KILL")
    try:
        rank, step = int(parts[0]), int(parts[1])
        generation = int(parts[3]) if len(parts) == 4 else 1
    except ValueError:
        raise UsageError(f"--fault {text!r}: RANK, STEP and GENERATION must be integers") from None
    sig = signal.SIGKILL
    if len(parts) >= 3 and parts[2]:
        name = parts[2].upper()
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            sig = signal.Signals[name]
        except KeyError:
            raise UsageError(f"--fault {text!r}: unknown signal {parts[2]!r}") from None
    if rank < 0 or step < 0 or generation < 1:
        raise UsageError(f"--fault {text!r}: rank and step must be >= 0, generation >= 1")
    from trainguard.agent.node import FaultPlan

    return FaultPlan(rank=rank, step=step, sig=sig, generation=generation)


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the ``trainguard run`` flags to ``p``."""
    p.add_argument("--nproc-per-node", type=int, default=1, help="workers on this node (default 1)")
    p.add_argument("--max-restarts", type=int, default=3, help="job-wide restart budget (default 3)")
    p.add_argument("--job", default=None, help="job name (default: script name + time)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="checkpoint directory or fsspec URL given to every worker as $TRAINGUARD_CHECKPOINT_DIR")
    p.add_argument("--log-dir", default=None, help="write each rank's output to LOG_DIR/rank<R>.log")
    p.add_argument("--fault", action="append", default=[], metavar="RANK:STEP[:SIGNAL[:GEN]]",
                   help="inject a fault: send SIGNAL (default KILL) to RANK once it reports STEP (repeatable)")
    g = p.add_argument_group("multi-node")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="join this coordinator instead of embedding one")
    g.add_argument("--nnodes", type=int, default=1, help="nodes the embedded coordinator waits for (default 1)")
    g.add_argument("--coordinator-listen", default="127.0.0.1:0", metavar="HOST:PORT",
                   help="where the embedded coordinator listens (default 127.0.0.1:0)")
    g.add_argument("--node-id", default=None, help="stable node identity (default: host name)")
    g.add_argument("--pod", default="", help="pod / supernode id of this node")
    g.add_argument("--node-index", type=int, default=0, help="index of this node inside its pod")
    g.add_argument("--host", default=None, help="host name used for rank ordering (default: host name)")
    g.add_argument("--address", default="127.0.0.1", help="address peers reach this node at (default 127.0.0.1)")
    g.add_argument("--spare", action="store_true", help="join as a spare node")
    p.add_argument("--hang-floor-s", type=float, default=60.0,
                   help="a worker with no step for max(this, 5x its slowest recent step) seconds is hung (default 60)")
    p.add_argument("--detectors", default="process",
                   help="comma-separated detectors the agent runs (default: process; see `trainguard detect`)")
    p.add_argument("--detector-config", default=None, metavar="FILE",
                   help="TOML file: top-level root (prefix of the /sys, /proc, /dev files detectors read; default /) "
                        "and interval_s (seconds; 0 keeps each detector's own), then one [<detector>] table of "
                        "fields per detector of --detectors, each may set its own root")
    p.add_argument("--predictor-interval-s", type=float, default=5.0, metavar="S",
                   help="seconds between two failure-risk scores of the predictor (default 5)")
    p.add_argument("--drain-grace-s", type=float, default=30.0, metavar="S",
                   help="after a predictor alarm advises a checkpoint, seconds before the coordinator is asked to "
                        "replace this node (default 30)")
    p.add_argument("--predictor-model", default=None, metavar="PATH",
                   help="trained predictor model (`trainguard predictor train`); default: rules tier only")
    p.add_argument("--metric-history", default=None, metavar="PATH",
                   help="keep the detectors' metric history in this SQLite file (predictor training data)")
    p.add_argument("--failslow-action", choices=["report", "replace"], default="report",
                   help="what the coordinator does about a straggler node: report it (event, status), or replace it "
                        "with a spare when that saves more than a node restart costs (default report)")
    p.add_argument("--failslow-ratio", type=float, default=1.3, metavar="X",
                   help="a rank whose own work per step is X times the other ranks' median is slow (default 1.3)")
    p.add_argument("--no-standby", dest="standby", action="store_false",
                   help="do not keep warm standby worker processes (slower restarts, less memory)")
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name (python -m)")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

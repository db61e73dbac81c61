"""The flags of ``trainguard run``, kept apart from the launcher so ``trainguard --help`` stays cheap."""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainguard.agent.config import hostport_arg
from trainguard.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.drill.inject import FaultPlan


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
    from trainguard.drill.inject import FaultPlan

    return FaultPlan(rank=rank, step=step, sig=sig, generation=generation)


#: torchrun reads each flag's default from ``PET_<DEST>`` (e.g. ``PET_NPROC_PER_NODE``), as set by Kubernetes'
#: PyTorchJob and other launchers; ``trainguard run`` does the same for the torchrun flags.
ENV_DEFAULT_PREFIX = "PET_"

#: Extra default providers, consulted after ``PET_*`` (a scheduler integration such as SLURM registers one):
#: each takes the flag's ``dest`` and returns a default as text, or None when it has none.
DEFAULT_PROVIDERS: list[Callable[[str], str | None]] = []


class EnvDefault(str):
    """A flag's default read from an environment variable (``$PET_<DEST>``): the text, plus the variable's name
    so a bad value is reported under the variable the user set, not under a flag they never typed."""

    var: str

    def __new__(cls, text: str, var: str) -> "EnvDefault":
        """The text ``text`` read from ``$var``."""
        obj = super().__new__(cls, text)
        obj.var = var
        return obj


def flag_default(dest: str, fallback: object) -> object:
    """The default of flag ``dest``: ``$PET_<DEST>`` (an :class:`EnvDefault`), else the first registered
    provider's, else ``fallback``."""
    var = ENV_DEFAULT_PREFIX + dest.upper()
    env = os.environ.get(var)
    if env is not None:
        return EnvDefault(env, var)
    for provider in DEFAULT_PROVIDERS:
        value = provider(dest)
        if value is not None:
            return value
    return fallback


#: Attribute of a parsed ``trainguard run`` namespace: the ``dest`` of every torchrun flag given on the command
#: line, so defaults filled in later (:func:`~trainguard.agent.run_deploy.apply_slurm`) never replace one the
#: user gave, even when it equals the default (``--nproc-per-node 1``).
GIVEN_ATTR = "torchrun_flags_given"


class _NotesGiven(argparse.Action):
    """Mixin: after the action stores its value, notes the flag's ``dest`` in :data:`GIVEN_ATTR`."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: D102 - argparse's contract
        super().__call__(parser, namespace, values, option_string)
        setattr(namespace, GIVEN_ATTR, set(getattr(namespace, GIVEN_ATTR, ())) | {self.dest})


class _StoreGiven(_NotesGiven, argparse._StoreAction):
    """``store``, noting the flag's ``dest`` in :data:`GIVEN_ATTR`."""


class _StoreTrueGiven(_NotesGiven, argparse._StoreTrueAction):
    """``store_true``, noting the flag's ``dest`` in :data:`GIVEN_ATTR`: a ``--standalone`` typed beside a
    ``$PET_STANDALONE`` was otherwise taken for the variable's, and its errors named the variable."""


def flag_given(args: argparse.Namespace, dest: str) -> bool:
    """Whether torchrun flag ``dest`` was given, on the command line or as its ``$PET_<DEST>``."""
    return dest in getattr(args, GIVEN_ATTR, ()) or (ENV_DEFAULT_PREFIX + dest.upper()) in os.environ


def env_source(args: argparse.Namespace, dest: str) -> str | None:
    """``$PET_<DEST>`` when torchrun flag ``dest`` took its value from that variable (not given on the command
    line), else None."""
    var = ENV_DEFAULT_PREFIX + dest.upper()
    if dest in getattr(args, GIVEN_ATTR, ()) or var not in os.environ:
        return None
    return var


def name_env_source(exc: UsageError, args: argparse.Namespace) -> UsageError:
    """``exc`` reworded when it opens with a torchrun flag whose value came from ``$PET_<DEST>``.

    The checks of the torchrun flags name the flag (``--max-restarts must be 0..``); a value the user set as
    ``PET_MAX_RESTARTS`` was then reported under a flag they never typed, sending them to their command line.

    Returns:
        A UsageError naming the variable and the flag it stands for, or ``exc`` itself.
    """
    text = str(exc)
    for action_dest, flag in _TORCHRUN_FLAGS.items():
        var = env_source(args, action_dest)
        if var is None:
            continue
        for spelling in _spellings(flag):
            if text.startswith(spelling) and text[len(spelling):len(spelling) + 1] in (" ", ":", "=", ""):
                return UsageError(f"${var} (the default of {flag}){text[len(spelling):]}")
    return exc


def _env_checked(flag: str, kw: dict) -> Callable[[str], object] | None:
    """The ``type`` of a torchrun flag whose default may come from ``$PET_<DEST>``: the flag's own conversion
    (and ``choices``), a bad environment value refused under the variable's name.

    argparse converts a text default with the flag's type and reported ``PET_MAX_RESTARTS=abc`` as "argument
    --max-restarts: invalid int value"; it never checks a default against ``choices``, so
    ``PET_START_METHOD=bogus`` passed unnoticed.
    """
    conv = kw.get("type")
    choices = kw.get("choices")
    if conv is None and choices is None:
        return None
    if conv is float:
        from trainguard.cli import finite_float  # the parser's own float (its registry no longer sees `float`)

        conv = finite_float

    def parse(text: str) -> object:
        if not isinstance(text, EnvDefault):
            return conv(text) if conv is not None else text
        where = f"${text.var}={str(text)!r} (the default of {flag})"
        try:
            value = conv(text) if conv is not None else text
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentError(None, f"{where}: {exc}") from None
        except (TypeError, ValueError):
            kind = "a whole number" if conv is int else "a valid value"
            raise argparse.ArgumentError(None, f"{where}: expected {kind}") from None
        if choices is not None and value not in choices:
            raise argparse.ArgumentError(None, f"{where}: expected one of {', '.join(map(str, choices))}")
        return value

    parse.__name__ = getattr(conv, "__name__", "value")  # argparse names the type in its own errors
    return parse


#: ``dest`` -> canonical spelling of every torchrun flag (filled by :func:`_torchrun_flag`).
_TORCHRUN_FLAGS: dict[str, str] = {}


def _spellings(name: str) -> list[str]:
    """``--nproc-per-node`` and ``--nproc_per_node``: torchrun accepts both for every multi-word flag."""
    return [name] if "-" not in name[2:] else [name, "--" + name[2:].replace("-", "_")]


def _torchrun_flag(g: argparse._ActionsContainer, name: str, *, fallback: object = None, short: str | None = None,
                   **kw) -> None:
    dest = name[2:].replace("-", "_")
    _TORCHRUN_FLAGS[dest] = name
    names = ([short] if short else []) + _spellings(name)
    if kw.get("action") in ("store_true", "store_false"):
        raw = flag_default(dest, None)
        default = str(raw).lower() in ("1", "true", "yes", "on") if isinstance(raw, str) else bool(fallback)
        if kw["action"] == "store_true":
            kw = {**kw, "action": _StoreTrueGiven}
        g.add_argument(*names, dest=dest, default=default, **kw)
    else:
        checked = _env_checked(name, kw)
        if checked is not None:
            kw = {**kw, "type": checked}
        g.add_argument(*names, dest=dest, default=flag_default(dest, fallback), action=_StoreGiven, **kw)


def add_torchrun_arguments(p: argparse.ArgumentParser) -> None:
    """Adds torchrun's command line (torch 2.x, both spellings) to ``p``; see ``agent/run_torchrun.py`` for how
    each flag maps onto trainguard (rendezvous flags -> the coordinator, ``--standalone`` -> an embedded one)."""
    g = p.add_argument_group("torchrun flags", "torchrun's command line; each also reads $PET_<NAME> as torchrun "
                                               "does (e.g. PET_NPROC_PER_NODE)")
    _torchrun_flag(g, "--nnodes", fallback="1", metavar="N|MIN:MAX",
                   help="nodes of the job; MIN:MAX makes membership elastic (start on MIN, shrink to MIN)")
    _torchrun_flag(g, "--nproc-per-node", fallback="1", metavar="N|gpu|auto|cpu",
                   help="workers on this node: a count, or one per GPU / accelerator else CPU / CPU (default 1)")
    _torchrun_flag(g, "--rdzv-backend", fallback="static", metavar="NAME",
                   help="static or c10d: either way trainguard's coordinator is the rendezvous")
    _torchrun_flag(g, "--rdzv-endpoint", fallback="", metavar="HOST[:PORT]",
                   help="the coordinator's address (port default 29400); the node at HOST embeds it")
    _torchrun_flag(g, "--rdzv-id", fallback=None, metavar="ID", help="job id (same as --job)")
    _torchrun_flag(g, "--rdzv-conf", fallback="", metavar="K=V,...",
                   help="join_timeout (s for the first generation to form, default 600, and to reach the "
                        "coordinator, default 60), is_host (embed it here); other keys are ignored")
    _torchrun_flag(g, "--standalone", action="store_true", help="single node: embed the coordinator on a free port")
    _torchrun_flag(g, "--max-restarts", fallback=3, type=int, metavar="N",
                   help="job-wide restart budget (default 3; torchrun's is 0)")
    _torchrun_flag(g, "--monitor-interval", fallback=None, type=float, metavar="S",
                   help="seconds between two polls of the workers (default 0.05)")
    _torchrun_flag(g, "--start-method", fallback="spawn", choices=["spawn", "fork", "forkserver"],
                   help="accepted for torchrun compatibility; workers always start as fresh interpreters")
    _torchrun_flag(g, "--event-log-handler", fallback="null", metavar="NAME",
                   help="accepted for torchrun compatibility; events go to the coordinator and `trainguard events`")
    _torchrun_flag(g, "--role", fallback="default", metavar="NAME", help="worker role, exported as ROLE_NAME")
    _torchrun_flag(g, "--module", short="-m", action="store_true", help="SCRIPT is a module name (python -m)")
    _torchrun_flag(g, "--no-python", action="store_true",
                   help="run SCRIPT as an executable, not with the Python interpreter")
    _torchrun_flag(g, "--run-path", action="store_true",
                   help="accepted for torchrun compatibility: scripts always run as with runpy.run_path")
    _torchrun_flag(g, "--log-dir", fallback=None, metavar="DIR",
                   help="worker logs: LOG_DIR/rank<R>.log, or rank<R>.stdout.log / .stderr.log with -r / -t")
    _torchrun_flag(g, "--redirects", short="-r", fallback="0", metavar="STD",
                   help="send 1 stdout, 2 stderr, 3 both to files in --log-dir only (or per local rank: 0:1,1:2)")
    _torchrun_flag(g, "--tee", short="-t", fallback="0", metavar="STD",
                   help="send 1 stdout, 2 stderr, 3 both to files in --log-dir and the console (same syntax)")
    _torchrun_flag(g, "--local-ranks-filter", fallback="", metavar="R,...",
                   help="show only these local ranks' output on the console (files are not filtered)")
    _torchrun_flag(g, "--duplicate-stdout-filters", fallback="", metavar="WORDS",
                   help="accepted for torchrun compatibility; not applied")
    _torchrun_flag(g, "--duplicate-stderr-filters", fallback="", metavar="WORDS",
                   help="accepted for torchrun compatibility; not applied")
    _torchrun_flag(g, "--node-rank", fallback=0, type=int, metavar="R",
                   help="static rendezvous: this node's rank; node 0 embeds the coordinator at MASTER_ADDR:PORT")
    _torchrun_flag(g, "--master-addr", fallback="127.0.0.1", metavar="HOST",
                   help="static rendezvous, multi-node: the coordinator's host (node rank 0)")
    _torchrun_flag(g, "--master-port", fallback=None, type=int, metavar="PORT",
                   help="static rendezvous, multi-node: the coordinator's port (default 29500)")
    _torchrun_flag(g, "--local-addr", fallback=None, metavar="HOST",
                   help="address peers reach this node at (same as --address)")
    _torchrun_flag(g, "--logs-specs", fallback=None, metavar="NAME",
                   help="accepted for torchrun compatibility; not applied")
    _torchrun_flag(g, "--numa-binding", fallback=None, choices=["node", "socket", "exclusive", "core-complex"],
                   help="accepted for torchrun compatibility; not applied")
    _torchrun_flag(g, "--signals-to-handle", fallback="SIGTERM,SIGINT,SIGHUP,SIGQUIT", metavar="SIGS",
                   help="signals that stop the workers gracefully (default SIGTERM,SIGINT,SIGHUP,SIGQUIT)")
    _torchrun_flag(g, "--shutdown-timeout", fallback=None, type=int, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping workers (default 3)")
    _torchrun_flag(g, "--virtual-local-rank", action="store_true",
                   help="LOCAL_RANK=0 for every worker, each sees only its GPU through CUDA_VISIBLE_DEVICES")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the ``trainguard run`` flags to ``p``: torchrun's (see :func:`add_torchrun_arguments`), then
    trainguard's own."""
    add_torchrun_arguments(p)
    p.add_argument("--job", default=None,
                   help="job name (default: --rdzv-id; else the script name plus the rendezvous port, or the "
                        "checkpoint directory, or the start time)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="checkpoint directory or fsspec URL given to every worker as $TRAINGUARD_CHECKPOINT_DIR "
                        "(default: $TRAINGUARD_CHECKPOINT_DIR)")
    p.add_argument("--replica-bandwidth-mib-s", type=float, default=1024.0, metavar="MIB_S",
                   help="cap on pushing this node's in-memory checkpoint to its buddy node, MiB/s (0: none)")
    p.add_argument("--replica-memory-mib", type=int, default=8192, metavar="MIB",
                   help="most memory other nodes' checkpoint replicas may hold on this node (0: hold none; the "
                        "coordinator then never makes this node a buddy, it still replicates its own)")
    p.add_argument("--memory-tier", choices=("job", "host"), default="job",
                   help="job: report this node's in-memory checkpoints to the coordinator, which plans restores "
                        "from every node's memory and buddies' replicas (default); host: a step counts in memory "
                        "only when every rank's copy is on one host, no replication (the behaviour before)")
    p.add_argument("--no-replica", dest="replica", action="store_false",
                   help="neither push this node's in-memory checkpoints to a buddy nor serve or fetch replicas")
    p.add_argument("--fault", action="append", default=[], metavar="RANK:STEP[:SIGNAL[:GEN]]",
                   help="inject a fault: send SIGNAL (default KILL) to RANK once it reports STEP (repeatable)")
    g = p.add_argument_group("multi-node")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT[,HOST:PORT]",
                   help="join this coordinator instead of embedding one; a list names where it may be restarted "
                        "(tried in turn while one is unreachable)")
    g.add_argument("--coordinator-listen", default=None, metavar="HOST:PORT", type=hostport_arg,
                   help="where the embedded coordinator listens (default 127.0.0.1:0, or the rendezvous address)")
    g.add_argument("--node-id", default=None,
                   help="stable node identity (default: host name; HOST-rRANK with a multi-node static rendezvous, "
                        "HOST-pPID when joining a coordinator on this host)")
    g.add_argument("--pod", default="", help="pod / supernode id of this node")
    g.add_argument("--node-index", type=int, default=None,
                   help="index of this node inside its pod (default: --node-rank)")
    g.add_argument("--host", default=None, help="host name used for rank ordering (default: host name)")
    g.add_argument("--address", default=None,
                   help="address peers reach this node at (default 127.0.0.1 on one node, else this host's "
                        "address on the route to the coordinator)")
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
    p.add_argument("script", help="training script (or module with -m, executable with --no-python)")
    rest = p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    # argparse takes a REMAINDER positional for a required one: `trainguard run` without a script said "the
    # following arguments are required: script, script_args", though a script needs no arguments.
    rest.required = False

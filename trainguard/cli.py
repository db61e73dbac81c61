"""The ``trainguard`` command line.

Each subsystem contributes its own subcommands through a ``register(subparsers)`` function in its ``cli``
module (listed in :data:`SUBSYSTEM_CLIS`), so the subsystems stay independent. A subcommand handler returns an
exit code; any :class:`~trainguard.errors.TrainguardError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

# gRPC's fork handlers only print warnings here: the agent forks workers that never use the parent's channels.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
# gRPC core's own INFO/WARNING lines (e.g. "Handshake failed") would interleave unstructured text with our logs
# (and break --log-format json); our code reports those failures itself, naming the flag to fix.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
from collections.abc import Callable, Sequence

from trainguard._version import __version__
from trainguard.errors import TrainguardError

#: Modules whose ``register(subparsers)`` adds subcommands. A module that does not exist yet is skipped.
SUBSYSTEM_CLIS: tuple[str, ...] = (
    "trainguard.agent.cli",
    "trainguard.agent.qualify.cli",
    "trainguard.recovery.cli",
    "trainguard.checkpoint.cli",
    "trainguard.detectors.cli",
    "trainguard.predictor.cli",
    "trainguard.drill_cli",
)

Handler = Callable[[argparse.Namespace], int]


def finite_float(text: str) -> float:
    """argparse type of every ``type=float`` flag: a number, refused when NaN or infinite.

    ``float()`` takes "nan" and "inf"; a NaN passes every range check (``x < 0`` is false), so a lease timeout
    of nan was a coordinator that never expired a dead node, and an infinite duration a run that never ended.
    No trainguard flag means anything by them.

    Raises:
        argparse.ArgumentTypeError: ``text`` is not a finite number (argparse names the flag).
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


#: Metavars that declare a flag's value a file or folder path (see :func:`is_path_flag`).
PATH_METAVARS = frozenset({"PATH", "DIR", "FILE", "PNG"})
#: Destinations of flags without a metavar whose value is a path (torchrun's ``--log_dir`` has one; these not).
PATH_DESTS = frozenset({"config", "socket", "workdir", "root", "shm", "out", "model", "events", "metrics", "faults",
                        "rules", "trace", "port_file", "detector_config"})


def is_path_flag(action: argparse.Action) -> bool:
    """Whether an option's value names a file or folder: its metavar says so (:data:`PATH_METAVARS`), or, with no
    metavar, its destination does (:data:`PATH_DESTS` or a ``_dir``/``_file``/``_path`` suffix)."""
    if not action.option_strings:
        return False
    if action.metavar is not None:
        return action.metavar in PATH_METAVARS
    dest = action.dest
    return dest in PATH_DESTS or dest.endswith(("_dir", "_file", "_path"))


def expand_home(text: str) -> str:
    """Expands a leading ``~`` or ``~user`` the way the shell would have had the value been a separate word.

    ``--state-dir=~/x`` reaches the program with the ``~`` intact (the shell expands it only at the start of a
    word), and was taken as the folder ``./~/x``.

    Raises:
        argparse.ArgumentTypeError: ``~user`` names no user (the path would be a relative folder named ``~user``).
    """
    if not text.startswith("~"):
        return text
    expanded = os.path.expanduser(text)
    if expanded == text:
        name = text[1:].split("/", 1)[0]
        who = f"user {name!r}" if name else "the home folder ($HOME unset and no passwd entry)"
        raise argparse.ArgumentTypeError(f"{text!r}: cannot expand '~': no {who}; give the full path")
    return expanded


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line plus the usage hint, exit code 2, whose float flags are
    finite (:func:`finite_float`) and whose path flags expand a leading ``~`` (:func:`expand_home`)."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        """As :class:`argparse.ArgumentParser`; values of ``type=float`` flags, argument groups' included, are
        converted by :func:`finite_float` (argparse looks a flag's type up in the parser's registry first)."""
        super().__init__(*args, **kwargs)
        self.register("type", float, finite_float)

    def _get_value(self, action: argparse.Action, arg_string: str) -> object:
        # argparse converts every value of every flag here (groups' and subcommands' too), the one place that
        # sees both the flag and its text; a value left to a training script is positional and passes untouched.
        if arg_string.startswith("~") and is_path_flag(action):
            try:
                arg_string = expand_home(arg_string)
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentError(action, str(exc)) from None
        return super()._get_value(action, arg_string)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"trainguard: error: {message} (see '{self.prog} --help')\n")


def _version(_: argparse.Namespace) -> int:
    print(f"trainguard {__version__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Builds the full parser with every subsystem's subcommands.

    Returns:
        The top-level parser; each leaf parser has a ``handler`` default.
    """
    parser = _Parser(prog="trainguard", description="Fault tolerance and checkpointing for distributed training.")
    parser.add_argument("--log-level", default=None, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default INFO; for `trainguard agent`, its config's log.level)")
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser("version", help="print the version")
    p.set_defaults(handler=_version)
    for module_name in SUBSYSTEM_CLIS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module_name.startswith(exc.name):
                continue  # that subsystem has no CLI (yet)
            raise
        module.register(sub)
    from trainguard.cli_support import add_log_format_argument, add_log_format_everywhere

    add_log_format_argument(parser, top_level=True)
    add_log_format_everywhere(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainguard`` console script.

    Args:
        argv: arguments without the program name; ``sys.argv[1:]`` when None.

    Returns:
        The process exit code.
    """
    try:
        # Importing every subsystem's CLI takes seconds on a busy host: a Ctrl-C then was a traceback.
        parser = build_parser()
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        print("trainguard: interrupted", file=sys.stderr)
        return 130
    from trainguard.cli_support import run_quietly_on_closed_pipe, setup_logging

    try:
        setup_logging(args)
    except ValueError as exc:
        print(f"trainguard: error: {exc}", file=sys.stderr)
        return 2
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return run_quietly_on_closed_pipe(lambda: int(handler(args) or 0))
    except TrainguardError as exc:
        print(f"trainguard: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("trainguard: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The ``trainguard`` console script and ``python -m trainguard[.cli]``: :func:`main`, then the exit.

    A ``trainguard run`` whose job ended before the agent's background ``import torch`` did (the workers' store,
    :mod:`trainguard.agent.worker_store`) leaves that thread inside torch. CPython before 3.14 ends such a
    thread with ``pthread_exit`` while the interpreter finalises, and the unwind through torch's C++ frames
    aborted the process (exit -6, "terminate called without an active exception") after the job had
    succeeded. The command's own clean-up is over by then, so the process exits at once, output flushed,
    without finalising; waiting for the import instead cost every short job the rest of it (~2 s of CPU).
    """
    code = main()
    from trainguard.agent.worker_store import busy

    if busy():
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass  # a closed pipe: nothing more can reach it
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()

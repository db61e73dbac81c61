"""Process-wide behaviour of the ``trainguard`` command: the log format and a quiet exit on a closed pipe.

- ``--log-format {text,json,journal,auto}`` is accepted by every subcommand (and before it:
  ``trainguard --log-format json run ...``); ``$TRAINGUARD_LOG_FORMAT`` sets the default. ``json`` writes one
  object per line (``ts``, ``level``, ``logger``, ``msg``, extras) for log shippers; the formats are those of the
  daemon (:mod:`trainguard.agent.logging_setup`). The daemon ``trainguard agent`` gets the flag through its
  own override variable, so it wins over the ``[log]`` table of its config file.
- ``trainguard events | head`` must end quietly: a :class:`BrokenPipeError` on stdout ends the command with exit
  code 141 (128 + SIGPIPE, what a shell reports for a killed writer) and no traceback. A command that waits
  (``events --follow | head -1``) learns of the closed pipe at once through :func:`watch_reader_gone`, not at
  its next write, which may be hours away.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import select
import stat
import sys
import threading
from collections.abc import Callable

#: Default of ``--log-format`` when the flag is not given.
LOG_FORMAT_ENV = "TRAINGUARD_LOG_FORMAT"
#: Accepted values of ``--log-format``.
LOG_FORMATS = ("text", "json", "journal", "auto")
#: Exit code after the reader of stdout went away.
EXIT_BROKEN_PIPE = 141


def whole_number(minimum: int, unit: str = "", hint: str = "") -> Callable[[str], int]:
    """An argparse ``type``: a whole number of at least ``minimum``; ``unit`` ("nodes") and ``hint`` (what to do
    instead) go into the refusal, which argparse prefixes with the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number{' of ' + unit if unit else ''}, got "
                                             f"{text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} (got {value}){'; ' + hint if hint else ''}")
        return value
    return parse


def add_log_format_argument(parser: argparse.ArgumentParser, top_level: bool = False) -> None:
    """Adds ``--log-format`` to ``parser`` (a subcommand's flag wins over the top-level one)."""
    parser.add_argument("--log-format", choices=LOG_FORMATS, default=None,
                        dest="log_format_top" if top_level else "log_format",
                        help=f"log records on stderr as text, json (one object per line), journal or auto "
                             f"(default ${LOG_FORMAT_ENV} or text)")


def add_log_format_everywhere(sub: argparse._SubParsersAction) -> None:
    """Adds ``--log-format`` to every subcommand parser under ``sub`` (nested ones included)."""
    for parser in set(sub.choices.values()):
        if not any("--log-format" in a.option_strings for a in parser._actions):
            add_log_format_argument(parser)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                add_log_format_everywhere(action)


def chosen_log_format(args: argparse.Namespace) -> str | None:
    """The format the flags or ``$TRAINGUARD_LOG_FORMAT`` ask for; None for the historical default.

    Raises:
        ValueError: ``$TRAINGUARD_LOG_FORMAT`` holds an unknown format.
    """
    fmt = getattr(args, "log_format", None) or getattr(args, "log_format_top", None)
    if fmt:
        return fmt
    env = os.environ.get(LOG_FORMAT_ENV, "")
    if env and env not in LOG_FORMATS:
        raise ValueError(f"${LOG_FORMAT_ENV}={env!r}: use one of {', '.join(LOG_FORMATS)}")
    return env or None


def setup_logging(args: argparse.Namespace) -> None:
    """Routes logging to stderr in the chosen format at ``args.log_level``.

    Raises:
        ValueError: unknown format in the environment.
    """
    level = args.log_level or "INFO"  # None: the flag not given (the daemon's config file may set its level)
    if args.log_level:
        from trainguard.agent.config import LOG_LEVEL_ENV as AGENT_LOG_LEVEL_ENV

        # The daemon re-configures logging from its config file; the flag must win there (it did not:
        # `trainguard --log-level ERROR agent` logged at the file's level).
        os.environ[AGENT_LOG_LEVEL_ENV] = args.log_level.lower()
    fmt = chosen_log_format(args)
    if fmt is None:
        logging.basicConfig(level=getattr(logging, level),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        return
    from trainguard.agent.config import LOG_FORMAT_ENV as AGENT_LOG_FORMAT_ENV
    from trainguard.agent.logging_setup import configure_logging

    configure_logging(fmt, level.lower())
    # The daemon re-configures logging from its config file; the flag must win there too.
    os.environ[AGENT_LOG_FORMAT_ENV] = fmt


def run_quietly_on_closed_pipe(fn: Callable[[], int]) -> int:
    """Runs ``fn``; a closed stdout (``| head``) ends it with :data:`EXIT_BROKEN_PIPE` instead of a traceback."""
    try:
        code = fn()
        sys.stdout.flush()  # a pipe closed after the last print shows up here
        return code
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        if exc.errno not in _OUTPUT_FULL:
            raise
        # A full disk or quota under the output (`> /dev/full`, `--out` on a full filesystem) was a traceback
        # and exit 1, which `trainguard detect` also returns for a failed detector: a health probe read a full
        # disk as a hardware fault.
        where = f" {exc.filename}" if exc.filename else " (standard output)"
        _stdout_to_devnull()
        print(f"trainguard: error: cannot write the output{where}: {exc.strerror or exc}; free space or write "
              "elsewhere", file=sys.stderr)
        return EXIT_OUTPUT_ERROR


#: Exit code when the output could not be written (a full disk): sysexits' EX_IOERR.
EXIT_OUTPUT_ERROR = 74
_OUTPUT_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _stdout_to_devnull() -> None:
    """Points stdout at /dev/null so the interpreter's final flush does not raise a second time."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def watch_reader_gone(fd: int, on_gone: Callable[[], None]) -> threading.Thread | None:
    """Calls ``on_gone`` (from a daemon thread) as soon as nobody reads ``fd`` any more.

    A writer to a pipe otherwise learns that its reader exited only when it next writes; a command that streams
    rare events would sit there until the next event. Linux reports ``POLLERR`` on a pipe's write end once the
    last reader has closed it (``POLLHUP`` on a socket), so one blocking ``poll`` is enough.

    Args:
        fd: the file descriptor written to (normally ``sys.stdout.fileno()``).
        on_gone: called once when the reader is gone.

    Returns:
        The watcher thread, or ``None`` when ``fd`` is not a pipe or socket (a terminal or file has no reader
        to lose).
    """
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return None
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return None

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, select.POLLERR | select.POLLHUP)
        while True:
            try:
                ready = poller.poll()
            except InterruptedError:
                continue
            except OSError:
                return
            if any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in ready):
                on_gone()
                return

    thread = threading.Thread(target=watch, name="reader-gone", daemon=True)
    thread.start()
    return thread

"""The systemd notification protocol (``sd_notify``), spoken directly: no library needed.

A service with ``Type=notify`` tells systemd about its state by sending one datagram of ``KEY=VALUE`` lines to
the unix socket named in ``$NOTIFY_SOCKET`` (a leading ``@`` names a Linux abstract socket). The keys used here:

- ``READY=1`` once the daemon serves; ``RELOADING=1`` + ``MONOTONIC_USEC=`` when a reload starts (then
  ``READY=1`` again when it is done); ``STOPPING=1`` when a graceful stop starts.
- ``STATUS=`` one line shown by ``systemctl status``.
- ``WATCHDOG=1`` keep-alive, expected every ``$WATCHDOG_USEC`` microseconds; :class:`Watchdog` paces it at
  half that interval and only while the caller says the main loop is healthy, so a wedged daemon gets
  restarted by systemd.

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a cheap no-op, so the daemon runs the same way in tests.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

#: Socket systemd listens on for notifications.
NOTIFY_SOCKET_ENV = "NOTIFY_SOCKET"
#: Watchdog interval in microseconds, set by systemd when ``WatchdogSec=`` is configured.
WATCHDOG_USEC_ENV = "WATCHDOG_USEC"
#: PID the watchdog settings are meant for; other processes (our workers) must ignore them.
WATCHDOG_PID_ENV = "WATCHDOG_PID"


class SystemdNotifier:
    """Sends state notifications to systemd over ``$NOTIFY_SOCKET``.

    Sending never raises: a failed notification is logged once per kind of error, because the daemon must keep
    serving even if systemd went away.
    """

    def __init__(self, address: str | None) -> None:
        """Creates a notifier.

        Args:
            address: value of ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract socket); None or ``""``
                disables notifications.
        """
        self._address: str | bytes | None = None
        self._sock: socket.socket | None = None
        self._warned: set[str] = set()
        if address:
            # '@' maps to the leading NUL byte of an abstract socket name.
            self._address = "\0" + address[1:] if address.startswith("@") else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, unset: bool = True) -> "SystemdNotifier":
        """Creates a notifier from ``$NOTIFY_SOCKET``.

        Args:
            environ: environment to read (default ``os.environ``).
            unset: remove ``NOTIFY_SOCKET`` from the environment so child processes (the training workers) do
                not inherit it and cannot send notifications on the daemon's behalf.

        Returns:
            The notifier (disabled when the variable is absent).
        """
        env = os.environ if environ is None else environ
        address = env.get(NOTIFY_SOCKET_ENV)
        if unset:
            env.pop(NOTIFY_SOCKET_ENV, None)
        return cls(address)

    @property
    def enabled(self) -> bool:
        """True when notifications go somewhere."""
        return self._sock is not None

    def notify(self, **fields: str | int) -> bool:
        """Sends one datagram with the given fields, e.g. ``notify(READY=1, STATUS="serving")``.

        Args:
            **fields: protocol keys and values; newlines in values are replaced by spaces (one line each).

        Returns:
            True when the datagram was sent, False when disabled or the send failed.
        """
        if self._sock is None or self._address is None:
            return False
        lines = [f"{key}={str(value).replace(chr(10), ' ')}" for key, value in fields.items()]
        try:
            self._sock.sendto("\n".join(lines).encode("utf-8"), self._address)
            return True
        except OSError as exc:
            kind = type(exc).__name__
            if kind not in self._warned:
                self._warned.add(kind)
                log.warning("sd_notify to %r failed: %s (further %s errors are not logged)", self._address, exc, kind)
            return False

    def ready(self, status: str = "") -> bool:
        """Tells systemd the daemon serves (``READY=1``), with an optional status line."""
        return self.notify(READY=1, **({"STATUS": status} if status else {}))

    def reloading(self) -> bool:
        """Tells systemd a configuration reload started (send :meth:`ready` when it is done)."""
        return self.notify(RELOADING=1, MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str = "") -> bool:
        """Tells systemd a graceful stop started."""
        return self.notify(STOPPING=1, **({"STATUS": status} if status else {}))

    def status(self, line: str) -> bool:
        """Updates the one-line status shown by ``systemctl status``."""
        return self.notify(STATUS=line)

    def close(self) -> None:
        """Closes the socket; later calls are no-ops."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Reads the watchdog interval systemd expects, like ``sd_watchdog_enabled()``.

    Args:
        environ: environment to read (default ``os.environ``).
        pid: this process's pid (default ``os.getpid()``); ``$WATCHDOG_PID``, when set, must equal it.

    Returns:
        The interval in seconds, or None when no watchdog is configured for this process.
    """
    env = os.environ if environ is None else environ
    usec = env.get(WATCHDOG_USEC_ENV, "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    wd_pid = env.get(WATCHDOG_PID_ENV, "")
    if wd_pid and (not wd_pid.isdigit() or int(wd_pid) != (os.getpid() if pid is None else pid)):
        return None
    return int(usec) / 1e6


class Watchdog:
    """Paces ``WATCHDOG=1`` keep-alives at half the systemd interval, only while the daemon is healthy.

    The main loop calls :meth:`tick` on every iteration with its own verdict; a stuck loop stops calling it and
    an unhealthy one passes ``healthy=False``, so in both cases systemd stops hearing from us and, after
    ``WatchdogSec``, restarts the service. Keep-alives are never sent from a helper thread, which would keep
    pinging while the main loop is wedged.
    """

    def __init__(self, notifier: SystemdNotifier, interval_s: float | None) -> None:
        """Creates the pacer.

        Args:
            notifier: where keep-alives go.
            interval_s: systemd's watchdog interval in seconds (see :func:`watchdog_interval`); None disables.
        """
        self._notifier = notifier
        self.interval_s = interval_s
        self._last_ping = float("-inf")
        self.pings = 0

    @property
    def period_s(self) -> float | None:
        """Seconds between keep-alives (half the interval), or None when disabled."""
        return None if self.interval_s is None else self.interval_s / 2

    def tick(self, healthy: bool, now: float | None = None) -> bool:
        """Sends a keep-alive when one is due and the loop is healthy.

        Args:
            healthy: the main loop's verdict on every subsystem it checked this iteration.
            now: monotonic time in seconds (default ``time.monotonic()``).

        Returns:
            True when a keep-alive was sent.
        """
        if self.period_s is None or not healthy:
            return False
        now = time.monotonic() if now is None else now
        if now - self._last_ping < self.period_s:
            return False
        if self._notifier.notify(WATCHDOG=1):
            self._last_ping = now
            self.pings += 1
            return True
        return False

    def seconds_until_due(self, now: float | None = None) -> float | None:
        """Seconds until the next keep-alive is due (0 if overdue), or None when disabled."""
        if self.period_s is None:
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, self._last_ping + self.period_s - now)

"""What the node agent daemon claims on the node before it serves: its state folder, its socket, its TCP port.

One daemon per state folder and per socket path, each held by an exclusive ``flock`` for the daemon's life
(:func:`lock_state_dir`, :func:`lock_socket_path`); a stale socket file is removed, a live one refused
(:func:`prepare_socket_path`); a ``grpc.listen`` port another process holds is refused in one line naming the
option that set it (:func:`refuse_taken_port`). Every refusal raises before anything binds, so a refused start
leaves nothing behind (see :class:`~trainguard.agent.agentd.AgentDaemon`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat

from trainguard.agent.config import AgentConfig, AgentConfigError, parse_hostport
from trainguard.agent.errors import AgentError

# The daemon's logger: these lines were the daemon's before they moved here, and operators filter on its name.
log = logging.getLogger("trainguard.agent.agentd")


def make_state_dir(config: AgentConfig) -> None:
    """Creates ``agent.state_dir`` (0750) and checks that this user may write in it.

    Raises:
        AgentConfigError: it cannot be created or is not writable, naming the flag that picks another.
    """
    path = config.agent.state_dir
    try:
        os.makedirs(path, mode=0o750, exist_ok=True)
    except OSError as exc:
        raise AgentConfigError(f"agent.state_dir: cannot create {path} ({exc.strerror}); pick another --state-dir") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise AgentConfigError(f"agent.state_dir: {path} is not writable by this user; pick another --state-dir")


def hold_lock(lock_path: str, key: str, flag: str, taken: str) -> int:
    """Creates ``lock_path`` and takes its exclusive ``flock`` for the daemon's life, writing the pid in it;
    returns its fd.

    Args:
        lock_path: the lock file.
        key, flag: the setting and the flag that name the locked thing (in the errors).
        taken: what another agent holding the lock does, for the error (``"uses the state folder X"``).

    Raises:
        AgentConfigError: the lock file cannot be created.
        AgentError: another daemon holds the lock (the message names its pid).
    """
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise AgentConfigError(f"{key}: cannot create {lock_path} ({exc.strerror}); pick another {flag}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise AgentError(f"another trainguard agent{f' (pid {holder})' if holder.isdigit() else ''} {taken}; stop "
                         f"that agent first or give this one its own {flag}") from exc
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        # A full filesystem (a /dev/shm filled by leftover arenas) failed here without a file name: the CLI called
        # it "cannot write the output (standard output)", exit 74, and left the empty lock file.
        try:
            os.unlink(lock_path)  # before the close: once closed, another daemon may hold the file at that path
        except OSError:
            pass
        os.close(fd)
        raise AgentConfigError(f"{key}: cannot write {lock_path} ({exc.strerror}); free space there or pick "
                               f"another {flag}") from exc
    return fd


def lock_state_dir(path: str) -> int:
    """Takes the exclusive lock ``<state_dir>/agent.lock`` that one daemon per state folder holds for its life.

    Two daemons given other sockets but one state folder (a copied unit file, a test instance left running) both
    ran, wrote one metric history and reported one node id to the coordinators; the socket's lock alone did not
    see it.
    """
    lock_path = os.path.join(path, "agent.lock")
    return hold_lock(lock_path, "agent.state_dir", "--state-dir",
                      f"uses the state folder {path} (it holds {lock_path})")


def lock_socket_path(path: str) -> int:
    """Takes the exclusive lock ``<socket>.lock`` that one daemon per socket path holds for its life; returns its fd.

    The probe of :func:`prepare_socket_path` alone cannot tell a second daemon that one runs when its socket
    file was removed under it (a cleaner, a hand), nor win a start race: gRPC unlinks and rebinds a path even
    while another server listens on it, so two daemons would run (both keeping arenas and reporting the node).
    """
    lock_path = f"{path}.lock"
    return hold_lock(lock_path, "grpc.socket", "--socket", f"holds {lock_path}, so serves on {path}")


def prepare_socket_path(path: str) -> None:
    """Creates the socket's folder (0750) and removes a stale socket; refuses to steal a live one."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, mode=0o750, exist_ok=True)
    except OSError as exc:
        raise AgentConfigError(f"grpc.socket: cannot create folder {folder} ({exc.strerror}); pick another --socket") from exc
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AgentConfigError(f"grpc.socket: {path} exists and is not a socket; remove it or pick another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: left over from a crashed agent
        log.info("removed stale socket %s", path)
        return
    finally:
        probe.close()
    raise AgentError(f"another process serves on {path}; stop that agent first or pick another --socket")


def refuse_taken_port(config: AgentConfig) -> None:
    """Refuses a ``grpc.listen`` port another process listens on, before gRPC is asked to bind it.

    gRPC's core logs its own "Failed to add port to server" line to stderr before the bind error reaches us, so an
    operator saw a C++ log line ahead of (and longer than) ours. A port taken between this probe and gRPC's bind
    still fails, with gRPC's line first.

    Raises:
        AgentConfigError: the port is in use, naming it and the option that sets it.
    """
    listen = config.grpc.listen
    host, port = parse_hostport(listen)
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # a host that does not resolve: gRPC's bind error says so
    for family, kind, proto, _, address in addresses:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family this host lacks (IPv6 off): gRPC's bind fails or skips it alike
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds: TIME_WAIT holds nothing
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise AgentConfigError(port_taken_message(config)) from exc
                # another error (an address not on this host) is gRPC's to report


def port_taken_message(config: AgentConfig) -> str:
    """The one line for a ``grpc.listen`` port in use, naming the option to change where it was set."""
    origin = config.origins.get("grpc.listen")
    if origin == "--grpc-listen":
        where = "--grpc-listen HOST:PORT"
    elif origin:
        where = f"{origin} (or --grpc-listen HOST:PORT)"
    elif config.source.startswith("<"):  # no file: the built-in default
        where = "--grpc-listen HOST:PORT (or grpc.listen in the config file)"
    else:
        where = f"grpc.listen in {config.source} (or --grpc-listen HOST:PORT)"
    _, port = parse_hostport(config.grpc.listen)
    return (f"grpc.listen: port {port} ({config.grpc.listen}) is in use by another process (another agent?); stop "
            f"it or pick a free port with {where}; '' disables TCP")


def self_check_host(listen: str) -> str:
    """Where the daemon reaches its own TCP listener ``listen`` (``HOST:PORT``): the host itself, or loopback of
    the same family for a wildcard address (an IPv6 or a single interface's address is not on 127.0.0.1)."""
    host, _ = parse_hostport(listen)
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


__all__ = ["hold_lock", "lock_socket_path", "lock_state_dir", "make_state_dir", "port_taken_message",
           "prepare_socket_path", "refuse_taken_port", "self_check_host"]

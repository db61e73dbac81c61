"""The node agent daemon's configuration: the loader it calls at start and on SIGHUP, and the checks of the
sections it uses itself (``[detectors]``, ``[coordinator]`` TLS and token), so that a bad file is refused in one
line before anything listens, and a reload that a restart would refuse is refused too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from trainguard.agent.config import AgentConfig, AgentConfigError, refuse_url

#: Reads and validates the daemon's configuration (file, environment, flags); raises AgentConfigError.
ConfigLoader = Callable[[], AgentConfig]


def config_loader(
    config_path: str | None = None,
    grpc_listen: str | None = None,
    socket_path: str | None = None,
    state_dir: str | None = None,
) -> ConfigLoader:
    """Builds the loader the daemon calls at start and on SIGHUP: file, then environment, then these flags.

    Args:
        config_path: ``--config``; None means ``$TRAINGUARD_AGENT_CONFIG`` or the default path.
        grpc_listen: ``--grpc-listen HOST:PORT`` ("" disables TCP), or None to keep the configured one.
        socket_path: ``--socket PATH`` ("" disables it), or None.
        state_dir: ``--state-dir DIR``, or None.

    Relative ``config_path``, ``socket_path`` and ``state_dir`` are resolved against the current folder now;
    a URL for any of them is refused (see :func:`~trainguard.agent.config.refuse_url`).

    Raises:
        AgentConfigError: a URL given for one of the paths.

    Returns:
        A function returning the validated configuration, raising AgentConfigError.
    """
    # Relative paths on the command line mean the folder the command was typed in: resolved once, here, so every
    # later load (SIGHUP) and every client reads the same place. In the file and the environment they are refused
    # (config.validate): under systemd the daemon starts in /, not where the file or the unit was written.
    refuse_url(config_path, "--config")
    refuse_url(socket_path, "--socket", "a local unix socket path")
    refuse_url(state_dir, "--state-dir", "a local folder (a path on this host)")
    config_path, socket_path, state_dir = (os.path.abspath(p) if p else p
                                           for p in (config_path, socket_path, state_dir))
    flags = {("grpc", "listen"): (grpc_listen, "--grpc-listen"), ("grpc", "socket"): (socket_path, "--socket"),
             ("agent", "state_dir"): (state_dir, "--state-dir")}

    def load() -> AgentConfig:
        config = AgentConfig.load(config_path)
        updates = {key: value for key, (value, _) in flags.items() if value is not None}
        origins = {f"{k[0]}.{k[1]}": flag for k, (value, flag) in flags.items() if value is not None}
        config = config.with_overrides(updates, origins)
        config.validate()
        return config

    return load


def check_detectors(config: AgentConfig) -> None:
    """Checks the ``[detectors]`` settings as the daemon's start creates them, creating no detector.

    Raises:
        AgentConfigError: an unknown detector, a table for one not enabled, a bad field or root.
    """
    from trainguard.detectors.errors import DetectorConfigError

    try:
        config.detector_loader().settings()
    except DetectorConfigError as exc:
        raise AgentConfigError(str(exc)) from exc
    except ImportError:
        pass  # a detector module missing from this install: the start runs without detectors, not refused


def coordinator_security(config: AgentConfig) -> Any:
    """The TLS files and job token of the configured coordinators (``[coordinator]``).

    Raises:
        AgentConfigError: the token file is unreadable.
    """
    from trainguard.agent.tls import TlsFiles as Files
    from trainguard.recovery.rpc_security import RpcSecurity, SecurityConfigError, read_token_file

    c = config.coordinator
    try:
        token = read_token_file(c.token_file, "coordinator.token_file") if c.token_file else ""
    except SecurityConfigError as exc:
        raise AgentConfigError(str(exc)) from exc
    return RpcSecurity(tls=Files(c.tls_cert_file, c.tls_key_file, c.tls_ca_file), token=token)


def check_coordinator_tls(config: AgentConfig) -> None:
    """Loads the ``[coordinator]`` TLS files as the reporters will, before anything listens: a readable file
    that is no PEM (or a key that is not the certificate's) was found only when the first reporter started,
    after the listeners had logged, and named by path only.

    Raises:
        AgentConfigError: a malformed file, naming its key and the config file.
    """
    from trainguard.agent.tls import TlsFiles as Files, channel_credentials

    c = config.coordinator
    if not c.targets() or not (c.tls_ca_file or c.tls_cert_file):
        return
    try:
        channel_credentials(Files(c.tls_cert_file, c.tls_key_file, c.tls_ca_file))
    except AgentConfigError as exc:
        text = str(exc)
        key = next((k for k in ("tls_ca_file", "tls_cert_file", "tls_key_file")
                    if getattr(c, k) and getattr(c, k) in text), "tls_cert_file")
        raise AgentConfigError(f"{config.source}: coordinator.{key}: {text}") from exc


__all__ = ["ConfigLoader", "check_coordinator_tls", "check_detectors", "config_loader", "coordinator_security"]

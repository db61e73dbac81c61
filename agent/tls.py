"""TLS and mutual-TLS credentials for the agent's TCP listener and for its clients.

Certificates are PEM files. Before handing them to gRPC (whose errors are vague and come late, at the first
handshake) they are checked with Python's ``ssl`` module, so an unreadable file, a certificate that does not
match its key, or a bundle with no certificate fails at start with one line naming the file.

The server credentials are *dynamic*: gRPC asks :class:`ServerCertificates` for the current certificate on each
new handshake, so ``reload()`` (called on SIGHUP) rotates certificates without dropping the listener.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass

import grpc

from trainguard.agent.config import AgentConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the PEM files of one TLS endpoint.

    Attributes:
        cert_file: certificate chain (server, or client for mutual TLS); ``""`` for none.
        key_file: private key of ``cert_file``; ``""`` for none.
        ca_file: CA bundle: on a server, the CAs client certificates must chain to (mutual TLS); on a client,
            the CAs the server certificate must chain to. ``""`` for none.
    """

    cert_file: str = ""
    key_file: str = ""
    ca_file: str = ""


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise AgentConfigError(f"{what} {path}: cannot read ({exc.strerror}); check the path and permissions") from exc


def load_key_pair(cert_file: str, key_file: str, what: str = "tls.cert_file") -> tuple[bytes, bytes]:
    """Reads a PEM certificate chain and its key, checking that they parse and match.

    Args:
        cert_file: PEM certificate chain.
        key_file: PEM private key (unencrypted).
        what: option name for error messages.

    Returns:
        ``(key_pem, cert_pem)`` bytes, in the order gRPC wants them.

    Raises:
        AgentConfigError: unreadable file, not PEM, or key and certificate do not match.
    """
    cert = _read(cert_file, what)
    key = _read(key_file, what.replace("cert_file", "key_file"))
    if b"-----BEGIN CERTIFICATE-----" not in cert:
        raise AgentConfigError(f"{what} {cert_file}: no PEM certificate in the file")
    if b"PRIVATE KEY-----" not in key:
        raise AgentConfigError(f"{what.replace('cert_file', 'key_file')} {key_file}: no PEM private key in the file")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise AgentConfigError(
            f"{what} {cert_file}: certificate and key {key_file} do not load or do not match ({exc.reason})"
        ) from exc
    return key, cert


def load_ca_bundle(ca_file: str, what: str = "tls.client_ca_file") -> bytes:
    """Reads a PEM CA bundle and checks that it holds at least one certificate.

    Raises:
        AgentConfigError: unreadable, or no certificate in it.
    """
    data = _read(ca_file, what)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise AgentConfigError(f"{what} {ca_file}: not a PEM CA bundle ({exc.reason})") from exc
    if ctx.cert_store_stats()["x509_ca"] + ctx.cert_store_stats()["x509"] == 0:
        raise AgentConfigError(f"{what} {ca_file}: holds no certificate")
    return data


class ServerCertificates:
    """The server's current certificate configuration, reloadable while serving.

    With a client CA configured, clients must present a certificate chaining to it (mutual TLS); the
    requirement itself is fixed at start.
    """

    def __init__(self, files: TlsFiles) -> None:
        """Loads and checks the files.

        Raises:
            AgentConfigError: see :func:`load_key_pair` and :func:`load_ca_bundle`.
        """
        self.require_client_auth = bool(files.ca_file)
        self._lock = threading.Lock()
        self._files = files
        self._config = self._load(files)
        self._fresh = False

    def _load(self, files: TlsFiles) -> grpc.ServerCertificateConfiguration:
        pair = load_key_pair(files.cert_file, files.key_file)
        root = load_ca_bundle(files.ca_file) if files.ca_file else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=root)

    def reload(self, files: TlsFiles | None = None) -> None:
        """Re-reads the files (or new ones); new handshakes use them, open connections keep theirs.

        On error the previous certificates stay in use.

        Raises:
            AgentConfigError: the new files are bad, or mutual TLS would be switched on or off.
        """
        files = files or self._files
        if bool(files.ca_file) != self.require_client_auth:
            raise AgentConfigError("tls.client_ca_file: switching mutual TLS on or off needs a restart")
        config = self._load(files)
        with self._lock:
            self._files, self._config, self._fresh = files, config, True
        log.info("TLS certificates reloaded from %s", files.cert_file)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # gRPC calls this on each handshake; None means "keep the current one".
        with self._lock:
            if not self._fresh:
                return None
            self._fresh = False
            return self._config

    def credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials that follow :meth:`reload`."""
        with self._lock:
            initial = self._config
        return grpc.dynamic_ssl_server_credentials(
            initial, self._fetch, require_client_authentication=self.require_client_auth
        )


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials: verify the server against ``files.ca_file`` (system roots when empty) and present
    ``files.cert_file`` when set (mutual TLS).

    Raises:
        AgentConfigError: a file is unreadable or malformed.
    """
    root = load_ca_bundle(files.ca_file, "CA file") if files.ca_file else None
    if files.cert_file or files.key_file:
        key, cert = load_key_pair(files.cert_file, files.key_file, "client cert_file")
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
    return grpc.ssl_channel_credentials(root_certificates=root)

"""Who may talk to the coordinator: TLS / mutual TLS on its port and a shared job token on every call.

The coordinator can order every node of a job to stop, restart or drain, so each call must come from a
process of the job. Two independent checks, both optional and both recommended off a trusted host:

- **TLS** (``cert_file`` + ``key_file``): agents verify the coordinator against a CA. With ``client_ca_file``
  the coordinator also demands a client certificate chaining to that CA (**mutual TLS**); a client without one,
  or with one from another CA, fails the handshake (``UNAVAILABLE``) before any request is read.
- **Job token**: a shared secret (at least :data:`MIN_TOKEN_CHARS` characters) sent as
  ``authorization: Bearer <token>`` metadata on every call and compared in constant time by a server
  interceptor. A call without it, or with another one, gets ``UNAUTHENTICATED`` and is logged with the peer; no
  handler runs. ``grpc.health.v1`` is the one exception (Kubernetes and load balancers probe without
  metadata), and it reveals nothing but SERVING / NOT_SERVING.

The token comes from ``--token-file`` or, in this order, ``$TRAINGUARD_JOB_TOKEN_FILE`` and
``$TRAINGUARD_JOB_TOKEN`` (a Kubernetes Secret or a Slurm-job-private file); never from a command-line value,
which every user of the host could read in ``ps``.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from trainguard.agent.tls import ServerCertificates, TlsFiles, channel_credentials
from trainguard.errors import ConfigError
from trainguard.recovery.refusal_log import RefusalLog

log = logging.getLogger(__name__)

#: Environment variable holding the job token itself.
TOKEN_ENV = "TRAINGUARD_JOB_TOKEN"
#: Environment variable naming a file that holds the job token (preferred over :data:`TOKEN_ENV`).
TOKEN_FILE_ENV = "TRAINGUARD_JOB_TOKEN_FILE"
#: Metadata key carrying the token (gRPC metadata keys are lower case).
TOKEN_METADATA_KEY = "authorization"
#: Shortest token accepted, characters (``openssl rand -hex 32`` gives 64).
MIN_TOKEN_CHARS = 16
#: Method prefixes served without a token: standard health checks only.
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)


class SecurityConfigError(ConfigError):
    """A TLS file or the job token is missing, unreadable or malformed."""


def read_token_file(path: str, what: str = "--token-file") -> str:
    """Reads a job token from a file (surrounding whitespace stripped).

    Raises:
        SecurityConfigError: unreadable file, or a token shorter than :data:`MIN_TOKEN_CHARS`.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise SecurityConfigError(f"{what} {path}: cannot read the job token ({exc}); check the path and "
                                  "permissions") from exc
    return check_token(token, f"{what} {path}")


def check_token(token: str, what: str) -> str:
    """Returns ``token`` if it is usable as a job token.

    Raises:
        SecurityConfigError: too short, or contains whitespace or control characters.
    """
    if len(token) < MIN_TOKEN_CHARS:
        raise SecurityConfigError(f"{what}: the job token has {len(token)} characters; use at least "
                                  f"{MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")
    if any(c.isspace() or ord(c) < 32 for c in token):
        raise SecurityConfigError(f"{what}: the job token contains whitespace or control characters")
    return token


def token_from(token_file: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The job token: ``token_file``, else ``$TRAINGUARD_JOB_TOKEN_FILE``, else ``$TRAINGUARD_JOB_TOKEN``.

    Returns:
        The token, or ``""`` when none is configured.

    Raises:
        SecurityConfigError: the configured source is unreadable or the token malformed.
    """
    env = os.environ if environ is None else environ
    if token_file:
        return read_token_file(token_file)
    if env.get(TOKEN_FILE_ENV):
        return read_token_file(env[TOKEN_FILE_ENV], f"${TOKEN_FILE_ENV}")
    if env.get(TOKEN_ENV):
        return check_token(env[TOKEN_ENV], f"${TOKEN_ENV}")
    return ""


def _deny(code: grpc.StatusCode, message: str, like: grpc.RpcMethodHandler | None = None) -> grpc.RpcMethodHandler:
    """A handler that aborts every call with ``code``, of the same streaming kind as ``like`` (gRPC serves a
    stream method through a handler of its own kind only; None: unary-unary)."""
    def abort(request, context):  # noqa: ARG001 (gRPC handler signature)
        context.abort(code, message)

    def abort_stream(request, context):  # noqa: ARG001 (a generator: server-streaming handlers return one)
        context.abort(code, message)
        yield  # pragma: no cover - abort raises

    req = bool(like is not None and like.request_streaming)
    resp = bool(like is not None and like.response_streaming)
    if req and resp:
        return grpc.stream_stream_rpc_method_handler(abort_stream)
    if req:
        return grpc.stream_unary_rpc_method_handler(abort)
    if resp:
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    return grpc.unary_unary_rpc_method_handler(abort)


class TokenCheck(grpc.ServerInterceptor):
    """Server interceptor refusing every call without the job token (``UNAUTHENTICATED``).

    Args:
        token: the expected token.
        open_prefixes: method-name prefixes served without a token.
        what: the service, as refusals name it. Default ``"coordinator"``.
    """

    def __init__(self, token: str, open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES,
                 what: str = "coordinator") -> None:
        self._expected = f"Bearer {token}".encode()
        self._open = tuple(open_prefixes)
        self._what = what
        self.refused = 0
        self._refusals = RefusalLog(log)  # a scanner or a misconfigured client retries: one line per window

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        """Passes the call on when its metadata carries the token; else answers UNAUTHENTICATED."""
        method = handler_call_details.method or ""
        if method.startswith(self._open):
            return continuation(handler_call_details)
        got = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                got = value if isinstance(value, str) else value.decode(errors="replace")
                break
        if got and hmac.compare_digest(got.encode(), self._expected):
            return continuation(handler_call_details)
        self.refused += 1
        why = "no job token" if not got else "a wrong job token"
        self._refusals.refused(method, "UNAUTHENTICATED", why,
                               f"refused {method}: {why} (the caller needs ${TOKEN_ENV} or --token-file)")
        # The refusal's handler must be of the method's own kind (the replica service streams), so the real
        # handler is looked up, never run.
        return _deny(grpc.StatusCode.UNAUTHENTICATED, f"{why}: this {self._what} requires the job's token",
                     continuation(handler_call_details))


class _TokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Client interceptor adding the token to every call (works on plaintext channels, unlike call credentials)."""

    def __init__(self, token: str) -> None:
        self._pair = (TOKEN_METADATA_KEY, f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(d.metadata or ()), self._pair]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        """Adds the token to a unary call."""
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        """Adds the token to a server-streaming call."""
        return continuation(self._details(client_call_details), request)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


@dataclass(frozen=True)
class RpcSecurity:
    """TLS files and the job token of one side of the coordinator connection.

    On the coordinator: ``tls.cert_file``/``tls.key_file`` switch TLS on, ``tls.ca_file`` demands client
    certificates from that CA (mutual TLS). On an agent: ``tls.ca_file`` verifies the coordinator (TLS on),
    ``tls.cert_file``/``tls.key_file`` are its client certificate. ``token`` is checked on, or sent with, every
    call when non-empty.

    Attributes:
        tls: PEM file paths; all empty means plaintext.
        token: the shared job token; ``""`` for none.
        server_name: name expected in the coordinator's certificate when it differs from the dialled host
            (client side only). Default ``""``.
    """

    tls: TlsFiles = field(default_factory=TlsFiles)
    token: str = ""
    server_name: str = ""

    @property
    def server_tls(self) -> bool:
        """True when a server with these settings serves TLS."""
        return bool(self.tls.cert_file)

    @property
    def client_tls(self) -> bool:
        """True when a client with these settings dials TLS."""
        return bool(self.tls.ca_file or self.tls.cert_file)

    def check_server(self) -> None:
        """Checks the server-side settings fit together.

        Raises:
            SecurityConfigError: a key without a certificate or a client CA without TLS.
        """
        if bool(self.tls.cert_file) != bool(self.tls.key_file):
            raise SecurityConfigError("--tls-cert and --tls-key must be given together")
        if self.tls.ca_file and not self.tls.cert_file:
            raise SecurityConfigError("--tls-client-ca needs --tls-cert/--tls-key: mutual TLS is TLS first")

    def server_interceptors(self) -> list[grpc.ServerInterceptor]:
        """Interceptors the coordinator's server needs (the token check when a token is set)."""
        return [TokenCheck(self.token)] if self.token else []

    def add_port(self, server: grpc.Server, listen: str) -> int:
        """Binds ``listen`` on ``server`` with TLS when configured; returns the port (0 when it failed).

        Raises:
            SecurityConfigError: a certificate file is unreadable or does not match its key.
        """
        if not self.server_tls:
            return server.add_insecure_port(listen)
        self.check_server()
        try:
            certs = ServerCertificates(self.tls)
        except ConfigError as exc:
            raise SecurityConfigError(str(exc)) from exc
        return server.add_secure_port(listen, certs.credentials())

    def channel(self, target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
        """A channel to the coordinator at ``target`` with TLS and the token as configured.

        Raises:
            SecurityConfigError: a TLS file is unreadable or malformed.
        """
        opts = list(options)
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        if self.client_tls:
            if bool(self.tls.cert_file) != bool(self.tls.key_file):
                raise SecurityConfigError("--coordinator-cert and --coordinator-key must be given together")
            try:
                creds = channel_credentials(self.tls)
            except ConfigError as exc:
                raise SecurityConfigError(str(exc)) from exc
            channel = grpc.secure_channel(target, creds, opts)
        else:
            channel = grpc.insecure_channel(target, opts)
        if self.token:
            channel = grpc.intercept_channel(channel, _TokenMetadata(self.token))
        return channel

    def describe(self, server: bool = True) -> str:
        """A short, secret-free description for logs, e.g. ``mTLS + token``."""
        tls = self.server_tls if server else self.client_tls
        mutual = bool(self.tls.ca_file) if server else bool(self.tls.cert_file)
        parts = [("mTLS" if mutual else "TLS") if tls else "plaintext"]
        if self.token:
            parts.append("token")
        return " + ".join(parts)


__all__ = ["MIN_TOKEN_CHARS", "OPEN_METHOD_PREFIXES", "RpcSecurity", "SecurityConfigError", "TOKEN_ENV",
           "TOKEN_FILE_ENV", "TOKEN_METADATA_KEY", "TokenCheck", "check_token", "read_token_file", "token_from"]

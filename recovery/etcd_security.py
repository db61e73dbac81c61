"""TLS and user authentication for the etcd store, set in the store URL's query string.

``etcd://[user@]host:port[,host:port][/prefix]?ca=FILE[&cert=FILE&key=FILE][&password_file=FILE]``

- ``ca``: talk HTTPS to etcd and verify it against this CA bundle (``--trusted-ca-file`` of etcd's clients);
- ``cert`` + ``key``: present a client certificate (etcd ``--client-cert-auth``);
- ``user@`` with ``password_file`` (or ``$TRAINGUARD_ETCD_PASSWORD``): etcd role-based auth; the store gets a
  token from ``/v3/auth/authenticate`` and sends it on every request, fetching a new one when etcd says it
  expired. A password written into the URL is refused: URLs end up in logs, process lists and manifests.

Use client certificates *or* users against one etcd 3.4 server, not both: its JSON gateway refuses to log a
user in over a client-certificate connection ("CommonName of client sending a request against gateway will be
ignored"); either one authenticates the coordinator.
"""

from __future__ import annotations

import os
import ssl
import urllib.parse
from dataclasses import dataclass

from trainguard.recovery.errors import StoreURLError

#: Environment variable holding the etcd user's password (``password_file`` in the URL wins).
ETCD_PASSWORD_ENV = "TRAINGUARD_ETCD_PASSWORD"
_KNOWN = ("ca", "cert", "key", "password_file")


@dataclass(frozen=True)
class EtcdSecurity:
    """How the store authenticates to etcd.

    Attributes:
        ca_file: PEM CA bundle: HTTPS when set.
        cert_file / key_file: PEM client certificate and key (mutual TLS), or ``""``.
        user / password: etcd user, or ``""`` for none.
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    user: str = ""
    password: str = ""

    @property
    def tls(self) -> bool:
        """True when the store speaks HTTPS."""
        return bool(self.ca_file)

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client TLS context, or None for plain HTTP.

        Raises:
            StoreURLError: a file is unreadable or the key does not match the certificate.
        """
        if not self.tls:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise StoreURLError(f"etcd store TLS files (ca={self.ca_file}, cert={self.cert_file}): {exc}") from exc
        return ctx


def etcd_security(url: urllib.parse.SplitResult, environ: dict[str, str] | None = None) -> EtcdSecurity:
    """Reads the TLS and auth settings of an ``etcd://`` URL.

    Raises:
        StoreURLError: unknown query key, a password in the URL, cert without key, missing file.
    """
    env = os.environ if environ is None else environ
    query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
    for key in query:
        if key not in _KNOWN:
            raise StoreURLError(f"etcd store URL: unknown option {key!r}; use {', '.join(_KNOWN)}")
    opt = {k: v[-1] for k, v in query.items()}
    for key in ("ca", "cert", "key", "password_file"):
        if opt.get(key) and not os.path.isfile(opt[key]):
            raise StoreURLError(f"etcd store URL: {key}={opt[key]}: no such file")
    if bool(opt.get("cert")) != bool(opt.get("key")):
        raise StoreURLError("etcd store URL: cert and key must be given together")
    if opt.get("cert") and not opt.get("ca"):
        raise StoreURLError("etcd store URL: a client certificate needs ca= (TLS) too")
    userinfo = url.netloc.rpartition("@")[0] if "@" in url.netloc else ""
    if ":" in userinfo:
        raise StoreURLError("etcd store URL: do not write the password into the URL; use password_file=FILE or "
                            f"${ETCD_PASSWORD_ENV}")
    password = ""
    if userinfo:
        if opt.get("password_file"):
            with open(opt["password_file"], encoding="utf-8") as fh:
                password = fh.read().strip()
        else:
            password = env.get(ETCD_PASSWORD_ENV, "")
        if not password:
            raise StoreURLError(f"etcd store URL names user {userinfo!r} but no password: add password_file=FILE "
                                f"or set ${ETCD_PASSWORD_ENV}")
    return EtcdSecurity(opt.get("ca", ""), opt.get("cert", ""), opt.get("key", ""), urllib.parse.unquote(userinfo),
                        password)


__all__ = ["ETCD_PASSWORD_ENV", "EtcdSecurity", "etcd_security"]

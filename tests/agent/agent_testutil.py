"""Helpers shared by the agent tests: throwaway certificate authorities made with the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Pki:
    """Paths of a test PKI: two unrelated CAs, a server cert and a client cert from CA 1, a client cert from CA 2.

    Attributes:
        ca: CA 1 certificate (trusted by server and clients).
        server_cert / server_key: server identity for ``localhost`` and ``127.0.0.1``, signed by CA 1.
        client_cert / client_key: client identity signed by CA 1.
        rogue_cert / rogue_key: client identity signed by CA 2 (must be refused).
        other_ca: CA 2 certificate.
        server2_cert / server2_key: another server identity, signed by CA 2 (certificate rotation).
    """

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path
    rogue_key: Path
    other_ca: Path
    server2_cert: Path
    server2_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
             "-subj", f"/CN={name}", "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
    (d / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


def make_pki(d: Path) -> Pki:
    """Creates the PKI in directory ``d`` (EC P-256 keys: fast)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to create test certificates (apt-get install openssl)")
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca1")
    _ca(d, "ca2")
    _leaf(d, "server", "ca1", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _leaf(d, "client", "ca1", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "rogue", "ca2", "extendedKeyUsage=clientAuth\n")
    _leaf(d, "server2", "ca2", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    return Pki(ca=d / "ca1.pem", server_cert=d / "server.pem", server_key=d / "server.key",
               client_cert=d / "client.pem", client_key=d / "client.key", rogue_cert=d / "rogue.pem",
               rogue_key=d / "rogue.key", other_ca=d / "ca2.pem",
               server2_cert=d / "server2.pem", server2_key=d / "server2.key")

"""The etcd store over TLS with client certificates and etcd user auth, against a real etcd started with
``--client-cert-auth`` and auth enabled: the right CA, certificate and password work (a coordinator runs on it);
a wrong CA, no client certificate, a wrong password and no user are refused with a StoreError. Skipped with a
reason when the etcd binary is absent; the URL checks run everywhere."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))
from agent_testutil import _leaf, make_pki  # noqa: E402
from recovery_fixtures import ETCD_BINARY, ETCD_SKIP_REASON  # noqa: E402

import tg_testutil
from trainguard.recovery.errors import StoreError, StoreURLError  # noqa: E402
from trainguard.recovery.etcd_security import etcd_security  # noqa: E402
from trainguard.recovery.store import Put, open_store  # noqa: E402

PASSWORD = "etcd-root-pw-" + "x" * 8


def _free_port() -> int:
    return tg_testutil.free_port()


def test_url_options_are_checked(tmp_path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    for url, needle in [(f"etcd://h:1?ca={ca}&bogus=1", "unknown option 'bogus'"),
                        ("etcd://h:1?ca=/no/such/file", "no such file"),
                        (f"etcd://h:1?ca={ca}&cert={ca}", "cert and key must be given together"),
                        ("etcd://root:secret@h:1", "do not write the password into the URL"),
                        ("etcd://root@h:1", "no password")]:
        with pytest.raises(StoreURLError, match=needle):
            etcd_security(urllib.parse.urlsplit(url), {})
    sec = etcd_security(urllib.parse.urlsplit("etcd://root@h:1"), {"TRAINGUARD_ETCD_PASSWORD": "pw"})
    assert (sec.user, sec.password, sec.tls) == ("root", "pw", False)


def _start_etcd(tmp_path_factory, client_cert_auth: bool):
    """etcd over TLS; with ``client_cert_auth`` it demands client certificates, else it enables user auth (root).

    etcd 3.4's JSON gateway cannot combine the two (it refuses to log in a user over a client-certificate
    connection: "CommonName of client sending a request against gateway will be ignored"), so each is tested on
    its own server.
    """
    if ETCD_BINARY is None:
        pytest.skip(ETCD_SKIP_REASON)
    d = tmp_path_factory.mktemp("etcd-pki")
    pki = make_pki(d)
    # etcd's JSON gateway dials etcd's own gRPC port with the server certificate as its client certificate,
    # so under --client-cert-auth that certificate must be good for both uses.
    _leaf(d, "etcdserver", "ca1", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    data = tmp_path_factory.mktemp("etcd-tls")
    client, peer = _free_port(), _free_port()
    log = open(data / "etcd.log", "wb")
    proc = subprocess.Popen(
        [ETCD_BINARY, "--name", "tg-tls", "--data-dir", str(data / "d"),
         "--listen-client-urls", f"https://127.0.0.1:{client}", "--advertise-client-urls",
         f"https://127.0.0.1:{client}", "--listen-peer-urls", f"http://127.0.0.1:{peer}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}", "--initial-cluster",
         f"tg-tls=http://127.0.0.1:{peer}", "--cert-file", str(d / "etcdserver.pem"),
         "--key-file", str(d / "etcdserver.key"), "--log-level", "error",
         *(["--trusted-ca-file", str(pki.ca), "--client-cert-auth"] if client_cert_auth else [])],
        stdout=log, stderr=subprocess.STDOUT)
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if client_cert_auth:
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))

    def call(path: str, body: dict) -> dict:
        req = urllib.request.Request(f"https://127.0.0.1:{client}{path}", json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=5, context=ctx) as r:
            return json.loads(r.read())

    deadline = time.monotonic() + 20
    while True:
        try:
            call("/v3/kv/range", {"key": "eA=="})
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"etcd did not start: {(data / 'etcd.log').read_text()[-2000:]}") from None
            time.sleep(0.1)
    if not client_cert_auth:
        call("/v3/auth/role/add", {"name": "root"})
        call("/v3/auth/user/add", {"name": "root", "password": PASSWORD})
        call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        call("/v3/auth/enable", {})
    return proc, log, f"127.0.0.1:{client}", pki, data


@pytest.fixture(scope="module", params=["client-cert", "user"])
def secure_etcd(tmp_path_factory, request):
    """Yields (mode, endpoint, pki, data dir) for an etcd demanding client certificates, then one with users."""
    proc, log, ep, pki, data = _start_etcd(tmp_path_factory, request.param == "client-cert")
    try:
        yield request.param, ep, pki, data
    finally:
        proc.kill()
        proc.wait()
        log.close()


def _url(ep: str, pki, ca=None, cert=True, user="root", pw_file=None) -> str:
    q = {"ca": str(ca or pki.ca)}
    if cert:
        q.update(cert=str(pki.client_cert), key=str(pki.client_key))
    if pw_file:
        q["password_file"] = str(pw_file)
    who = f"{user}@" if user else ""
    return f"etcd://{who}{ep}/tls{os.getpid()}-{time.monotonic_ns()}?{urllib.parse.urlencode(q)}"


def _good_url(mode: str, ep: str, pki, data: Path) -> str:
    if mode == "client-cert":
        return _url(ep, pki, user="")
    pw = data / "pw"
    pw.write_text(PASSWORD + "\n")
    return _url(ep, pki, cert=False, pw_file=pw)


def test_right_settings_work_and_a_coordinator_runs_on_them(secure_etcd) -> None:
    mode, ep, pki, data = secure_etcd
    url = _good_url(mode, ep, pki, data)
    store = open_store(url)
    try:
        store.commit([], [Put("a", b"1")])
        assert store.get("a").value == b"1"
        if mode == "user":
            store._auth_token = "expired-token"  # etcd answers 401; the store must log in again by itself
            assert store.get("a").value == b"1"
    finally:
        store.close()
    from trainguard.recovery.coordinator import JobCoordinator, JobSpec

    core = JobCoordinator(JobSpec(job="tls-job", store=url))
    try:
        assert core.fence.epoch >= 1
    finally:
        core.close()


@pytest.mark.parametrize("case", ["wrong CA", "no client cert or no user", "wrong password", "plaintext"])
def test_refused(secure_etcd, case) -> None:
    mode, ep, pki, data = secure_etcd
    bad = data / "pw-bad"
    bad.write_text("not-the-password")
    good = _good_url(mode, ep, pki, data)
    if case == "wrong CA":
        url = good.replace(urllib.parse.quote(str(pki.ca), safe=""), urllib.parse.quote(str(pki.other_ca), safe=""))
        assert url != good
    elif case == "no client cert or no user":
        url = _url(ep, pki, cert=False, user="")
    elif case == "wrong password":
        if mode == "client-cert":
            pytest.skip("users are tested on the server with user auth")
        url = _url(ep, pki, cert=False, pw_file=bad)
    else:
        url = f"etcd://{ep}/plain"
    store = open_store(url)
    try:
        with pytest.raises(StoreError):
            store.commit([], [Put("b", b"2")])
    finally:
        store.close()

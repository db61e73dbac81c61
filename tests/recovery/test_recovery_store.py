"""One contract-test suite for every state-store backend (memory, file, SQLite, etcd), plus fencing and the
crash-safety of the file and SQLite backends."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import recovery_fixtures

from trainguard.recovery.errors import FencedError, StoreError, StoreURLError
from trainguard.recovery.store import (Compare, FencedStore, FileStore, Put, Store, acquire_fence,
                                       open_store)

_etcd_ns = itertools.count()

Opener = Callable[[], Store]

# the etcd server fixture, by name (an assignment, so no linter takes it for an unused import)
etcd_endpoint = recovery_fixtures.etcd_endpoint


@pytest.fixture(params=["memory", "file", "sqlite", "etcd"])
def opener(request: pytest.FixtureRequest, tmp_path) -> Iterator[tuple[str, Opener]]:
    """Yields (backend, open) where open() returns a new handle on the SAME store (reopen = restart)."""
    kind = request.param
    if kind == "memory":
        mem = open_store("memory://")
        url = None
    elif kind == "file":
        url = f"file://{tmp_path}/fs"
    elif kind == "sqlite":
        url = f"sqlite://{tmp_path}/state.db"
    else:
        ep = request.getfixturevalue("etcd_endpoint")
        url = f"etcd://{ep}/t{os.getpid()}-{next(_etcd_ns)}"
    handles: list[Store] = []

    def open_() -> Store:
        s = mem if url is None else open_store(url)
        handles.append(s)
        return s

    yield kind, open_
    for h in handles:
        h.close()


def test_get_missing_and_create(opener) -> None:
    _, open_ = opener
    s = open_()
    assert s.get("a/x") is None
    res = s.compare_and_set("a/x", 0, b"one")
    assert res.ok and res.revision > 0
    rec = s.get("a/x")
    assert rec.value == b"one" and rec.version == res.revision


def test_cas_conflict_reports_current_version_and_writes_nothing(opener) -> None:
    _, open_ = opener
    s = open_()
    v1 = s.compare_and_set("k", 0, b"1").revision
    again = s.compare_and_set("k", 0, b"2")
    assert not again.ok and again.conflicts == {"k": v1}
    stale = s.compare_and_set("k", v1 + 1000, b"3")
    assert not stale.ok and s.get("k").value == b"1"
    v2 = s.compare_and_set("k", v1, b"4").revision
    assert v2 > v1 and s.get("k").value == b"4"


def test_multi_key_commit_is_atomic(opener) -> None:
    _, open_ = opener
    s = open_()
    va = s.compare_and_set("j/a", 0, b"a").revision
    res = s.commit([Compare("j/a", va), Compare("j/b", 12345)], [Put("j/a", b"A"), Put("j/c", b"C")])
    assert not res.ok and set(res.conflicts) == {"j/b"}
    assert s.get("j/a").value == b"a" and s.get("j/c") is None
    res = s.commit([Compare("j/a", va), Compare("j/b", 0)], [Put("j/a", b"A"), Put("j/c", b"C"), Put("j/a", None)])
    assert res.ok
    assert s.get("j/a") is None and s.get("j/c").version == res.revision


def test_scan_prefix_and_delete(opener) -> None:
    _, open_ = opener
    s = open_()
    s.commit([], [Put("job/n/1", b"1"), Put("job/n/2", b"2"), Put("job/m", b"m"), Put("jobx/n/1", b"x"),
                  Put("job/n%_", b"odd")])
    assert set(s.scan("job/n/")) == {"job/n/1", "job/n/2"}
    assert set(s.scan("job/n")) == {"job/n/1", "job/n/2", "job/n%_"}
    assert s.scan("nothing/") == {}
    v = s.get("job/n/1").version
    assert s.compare_and_set("job/n/1", v, None).ok
    assert set(s.scan("job/n/")) == {"job/n/2"}


def test_binary_values_roundtrip(opener) -> None:
    _, open_ = opener
    s = open_()
    blob = bytes(range(256)) * 300
    assert s.compare_and_set("bin", 0, blob).ok
    assert s.get("bin").value == blob


def test_state_survives_reopen(opener) -> None:
    kind, open_ = opener
    s = open_()
    rev = s.commit([], [Put("p/a", b"1"), Put("p/b", b"2")]).revision
    s.close() if kind != "memory" else None
    t = open_()
    assert {k: r.value for k, r in t.scan("p/").items()} == {"p/a": b"1", "p/b": b"2"}
    assert t.get("p/a").version == rev
    assert t.compare_and_set("p/a", rev, b"3").revision > rev


def test_two_handles_see_each_other(opener) -> None:
    _, open_ = opener
    a, b = open_(), open_()
    v = a.compare_and_set("shared", 0, b"a").revision
    assert b.get("shared").value == b"a"
    assert not b.compare_and_set("shared", 0, b"b").ok
    assert b.compare_and_set("shared", v, b"b").ok
    assert a.get("shared").value == b"b"


def test_fencing_stops_the_old_writer(opener) -> None:
    _, open_ = opener
    old = FencedStore(open_(), acquire_fence(open_(), "job/fence"))
    assert old.fence.epoch == 1
    assert old.compare_and_set("job/state", 0, b"old").ok
    new = FencedStore(open_(), acquire_fence(open_(), "job/fence"))
    assert new.fence.epoch == 2
    with pytest.raises(FencedError, match="another coordinator took over"):
        old.commit([], [Put("job/state", b"clobber")])
    assert new.get("job/state").value == b"old"
    v = new.get("job/state").version
    assert new.compare_and_set("job/state", v, b"new").ok


def test_concurrent_cas_increments_lose_nothing(opener) -> None:
    kind, open_ = opener
    stores = [open_() for _ in range(3)]

    def bump(s: Store, n: int) -> None:
        for _ in range(n):
            while True:
                rec = s.get("ctr")
                cur = int(rec.value) if rec else 0
                if s.compare_and_set("ctr", rec.version if rec else 0, str(cur + 1).encode()).ok:
                    break

    threads = [threading.Thread(target=bump, args=(s, 15)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert int(stores[0].get("ctr").value) == 45


def test_store_urls() -> None:
    for bad in ["nosuch://x", "sqlite://relative", "file://host/x", "etcd://noport", "etcd://h:99999", "sqlite://"]:
        with pytest.raises(StoreURLError):
            open_store(bad)


def test_relative_or_optioned_local_store_urls_are_refused(tmp_path, monkeypatch) -> None:
    # "sqlite:state.db" opened ./state.db: a coordinator restarted from another directory found an empty store.
    monkeypatch.chdir(tmp_path)
    for bad in ["sqlite:state.db", "file:statedir", "sqlite:///%s/a.db?mode=ro" % tmp_path, "file:///%s/d#x" % tmp_path]:
        with pytest.raises(StoreURLError, match="absolute local path"):
            open_store(bad)
    assert list(tmp_path.iterdir()) == []
    open_store(f"sqlite://localhost{tmp_path}/ok.db").close()


def test_etcd_down_is_a_clear_store_error() -> None:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = open_store(f"etcd://127.0.0.1:{port}")
    with pytest.raises(StoreError, match="no etcd endpoint answered"):
        s.get("x")


def test_corrupt_file_store_is_refused_and_left_alone(tmp_path) -> None:
    (tmp_path / "state.json").write_text('{"revision": 3, "kv": {"a": [3, "!!notbase64')
    with pytest.raises(StoreError, match="corrupt"):
        FileStore(tmp_path)
    assert (tmp_path / "state.json").read_text().startswith('{"revision": 3')


_CRASHER = r"""
import os, sys
from trainguard.recovery.store import open_store, Put
s = open_store(sys.argv[1])
i = 0
while True:
    i += 1
    s.commit([], [Put("crash/ctr", str(i).encode()), Put("crash/twin", str(i).encode())])
    print(i, flush=True)
"""


@pytest.mark.parametrize("scheme", ["file", "sqlite"])
def test_sigkill_mid_commit_leaves_a_consistent_state(tmp_path, scheme: str) -> None:
    url = f"{scheme}://{tmp_path}/st" + (".db" if scheme == "sqlite" else "")
    proc = subprocess.Popen([sys.executable, "-c", _CRASHER, url], stdout=subprocess.PIPE, text=True)
    try:
        acked = 0
        for line in proc.stdout:
            acked = int(line)
            if acked >= 40:
                break
    finally:
        proc.kill()
        proc.wait()
    s = open_store(url)
    ctr, twin = s.get("crash/ctr"), s.get("crash/twin")
    # Every acknowledged commit is durable, and the two keys of one commit are never torn apart.
    assert int(ctr.value) >= acked and ctr.value == twin.value and ctr.version == twin.version
    s.close()


def test_etcd_restarted_between_requests_is_reached_again(tmp_path) -> None:
    # The store keeps one connection alive; an etcd restart between two requests killed it, and the next
    # request failed with "no etcd endpoint answered" although etcd was up again.
    from recovery_fixtures import ETCD_BINARY, ETCD_SKIP_REASON, free_port, start_etcd
    if ETCD_BINARY is None:
        pytest.skip(ETCD_SKIP_REASON)
    client, peer = free_port(), free_port()
    with open(tmp_path / "etcd.log", "wb") as log:
        proc = start_etcd(tmp_path, client, peer, log)
        s = open_store(f"etcd://127.0.0.1:{client}/restart")
        try:
            assert s.commit([], [Put("a", b"1")]).ok
            proc.kill()
            proc.wait()
            proc = start_etcd(tmp_path, client, peer, log)
            assert s.get("a").value == b"1"
            assert s.commit([], [Put("a", b"2")]).ok
        finally:
            s.close()
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_sqlite_store_names_the_remedy_and_is_left_alone(tmp_path, damage: str) -> None:
    # A damaged file was answered with "check the path and permissions", which sends an operator the wrong way.
    path = tmp_path / "state.db"
    if damage == "garbage":
        path.write_bytes(b"not a database " * 400)
    else:
        s = open_store(f"sqlite://{path}")
        for i in range(200):
            s.commit([], [Put(f"k{i}", os.urandom(2000))])
        s.close()  # checkpoints the WAL into the file
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = path.read_bytes()
    with pytest.raises(StoreError, match=r"state\.db .*not a SQLite database or is damaged: move it .*fresh --store"):
        open_store(f"sqlite://{path}")
    assert path.read_bytes() == before


def test_sqlite_store_with_a_damaged_page_is_refused_at_open(tmp_path) -> None:
    # A page damaged inside (its header intact) opened fine: the coordinator served, health SERVING, while every
    # commit failed with "database disk image is malformed", so every heartbeat was refused until someone read
    # the log. The check at open refuses it with the remedy instead, and leaves the file as it was.
    path = tmp_path / "state.db"
    s = open_store(f"sqlite://{path}")
    s.commit([], [Put("trainguard/jobs/j/state", b"x" * 100)])
    s.close()
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) >= 2 * page
    data[page + 4: page + 8] = b"\xff\xff\xff\xff"  # page 2's b-tree header: first freeblock, cell count
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"state\.db .*not a SQLite database or is damaged: move it .*fresh --store"):
        open_store(f"sqlite://{path}")
    assert path.read_bytes() == bytes(data)


def test_sqlite_store_under_a_plain_file_is_a_store_error(tmp_path) -> None:
    # The directory could not be made (a file in its place): a bare FileExistsError escaped, which the embedded
    # coordinator and callers catching StoreError did not expect.
    (tmp_path / "afile").write_text("")
    with pytest.raises(StoreError, match=r"SQLite store .*afile/x\.db .*writable directory"):
        open_store(f"sqlite://{tmp_path}/afile/x.db")


def test_file_store_removes_temp_documents_of_killed_writers(tmp_path) -> None:
    # A coordinator killed -9 between writing state.json.XXXX.tmp and renaming it left it there; each crash added one.
    url = f"file://{tmp_path}/st"
    proc = subprocess.Popen([sys.executable, "-c", _CRASHER, url], stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if int(line) >= 5:
            break
    proc.kill()
    proc.wait()
    proc.stdout.close()
    (tmp_path / "st" / "state.json.dead1234.tmp").write_text("{half")  # what a kill at the wrong instant leaves
    s = open_store(url)
    assert int(s.get("crash/ctr").value) >= 5
    s.close()
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == ["lock", "state.json"]


def _leaderless(client: int) -> bool:
    """Whether the etcd member serving ``client`` knows it has no leader (its own status, no quorum needed)."""
    req = urllib.request.Request(f"http://127.0.0.1:{client}/v3/maintenance/status", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return int(json.loads(r.read()).get("leader", 0)) == 0


def _enable_root(client: int, password: str) -> None:
    """Turns on etcd user auth with user root (its password ``password``)."""
    for path, body in [("/v3/auth/role/add", {"name": "root"}), ("/v3/auth/user/add", {"name": "root", "password":
                       password}), ("/v3/auth/user/grant", {"user": "root", "role": "root"}), ("/v3/auth/enable", {})]:
        req = urllib.request.Request(f"http://127.0.0.1:{client}{path}", json.dumps(body).encode(), method="POST")
        urllib.request.urlopen(req, timeout=5).close()


@pytest.mark.parametrize("user", [False, True])
def test_etcd_member_without_quorum_is_skipped_like_a_dead_one(tmp_path, request, user: bool) -> None:
    # A member that lost quorum answers 503 "no leader" (after etcd's 5 s request timeout, without the hasleader
    # header); the store raised that as its own failure instead of asking the next listed endpoint, which serves.
    # With etcd users the login was refused the same way, and named the password file as the culprit.
    from recovery_fixtures import ETCD_BINARY, ETCD_SKIP_REASON, free_port, start_etcd, wait_etcd
    if ETCD_BINARY is None:
        pytest.skip(ETCD_SKIP_REASON)
    ca, cb, pa, pb = free_port(), free_port(), free_port(), free_port()
    cluster = f"qa=http://127.0.0.1:{pa},qb=http://127.0.0.1:{pb}"
    procs = []
    with open(tmp_path / "etcd.log", "wb") as log:
        try:
            if user:  # the healthy endpoint needs the same user: one of its own
                hc, hp = free_port(), free_port()
                procs.append(start_etcd(tmp_path, hc, hp, log))
                _enable_root(hc, "pw")
                healthy = f"127.0.0.1:{hc}"
                (tmp_path / "pw").write_text("pw")
            else:
                healthy = request.getfixturevalue("etcd_endpoint")  # skips without the etcd binary
            a = start_etcd(tmp_path, ca, pa, log, name="qa", cluster=cluster, wait=False)
            b = start_etcd(tmp_path, cb, pb, log, name="qb", cluster=cluster, wait=False)
            procs += [a, b]
            wait_etcd(a, ca, tmp_path)
            wait_etcd(b, cb, tmp_path)
            if user:
                _enable_root(ca, "pw")
            b.kill()  # two members, one left: no quorum
            b.wait()
            deadline = time.monotonic() + 30
            while not _leaderless(ca):
                assert time.monotonic() < deadline, "the member left alone still reports a leader"
                time.sleep(0.05)
            who, opts = ("root@", f"?password_file={tmp_path / 'pw'}") if user else ("", "")
            s = open_store(f"etcd://{who}127.0.0.1:{ca},{healthy}/quorum{os.getpid()}-{next(_etcd_ns)}{opts}")
            try:
                assert s.commit([], [Put("k", b"v")]).ok
                assert s.get("k").value == b"v"
            finally:
                s.close()
        finally:
            for p in procs:
                p.kill()
                p.wait()


def test_a_sqlite_store_deleted_or_replaced_under_a_running_coordinator_fails_loudly(tmp_path) -> None:
    """An operator cleaning ~/.local/state (or a second job's setup) removed the SQLite file while a coordinator
    ran: SQLite kept writing to the unlinked file, every commit "succeeded", and the coordinator started again
    found an empty store and ran the job from generation 1, handing out generation numbers and MASTER_PORTs a
    second time. Reads and writes now fail, naming the file, until it is back."""
    from pathlib import Path

    from trainguard.recovery.store import SQLiteStore

    path = tmp_path / "state.db"
    store = SQLiteStore(path)
    try:
        assert store.compare_and_set("k", 0, b"1").ok
        moved = tmp_path / "moved.db"
        for suffix in ("", "-wal", "-shm"):
            if Path(f"{path}{suffix}").exists():
                os.rename(f"{path}{suffix}", f"{moved}{suffix}")
        with pytest.raises(StoreError, match="was deleted or replaced"):
            store.compare_and_set("k", 1, b"2")
        with pytest.raises(StoreError, match="was deleted or replaced"):
            store.get("k")
        SQLiteStore(path).close()  # another, empty file under the name: still not the store this one opened
        with pytest.raises(StoreError, match="was deleted or replaced"):
            store.get("k")
        for suffix in ("-wal", "-shm", ""):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
            if Path(f"{moved}{suffix}").exists():
                os.rename(f"{moved}{suffix}", f"{path}{suffix}")
        assert store.get("k").value == b"1"  # the file is back: served again
    finally:
        store.close()


@pytest.mark.parametrize("sql, value", [("'{\"node\": 5}'", b'{"node": 5}'), ("5", b"5"), ("2.5", b"2.5"),
                                        ("x'00ff'", b"\x00\xff")])
def test_a_hand_edited_sqlite_value_of_any_sql_type_is_read_as_its_bytes(tmp_path, sql: str, value: bytes) -> None:
    """The sqlite3 shell stores `UPDATE kv SET value = '...'` as TEXT: bytes() of a str was a TypeError traceback
    from every read (and an INTEGER was taken as a length); now a value reads as the bytes SQLite's CAST gives, and
    the coordinator's decoders name a damaged record."""
    import sqlite3

    url = f"sqlite://{tmp_path}/h.db"
    store = open_store(url)
    store.commit([], [Put("j/nodes/a", b'{"ok": 1}')])
    db = sqlite3.connect(tmp_path / "h.db")
    db.execute(f"UPDATE kv SET value = {sql} WHERE key = 'j/nodes/a'")
    db.commit()
    db.close()
    assert store.get("j/nodes/a").value == value
    assert store.scan("j/")["j/nodes/a"].value == value
    assert store.scan("")["j/nodes/a"].value == value
    version = store.get("j/nodes/a").version
    assert store.commit([Compare("j/nodes/a", version)], [Put("j/nodes/a", b"new")]).ok
    store.close()


def test_a_hand_edited_sqlite_version_is_a_store_error_naming_the_key(tmp_path) -> None:
    import sqlite3

    store = open_store(f"sqlite://{tmp_path}/v.db")
    store.commit([], [Put("j/state", b"s")])
    db = sqlite3.connect(tmp_path / "v.db")
    db.execute("UPDATE kv SET version = 'two' WHERE key = 'j/state'")
    db.commit()
    db.close()
    for read in (lambda: store.get("j/state"), lambda: store.scan("j/"),
                 lambda: store.commit([Compare("j/state", 1)], [Put("j/state", b"t")])):
        with pytest.raises(StoreError, match=r"key 'j/state' has the value .* and version 'two'.*delete it"):
            read()
    store.close()


def test_a_text_node_record_stops_the_coordinator_with_the_corrupt_record_line(tmp_path, tg_env) -> None:
    """The reviewer's repro: a node record edited in the sqlite3 shell was a traceback and exit 1."""
    import sqlite3

    url = f"sqlite://{tmp_path}/n.db"
    store = open_store(url)
    store.commit([], [Put("trainguard/jobs/tx/nodes/a", b"x")])
    store.close()
    db = sqlite3.connect(tmp_path / "n.db")
    db.execute("UPDATE kv SET value = '{\"node\": 5}' WHERE key = 'trainguard/jobs/tx/nodes/a'")
    db.commit()
    db.close()
    r = subprocess.run([sys.executable, "-m", "trainguard.cli", "coordinator", "--job", "tx", "--listen",
                        "127.0.0.1:0", "--store", url], env=tg_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "node record 'trainguard/jobs/tx/nodes/a' is corrupt" in r.stderr and "delete it" in r.stderr, r.stderr

"""The coordinator's records in the store, encoded and decoded: one record per node, and the job state.

Keys live under ``trainguard/jobs/<job>/`` (see :mod:`~trainguard.recovery.coordinator` for what each holds and
when it is written). A node record is JSON: the node's identity, its lease, its agent's instance id and why it
failed qualification. A held cordon's record (``held/<node id>``) is JSON: the fatal reason a node daemon reported
about a node that had not registered, the daemon's instance and host. The state record is zlib-compressed JSON:
the policy state, the rank layout (slot holders named by a digest of their node id: see :func:`layout_doc`),
MASTER_PORT and every port used so far. Pure functions: the coordinator reads and writes the store itself.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from trainguard.recovery.domain import NodeRecord
from trainguard.recovery.errors import MembershipError, PolicyError, StoreError
from trainguard.recovery.policy import PolicyState
from trainguard.recovery.ranks import RankLayout, layout_from_mapping


@dataclass(frozen=True)
class StoredNode:
    """A node record as read back: identity, lease, agent instance, qualification refusal ("" if none), and
    whether the coordinator had found the node lost (its lease expired, or it left) when it wrote the record."""

    info: NodeRecord
    lease: str
    instance: str
    refused: str
    lost: bool = False


@dataclass(frozen=True)
class StoredState:
    """The job state record as read back."""

    policy: PolicyState
    layout: RankLayout | None
    master_port: int
    used_ports: set[int]


def node_value(info: NodeRecord, lease: str, instance: str, refused: str, lost: bool = False) -> bytes:
    """The value of a node's record (``lost``: the node's lease had ended; written only when true, so records
    of live nodes read the same by older coordinators)."""
    doc: dict[str, object] = {"node": info.to_dict(), "lease": lease, "instance": instance, "refused": refused}
    if lost:
        doc["lost"] = True
    return json.dumps(doc).encode()


def decode_node(key: str, value: bytes) -> StoredNode:
    """Reads a node record (also the NodeInfo form written by trainguard <= 0.x).

    Raises:
        StoreError: the record is corrupt.
    """
    try:
        d = json.loads(value)
        if "node" in d:
            info = NodeRecord.from_dict(d["node"])
        else:  # written by trainguard <= 0.x: the NodeInfo message, hex-encoded
            from trainguard.recovery.convert import legacy_node_record
            info = legacy_node_record(d["info"])
        lost = d.get("lost", False)
        if not isinstance(lost, bool):
            raise TypeError(f"'lost' is {lost!r}, not true or false")
        return StoredNode(info, str(d["lease"]), str(d.get("instance", "")), str(d.get("refused", "")), lost)
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"node record {key!r} is corrupt ({exc}): delete it or use a fresh store") from exc


#: Characters of a held cordon's reason that are stored: a failure's description keeps no more of a detail
#: (:data:`~trainguard.recovery.policy.MAX_DETAIL`), and 16384 held records of a 4 KB reason each made a scan of
#: 64 MB at every coordinator start.
HELD_REASON_CHARS = 240


@dataclass(frozen=True)
class StoredHeld:
    """A held cordon as read back: the node daemon's fatal reason, its instance and host."""

    node_id: str
    reason: str
    instance: str
    host: str


def held_value(reason: str, instance: str, host: str) -> bytes:
    """The value of a held cordon's record (the reason cut to :data:`HELD_REASON_CHARS`)."""
    return json.dumps({"reason": reason[:HELD_REASON_CHARS], "instance": instance, "host": host}).encode()


def decode_held(key: str, node_id: str, value: bytes) -> StoredHeld:
    """Reads a held cordon's record.

    Raises:
        StoreError: the record is corrupt.
    """
    try:
        d = json.loads(value)
        reason = str(d["reason"])
        if not reason or not node_id:
            raise ValueError("no reason or no node id")
        return StoredHeld(node_id, reason, str(d.get("instance", "")), str(d.get("host", "")))
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"held cordon record {key!r} is corrupt ({exc}): delete it (the node is then not kept "
                         "out until its node daemon reports it fatal again) or use a fresh store") from exc


#: Size of a job state record past which the coordinator logs an error: etcd refuses requests over its
#: ``--max-request-bytes`` (1.5 MiB by default), and the state is committed with other records.
STATE_WARN_BYTES = 1024 * 1024


def checkpoint_value(step: int) -> bytes:
    """The value of the job's committed checkpoint step record."""
    return json.dumps({"step": step}).encode()


def decode_checkpoint(key: str, value: bytes) -> int:
    """Reads the job's committed checkpoint step.

    Raises:
        StoreError: the record is corrupt (it was read raw: a damaged one stopped the coordinator's start with a
            Python traceback, a KeyError or a JSON error, that named neither the key nor what to do).
    """
    try:
        step = json.loads(value)["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < -1:
            raise ValueError(f"step {step!r} is not a step")
        return step
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"checkpoint record {key!r} is corrupt ({exc}): delete it (the job's committed step "
                         "is then taken from the nodes' next commits) or use a fresh store") from exc


#: Bytes of a node id's digest by which the state record's rank layout names a slot holder whose node record
#: (``nodes/<node id>``) is in the store: the id is stored there once already. 64 bits: two of 10**5 node ids share
#: one with a probability of ~3e-10, and a decoder that finds two says so instead of guessing.
ID_DIGEST_BYTES = 8


#: Prefix of the id given to a slot holder whose digest no node record resolves (see :func:`layout_from_doc`).
LOST_RECORD_PREFIX = "?lost-record-"

#: The exact form of such an id: the service accepts it where an operator must name one (``trainguard uncordon``)
#: and nowhere else; the ``?`` keeps any node from registering under it.
LOST_RECORD_RE = re.compile(r"\?lost-record-[0-9a-f]{%d}" % (2 * ID_DIGEST_BYTES))


def id_digest(node_id: str) -> bytes:
    """The digest by which a stored rank layout names a node whose record is in the store."""
    return hashlib.blake2b(node_id.encode(), digest_size=ID_DIGEST_BYTES).digest()


def _runs(values: Sequence[int]) -> list[list[int]]:
    """``[[value, count], ...]`` of consecutive equal values (device counts: one run for a uniform job)."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def _table(column: Sequence[str]) -> dict[str, list] | list[str]:
    """``{"v": distinct values in first-seen order, "i": each row's index into them}``, or the plain column when
    most of its values are distinct.

    Why: a pod id (up to 128 characters) is shared by every node of the pod, but a plain column compresses its
    repeats only within zlib's 32 KiB window: with the slots of 196 pods interleaved (replacements from other pods)
    the pod column of 12,500 slots was ~385 KB compressed, ~38 KB as a table. A column of distinct values (each
    node's own address) gains nothing from a table, and its index would add ~30 KB at 12,500 slots.
    """
    index: dict[str, int] = {}
    rows = [index.setdefault(v, len(index)) for v in column]
    if len(index) > len(rows) // 2:
        return list(column)
    return {"v": list(index), "i": rows}


def _column(value: object) -> list[str]:
    """A column of :func:`layout_doc`'s form: a :func:`_table` (format 3), or a plain list (formats 2 and 3).

    Raises:
        ValueError, TypeError, KeyError: malformed (an index that is not an int in range among them).
    """
    if isinstance(value, list):  # one value per slot
        return [str(a) for a in value]
    if not isinstance(value, dict):
        raise TypeError(f"a column is a {type(value).__name__}")
    values = [str(v) for v in value["v"]]
    rows = value["i"]
    if not isinstance(rows, list) or not all(type(i) is int and 0 <= i < len(values) for i in rows):
        raise ValueError("a column's index names no stored value")
    return [values[i] for i in rows]


def layout_doc(layout: RankLayout, by_digest: Callable[[str], bool] = lambda _: False) -> dict[str, object]:
    """The compact form of a rank layout in the state record (format 3; format 2 stored the address and pod
    columns as plain lists, and is read as before).

    Why: the layout was stored as one JSON row per slot, each with the full node id. At 12,500 nodes of 128-character
    random ids the record was 1.45 MB compressed (the ids themselves are ~97 bytes each of entropy, so no encoding
    of them fits 1 MiB), past etcd's default 1.5 MiB request limit with the cordon list and the records committed
    with it: every later state write, so every recovery, failed. Each node id is in its node record already; the
    layout names it by a digest of :data:`ID_DIGEST_BYTES` (~11 bytes stored), and keeps the full id only for
    nodes ``by_digest`` declines (no record, or one whose last write failed). Device counts are stored as runs,
    addresses and pod ids once per distinct value with an index per slot (:func:`_table`).

    Args:
        layout: the layout.
        by_digest: whether a node id may be named by its digest (its node record is in the store by the time
            this record is, see :meth:`~.durability.Durability._record_stored`).

    Returns:
        A JSON-friendly mapping (see :func:`layout_from_doc`).
    """
    refs = bytearray()
    ids: dict[str, str] = {}
    zero = bytes(ID_DIGEST_BYTES)
    for i, s in enumerate(layout.slots):
        if by_digest(s.node_id):
            refs += id_digest(s.node_id)
        else:
            refs += zero
            ids[str(i)] = s.node_id
    return {"format": 3, "n": len(layout.slots), "refs": base64.b64encode(bytes(refs)).decode(), "ids": ids,
            "lws": _runs([s.local_world_size for s in layout.slots]),
            # New keys, not "addr"/"pod": a format-2 coordinator reads those as lists, and iterating a table's
            # two keys gave a 2-slot layout the addresses "v" and "i"; missing, it says the store is corrupt.
            "addr_t": _table([s.address for s in layout.slots]), "pod_t": _table([s.pod_id for s in layout.slots])}


def layout_from_doc(doc: Mapping[str, object], group_size: int, node_ids: Iterable[str]) -> RankLayout:
    """Rebuilds a layout from :func:`layout_doc`'s form; digests are resolved against ``node_ids`` (the ids of
    the node records in the store).

    A digest no node record resolves (the record's write was lost to a store outage and the coordinator stopped
    before writing it again) becomes ``?lost-record-<digest>``, an id no node can register under: the slot is
    then a lost holder's, replaced as any other (its node, registering again, is a newcomer).

    Raises:
        MembershipError: the form is malformed or inconsistent, or two node records share a digest it names.
    """
    try:
        n = int(doc["n"])  # type: ignore[call-overload]
        refs = base64.b64decode(str(doc["refs"]), validate=True)
        ids = {int(k): str(v) for k, v in dict(doc["ids"]).items()}  # type: ignore[call-overload]
        runs = [(int(v), int(c)) for v, c in doc["lws"]]  # type: ignore[union-attr]
        if any(c < 1 for _, c in runs) or sum(c for _, c in runs) != n:  # before expanding: a corrupt count
            raise ValueError("device count runs do not add up to the slots")
        lws = [v for v, c in runs for _ in range(c)]
        if "addr_t" in doc:  # format 3
            addr, pod = _column(doc["addr_t"]), _column(doc["pod_t"])
        else:
            addr, pod = _column(doc["addr"]), _column(doc["pod"])
    except (KeyError, TypeError, ValueError) as exc:
        raise MembershipError(f"stored rank layout is malformed ({exc}): the store is corrupt") from exc
    if not (len(refs) == n * ID_DIGEST_BYTES and len(lws) == len(addr) == len(pod) == n):
        raise MembershipError("stored rank layout's columns differ in length: the store is corrupt")
    wanted = {refs[i * ID_DIGEST_BYTES:(i + 1) * ID_DIGEST_BYTES] for i in range(n) if i not in ids}
    known: dict[bytes, str] = {}
    for nid in node_ids:
        d = id_digest(nid)
        if d in wanted:
            if d in known and known[d] != nid:
                raise MembershipError(f"node records {known[d]!r} and {nid!r} share the digest the stored rank "
                                      "layout names a slot by: delete the one that holds no slot")
            known[d] = nid
    rows = []
    first = 0
    for i in range(n):
        d = refs[i * ID_DIGEST_BYTES:(i + 1) * ID_DIGEST_BYTES]
        nid = ids[i] if i in ids else known.get(d, LOST_RECORD_PREFIX + d.hex())
        rows.append({"node_id": nid, "group_rank": i, "first_rank": first, "local_world_size": lws[i],
                     "address": addr[i], "pod_id": pod[i]})
        first += lws[i]
    return layout_from_mapping(rows, group_size)


def state_value(policy: PolicyState, layout: RankLayout | None, group_size: int, master_port: int,
                used_ports: set[int], by_digest: Callable[[str], bool] = lambda _: False) -> bytes:
    """The value of the job state record; ``group_size`` is the layout's, or the spec's while there is none.

    Args:
        by_digest: whether a slot holder may be named by its id's digest (see :func:`layout_doc`); by default
            every id is stored in full.
    """
    part = layout_doc(layout, by_digest) if layout else None
    # No "layout" key: trainguard before format 2 reads it unconditionally, so an older coordinator started on this
    # store says the record is corrupt instead of taking the job for one with no layout.
    doc = {"policy": policy.to_dict(), "slots": part,
           "group_size": layout.group_size if layout else group_size,
           "master_port": master_port, "used_ports": sorted(used_ports)}
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 6)


def decode_state(job: str, value: bytes, node_ids: Iterable[str] = ()) -> StoredState:
    """Reads the job state record of ``job``; ``node_ids`` are the ids of the node records in the store, which
    the layout names by digest (formats 2 and 3). Records with the layout as rows of full ids (format 1) read as before.

    Raises:
        StoreError: the record is corrupt.
    """
    try:
        d = json.loads(zlib.decompress(value))
        policy = PolicyState.from_dict(d["policy"])
        if "slots" in d:  # formats 2 and 3
            part = d["slots"]
            layout = layout_from_doc(part, int(d["group_size"]), node_ids) if part else None
        else:
            rows = d["layout"]
            layout = layout_from_mapping(rows, int(d["group_size"])) if rows else None
        return StoredState(policy, layout, int(d["master_port"]), {int(p) for p in d["used_ports"]})
    except (ValueError, KeyError, TypeError, zlib.error, PolicyError, MembershipError) as exc:
        raise StoreError(f"job state of {job!r} is corrupt ({exc}): use a fresh store") from exc

"""The coordinator's records in the store, encoded and decoded: one record per node, and the job state.

Keys live under ``trainguard/jobs/<job>/`` (see :mod:`~trainguard.recovery.coordinator` for what each holds and
when it is written). A node record is JSON: the node's identity, its lease, its agent's instance id and why it
failed qualification. A held cordon's record (``held/<node id>``) is JSON: the fatal reason a node daemon reported
about a node that had not registered, the daemon's instance and host. The state record is zlib-compressed JSON:
the policy state, the rank layout, MASTER_PORT and every port used so far. Pure functions: the coordinator reads
and writes the store itself.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

from trainguard.recovery.domain import NodeRecord
from trainguard.recovery.errors import MembershipError, PolicyError, StoreError
from trainguard.recovery.policy import PolicyState
from trainguard.recovery.ranks import RankLayout, layout_from_mapping, layout_to_rows


@dataclass(frozen=True)
class StoredNode:
    """A node record as read back: identity, lease, agent instance, qualification refusal ("" if none)."""

    info: NodeRecord
    lease: str
    instance: str
    refused: str


@dataclass(frozen=True)
class StoredState:
    """The job state record as read back."""

    policy: PolicyState
    layout: RankLayout | None
    master_port: int
    used_ports: set[int]


def node_value(info: NodeRecord, lease: str, instance: str, refused: str) -> bytes:
    """The value of a node's record."""
    return json.dumps({"node": info.to_dict(), "lease": lease, "instance": instance, "refused": refused}).encode()


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
        return StoredNode(info, str(d["lease"]), str(d.get("instance", "")), str(d.get("refused", "")))
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


def state_value(policy: PolicyState, layout: RankLayout | None, group_size: int, master_port: int,
                used_ports: set[int]) -> bytes:
    """The value of the job state record; ``group_size`` is the layout's, or the spec's while there is none."""
    doc = {"policy": policy.to_dict(), "layout": layout_to_rows(layout) if layout else None,
           "group_size": layout.group_size if layout else group_size,
           "master_port": master_port, "used_ports": sorted(used_ports)}
    return zlib.compress(json.dumps(doc, separators=(",", ":")).encode(), 3)


def decode_state(job: str, value: bytes) -> StoredState:
    """Reads the job state record of ``job``.

    Raises:
        StoreError: the record is corrupt.
    """
    try:
        d = json.loads(zlib.decompress(value))
        policy = PolicyState.from_dict(d["policy"])
        rows = d["layout"]
        layout = layout_from_mapping(rows, int(d["group_size"])) if rows else None
        return StoredState(policy, layout, int(d["master_port"]), {int(p) for p in d["used_ports"]})
    except (ValueError, KeyError, TypeError, zlib.error, PolicyError, MembershipError) as exc:
        raise StoreError(f"job state of {job!r} is corrupt ({exc}): use a fresh store") from exc

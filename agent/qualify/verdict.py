"""The outcome of a node's pre-flight check: one result per check, and the verdict over all of them.

A :class:`Verdict` is what travels: printed by ``trainguard qualify`` (text or ``--json``), sent to the coordinator
at registration (the proto ``NodeQualification``, fields 120+ of ``RegisterNodeRequest`` and
``NodeHeartbeatRequest``), and read back there by :mod:`trainguard.recovery.qualification`.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI's parser is built without importing protobuf
    from trainguard.proto import coordinator_pb2


class CheckStatus(str, enum.Enum):
    """How one check ended. PASS and SKIP (nothing to check on this node, or not configured) let the node in."""

    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome.

    Attributes:
        name: the check (``pcie``, ``nic``, ...).
        status: pass, fail or skip.
        detail: one line: what was checked, or why it failed / was skipped.
        duration_s: wall time of the check, seconds.
        measured_s: a time the check measured for the coordinator to keep (the peer exchange's), 0 when none.
    """

    name: str
    status: CheckStatus
    detail: str
    duration_s: float = 0.0
    measured_s: float = 0.0


@dataclass(frozen=True)
class Verdict:
    """Every check's result and whether the node may take a slot.

    Attributes:
        node_id: the node checked.
        results: one per check that ran, in run order.
        duration_s: wall time of the whole qualification, seconds.
    """

    node_id: str
    results: tuple[CheckResult, ...] = field(default_factory=tuple)
    duration_s: float = 0.0

    @property
    def passed(self) -> bool:
        """No check failed."""
        return all(r.status is not CheckStatus.FAIL for r in self.results)

    @property
    def reason(self) -> str:
        """Why the node failed, one line (``""`` when it passed)."""
        return "; ".join(f"{r.name}: {r.detail}" for r in self.results if r.status is CheckStatus.FAIL)

    @property
    def peer_s(self) -> float:
        """The node's median exchange time with its peers, seconds (0 when the peer check did not measure one)."""
        return next((r.measured_s for r in self.results if r.name == "peers"), 0.0)

    def summary(self) -> str:
        """One line for logs: passed/failed, the reason, the time taken."""
        if self.passed:
            return f"node {self.node_id} qualified in {self.duration_s:.2f} s"
        return f"node {self.node_id} failed qualification ({self.duration_s:.2f} s): {self.reason}"

    def to_text(self) -> str:
        """A human report: one line per check, then the verdict."""
        lines = [f"{r.status.value.upper():4}  {r.name:9} {r.duration_s * 1000:7.1f} ms  {r.detail}"
                 for r in self.results]
        return "\n".join(lines + [self.summary()])

    def to_json(self) -> str:
        """The verdict as a JSON object (``passed``, ``reason``, ``duration_s``, ``checks``)."""
        return json.dumps({"node_id": self.node_id, "passed": self.passed, "reason": self.reason,
                           "duration_s": round(self.duration_s, 4),
                           "checks": [dict(asdict(r), status=r.status.value, duration_s=round(r.duration_s, 4))
                                      for r in self.results]}, indent=2)

    def to_pb(self, echo_port: int = 0) -> "coordinator_pb2.NodeQualification":
        """The verdict on the wire; ``echo_port``: where the node answers peers' exchanges (0: it does not)."""
        from trainguard.proto import coordinator_pb2

        msg = coordinator_pb2.NodeQualification(passed=self.passed, reason=self.reason[:1000],
                                                duration_s=self.duration_s, echo_port=echo_port, peer_s=self.peer_s)
        for r in self.results:
            msg.checks.add(name=r.name, status=r.status.value, detail=r.detail[:500], duration_s=r.duration_s)
        return msg

    @classmethod
    def from_pb(cls, node_id: str, msg: "coordinator_pb2.NodeQualification") -> "Verdict":
        """A verdict read from the wire (an unknown status counts as a failure: a newer agent's refusal).

        Args:
            node_id: the node that sent it.
            msg: the message.
        """
        results = []
        for c in msg.checks:
            try:
                status = CheckStatus(c.status)
            except ValueError:
                status = CheckStatus.FAIL
            results.append(CheckResult(c.name, status, c.detail, c.duration_s,
                                       msg.peer_s if c.name == "peers" else 0.0))
        if not msg.passed and all(r.status is not CheckStatus.FAIL for r in results):
            results.append(CheckResult("verdict", CheckStatus.FAIL, msg.reason or "failed (no reason given)"))
        return cls(node_id, tuple(results), msg.duration_s)


__all__ = ["CheckResult", "CheckStatus", "Verdict"]

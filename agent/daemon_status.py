"""What the node agent daemon says about itself: its health statuses and metrics copied from live state each loop
turn, the self-check that gates the systemd watchdog's keep-alives, and the one-line status for systemd's STATUS=
and the log.

:class:`DaemonStatus` is a part of :class:`~trainguard.agent.agentd.AgentDaemon` (a base class): it reads the
daemon's parts (``config``, ``metrics``, ``health``, ``node_health``, ``jobs``, ``runner``, ``verdict_latch``) and
the serving state its start recorded (``_self_check``, ``_socket_ino``, ``_certs``, ``tcp_port``).
"""

from __future__ import annotations

import logging
import os
import stat

import grpc
from grpc_health.v1 import health_pb2

from trainguard.agent.health import NODE_AGENT_SERVICE

# The daemon's logger: these lines were the daemon's before they moved here, and operators filter on its name.
log = logging.getLogger("trainguard.agent.agentd")

#: Deadline of the daemon's own health self-check, in seconds.
SELF_CHECK_TIMEOUT_S = 2.0


def detector_counts(statuses: list) -> str:
    """``detectors 7 ok, 4 no hardware, 1 failed`` for the status line: the detectors by state, ok first, then
    the others that occur (a detector with nothing to watch on this node is not "ok": it watches nothing, and
    one not sampled yet has read nothing).

    Args:
        statuses: the runner's :class:`~trainguard.detectors.runner.DetectorStatus` list.
    """
    counts: dict[str, int] = {}
    for status in sorted(statuses, key=lambda s: s.state):
        # OK is the runner's state before a first sample; a stalled first sample already reads ERROR.
        unsampled = not status.samples and status.state.name == "OK"
        label = "not sampled yet" if unsampled else status.state.name.lower().replace("_", " ")
        counts[label] = counts.get(label, 0) + 1
    counts = {"ok": counts.pop("ok", 0), **counts}
    return "detectors " + ", ".join(f"{n} {label}" for label, n in counts.items())


class DaemonStatus:
    """The daemon's statuses, self-check and status line (see the module docstring)."""

    def detector_statuses(self) -> list:
        """The detector runner's statuses (empty without detectors)."""
        return list(self.runner.statuses()) if self.runner is not None else []

    def _refresh(self) -> None:
        """Copies live state into metrics and health statuses."""
        statuses = self.detector_statuses()
        self._sampler_progress.observe(statuses)  # every loop turn: progress is dated to the turn that saw it
        if self.metrics is not None:
            self.metrics.set_detector_states({s.name: s.state.name for s in statuses})
            self.metrics.set_worker_states([])  # the daemon runs no workers (jobs' launchers do)
            if self.node_health is not None:
                h = self.node_health
                self.metrics.set_predictor(h.score, h.threshold, h.alarms_per_day)
        if not self._socket_in_place():
            # Launchers and `trainguard status` cannot reach this agent and the running server cannot bind the
            # path again: NOT_SERVING fails the liveness probe (and the self-check, which stops the watchdog's
            # keep-alives), so the agent is restarted and binds it anew.
            self.health.set("", False)
            self.health.set(NODE_AGENT_SERVICE, False)
        self._predictor_degraded()
        self.health.set_subsystem("coordinator", self.jobs is None or self.jobs.configured_ok())
        self.health.set_subsystem("workers", True)
        from trainguard.detectors.base import DetectorState

        bad = (DetectorState.FAILED, DetectorState.ERROR)
        if statuses:
            self.health.set_detectors({s.name: s.state not in bad for s in statuses})
        else:
            self.health.set_subsystem("detectors", not self.detector_gap)

    def subsystem_details(self) -> dict[str, str]:
        """Why each subsystem that is not serving is not (``trainguard status`` showed "coordinator not_serving"
        and the reason was only in the daemon's journal)."""
        out: dict[str, str] = {}
        if self.jobs is not None and (problems := self.jobs.configured_problems()):
            out["coordinator"] = "; ".join(problems)
        if absent := self._absent_model_metrics():
            out["predictor"] = (f"the model was trained on {', '.join(absent)}, which this node does not produce: "
                                "the rules tier only")
        return out

    def _absent_model_metrics(self) -> list[str]:
        monitor = getattr(self.node_health, "predictor", None) if self.node_health is not None else None
        return list(getattr(monitor, "absent_model_metrics", None) or ())

    def _predictor_degraded(self) -> None:
        """A model trained on metrics this node does not produce leaves the rules tier only (the monitor finds
        out a minute after start): said in ``trainguard status`` (predictor not serving) and once as a WARNING
        event, where before only the journal said it and every status read "predictor ok"."""
        absent = self._absent_model_metrics()
        if not absent:
            return
        self.health.set_subsystem("predictor", False)
        if self._predictor_degraded_said:
            return
        self._predictor_degraded_said = True
        from trainguard.detectors.events import Action, HealthEvent, Severity

        model = self.config.predictor.model if self.config is not None else ""
        self._on_event(HealthEvent(
            source="predictor", kind="predictor.degraded", severity=Severity.WARNING, action=Action.WATCH,
            message=f"the model {model} was trained on {', '.join(absent)}, which this node does not produce: "
                    "scoring with the rules tier only; enable the detectors that produce them or retrain on this "
                    "node's history",
            evidence={"absent_metrics": ",".join(absent), "model": model}))

    def _socket_in_place(self) -> bool:
        """Whether ``grpc.socket`` still names the socket this agent serves on (logs once when it does not).

        The self-check's channel keeps the connection it made before, so it cannot tell a removed or replaced
        socket file: the agent answered itself while nobody else could reach it.
        """
        sock = self.config.grpc.socket if self.config is not None else ""
        if not sock or self._socket_ino is None:
            return True
        try:
            st = os.stat(sock)
            in_place = stat.S_ISSOCK(st.st_mode) and st.st_ino == self._socket_ino
        except OSError:
            in_place = False
        if not in_place and not self._socket_lost:
            self._socket_lost = True
            log.error("the socket %s was removed or replaced: launchers and `trainguard status` cannot reach this "
                      "agent; health NOT_SERVING and no watchdog keep-alives, so that it is restarted", sock)
        return in_place

    def _sampler_stalled(self) -> bool:
        statuses = self.detector_statuses()
        if not statuses:
            return False
        shortest = min(getattr(d.config, "interval_s", 5.0) for d in self.runner.detectors)
        return self._sampler_progress.stalled(statuses, shortest)

    def _healthy(self) -> bool:
        """The main loop's verdict: gRPC answers its own health check and the detector sampler progresses."""
        if self._self_check is not None:
            try:
                reply = self._self_check(health_pb2.HealthCheckRequest(service=""), timeout=SELF_CHECK_TIMEOUT_S)
            except grpc.RpcError as exc:
                log.error("self-check: the gRPC server did not answer (%s); withholding watchdog pings", exc.code())
                return False
            if reply.status != health_pb2.HealthCheckResponse.SERVING:
                return False
        if self._sampler_stalled():
            log.error("self-check: the detector sampler made no progress; withholding watchdog pings")
            return False
        return True

    def _summary(self) -> str:
        """One line for systemd's STATUS= and the log."""
        workers = 0  # jobs' launchers run the workers
        score = self.node_health.score if self.node_health is not None else 0.0
        detectors = detector_counts(self.detector_statuses()) if not self.detector_gap else "no detectors"
        where = []
        if self.config is not None and self.config.grpc.socket:
            where.append(f"unix:{self.config.grpc.socket}")
        if self.config is not None and self.config.grpc.listen:
            where.append(f"tcp:{self.tcp_port}{'+tls' if self._certs else ''}")
        coordinators = self.jobs.summary() if self.jobs is not None else ""
        coordinators = f"; {coordinators}" if coordinators else ""
        verdict = self.verdict_latch.verdict().verdict.name.lower()
        return (f"serving on {' '.join(where)}; {detectors}; {workers} workers; risk {score:.2f}; "
                f"node {verdict}{coordinators}")


__all__ = ["SELF_CHECK_TIMEOUT_S", "DaemonStatus", "detector_counts"]

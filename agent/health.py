"""The standard ``grpc.health.v1`` service with one status per agent subsystem, plus server reflection.

Health checkers (``grpc_health_probe``, Kubernetes gRPC probes, load balancers) ask ``Check(service)``:

- ``""`` (the whole server): SERVING while the daemon runs and its main loop is healthy; NOT_SERVING during a
  graceful stop. Use it for liveness.
- ``trainguard.v1.NodeAgent``: the node service itself.
- ``trainguard.agent.<subsystem>`` for each of :data:`SUBSYSTEMS` (``detectors``, ``workers``, ``predictor``,
  ``coordinator``, ``metrics``), and ``trainguard.agent.detector.<name>`` for each detector: NOT_SERVING when
  that part failed. Use them for readiness or alerting. A subsystem the user switched off (``metrics.listen =
  ""``, ``predictor.enabled = false``) is no fault: SERVING, and named in the ``trainguard-off`` trailing
  metadata of ``List`` (comma-separated service names), which ``trainguard status`` shows as "off".

Statuses change only through :class:`HealthReporter`, which also remembers them for ``trainguard status``; the
``List`` method returns all of them in one call.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

#: Full name of the node-agent gRPC service.
NODE_AGENT_SERVICE = "trainguard.v1.NodeAgent"
#: Prefix of per-subsystem health service names.
SUBSYSTEM_PREFIX = "trainguard.agent."
#: Subsystems with their own health status.
SUBSYSTEMS = ("detectors", "workers", "predictor", "coordinator", "metrics")
#: Trailing metadata key of ``List``: the services switched off by configuration, comma-separated.
OFF_METADATA_KEY = "trainguard-off"

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def subsystem_service(name: str) -> str:
    """Health service name of a subsystem, e.g. ``trainguard.agent.detectors``."""
    return SUBSYSTEM_PREFIX + name


def detector_service(name: str) -> str:
    """Health service name of one detector, e.g. ``trainguard.agent.detector.roce``."""
    return f"{SUBSYSTEM_PREFIX}detector.{name}"


class _ListingHealthServicer(health.HealthServicer):
    """The stock servicer plus ``List`` (every status in one call), which the stock one leaves unimplemented."""

    def __init__(self, reporter: "HealthReporter") -> None:
        super().__init__(experimental_non_blocking=True)
        self._reporter = reporter

    def List(self, request, context):  # noqa: N802 (gRPC naming)
        reply = health_pb2.HealthListResponse()
        for service, serving in self._reporter.status().items():
            reply.statuses[service].status = _SERVING if serving else _NOT_SERVING
        off = self._reporter.off()
        if off:
            context.set_trailing_metadata(((OFF_METADATA_KEY, ",".join(off)),))
        return reply


class HealthReporter:
    """Owns the health servicer and the status of every subsystem.

    Thread-safe: the main loop, detector threads and the shutdown path all report.
    """

    def __init__(self) -> None:
        """Creates the servicer with every known service NOT_SERVING until the daemon says otherwise."""
        self.servicer = _ListingHealthServicer(self)
        self._lock = threading.Lock()
        self._status: dict[str, bool] = {}
        self._off: set[str] = set()
        self._stopping = False
        for service in ("", NODE_AGENT_SERVICE, *(subsystem_service(s) for s in SUBSYSTEMS)):
            self._set(service, False)

    def _set(self, service: str, serving: bool) -> None:
        self._status[service] = serving
        self.servicer.set(service, _SERVING if serving else _NOT_SERVING)

    def set(self, service: str, serving: bool) -> None:
        """Sets one service's status (a full name, see :func:`subsystem_service`); ignored once stopping.

        Args:
            service: health service name; ``""`` is the whole server.
            serving: True for SERVING, False for NOT_SERVING.
        """
        with self._lock:
            if self._stopping or self._status.get(service) == serving:
                return
            self._set(service, serving)

    def set_subsystem(self, name: str, serving: bool) -> None:
        """Sets a subsystem's status by short name (``"detectors"``...)."""
        with self._lock:
            self._off.discard(subsystem_service(name))
        self.set(subsystem_service(name), serving)

    def set_subsystem_off(self, name: str) -> None:
        """Marks a subsystem as switched off by the user (``metrics.listen = ""``): SERVING, as nothing is wrong
        with it, and listed by :meth:`off`. NOT_SERVING, a node set up so failed its readiness probes and showed
        "metrics not_serving" in ``trainguard status``."""
        with self._lock:
            self._off.add(subsystem_service(name))
        self.set(subsystem_service(name), True)

    def off(self) -> list[str]:
        """The services switched off by configuration, sorted."""
        with self._lock:
            return sorted(self._off)

    def set_detectors(self, states: dict[str, bool]) -> None:
        """Sets each detector's status, and the ``detectors`` subsystem to SERVING only if all are.

        Args:
            states: detector name -> healthy.
        """
        for name, ok in states.items():
            self.set(detector_service(name), ok)
        self.set_subsystem("detectors", all(states.values()))

    def status(self) -> dict[str, bool]:
        """A copy of every service's current status (name -> serving)."""
        with self._lock:
            return dict(self._status)

    def shutdown(self) -> None:
        """Marks everything NOT_SERVING for a graceful stop; later :meth:`set` calls are ignored."""
        with self._lock:
            self._stopping = True
            for service in self._status:
                self._status[service] = False
        self.servicer.enter_graceful_shutdown()

    def add_to_server(self, server: grpc.Server) -> None:
        """Registers the ``grpc.health.v1.Health`` service on a server."""
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)


def enable_reflection(server: grpc.Server, service_names: Iterable[str] = (NODE_AGENT_SERVICE,)) -> list[str]:
    """Serves gRPC server reflection listing the given services, the health service and reflection itself.

    Args:
        server: the server (before ``start()``).
        service_names: full names of the application services to list.

    Returns:
        Every service name reflection lists.
    """
    names = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server)
    return names

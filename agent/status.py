"""``trainguard status``: ask a node agent for its health and print it."""

from __future__ import annotations

import json

import grpc
from google.protobuf import json_format

from trainguard.agent.errors import AgentError
from trainguard.proto import agent_pb2, agent_pb2_grpc


def fetch_health(socket_path: str | None = None, target: str | None = None, timeout_s: float = 3.0):
    """Fetches ``NodeHealth`` from an agent.

    Raises:
        AgentError: the agent cannot be reached or refused the call.
    """
    address = target or f"unix:{socket_path}"
    with grpc.insecure_channel(address) as channel:
        try:
            return agent_pb2_grpc.NodeAgentStub(channel).GetHealth(agent_pb2.GetHealthRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise AgentError(f"no node agent answers at {address} ({exc.code().name}); is `trainguard agent` "
                             "running, and is the socket/target right?") from exc


def show_status(socket_path: str | None, target: str | None, as_json: bool) -> int:
    """Prints the agent's health as a table (or JSON); returns the exit code."""
    h = fetch_health(socket_path, target)
    if as_json:
        print(json.dumps(json_format.MessageToDict(h, preserving_proto_field_name=True), indent=2))
        return 0
    print(f"node {h.node_id}  trainguard {h.version}  up {h.uptime_s:.0f}s  job {h.job or '-'}  "
          f"generation {h.generation}  last checkpoint {h.last_checkpoint_step}")
    if h.detectors:
        print(f"{'DETECTOR':<16}{'STATE':<14}DETAIL")
        for d in h.detectors:
            print(f"{d.name:<16}{agent_pb2.DetectorState.Name(d.state).removeprefix('DETECTOR_STATE_'):<14}{d.detail}")
    if h.workers:
        print(f"{'RANK':<6}{'PID':<8}{'STATE':<11}{'STEP':<8}HEARTBEAT AGE")
        for w in h.workers:
            state = agent_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_")
            print(f"{w.rank:<6}{w.pid:<8}{state:<11}{w.step:<8}{w.last_heartbeat_age_s:.1f}s")
    for e in h.recent_events:
        print(f"event {e.kind} {e.subject}: {e.message}")
    return 0

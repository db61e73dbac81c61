"""trainguard's gRPC protocol (package ``trainguard.v1``) and its generated Python modules.

Import the generated modules from here::

    from trainguard.proto import common_pb2, agent_pb2, agent_pb2_grpc
"""

from trainguard.proto.trainguard.v1 import (  # noqa: F401  (re-exported)
    agent_pb2,
    agent_pb2_grpc,
    common_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    replica_pb2,
    replica_pb2_grpc,
)

__all__ = ["agent_pb2", "agent_pb2_grpc", "common_pb2", "coordinator_pb2", "coordinator_pb2_grpc", "replica_pb2",
           "replica_pb2_grpc"]

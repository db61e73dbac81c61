"""trainguard.agent: the node agent (worker supervisor, coordinator link, node health, daemon)."""

import os

# The supervisor starts workers with a preexec_fn, i.e. fork then exec, from a process that runs gRPC (its local
# server, the coordinator link). With gRPC's fork support on, the child runs gRPC's fork handlers between fork and
# exec, and its event-engine poller aborted it (SIGABRT, "epoll_wait error: Bad file descriptor") before the
# worker started: seen with run_job or a LocalSupervisor used in-process. The CLI sets the same before gRPC loads
# (trainguard/cli.py); this covers importing the agent as a library. An explicit setting is kept.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

"""What one generation's workers get on this node: their specs (torchrun's environment), the store the agent
hosts for them, and the folder of their ``TORCHELASTIC_ERROR_FILE``s."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

from trainguard.agent.errors import WorkerStartError
from trainguard.agent.workers import WorkerSpec
from trainguard.worker_env import WorkerEnv, WorkerEnvError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.agent.node import NodeConfig
    from trainguard.agent.worker_store import GenerationStore
    from trainguard.proto import common_pb2

log = logging.getLogger(__name__)


def worker_specs(c: NodeConfig, table: common_pb2.RankTable, mine: common_pb2.NodeRanks, errors_dir: str,
                 use_agent_store: bool) -> list[WorkerSpec]:
    """One spec per local rank of ``mine`` in ``table``, each with torchrun's environment and its own error file
    ``<errors_dir>/rank<R>/error.json``."""
    specs = []
    for local_rank in range(mine.local_world_size):
        rank = mine.first_rank + local_rank
        error_file = os.path.join(errors_dir, f"rank{rank}", "error.json")
        os.makedirs(os.path.dirname(error_file), exist_ok=True)
        worker = WorkerEnv(
            rank=rank,
            local_rank=local_rank,
            world_size=table.world_size,
            local_world_size=mine.local_world_size,
            group_rank=mine.group_rank,
            group_world_size=table.node_count or len(table.nodes),  # large jobs list only this node
            master_addr=table.master_addr,
            master_port=table.master_port,
            restart_count=table.restart_count,
            max_restarts=table.max_restarts,
            run_id=c.job,
            role=c.role,
            use_agent_store=use_agent_store,
            error_file=error_file,
            signals_to_handle=c.signals_to_handle,
            generation=table.generation,
            job=c.job,
            job_by_start_time=c.job_by_start_time,
            node_id=c.node_id,
            agent_socket=c.socket_path or None,
        )
        try:
            env = worker.to_env(os.environ, virtual_local_rank=c.virtual_local_rank, extra=c.extra_env)
        except WorkerEnvError as exc:
            raise WorkerStartError(str(exc)) from exc
        specs.append(WorkerSpec(rank=rank, local_rank=local_rank, argv=list(c.argv), env=env))
    return specs


class GenerationResources:
    """The agent-side resources of the current generation: its store (when this node hosts it) and the folder
    of its workers' error files.

    Args:
        error_dir: root of the error files; None makes (and later removes) a temporary folder.
    """

    def __init__(self, error_dir: str | None) -> None:
        self._error_dir = error_dir
        self._root: str | None = error_dir
        self._store: GenerationStore | None = None
        self._disabled = False  # hosting failed once: rank 0 hosts from then on
        self.failed: tuple[int, str] | None = None  # (generation, why) when hosting failed after the start

    def host_store(self, c: NodeConfig, table: common_pb2.RankTable, mine: common_pb2.NodeRanks) -> bool:
        """Closes the previous generation's store and, when this node holds rank 0, hosts the new one on the
        table's ``MASTER_PORT``; returns the workers' ``TORCHELASTIC_USE_AGENT_STORE``.

        Every node's workers are clients of the agent's store (as under torchrun). If this node cannot host it
        (the port was taken since it was reported free), its rank 0 hosts it instead, at the same address.
        """
        self.close_store()
        if not c.host_store or self._disabled:
            return False
        if mine.first_rank != 0:
            return True
        from trainguard.agent.worker_store import GenerationStore, StoreHostError

        generation = table.generation

        def failed_later(exc: Exception) -> None:
            # The workers were told the agent hosts the store: this generation cannot form. The agent restarts
            # it (a new port), and rank 0 hosts the stores from then on.
            self._disabled = True
            self.failed = (generation, str(exc))

        try:
            self._store = GenerationStore(table.master_port, table.world_size).start_soon(failed_later)
            return True
        except StoreHostError as exc:
            log.warning("generation %d: %s; rank 0 hosts the store instead", generation, exc)
            self._disabled = True
            return False

    def close_store(self) -> None:
        """Closes the hosted store, if any."""
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def error_dir(self, generation: int) -> str:
        """``<root>/g<generation>``, created: a fresh folder for the generation's error files."""
        if self._root is None:
            self._root = tempfile.mkdtemp(prefix="tg-errors-")
        path = os.path.join(self._root, f"g{generation}")
        os.makedirs(path, exist_ok=True)
        return path

    def cleanup(self) -> None:
        """Closes the store and removes a temporary error folder."""
        self.close_store()
        if self._root is not None and self._error_dir is None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None


def read_error_file(path: str | None, limit: int = 500) -> str | None:
    """The exception a worker recorded in its ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record`` writes
    ``{"message": {"message": "RuntimeError: ...", "extraInfo": {...}}}``), first line, at most ``limit``
    characters; None when there is no usable file."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    if not isinstance(msg, str) or not msg.strip():
        return None
    first = msg.strip().splitlines()[0]
    return first if len(first) <= limit else first[:limit - 3] + "..."

"""The worker environment: the one contract between whoever launches a training worker and the worker itself.

The launcher side (the node agent of ``trainguard run`` and of the daemon) writes it with
:meth:`WorkerEnv.to_env`; the worker side (the training hook, the drill's workers, any user script) reads it with
:meth:`WorkerEnv.from_env`. Both the variable names and their parsing live here and nowhere else, so a name
cannot drift between the two processes.

It is torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_*``, ...,
so unmodified torch scripts run) plus trainguard's own ``TRAINGUARD_*`` variables. Every field has the default a
worker sees when it runs alone (rank 0 of 1) or under plain torchrun (no trainguard variables).

This module imports nothing beyond the standard library and :mod:`trainguard.errors`, so the hook stays light.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from trainguard.errors import ConfigError

#: Unix socket of the node agent serving this worker (``WorkerHeartbeat``, advisories).
AGENT_SOCKET_ENV = "TRAINGUARD_AGENT_SOCKET"
#: Generation (incarnation of the job's rank table) the worker belongs to.
GENERATION_ENV = "TRAINGUARD_GENERATION"
#: The job's name.
JOB_ENV = "TRAINGUARD_JOB"
#: ``1`` when ``trainguard run`` named the job after its start time (a one-node run given no ``--job``,
#: ``--rdzv-id`` or checkpoint directory): a worker that checkpoints to a directory of its own
#: (``trainguard.init(checkpoint_dir=...)``) names the job after it instead, as under torchrun, so a relaunch
#: resumes.
JOB_BY_START_TIME_ENV = "TRAINGUARD_JOB_BY_START_TIME"
#: The node id of the agent that started the worker.
NODE_ID_ENV = "TRAINGUARD_NODE_ID"
#: Default checkpoint location (directory or fsspec URL) for every worker, set by ``trainguard run
#: --checkpoint-dir``.
CHECKPOINT_DIR_ENV = "TRAINGUARD_CHECKPOINT_DIR"
#: Unix socket of the agent-owned checkpoint service; when absent a Checkpointer starts its own persist process.
CHECKPOINT_SERVICE_ENV = "TRAINGUARD_CHECKPOINT_SERVICE"
#: The coordinator's restore plan for this worker's rank, set by the node agent for each new generation: JSON
#: ``{"generation", "step", "memory_steps", "source", "peer_node"}`` (:mod:`trainguard.recovery.memory_plan`).
#: ``memory_steps`` are steps whose every rank's copy lies in its own node's memory: the Checkpointer then
#: restores them from this node's memory although the other copies lie on other hosts.
RESTORE_PLAN_ENV = "TRAINGUARD_RESTORE_PLAN"

#: torchrun's variable names (``torch.distributed.run``), set for every worker.
RANK_ENV = "RANK"
LOCAL_RANK_ENV = "LOCAL_RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"
GROUP_RANK_ENV = "GROUP_RANK"
GROUP_WORLD_SIZE_ENV = "GROUP_WORLD_SIZE"
ROLE_NAME_ENV = "ROLE_NAME"
MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
USE_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"

#: The run id torchrun makes up for each one-node launch (``--standalone``, or no rendezvous flags): a fresh
#: uuid4, so it names no job across launches. (A multi-node job's ``none``, torchrun's default ``--rdzv-id``,
#: is stable and the same on every node.)
_TORCHRUN_MADE_RUN_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def torchrun_made_run_id(run_id: str) -> bool:
    """Whether ``run_id`` is one torchrun made up for a single one-node launch (a uuid4), not a
    ``--rdzv-id`` someone chose or torchrun's stable default ``none``."""
    return bool(_TORCHRUN_MADE_RUN_ID.match(run_id))


def checkpoint_job_name(script: str, checkpoint_dir: str) -> str:
    """``<script stem>-<10 hex digits of the SHA-256 of the checkpoint location>``: the job name of a one-node
    ``trainguard run`` with ``--checkpoint-dir`` and no ``--job``, and of the hook under a one-node
    torchrun launch (whose run id is a fresh uuid), so rerunning the same command finds the same
    checkpoints under either launcher.

    A local location is resolved to its real absolute path (``~``, symlinks, a trailing slash, relative to the
    working directory), whether given as a path or as ``file:///abs`` / ``file:/abs``: one directory has one
    name, whichever spelling the launcher and the worker were given. A remote URL is hashed in its canonical
    spelling (``s3://b/x/``, ``s3://b//x`` and ``S3://b/x`` name one job, that of ``s3://b/x``). A ``-m``
    module's ``__main__.py`` is named after its package folder.

    Raises:
        CheckpointConfigError: a ``file://`` URL with a host part (``file://data/ckpt``), which names no
            directory every process agrees on.
    """
    from trainguard.checkpoint.location import CheckpointLocation

    base = os.path.basename(script.rstrip("/"))
    stem = os.path.splitext(base)[0]
    if stem == "__main__":
        stem = os.path.basename(os.path.dirname(os.path.abspath(script)))
    # The location's identity: the real path of a local one (what jobs were named before file:// URLs were
    # normalised), the canonical URL of a remote one. Hashed as typed, s3://b/x/ and s3://b/x named two jobs of
    # one folder, so a relaunch spelled differently resumed none of the checkpoints; a canonical spelling and a
    # local path keep the name they had.
    where = CheckpointLocation.parse(checkpoint_dir, "checkpoint directory").identity
    # the same valid name as trainguard run's (job_name_from): the hook kept '_train-…' or 'my train-…' where the
    # launcher named the job 'train-…' / 'my_train-…', so neither resumed the other's checkpoints
    return job_name_from(stem or "job", hashlib.sha256(where.encode()).hexdigest()[:10])


def job_name_from(stem: str, suffix: str) -> str:
    """``<stem>-<suffix>`` as a valid job name (:data:`JOB_NAME_RE`): characters a job name may not hold
    become ``_``, a leading one that is not a letter or digit goes, and the stem is cut to fit 128 characters.
    torchrun runs any script name; a default name built from ``_train.py``, ``my train.py`` or ``训练.py`` was
    refused by the coordinator ("job name ... is invalid") for a name the user never gave."""
    from trainguard.recovery.spec import JOB_NAME_RE

    name = f"{stem}-{suffix}"
    if JOB_NAME_RE.match(name):
        return name  # unchanged: a rerun keeps finding the checkpoints of earlier versions
    safe = re.sub(r"[^A-Za-z0-9._:@-]+", "_", stem)
    safe = re.sub(r"^[^A-Za-z0-9]+", "", safe)[:127 - len(suffix)].rstrip("._:@-") or "job"
    return f"{safe}-{suffix}"


def run_id_job_name(run_id: str) -> str:
    """The job name of a torchrun ``--rdzv-id`` (``TORCHELASTIC_RUN_ID``): the id itself when it is a valid job
    name, else the id with the characters a job name may not hold as ``_`` plus 8 hex digits of its hash (two ids
    that differ only there stay two jobs). torchrun takes any id: one taken from a scheduler or a path
    (``team/run 7``) was refused by ``trainguard run``. (The hook under plain torchrun keeps the raw id, as its
    checkpoint folders of earlier versions are named.)"""
    from trainguard.recovery.spec import JOB_NAME_RE

    if JOB_NAME_RE.match(run_id):
        return run_id
    return job_name_from(run_id, hashlib.sha256(run_id.encode()).hexdigest()[:8])


#: torchrun's default ``TORCHELASTIC_SIGNALS_TO_HANDLE``.
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


class WorkerEnvError(ConfigError):
    """A worker environment variable is malformed, or cannot be built (no device for a virtual local rank)."""


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise WorkerEnvError(f"environment variable {name}={value!r} is not an integer") from None


def _str(env: Mapping[str, str], name: str) -> str | None:
    return env.get(name) or None


@dataclass(frozen=True)
class WorkerEnv:
    """What one worker is told about its place in the job.

    Attributes:
        rank: global rank (``RANK``), default 0.
        local_rank: index of the worker on its node (``LOCAL_RANK``), default 0.
        world_size: number of workers in the job (``WORLD_SIZE``), default 1.
        local_world_size: workers on this node (``LOCAL_WORLD_SIZE``), default 1.
        group_rank: index of this node (``GROUP_RANK``), default 0.
        group_world_size: nodes in the job (``GROUP_WORLD_SIZE``), default 1.
        master_addr: host of the generation's store (``MASTER_ADDR``); empty when unset.
        master_port: its TCP port (``MASTER_PORT``); 0 when unset.
        restart_count: restarts of the job so far (``TORCHELASTIC_RESTART_COUNT``), default 0.
        max_restarts: restart budget (``TORCHELASTIC_MAX_RESTARTS``), default 0.
        run_id: torchrun's job id (``TORCHELASTIC_RUN_ID``); empty when unset.
        role: ``ROLE_NAME`` (torchrun's ``--role``), default ``"default"``.
        use_agent_store: the launcher hosts the store (``TORCHELASTIC_USE_AGENT_STORE``), default False.
        error_file: where torch's ``@record`` writes the worker's exception (``TORCHELASTIC_ERROR_FILE``).
        signals_to_handle: ``TORCHELASTIC_SIGNALS_TO_HANDLE``, default torchrun's.
        generation: the trainguard generation (``TRAINGUARD_GENERATION``), default 0.
        job: the trainguard job name (``TRAINGUARD_JOB``); empty when unset (see :attr:`job_name`).
        job_by_start_time: ``trainguard run`` named the job after its start time (``TRAINGUARD_JOB_BY_START_TIME``).
        node_id: the agent's node id (``TRAINGUARD_NODE_ID``); empty when unset.
        agent_socket: the node agent's unix socket (``TRAINGUARD_AGENT_SOCKET``); None without an agent.
        checkpoint_dir: default checkpoint location (``TRAINGUARD_CHECKPOINT_DIR``); None when unset.
        checkpoint_service: the agent's checkpoint service socket (``TRAINGUARD_CHECKPOINT_SERVICE``); None when
            unset.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    group_rank: int = 0
    group_world_size: int = 1
    master_addr: str = ""
    master_port: int = 0
    restart_count: int = 0
    max_restarts: int = 0
    run_id: str = ""
    role: str = "default"
    use_agent_store: bool = False
    error_file: str | None = None
    signals_to_handle: str = DEFAULT_SIGNALS
    generation: int = 0
    job: str = ""
    job_by_start_time: bool = False
    node_id: str = ""
    agent_socket: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_service: str | None = None

    @property
    def job_name(self) -> str:
        """The job's name as a worker should use it: ``TRAINGUARD_JOB``, else ``TORCHELASTIC_RUN_ID``, else
        ``"default"``."""
        return self.job or self.run_id or "default"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerEnv:
        """Reads the worker environment; a variable that is unset or empty takes its default.

        Args:
            env: the environment to read (default ``os.environ``).

        Returns:
            The parsed environment.

        Raises:
            WorkerEnvError: an integer variable holds something else (the message names the variable).
        """
        e = os.environ if env is None else env
        store = (e.get(USE_AGENT_STORE_ENV) or "").strip().lower()
        return cls(
            rank=_int(e, RANK_ENV, 0),
            local_rank=_int(e, LOCAL_RANK_ENV, 0),
            world_size=_int(e, WORLD_SIZE_ENV, 1),
            local_world_size=_int(e, LOCAL_WORLD_SIZE_ENV, 1),
            group_rank=_int(e, GROUP_RANK_ENV, 0),
            group_world_size=_int(e, GROUP_WORLD_SIZE_ENV, 1),
            master_addr=e.get(MASTER_ADDR_ENV) or "",
            master_port=_int(e, MASTER_PORT_ENV, 0),
            restart_count=_int(e, RESTART_COUNT_ENV, 0),
            max_restarts=_int(e, MAX_RESTARTS_ENV, 0),
            run_id=e.get(RUN_ID_ENV) or "",
            role=e.get(ROLE_NAME_ENV) or "default",
            use_agent_store=store in ("1", "true", "yes"),
            error_file=_str(e, ERROR_FILE_ENV),
            signals_to_handle=e.get(SIGNALS_TO_HANDLE_ENV) or DEFAULT_SIGNALS,
            generation=_int(e, GENERATION_ENV, 0),
            job=e.get(JOB_ENV) or "",
            job_by_start_time=(e.get(JOB_BY_START_TIME_ENV) or "").strip() == "1",
            node_id=e.get(NODE_ID_ENV) or "",
            agent_socket=_str(e, AGENT_SOCKET_ENV),
            checkpoint_dir=_str(e, CHECKPOINT_DIR_ENV),
            checkpoint_service=_str(e, CHECKPOINT_SERVICE_ENV),
        )

    def to_env(self, base: Mapping[str, str], *, virtual_local_rank: bool = False,
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The complete environment of the worker: ``base``, torchrun's variables, then trainguard's.

        Unmodified torch scripts (``init_process_group`` with ``env://``) run under it. trainguard's optional
        variables (agent socket, checkpoint location and service) are set only when they have a value;
        an empty ``error_file`` removes an inherited ``TORCHELASTIC_ERROR_FILE``.

        Args:
            base: the environment to start from (usually ``os.environ``); not modified.
            virtual_local_rank: torchrun's ``--virtual-local-rank``: ``LOCAL_RANK=0`` and ``CUDA_VISIBLE_DEVICES``
                narrowed to this worker's device.
            extra: more variables (the user's), applied after torchrun's and before trainguard's own.

        Returns:
            A new dict.

        Raises:
            WorkerEnvError: ``virtual_local_rank`` with fewer visible devices than local ranks.
        """
        env = dict(base)
        env.update({
            RANK_ENV: str(self.rank),
            LOCAL_RANK_ENV: str(self.local_rank),
            WORLD_SIZE_ENV: str(self.world_size),
            LOCAL_WORLD_SIZE_ENV: str(self.local_world_size),
            GROUP_RANK_ENV: str(self.group_rank),
            GROUP_WORLD_SIZE_ENV: str(self.group_world_size),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            ROLE_NAME_ENV: self.role,
            MASTER_ADDR_ENV: self.master_addr,
            MASTER_PORT_ENV: str(self.master_port),
            RESTART_COUNT_ENV: str(self.restart_count),
            MAX_RESTARTS_ENV: str(self.max_restarts),
            RUN_ID_ENV: self.run_id,
            USE_AGENT_STORE_ENV: str(bool(self.use_agent_store)),
            SIGNALS_TO_HANDLE_ENV: self.signals_to_handle,
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            # Unbuffered by default so a worker's last lines reach the log before a crash; a user's own setting
            # (e.g. PYTHONUNBUFFERED= to keep whole lines together on a shared console) wins.
            "PYTHONUNBUFFERED": base.get("PYTHONUNBUFFERED", "1"),
        })
        if self.error_file:
            env[ERROR_FILE_ENV] = self.error_file
        else:
            env.pop(ERROR_FILE_ENV, None)
        if virtual_local_rank:
            env[LOCAL_RANK_ENV] = "0"
            visible = base.get("CUDA_VISIBLE_DEVICES")
            if visible is not None:
                devices = [d.strip() for d in visible.split(",") if d.strip()]
                if self.local_rank >= len(devices):
                    raise WorkerEnvError(f"--virtual-local-rank: local rank {self.local_rank} has no device in "
                                         f"CUDA_VISIBLE_DEVICES={visible}")
                env["CUDA_VISIBLE_DEVICES"] = devices[self.local_rank]
            else:
                env["CUDA_VISIBLE_DEVICES"] = str(self.local_rank)
        # torchrun sets this to 1 when unset and more than one worker shares the node, to keep N workers from
        # oversubscribing the cores N-fold.
        if self.local_world_size > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        if extra:
            env.update(extra)
        env[GENERATION_ENV] = str(self.generation)
        env[JOB_ENV] = self.job
        if self.job_by_start_time:
            env[JOB_BY_START_TIME_ENV] = "1"
        else:
            env.pop(JOB_BY_START_TIME_ENV, None)  # a launcher's own, inherited from a run that started it
        env[NODE_ID_ENV] = self.node_id
        for name, value in ((AGENT_SOCKET_ENV, self.agent_socket),
                            (CHECKPOINT_DIR_ENV, self.checkpoint_dir),
                            (CHECKPOINT_SERVICE_ENV, self.checkpoint_service)):
            if value:
                env[name] = value
        return env


__all__ = [
    "AGENT_SOCKET_ENV", "CHECKPOINT_DIR_ENV", "CHECKPOINT_SERVICE_ENV", "DEFAULT_SIGNALS", "GENERATION_ENV",
    "JOB_BY_START_TIME_ENV", "JOB_ENV", "NODE_ID_ENV", "RESTORE_PLAN_ENV", "WorkerEnv", "WorkerEnvError",
    "run_id_job_name",
]

"""The training-loop hook: what user code imports.

A :class:`Session` reports progress to the node agent, saves checkpoints through
:class:`trainguard.checkpoint.Checkpointer`, restores the newest complete one at start, and acts on the agent's
advisories (checkpoint now, stop). It works in three settings:

- under ``trainguard run`` (``TRAINGUARD_AGENT_SOCKET`` is set): heartbeats go to the agent;
- under plain ``torchrun``: ranks come from the environment, no agent;
- alone: rank 0 of 1.

Following torchft's Manager, the hook never throws trainguard's own errors into the user's step: failures of
heartbeats or saves are logged, latched in :attr:`Session.errors` and reported as health events; only
:meth:`Session.restore` raises, because training must not start from a state it cannot trust.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from trainguard import error_file, gloo_exit
from trainguard.errors import TrainguardError, UsageError
from trainguard.step_timer import Section, StepTimer
from trainguard.steps import MAX_STEP
from trainguard.worker_env import (CHECKPOINT_DIR_ENV, RANK_ENV, WORLD_SIZE_ENV, WorkerEnv, checkpoint_job_name,
                                   torchrun_made_run_id)

log = logging.getLogger("trainguard.hook")


#: Fewest seconds between two step heartbeats of a worker. Steps completed meanwhile are folded into the next
#: heartbeat (mean step time and sections), so a fast loop does not pay one RPC per step: at ~7 ms per step a
#: heartbeat per step cost 7% of the step's CPU, one per 100 ms still 3% (bench/bench_failslow.py overhead).
HEARTBEAT_MIN_INTERVAL_S = 0.25
#: Seconds a heartbeat call to the agent may take; a slower answer is lost (its advisories come again, see
#: ``_AgentLink``).
HEARTBEAT_TIMEOUT_S = 2.0
#: Most advisory ids a heartbeat acknowledges: those received since the last acknowledgement that got through.
MAX_ACKS = 32
#: Most errors :attr:`Session.errors` keeps (the newest).
MAX_LATCHED_ERRORS = 1000

# Open sessions that checkpoint, by (job, rank): one process has one writer per job and rank (the staging area's
# lease), so a second session of the same job got every save refused, one logged error per save, and its restore
# did not see the first one's newest step.
_OPEN_SESSIONS: dict[tuple[str, int], "weakref.ref[Session]"] = {}
_OPEN_LOCK = threading.Lock()


def _rpc_error_line(exc: BaseException) -> str:
    """A failed call as one line: ``CODE: details`` for a gRPC error, whose ``str()`` spans several lines."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        try:
            return f"{code().name}: {details()}".replace("\n", " ")
        except Exception:  # noqa: BLE001 - a half-built error must not break the heartbeat thread
            pass
    return str(exc).replace("\n", " ")


class _AgentLink:
    """Heartbeats to the local agent from a background thread, so a step never waits on the control plane.

    Every message goes out from that one thread, in order, and carries the worker's current "no steps expected"
    state (``finished`` on the wire: a pause of hang detection, or the loop's end): a pause or finish sent from
    the caller's thread could overtake a step heartbeat already on its way, and the agent takes the latest
    state it receives.

    Advisories are acknowledged: each heartbeat names the ids received in earlier answers, and the agent hands an
    advisory out in every answer until its id comes back. An answer lost to a timed-out call lost its advisory (a
    "checkpoint now" or "stop") before; now the next answer carries it again. The session acts on each id once.
    """

    def __init__(self, socket_path: str, rank: int, generation: int) -> None:
        import grpc

        from trainguard.proto import agent_pb2, agent_pb2_grpc

        self._pb = agent_pb2
        self._channel = grpc.insecure_channel(f"unix:{socket_path}")
        self._stub = agent_pb2_grpc.NodeAgentStub(self._channel)
        self._rank = rank
        self._generation = generation
        self._pid = os.getpid()
        self._cond = threading.Condition()
        # [last step, summed step time, steps, summed sections or None] since the last heartbeat sent
        self._pending: list | None = None
        self._advisories: list[Any] = []
        self._acks: list[str] = []  # ids received and not yet acknowledged in a call that got an answer
        self._closed = False
        self._quiet = False  # no steps expected now (hang detection paused, or the loop is over)
        self._state_seq = 0  # bumped on every change of _quiet; _sent_seq: the last one delivered
        self._sent_seq = 0
        self.failures = 0
        self.sent = 0  # step heartbeats sent
        # The hello: a heartbeat of step -1 tells the agent at once that this worker reports, so a silence
        # before its first step is a hang (a script without the hook is never judged by silence). n = 0 marks
        # it: the first step replaces it rather than averaging its step time with nothing.
        self._pending = [-1, 0.0, 0, None]
        self._thread = threading.Thread(target=self._loop, name="trainguard-heartbeat", daemon=True)
        self._thread.start()

    def beat(self, step: int, step_time_s: float, sections: dict[str, float] | None = None) -> None:
        with self._cond:
            p = self._pending
            if p is None or p[2] == 0:  # nothing pending, or only the hello (not sent yet: a step says more)
                self._pending = [step, step_time_s, 1, dict(sections) if sections else None]
                # Wake the sender only for the first step since its last heartbeat: it then sleeps until the
                # next one is due. Waking it at every step cost a GIL hand-off per step (~2% of a 6 ms step).
                self._cond.notify()
            else:
                p[0], p[1], p[2] = step, p[1] + step_time_s, p[2] + 1
                if sections:
                    acc = p[3] if p[3] is not None else {}
                    for name, v in sections.items():
                        acc[name] = acc.get(name, 0.0) + v
                    p[3] = acc

    def set_quiet(self, quiet: bool, timeout: float = 2.0) -> bool:
        """Tells the agent that no steps are expected from now on (``quiet``) or that they are again, after
        any step heartbeat already pending; waits up to ``timeout`` s for the message to be sent. Returns whether
        it was sent in time (an agent that is away is no reason to stop training)."""
        with self._cond:
            if self._quiet == quiet:
                return True
            self._quiet = quiet
            self._state_seq += 1
            seq = self._state_seq
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._sent_seq >= seq or self._closed, timeout)

    def take_advisories(self) -> list[Any]:
        with self._cond:
            out, self._advisories = self._advisories, []
        return out

    def report_checkpoint(self, step: int, tier: str, nbytes: int, stall_s: float) -> None:
        try:
            self._stub.ReportCheckpoint(
                self._pb.CheckpointReport(rank=self._rank, step=step, tier=tier, bytes=nbytes, stall_s=stall_s),
                timeout=HEARTBEAT_TIMEOUT_S,
            )
        except Exception as exc:  # noqa: BLE001 - the agent being away must not stop training
            self.failures += 1
            log.debug("checkpoint report failed: %s", exc)

    def _loop(self) -> None:
        next_send = 0.0
        while True:
            with self._cond:
                while not self._closed and self._sent_seq == self._state_seq and (
                        self._pending is None or time.monotonic() < next_send):
                    self._cond.wait(None if self._pending is None else max(0.0, next_send - time.monotonic()))
                if self._closed and self._pending is None and self._sent_seq == self._state_seq:
                    return
                pending, self._pending = self._pending, None
                seq, quiet = self._state_seq, self._quiet
                acks = list(self._acks)
            step, total, n, sums = pending if pending is not None else (-1, 0.0, 0, None)
            if pending is not None and n > 0:
                # Not after the hello: the first step goes out at once. It marks the end of a restart (the
                # agent's "first resumed step"); held back behind the hello it was reported as a later step, up
                # to 0.25 s late (the demo said "resumed at step 203" after a restore to step 200).
                next_send = time.monotonic() + HEARTBEAT_MIN_INTERVAL_S
            dt = total / n if n else 0.0
            sections = {name: v / n for name, v in sums.items()} if sums else None
            try:
                resp = self._stub.WorkerHeartbeat(
                    self._pb.WorkerHeartbeatRequest(rank=self._rank, pid=self._pid, generation=self._generation,
                                                    step=step, step_time_s=dt, section_s=sections or {},
                                                    finished=quiet, acked_advisory_ids=acks,
                                                    acks_advisories=True),
                    timeout=HEARTBEAT_TIMEOUT_S,
                )
                self.sent += n > 0  # the hello and state changes are not step heartbeats
                with self._cond:
                    # The agent has these acknowledgements now; the answer's advisories are acknowledged next
                    # time (an id it hands out again is acknowledged again: that answer may be the one it got).
                    done = set(acks)
                    self._acks = [i for i in self._acks if i not in done]
                    for adv in resp.advisories:
                        if adv.advisory_id not in self._acks:
                            self._acks.append(adv.advisory_id)
                    del self._acks[:-MAX_ACKS]
                    self._advisories.extend(resp.advisories)
            except Exception as exc:  # noqa: BLE001
                self.failures += 1
                if self.failures in (1, 10, 100):
                    log.warning("heartbeat to the agent failed (%s); training continues", _rpc_error_line(exc))
            with self._cond:
                self._sent_seq = max(self._sent_seq, seq)
                self._cond.notify_all()

    def finish(self) -> None:
        """Tells the agent that no more steps will come (so a long final evaluation is not a hang)."""
        if not self.set_quiet(True):
            log.debug("the agent did not take the end of the loop in time")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=3.0)
        self._channel.close()


def _place_in_job(env: WorkerEnv) -> tuple[int, int, bool]:
    """``(rank, world size, assumed)`` of this worker: the launcher's (``RANK``, ``WORLD_SIZE``), else the default
    process group's when the script built one itself (``mp.spawn`` with ``init_process_group(rank=r,
    world_size=n)``), else rank 0 of 1 (``assumed``: nothing said so).

    Without the group's place every spawned process took itself for rank 0 of 1: all but one had every save
    refused (one writer per job and rank), and a resume loaded one rank's state into every rank.
    """
    if os.environ.get(RANK_ENV) or os.environ.get(WORLD_SIZE_ENV):
        return env.rank, env.world_size, False
    dist = _initialized_dist()
    if dist is None:
        return env.rank, env.world_size, True
    return dist.get_rank(), dist.get_world_size(), False


def _mention_default_job(root: str, job: str) -> None:
    """Logs how to resume the checkpoints a lone process saved as job ``default`` (its name before lone processes
    were named like ``trainguard run``'s jobs), when ``root`` holds some and none of ``job`` yet: the rerun
    starts from step 0 otherwise, with no word of the old folder."""
    from trainguard.checkpoint.storage import is_step_dirname

    old = os.path.join(root, "default")
    try:
        if os.path.isdir(os.path.join(root, job)) or not any(is_step_dirname(n) for n in os.listdir(old)):
            return
    except OSError:
        return
    log.warning("%s holds checkpoints of job 'default', the name every lone process had before; this run is job "
                "%r. To resume them, pass trainguard.init(job='default') (or set $TRAINGUARD_JOB=default)", old, job)


def _as_step(step: Any) -> Any:
    """``step`` as a plain int when it is an integer of any kind (numpy's, a 0-d integer tensor), else as given
    (the Checkpointer refuses a float step with a line of its own).

    The hook keeps the step it was given: a tensor counter the loop increments in place (``gstep += 1``) changed
    the kept "last step" with it, so the next step looked repeated (a latched UsageError) and
    :attr:`Session.last_saved_step` named a step never saved.
    """
    try:
        return operator.index(step)
    except TypeError:
        return step


def _initialized_dist() -> Any:
    """``torch.distributed`` when its default process group is up, else None (torch is never imported here)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist if dist is not None and dist.is_available() and dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - a broken torch install is no reason to refuse a lone worker
        return None


class Session:
    """One worker's connection to trainguard.

    Args:
        checkpoint_dir: directory or fsspec URL for checkpoints; defaults to ``$TRAINGUARD_CHECKPOINT_DIR``;
            None disables checkpointing.
        save_every: save automatically every this many steps in :meth:`step_done` (0: only on request): at each
            step that reaches or passes a multiple of it (``step + 1`` counted), so steps that jump still save.
        job: job name (defaults to ``$TRAINGUARD_JOB``, else ``$TORCHELASTIC_RUN_ID`` unless torchrun made it up
            for a one-node launch (a fresh uuid); then, and in a lone process (no run id), with checkpoints,
            ``<script>-<hash of the checkpoint location>`` as ``trainguard run`` names it, so a rerun of the same
            script resumes and another script's run is another job; ``default`` without checkpoints).
        checkpoint_options: extra fields for :class:`trainguard.checkpoint.CheckpointConfig`.

    Raises:
        TrainguardError: the checkpoint location is unusable (unwritable, malformed URL).
        UsageError: a session of the same job and rank that checkpoints is still open in this process.
    """

    def __init__(
        self,
        checkpoint_dir: str | None = None,
        save_every: int = 0,
        job: str | None = None,
        checkpoint_options: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            every = operator.index(save_every)  # an int (numpy's too); a str or None compared with 0 was a TypeError
        except TypeError:
            every = -1
        if every < 0 or isinstance(save_every, bool):
            raise TrainguardError(f"save_every must be a whole number of steps >= 0 (0: only on request), got "
                                  f"{save_every!r}")
        save_every = every
        env = WorkerEnv.from_env()
        self.rank, self.world_size, self._place_assumed = _place_in_job(env)
        self.local_rank = env.local_rank
        self.restart_count = env.restart_count
        self.generation = env.generation
        directory = checkpoint_dir if checkpoint_dir is not None else env.checkpoint_dir
        lone_named = False  # a lone process's job named here (it was "default" before)
        if job:
            self.job = job
        elif directory and (env.job_by_start_time
                            or not env.job and (not env.run_id or torchrun_made_run_id(env.run_id))):
            # A one-node torchrun launch's run id is a fresh uuid, so each relaunch of the same command saved into a
            # new job folder and resumed nothing; so did a one-node trainguard run given no checkpoint directory
            # (the script's own): it names the job after its start time. A lone process (no run id at all) was
            # job "default": every such script on the host shared one in-memory tier folder (a second one running
            # had every save refused, one that crashed had its copies overwritten) and, in one checkpoint
            # directory, one job folder (a second script restored the first one's model).
            self.job = checkpoint_job_name(sys.argv[0] if sys.argv and sys.argv[0] else "job", directory)
            lone_named = not env.run_id
        else:
            self.job = env.job_name
        self.save_every = save_every
        self.errors: list[BaseException] = []
        self.should_stop = False
        self.last_saved_step: int | None = None
        self.restored_step: int | None = None
        self._last_step_end = time.monotonic()
        self._last_step: int | None = None  # the highest step reported through step_done
        self._backward_warned = False
        self._range_warned = False  # a step outside 0..MAX_STEP was logged
        self._handled_advisories: set[str] = set()
        self._checkpoint_now = False
        self._checkpoint_at: set[int] = set()  # steps of pending job-wide checkpoints
        self._agent: _AgentLink | None = None
        self._ckpt = None
        self._finished = False
        self._pauses = 0  # open pause_hang_detection blocks
        self._pause_start = 0.0  # when the outermost open pause began (monotonic seconds)
        self._steps_reported = 0  # step_done calls, and their count when the outermost pause began
        self._pause_steps = 0
        self._pause_lock = threading.Lock()
        self._timer = StepTimer()
        #: Wall time of the last completed step, seconds (the first one's runs from init), and its sections (see
        #: :meth:`section`).
        self.last_step_time_s = 0.0
        self.last_sections: dict[str, float] = {}

        # A worker that finished its training must not die with SIGABRT at exit because a gloo thread still
        # holds a finished collective (see trainguard.gloo_exit): under trainguard run or torchrun that reads as a
        # failed job.
        gloo_exit.install()
        error_file.install()  # the launcher's summary then names what ended the worker (a failed restore)
        if directory:
            from trainguard.checkpoint import CheckpointConfig, Checkpointer

            key = (self.job, self.rank)
            with _OPEN_LOCK:
                other = _OPEN_SESSIONS.get(key)
                if other is not None and other() is not None:
                    raise UsageError(f"trainguard.init() was already called in this process for job {self.job!r} "
                                     f"rank {self.rank} and that session is still open: reuse it, or call its "
                                     f"close() first")
                cfg = CheckpointConfig(directory=directory, **_checked_options(checkpoint_options))
                self._ckpt = Checkpointer(cfg, rank=self.rank, world_size=self.world_size, job=self.job,
                                          on_event=self._on_checkpoint_event)
                _OPEN_SESSIONS[key] = weakref.ref(self)
            if lone_named and self.rank == 0 and self._ckpt.disk is not None:
                _mention_default_job(self._ckpt.disk.root, self.job)
        elif save_every and self.rank == 0:
            # Checkpointing off is legitimate (a run without --checkpoint-dir), but asked-for saves that never
            # happen are not: a script relying on $TRAINGUARD_CHECKPOINT_DIR under plain torchrun saved nothing
            # and restarted from step 0, with no word.
            log.warning("save_every=%d but no checkpoint directory is set (trainguard.init(checkpoint_dir=...), "
                        "$%s or trainguard run --checkpoint-dir): nothing is saved or restored", save_every,
                        CHECKPOINT_DIR_ENV)
        socket_path = env.agent_socket
        if socket_path:
            self._agent = _AgentLink(socket_path, self.rank, self.generation)
            # Lets the agent's hang detector put this worker's Python stacks into the "hung" event.
            from trainguard.detectors.stackdump import install_stack_dump_handler

            install_stack_dump_handler()

    # -- checkpoints -----------------------------------------------------------------------------------------
    @property
    def checkpointer(self):
        """The underlying :class:`trainguard.checkpoint.Checkpointer`, or None when checkpointing is off."""
        return self._ckpt

    def restore(self, state: MutableMapping[str, Any]) -> int:
        """Loads the newest complete checkpoint into ``state`` in place.

        Inside a process group (``init_process_group`` called first, as under torchrun) it is a collective every
        rank calls: the ranks agree on one step (a rank whose newest copy is torn falls back, the others follow),
        and when any rank's restore raises, every other rank raises ``CheckpointError``.

        Args:
            state: mapping of names to tensors, nested containers or objects with ``state_dict()`` /
                ``load_state_dict()`` (modules, optimizers); the same mapping later given to :meth:`save`.

        Returns:
            The next step to run: the restored step + 1, or 0 when there is nothing to restore.

        Raises:
            TrainguardError: a checkpoint exists but none can be restored (e.g. a different world size, or every
                committed step is corrupt: ``CorruptCheckpointError``), on this rank or on another one.
            UsageError: :func:`init` ran before ``init_process_group`` in a process launched without
                ``RANK``/``WORLD_SIZE`` (``mp.spawn``), so this session cannot know its rank.
        """
        if self._ckpt is None:
            return 0
        misplaced = self._misplaced()
        if misplaced is not None:
            raise misplaced
        # No agreement of the hook's own after the Checkpointer's: a rank whose restore raised something other
        # than a TrainguardError (a user's load_state_dict) never reached it, and it reduced a CPU tensor, which
        # a pure NCCL group refuses.
        step = self._ckpt.restore(state)
        self.restored_step = step
        if step is None:
            return 0
        if self._last_step is None or step > self._last_step:
            # A loop that starts again at 0 (restore's result ignored) is a step that went back: its saves would
            # replace the restored run's checkpoints of the same steps, and every restart resumed the old step.
            self._last_step = step
        log.info("rank %d restored step %d from %s", self.rank, step, getattr(self._ckpt, "last_restore_tier", "?"))
        return step + 1

    def save(self, state: Mapping[str, Any], step: int) -> bool:
        """Saves ``state`` as checkpoint ``step`` (returns once the snapshot is taken; persisting goes on).

        Returns:
            True when the snapshot was taken; False when saving failed (the error is latched and logged).
        """
        if self._ckpt is None:
            return False
        step = _as_step(step)
        misplaced = self._misplaced()
        if misplaced is not None:
            # Saved as rank 0 of 1, one process's state was committed as the whole job's step (a later restore
            # at world size 1 loaded it, one at 2 refused it) and every other process had its saves refused with
            # "another process writes this job": a message about job names, not about the order of the calls.
            self._latch(misplaced, f"checkpoint of step {step} not taken")
            return False
        t0 = time.perf_counter()
        try:
            self._ckpt.save(state, step)
        except TrainguardError as exc:
            self._latch(exc, f"checkpoint of step {step} failed")
            return False
        self.last_saved_step = step
        if self._agent is not None:
            self._agent.report_checkpoint(step, "snapshot", 0, time.perf_counter() - t0)
        return True

    def _misplaced(self) -> UsageError | None:
        """The error for a session that took itself for rank 0 of 1 (:func:`init` ran before the script's own
        ``init_process_group`` in a process launched without ``RANK``/``WORLD_SIZE``, as ``mp.spawn`` starts
        them) inside a process group of several ranks; None when its place is right."""
        dist = _initialized_dist() if self._place_assumed else None
        if dist is None or dist.get_world_size() <= 1:
            return None
        return UsageError(f"trainguard.init() ran before init_process_group() in a process launched without "
                          f"RANK/WORLD_SIZE, so it took itself for rank 0 of 1 in a group of "
                          f"{dist.get_world_size()}; call init_process_group() first")

    def _on_checkpoint_event(self, event) -> None:
        # The checkpointer has logged it. A failure of a background tier (the persist process's disk write, the
        # upload) is latched like a failed save: it used to be logged only, so a job whose every disk write failed
        # (ENOSPC) ended with session.errors == [].
        from trainguard.checkpoint.errors import StorageUnavailableError
        from trainguard.detectors.events import Severity

        if getattr(event, "severity", None) in (Severity.ERROR, Severity.CRITICAL):
            self._remember(StorageUnavailableError(getattr(event, "message", str(event))))

    def _latch(self, exc: BaseException, what: str) -> None:
        self._remember(exc)
        log.error("%s: %s (training continues)", what, exc)

    def _remember(self, exc: BaseException) -> None:
        self.errors.append(exc)
        if len(self.errors) > MAX_LATCHED_ERRORS:  # a save failing every step for days must not grow without end
            del self.errors[:-MAX_LATCHED_ERRORS]

    # -- progress --------------------------------------------------------------------------------------------
    def section(self, name: str) -> "Section":
        """Times a part of the current step: ``with session.section("forward"): ...``.

        The times of each name are summed over the step and sent with the step's heartbeat; the coordinator
        compares ranks with them (:mod:`trainguard.recovery.straggler`). Wrap the time a rank waits for its
        peers (all-reduce, barrier) in ``"comm"``: a rank's own work is its step time less that wait, so a
        slow rank stands out even though every rank's step takes as long as the slowest one's. Other names
        (``"data"``, ``"forward"``, ``"backward"``, ``"optim"``) are shown as they are. Where CUDA is
        initialised, sections are timed with CUDA events on the current stream (GPU time, read without a
        device synchronisation when the events have completed), else with ``time.perf_counter``.

        Args:
            name: section name, 1-32 characters of ``[A-Za-z0-9_.-]``.

        Returns:
            A reusable context manager (one per name; do not nest a name inside itself).

        Raises:
            TrainguardError: the name is malformed (a programming error, raised at once, outside any step).
        """
        return self._timer.section(name)

    def step_done(self, step: int, state: Mapping[str, Any] | None = None) -> None:
        """Marks ``step`` complete: heartbeat, advisories, and a save when due.

        Args:
            step: the step just completed (0-based), counted over the whole run: it must grow from call to call
                (a step that does not is latched in :attr:`errors` and logged once; under an agent the worker is
                then taken for hung, because only a higher step counts as progress).
            state: what to checkpoint when a save is due (every ``save_every`` steps, or when the agent advises
                a checkpoint); None skips saving.
        """
        step = _as_step(step)
        if isinstance(step, int) and not 0 <= step <= MAX_STEP:
            self._step_out_of_range(step)
            self._timer.collect()  # this step's section times go with it, not into the next step's
            return
        if self._finished and self._agent is not None:
            self._step_after_finish(step)
        prev = self._last_step
        if prev is not None and step <= prev:
            self._step_went_back(step)
        else:
            self._last_step = step
        self._steps_reported += 1
        now = time.monotonic()
        dt = now - self._last_step_end
        self._last_step_end = now
        sections = self._timer.collect()
        self.last_step_time_s, self.last_sections = dt, sections
        if self._agent is not None:
            # The first step's time runs from init(): set-up and restore, not a step. Sent as 0 (unknown, which
            # the agent skips): as a step it became the agent's "slowest recent step" and the hang bound 5x it.
            sent = dt if self._steps_reported > 1 else 0.0
            if sections:
                self._agent.beat(step, sent, sections)
            else:
                self._agent.beat(step, sent)
            self._apply_advisories(step)
        due = self.save_every > 0 and self._save_due(step, prev)
        # A job-wide checkpoint is taken at the first step reaching its step: every rank reports the same steps,
        # so they all save the same one. Waiting for the exact step never saved a loop whose steps jump (samples
        # seen) and warned "too late" on every rank; one heard of only after its step is skipped when heard.
        reached = {s for s in self._checkpoint_at if s <= step}
        at = bool(reached)
        self._checkpoint_at -= reached
        if state is not None and (due or at or self._checkpoint_now):
            self._checkpoint_now = False
            self.save(state, step)

    def _step_out_of_range(self, step: int) -> None:
        """Latches (and logs once) a step outside 0..2**53-1, which is neither reported nor saved. Sent on, the
        node agent took it and the coordinator refused every later heartbeat of the node, which lost its slot in
        the job; no checkpoint tier names such a step either."""
        if self._range_warned:
            return
        self._range_warned = True
        self._latch(UsageError(f"step_done({step}): a step is in 0..{MAX_STEP} (2**53-1); this step is not reported "
                               f"and nothing is saved at it (under an agent, a worker with no step in range for "
                               f"long is taken for hung)"), f"rank {self.rank}")

    def _step_after_finish(self, step: int) -> None:
        """A step after :meth:`finish` (called per epoch before an evaluation, say): the loop is not over, so hang
        detection comes back on. It stayed off for the rest of the run, silently: a rank hanging later was never
        found."""
        self._finished = False
        self._agent.set_quiet(False)
        self._latch(UsageError(f"step_done({step}) after finish(): finish() ends hang detection for good and is for "
                               f"the end of the loop; wrap a phase between steps in pause_hang_detection() instead "
                               f"(hang detection is back on)"), f"rank {self.rank}")

    def _save_due(self, step: int, prev: int | None) -> bool:
        """Whether ``step`` completes a multiple of ``save_every`` steps since ``prev`` (the step reported before).

        A step that jumps (counted in samples or micro-batches: 0, 32, 64, ...) crosses a multiple without landing
        on one: ``(step + 1) % save_every == 0`` never held for ``save_every=10`` and steps of 32, and such a run
        saved nothing at all, with no word. For steps one apart it is that rule; the first step (none before it) and
        a step that went back keep it. After :meth:`restore`, ``prev`` is the restored step.
        """
        every = self.save_every
        if prev is None or step <= prev:
            return (step + 1) % every == 0
        return (step + 1) // every > (prev + 1) // every

    def _step_went_back(self, step: int) -> None:
        """Warns once about a step that does not grow (e.g. the index within an epoch, or one step reported per
        micro-batch): checkpoints are named by step, so ``save_every`` saves over earlier checkpoints of the same
        step and a restart resumes from the highest step, not the latest. (The agent counts such a step as
        progress; it used to count only a higher one and restart the worker as hung.)"""
        if self._backward_warned:
            return
        self._backward_warned = True
        what = ("checkpoints of a repeated step replace the earlier ones, and a restart resumes from the highest "
                "step saved, not the latest")
        if self._steps_reported == 0 and self.restored_step == self._last_step:
            self._latch(UsageError(f"step_done({step}) after restore() loaded step {self._last_step}: start the loop "
                                   f"at the step restore() returns ({self._last_step + 1}); {what}"),
                        f"rank {self.rank}")
            return
        if step == self._last_step:
            # The same step again is one call per micro-batch (gradient accumulation), not an epoch's index: the
            # message about epochs named the wrong fix.
            self._latch(UsageError(f"step_done({step}) called again for the same step: call it once per optimizer "
                                   f"step (after the last micro-batch when accumulating gradients), with a step "
                                   f"that grows; {what}"), f"rank {self.rank}")
            return
        self._latch(UsageError(f"step_done({step}) after step_done({self._last_step}): steps must grow over the "
                               f"whole run (pass a global step counter, not the index within an epoch); {what}"),
                    f"rank {self.rank}")

    def _apply_advisories(self, step: int) -> None:
        """Acts on the agent's new advisories, heard at the end of ``step``."""
        from trainguard.proto import agent_pb2

        for adv in self._agent.take_advisories() if self._agent else []:
            if adv.advisory_id in self._handled_advisories:
                continue
            self._handled_advisories.add(adv.advisory_id)
            if adv.kind == agent_pb2.ADVISORY_KIND_CHECKPOINT_NOW and 0 < adv.at_step < step:
                log.warning("job-wide checkpoint at step %d: heard of it only at step %d, too late", adv.at_step,
                            step)
            elif adv.kind == agent_pb2.ADVISORY_KIND_CHECKPOINT_NOW and adv.at_step > 0:
                # Job-wide: every rank saves when it completes the same step, so that step is complete.
                log.warning("job-wide checkpoint at step %d: %s", adv.at_step, adv.reason)
                self._checkpoint_at.add(adv.at_step)
            elif adv.kind == agent_pb2.ADVISORY_KIND_CHECKPOINT_NOW:
                log.warning("agent advises a checkpoint now: %s", adv.reason)
                self._checkpoint_now = True
            elif adv.kind == agent_pb2.ADVISORY_KIND_STOP:
                log.warning("agent asks to stop: %s", adv.reason)
                self.should_stop = True

    def finish(self) -> None:
        """Declares the training loop over: the agent stops expecting steps (hang detection ends for this
        worker). Call it before a long final evaluation; :meth:`close` calls it too. A step reported after it
        turns hang detection back on and is latched as a ``UsageError`` (a phase between steps belongs in
        :meth:`pause_hang_detection`)."""
        if self._agent is not None and not self._finished:
            self._finished = True
            self._agent.finish()

    @contextlib.contextmanager
    def pause_hang_detection(self, reason: str = "") -> Iterator[None]:
        """A long phase between steps that is not a hang: ``with session.pause_hang_detection("evaluation"):``.

        The agent counts a worker as hung when no step arrives for ``max(--hang-floor-s, 5 x its slowest recent
        step)`` (60 s by default), so a periodic evaluation, a synchronous export or a data re-shuffle that
        takes longer would be killed and restarted. Inside this block the agent expects no steps; when it ends,
        the silence is counted afresh from there (a worker that hangs after the block is still found). Steps
        reported inside the block count as usual. A block with no step inside is left out of the next step's
        time (:attr:`last_step_time_s`, what the agent and fail-slow detection see), with or without an agent.
        The pause itself is a no-op without an agent (plain ``torchrun``, alone) and after :meth:`finish`. Do
        not use it around training steps: a hang inside the block is not detected (the
        collectives' own timeouts still apply).

        Args:
            reason: what the phase is, for the log.
        """
        link = self._agent if not self._finished else None
        with self._pause_lock:  # nested or concurrent pauses: detection resumes when the last one ends
            self._pauses += 1
            if self._pauses == 1:
                self._pause_start, self._pause_steps = time.monotonic(), self._steps_reported
                if link is not None:
                    log.info("hang detection paused%s", f" ({reason})" if reason else "")
                    link.set_quiet(True)
        try:
            yield
        finally:
            with self._pause_lock:
                self._pauses -= 1
                if self._pauses == 0:
                    if self._steps_reported == self._pause_steps:
                        # The phase is not part of the next step: counted in, it became the agent's "slowest
                        # recent step", and the hang bound (5x that) grew to 5x the evaluation for a while.
                        self._last_step_end += time.monotonic() - self._pause_start
                    if link is not None and not self._finished:
                        link.set_quiet(False)
                        log.info("hang detection resumed%s", f" after {reason}" if reason else "")

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until every saved checkpoint is durable."""
        if self._ckpt is not None:
            try:
                self._ckpt.wait(timeout=timeout)
            except TrainguardError as exc:
                self._latch(exc, "waiting for checkpoints failed")

    def close(self) -> None:
        """Flushes checkpoints and closes the agent link; idempotent."""
        self.finish()
        if self._ckpt is not None:
            try:
                self._ckpt.close()
            except TrainguardError as exc:
                self._latch(exc, "closing the checkpointer failed")
            self._ckpt = None
            with _OPEN_LOCK:
                ref = _OPEN_SESSIONS.get((self.job, self.rank))
                if ref is not None and ref() in (self, None):
                    del _OPEN_SESSIONS[(self.job, self.rank)]
        if self._agent is not None:
            self._agent.close()
            self._agent = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _checked_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``checkpoint_options`` as keyword arguments of :class:`~trainguard.checkpoint.CheckpointConfig`.

    A key the config does not have was a ``TypeError`` ("__init__() got an unexpected keyword argument"), and
    ``directory`` one about "multiple values", where a key inside a tier (``{"disk": {"kep": 1}}``) already got a
    :class:`~trainguard.checkpoint.errors.CheckpointConfigError` naming it and the keys there are.

    Raises:
        CheckpointConfigError: a key that is no field of the config, or ``directory`` (``checkpoint_dir`` sets it).
    """
    import dataclasses

    from trainguard.checkpoint import CheckpointConfig
    from trainguard.checkpoint.errors import CheckpointConfigError

    options = dict(options or {})
    if "directory" in options:
        raise CheckpointConfigError("checkpoint_options['directory']: give the folder as trainguard.init("
                                    "checkpoint_dir=...) (or $TRAINGUARD_CHECKPOINT_DIR) instead")
    known = [f.name for f in dataclasses.fields(CheckpointConfig) if f.init and f.name != "directory"]
    unknown = sorted(str(k) for k in options if k not in known)
    if unknown:
        raise CheckpointConfigError(f"checkpoint_options: unknown key(s) {', '.join(map(repr, unknown))}; known "
                                    f"keys: {', '.join(known)}")
    return options


def init(
    checkpoint_dir: str | None = None,
    save_every: int = 0,
    job: str | None = None,
    checkpoint_options: Mapping[str, Any] | None = None,
) -> Session:
    """Creates the worker's :class:`Session` (see its arguments)."""
    return Session(checkpoint_dir=checkpoint_dir, save_every=save_every, job=job,
                   checkpoint_options=checkpoint_options)

"""Interop with ``torch.distributed.checkpoint`` (DCP): export a committed step to DCP's layout, import from it.

Export writes, with DCP's own ``FileSystemWriter``, the decoded state of every rank (under ``rank<N>.`` prefixes
when ranks hold different states, unprefixed when there is one rank or the state is replicated), plus a small
``_trainguard`` entry holding our JSON trees so an exported step imports back exactly. Any DCP user can load it
with ``dcp.load``.

Import reads DCP's ``.metadata`` through a restricted unpickler that only admits DCP's metadata classes,
``torch.Size`` and dtypes, and non-tensor items with ``torch.load(weights_only=True)``; a checkpoint needing
anything else is refused rather than unpickled.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
from typing import Any, Callable

import torch

from trainguard.checkpoint.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from trainguard.checkpoint.import_staging import STAGING_LOCK, STAGING_PREFIX, sweep_stale_imports
from trainguard.checkpoint.manifest import Manifest
from trainguard.steps import MAX_STEP
from trainguard.checkpoint.reader import RankCopy
from trainguard.checkpoint.storage import LocalStore, check_job_name, manifest_name
from trainguard.checkpoint.tree import decode
from trainguard.checkpoint.writer import write_rank_step

META_KEY = "_trainguard"
_ALLOWED_MODULES = ("torch.distributed.checkpoint.",)
_ALLOWED = {("torch", "Size"), ("pathlib", "PosixPath"), ("torch.serialization", "_get_layout"),
            ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULES) or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CorruptCheckpointError(f"DCP metadata references {module}.{name}, which import refuses to unpickle")


def _reader_and_planner(path: str) -> tuple[Any, Any]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import Metadata

            where = os.path.join(path, ".metadata")
            with open(where, "rb") as f:
                try:
                    md = _SafeUnpickler(f).load()
                except CorruptCheckpointError:
                    raise
                except Exception as exc:
                    # An empty or cut-short file was an EOFError / UnpicklingError traceback.
                    raise CorruptCheckpointError(f"{where} cannot be read ({type(exc).__name__}: {exc}); the DCP "
                                                 "checkpoint is torn or damaged") from exc
            if not isinstance(md, Metadata):
                raise CorruptCheckpointError(f"{where} holds a {type(md).__name__}, not DCP Metadata; is this a "
                                             "torch.distributed.checkpoint directory?")
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class SafePlanner(DefaultLoadPlanner):
        # dcp.load does not hand replaced non-tensor values back to the caller's dict; keep them here.
        loaded: dict[str, Any] = {}

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:  # weights_only refused what the pickle asks for
                raise CorruptCheckpointError(f"item {read_item.dest_index.fqn} is a pickled object that needs "
                                             f"unsafe unpickling ({type(exc).__name__}); import refuses it") from exc
            except Exception as exc:
                raise CorruptCheckpointError(f"item {read_item.dest_index.fqn} cannot be read ({type(exc).__name__}"
                                             f"); the DCP checkpoint is torn or damaged") from exc
            self.loaded[read_item.dest_index.fqn] = obj

    return SafeReader(path), SafePlanner(flatten_state_dict=False)


def _quiet_dcp() -> Any:
    import warnings

    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore")
    return ctx


def export_step(root: str, job: str, step: int | None, out_dir: str,
                progress: Callable[[int], None] | None = None) -> int:
    """Exports a committed step of the disk tier to a DCP checkpoint directory.

    Args:
        root: disk tier directory; job: job name.
        step: the step (None: the newest committed).
        out_dir: destination directory (created).
        progress: called with a byte count as data is verified.

    Returns:
        The exported step.

    Raises:
        NoCheckpointError: no such committed step. CorruptCheckpointError: a copy fails verification (for the
            default step, the message names the older committed steps to pass instead).
    """
    store = LocalStore(root, job)
    committed = dict(store.committed_steps())
    if not committed:
        raise NoCheckpointError(f"no committed step in {store.describe()}; nothing to export")
    if step is not None:
        if step not in committed:
            raise NoCheckpointError(f"step {step} is not committed in {store.describe()}; see `trainguard ckpt ls`")
        return _export_step(store, step, committed[step], out_dir, progress)
    step = max(committed)
    try:
        return _export_step(store, step, committed[step], out_dir, progress)
    except CorruptCheckpointError as exc:
        # The default is the newest committed step; damaged, the export stopped there and named no way on.
        older = sorted((s for s in committed if s < step), reverse=True)
        hint = (f"pass --step with an older committed step ({', '.join(map(str, older[:5]))}"
                f"{' ...' if len(older) > 5 else ''}; `trainguard ckpt verify` says which verify)" if older
                else "there is no older committed step")
        raise CorruptCheckpointError(f"{exc}; step {step} is the newest committed step (the default) and it is "
                                     f"damaged: {hint}") from exc


def _export_step(store: LocalStore, step: int, ws: int, out_dir: str,
                 progress: Callable[[int], None] | None) -> int:
    """:func:`export_step` of one committed step of world size ``ws``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if Manifest.from_json(store.read_small(step, manifest_name(0)), f"step {step} rank 0 manifest").sharded:
        from trainguard.checkpoint.dcp_sharded import export_sharded

        export_sharded(store, step, ws, out_dir, progress)
        return step
    copies = []
    try:
        state: dict[str, Any] = {}
        meta: dict[str, Any] = {"step": step, "world_size": ws, "ranks": {}}
        man0 = Manifest.from_json(store.read_small(step, manifest_name(0)), f"step {step} rank 0 manifest").check_place(
            step, 0, f"step {step} rank 0")
        ranks = [0] if (ws == 1 or man0.replicated) else list(range(ws))
        for r in ranks:
            man = man0 if r == 0 else Manifest.from_json(store.read_small(step, manifest_name(r)),
                                                         f"step {step} rank {r} manifest").check_place(
                step, r, f"step {step} rank {r}")
            copy = RankCopy(man, store.local_data_path(step, r), f"step {step} rank {r}", advisory_lock=True)
            copies.append(copy)
            copy.verify(progress)
            decoded = decode(numpy_as_tensors(man.tree), lambda i, _t, _n=None, c=copy: c.tensor(i), None)
            prefix = "" if len(ranks) == 1 else f"rank{r}"
            if prefix:
                state[prefix] = decoded
            else:
                state.update(decoded)
            meta["ranks"][str(r)] = {"prefix": prefix, "tree": man.tree, "keys": [e.key for e in man.tensors],
                                     "replicated": man.replicated}
        if META_KEY in state:
            raise CheckpointError(f"the state has a top-level key {META_KEY!r}, reserved for export metadata")
        state[META_KEY] = json.dumps(meta)
        os.makedirs(out_dir, exist_ok=True)
        ctx = _quiet_dcp()
        try:
            dcp.save(state, checkpoint_id=out_dir)
        except (Exception, CheckpointException) as exc:  # a BaseException: a full disk left as a traceback
            raise CheckpointError(f"cannot write the export to {out_dir}: {_first_line(_dcp_failure(exc))}; "
                                  "free space or choose another folder") from exc
        finally:
            ctx.__exit__(None, None, None)
    finally:
        for c in copies:
            c.close()
    return step


def numpy_as_tensors(node: Any) -> Any:
    """A copy of a tree whose numpy arrays decode as tensors (the ``"np"`` marks dropped).

    DCP stores a value that is no tensor as a pickle: a numpy array in the state was exported as one, which
    ``ckpt import`` (``torch.load(weights_only=True)``) refused, so an export of such a state never imported back.
    As tensors they are plain DCP tensors; the export's trainguard entry keeps the marks, so an import restores
    numpy arrays again.
    """
    if isinstance(node, dict):
        return {k: numpy_as_tensors(v) for k, v in node.items() if not (k == "np" and node.get("t") == "tensor")}
    if isinstance(node, list):
        return [numpy_as_tensors(v) for v in node]
    return node


def _dcp_failure(exc: BaseException) -> BaseException:
    """The error a rank raised inside ``dcp.load`` or ``dcp.save``: DCP wraps it in a CheckpointException whose
    text is every rank's traceback."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        for wrapped in failures.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            if isinstance(inner, BaseException):
                return inner
    return exc


def _is_trainguard_export(md: Any) -> bool:
    """True for a DCP checkpoint written by the unsharded :func:`export_step` (it carries our trees)."""
    return META_KEY in md.state_dict_metadata


def _flat_fqns(prefix: str, tree: Any, keys: list[str]) -> list[str]:
    return [f"{prefix}.{k}" if prefix else k for k in keys]


def import_dcp(src_dir: str, root: str, job: str, step: int | None = None, world_size: int | None = None,
               force: bool = False) -> int:
    """Imports a DCP checkpoint directory as a committed step of the disk tier.

    The step is written into a hidden staging folder inside the job's folder and moved into place with one
    rename once every rank committed (see :func:`_publish`): a crash mid-import leaves no step at all, never a
    half-written one that reads as committed, and ``force`` swaps an existing step for the new one atomically.

    A checkpoint exported by :func:`export_step` from an unsharded step comes back exactly (same ranks, trees,
    step). Any other DCP checkpoint (sharded ones included: FSDP2, tensor parallel, any saving world size)
    becomes a sharded step over ``world_size`` ranks, nested as DCP's planner data describes, streaming one rank
    at a time (see :mod:`.dcp_sharded`); any world size then restores it.

    Args:
        src_dir: DCP checkpoint directory.
        root: disk tier directory; job: job name.
        step: step number to store it as (default: the exported step, else 0).
        world_size: ranks of the written step (each holds a dim-0 shard of every tensor). Default 1. A trainguard
            export is written back with the world size it was saved with: another ``world_size`` is refused.
        force: replace the step when the job already has a folder of that step (committed or torn).

    Returns:
        The step written.

    Raises:
        CorruptCheckpointError: metadata that would need unsafe unpickling, or unreadable files.
        CheckpointError: ``world_size`` differs from a trainguard export's; ``job`` is not a valid folder name;
            ``step`` is outside 0..2**53-1; the step exists and ``force`` is not set.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    check_job_name(job)  # before reading the source: ``../evil`` would write outside ``root``
    if step is not None and not 0 <= step <= MAX_STEP:
        # -5 was written as the folder ``step_-00000000005`` under a commit record of step -5: no listing, restore or
        # `ckpt` command reads either, so the import "succeeded" into nothing and the job's record read as damaged.
        raise CheckpointError(f"--step {step}: a step is in 0..{MAX_STEP} (2**53-1)")
    if not os.path.isfile(os.path.join(src_dir, ".metadata")):
        raise CheckpointError(f"{src_dir} is not a torch.distributed.checkpoint directory (no .metadata file)")
    if world_size is not None and world_size < 1:
        raise CheckpointError(f"--world-size must be >= 1, got {world_size}")
    if step is not None:
        _refuse_existing(LocalStore(root, job), step, force)  # before reading the source (checked again below)
    reader, planner = _reader_and_planner(src_dir)
    md = reader.read_metadata()
    if not _is_trainguard_export(md):
        from trainguard.checkpoint.dcp_sharded import exported_step, import_sharded

        if step is None:
            step = exported_step(src_dir) or 0
        _refuse_existing(LocalStore(root, job), step, force)
        with _Staging(root, job) as staging:
            import_sharded(src_dir, md, staging.store, step, world_size or 1)
            staging.publish(step, force)
        return step
    flat: dict[str, Any] = {}
    for fqn, sm in md.state_dict_metadata.items():
        if isinstance(sm, TensorStorageMetadata):
            flat[fqn] = torch.empty(tuple(sm.size), dtype=sm.properties.dtype)
        elif isinstance(sm, BytesStorageMetadata):
            flat[fqn] = None
    reader, planner = _reader_and_planner(src_dir)
    planner.loaded = {}
    ctx = _quiet_dcp()
    try:
        dcp.load(flat, storage_reader=reader, planner=planner)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException: a truncated file's
        inner = _dcp_failure(exc)                    # error escaped the CLI as a traceback
        if isinstance(inner, CheckpointError):
            raise inner from exc
        raise CorruptCheckpointError(f"cannot import {src_dir}: {_first_line(inner)}") from exc
    finally:
        ctx.__exit__(None, None, None)
    flat.update(planner.loaded)
    meta_raw = flat.get(META_KEY)
    if isinstance(meta_raw, str):
        meta = json.loads(meta_raw)
        step = int(meta["step"]) if step is None else step
        ws = int(meta["world_size"])
        if world_size is not None and world_size != ws:
            # An export restores exactly as saved (same ranks and trees); resharding it is not implemented.
            raise CheckpointError(
                f"--world-size {world_size}: {src_dir} was exported by `trainguard ckpt export` from a step of "
                f"world size {ws} and is imported as saved; omit --world-size (or pass {ws})")
        _refuse_existing(LocalStore(root, job), step, force)
        with _Staging(root, job) as staging:
            for r_str, rm in meta["ranks"].items():
                fqns = _flat_fqns(rm["prefix"], rm["tree"], rm["keys"])
                missing = [f for f in fqns if f not in flat]
                if missing:
                    raise CorruptCheckpointError(f"{src_dir} lacks tensors {missing[:3]} listed in its trainguard "
                                                 "entry")
                tensors = [(k, flat[f]) for k, f in zip(rm["keys"], fqns)]
                ranks = range(ws) if len(meta["ranks"]) == 1 and ws > 1 else [int(r_str)]
                for r in ranks:
                    write_rank_step(staging.store, step, r, ws, rm["tree"], tensors,
                                    replicated=bool(rm.get("replicated")))
            staging.publish(step, force)
        return step
    raise CorruptCheckpointError(f"{src_dir}: its {META_KEY} entry is not a trainguard export record")


def _refuse_existing(store: LocalStore, step: int, force: bool) -> None:
    """Refuses to import over a step the job already has, unless ``force``.

    Before, an import wrote its ranks' files over the existing step's one by one: a second import of another
    checkpoint as the same step silently replaced the first (``ckpt export`` asks for ``--force`` to write over
    an earlier export), and a crash in between left a step that mixed both and still read as committed.

    Raises:
        CheckpointError: the step's folder exists and ``force`` is not set.
    """
    if force or step not in store.list_steps():
        return
    state = "committed" if store.is_complete(step)[0] else "incomplete"
    raise CheckpointError(f"step {step} of job {os.path.basename(store.job_dir)} already exists in {store.root} "
                          f"({state}); pass --force to replace it, or --step to import as another step")


class _Staging:
    """A hidden folder inside the job's folder (``<job>/.import-<random suffix>/<job>/``) that an import writes its step
    into; :meth:`publish` moves the finished step into the job with one rename. Step listings only read folders
    named ``step_<n>`` directly under the job, so a staging folder left by a crash is never taken for a step; the
    same filesystem as the job makes the rename atomic.

    The import holds an exclusive ``flock`` on the folder's ``.lock`` file while it runs. A killed import (SIGKILL,
    OOM, a lost node) left its folder and the bytes it had written for good; the next import into the job removes
    every staging folder whose lock it can take (its import is gone: the kernel dropped the lock with the process),
    and leaves those of imports still running."""

    def __init__(self, root: str, job: str) -> None:
        import fcntl
        import tempfile

        self.target = LocalStore(root, job)
        self.new_job = not os.path.isdir(self.target.job_dir)
        os.makedirs(self.target.job_dir, exist_ok=True)
        sweep_stale_imports(self.target.job_dir)
        self.dir = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.target.job_dir)
        self._lock = os.open(os.path.join(self.dir, STAGING_LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        except OSError:
            pass  # a filesystem without flock: no import can take this lock either, so none removes the folder
        self.store = LocalStore(self.dir, job)

    def __enter__(self) -> "_Staging":
        return self

    def __exit__(self, *exc: object) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
        os.close(self._lock)
        if self.new_job:
            try:
                os.rmdir(self.target.job_dir)  # a failed import into a new job: no empty job folder to list
            except OSError:
                pass  # the import succeeded (the folder holds the step)

    def publish(self, step: int, force: bool) -> None:
        """Moves the staged ``step`` into the job, swapping out an existing one when ``force``.

        Raises:
            CorruptCheckpointError: the staged step is not complete (a rank was not written).
            CheckpointError: the step appeared in the job meanwhile and ``force`` is not set.
        """
        from trainguard.checkpoint.fileio import fsync_dir
        from trainguard.checkpoint.storage import step_dirname

        complete, ws = self.store.is_complete(step)
        if not complete:
            raise CorruptCheckpointError(f"the import of step {step} wrote an incomplete step; nothing was imported")
        staged = os.path.join(self.store.job_dir, step_dirname(step))
        final = os.path.join(self.target.job_dir, step_dirname(step))
        if not os.path.lexists(final):
            try:
                if not _rename2(staged, final, _RENAME_NOREPLACE):
                    os.rename(staged, final)
                placed = True
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                placed = False  # another import or a trainer wrote the step meanwhile
        else:
            placed = False
        if not placed:
            _refuse_existing(self.target, step, force)
            if not _rename2(staged, final, _RENAME_EXCHANGE):
                # Without an atomic exchange (not Linux, or a filesystem without it) the old step is moved
                # aside first: a crash between the two renames loses the old step but never leaves a mixed one.
                os.rename(final, os.path.join(self.dir, "replaced"))
                os.rename(staged, final)
        if self.target.fsync:
            fsync_dir(self.target.job_dir)
        # The record is a hint (readers trust the markers), rewritten as the rank completing a step would.
        self.target._update_record(step, ws)


_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _rename2(src: str, dst: str, flags: int) -> bool:
    """Linux ``renameat2(src, dst, flags)``; False where the call or the flag is not supported (then nothing
    was renamed).

    Raises:
        OSError: the rename failed for another reason (``dst`` exists with ``RENAME_NOREPLACE``: EEXIST).
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), ctypes.c_uint(flags)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), dst)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__

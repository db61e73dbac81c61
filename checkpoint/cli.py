"""``trainguard ckpt ls|verify|gc|export|import``: operator commands over checkpoint directories.

``DIR`` is the checkpoint root (a local path or an fsspec URL); ``--job`` may be omitted when the root holds one
job. Long operations (verify, export) show a tqdm progress bar on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from trainguard.checkpoint.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError


def register(subparsers: Any) -> None:
    """Adds the ``ckpt`` command group to the top-level parser."""
    p = subparsers.add_parser("ckpt", help="inspect, verify, clean, export and import checkpoints")
    sub = p.add_subparsers(dest="ckpt_command", metavar="ACTION", parser_class=type(p))
    p.set_defaults(handler=lambda a: (p.print_help(), 2)[1])

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("directory", help="checkpoint root: local path or fsspec URL")
        q.add_argument("--job", default=None, help="job name (default: the only job under DIR)")

    q = sub.add_parser("ls", help="list committed and incomplete steps per tier")
    common(q)
    q.add_argument("--shm", default=None, help="shared-memory tier root to list too (e.g. /dev/shm/trainguard)")
    q.add_argument("--json", action="store_true", help="machine-readable output")
    q.set_defaults(handler=_one_line_os_errors(_ls))

    q = sub.add_parser("verify", help="check every checksum of a step (default: all committed steps)")
    common(q)
    q.add_argument("--step", type=int, default=None)
    q.set_defaults(handler=_one_line_os_errors(_verify))

    q = sub.add_parser("gc", help="keep the newest K committed steps that verify, delete older and torn ones")
    common(q)
    q.add_argument("--keep", type=int, required=True, help="committed steps that verify to keep (>= 1); corrupt steps do not count")
    q.add_argument("--shm", default=None, help="also delete this job's shared-memory arena under this root")
    q.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    q.set_defaults(handler=_one_line_os_errors(_gc))

    q = sub.add_parser("export", help="write a committed step in torch.distributed.checkpoint's layout "
                                      "(sharded steps stay sharded: dcp.load restores them at any world size)")
    common(q)
    q.add_argument("output", help="destination directory for the DCP checkpoint")
    q.add_argument("--step", type=int, default=None, help="step to export (default: newest committed)")
    q.add_argument("--force", action="store_true",
                   help="write into an OUTPUT folder that is not empty (files of the same names are replaced)")
    q.set_defaults(handler=_one_line_os_errors(_export))

    q = sub.add_parser("import", help="import a torch.distributed.checkpoint directory as a committed step")
    q.add_argument("source", help="DCP checkpoint directory")
    q.add_argument("directory", help="checkpoint root (local path) to import into")
    q.add_argument("--job", required=True, help="job name to import under")
    q.add_argument("--step", type=int, default=None, help="step number (default: the exported step, else 0)")
    q.add_argument("--world-size", type=int, default=None,
                   help="ranks to shard a DCP checkpoint over (dim 0, like FSDP2; default 1); any world size "
                        "restores it. A `ckpt export` directory keeps its saved world size (another is refused)")
    q.add_argument("--force", action="store_true",
                   help="replace the step when the job already has it (the new step takes its place in one rename)")
    q.set_defaults(handler=_one_line_os_errors(_import))


# ---------------------------------------------------------------------- helpers
def _one_line_os_errors(handler: Any) -> Any:
    """``handler`` with an operating-system error it did not handle (a folder it may not read or write, a path on
    /proc) turned into a one-line :class:`CheckpointError` naming the path: it was a traceback, exit code 1."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except OSError as exc:
            where = f"{exc.filename}: " if exc.filename else ""
            raise CheckpointError(f"{where}{exc.strerror or exc}; check the path and its permissions") from exc

    return run


def _store(directory: str, job: str | None) -> Any:
    from trainguard.checkpoint.location import CheckpointLocation

    location = CheckpointLocation.parse(directory, "the checkpoint root")
    if location.is_local and not os.path.isdir(location.local_path):
        raise CheckpointError(f"{location.local_path} is not a directory; pass the checkpoint root"
                              f"{_url_typo(directory)}")
    return location.open_store(_job(directory, job))


def _url_typo(directory: str) -> str:
    """A hint when a path that is no folder reads as a URL missing a slash (``s3:/bucket/x``): it was taken for a
    relative path and reported only as "not a directory"."""
    from fsspec.registry import known_implementations, registry

    scheme, sep, rest = directory.partition(":")
    if not sep or "/" in scheme or rest.startswith("//") or scheme.lower() in ("file", "local"):
        return ""
    if scheme.lower() not in known_implementations and scheme.lower() not in registry:
        return ""
    return f" (a URL takes two slashes after its scheme: did you mean {scheme}://{rest.lstrip('/')}?)"


def _jobs(directory: str) -> list[str]:
    """The job folders under a checkpoint root, sorted.

    Raises:
        CheckpointError: the root cannot be listed.
    """
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(directory)
        jobs = [e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(root, detail=False) if fs.isdir(e)]
    except FileNotFoundError as exc:
        # fsspec's error text is the bare path ("cannot list memory://x: /x")
        hint = ("; memory:// is the memory of one process, which no other process (this command) can see"
                if directory.startswith("memory:") else _url_typo(directory) or "; check the path or URL")
        raise CheckpointError(f"cannot list {directory}: no such folder{hint}") from exc
    except Exception as exc:
        raise CheckpointError(f"cannot list {directory}: {exc}") from exc
    return sorted(j for j in jobs if not j.startswith("."))


def _job(directory: str, job: str | None) -> str:
    """``--job`` when the root holds that job, else the root's only job when ``--job`` was not given.

    Raises:
        CheckpointError: not a valid job name, no such job (the message lists the jobs there), or no ``--job``
            and not exactly one job.
    """
    from trainguard.checkpoint.storage import check_job_name, is_step_dirname

    if job is not None:
        check_job_name(job)
    jobs = _jobs(directory)
    if jobs and all(is_step_dirname(j) for j in jobs):
        # A job's own folder given as the root: its steps were listed as "jobs", or, with one step, the step taken
        # for the job and its (absent) steps reported as "no committed step".
        parent, name = os.path.split(directory.rstrip("/"))
        raise CheckpointError(f"{directory} is the folder of job {name!r} (it holds step folders); pass the "
                              f"checkpoint root above it: {parent or '.'} --job {name}")
    if job is not None:
        # An empty listing would read as "no steps yet" and exit 0, hiding a misspelt --job.
        if job not in jobs:
            raise CheckpointError(f"{directory} holds no job {job!r} (jobs there: {', '.join(jobs) or 'none'}); "
                                  "check --job")
        return job
    if len(jobs) != 1:
        raise CheckpointError(f"{directory} holds {len(jobs)} jobs ({', '.join(jobs) or 'none'}); "
                              "choose one with --job")
    return jobs[0]


_DCP_HINT = ("export and import use local folders only: give a path (or file:///abs/dir) and copy the folder to "
             "or from remote storage with its own tools")
_SHM_HINT = "give the shared-memory tier's root as a path (or file:///abs/dir), e.g. /dev/shm/trainguard"


def _local_folder(text: str, name: str, hint: str) -> str:
    """The local path of the folder argument ``name``: a path, ``file:///abs`` or ``file:/abs``.

    Before, the text went to ``os`` and to ``dcp.save`` as given: ``export DIR file:///abs/out`` created a folder
    ``./file:/abs/out`` under the working directory and skipped the not-empty check (DCP's own fsspec writer put
    the files in ``/abs/out``, over an earlier export), ``export DIR memory://out`` reported success for files
    that vanished with the process, ``import file:///abs/dcp`` said the export had no ``.metadata``, and
    ``gc --shm file:///dev/shm/trainguard`` said it removed an arena it never looked at.

    Raises:
        CheckpointError: a remote or in-process URL (``s3://``, ``memory://``), or a ``file://`` URL with a host
            part; the message names the argument.
    """
    from trainguard.checkpoint.location import CheckpointLocation

    location = CheckpointLocation.parse(text, name)
    if not location.is_local:
        raise CheckpointError(f"{name} {text!r} is not a local folder; {hint}")
    return location.local_path


def _bar(total: int | None, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                disable=None, leave=False)


def _open_rank(store: Any, step: int, rank: int) -> Any:
    import tempfile

    from trainguard.checkpoint.manifest import Manifest
    from trainguard.checkpoint.reader import RankCopy
    from trainguard.checkpoint.storage import manifest_name

    where = f"step {step} rank {rank}"
    try:
        raw = store.read_small(step, manifest_name(rank))
    except FileNotFoundError as exc:
        raise CorruptCheckpointError(f"{where}: manifest is missing") from exc
    man = Manifest.from_json(raw, f"{where} manifest").check_place(step, rank, where)
    path = store.local_data_path(step, rank)
    if path is not None:
        return RankCopy(man, path, where, advisory_lock=True)
    fd, tmp = tempfile.mkstemp(suffix=".data")
    os.close(fd)
    try:
        store.fetch_data(step, rank, tmp)
        return RankCopy(man, tmp, where)
    finally:
        os.unlink(tmp)


# ---------------------------------------------------------------------- handlers
def _ls(args: argparse.Namespace) -> int:
    if args.shm:
        args.shm = _local_folder(args.shm, "--shm", _SHM_HINT)
    store = _store(args.directory, args.job)
    job = store.job_dir.rstrip("/").rsplit("/", 1)[-1]
    rows = []
    for step in store.list_steps():
        complete, ws = store.is_complete(step)
        marks = store.markers(step)
        # A complete step's ranks are 0..ws-1; markers of higher ranks are an earlier save's (a larger world).
        rows.append({"step": step, "tier": store.tier, "complete": complete, "world_size": ws or None,
                     "ranks_committed": list(range(ws)) if complete else sorted(marks)})
    if args.shm:
        from trainguard.checkpoint.arena import memory_manifests
        from trainguard.checkpoint.manifest import complete_world_size

        if not os.path.isdir(os.path.join(args.shm, job)):
            # A mistyped --shm listed no memory rows, as if the tier held nothing.
            print(f"trainguard: no shared-memory arena of job {job} under {args.shm}", file=sys.stderr)

        for step, ranks in sorted(memory_manifests(args.shm, job).items()):
            ws = complete_world_size({r: m.world_size for r, (_, m) in ranks.items()})
            rows.append({"step": step, "tier": "memory", "complete": ws > 0,
                         "world_size": ws or None, "ranks_committed": sorted(ranks)})
    record = store.record()
    if args.json:
        print(json.dumps({"job": job, "location": store.describe(), "record": record, "steps": rows}, indent=2))
        return 0
    print(f"job {job} at {store.describe()}; newest committed (record): "
          f"{record['step'] if record else 'none'}")
    print(f"{'STEP':>12}  {'TIER':<7} {'STATE':<10} {'WORLD':>5}  RANKS")
    for r in sorted(rows, key=lambda r: (r["step"], r["tier"])):
        state = "committed" if r["complete"] else "incomplete"
        print(f"{r['step']:>12}  {r['tier']:<7} {state:<10} {r['world_size'] or '?':>5}  "
              f"{len(r['ranks_committed'])} committed")
    if any(r["complete"] for r in rows):
        # ls reads commit markers only: a step whose bytes rotted since reads "committed" here (and was taken
        # for a checked one); verify reads every byte.
        print("committed: every rank's commit marker is written; `trainguard ckpt verify` checks the data")
    return 0


def _uncommitted_why(store: Any, step: int) -> str:
    """Why a step that exists is not committed: damaged commit markers are named (a marker that is there but
    unreadable was reported as missing, and the user found the file in place)."""
    from trainguard.checkpoint.storage import _MARKER_RE

    try:
        present = {int(m.group(1)) for n in store.list_names(step) if (m := _MARKER_RE.match(n))}
        damaged = sorted(present - set(store.markers(step)))
    except OSError:
        damaged = []
    if damaged:
        return (f"the commit marker of rank(s) {', '.join(map(str, damaged[:8]))} is damaged (not a valid marker); "
                "the step cannot be trusted: restore or export another one")
    return "some rank's commit marker is missing"


def _verify(args: argparse.Namespace) -> int:
    store = _store(args.directory, args.job)
    committed = dict(store.committed_steps())
    steps = [args.step] if args.step is not None else sorted(committed)
    if args.step is None:
        recorded = _recorded_uncommitted(store, committed)
        if recorded is not None:
            # the job's record names it committed: its markers went missing or were damaged since, which a
            # restore skips (and now warns of); verify said nothing of it and exited 0
            steps.append(recorded)
    if not steps:
        raise NoCheckpointError(f"no committed step in {store.describe()}")
    bad = 0
    for step in steps:
        ws = committed.get(step)
        if ws is None:
            if step not in store.list_steps():
                newest = max(committed, default=None)
                print(f"step {step}: NO SUCH STEP in {store.describe()} (newest committed: "
                      f"{'none' if newest is None else newest}; `trainguard ckpt ls` lists them)")
            else:
                print(f"step {step}: NOT COMMITTED ({_uncommitted_why(store, step)})")
            bad += 1
            continue
        manifests: dict[int, Any] = {}
        for rank in range(ws):
            try:
                with _open_rank(store, step, rank) as copy:
                    with _bar(copy.manifest.data_bytes, f"verify step {step} rank {rank}") as bar:
                        copy.verify(bar.update)
                manifests[rank] = copy.manifest
                print(f"step {step} rank {rank}: OK ({copy.manifest.data_bytes} bytes, "
                      f"{len(copy.manifest.tensors)} tensors)")
            except (CorruptCheckpointError, OSError) as exc:
                if _removed_meanwhile(store, step):
                    print(f"step {step}: REMOVED while verifying (no longer committed: a live job's retention or "
                          "a `ckpt gc` deleted it)" + ("" if args.step is not None else "; not counted"))
                    bad += args.step is not None  # the step asked for is gone; one of the listed is no failure
                    break
                print(f"step {step} rank {rank}: CORRUPT: {exc}")
                bad += 1
        if len(manifests) == ws:
            # Each rank's copy can verify while their shards leave a gap or overlap: the step then fails every
            # reshard and export, so it is no good step either.
            problems = _layout_problems(manifests)
            for p in problems:
                print(f"step {step}: INCONSISTENT SHARDS: {p}")
            bad += bool(problems)
    return 1 if bad else 0


def _recorded_uncommitted(store: Any, committed: dict[int, int]) -> int | None:
    """The step the job's commit record names when it is newer than every committed step and its folder is
    still there, incomplete; else None."""
    try:
        record = store.record()
        step = None if record is None else int(record["step"])
        if step is None or step in committed or step < max(committed, default=-1):
            return None
        return step if step in store.list_steps() and not store.is_complete(step)[0] else None
    except (OSError, CheckpointError, KeyError, TypeError, ValueError):
        return None


def _layout_problems(manifests: dict[int, Any]) -> list[str]:
    """:func:`~trainguard.checkpoint.shards.shard_layout_problems` of a sharded step's manifests (none for an
    unsharded one): restore, verify, gc and export share that one check."""
    if not any(m.sharded for m in manifests.values()):
        return []
    from trainguard.checkpoint.shards import shard_layout_problems

    return shard_layout_problems(manifests)


def _removed_meanwhile(store: Any, step: int) -> bool:
    """Whether ``step``, committed when listed, is no longer committed: a live trainer's retention (or ``ckpt gc``)
    removes a step's commit markers before its files, so files missing after that are no corruption."""
    try:
        return not store.is_complete(step)[0]
    except (OSError, CheckpointError):
        return False


def _step_problem(store: Any, step: int, world_size: int) -> str | None:
    """Why committed ``step`` does not verify (first failing rank, or the ranks' shards not tiling a tensor), or
    None when every rank's copy verifies."""
    manifests: dict[int, Any] = {}
    for rank in range(world_size):
        try:
            with _open_rank(store, step, rank) as copy:
                copy.verify()
            manifests[rank] = copy.manifest
        except (CorruptCheckpointError, OSError) as exc:
            return f"rank {rank}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    problems = _layout_problems(manifests)
    return f"inconsistent shards: {problems[0]}" if problems else None


@dataclass
class GcPlan:
    """What ``ckpt gc --keep K`` keeps and deletes.

    Attributes:
        remove: steps to delete, ascending.
        kept: ``(step, why)`` of every committed step kept, newest first.
    """

    remove: list[int]
    kept: list[tuple[int, str]]


def gc_plan(store: Any, keep: int) -> GcPlan:
    """Plans ``ckpt gc --keep KEEP`` without deleting anything.

    Only steps that verify count toward ``keep`` (a corrupt newest step must not push out the valid ones): the
    committed steps are verified newest first until ``keep`` of them pass. Everything older than the oldest
    kept valid step goes, and torn steps older than the newest commit; corrupt steps newer than that are kept
    (not counted) for inspection. With no step that verifies nothing is deleted.

    Args:
        store: the job's step store.
        keep: steps that verify to keep (>= 1).
    """
    committed = sorted(store.committed_steps(), reverse=True)
    kept: list[tuple[int, str]] = []
    valid = 0
    oldest_kept: int | None = None
    for step, ws in committed:
        if valid == keep:
            break
        problem = _step_problem(store, step, ws)
        if problem is not None and _removed_meanwhile(store, step):
            continue  # a live job's retention removed it while it was verified: neither kept nor corrupt
        if problem is None:
            valid += 1
            oldest_kept = step
            kept.append((step, f"verifies ({valid} of {keep} kept by --keep)"))
        else:
            kept.append((step, f"CORRUPT, not counted toward --keep ({problem})"))
    if oldest_kept is None:
        return GcPlan([], kept)
    complete = {s for s, _ in committed}
    newest = committed[0][0]
    # Torn leftovers older than the newest commit (a crashed save) go too; newer ones may still be in progress.
    remove = sorted(s for s in store.list_steps()
                    if s < oldest_kept or (s not in complete and s < newest))
    return GcPlan(remove, kept)


def _sweep_imports(store: Any, dry_run: bool) -> None:
    """Removes (or, ``dry_run``, names) the staging folders of imports into the job that died unfinished: a
    SIGKILLed `ckpt import` left its folder, with every byte it had written, until the next import into the job."""
    from trainguard.checkpoint.import_staging import sweep_stale_imports
    from trainguard.checkpoint.storage import LocalStore

    if not isinstance(store, LocalStore):
        return  # imports stage only in local folders
    gone = sweep_stale_imports(store.job_dir, dry_run=dry_run)
    if gone:
        names = ", ".join(os.path.basename(p) for p in gone)
        print(f"{'would remove' if dry_run else 'removed'} the staging folder(s) of {len(gone)} import(s) that "
              f"ended unfinished: {names}")


def _gc(args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise CheckpointError("--keep must be >= 1")
    if args.shm:
        args.shm = _local_folder(args.shm, "--shm", _SHM_HINT)
    store = _store(args.directory, args.job)
    plan = gc_plan(store, args.keep)
    dry = getattr(args, "dry_run", False)
    for step, why in plan.kept:
        print(f"{'would keep' if dry else 'kept'} step {step}: {why}")
    if plan.kept and not any(why.startswith("verifies") for _, why in plan.kept):
        print("no committed step verifies; deleting nothing (run `trainguard ckpt verify`)")
        return 1
    if dry:
        print(f"would remove {len(plan.remove)} step(s): {plan.remove}" if plan.remove else "nothing to remove")
        _sweep_imports(store, dry_run=True)
        if args.shm:
            job = store.job_dir.rstrip("/").rsplit("/", 1)[-1]
            print(f"would remove the shared-memory arena under {args.shm}" if os.path.isdir(
                os.path.join(args.shm, job)) else f"no shared-memory arena of job {job} under {args.shm}")
        return 0
    for s in plan.remove:
        store.remove_step(s)
    # remove_step leaves what it cannot delete (retention in a trainer must never raise): a user without write
    # access to the job's folder was told "removed 3 step(s)", exit 0, with every step still in place.
    left = sorted(set(plan.remove) & set(store.list_steps()))
    removed = [s for s in plan.remove if s not in left]
    print(f"removed {len(removed)} step(s): {removed}" if removed else "nothing removed" if left
          else "nothing to remove")
    if left:
        print(f"could not remove step(s) {left} from {store.describe()}: check that you may write there "
              "(its owner, a read-only mount)", file=sys.stderr)
        return 1
    _sweep_imports(store, dry_run=False)
    if args.shm:
        from trainguard.checkpoint.arena import remove_job

        job = store.job_dir.rstrip("/").rsplit("/", 1)[-1]
        if not os.path.isdir(os.path.join(args.shm, job)):
            # It said "removed the shared-memory arena" for a mistyped root that held nothing.
            print(f"no shared-memory arena of job {job} under {args.shm}: nothing removed there")
            return 0
        kept = remove_job(args.shm, job)
        if kept:  # a live trainer holds these ranks' leases: removing its slots would fail its next save
            print(f"removed the shared-memory arena under {args.shm}, except ranks {kept}: a live process "
                  "writes them")
        else:
            print(f"removed the shared-memory arena under {args.shm}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from trainguard.checkpoint.dcp import export_step
    from trainguard.checkpoint.location import CheckpointLocation

    location = CheckpointLocation.parse(args.directory, "the checkpoint root")
    if not location.is_local:
        raise CheckpointError("export reads the local disk tier; pass a local checkpoint root")
    root = location.local_path
    job = _job(root, args.job)
    output = _local_folder(args.output, "output", _DCP_HINT)
    if os.path.exists(output) and not os.path.isdir(output):
        raise CheckpointError(f"{args.output} is a file; pass a folder (new or empty) for the export")
    if os.path.isdir(output) and os.listdir(output) and not getattr(args, "force", False):
        # DCP writes its .metadata and shard files over whatever is there: another export would be lost.
        raise CheckpointError(f"{args.output} is not empty; choose a new folder, or pass --force to write the "
                              "export into it")
    bar = _bar(None, "verify+export")  # type: ignore[arg-type]
    try:
        step = export_step(root, job, args.step, output, bar.update)
    finally:
        bar.close()
    print(f"exported step {step} of job {job} to {args.output} (torch.distributed.checkpoint layout)")
    return 0


def _import(args: argparse.Namespace) -> int:
    from trainguard.checkpoint.dcp import import_dcp
    from trainguard.checkpoint.location import CheckpointLocation

    location = CheckpointLocation.parse(args.directory, "the checkpoint root")
    if not location.is_local:
        raise CheckpointError("import writes the local disk tier; pass a local checkpoint root")
    from tqdm import tqdm

    with tqdm(total=1, desc="import", file=sys.stderr, disable=None, leave=False) as bar:
        step = import_dcp(_local_folder(args.source, "source", _DCP_HINT), location.local_path, args.job,
                          args.step, args.world_size, force=getattr(args, "force", False))
        bar.update(1)
    print(f"imported {args.source} as step {step} of job {args.job}")
    return 0

"""Node-local checks: the configured detectors report nothing bad, and the checkpoint disk writes fast enough.

- ``detectors``: builds the node's configured detector set once and takes one sample of each; any event of
  severity ERROR or CRITICAL fails the node (an input a detector cannot read is a warning, as in the agent).
  Detectors that watch the workers (``process``) are left out: no worker runs before the node takes a slot.
- ``disk``: writes ``disk_mib`` MiB into the checkpoint directory (or ``disk_dir``) and fsyncs it; the rate
  (MiB over the wall time of the writes and the fsync) must reach ``disk_min_mib_s``. A full or read-only disk
  fails with the OS error. The file is removed whatever happens.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid

from trainguard.agent.qualify.base import Outcome, QualifyContext, failed, passed, register_check, skipped
from trainguard.checkpoint.location import LOCAL_SCHEMES, split_url
from trainguard.detectors.events import Severity

_CHUNK = 1 << 20


@register_check("detectors")
class DetectorsCheck:
    """One sample of every configured hardware detector; no ERROR or CRITICAL event."""

    name = "detectors"

    def run(self, ctx: QualifyContext, deadline: float) -> Outcome:
        """Samples each detector once, in order, until done or past ``deadline``."""
        from trainguard.detectors.base import create_detectors, detector_class

        names = [n for n in ctx.detector_names if not getattr(detector_class(n), "accepts_worker_view", False)]
        if not names:
            return skipped("no hardware detectors configured")
        settings = {n: f for n, f in ctx.detector_settings.items() if n in names}
        detectors = create_detectors(names, settings, root=ctx.detector_root)
        bad: list[str] = []
        unreadable = 0
        broken: list[str] = []
        sampled = 0
        try:
            for det in detectors:
                if time.monotonic() > deadline:
                    return failed(f"timed out after sampling {sampled} of {len(detectors)} detectors")
                try:
                    sample = det.sample()
                except Exception as exc:  # noqa: BLE001 (a broken detector reads as unreadable input, as in the runner)
                    broken.append(f"{det.name} ({type(exc).__name__}: {exc})")
                    continue
                sampled += 1
                unreadable += len(sample.errors)
                bad += [f"{ev.kind} ({ev.message})" for ev in sample.events if ev.severity >= Severity.ERROR]
        finally:
            for det in detectors:
                try:
                    det.close()
                except Exception:  # noqa: BLE001 (closing must not hide the verdict)
                    pass
        if bad:
            return failed("; ".join(bad))
        note = f" ({unreadable} unreadable input(s))" if unreadable else ""
        if broken:
            note += f"; could not sample {', '.join(broken)}"
        return passed(f"{sampled} detector(s) clean: {', '.join(names)}{note}")


def _local_dir(path: str | None) -> str | None:
    """A local directory from a checkpoint location: a path or ``file://`` URL; None for a remote URL."""
    if not path:
        return None
    scheme, rest = split_url(path)  # the checkpointer's own parsing: file:/abs is /abs, not ./file:/abs
    return rest if scheme in LOCAL_SCHEMES else None


def _existing(path: str) -> str:
    """``path`` or its nearest existing ancestor (a job's checkpoint directory may not exist yet; writing to
    the filesystem that will hold it measures the same disk without creating folders on the job's behalf)."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


@register_check("disk")
class DiskWriteCheck:
    """``disk_mib`` MiB written and fsync'd at ``disk_min_mib_s`` or faster."""

    name = "disk"

    def run(self, ctx: QualifyContext, deadline: float) -> Outcome:
        """Writes the test file, fsyncs it, times both, removes it."""
        cfg = ctx.config
        if cfg.disk_dir and not os.path.isdir(cfg.disk_dir):
            # the operator named the disk to test: an ancestor would be another disk (the root filesystem under a
            # volume that failed to mount), and the node would qualify on the wrong one
            return failed(f"qualify.disk_dir {cfg.disk_dir}: no such directory (not mounted?); create it or fix "
                          "the path")
        target = _existing(cfg.disk_dir or _local_dir(ctx.checkpoint_dir) or tempfile.gettempdir())
        path = os.path.join(target, f".trainguard-qualify-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        block = os.urandom(_CHUNK)  # incompressible: a compressing filesystem must not flatter the rate
        written = 0
        t0 = time.monotonic()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                for _ in range(cfg.disk_mib):
                    if time.monotonic() > deadline:
                        return failed(f"{target}: wrote only {written / _CHUNK:.0f} of {cfg.disk_mib} MiB "
                                      f"in {time.monotonic() - t0:.2f} s")
                    view = memoryview(block)
                    while view:
                        view = view[os.write(fd, view):]
                    written += _CHUNK
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            return failed(f"{target}: cannot write ({exc.strerror or exc})")
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass
        took = max(time.monotonic() - t0, 1e-6)
        rate = written / _CHUNK / took
        if rate < cfg.disk_min_mib_s:
            return failed(f"{target}: {rate:.1f} MiB/s ({cfg.disk_mib} MiB fsync'd in {took:.2f} s), below the "
                          f"{cfg.disk_min_mib_s:g} MiB/s minimum")
        return passed(f"{target}: {rate:.0f} MiB/s ({cfg.disk_mib} MiB fsync'd)")


__all__ = ["DetectorsCheck", "DiskWriteCheck"]

"""The staging folders of ``trainguard ckpt import``: ``<job>/.import-<random suffix>``, one per import, each
holding an exclusive ``flock`` on its ``.lock`` file while the import runs (see ``dcp._Staging``). A killed import
(SIGKILL, OOM, a lost node) leaves its folder and the bytes it wrote; the next import into the job and
``ckpt gc`` remove every folder whose lock they can take (the kernel dropped it with the dead process).

Kept apart from :mod:`.dcp` so that ``ckpt gc`` sweeps without importing torch.
"""

from __future__ import annotations

import os

#: Staging folders of imports are named ``<job>/.import-<random suffix>``.
STAGING_PREFIX = ".import-"
#: The file each running import holds an exclusive flock on.
STAGING_LOCK = ".lock"
#: A staging folder without its lock file is left alone this long (an import between creating the folder and its
#: lock file); older ones are a crash's (or an older version's) leftovers.
STAGING_UNLOCKED_GRACE_S = 60.0


def sweep_stale_imports(job_dir: str, dry_run: bool = False) -> list[str]:
    """Removes the staging folders of imports into ``job_dir`` that are no longer running.

    Args:
        job_dir: the job's folder.
        dry_run: remove nothing; return the folders that would go.

    Returns:
        The folders removed (or that would be).
    """
    import fcntl
    import shutil
    import time

    removed = []
    try:
        names = [n for n in os.listdir(job_dir) if n.startswith(STAGING_PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(job_dir, name)
        try:
            fd = os.open(os.path.join(path, STAGING_LOCK), os.O_RDONLY)
        except FileNotFoundError:
            try:
                stale = time.time() - os.lstat(path).st_mtime > STAGING_UNLOCKED_GRACE_S
            except OSError:
                continue
            if stale:
                if not dry_run:
                    shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a running import holds it
            continue
        try:
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True)  # under its lock: no import can be starting in it
            removed.append(path)
        finally:
            os.close(fd)
    if removed and not dry_run:
        import logging

        logging.getLogger(__name__).warning("removed the staging folder(s) of %d import(s) that ended without "
                                            "finishing: %s", len(removed), ", ".join(removed))
    return removed


__all__ = ["STAGING_LOCK", "STAGING_PREFIX", "STAGING_UNLOCKED_GRACE_S", "sweep_stale_imports"]

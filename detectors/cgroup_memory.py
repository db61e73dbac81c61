"""Memory limit and working set of a control group, cgroup v2 or v1.

In a container the kernel's OOM killer acts at the container's cgroup limit, not when ``/proc/meminfo`` (the
host's figures) runs out: a pod limited to 64 GiB on a 2 TiB node is killed with 1.9 TiB "available". This
module reads the limit and what counts against it, as the kubelet does for eviction: the *working set*, usage
minus the inactive page cache that the kernel reclaims before it kills anything.

Files, under the detector's root (Documentation/admin-guide/cgroup-v2.rst and cgroup-v1/memory.rst):
* ``/proc/self/cgroup``: ``0::<path>`` (v2), ``<id>:memory:<path>`` (v1; controllers may be comma-joined);
* v2, under ``/sys/fs/cgroup/<path>``: ``memory.max`` (bytes or ``max``), ``memory.current``, ``memory.stat``
  (``inactive_file``);
* v1, under ``/sys/fs/cgroup/memory/<path>``: ``memory.limit_in_bytes`` (unlimited reads as a page-rounded
  2^63-1), ``memory.usage_in_bytes``, ``memory.stat`` (``total_inactive_file``).
Every ancestor's limit binds too (a job's cgroup under a pod's, under a slice), so the cgroup and each parent up
to the mount are read and the one with the least room wins. A container without its own cgroup namespace sees a
path (``/docker/<id>``) that does not exist under its mount, where its own cgroup is the mount's root: the root
is read then. A path with ``..`` (a cgroup outside this process's cgroup namespace root) is not under the mount
at all: it is a read error, and nothing outside the mount is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainguard.detectors.errors import DetectorReadError
from trainguard.detectors.sysfs import parse_int, read_text

CGROUP_MOUNT = "/sys/fs/cgroup"
#: A v1 limit at or above this is "no limit" (the kernel writes 2^63-1 rounded down to a page).
V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class CgroupMemory:
    """The binding memory limit: the cgroup (path under the mount), its limit, and the working set against it."""

    cgroup: str
    limit_bytes: int
    working_set_bytes: int

    @property
    def available_bytes(self) -> int:
        """Room left before the limit (never negative)."""
        return max(0, self.limit_bytes - self.working_set_bytes)


def own_cgroup(root_path: str) -> tuple[str, str]:
    """This process's memory cgroup from ``/proc/self/cgroup``.

    Args:
        root_path: the file, under the detector's root.

    Returns:
        ``(version, path)``: ``"v1"`` when a v1 memory hierarchy holds this process, else ``"v2"``.

    Raises:
        DetectorReadError: unreadable, or no memory hierarchy line.
    """
    v2 = None
    for line in read_text(root_path).splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            return "v1", parts[2] or "/"
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2] or "/"
    if v2 is None:
        raise DetectorReadError(root_path, "no '0::<path>' or '<id>:memory:<path>' line")
    return "v2", v2


def _stat_value(path: str, key: str) -> int:
    for line in read_text(path).splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _byte_count(value.strip(), path, f"{key} as a byte count")
    return 0  # kernels without the key count no reclaimable cache


def _read_bytes(path: str) -> int | None:
    """A limit or usage file: bytes, or None for ``max``."""
    text = read_text(path).strip()
    if text == "max":
        return None
    return _byte_count(text, path, "a byte count or 'max'")


def _byte_count(text: str, path: str, expected: str) -> int:
    """A non-negative decimal count as the kernel prints it. int() took '1_000', '-5' and other scripts' digits:
    a limit of -5 bytes read as no room at all, a memory_low event and a checkpoint asked for on garbage."""
    value = parse_int(text, path, expected)
    if value < 0:
        raise DetectorReadError(path, f"expected {expected}, found the negative {text[:40]!r}")
    return value


def binding_limit(version: str, mount: str, path: str, own: bool = True) -> CgroupMemory | None:
    """The limit with the least room among the cgroup at ``path`` and its ancestors.

    Args:
        version: ``"v1"`` or ``"v2"``.
        mount: the hierarchy's mount point under the detector's root (``<root>/sys/fs/cgroup`` for v2,
            ``<root>/sys/fs/cgroup/memory`` for v1).
        path: the cgroup, absolute within the hierarchy.
        own: ``path`` is this process's own (from ``/proc/self/cgroup``): when it is not under the mount, the
            mount's root is read; a named cgroup that does not exist is an error instead.

    Returns:
        The binding limit, or None when no cgroup on the way sets one (a process on the host).

    Raises:
        DetectorReadError: a limit, usage or stat file exists but cannot be read, or a named cgroup is absent.
    """
    # Normalised, and never climbing out of the mount: a path with '..' (a cgroup outside this cgroup
    # namespace's root, as /proc/self/cgroup shows one) was followed there, reading limits of whatever folders
    # lay above the mount (<root>/sys/fs/memory.max, ...) as this cgroup's.
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise DetectorReadError(mount, f"cgroup path {path!r} leads outside {mount} ('..'); only cgroups under the "
                                "mount can be read")
    rel = "/".join(parts)
    start = os.path.join(mount, rel) if rel else mount
    if not os.path.isdir(start):
        if not own:
            raise DetectorReadError(start, f"no cgroup {path!r} under {mount} (host.memory_cgroup names a cgroup "
                                    "path such as /kubepods.slice or /system.slice/train.service, or 'self')")
        start, rel = mount, ""  # no cgroup namespace: the mount's root is this container's own cgroup
    limit_file, usage_file, stat_key = (
        ("memory.max", "memory.current", "inactive_file") if version == "v2"
        else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    best: CgroupMemory | None = None
    here, name = start, "/" + rel
    while True:
        limit_path = os.path.join(here, limit_file)
        if os.path.exists(limit_path):  # the v2 root has no memory.max
            limit = _read_bytes(limit_path)
            if limit is not None and not (version == "v1" and limit >= V1_UNLIMITED):
                usage = _read_bytes(os.path.join(here, usage_file)) or 0
                stat_path = os.path.join(here, "memory.stat")
                cache = _stat_value(stat_path, stat_key) if os.path.exists(stat_path) else 0
                found = CgroupMemory(name, limit, max(0, usage - cache))
                if best is None or found.available_bytes < best.available_bytes:
                    best = found
        if os.path.normpath(here) == os.path.normpath(mount):
            return best
        here, name = os.path.dirname(here), os.path.dirname(name) or "/"


def read_cgroup_memory(proc_self_cgroup: str, cgroup_root: str, cgroup: str) -> CgroupMemory | None:
    """The binding memory limit of ``cgroup`` (``"self"``: this process's) and its ancestors.

    Args:
        proc_self_cgroup: ``/proc/self/cgroup`` under the detector's root.
        cgroup_root: ``/sys/fs/cgroup`` under the detector's root.
        cgroup: ``"self"`` or an absolute cgroup path (a job's slice, a pod's cgroup).

    Returns:
        The binding limit, or None when none is set (or, for ``"self"``, when there is no cgroup filesystem).

    Raises:
        DetectorReadError: a file cannot be read or parsed, or a named cgroup does not exist.
    """
    if not os.path.isdir(cgroup_root) or (cgroup == "self" and not os.path.exists(proc_self_cgroup)):
        if cgroup != "self":
            raise DetectorReadError(cgroup_root, "no cgroup filesystem to find host.memory_cgroup in")
        return None  # no cgroups here (another OS, a fake tree of a drill that models none)
    if cgroup == "self":
        version, path = own_cgroup(proc_self_cgroup)
        if ".." in path.split("/"):
            # The kernel shows a cgroup outside this process's cgroup namespace root relative to that root
            # ('0::/../sibling'): it is not under the mount, and neither is its parent's limit. Not readable here;
            # said so, rather than reading the folders above the mount or the namespace root's limit as its own.
            raise DetectorReadError(proc_self_cgroup, f"this process's cgroup {path!r} is outside its cgroup "
                                    "namespace's root ('..'): its memory limit cannot be read under "
                                    f"{cgroup_root}; the node's memory counts alone")
    else:
        version = "v1" if os.path.isdir(os.path.join(cgroup_root, "memory")) and not os.path.exists(
            os.path.join(cgroup_root, "cgroup.controllers")) else "v2"
        path = cgroup
    mount = os.path.join(cgroup_root, "memory") if version == "v1" else cgroup_root
    return binding_limit(version, mount, path, own=cgroup == "self")

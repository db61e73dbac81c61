"""The host detector's memory against a cgroup's limit (a container's), on fake cgroup v2 and v1 trees in the
kernel's formats, and on this machine's own cgroup."""

from __future__ import annotations

import os

import pytest

from trainguard.detectors.cgroup_memory import read_cgroup_memory
from trainguard.detectors.errors import DetectorConfigError, DetectorReadError
from trainguard.detectors.host import HostConfig, HostDetector
from trainguard.testing.sysfs import write_file

GIB = 1 << 30
KIB_TOTAL = 2 * 1024 * 1024 * 1024  # a 2 TiB node, in kB
MEMINFO = (f"MemTotal:       {KIB_TOTAL} kB\nMemFree:        {KIB_TOTAL // 2} kB\n"
           f"MemAvailable:   {KIB_TOTAL * 9 // 10} kB\nSwapTotal:             0 kB\nSwapFree:              0 kB\n")
V2_STAT = "anon {anon}\nfile {file}\nkernel 1048576\nactive_file 1000\ninactive_file {inactive}\nslab 4096\n"
V1_STAT = ("cache {file}\nrss {anon}\ninactive_file 0\nhierarchical_memory_limit {limit}\n"
           "total_cache {file}\ntotal_rss {anon}\ntotal_inactive_file {inactive}\n")


def _v2_pod(root, pod: str, limit: str, current: int, inactive: int, job_limit: str | None = None) -> None:
    """A cgroup v2 tree: the pod's cgroup (with its limit) holding this process in a job cgroup below it."""
    write_file(root, "proc/meminfo", MEMINFO)
    write_file(root, "proc/self/cgroup", f"0::{pod}/job\n")
    write_file(root, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory hugetlb pids rdma misc\n")
    write_file(root, "sys/fs/cgroup/memory.stat", V2_STAT.format(anon=1, file=1, inactive=1))  # the root: no max
    write_file(root, f"sys/fs/cgroup{pod}/memory.max", limit + "\n")
    write_file(root, f"sys/fs/cgroup{pod}/memory.current", f"{current}\n")
    write_file(root, f"sys/fs/cgroup{pod}/memory.stat", V2_STAT.format(anon=current - inactive, file=inactive,
                                                                       inactive=inactive))
    write_file(root, f"sys/fs/cgroup{pod}/job/memory.max", (job_limit or "max") + "\n")
    write_file(root, f"sys/fs/cgroup{pod}/job/memory.current", f"{current}\n")
    write_file(root, f"sys/fs/cgroup{pod}/job/memory.stat", V2_STAT.format(anon=current - inactive,
                                                                           file=inactive, inactive=inactive))


def test_a_container_near_its_limit_is_memory_low_with_the_host_nearly_free(tmp_path) -> None:
    """A 64 GiB pod on a 2 TiB node: the OOM killer acts at 64 GiB while /proc/meminfo says 90% available.
    Without the cgroup, 63.5 GiB of working set in that pod read as 90% free and nothing asked for a checkpoint
    before the kill."""
    pod = "/kubepods.slice/kubepods-pod1234.slice"
    _v2_pod(tmp_path, pod, str(64 * GIB), current=64 * GIB - GIB // 4, inactive=GIB // 8)
    node_only = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0)).sample()
    assert node_only.metrics["mem_available_pct"] == pytest.approx(90.0) and node_only.events == []
    det = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0, memory_cgroup="self"))
    s = det.sample()
    room = GIB // 4 + GIB // 8  # the limit minus the working set (usage less the inactive file cache)
    assert s.metrics["mem_available_bytes"] == room
    assert s.metrics["mem_available_pct"] == pytest.approx(100.0 * room / (64 * GIB))
    (ev,) = s.events
    assert ev.kind == "host.memory_low" and f"cgroup {pod}" in ev.message and "of 65536 MiB" in ev.message
    assert ev.evidence["cgroup"] == pod and ev.evidence["mem_limit_bytes"] == str(64 * GIB)
    # the same cgroup named explicitly (the node daemon watching a job's pod) reads the same
    named = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0, memory_cgroup=pod)).sample()
    assert named.metrics["mem_available_bytes"] == room


def test_the_tighter_of_a_cgroup_and_its_parent_binds_and_an_unlimited_one_is_the_node(tmp_path) -> None:
    pod = "/kubepods.slice/kubepods-pod77.slice"
    _v2_pod(tmp_path, pod, str(512 * GIB), current=10 * GIB, inactive=0, job_limit=str(12 * GIB))
    cg = read_cgroup_memory(str(tmp_path / "proc/self/cgroup"), str(tmp_path / "sys/fs/cgroup"), "self")
    assert cg is not None and cg.cgroup == f"{pod}/job" and cg.available_bytes == 2 * GIB
    _v2_pod(tmp_path, pod, "max", current=10 * GIB, inactive=0)
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0, memory_cgroup="self")).sample()
    assert s.metrics["mem_available_pct"] == pytest.approx(90.0) and not s.errors


def test_cgroup_v1_without_a_namespace_reads_the_mount_root(tmp_path) -> None:
    """Docker on cgroup v1: /proc/self/cgroup names /docker/<id>, which is not under the container's mount of
    its own memory cgroup; the mount's root is that cgroup."""
    write_file(tmp_path, "proc/meminfo", MEMINFO)
    write_file(tmp_path, "proc/self/cgroup", "12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n"
                                             "0::/system.slice/containerd.service\n")
    base = "sys/fs/cgroup/memory"
    write_file(tmp_path, f"{base}/memory.limit_in_bytes", f"{8 * GIB}\n")
    write_file(tmp_path, f"{base}/memory.usage_in_bytes", f"{8 * GIB - GIB // 16}\n")
    write_file(tmp_path, f"{base}/memory.stat", V1_STAT.format(file=GIB // 32, anon=7 * GIB, limit=8 * GIB,
                                                               inactive=GIB // 32))
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0, memory_cgroup="self")).sample()
    assert s.metrics["mem_available_bytes"] == GIB // 16 + GIB // 32
    assert [e.kind for e in s.events] == ["host.memory_low"] and "cgroup /" in s.events[0].message
    # unlimited (the page-rounded 2^63-1 the kernel writes): the node's figures
    write_file(tmp_path, f"{base}/memory.limit_in_bytes", "9223372036854771712\n")
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0, memory_cgroup="self")).sample()
    assert s.metrics["mem_available_pct"] == pytest.approx(90.0) and s.events == []


def test_bad_cgroup_settings_and_files_are_named(tmp_path) -> None:
    for bad in ("kubepods.slice", "/a/../b", 3):
        with pytest.raises(DetectorConfigError, match="memory_cgroup"):
            HostConfig(memory_cgroup=bad).validate()  # type: ignore[arg-type]
    pod = "/kubepods.slice/p1"
    _v2_pod(tmp_path, pod, "lots", current=GIB, inactive=0)
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0, memory_cgroup="self")).sample()
    # the cgroup's file is a read error; the node's memory is still measured
    assert any("memory.max" in str(e) and "'lots'" in str(e) for e in s.errors)
    assert s.metrics["mem_available_pct"] == pytest.approx(90.0)
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0, memory_cgroup="/no/such")).sample()
    assert any("no cgroup '/no/such'" in str(e) for e in s.errors)


def test_this_machines_own_cgroup_is_read() -> None:
    """The real /proc/self/cgroup and /sys/fs/cgroup of the machine the tests run on (v1 or v2): a limit, when
    one is set, is at least the working set's room, and the detector samples without an error."""
    if not os.path.exists("/proc/self/cgroup") or not os.path.isdir("/sys/fs/cgroup"):
        pytest.skip("no cgroup filesystem here")
    cg = read_cgroup_memory("/proc/self/cgroup", "/sys/fs/cgroup", "self")
    if cg is not None:
        assert cg.limit_bytes > 0 and 0 <= cg.available_bytes <= cg.limit_bytes
    s = HostDetector(HostConfig(cpu_busy_pct=100.0, memory_cgroup="self")).sample()
    assert not s.errors and 0 <= s.metrics["mem_available_pct"] <= 100


def test_a_cgroup_outside_the_namespace_root_is_not_followed_out_of_the_mount(tmp_path, monkeypatch) -> None:
    """A process in a cgroup outside its cgroup namespace's root sees it in /proc/self/cgroup relative to that
    root, with '..' ('0::/../../outside/job'). That path was joined to the mount and followed: the limits of the
    folders above the mount were read as this cgroup's (here a 1 GiB memory.max at <root>/sys/outside/job made
    a 2 TiB node memory_low). Nothing outside the mount is opened now; the host detector says why the cgroup
    cannot be read and measures the node."""
    _v2_pod(tmp_path, "/kubepods.slice/p1", str(64 * GIB), current=GIB, inactive=0)
    write_file(tmp_path, "proc/self/cgroup", "0::/../../outside/job\n")
    outside = "sys/outside/job"
    write_file(tmp_path, f"{outside}/memory.max", f"{GIB}\n")
    write_file(tmp_path, f"{outside}/memory.current", f"{GIB - 4096}\n")
    write_file(tmp_path, f"{outside}/memory.stat", V2_STAT.format(anon=GIB, file=0, inactive=0))
    mount = str(tmp_path / "sys/fs/cgroup")
    opened: list[str] = []
    real_open = os.open

    def recording_open(path, *args, **kwargs):
        opened.append(os.path.realpath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording_open)
    s = HostDetector(HostConfig(root=str(tmp_path), cpu_busy_pct=100.0, memory_cgroup="self")).sample()
    monkeypatch.undo()
    assert s.events == [] and s.metrics["mem_available_pct"] == pytest.approx(90.0)
    (err,) = s.errors
    assert err.path == str(tmp_path / "proc/self/cgroup") and "outside its cgroup namespace's root" in err.reason
    assert "'/../../outside/job'" in s.detail
    assert not [p for p in opened if p.startswith(str(tmp_path / "sys")) and not p.startswith(mount + "/")]
    # the reader itself refuses a path climbing out, whoever names it
    with pytest.raises(DetectorReadError, match="leads outside"):
        read_cgroup_memory(str(tmp_path / "proc/self/cgroup"), mount, "/kubepods.slice/../../outside/job")

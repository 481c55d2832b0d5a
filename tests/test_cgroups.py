"""Cgroup drivers. v1 is exercised for real by every bubblewrap test on this host; v2 (the
default on modern hosts, absent here) is checked against a directory laid out like cgroupfs,
for what we write and what we read."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandlot import BackendUnavailable
from sandlot.backends.cgroups import CgroupDriver, CgroupLimits

LIMITS = CgroupLimits(memory_bytes=256 << 20, pids_max=128, cpu_cores=0.5)


def _fake_v2(root: Path) -> Path:
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("\n")
    return root


def test_detect_prefers_v1_controllers_on_hybrid_hosts(tmp_path: Path) -> None:
    mounts = [
        (str(tmp_path / "memory"), "cgroup", {"rw", "memory"}),
        (str(tmp_path / "pids"), "cgroup", {"rw", "pids"}),
        (str(tmp_path / "cpu"), "cgroup", {"rw", "cpu", "cpuacct"}),
        (str(tmp_path / "unified"), "cgroup2", {"rw"}),
    ]
    driver = CgroupDriver.detect(mounts)
    assert driver.version == 1
    assert driver.roots["cpuacct"] == tmp_path / "cpu"


def test_detect_v2_needs_the_controllers(tmp_path: Path) -> None:
    root = _fake_v2(tmp_path / "cg")
    assert CgroupDriver.detect([(str(root), "cgroup2", {"rw"})]).version == 2
    (root / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(BackendUnavailable, match="memory, pids and cpu"):
        CgroupDriver.detect([(str(root), "cgroup2", {"rw"})])


def test_v2_create_enables_controllers_and_writes_limits(tmp_path: Path) -> None:
    root = _fake_v2(tmp_path / "cg")
    driver = CgroupDriver(2, {"unified": root})
    # The kernel creates a cgroup's files on mkdir; here the parents need theirs up front.
    for parent in (root / "sandlot", root / "sandlot" / "inst"):
        parent.mkdir()
        (parent / "cgroup.subtree_control").write_text("\n")
    cgroup = driver.create(("sandlot", "inst", "sb-1"), LIMITS)
    leaf = root / "sandlot" / "inst" / "sb-1"
    assert (leaf / "memory.max").read_text() == str(256 << 20)
    assert (leaf / "memory.swap.max").read_text() == "0"
    assert (leaf / "pids.max").read_text() == "128"
    assert (leaf / "cpu.max").read_text() == "50000 100000"
    for parent in (root, root / "sandlot", root / "sandlot" / "inst"):
        assert (parent / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert cgroup.procs_files == [leaf / "cgroup.procs"]


def test_v2_reads_kill_counters_and_usage(tmp_path: Path) -> None:
    leaf = tmp_path / "leaf"
    leaf.mkdir()
    (leaf / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    (leaf / "pids.events").write_text("max 7\n")
    (leaf / "memory.current").write_text("1048576\n")
    (leaf / "memory.peak").write_text("2097152\n")
    (leaf / "pids.current").write_text("3\n")
    (leaf / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\n")
    cgroup = CgroupDriver(2, {"unified": tmp_path}).path("leaf")
    usage = cgroup.usage()
    assert (usage.oom_kills, usage.pids_limit_hits) == (2, 7)
    assert (usage.memory_bytes, usage.memory_peak_bytes, usage.pids) == (1 << 20, 2 << 20, 3)
    assert usage.cpu_s == 1.5


def test_v1_reads_oom_kill_from_oom_control(tmp_path: Path) -> None:
    for name in ("memory", "pids", "cpu"):
        (tmp_path / name / "sb").mkdir(parents=True)
    (tmp_path / "memory" / "sb" / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"
    )
    (tmp_path / "pids" / "sb" / "pids.events").write_text("max 5\n")
    roots = {name: tmp_path / name for name in ("memory", "pids", "cpu")}
    cgroup = CgroupDriver(1, roots).path("sb")
    assert cgroup.oom_kills() == 3
    assert cgroup.pids_limit_hits() == 5

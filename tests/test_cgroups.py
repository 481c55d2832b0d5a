"""Cgroup drivers. v1 is exercised for real by every bubblewrap test on a v1 host (the CI
machine: Debian 12, hybrid, controllers on v1). v2 ran live on an Ubuntu 24.04 host (kernel
6.18), where the same suites pass on it; on a v1 host it is checked here against a directory
laid out like cgroupfs (what we write, what we read, and the kernel's "no internal processes"
rule, emulated), and `make test` on a v2 host runs it for real."""

from __future__ import annotations

import errno
import os
import pathlib
from pathlib import Path
from typing import Any

import pytest

from sandlot import BackendUnavailable
from sandlot.backends import cgroups
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
    assert cgroup.enter_files == [leaf / "cgroup.procs"]  # v2 moves processes only there


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


class _NoInternalProcesses:
    """cgroupfs's write rules, for paths under ``ns_root``: a cgroup other than the whole
    hierarchy's root that holds processes refuses controllers for its children (EBUSY), and
    writing a pid to ``cgroup.procs`` moves it there from wherever it was."""

    def __init__(self, ns_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.ns_root = ns_root
        self.refusals = 0
        real_write = pathlib.Path.write_text

        def write_text(path: Path, data: str, *args: Any, **kwargs: Any) -> int:
            if self.ns_root not in path.parents:
                return real_write(path, data, *args, **kwargs)
            if path.name == "cgroup.subtree_control" and _procs(path.parent):
                self.refusals += 1
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(path))
            if path.name == "cgroup.subtree_control":
                data = " ".join(word.lstrip("+") for word in data.split())
            if path.name == "cgroup.procs":
                for procs in self.ns_root.rglob("cgroup.procs"):
                    kept = [p for p in _procs(procs.parent) if p != data.strip()]
                    real_write(procs, "".join(f"{p}\n" for p in kept))
                data = "".join(f"{p}\n" for p in [*_procs(path.parent), data.strip()])
            return real_write(path, data, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "write_text", write_text)


def _procs(cgroup_dir: Path) -> list[str]:
    procs = cgroup_dir / "cgroup.procs"
    return procs.read_text().split() if procs.exists() else []


def _mkcg(path: Path) -> None:
    path.mkdir()  # the kernel makes a cgroup's files on mkdir; here we make the two we use
    for name in ("cgroup.subtree_control", "cgroup.procs"):
        (path / name).touch()


def test_v2_in_a_container_moves_the_namespace_roots_processes_to_a_leaf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Docker's and Kubernetes' default on v2: our process (and the container's others) sit
    in the cgroup namespace's root, so enabling controllers for children failed with EBUSY
    for every create. They are moved into a leaf first, as docker-in-docker does."""
    root = _fake_v2(tmp_path / "cg")
    (root / "cgroup.procs").write_text("1\n42\n")
    fs = _NoInternalProcesses(tmp_path, monkeypatch)
    driver = CgroupDriver(2, {"unified": root})
    for parent in (root / "sandlot", root / "sandlot" / "inst"):
        _mkcg(parent)
    driver.create(("sandlot", "inst", "sb-1"), LIMITS)
    assert fs.refusals == 1
    assert _procs(root) == []
    assert _procs(root / cgroups.EVACUATION_LEAF) == ["1", "42"]
    for parent in (root, root / "sandlot", root / "sandlot" / "inst"):
        assert (parent / "cgroup.subtree_control").read_text() == "memory pids cpu"
    # A second create finds the controllers on and moves nothing.
    driver.create(("sandlot", "inst", "sb-2"), LIMITS)
    assert fs.refusals == 1


def test_v2_refusal_other_than_busy_names_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _fake_v2(tmp_path / "cg")

    def refuse(path: Path, data: str, *args: Any, **kwargs: Any) -> int:
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(pathlib.Path, "write_text", refuse)
    with pytest.raises(BackendUnavailable, match="SANDBOX_CGROUP_ROOT naming a cgroup delegated"):
        CgroupDriver(2, {"unified": root}).create(("sandlot", "sb"), LIMITS)


def test_probe_makes_and_removes_a_real_cgroup() -> None:
    """What `sandlot doctor` runs: a real cgroup with limits, on this host's hierarchy."""
    if os.geteuid() != 0:
        pytest.skip("making cgroups outside a delegated subtree needs root")
    driver = CgroupDriver.detect()
    detail = driver.probe("sandlot-test-probe")
    assert "made and removed a limited cgroup" in detail
    assert driver.children("sandlot-test-probe") == []
    driver.path("sandlot-test-probe").remove(0)


def test_v2_a_busy_cgroup_below_the_root_is_refused_not_emptied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the root as we see it (a container's namespace root) is ours to empty: a busy
    cgroup named below it (a systemd unit as SANDBOX_CGROUP_ROOT) keeps its processes, and
    the create fails with what to do."""
    root = _fake_v2(tmp_path / "cg")
    (root / "cgroup.procs").touch()
    _NoInternalProcesses(tmp_path, monkeypatch)
    _mkcg(root / "unit")
    (root / "unit" / "cgroup.procs").write_text("7\n")
    driver = CgroupDriver(2, {"unified": root})
    with pytest.raises(BackendUnavailable, match="cannot enable"):
        driver.create(("unit", "sb-1"), LIMITS)
    assert _procs(root / "unit") == ["7"]
    assert not (root / "unit" / cgroups.EVACUATION_LEAF).exists()


@pytest.mark.parametrize("version", [1, 2])
def test_the_memory_ceiling_is_the_lowest_limit_over_the_sandboxes_cgroups(
    tmp_path: Path, version: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a pod's sandboxes share: its own limit, or a lower one on the way down to them;
    "no limit" (v2's ``max``, v1's largest long) is none."""
    root = tmp_path / "root"
    name = "memory.limit_in_bytes" if version == 1 else "memory.max"
    unlimited = "9223372036854771712" if version == 1 else "max"
    (root / "sandlot" / "inner").mkdir(parents=True)
    (root / name).write_text(f"{1 << 30}\n")  # the pod's 1 GiB
    (root / "sandlot" / name).write_text(f"{unlimited}\n")
    (root / "sandlot" / "inner" / name).write_text(f"{512 << 20}\n")
    driver = CgroupDriver(version, {"memory" if version == 1 else "unified": root})
    monkeypatch.setattr(CgroupDriver, "detect", classmethod(lambda cls, mounts=None: driver))
    assert cgroups.memory_ceiling_mb("sandlot") == 1024
    assert cgroups.memory_ceiling_mb("sandlot/inner") == 512
    (root / name).write_text(f"{unlimited}\n")
    assert cgroups.memory_ceiling_mb("sandlot") is None

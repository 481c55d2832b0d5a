"""What the bubblewrap backend holds for each of its sandboxes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sandlot.backends.base import AttachedVolume, Guest
from sandlot.backends.bubblewrap import netns
from sandlot.backends.bubblewrap.rootless import NoCgroup
from sandlot.backends.cgroups import Cgroup
from sandlot.backends.launch import SANDBOX_UID

__all__ = ["SANDBOX_UID", "Box"]


@dataclass
class Box:
    sandbox_id: str
    root: Path
    workspace: Path
    uid: int
    uid_lock_fd: int | None  # None rootless: every sandbox has the user's uid
    cgroup: Cgroup | NoCgroup
    disk_capped: bool
    guest: Guest | None = None
    net: netns.SandboxNet | None = None
    net_lock_fd: int | None = None  # holds net's /30 host-wide while the sandbox lives
    system: Path | None = None  # the environment's tree bound as /; None: the host's /usr
    # The sandbox's own CPU quota while its guest starts under START_CPU_CORES (backend.py);
    # None once set.
    cpu_cores_after_start: float | None = None
    proc_files: str = ""  # the directory of its synthesized /proc files, with a final "/"
    # Its cgroup was seen empty with no guest started since: it stays so (only a process
    # inside can fork into it), so a destroy's stop need not read it again after its halt.
    emptied: bool = False
    # Its named volumes, attached again by every start of its guest (launching.py); once
    # they have been, a restart waits for the old guest's mounts of them to go first.
    volumes: tuple[AttachedVolume, ...] = ()
    volumes_attached: bool = False

    @property
    def tmp(self) -> Path:
        """Its /tmp on the host: beside the workspace, on the same volume (disk_paths)."""
        return self.workspace.parent / "tmp"

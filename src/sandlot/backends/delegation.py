"""A cgroup v2 subtree delegated to an ordinary user: where a non-root manager may put limits.

Two kinds exist, and both look the same from here: a directory of the unified hierarchy, with
its ``cgroup.procs`` and ``cgroup.subtree_control``, owned by the user.

- systemd's user manager with ``Delegate=yes`` (the default for ``user@UID.service``): a
  process started from it (``systemd-run --user --scope``, a user service, most desktop
  terminals) sits in ``/user.slice/user-UID.slice/user@UID.service/...``, all owned by the user;
  a login shell's ``session-N.scope`` is root's, not delegated.
- a subtree an administrator made and chowned to the user (or named in
  ``SANDBOX_CGROUP_ROOT``).

The delegated root is the highest ancestor of our own cgroup that the user still owns (the
kernel lets a process move between two cgroups only with write access to their common
ancestor, so only a subtree holding our own process is usable). cgroup v2's "no internal
processes" rule then applies: controllers reach child cgroups only from a cgroup that holds no
process itself, so :func:`prepare` moves the processes sitting in the root (ours, at least) to a
leaf, :data:`MANAGER_LEAF`, before sandbox cgroups are made beside it.
"""

from __future__ import annotations

import contextlib
import stat
from dataclasses import dataclass
from pathlib import Path

from sandlot.backends.cgroups import REQUIRED, CgroupDriver, evacuate
from sandlot.errors import BackendUnavailable

MANAGER_LEAF = "sandlot-manager"
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
PROC_SELF_MOUNTS = Path("/proc/self/mounts")
# A delegated directory's files that we write (cgroup.threads too on real systems; unused here).
DELEGATED_FILES = ("cgroup.procs", "cgroup.subtree_control")


@dataclass(frozen=True)
class Delegation:
    root: Path  # the delegated cgroup directory
    how: str  # what delegated it, for doctor and the logs
    configured: bool  # named by SANDBOX_CGROUP_ROOT (sandboxes go straight below it)


def unified_mount(mounts_file: Path = PROC_SELF_MOUNTS) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted, if it is."""
    with contextlib.suppress(OSError):
        for line in mounts_file.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "cgroup2":
                return Path(parts[1])
    return None


def own_cgroup(proc_self_cgroup: Path = PROC_SELF_CGROUP) -> str | None:
    """Our cgroup in the unified hierarchy (the ``0::/path`` line), relative to its root."""
    with contextlib.suppress(OSError):
        for line in proc_self_cgroup.read_text().splitlines():
            hierarchy, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if hierarchy == "0" and controllers == "":
                return path.strip().lstrip("/")
    return None


def _owned_writable(path: Path, uid: int) -> bool:
    """Owned by ``uid`` with the owner's write bit, the directory and the files we write.

    Ownership, not ``os.access``: root may write anywhere, but what counts is what the
    administrator (or systemd) handed to this user.
    """
    for target in (path, *(path / name for name in DELEGATED_FILES)):
        try:
            st = target.stat()
        except OSError:
            return False
        if st.st_uid != uid or not st.st_mode & stat.S_IWUSR:
            return False
    return True


def _controllers(path: Path) -> set[str]:
    try:
        return set((path / "cgroup.controllers").read_text().split())
    except OSError:
        return set()


def _configured_root(
    unified: Path, configured: str | None, own: Path | None, uid: int
) -> tuple[Path | None, str]:
    """SANDBOX_CGROUP_ROOT as a delegated root, if it is one that holds this process."""
    if not configured:
        return None, ""
    candidate = Path(configured) if configured.startswith("/") else unified / configured
    if not candidate.resolve().is_relative_to(unified.resolve()):
        return None, ""  # not a cgroup at all
    if not _owned_writable(candidate, uid):
        return None, ""
    if own is None or not own.is_relative_to(candidate):
        # Moving a process between cgroups takes write access to their common ancestor.
        return None, (
            f"; SANDBOX_CGROUP_ROOT={configured} is yours, but this process is not inside it, "
            "so no process can be moved into it (as root: echo <pid> > "
            f"{candidate}/cgroup.procs, or start sandlot from a shell placed there)"
        )
    return candidate, ""


def _systemd_hint(relative: str, uid: int) -> str:
    session = f"user.slice/user-{uid}.slice/"
    if relative.startswith(session) and f"/user@{uid}.service" not in f"/{relative}":
        return (
            "; this process is in a login session's scope, which systemd does not delegate: "
            "start it with `systemd-run --user --scope -p Delegate=yes <command>`"
        )
    return ""


def find_delegated(
    uid: int,
    *,
    configured: str | None = None,
    mounts_file: Path = PROC_SELF_MOUNTS,
    proc_self_cgroup: Path = PROC_SELF_CGROUP,
) -> tuple[Delegation | None, str]:
    """The cgroup v2 subtree delegated to ``uid`` that holds this process, and why (or why
    none): the reason is what doctor and the degraded-mode warning print."""
    unified = unified_mount(mounts_file)
    if unified is None:
        return None, "no cgroup v2 hierarchy is mounted (cgroup v1 is never delegated)"
    relative = own_cgroup(proc_self_cgroup)
    own = None if relative is None else (unified / relative if relative else unified)
    found, configured_why = _configured_root(unified, configured, own, uid)
    how = "SANDBOX_CGROUP_ROOT"
    if found is None:
        if own is None or relative is None:
            return None, f"this process is in no cgroup of {unified}"
        current = own
        while current != unified and _owned_writable(current, uid):
            found, current = current, current.parent
        if found is None:
            return None, (
                f"our cgroup /{relative} is not delegated to uid {uid}"
                f"{_systemd_hint(relative, uid)}{configured_why}"
            )
        systemd = f"user@{uid}.service"
        how = (
            "systemd user session (Delegate=yes)"
            if systemd in found.parts
            else f"a subtree chowned to uid {uid}"
        )
    missing = [c for c in REQUIRED if c not in _controllers(found)]
    if missing:
        return None, (
            f"{found} is delegated but lacks the {', '.join(missing)} controller(s); "
            "ask for them with DelegateControllers= (systemd) or enable them in its parent"
        )
    return Delegation(found, how, configured=how == "SANDBOX_CGROUP_ROOT"), f"{how}: {found}"


def prepare(delegation: Delegation) -> CgroupDriver:
    """Move the processes in the delegated root to a leaf, so controllers can be enabled for
    sandbox cgroups beside it; return a driver rooted at the delegated directory.

    Raises:
        BackendUnavailable: a process could not be moved (the error names it).
    """
    root = delegation.root
    leaf = root / MANAGER_LEAF
    try:
        evacuate(root, MANAGER_LEAF)
    except OSError as exc:
        raise BackendUnavailable(
            f"cannot move the processes of the delegated cgroup {root} into {leaf}: {exc}; "
            "controllers cannot reach sandbox cgroups while it holds processes"
        ) from exc
    return CgroupDriver(2, {"unified": root})

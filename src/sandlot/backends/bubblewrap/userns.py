"""Why unprivileged user namespaces may be refused on this host, and what the fix costs.

Read only when the probe that starts a real bwrap has failed: each finding turns its error
into a sentence with the command that fixes it. Paths are parameters so that tests can point
them at a fake ``/proc/sys`` and ``/etc/apparmor.d``.
"""

from __future__ import annotations

from pathlib import Path

PROC_SYS = Path("/proc/sys")
APPARMOR_D = Path("/etc/apparmor.d")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def bwrap_profiles(apparmor_d: Path) -> list[Path]:
    """AppArmor profiles that name bwrap (Ubuntu ships ``bwrap-userns-restrict``)."""
    found: list[Path] = []
    try:
        entries = sorted(apparmor_d.iterdir())
    except OSError:
        return found
    for entry in entries:
        if not entry.is_file():
            continue
        text = _read(entry) or ""
        if "bwrap" in entry.name or "/usr/bin/bwrap" in text:
            found.append(entry)
    return found


def userns_hint(proc_sys: Path = PROC_SYS, apparmor_d: Path = APPARMOR_D) -> str:
    """What blocks unprivileged user namespaces here and how to lift it ("" if nothing known)."""
    hints = []
    if _read(proc_sys / "kernel/apparmor_restrict_unprivileged_userns") == "1":
        profiles = bwrap_profiles(apparmor_d)
        if profiles:
            loaded = ", ".join(p.name for p in profiles)
            fix = (
                f"a bwrap profile exists ({loaded}) but did not apply: load it with "
                f"`sudo apparmor_parser -r {profiles[0]}`"
            )
        else:
            fix = (
                f"install a profile for /usr/bin/bwrap that allows `userns` in {apparmor_d} "
                "(Ubuntu's AppArmor 4 ships one as bwrap-userns-restrict) and load it with "
                f"`sudo apparmor_parser -r {apparmor_d}/bwrap-userns-restrict`"
            )
        hints.append(
            "AppArmor restricts unprivileged user namespaces "
            "(kernel.apparmor_restrict_unprivileged_userns=1, Ubuntu 23.10 and later) to "
            f"programs with a profile: {fix}; or lift the restriction for every program with "
            "`sudo sysctl kernel.apparmor_restrict_unprivileged_userns=0` (which reopens the "
            "kernel's user-namespace attack surface to any local program)"
        )
    if _read(proc_sys / "kernel/unprivileged_userns_clone") == "0":
        hints.append(
            "unprivileged user namespaces are off (kernel.unprivileged_userns_clone=0): "
            "`sudo sysctl kernel.unprivileged_userns_clone=1`"
        )
    if _read(proc_sys / "user/max_user_namespaces") == "0":
        hints.append(
            "user namespaces are capped at zero (user.max_user_namespaces=0): "
            "`sudo sysctl user.max_user_namespaces=15000`"
        )
    return "; ".join(hints)

"""Whether this host can run the bubblewrap backend: the kernel and tool features it stands on,
each with why it matters (``sandlot doctor`` prints them; the test suite skips without them).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from sandlot.backends.base import Check
from sandlot.backends.bubblewrap.seccomp import build_filter
from sandlot.backends.cgroups import CgroupDriver
from sandlot.backends.disk import loop_disks_available
from sandlot.errors import SandboxError

USERNS_PROBE_TIMEOUT_S = 20


def _bwrap_version() -> str | None:
    path = shutil.which("bwrap")
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown version"


def _userns_probe() -> tuple[bool, str]:
    """Start a real, minimal unprivileged bwrap: the only proof that user namespaces work."""
    if shutil.which("bwrap") is None or shutil.which("setpriv") is None:
        return False, "bwrap or setpriv missing"
    argv = [
        "bwrap",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "/bin/true",
    ]
    if os.geteuid() == 0:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", *argv]
    run = subprocess.run(
        argv, capture_output=True, text=True, check=False, timeout=USERNS_PROBE_TIMEOUT_S
    )
    if run.returncode == 0:
        return True, "unprivileged user + pid + net + mount namespaces start"
    return False, run.stderr.strip() or f"exit {run.returncode}"


def _seccomp() -> tuple[bool, str]:
    try:
        size = len(build_filter(False))
    except SandboxError as exc:
        return False, str(exc)
    return True, f"libseccomp filter compiles ({size} bytes of BPF)"


def _cgroups(parent: str) -> tuple[bool, str]:
    try:
        return True, CgroupDriver.detect().probe(parent)
    except SandboxError as exc:
        return False, str(exc)


def host_checks(cgroup_root: str) -> list[Check]:
    """Root, bwrap, user namespaces, cgroups, seccomp, the disk cap and setpriv."""
    root = os.geteuid() == 0
    bwrap = _bwrap_version()
    setpriv = shutil.which("setpriv")
    return [
        Check(
            "root",
            root,
            "running as root" if root else f"running as uid {os.geteuid()}",
            "the bubblewrap backend creates cgroups and gives each sandbox its own host uid",
        ),
        Check(
            "bubblewrap",
            bwrap is not None,
            bwrap or "not installed (apt-get install bubblewrap)",
            "namespaces: the sandbox sees its own processes, filesystem and (no) network",
        ),
        Check(
            "user namespaces",
            *_userns_probe(),
            "sandboxes run under an unprivileged uid; without user namespaces bwrap cannot start",
        ),
        Check(
            "cgroups",
            *_cgroups(cgroup_root),
            "memory, pids and CPU limits; without them a memory or fork bomb takes the host down",
        ),
        Check(
            "seccomp",
            *_seccomp(),
            "blocks ptrace, mount, unshare, bpf, keyctl, io_uring and non-unix sockets",
        ),
        Check(
            "disk cap",
            *loop_disks_available(),
            "caps /workspace; without it a sandbox can fill the host's disk",
            required=False,
        ),
        Check(
            "setpriv",
            setpriv is not None,
            setpriv or "missing",
            "drops from root to the sandbox's uid before bwrap starts",
        ),
    ]

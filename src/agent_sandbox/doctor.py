"""``agent-sandbox doctor``: which isolation features this host has, and why each matters."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from agent_sandbox.backends.cgroups import CgroupDriver
from agent_sandbox.backends.disk import loop_disks_available
from agent_sandbox.errors import SandboxError


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    why: str
    required: bool = True


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
    run = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=20)
    if run.returncode == 0:
        return True, "unprivileged user + pid + net + mount namespaces start"
    return False, run.stderr.strip() or f"exit {run.returncode}"


def _seccomp() -> tuple[bool, str]:
    from agent_sandbox.backends.seccomp import build_filter

    try:
        size = len(build_filter(False))
    except SandboxError as exc:
        return False, str(exc)
    return True, f"libseccomp filter compiles ({size} bytes of BPF)"


def run_checks() -> list[Check]:
    checks = []
    root = os.geteuid() == 0
    checks.append(
        Check(
            "root",
            root,
            "running as root" if root else f"running as uid {os.geteuid()}",
            "the bubblewrap backend creates cgroups and gives each sandbox its own host uid",
        )
    )
    version = _bwrap_version()
    checks.append(
        Check(
            "bubblewrap",
            version is not None,
            version or "not installed (apt-get install bubblewrap)",
            "namespaces: the sandbox sees its own processes, filesystem and (no) network",
        )
    )
    ok, detail = _userns_probe()
    checks.append(
        Check(
            "user namespaces",
            ok,
            detail,
            "sandboxes run under an unprivileged uid; without user namespaces bwrap cannot start",
        )
    )
    try:
        driver = CgroupDriver.detect()
        cg_ok, cg_detail = True, driver.describe()
    except SandboxError as exc:
        cg_ok, cg_detail = False, str(exc)
    checks.append(
        Check(
            "cgroups",
            cg_ok,
            cg_detail,
            "memory, pids and CPU limits; without them a memory or fork bomb takes the host down",
        )
    )
    ok, detail = _seccomp()
    checks.append(
        Check(
            "seccomp",
            ok,
            detail,
            "blocks ptrace, mount, unshare, bpf, keyctl, io_uring and non-unix sockets",
        )
    )
    ok, detail = loop_disks_available()
    checks.append(
        Check(
            "disk cap",
            ok,
            detail,
            "caps /workspace; without it a sandbox can fill the host's disk",
            required=False,
        )
    )
    checks.append(
        Check(
            "setpriv",
            shutil.which("setpriv") is not None,
            shutil.which("setpriv") or "missing",
            "drops from root to the sandbox's uid before bwrap starts",
        )
    )
    return checks

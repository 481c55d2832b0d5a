"""Whether this host can run the bubblewrap backend: the kernel and tool features it stands on,
each with why it matters (``sandlot doctor`` prints them; the test suite skips without them).

As root every wall is required; as an ordinary user (rootless, :mod:`.rootless`) the checks
say which walls hold in that mode and which are missing, and why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from sandlot.backends import mountns
from sandlot.backends.base import Check
from sandlot.backends.bubblewrap.rootless import (
    PRLIMIT,
    SETPRIV,
    missing_walls,
    nproc_per_namespace,
)
from sandlot.backends.bubblewrap.seccomp import build_filter
from sandlot.backends.bubblewrap.userns import userns_hint
from sandlot.backends.cgroups import CgroupDriver
from sandlot.backends.delegation import find_delegated
from sandlot.backends.disk import loop_disks_available
from sandlot.backends.rootfs import bubblewrap_mode
from sandlot.config import Settings
from sandlot.environments import load_registry
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
    root = os.geteuid() == 0
    if shutil.which("bwrap") is None or (root and shutil.which("setpriv") is None):
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
    if root:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", *argv]
    run = subprocess.run(
        argv, capture_output=True, text=True, check=False, timeout=USERNS_PROBE_TIMEOUT_S
    )
    if run.returncode == 0:
        return True, "unprivileged user + pid + net + mount namespaces start"
    failed = run.stderr.strip() or f"exit {run.returncode}"
    hint = userns_hint()
    return False, f"{failed}; {hint}" if hint else failed


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


def _common_checks() -> list[Check]:
    bwrap = _bwrap_version()
    return [
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
            "seccomp",
            *_seccomp(),
            "blocks ptrace, mount, unshare, bpf, keyctl, io_uring and non-unix sockets",
        ),
    ]


def host_checks(settings: Settings) -> list[Check]:
    """Root mode: root, bwrap, user namespaces, seccomp, cgroups, the disk cap and setpriv;
    rootless: what holds and what is missing in that mode."""
    if os.geteuid() != 0:
        return rootless_checks(settings) + environment_checks(settings)
    setpriv = shutil.which("setpriv")
    return [
        Check(
            "root",
            True,
            "running as root",
            "the bubblewrap backend creates cgroups and gives each sandbox its own host uid",
        ),
        *_common_checks(),
        Check(
            "cgroups",
            *_cgroups(settings.cgroup_root),
            "memory, pids and CPU limits; without them a memory or fork bomb takes the host down",
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
        Check(
            "network tools",
            *_network_tools(),
            "network=True makes a veth pair (ip), walls it (iptables), and deletes a sandbox's "
            "tracked flows when it ends (conntrack), or the next sandbox on its address "
            "inherits them",
            required=False,
        ),
        Check(
            "guest template",
            *_guest_template(settings),
            "each new guest is forked from an interpreter that has already imported it, "
            "instead of starting one: about a third less CPU a create (SECURITY.md)",
            required=False,
        ),
        *environment_checks(settings),
    ]


def _network_tools() -> tuple[bool, str]:
    from sandlot.backends.hostnet import CONNTRACK, IP, IPTABLES

    missing = [tool for tool in (IP, IPTABLES, CONNTRACK) if not Path(tool).is_file()]
    if missing:
        return False, f"missing {', '.join(missing)} (apt-get install iproute2 iptables conntrack)"
    return True, "ip, iptables and conntrack installed"


def _guest_template(settings: Settings) -> tuple[bool, str]:
    if not settings.guest_template:
        return False, "off (SANDBOX_GUEST_TEMPLATE=false): every guest starts afresh"
    if not mountns.supported():
        return False, "this kernel has no mount API (Linux 5.12): every guest starts afresh"
    if settings.guest_template_scope == "system":
        return True, (
            "on, one template per system for every owner (SANDBOX_GUEST_TEMPLATE_SCOPE="
            "system): tenants' sandboxes share its memory layout and hash secret"
        )
    return True, (
        f"on, one template per system and owner, at most {settings.max_guest_templates} "
        "running; a pooled sandbox forks only for the tenant of the pool's last creates"
    )


ROOTFS_WHY = (
    "the environment's own tree, bound read-only as /; without one only the default "
    "environment runs, on the host's /usr"
)


def environment_checks(settings: Settings) -> list[Check]:
    """Which system each environment's bubblewrap sandboxes get: its built tree, the host's
    /usr (the default environment, no tree yet) or none (a create fails until it is built)."""
    try:
        registry = load_registry(settings.registry_dir)
    except SandboxError as exc:
        return [Check("environments", False, exc.message, ROOTFS_WHY, required=False)]
    checks = []
    for env in registry.values():
        mode, tree = bubblewrap_mode(env, settings.rootfs_dir)
        build = f"sandlot image build {env.name}"
        if tree is not None and os.geteuid() != 0 and not os.access(tree, os.R_OK | os.X_OK):
            ok, detail = False, f"{tree} is not readable by this user"
        elif mode == "tree":
            ok, detail = True, f"rootfs mode: {tree}"
        elif mode == "host":
            ok, detail = True, f"host mode: the host's /usr (no tree yet; `{build}`)"
        else:
            ok, detail = False, f"no tree for spec {env.spec_hash()}: `{build}` (as root)"
        checks.append(Check(f"env {env.name}", ok, detail, ROOTFS_WHY, required=False))
    return checks


def rootless_checks(settings: Settings) -> list[Check]:
    """Run by an ordinary user: one uid for all sandboxes, limits from a delegated cgroup or
    rlimits, no disk cap, no network."""
    uid = os.getuid()
    delegated, why = find_delegated(uid, configured=settings.cgroup_root)
    nproc = nproc_per_namespace(os.uname().release)
    checks = [
        Check(
            "rootless",
            True,
            f"running as uid {uid}: bwrap runs unprivileged, and every sandbox of this user "
            "shares this one host uid (65534 inside)",
            "sandboxes are kept from each other and from your files by their pid and mount "
            "namespaces, not by uids; a kernel escape from them lands in this account",
            required=False,
        ),
        *_common_checks(),
        # In every rootless mode: prlimit sets RLIMIT_FSIZE (and, with no cgroup, the rest);
        # setpriv ties bwrap to the manager with a death signal.
        *(
            Check(
                name,
                shutil.which(path) is not None,
                path if shutil.which(path) else "missing (apt-get install util-linux)",
                why,
            )
            for name, path, why in (
                ("prlimit", PRLIMIT, "sets the rlimits inside each sandbox before the guest"),
                ("setpriv", SETPRIV, "kills a sandbox's bwrap when the manager dies"),
            )
        ),
    ]
    if delegated is not None:
        checks.append(
            Check(
                "cgroups",
                True,
                f"delegated cgroup v2 subtree, {why}",
                "memory, pids and CPU limits per sandbox, and the kill_reason of a limit hit",
            )
        )
        return [*checks, *_rootless_gaps()]
    missing = "; ".join(missing_walls(nproc=nproc))
    checks += [
        Check(
            "cgroups",
            False,
            f"none delegated ({why}); rlimits instead, missing: {missing}",
            "without a cgroup, memory is capped per process and CPU not at all "
            "(SANDBOX_REQUIRE_LIMITS=true makes this an error)",
            required=settings.require_limits,
        ),
        Check(
            "pids cap",
            nproc,
            f"RLIMIT_NPROC set inside each sandbox's user namespace counts that sandbox alone "
            f"(Linux {os.uname().release})"
            if nproc
            else "this kernel (before 5.14) counts RLIMIT_NPROC for all your processes: no cap",
            "a fork bomb stops at the sandbox's pids limit",
            required=False,
        ),
    ]
    return [*checks, *_rootless_gaps()]


def _rootless_gaps() -> list[Check]:
    return [
        Check(
            "disk cap",
            False,
            "needs root (a loop-mounted image): the workspace is a plain directory, and "
            "RLIMIT_FSIZE bounds each file to the disk limit, not the workspace",
            "caps /workspace; without it a sandbox can fill your disk",
            required=False,
        ),
        Check(
            "network",
            False,
            "network=True needs root (a veth pair into the sandbox's own network namespace); "
            "rootless it is refused, never the host's namespace",
            "sandboxes that ask for a network",
            required=False,
        ),
    ]

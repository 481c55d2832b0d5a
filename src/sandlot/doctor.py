"""``sandlot doctor``: which isolation features this host has, and why each matters."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from sandlot.backends.cgroups import CgroupDriver
from sandlot.backends.disk import loop_disks_available
from sandlot.errors import SandboxError


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
    from sandlot.backends.seccomp import build_filter

    try:
        size = len(build_filter(False))
    except SandboxError as exc:
        return False, str(exc)
    return True, f"libseccomp filter compiles ({size} bytes of BPF)"


def run_checks(*, optional: bool = False) -> list[Check]:
    """The host's isolation features; with ``optional``, also docker, gVisor, images and the
    local model (slower: it asks dockerd and loads llama.cpp)."""
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
    if optional:
        checks += _docker_checks() + _agent_checks()
    return checks


def _docker_checks() -> list[Check]:
    """The optional docker backend: the daemon, gVisor, and each environment's image."""
    try:
        from sandlot.backends.dockerd import connect

        client = connect()
    except (SandboxError, ImportError) as exc:
        detail = str(exc) if isinstance(exc, SandboxError) else "pip install 'sandlot[docker]'"
        return [Check("docker", False, detail, DOCKER_WHY, required=False)]
    checks = []
    try:
        info = client.info()
        runtimes = sorted(info.get("Runtimes", {}))
        checks.append(
            Check(
                "docker",
                True,
                f"dockerd {info.get('ServerVersion', '?')}, runtimes: {' '.join(runtimes)}",
                DOCKER_WHY,
                required=False,
            )
        )
        runsc = "runsc" in runtimes
        checks.append(
            Check(
                "gVisor (runsc)",
                runsc,
                "registered with docker" if runsc else "not registered: make docker-setup",
                "runtime=runsc: the sandbox's syscalls go to gVisor's own kernel, not the host's",
                required=False,
            )
        )
        from sandlot.config import get_settings
        from sandlot.environments import load_registry
        from sandlot.images import image_status

        for env in load_registry(get_settings().registry_dir).values():
            status = image_status(env, client)
            built = "current" if status.current else ("stale" if status.present else "missing")
            checks.append(
                Check(
                    f"image {env.name}",
                    status.current,
                    f"{env.image}: {built}" + ("" if status.current else " (make image)"),
                    "docker sandboxes of this environment start from this image",
                    required=False,
                )
            )
    except Exception as exc:  # a daemon that answers badly is a finding, not a crash
        checks.append(Check("docker", False, repr(exc), DOCKER_WHY, required=False))
    finally:
        client.close()
    return checks


def _agent_checks() -> list[Check]:
    """The optional agent layer's local model: llama.cpp and the fetched weights."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return [
            Check(
                "local model",
                False,
                "llama-cpp-python missing: pip install 'sandlot[local]'",
                LOCAL_WHY,
                required=False,
            )
        ]
    from sandlot.agent.config import get_agent_settings
    from sandlot.agent.weights import is_fetched, model_path

    settings = get_agent_settings()
    if settings.local_model_path is not None:
        ok = settings.local_model_path.is_file()
        return [Check("local model", ok, str(settings.local_model_path), LOCAL_WHY, False)]
    name = settings.local_model
    try:
        fetched = is_fetched(name, settings.models_dir)
        detail = (
            str(model_path(name, settings.models_dir))
            if fetched
            else (f"{name} not fetched: make models")
        )
    except SandboxError as exc:
        fetched, detail = False, str(exc)
    return [Check("local model", fetched, detail, LOCAL_WHY, required=False)]


DOCKER_WHY = "backend=docker: a container per sandbox (optional; bubblewrap needs no daemon)"
LOCAL_WHY = "LLM_PROVIDER=local: the agent writes code with no network and no key"

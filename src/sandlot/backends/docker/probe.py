"""Whether this host can run the docker backend: a daemon that answers, the OCI runtime asked
for, and each environment's image (one API call each: slower than bubblewrap's checks, which
is why only ``sandlot doctor`` and docker test runs ask)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from sandlot.backends.base import Check
from sandlot.backends.docker.dockerd import RUNTIMES, connect
from sandlot.backends.docker.images import image_status
from sandlot.config import Settings
from sandlot.environments import get_environment, load_registry
from sandlot.errors import SandboxError

if TYPE_CHECKING:
    import docker

DOCKER_WHY = "backend=docker: a container per sandbox (optional; bubblewrap needs no daemon)"
# runtime -> (row name, why it matters)
RUNTIME_ROWS = {
    "runc": ("runc", "runtime=runc: the container shares the host's kernel, behind namespaces"),
    "runsc": (
        "gVisor (runsc)",
        "runtime=runsc: the sandbox's syscalls go to gVisor's own kernel, not the host's",
    ),
}


def daemon_checks(settings: Settings, runtime: str | None = None) -> list[Check]:
    """The daemon, the runtime (``runtime``, else the settings' default) and every
    environment's image; gVisor and the images of other environments are reported, not
    required."""
    try:
        client = connect()
    except SandboxError as exc:
        return [Check("docker", False, exc.message, DOCKER_WHY)]
    with contextlib.closing(client):
        try:
            return _checks(client, settings, runtime or settings.docker_runtime)
        except Exception as exc:  # a daemon that answers badly is a finding, not a crash
            return [Check("docker", False, repr(exc), DOCKER_WHY)]


def _checks(client: docker.DockerClient, settings: Settings, wanted: str) -> list[Check]:
    info = client.info()
    registered = sorted(info.get("Runtimes") or {})
    checks = [
        Check(
            "docker",
            True,
            f"dockerd {info.get('ServerVersion', '?')}, runtimes: {' '.join(registered)}",
            DOCKER_WHY,
        )
    ]
    if wanted not in RUNTIMES:
        known = ", ".join(sorted(RUNTIMES))
        checks.append(Check(wanted, False, f"unknown runtime; choose one of: {known}", ""))
    # gVisor is always reported: it is the docker backend's stronger wall, and not standard.
    for runtime in sorted({wanted, "runsc"} & RUNTIMES):
        name, why = RUNTIME_ROWS[runtime]
        ok = runtime in registered
        detail = "registered with docker" if ok else "not registered: make docker-setup"
        checks.append(Check(name, ok, detail, why, required=runtime == wanted))
    default_env = get_environment(settings.environment, settings.registry_dir).name
    for env in load_registry(settings.registry_dir).values():
        status = image_status(env, client)
        built = "current" if status.current else ("stale" if status.present else "missing")
        checks.append(
            Check(
                f"image {env.name}",
                status.current,
                f"{env.image}: {built}" + ("" if status.current else " (make image)"),
                "docker sandboxes of this environment start from this image",
                required=env.name == default_env,
            )
        )
    return checks

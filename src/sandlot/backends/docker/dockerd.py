"""Reaching the Docker Engine: one place that turns "no SDK" or "no daemon" into a clear error.

We use docker-py (the ``docker`` package, Docker's own SDK) rather than aiodocker: lifecycle
calls are a handful per sandbox and dominated by the container start itself, so running the
synchronous SDK in a thread costs nothing measurable, and its hijacked exec socket gives the
guest's stdio without a ``docker`` CLI process (25 MB RSS each) per sandbox.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from sandlot.errors import BackendUnavailable

if TYPE_CHECKING:
    import docker
    from docker.models.containers import Container

LABEL = "sandlot"  # every container and image we make carries it
LABEL_INSTANCE = "sandlot.instance"  # which data directory (server) owns the container
LABEL_SANDBOX = "sandlot.sandbox"
LABEL_ENVIRONMENT = "sandlot.environment"
LABEL_SPEC = "sandlot.spec"
RUNTIMES = frozenset({"runc", "runsc"})  # the OCI runtimes a docker sandbox may ask for
# Where docker-py looks when DOCKER_HOST is not set.
DEFAULT_HOST = "unix:///var/run/docker.sock"
API_TIMEOUT_S = 60
DAEMON_HINT = (
    "start the Docker daemon (`dockerd &`, or `make docker-setup`), or set DOCKER_HOST to a "
    "reachable one"
)


def connect() -> docker.DockerClient:
    """A client of the daemon named by DOCKER_HOST (default: the local socket), checked live.

    Raises:
        BackendUnavailable: the SDK is not installed or the daemon does not answer.
    """
    try:
        import docker  # optional dependency, imported only when used
    except ImportError as exc:
        raise BackendUnavailable(
            "the docker backend needs the Docker SDK: pip install 'sandlot[docker]'"
        ) from exc
    host = os.environ.get("DOCKER_HOST") or DEFAULT_HOST
    if host.startswith("unix://"):
        _knock(host.removeprefix("unix://"))
    client = None
    try:
        client = docker.from_env(timeout=API_TIMEOUT_S)
        client.ping()
    except docker.errors.DockerException as exc:
        if client is not None:
            client.close()
        raise BackendUnavailable(
            f"the Docker daemon is not reachable ({exc}); {DAEMON_HINT}"
        ) from exc
    return client


def _knock(socket_path: str) -> None:
    """Connect to the daemon's socket once, and close it.

    Where nothing answers there (no docker installed, a daemon stopped, a socket this user may
    not open), docker-py's own connect fails the same way but leaves its socket open, one per
    look: a ResourceWarning, and an error under the test suite's warnings filter on any
    machine without docker.

    Raises:
        BackendUnavailable: the socket cannot be connected to.
    """
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(API_TIMEOUT_S)
            probe.connect(socket_path)
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise BackendUnavailable(
            f"the Docker daemon is not reachable ({socket_path}: {why}); {DAEMON_HINT}"
        ) from exc


def labelled(client: docker.DockerClient, labels: list[str]) -> list[Container]:
    """Every container (running or not) carrying all ``labels``, each inspected.

    docker-py's ``containers.list`` inspects each listed container and raises NotFound when one
    is removed between the list and its inspect; another sandbox's stop or a crashed server's
    sweep does exactly that, so a container gone by then is simply not in the answer.
    """
    import docker  # optional dependency, imported only when used

    found: list[Container] = []
    for sparse in client.containers.list(all=True, sparse=True, filters={"label": labels}):
        if sparse.id is None:
            continue
        try:
            found.append(client.containers.get(sparse.id))
        except docker.errors.NotFound:
            continue
    return found

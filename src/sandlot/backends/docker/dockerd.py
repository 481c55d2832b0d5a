"""Reaching the Docker Engine: one place that turns "no SDK" or "no daemon" into a clear error.

We use docker-py (the ``docker`` package, Docker's own SDK) rather than aiodocker: lifecycle
calls are a handful per sandbox and dominated by the container start itself, so running the
synchronous SDK in a thread costs nothing measurable, and its hijacked exec socket gives the
guest's stdio without a ``docker`` CLI process (25 MB RSS each) per sandbox.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from sandlot.backends.base import instance_dead
from sandlot.errors import BackendUnavailable

if TYPE_CHECKING:
    import docker
    from docker.models.containers import Container

LABEL = "sandlot"  # every container and image we make carries it
LABEL_INSTANCE = "sandlot.instance"  # which data directory (server) owns the container
# Its manager's instance directory: how any manager on the host tells a dead one's containers.
LABEL_INSTANCE_DIR = "sandlot.instance_dir"
LABEL_SANDBOX = "sandlot.sandbox"
LABEL_ENVIRONMENT = "sandlot.environment"
LABEL_SPEC = "sandlot.spec"
RUNTIMES = frozenset({"runc", "runsc"})  # the OCI runtimes a docker sandbox may ask for
# docker-py's name for a unix socket's URL (parse_host's answer)
_UNIX_URL = "http+unix://"
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
    path = daemon_socket()  # first: it also says so where the SDK is missing
    import docker

    if path is not None:
        _knock(path)
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


def _require_sdk() -> None:
    """Check that the ``docker`` package (an optional dependency, imported only where used)
    is installed.

    Raises:
        BackendUnavailable: it is not.
    """
    try:
        import docker  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(
            "the docker backend needs the Docker SDK: pip install 'sandlot[docker]'"
        ) from exc


def daemon_socket() -> str | None:
    """The unix socket docker-py reaches for DOCKER_HOST (its own reading of it: unset or
    empty is the default socket, ``unix://`` alone too, a relative path is made absolute),
    or None where the daemon is not on a unix socket (tcp://, ssh://).

    Raises:
        BackendUnavailable: the SDK is not installed, or DOCKER_HOST is not an address.
    """
    _require_sdk()
    import docker.errors
    import docker.utils

    try:
        parsed = docker.utils.parse_host(os.environ.get("DOCKER_HOST") or "")
    except docker.errors.DockerException as exc:
        raise BackendUnavailable(f"DOCKER_HOST is not an address docker can use: {exc}") from exc
    base_url = parsed.decode() if isinstance(parsed, bytes) else parsed  # typed str | bytes
    if not base_url.startswith(_UNIX_URL):
        return None
    path = base_url.removeprefix(_UNIX_URL)
    return path if path.startswith("/") else "/" + path  # as docker-py's UnixHTTPAdapter


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
        hint = (
            "this user may not open it: add the user to the docker group, or set DOCKER_HOST "
            "to a socket it may open"
            if exc.errno == errno.EACCES
            else DAEMON_HINT
        )
        raise BackendUnavailable(
            f"the Docker daemon is not reachable ({socket_path}: {why}); {hint}"
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


def reap_abandoned(client: docker.DockerClient, own_dir: Path) -> list[str]:
    """Remove every container whose manager is known dead (:func:`instance_dead`) from any
    data directory but ``own_dir`` (ours, whose dead instances recovery already sweeps);
    return the sandbox ids removed.

    A killed manager's containers run on (nobody tells Docker), each holding its memory,
    CPU share, processes and uid until a manager starts on that data directory again, which
    may be never. Only the containers go: the dead instance's records, volumes and artifacts
    wait for its own data directory's recovery, which finds the containers gone. A daemon
    that is not on this host (``DOCKER_HOST`` over TCP) is left alone: its paths are not ours.
    """
    import docker.errors  # optional dependency

    if os.environ.get("DOCKER_HOST", "unix://").split("://", 1)[0] != "unix":
        return []
    listed = client.containers.list(all=True, sparse=True, filters={"label": [LABEL]})
    by_dir: dict[str, list[tuple[str, str]]] = {}  # instance dir -> (container, sandbox)
    for container in listed:
        labels = container.attrs.get("Labels") or {}
        where = labels.get(LABEL_INSTANCE_DIR)
        if container.id is not None and where and Path(where) != own_dir:
            by_dir.setdefault(where, []).append((container.id, labels.get(LABEL_SANDBOX, "?")))
    removed: list[str] = []
    for where, containers in by_dir.items():
        if not instance_dead(Path(where)):
            continue
        for container_id, sandbox_id in containers:
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_container(container_id, force=True)
                removed.append(sandbox_id)
    return removed

"""Reaching the Docker daemon where there is none (backends/docker/dockerd.py): a clear
BackendUnavailable, and nothing left open. Runs on every machine, docker or not."""

from __future__ import annotations

import errno
import gc
import socket
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot.backends.docker import dockerd
from sandlot.errors import BackendUnavailable


def _connect_leaving_nothing_open() -> str:
    """The message of the error ``connect()`` raised, checked to have left no socket for the
    collector. The exception itself is dropped first: its traceback holds the frames that
    would hold such a socket, which would stay alive (and unreported) with it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(BackendUnavailable) as raised:
            dockerd.connect()
        message = str(raised.value)
        del raised
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not unclosed
    return message


def test_no_socket_is_a_clear_error_and_opens_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # docker-py tried the missing socket itself and left its failed socket open: on a
    # machine without docker, a ResourceWarning per look, and so an error in this suite.
    missing = tmp_path / "docker.sock"
    monkeypatch.setenv("DOCKER_HOST", f"unix://{missing}")
    error = _connect_leaving_nothing_open()
    assert str(missing) in error and "No such file" in error
    assert "make docker-setup" in error  # what to do about it


def test_a_socket_nobody_listens_on_is_a_clear_error_and_opens_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A daemon that stopped leaves its socket file behind: connections are refused.
    stale = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(str(stale))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{stale}")
    error = _connect_leaving_nothing_open()
    assert "Connection refused" in error


@pytest.fixture
def not_docker(tmp_path: Path) -> Iterator[Path]:
    """A unix socket whose server reads the request and hangs up without an answer."""
    path = tmp_path / "docker.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        thread.join(timeout=5)


def test_a_socket_that_is_not_docker_is_a_clear_error_and_opens_nothing(
    not_docker: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", f"unix://{not_docker}")
    error = _connect_leaving_nothing_open()
    assert "not reachable" in error


@pytest.mark.parametrize(
    ("host", "socket_path"),
    [
        ("", "/var/run/docker.sock"),  # set but empty: docker-py's default
        ("unix://", "/var/run/docker.sock"),
        ("unix:///srv/docker.sock", "/srv/docker.sock"),
        ("unix://srv/docker.sock", "/srv//docker.sock"),  # docker-py makes it absolute
        (" unix:///srv/docker.sock/ ", "/srv/docker.sock"),
        ("tcp://10.0.0.1:2375", None),  # not a unix socket: no knock, docker-py's own look
        ("ssh://me@build-host", None),
    ],
)
def test_the_socket_knocked_on_is_the_one_docker_py_uses(
    host: str, socket_path: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DOCKER_HOST", host)
    assert dockerd.daemon_socket() == socket_path


def test_a_host_docker_cannot_use_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "bogus://x")
    with pytest.raises(BackendUnavailable, match="DOCKER_HOST is not an address"):
        dockerd.connect()


def test_a_socket_this_user_may_not_open_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user outside the docker group: the advice is the group, not starting a daemon.
    def refuse(self: socket.socket, address: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'docker.sock'}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    with pytest.raises(BackendUnavailable, match=r"Permission denied.*docker group"):
        dockerd.connect()

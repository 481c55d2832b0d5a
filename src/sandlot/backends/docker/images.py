"""Build an environment's Docker image offline: debootstrap from Debian's mirror, docker import.

No image registry is reachable from the machines we target, so ``docker pull`` is not an
option. An image is rebuilt only when its YAML changes (its spec hash is an image label);
downloaded .debs are kept under ``<data_dir>/build/debs`` so a rebuild on the same machine
does not download them again. The guest agent is not in the image: the backend bind-mounts
it (see :mod:`sandlot.backends.launch`), so an image need not be rebuilt when the guest changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sandlot.backends.docker.dockerd import (
    LABEL,
    LABEL_ENVIRONMENT,
    LABEL_SPEC,
    connect,
)
from sandlot.backends.launch import GUEST_DIR_INSIDE, WORKSPACE_INSIDE
from sandlot.environments import Environment
from sandlot.errors import BackendUnavailable, ImageBuildError

if TYPE_CHECKING:
    import docker

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ImageStatus:
    environment: str
    image: str
    present: bool
    current: bool  # built from the YAML as it is now
    size_mb: float | None = None


def image_status(env: Environment, client: docker.DockerClient | None = None) -> ImageStatus:
    """Whether ``env``'s image exists in the daemon, and whether it matches its YAML."""
    import docker  # optional dependency

    if client is None:
        with contextlib.closing(connect()) as own:
            return image_status(env, own)
    try:
        image = client.images.get(env.image)
    except docker.errors.ImageNotFound:
        return ImageStatus(env.name, env.image, present=False, current=False)
    labels = image.labels or {}
    size = image.attrs.get("Size")
    return ImageStatus(
        env.name,
        env.image,
        present=True,
        current=labels.get(LABEL_SPEC) == env.spec_hash(),
        size_mb=round(size / 1e6, 1) if isinstance(size, int) else None,
    )


def _run(argv: list[str], progress: Progress) -> None:
    progress("$ " + " ".join(argv))
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise ImageBuildError(f"{argv[0]} failed with exit code {done.returncode}: {tail}")


def build_image(
    env: Environment, data_dir: Path, *, force: bool = False, progress: Progress = print
) -> ImageStatus:
    """Build and tag ``env.image`` unless an image of the same spec is already there.

    Raises:
        BackendUnavailable: not root, debootstrap missing, or no Docker daemon.
        ImageBuildError: a step of the build failed (its output is in the message).
    """
    with contextlib.closing(connect()) as client:
        return _build(env, data_dir, client, force=force, progress=progress)


def _build(
    env: Environment,
    data_dir: Path,
    client: docker.DockerClient,
    *,
    force: bool,
    progress: Progress,
) -> ImageStatus:
    status = image_status(env, client)
    if status.current and not force:
        progress(f"{env.image} is up to date (spec {env.spec_hash()}); --force rebuilds it")
        return status
    if os.geteuid() != 0:
        raise BackendUnavailable("building an image runs debootstrap, which needs root")
    if shutil.which("debootstrap") is None:
        raise BackendUnavailable("debootstrap is missing: apt-get install -y debootstrap")
    build_dir = data_dir / "build"
    debs = build_dir / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"{env.name}-", dir=build_dir))
    tarball = root.with_suffix(".tar")
    try:
        _run(
            [
                "debootstrap",
                f"--variant={env.variant}",
                f"--include={','.join(env.packages)}",
                f"--cache-dir={debs}",
                env.suite,
                str(root),
                env.mirror,
            ],
            progress,
        )
        # Mount points the container needs on a read-only root, and no package caches.
        for inside in (WORKSPACE_INSIDE, GUEST_DIR_INSIDE):
            (root / inside.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for item in (root / cache).glob("*"):
                if item.is_file():
                    item.unlink()
        _run(["tar", "-C", str(root), "--numeric-owner", "-cf", str(tarball), "."], progress)
        repository, _, tag = env.image.rpartition(":")
        progress(f"importing into Docker as {env.image}")
        client.api.import_image_from_file(
            str(tarball),
            repository=repository or env.image,
            tag=tag if repository else "latest",
            changes=[
                f"LABEL {LABEL}=1",
                f"LABEL {LABEL_ENVIRONMENT}={env.name}",
                f"LABEL {LABEL_SPEC}={env.spec_hash()}",
                "ENV LANG=C.UTF-8 PATH=/usr/local/bin:/usr/bin:/bin",
                f"WORKDIR {WORKSPACE_INSIDE}",
                "USER 65534:65534",
                'CMD ["/bin/sh"]',
            ],
        )
    finally:
        with contextlib.suppress(FileNotFoundError):
            tarball.unlink()
        shutil.rmtree(root, ignore_errors=True)
    status = image_status(env, client)
    if not status.current:
        raise ImageBuildError(f"{env.image} was imported but does not carry the expected label")
    progress(f"built {env.image} ({status.size_mb} MB)")
    return status


async def ensure_image(env: Environment, client: docker.DockerClient) -> None:
    """Raise a clear error if ``env``'s image is missing (we never build on a create call).

    Raises:
        BackendUnavailable: the image is not built.
    """
    status = await asyncio.to_thread(image_status, env, client)
    if not status.present:
        raise BackendUnavailable(
            f"the image {env.image} of environment {env.name!r} is not built; run "
            f"`sandlot image build {env.name}` (or `make image`)"
        )

"""An environment's Docker image: its root file system tree (:mod:`sandlot.backends.rootfs`,
debootstrapped offline from Debian's mirror), imported as it is.

No image registry is reachable from the machines we target, so ``docker pull`` is not an
option. The image carries the tree's spec hash and build id as labels: it is re-imported only
when the tree changed, and bubblewrap and docker sandboxes of one environment run the same
bits. The guest agent is not in the image: the backend bind-mounts
it (see :mod:`sandlot.backends.launch`), so an image need not be rebuilt when the guest changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
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
from sandlot.backends.launch import WORKSPACE_INSIDE
from sandlot.backends.rootfs import TreeStatus, build_tree
from sandlot.environments import Environment
from sandlot.errors import BackendUnavailable, ImageBuildError

if TYPE_CHECKING:
    import docker

Progress = Callable[[str], None]
LABEL_TREE = "sandlot.tree"  # the root file system build (backends/rootfs.py) it came from


@dataclass(frozen=True)
class ImageStatus:
    environment: str
    image: str
    present: bool
    current: bool  # built from the YAML as it is now
    tree_build: str | None = None  # the root file system build it was imported from
    size_mb: float | None = None


def image_status(
    env: Environment, client: docker.DockerClient | None = None, tree_build: str | None = None
) -> ImageStatus:
    """Whether ``env``'s image exists in the daemon, and whether it matches its YAML (and,
    given ``tree_build``, was imported from that build of its root file system tree)."""
    import docker  # optional dependency

    if client is None:
        with contextlib.closing(connect()) as own:
            return image_status(env, own, tree_build)
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
        current=labels.get(LABEL_SPEC) == env.spec_hash()
        and (tree_build is None or labels.get(LABEL_TREE) == tree_build),
        tree_build=labels.get(LABEL_TREE),
        size_mb=round(size / 1e6, 1) if isinstance(size, int) else None,
    )


def build_image(
    env: Environment,
    data_dir: Path,
    rootfs_dir: Path,
    *,
    force: bool = False,
    progress: Progress = print,
) -> ImageStatus:
    """Import ``env``'s root file system tree (built first if needed) as ``env.image``,
    unless the image already holds that very build of the tree.

    Raises:
        BackendUnavailable: not root, debootstrap missing, or no Docker daemon.
        ImageBuildError: a step of the build failed (its output is in the message).
    """
    tree = build_tree(env, rootfs_dir, data_dir / "build" / "debs", force=force, progress=progress)
    with contextlib.closing(connect()) as client:
        return import_tree(env, tree, data_dir, client, progress=progress)


def import_tree(
    env: Environment,
    tree: TreeStatus,
    data_dir: Path,
    client: docker.DockerClient,
    *,
    progress: Progress = print,
) -> ImageStatus:
    status = image_status(env, client, tree.build_id)
    if status.current:
        progress(f"{env.image} holds tree build {tree.build_id}: up to date")
        return status
    build_dir = data_dir / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"{env.name}-", suffix=".tar", dir=build_dir)
    os.close(fd)
    tarball = Path(name)
    try:
        argv = ["tar", "-C", str(tree.path), "--numeric-owner", "-cf", str(tarball), "."]
        progress("$ " + " ".join(argv))
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ImageBuildError(f"tar failed: {done.stderr.strip()[-2000:]}")
        repository, _, tag = env.image.rpartition(":")
        progress(f"importing {tree.path} into Docker as {env.image}")
        client.api.import_image_from_file(
            str(tarball),
            repository=repository or env.image,
            tag=tag if repository else "latest",
            changes=[
                f"LABEL {LABEL}=1",
                f"LABEL {LABEL_ENVIRONMENT}={env.name}",
                f"LABEL {LABEL_SPEC}={env.spec_hash()}",
                f"LABEL {LABEL_TREE}={tree.build_id}",
                "ENV LANG=C.UTF-8 PATH=/usr/local/bin:/usr/bin:/bin",
                f"WORKDIR {WORKSPACE_INSIDE}",
                "USER 65534:65534",
                'CMD ["/bin/sh"]',
            ],
        )
    finally:
        tarball.unlink(missing_ok=True)
    status = image_status(env, client, tree.build_id)
    if not status.current:
        raise ImageBuildError(f"{env.image} was imported but does not carry the expected labels")
    progress(f"imported {env.image} ({status.size_mb} MB)")
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

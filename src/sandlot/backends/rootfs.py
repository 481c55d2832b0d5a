"""The root file system store: one tree per environment and spec hash, built once, kept.

``sandlot image build`` debootstraps an environment (the .deb cache under
``<data_dir>/build/debs`` is reused), installs its ``pip:`` requirements into it, and renames
it into ``SANDBOX_ROOTFS_DIR/<name>-<spec hash>``. bubblewrap binds that tree read-only as a
sandbox's ``/``; docker imports the very same tree as the environment's image, so both run
identical bits. The store is machine-wide (never under a per-run data dir), root-owned and
only ever read by sandboxes.

Atomic: a tree is built under a ``.build-*`` name and renamed into place once complete, with
its marker (:data:`MARKER`) written last; a directory without the marker is never used. Builds
hold a lock on the store, and a build first removes what a crashed one left.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from sandlot.backends.launch import GUEST_DIR_INSIDE, WORKSPACE_INSIDE, identity_files
from sandlot.environments import HOST_ENVIRONMENT, Environment
from sandlot.errors import BackendUnavailable, ImageBuildError

Progress = Callable[[str], None]

MARKER = ".sandlot-tree.json"  # at the tree's root, written last: the tree is complete
BUILDING_PREFIX = ".build-"
OLD_PREFIX = ".old-"  # a replaced tree a live sandbox may still run on
# Mount points bubblewrap binds files onto: on a read-only root they must already exist.
ETC_MOUNT_POINTS = ("hosts", "nsswitch.conf", "passwd", "group", "resolv.conf", "gai.conf")
_TREE_NAME = re.compile(r"^(?P<env>.+)-(?P<spec>[0-9a-f]{16})$")


@dataclass(frozen=True)
class TreeStatus:
    environment: str
    path: Path  # where the current spec's tree is (or would be)
    present: bool  # the current spec's tree is built
    stale: tuple[Path, ...] = ()  # trees of an older spec of this environment
    build_id: str | None = None  # which build: a docker image imported from it carries it
    size_mb: float | None = None
    python: str | None = None  # the tree's CPython, "3.11"


def tree_path(env: Environment, rootfs_dir: Path) -> Path:
    return rootfs_dir / f"{env.name}-{env.spec_hash()}"


def read_marker(tree: Path) -> dict[str, object] | None:
    try:
        data = json.loads((tree / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def find_tree(env: Environment, rootfs_dir: Path) -> Path | None:
    """The built tree of ``env`` as its YAML is now, or None (one stat: called per create)."""
    path = tree_path(env, rootfs_dir)
    return path if (path / MARKER).is_file() else None


def tree_status(env: Environment, rootfs_dir: Path) -> TreeStatus:
    path = tree_path(env, rootfs_dir)
    stale: list[Path] = []
    with contextlib.suppress(OSError):
        for other in sorted(rootfs_dir.iterdir()):
            match = _TREE_NAME.match(other.name)
            if other != path and match and match["env"] == env.name:
                stale.append(other)
    marker = read_marker(path)
    if marker is None:
        return TreeStatus(env.name, path, present=False, stale=tuple(stale))
    size = marker.get("size_mb")
    return TreeStatus(
        env.name,
        path,
        present=True,
        stale=tuple(stale),
        build_id=str(marker.get("build_id")),
        size_mb=float(size) if isinstance(size, int | float) else None,
        python=str(marker.get("python")),
    )


def carries_identity(tree: Path) -> bool:
    """Whether ``tree``'s /etc holds this version's :func:`identity_files` (a tree built
    before them has the distribution's: bubblewrap binds ours over those). Read once per tree
    as built (its inode and mtime: a rebuild puts a new one at the same path)."""
    try:
        st = tree.stat()
    except OSError:
        return False
    return _carries_identity(tree, st.st_ino, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _carries_identity(tree: Path, _ino: int, _mtime_ns: int) -> bool:
    for name, content in identity_files().items():
        path = tree / "etc" / name
        try:
            if path.is_symlink() or path.read_text() != content:
                return False
        except (OSError, UnicodeDecodeError):
            return False
    return True


def bubblewrap_mode(env: Environment, rootfs_dir: Path) -> tuple[str, Path | None]:
    """How a bubblewrap sandbox of ``env`` gets its system: ("tree", path), ("host", None)
    for the default environment without a tree (the host's /usr), or ("missing", None)."""
    tree = find_tree(env, rootfs_dir)
    if tree is not None:
        return "tree", tree
    if env.name == HOST_ENVIRONMENT:
        return "host", None
    return "missing", None


def missing_tree_error(env: Environment) -> BackendUnavailable:
    return BackendUnavailable(
        f"environment {env.name!r} has no built root file system tree for its current "
        f"spec ({env.spec_hash()}); run `sandlot image build {env.name}` (or `make image`) "
        "as root: sandboxes never build on create"
    )


def _run(argv: list[str], progress: Progress, *, env: dict[str, str] | None = None) -> None:
    progress("$ " + " ".join(argv))
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-2000:]
        raise ImageBuildError(f"{argv[0]} failed with exit code {done.returncode}: {tail}")


@contextlib.contextmanager
def _store_lock(rootfs_dir: Path) -> Iterator[None]:
    fd = os.open(rootfs_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def build_tree(
    env: Environment,
    rootfs_dir: Path,
    debs_dir: Path,
    *,
    force: bool = False,
    progress: Progress = print,
) -> TreeStatus:
    """Build ``env``'s tree unless the current spec's is there; remove older specs' trees.

    Raises:
        BackendUnavailable: not root, or debootstrap missing.
        ImageBuildError: a step failed (its output is in the message).
    """
    status = tree_status(env, rootfs_dir)
    if status.present and not force:
        if carries_identity(status.path):
            progress(f"{status.path} is up to date (spec {env.spec_hash()}); --force rebuilds it")
            return status
        # Built before trees carried them: sandboxes bind them over it at every create.
        progress(f"{status.path} lacks sandlot's identity files in /etc: rebuilding it")
    if os.geteuid() != 0:
        raise BackendUnavailable("building a root file system runs debootstrap, which needs root")
    if shutil.which("debootstrap") is None:
        raise BackendUnavailable("debootstrap is missing: apt-get install -y debootstrap")
    rootfs_dir.mkdir(parents=True, exist_ok=True)
    # Sandbox uids (bwrap runs as them) must traverse the store to bind a tree.
    rootfs_dir.chmod(0o755)
    debs_dir.mkdir(parents=True, exist_ok=True)
    with _store_lock(rootfs_dir):
        for leftover in rootfs_dir.glob(BUILDING_PREFIX + "*"):
            progress(f"removing {leftover.name}, left by a build that did not finish")
            shutil.rmtree(leftover, ignore_errors=True)
        for old in rootfs_dir.glob(OLD_PREFIX + "*"):
            _remove_unless_in_use(old, progress)
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=f"{BUILDING_PREFIX}{env.name}-", dir=rootfs_dir))
        try:
            _fill(env, tmp, rootfs_dir, debs_dir, progress)
            _publish(tmp, tree_path(env, rootfs_dir), progress)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for stale in tree_status(env, rootfs_dir).stale:
            _remove_unless_in_use(stale, progress)
    status = tree_status(env, rootfs_dir)
    progress(f"built {status.path} ({status.size_mb} MB) in {time.monotonic() - started:.0f} s")
    return status


def _fill(env: Environment, tmp: Path, rootfs_dir: Path, debs: Path, progress: Progress) -> None:
    base = _same_base(env, rootfs_dir)
    if base is not None:
        # Another environment debootstrapped the same packages: copy, do not download again.
        progress(f"copying the debootstrap base of {base.name}")
        _run(["cp", "-a", "--reflink=auto", f"{base}/.", str(tmp)], progress)
        (tmp / MARKER).unlink(missing_ok=True)
        # Its pip requirements are not this environment's; the layout stays the
        # distribution's (a tree copied with an empty /usr/local had no /usr/local/lib).
        shutil.rmtree(tmp / "usr/local", ignore_errors=True)
        _local_skeleton(tmp)
    else:
        _run(
            [
                "debootstrap",
                f"--variant={env.variant}",
                f"--include={','.join(env.packages)}",
                f"--cache-dir={debs}",
                env.suite,
                str(tmp),
                env.mirror,
            ],
            progress,
        )
    for inside in (WORKSPACE_INSIDE, GUEST_DIR_INSIDE):
        (tmp / inside.lstrip("/")).mkdir(mode=0o755, parents=True, exist_ok=True)
    for name in ETC_MOUNT_POINTS:
        path = tmp / "etc" / name
        if not path.exists() and not path.is_symlink():
            path.touch(0o644)
    for name, content in identity_files().items():
        # The sandbox's own, so bubblewrap need not bind them over the tree's at every
        # create (~0.4 ms of its CPU: carries_identity).
        path = tmp / "etc" / name
        path.unlink()
        path.write_text(content)
        path.chmod(0o644)
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for item in (tmp / cache).glob("*"):
            if item.is_file():
                item.unlink()
    python = python_version(tmp)
    if env.pip:
        _pip_install(env, tmp, python, progress)
    tmp.chmod(0o755)
    size = _size_bytes(tmp)
    marker = {
        "environment": env.name,
        "spec": env.spec_hash(),
        "debootstrap": env.debootstrap_spec(),
        "build_id": secrets.token_hex(8),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": python,
        "pip": list(env.pip),
        "size_mb": round(size / 1e6, 1),
    }
    (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    (tmp / MARKER).chmod(0o644)


# /usr/local as Debian's base-files lays it out (its `man` a link to share/man).
LOCAL_DIRS = ("bin", "etc", "games", "include", "lib", "sbin", "share", "share/man", "src")


def _local_skeleton(tree: Path) -> None:
    """An empty /usr/local as debootstrap leaves it: base-files' directories, and the
    directories other packages of the tree add (python3's dist-packages, ca-certificates')."""
    local = tree / "usr/local"
    for name in LOCAL_DIRS:
        (local / name).mkdir(mode=0o755, parents=True, exist_ok=True)
    (local / "man").symlink_to("share/man")
    for python in (tree / "usr/lib").glob("python3.*"):
        if (python / "os.py").is_file():  # an interpreter's library, not a package's dir
            (local / "lib" / python.name / "dist-packages").mkdir(mode=0o755, parents=True)
    if (tree / "usr/share/ca-certificates").is_dir():
        (local / "share/ca-certificates").mkdir(mode=0o755)
    for path in (local, *local.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)  # whatever the umask: sandboxes traverse it


def _same_base(env: Environment, rootfs_dir: Path) -> Path | None:
    with contextlib.suppress(OSError):
        for other in sorted(rootfs_dir.iterdir()):
            marker = read_marker(other) if _TREE_NAME.match(other.name) else None
            if marker is not None and marker.get("debootstrap") == env.debootstrap_spec():
                return other
    return None


def _publish(tmp: Path, final: Path, progress: Progress) -> None:
    """Rename the finished tree into place; a forced rebuild swaps the old one out first."""
    if final.exists():
        old = final.with_name(f"{OLD_PREFIX}{final.name}-{secrets.token_hex(4)}")
        final.rename(old)
        tmp.rename(final)
        _remove_unless_in_use(old, progress)
    else:
        tmp.rename(final)


def trees_in_use() -> set[str]:
    """The names of store trees some live sandbox has bound as its root, from every
    process's mountinfo (a bind's root field is the tree's path, renames included)."""
    names: set[str] = set()
    for mountinfo in Path("/proc").glob("[0-9]*/mountinfo"):
        with contextlib.suppress(OSError):
            for line in mountinfo.read_text().splitlines():
                fields = line.split(" ", 5)
                if len(fields) > 4:
                    names.add(fields[3].rstrip("/").rpartition("/")[2])
    return names


def _remove_unless_in_use(tree: Path, progress: Progress) -> None:
    """Remove a replaced tree, unless a live sandbox still runs on it: its files would go
    from under that sandbox. A later build removes it once unused."""
    if tree.name in trees_in_use():
        if not tree.name.startswith(OLD_PREFIX):
            tree = tree.rename(tree.with_name(f"{OLD_PREFIX}{tree.name}"))
        progress(f"keeping {tree.name} while a live sandbox runs on it")
        return
    progress(f"removing {tree.name}, a replaced tree")
    shutil.rmtree(tree, ignore_errors=True)


def python_version(tree: Path) -> str:
    """The tree's CPython as "3.11" (from /usr/bin/python3's link)."""
    link = tree / "usr/bin/python3"
    target = str(link.readlink()) if link.is_symlink() else link.name
    match = re.search(r"python(\d+\.\d+)$", target)
    if match is None:
        raise ImageBuildError(f"cannot tell the python version of {tree} from {target!r}")
    return match[1]


def glibc_version(tree: Path) -> str:
    """The tree's glibc as "2.36" (what manylinux wheels are checked against)."""
    status = (tree / "var/lib/dpkg/status").read_text(errors="replace")
    match = re.search(r"^Package: libc6\n(?:[^\n]+\n)*?Version: (\d+)\.(\d+)", status, re.M)
    if match is None:
        raise ImageBuildError(f"cannot find libc6's version in {tree}/var/lib/dpkg/status")
    return f"{match[1]}.{match[2]}"


# pip's variables that only say how to reach the index, not what to take from it: a proxy,
# and the CA bundle of a network whose egress goes through a TLS-intercepting proxy, without
# which no wheel can be fetched there.
PIP_TRANSPORT = frozenset(
    {
        "PIP_CERT",
        "PIP_CLIENT_CERT",
        "PIP_PROXY",
        "PIP_TIMEOUT",
        "PIP_DEFAULT_TIMEOUT",
        "PIP_RETRIES",
    }
)


def pip_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of the build's pip: the caller's, less pip's own variables (an index,
    a config file: they would change what the spec hash promises), but for
    :data:`PIP_TRANSPORT`. HOME stays, so that pip's wheel cache is reused."""
    kept = {k: v for k, v in environ.items() if not k.startswith("PIP_") or k in PIP_TRANSPORT}
    return kept | {"PIP_CONFIG_FILE": os.devnull}


def _pip_install(env: Environment, tree: Path, python: str, progress: Progress) -> None:
    """Binary wheels for the tree's CPython and glibc, by the host's pip, into the tree's
    /usr/local (on the tree's sys.path): no compiler and no pip inside the tree."""
    arch = os.uname().machine
    glibc = glibc_version(tree).replace(".", "_")
    target = tree / "usr/local/lib" / f"python{python}" / "dist-packages"
    argv = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--no-compile",
        "--target",
        str(target),
        "--only-binary=:all:",
        "--python-version",
        python,
        "--implementation",
        "cp",
        "--platform",
        f"manylinux_{glibc}_{arch}",
    ]
    for link in env.find_links:
        argv += ["--find-links", link]
    if env.pip_no_index:
        argv.append("--no-index")
    argv += ["--", *env.pip]
    _run(argv, progress, env=pip_env(os.environ))
    _run(["chmod", "-R", "a+rX,go-w", str(target)], progress)


def _size_bytes(tree: Path) -> int:
    done = subprocess.run(
        ["du", "-sb", "--", str(tree)], capture_output=True, text=True, check=False
    )
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout else 0

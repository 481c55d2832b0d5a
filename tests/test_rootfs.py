"""The root file system store (backends/rootfs.py) and bubblewrap's rootfs mode.

Trees are real (debootstrap, pip) and kept in the machine-wide store across runs, as in
production: an environment of these tests is rebuilt only when its spec changes. Its
debootstrap base is the shipped python3's, so a build here copies that tree (`make image`
builds it) rather than downloading again.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandlot import BackendUnavailable, Sandbox, SandboxManager, Settings
from sandlot._portal import get_portal
from sandlot.backends.launch import identity_files
from sandlot.backends.rootfs import (
    BUILDING_PREFIX,
    MARKER,
    OLD_PREFIX,
    bubblewrap_mode,
    build_tree,
    carries_identity,
    find_tree,
    pip_env,
    tree_path,
    tree_status,
    trees_in_use,
)
from sandlot.environments import Environment, get_environment, load_registry
from sandlot.errors import ImageBuildError
from tests.conftest import make_settings, skip_reason

ROOTFS_DIR = Settings(_env_file=None).rootfs_dir  # type: ignore[call-arg]
DEBS = Path("/var/lib/sandlot/build/debs")
PIP_ENV = """
name: sandlot-test-pip
description: the python3 base plus a pure-Python wheel from PyPI
image: sandlot/sandlot-test-pip:bookworm
packages: [python3]
pip: ["six==1.16.0"]
"""
MISSING_ENV = """
name: sandlot-test-missing
description: never built
image: sandlot/sandlot-test-missing:bookworm
packages: [python3, less]
"""


def _env(text: str, **changes: object) -> Environment:
    import yaml

    return Environment.model_validate({**yaml.safe_load(text), **changes})


@pytest.fixture(scope="module")
def registry_dir(data_root: Path) -> Path:
    directory = data_root / "registry"
    (directory / "environments").mkdir(parents=True, exist_ok=True)
    (directory / "environments" / "pip.yaml").write_text(PIP_ENV)
    (directory / "environments" / "missing.yaml").write_text(MISSING_ENV)
    return directory


@pytest.fixture(scope="module")
def python3_tree() -> Path:
    tree = find_tree(get_environment("python3"), ROOTFS_DIR)
    if tree is None:
        pytest.fail(f"no python3 tree in {ROOTFS_DIR}: run `make image` (sandlot image build)")
    return tree


@pytest.fixture(scope="module")
def pip_tree(registry_dir: Path, python3_tree: Path) -> Path:
    env = get_environment("sandlot-test-pip", registry_dir)
    status = build_tree(env, ROOTFS_DIR, DEBS, progress=lambda _: None)
    return status.path


@pytest.fixture(scope="module")
def rootfs_manager(data_root: Path, registry_dir: Path) -> Iterator[SandboxManager]:
    reason = skip_reason("bubblewrap")
    if reason:
        pytest.skip(reason)
    settings = make_settings(data_root / "rootfs", registry_dir=registry_dir)
    mgr = SandboxManager(settings)
    get_portal().call(mgr.start())
    yield mgr
    get_portal().call(mgr.close())


# ------------------------------------------------------------------------- spec and store


def test_spec_hash_covers_pip_and_keeps_older_hashes() -> None:
    plain = _env(PIP_ENV, pip=[])
    # Without pip the hash is the one images were labelled with before pip existed.
    old = f"bookworm|minbase|{plain.mirror}|python3"
    assert plain.spec_hash() == hashlib.sha256(old.encode()).hexdigest()[:16]
    hashes = {
        plain.spec_hash(),
        _env(PIP_ENV).spec_hash(),
        _env(PIP_ENV, pip=["six==1.17.0"]).spec_hash(),
        _env(PIP_ENV, find_links=["/srv/wheels"]).spec_hash(),
        _env(PIP_ENV, pip_no_index=True).spec_hash(),
    }
    assert len(hashes) == 5
    assert _env(PIP_ENV).debootstrap_spec() == plain.debootstrap_spec()


def test_the_builds_pip_keeps_how_to_reach_the_index_not_what_to_take() -> None:
    # Behind a TLS-intercepting proxy pip needs the proxy's CA (PIP_CERT): without it a
    # pristine machine there could not build a tree with pip requirements (every fetch failed
    # certificate verification), where this host's system bundle hid it.
    caller = {
        "HOME": "/root",
        "PATH": "/usr/bin",
        "PIP_CERT": "/etc/proxy-ca.crt",
        "PIP_PROXY": "http://proxy:3128",
        "PIP_INDEX_URL": "https://elsewhere.example/simple",
        "PIP_EXTRA_INDEX_URL": "https://more.example/simple",
        "PIP_CONFIG_FILE": "/home/me/pip.conf",
        "PIP_NO_BINARY": ":all:",
    }
    env = pip_env(caller)
    assert env == {
        "HOME": "/root",
        "PATH": "/usr/bin",
        "PIP_CERT": "/etc/proxy-ca.crt",
        "PIP_PROXY": "http://proxy:3128",
        "PIP_CONFIG_FILE": os.devnull,
    }


def test_a_tree_without_its_marker_is_never_used(data_root: Path) -> None:
    store = data_root / "store-unit"
    env = _env(MISSING_ENV)
    half = tree_path(env, store)
    (half / "usr/bin").mkdir(parents=True)
    assert find_tree(env, store) is None
    assert bubblewrap_mode(env, store) == ("missing", None)
    assert bubblewrap_mode(get_environment("python3"), store) == ("host", None)
    (half / MARKER).write_text(json.dumps({"build_id": "b1", "python": "3.11"}))
    assert find_tree(env, store) == half
    assert tree_status(env, store).build_id == "b1"


def test_pip_requirements_are_built_into_the_tree(pip_tree: Path, registry_dir: Path) -> None:
    env = get_environment("sandlot-test-pip", registry_dir)
    marker = json.loads((pip_tree / MARKER).read_text())
    assert marker["spec"] == env.spec_hash() and marker["pip"] == ["six==1.16.0"]
    six = pip_tree / "usr/local/lib/python3.11/dist-packages/six.py"
    assert six.is_file() and six.stat().st_uid == 0 and six.stat().st_mode & 0o004
    assert not list(ROOTFS_DIR.glob(BUILDING_PREFIX + "*"))
    # Current: a second build keeps the very same tree.
    again = build_tree(env, ROOTFS_DIR, DEBS, progress=lambda _: None)
    assert again.build_id == marker["build_id"]


def test_a_failed_build_leaves_nothing_and_a_new_spec_replaces_the_old(
    pip_tree: Path, registry_dir: Path, data_root: Path
) -> None:
    wheels = data_root / "no-wheels"
    wheels.mkdir(exist_ok=True)
    env = get_environment("sandlot-test-pip", registry_dir)
    broken = env.model_copy(
        update={"pip": ("sandlot-no-such-wheel==1",), "find_links": (str(wheels),)}
    )
    broken = broken.model_copy(update={"pip_no_index": True})
    with pytest.raises(ImageBuildError, match="No matching distribution"):
        build_tree(broken, ROOTFS_DIR, DEBS, progress=lambda _: None)
    assert find_tree(broken, ROOTFS_DIR) is None
    assert not tree_path(broken, ROOTFS_DIR).exists()
    assert not list(ROOTFS_DIR.glob(BUILDING_PREFIX + "*"))
    assert find_tree(env, ROOTFS_DIR) == pip_tree  # the good tree is untouched
    # A changed spec: a new tree; the older spec's is removed once the new one is in place.
    newer = env.model_copy(update={"pip": ("six==1.17.0",)})
    status = build_tree(newer, ROOTFS_DIR, DEBS, progress=lambda _: None)
    try:
        assert status.present and status.path != pip_tree and not pip_tree.exists()
        assert (status.path / "usr/local/lib/python3.11/dist-packages/six.py").is_file()
    finally:
        # Back to the YAML's spec for the tests after this one (and the next run).
        build_tree(env, ROOTFS_DIR, DEBS, progress=lambda _: None)
    assert not status.path.exists()


def _make_wheel(directory: Path, version: str) -> None:
    """A pure-Python wheel built here, by hand (a wheel is a zip with three metadata files)."""
    import base64
    import zipfile

    name = f"sandlot_probe_pkg-{version}"
    files = {
        "sandlot_probe_pkg.py": f"VERSION = {version!r}\n",
        f"{name}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: sandlot-probe-pkg\nVersion: {version}\n"
        ),
        f"{name}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{name}.dist-info/RECORD,,")
    files[f"{name}.dist-info/RECORD"] = "\n".join(record) + "\n"
    with zipfile.ZipFile(directory / f"{name}-py3-none-any.whl", "w") as wheel:
        for path, text in files.items():
            wheel.writestr(path, text)


def test_a_wheel_cache_alone_builds_the_tree(
    rootfs_manager: SandboxManager, python3_tree: Path, data_root: Path
) -> None:
    """find_links + pip_no_index: a locally built wheel, no package index."""
    wheels = data_root / "wheels"
    wheels.mkdir(exist_ok=True)
    _make_wheel(wheels, "0.3.1")
    registry = data_root / "registry-wheel"
    (registry / "environments").mkdir(parents=True, exist_ok=True)
    (registry / "environments" / "wheel.yaml").write_text(
        "name: sandlot-test-wheel\nimage: sandlot/sandlot-test-wheel:bookworm\n"
        f"packages: [python3]\npip: [sandlot-probe-pkg==0.3.1]\nfind_links: [{wheels}]\n"
        "pip_no_index: true\n"
    )
    env = get_environment("sandlot-test-wheel", registry)
    status = build_tree(env, ROOTFS_DIR, DEBS, progress=lambda _: None)
    assert status.present
    # Built with the sandbox's identity files: bwrap binds none over them.
    assert carries_identity(status.path)
    # Copied from the python3 tree's debootstrap base, less its /usr/local's contents, not
    # less the directories debootstrap made there (they were all gone before 2026-12-06).
    local = status.path / "usr/local"
    assert sorted(p.name for p in local.iterdir()) == [
        "bin",
        "etc",
        "games",
        "include",
        "lib",
        "man",
        "sbin",
        "share",
        "src",
    ]
    assert (local / "man").readlink() == Path("share/man")
    assert sorted(p.name for p in (local / "lib/python3.11/dist-packages").iterdir()) == [
        "sandlot_probe_pkg-0.3.1.dist-info",
        "sandlot_probe_pkg.py",
    ]
    for name, content in identity_files().items():
        assert (status.path / "etc" / name).read_text() == content
    module = status.path / "usr/local/lib/python3.11/dist-packages/sandlot_probe_pkg.py"
    assert module.read_text() == "VERSION = '0.3.1'\n"
    settings = rootfs_manager.settings.model_copy(update={"registry_dir": registry})
    manager = SandboxManager(settings.model_copy(update={"data_dir": data_root / "wheel-mgr"}))
    get_portal().call(manager.start())
    try:
        with Sandbox.create(
            manager=manager, backend="bubblewrap", environment="sandlot-test-wheel"
        ) as sb:
            assert sb.run_code("import sandlot_probe_pkg as p; p.VERSION").text == "'0.3.1'"
            _assert_identity(sb, bound=False)
    finally:
        get_portal().call(manager.close())


IDENTITY_PROBE = (
    "id -un; id -gn; hostname; getent hosts sandbox | cut -d' ' -f1; "
    "grep -c ' /etc/\\(passwd\\|group\\|hosts\\|nsswitch.conf\\) ' /proc/self/mountinfo; "
    "cat /etc/passwd"
)


def _assert_identity(sb: Sandbox, *, bound: bool) -> None:
    """The sandbox's user, group and host name are its own, read from the tree's files or
    from ours bound over them (``bound``: four mounts over /etc)."""
    out = sb.commands.run(IDENTITY_PROBE).stdout.splitlines()
    assert out[:4] == ["sandbox", "sandbox", "sandbox", "127.0.0.1"], out
    assert out[4] == ("4" if bound else "0"), out
    assert "\n".join(out[5:]) + "\n" == identity_files()["passwd"], out


def test_a_tree_built_before_the_identity_files_has_them_bound(tmp_path: Path) -> None:
    """A tree built before its /etc carried sandlot's identity files (the distribution's
    passwd), or whose files differ or are links, gets them bound over its own; a tree
    built with them gets none (~0.4 ms of bwrap's CPU a create: BENCHMARKS.md)."""
    from typing import Any

    from sandlot.backends.base import GuestSpec
    from sandlot.backends.bubblewrap.argv import Argvs
    from sandlot.backends.bubblewrap.box import Box
    from sandlot.backends.bubblewrap.rootless import NoCgroup

    def binds(tree: Path | None) -> list[str]:
        box = Box("s", tmp_path, tmp_path / "ws", 65534, None, NoCgroup(), True, system=tree)
        spec = GuestSpec(sandbox_id="s", limits=Any)  # type: ignore[arg-type]
        argv = Argvs(tmp_path / "ours", tmp_path / "guest", rootless=False).bwrap(
            box, spec, 3, 4, manager_mounts=True, templated=True
        )
        return [
            argv[i + 2] for i, a in enumerate(argv) if a == "--ro-bind" and "/etc/" in argv[i + 2]
        ]

    every = ["/etc/passwd", "/etc/group", "/etc/hosts", "/etc/nsswitch.conf"]
    assert binds(None)[:4] == every  # the host's /usr: no /etc of its own (ETC_BINDS follow)
    for n, variant in enumerate(("debian", "ours", "one link", "one missing")):
        tree = tmp_path / f"tree-{n}"
        (tree / "etc").mkdir(parents=True)
        for name, content in identity_files().items():
            (tree / "etc" / name).write_text(
                "root:x:0:0:root:/root:/bin/bash\n" if variant == "debian" else content
            )
        if variant == "one link":
            (tree / "etc/hosts").unlink()
            (tree / "etc/hosts").symlink_to(tmp_path / "tree-1/etc/hosts")
        if variant == "one missing":
            (tree / "etc/group").unlink()
        assert carries_identity(tree) == (variant == "ours"), variant
        assert binds(tree) == ([] if variant == "ours" else every), variant


def test_a_sandbox_on_the_python3_tree_is_who_it_says(
    rootfs_manager: SandboxManager, python3_tree: Path
) -> None:
    with Sandbox.create(manager=rootfs_manager, backend="bubblewrap") as sb:
        _assert_identity(sb, bound=not carries_identity(python3_tree))


# ---------------------------------------------------------------------- bubblewrap mode


def test_bubblewrap_runs_the_environment_tree(
    rootfs_manager: SandboxManager, pip_tree: Path
) -> None:
    with Sandbox.create(
        manager=rootfs_manager, backend="bubblewrap", environment="sandlot-test-pip"
    ) as sb:
        assert sb.run_code("import six; six.__version__").text == "'1.16.0'"
        marker = json.loads(sb.commands.run("cat /.sandlot-tree.json").stdout)
        assert marker["spec"] == pip_tree.name.rpartition("-")[2]
    with Sandbox.create(manager=rootfs_manager, backend="bubblewrap") as sb:
        missing = sb.run_code("import six")
        assert missing.error is not None and missing.error.type == "ModuleNotFoundError"


def test_a_rebuild_never_pulls_a_tree_from_under_a_live_sandbox(
    rootfs_manager: SandboxManager, pip_tree: Path, registry_dir: Path
) -> None:
    env = get_environment("sandlot-test-pip", registry_dir)
    with Sandbox.create(
        manager=rootfs_manager, backend="bubblewrap", environment="sandlot-test-pip"
    ) as sb:
        assert pip_tree.name in trees_in_use()
        before = sb.commands.run("cat /.sandlot-tree.json").stdout
        rebuilt = build_tree(env, ROOTFS_DIR, DEBS, force=True, progress=lambda _: None)
        assert rebuilt.path == pip_tree and rebuilt.build_id not in before
        kept = list(ROOTFS_DIR.glob(OLD_PREFIX + pip_tree.name + "-*"))
        assert len(kept) == 1, kept
        # The sandbox still runs on its own (now replaced) tree, whole.
        assert sb.commands.run("cat /.sandlot-tree.json < /dev/null").stdout == before
        assert sb.run_code("import six; six.__version__").text == "'1.16.0'"
    # Unused once the sandbox's last process (its guest template's, which ends after it) has
    # gone, which a loaded machine takes a moment for: then the next build removes it.
    deadline = time.monotonic() + 10
    while kept[0].name in trees_in_use() and time.monotonic() < deadline:
        time.sleep(0.1)
    build_tree(env, ROOTFS_DIR, DEBS, force=True, progress=lambda _: None)
    assert not kept[0].exists()


def test_a_missing_tree_fails_the_create_and_names_the_command(
    rootfs_manager: SandboxManager,
) -> None:
    with pytest.raises(BackendUnavailable, match="sandlot image build sandlot-test-missing"):
        Sandbox.create(
            manager=rootfs_manager, backend="bubblewrap", environment="sandlot-test-missing"
        )
    assert not tree_path(_env(MISSING_ENV), ROOTFS_DIR).exists()  # never built on create


WALLS_PROBE = """
import os
seen = {}
for path in ("/etc/shadow", "/root", "/work", "/var/lib/sandlot", HOST_MARKER, PROJECT):
    seen[path] = os.path.exists(path)
mounts = {}
for line in open("/proc/self/mounts"):
    fields = line.split()
    mounts[fields[1]] = fields[3].split(",")
try:
    open("/usr/local/probe", "w")
    wrote = True
except OSError as exc:
    wrote = exc.errno
shadow = open("/etc/shadow").read() if os.access("/etc/shadow", os.R_OK) else None
seen, mounts, wrote, shadow, sorted(os.listdir("/usr/local/lib"))
"""


def test_rootfs_mode_walls(rootfs_manager: SandboxManager, python3_tree: Path) -> None:
    """The host's files are not the sandbox's: its /usr/local, /etc/shadow, the project."""
    import ast
    import errno

    marker = Path("/usr/local/share") / f"sandlot-rootfs-probe-{secrets.token_hex(4)}"
    marker.write_text("host only\n")
    try:
        with Sandbox.create(manager=rootfs_manager, backend="bubblewrap") as sb:
            code = WALLS_PROBE.replace("HOST_MARKER", repr(str(marker))).replace(
                "PROJECT", repr(str(Path(__file__).resolve().parent))
            )
            result = sb.run_code(code)
            assert result.ok, result
            seen, mounts, wrote, shadow, local_lib = ast.literal_eval(result.text or "")
    finally:
        marker.unlink()
    # /etc/shadow and /root are the tree's (root-only), never the host's.
    assert seen.pop("/etc/shadow") and seen.pop("/root")
    assert not any(seen.values()), seen
    assert shadow is None
    assert wrote == errno.EROFS
    assert local_lib == sorted(os.listdir(python3_tree / "usr/local/lib"))
    assert "ro" in mounts["/"]
    assert [point for point, options in mounts.items() if "nosuid" not in options] == []
    writable = {p for p, options in mounts.items() if "rw" in options and not p.startswith("/dev/")}
    assert writable <= {"/proc", "/dev", "/tmp", "/workspace"}, writable
    assert sb.info.environment == "python3"


def test_store_is_root_owned_and_not_writable_by_sandboxes(python3_tree: Path) -> None:
    for path in (ROOTFS_DIR, python3_tree, python3_tree / "usr"):
        info = path.stat()
        assert info.st_uid == 0 and not info.st_mode & 0o022, path


def test_doctor_says_which_mode_each_environment_gets(
    registry_dir: Path, python3_tree: Path
) -> None:
    from sandlot.backends.bubblewrap.probe import environment_checks

    settings = make_settings(Path("/nonexistent"), registry_dir=registry_dir)
    rows = {c.name: c for c in environment_checks(settings)}
    assert rows["env python3"].ok and str(python3_tree) in rows["env python3"].detail
    assert not rows["env sandlot-test-missing"].ok
    assert "sandlot image build sandlot-test-missing" in rows["env sandlot-test-missing"].detail
    host_mode = make_settings(Path("/nonexistent"), rootfs_dir=Path("/nonexistent"))
    rows = {c.name: c for c in environment_checks(host_mode)}
    assert rows["env python3"].detail.startswith("host mode")
    assert set(rows) >= {f"env {name}" for name in load_registry(None)}

"""Rootless mode: the bubblewrap backend run by an ordinary user, tried as one.

The real test creates a user (``sandlot-rootless``, once), and runs a Python program as that
user that imports sandlot from this source tree and attacks: sandbox A tries to read, signal
and kill sandbox B and the user's own processes, to read the user's home, and to write
outside its workspace; a third sandbox tries the degraded mode's rlimits. This host has
cgroup v1 and no delegation, so it runs the degraded mode; delegated-subtree detection is
unit-tested on a fake cgroupfs tree below. Skipped only without bwrap or without unprivileged
user namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pyseccomp
import pytest
import structlog

from sandlot.backends.bubblewrap.rootless import nproc_per_namespace, rlimit_argv
from sandlot.backends.bubblewrap.userns import userns_hint
from sandlot.backends.delegation import MANAGER_LEAF, find_delegated, prepare
from sandlot.models import ResolvedLimits

SRC = Path(__file__).resolve().parents[1] / "src"
USER = "sandlot-rootless"
CHILD_TIMEOUT_S = 240

# Runs as the non-root user; prints one JSON object as its last line.
CHILD = r"""
import json, os, subprocess, sys, time, warnings
from pathlib import Path

warnings.simplefilter("always")
from sandlot import Sandbox
from sandlot.backends.bubblewrap.probe import host_checks
from sandlot.backends.bubblewrap.rootless import DegradedIsolationWarning
from sandlot.config import Settings
from sandlot.errors import BackendUnavailable, ConfigError
from sandlot.sandbox import default_manager

TOKEN = sys.argv[1]
out = {"uid": os.getuid()}
home = Path.home()
data_dir = home / ".local/share/sandlot"


def host_pids(tag):
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def gone(tag, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while host_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not host_pids(tag)


if sys.argv[2] == "strict":
    try:
        Sandbox.create().kill()
        out["strict"] = "created"
    except BackendUnavailable as exc:
        out["strict"] = str(exc)
    print(json.dumps(out))
    sys.exit(0)

out["checks"] = {
    c.name: [c.ok, c.detail, c.required] for c in host_checks(Settings(_env_file=None))
}
canary = home / "canary.txt"
canary.write_text("HOME-SECRET-" + TOKEN)
host_tag = "host-marker-" + TOKEN
# Its own stdio: a marker holding our pipes would keep the test waiting if we failed early.
host_marker = subprocess.Popen(
    ["bash", "-c", f"exec -a {host_tag} sleep 300"],
    stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
)

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = Sandbox.create(env={"SECRET_ENV": "env-marker-" + TOKEN})
    b = Sandbox.create(pids=64)
    c = Sandbox.create(pids=64, memory_mb=256, disk_mb=64)
# bwrap lives as long as A: its command line is every host user's to read.
out["env_on_host"] = host_pids("env-marker-" + TOKEN)
out["env_in_a"] = a.commands.run("echo $SECRET_ENV").stdout.strip()
out["warnings"] = [
    str(w.message) for w in caught if issubclass(w.category, DegradedIsolationWarning)
]

try:
    Sandbox.create(network=True).kill()
    out["network"] = "created"
except ConfigError as exc:
    out["network"] = str(exc)

b_tag = "b-marker-" + TOKEN
b.files.write("secret.txt", "B-SECRET-" + TOKEN)
b.commands.run(f"(exec -a {b_tag} sleep 300) >/dev/null 2>&1 &")
out["b_marker_on_host"] = bool(host_pids(b_tag))
boxes = default_manager().instance_dir / "sandboxes"  # this process's instance
b_workspace = boxes / b.id / "workspace"
out["b_secret_on_host"] = (b_workspace / "secret.txt").read_text()

probe = '''
import json, os, subprocess
TOKEN, CANARY, B_WS, DATA, HOME = ARGS
res = {"uid": os.getuid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}
seen = []
for p in res["pids"]:
    try:
        seen.append(open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace"))
    except OSError:
        pass
res["sees_markers"] = [s for s in seen if "marker-" + TOKEN in s]
reads = {}
for path in (CANARY, B_WS + "/secret.txt", "/etc/shadow", "/proc/1/root" + CANARY):
    try:
        reads[path] = open(path).read()[:40]
    except OSError as exc:
        reads[path] = type(exc).__name__
res["reads"] = reads
try:
    res["home_dirs"] = os.listdir("/home")
except OSError as exc:
    res["home_dirs"] = type(exc).__name__
writes = {}
for path in (HOME + "/pwned", DATA + "/pwned", B_WS + "/pwned", "/usr/pwned", "/etc/pwned",
             "/opt/sandlot/pwned", "/pwned", "/proc/sys/kernel/hostname"):
    try:
        with open(path, "w") as f:
            f.write("pwned")
        writes[path] = "written"
    except OSError as exc:
        writes[path] = type(exc).__name__
res["writes"] = writes
with open("/tmp/pwned-" + TOKEN, "w") as f:
    f.write("inside")
res["unshare"] = subprocess.run(["unshare", "-U", "true"], capture_output=True).returncode
print(json.dumps(res))
'''
args = [TOKEN, str(canary), str(b_workspace), str(data_dir), str(home)]
run = a.run_code(f"ARGS = {args!r}\n" + probe)
out["a_probe"] = json.loads(run.stdout) if run.ok else run.model_dump()
os.symlink(canary, boxes / a.id / "workspace" / "leak")
try:
    out["a_leak_read"] = a.files.read("leak")
except Exception as exc:
    out["a_leak_read"] = type(exc).__name__
out["host_tmp_written"] = Path("/tmp/pwned-" + TOKEN).exists()

# kill(-1) signals every process the caller may signal: in A, only A's own.
out["a_kill_all"] = a.commands.run("kill -9 -1; echo done", timeout_s=10).model_dump(
    include={"exit_code", "kill_reason"}
)
time.sleep(0.5)
out["after_kill_all"] = {
    "b_marker": bool(host_pids(b_tag)),
    "host_marker": host_marker.poll() is None,
    "b_answers": b.run_code("6 * 7").text,
}

# The degraded mode's rlimits, in C (its own pids limit) while B forks beside it.
fork = '''
import os, time
n, err = 0, None
try:
    while n < 500:
        pid = os.fork()
        if pid == 0:
            null = os.open("/dev/null", os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.closerange(3, 4096)
            time.sleep(HOLD_S)
            os._exit(0)
        n += 1
except OSError as exc:
    err = exc.errno
print(n, err)
'''
c_fork = c.run_code("HOLD_S = 20\n" + fork)
b_fork = b.run_code("HOLD_S = 1\n" + fork.replace("n < 500", "n < 40"))
out["forks"] = {"c": c_fork.stdout.split(), "b": b_fork.stdout.split()}
d = Sandbox.create(pids=64, memory_mb=256, disk_mb=64)
out["memory"] = {
    "small": d.run_code("x = bytearray(64 * 2**20); len(x)").text,
    "large": getattr(d.run_code("x = bytearray(400 * 2**20)").error, "type", None),
}
# Runtimes that reserve more address space than they use still start (V8 reserves GiBs):
# the node environment's tree where it is built (rootfs mode), else the host's node.
try:
    n = Sandbox.create(pids=64, memory_mb=256, disk_mb=64, environment="node")
except BackendUnavailable:
    n = d
out["node"] = (
    n.commands.run("node -e 'console.log(6 * 7)'").stdout.strip()
    if n.commands.run("command -v node").exit_code == 0
    else None
)
out["node_tree"] = n is not d  # rootfs mode: the user ran the node tree root built
if n is not d:
    n.kill()
fsize = d.commands.run("head -c 100M /dev/zero > big; echo $?; stat -c %s big")
out["fsize"] = fsize.stdout.split()
raise_hard = d.run_code(
    "import resource\nresource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6))"
)
out["raise_nproc"] = raise_hard.error.type if raise_hard.error else "raised"

# Destroy ends every process of the sandbox and removes a tree it tried to make undeletable.
a_tag = "a-marker-" + TOKEN
a.commands.run(
    f"(exec -a {a_tag} sleep 300) >/dev/null 2>&1 & "
    f"setsid bash -c 'exec -a {a_tag}-setsid sleep 300' >/dev/null 2>&1 & "
    "mkdir -p locked/inner && touch locked/inner/f && chmod 000 locked/inner && chmod 500 locked",
    fresh=True,
)
out["a_marker_before"] = len(host_pids(a_tag))
a_dir = boxes / a.id
for sb in (a, b, c, d):
    sb.kill()
# A kill returns once nothing of the sandbox runs; its files go right after.
from sandlot._portal import get_portal
from sandlot.sandbox import default_manager
get_portal().call(default_manager().settle())
out["a_marker_after"] = not gone(a_tag)
out["b_marker_after"] = not gone(b_tag)
out["a_dir_left"] = a_dir.exists()
out["sandbox_dirs_left"] = sorted(p.name for p in boxes.iterdir())
out["canary_intact"] = canary.read_text() == "HOME-SECRET-" + TOKEN
out["home_entries"] = sorted(p.name for p in home.iterdir())
host_marker.kill()
print(json.dumps(out))
"""


def _as_user(uid: int, gid: int) -> list[str]:
    if os.geteuid() != 0:
        return []  # already an ordinary user: run as ourselves
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--init-groups", "--"]


def _ensure_user() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        return pwd.getpwuid(os.getuid())
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(USER)
    subprocess.run(
        ["useradd", "--no-create-home", "--user-group", "--shell", "/usr/sbin/nologin", USER],
        check=True,
    )
    return pwd.getpwnam(USER)


def _python_for(
    prefix: list[str], env: dict[str, str], src: Path, site: list[str]
) -> tuple[str, str]:
    """An interpreter the user can run that imports sandlot (from ``src``) and its
    dependencies, and the PYTHONPATH it needs (``src`` and ``site``, where this process
    finds them): this venv's python if the user can reach it, else the system's (``site``
    must then be of the same minor version)."""
    tried = []
    path = ":".join([str(src), *site])
    for python in (sys.executable, "/usr/bin/python3"):
        check = subprocess.run(
            [*prefix, python, "-c", "import sandlot, pydantic, structlog, pyseccomp"],
            env=env | {"PYTHONPATH": path},
            capture_output=True,
            text=True,
            check=False,
        )
        if check.returncode == 0:
            return python, path
        tried.append(f"{python}: {check.stderr.strip()[-300:]}")
    pytest.fail("no python the test user can run imports sandlot: " + " | ".join(tried))


# Imported by the user's python besides sandlot: where these live must be on its path.
DEPENDENCIES = (pydantic, structlog, pyseccomp)


def _readable_site(prefix: list[str], scratch: Path, mounts: list[Path]) -> list[str]:
    """Where this process finds sandlot's dependencies (this venv's site-packages, or a
    PYTHONPATH entry such as a ``pip install --target`` folder), as paths the user can reach.
    A checkout under a 0700 directory (a clone in /root) keeps them out of reach: they are
    then bound read-only into ``scratch`` (appended to ``mounts``, for the caller to unmount),
    not copied."""
    found = [str(Path(module.__file__ or "").parent.parent) for module in DEPENDENCIES]
    paths = []
    for index, site in enumerate(
        dict.fromkeys([*found, *(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))])
    ):
        probe = subprocess.run([*prefix, "test", "-r", site, "-a", "-x", site], check=False)
        if probe.returncode == 0:
            paths.append(site)
            continue
        target = scratch / f"site-{index}"
        target.mkdir(mode=0o755)
        subprocess.run(["mount", "--bind", "-o", "ro", site, str(target)], check=True)
        mounts.append(target)
        paths.append(str(target))
    return paths


def _readable_src(prefix: list[str], scratch: Path) -> Path:
    """This tree's src if the user can read it, else a copy the user can."""
    probe = subprocess.run(
        [*prefix, "test", "-r", str(SRC / "sandlot" / "__init__.py")], check=False
    )
    if probe.returncode == 0:
        return SRC
    copy = scratch / "src"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [copy, *copy.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return copy


@pytest.fixture(scope="module")
def child() -> Iterator[tuple[list[str], dict[str, str], str, Path]]:
    """(argv prefix to run as the user, env, the child program's path, HOME)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed")
    user = _ensure_user()
    prefix = _as_user(user.pw_uid, user.pw_gid)
    scratch = Path(tempfile.mkdtemp(prefix="sandlot-rootless-", dir="/tmp"))
    scratch.chmod(0o755)
    home = scratch / "home"
    home.mkdir(mode=0o700)
    os.chown(home, user.pw_uid, user.pw_gid)
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    userns = subprocess.run(
        [*prefix, "bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if userns.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        pytest.skip(f"unprivileged user namespaces fail: {userns.stderr.strip()} {userns_hint()}")
    mounts: list[Path] = []
    try:
        site = _readable_site(prefix, scratch, mounts)
        python, pythonpath = _python_for(prefix, env, _readable_src(prefix, scratch), site)
        program = scratch / "child.py"
        program.write_text(CHILD)
        program.chmod(0o644)
        yield [*prefix, python], env | {"PYTHONPATH": pythonpath}, str(program), home
    finally:
        for target in mounts:
            subprocess.run(["umount", str(target)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)


def _run_child(
    child: tuple[list[str], dict[str, str], str, Path], mode: str, **env: str
) -> dict[str, Any]:
    argv, base_env, program, home = child
    done = subprocess.run(
        [*argv, program, uuid.uuid4().hex[:12], mode],
        cwd=home,
        env=base_env | env,
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


@pytest.fixture(scope="module")
def run(child: tuple[list[str], dict[str, str], str, Path]) -> dict[str, Any]:
    return _run_child(child, "attack")


def test_runs_as_an_ordinary_user_with_one_warning(run: dict[str, Any]) -> None:
    assert run["uid"] != 0
    assert run["a_probe"]["uid"] == 65534
    # Four sandboxes made, one warning, naming what is missing.
    assert len(run["warnings"]) == 1, run["warnings"]
    for wall in ("memory accounting", "CPU quota", "disk cap"):
        assert wall in run["warnings"][0]


def test_doctor_says_rootless_and_which_walls_hold(run: dict[str, Any]) -> None:
    checks = run["checks"]
    assert checks["rootless"][0] and "shares this one host uid" in checks["rootless"][1]
    assert checks["user namespaces"][0] and checks["seccomp"][0] and checks["bubblewrap"][0]
    assert not checks["cgroups"][0] and not checks["cgroups"][2]  # missing, not required
    assert not checks["disk cap"][0] and not checks["network"][0]
    assert "root" not in checks  # rootless is a mode, not a failure


def test_a_cannot_see_or_read_b_or_the_users_files(run: dict[str, Any]) -> None:
    probe = run["a_probe"]
    assert probe["sees_markers"] == []  # neither B's process nor the user's
    assert run["b_marker_on_host"] and run["b_secret_on_host"].startswith("B-SECRET-")
    for path, got in probe["reads"].items():
        assert got in ("FileNotFoundError", "PermissionError"), (path, got)
    assert probe["home_dirs"] in ([], "FileNotFoundError")
    assert "HOME-SECRET" not in run["a_leak_read"]  # a planted symlink leads nowhere


def test_the_callers_env_is_on_no_host_command_line(run: dict[str, Any]) -> None:
    """Failed before: A's env (its JSON) stood on bwrap's argv for A's whole life."""
    assert run["env_on_host"] == []
    assert run["env_in_a"].startswith("env-marker-")


def test_a_cannot_write_outside_its_workspace(run: dict[str, Any]) -> None:
    for path, got in run["a_probe"]["writes"].items():
        assert got != "written", path
    assert not run["host_tmp_written"]  # its /tmp is its own
    assert run["canary_intact"]
    assert "pwned" not in run["home_entries"]
    assert run["a_probe"]["unshare"] != 0  # no nested user namespace


def test_a_cannot_kill_b_or_the_user(run: dict[str, Any]) -> None:
    assert run["after_kill_all"] == {"b_marker": True, "host_marker": True, "b_answers": "42"}


def test_degraded_rlimits_cap_each_sandbox(run: dict[str, Any]) -> None:
    c_forks, c_errno = run["forks"]["c"]
    b_forks, b_errno = run["forks"]["b"]
    if nproc_per_namespace(os.uname().release):
        # C stops below its own pids limit while B, beside it, still forks all 40.
        assert int(c_forks) < 64 and c_errno == "11", run["forks"]
    assert (b_forks, b_errno) == ("40", "None"), run["forks"]
    assert run["memory"] == {"small": str(64 * 2**20), "large": "MemoryError"}
    assert run["node"] in ("42", None)  # None: no node on this host
    assert run["node"] == "42" or not run["node_tree"]
    status, size = run["fsize"]
    assert int(size) <= 64 * 2**20 and status != "0"
    assert run["raise_nproc"] != "raised"


def test_network_is_refused_not_shared(run: dict[str, Any]) -> None:
    assert "needs root" in run["network"] and "host's network namespace" in run["network"]


def test_destroy_ends_every_process_and_file(run: dict[str, Any]) -> None:
    assert run["a_marker_before"] == 2
    assert not run["a_marker_after"] and not run["b_marker_after"]
    assert not run["a_dir_left"] and run["sandbox_dirs_left"] == []


def test_require_limits_refuses_the_degraded_mode(
    child: tuple[list[str], dict[str, str], str, Path],
) -> None:
    strict = _run_child(child, "strict", SANDBOX_REQUIRE_LIMITS="true")
    assert "SANDBOX_REQUIRE_LIMITS" in strict["strict"]


# ------------------------------------------------------------- unit: rlimits and hints


def test_rlimits_soft_equals_hard_and_nproc_only_where_per_namespace() -> None:
    limits = ResolvedLimits(
        memory_mb=128,
        cpu_cores=1,
        pids=50,
        timeout_s=5,
        disk_mb=10,
        output_limit_bytes=4096,
        output_file_limit_mb=1,
    )
    degraded = rlimit_argv(limits, degraded=True, nproc=True)
    assert "--nproc=50:50" in degraded and f"--data={128 * 2**20}:{128 * 2**20}" in degraded
    assert "--nproc=50:50" not in rlimit_argv(limits, degraded=True, nproc=False)
    fsize = 10 * 2**20
    assert rlimit_argv(limits, degraded=False, nproc=True)[1:] == [f"--fsize={fsize}:{fsize}", "--"]
    assert nproc_per_namespace("5.14.0-1") and nproc_per_namespace("6.1.0-26-amd64")
    assert not nproc_per_namespace("5.10.0-30-amd64") and not nproc_per_namespace("x")


def _fake_proc_sys(tmp_path: Path, restrict: str, profile: str | None) -> tuple[Path, Path]:
    proc_sys, apparmor_d = tmp_path / "sys", tmp_path / "apparmor.d"
    (proc_sys / "kernel").mkdir(parents=True)
    (proc_sys / "kernel/apparmor_restrict_unprivileged_userns").write_text(restrict + "\n")
    apparmor_d.mkdir()
    (apparmor_d / "usr.bin.man").write_text("/usr/bin/man { }\n")
    if profile is not None:
        (apparmor_d / profile).write_text("profile bwrap /usr/bin/bwrap flags=(unconfined) {\n")
    return proc_sys, apparmor_d


def test_apparmor_hint_without_a_bwrap_profile(tmp_path: Path) -> None:
    hint = userns_hint(*_fake_proc_sys(tmp_path, "1", None))
    assert "apparmor_restrict_unprivileged_userns=1" in hint
    assert "bwrap-userns-restrict" in hint and "apparmor_parser -r" in hint
    assert "sysctl kernel.apparmor_restrict_unprivileged_userns=0" in hint
    assert "attack surface" in hint  # the trade-off is said


def test_apparmor_hint_with_a_profile_that_did_not_apply(tmp_path: Path) -> None:
    proc_sys, apparmor_d = _fake_proc_sys(tmp_path, "1", "bwrap-userns-restrict")
    hint = userns_hint(proc_sys, apparmor_d)
    assert f"apparmor_parser -r {apparmor_d / 'bwrap-userns-restrict'}" in hint


def test_no_apparmor_hint_when_unrestricted(tmp_path: Path) -> None:
    assert userns_hint(*_fake_proc_sys(tmp_path, "0", None)) == ""
    proc_sys = tmp_path / "sys"
    (proc_sys / "user").mkdir()
    (proc_sys / "user/max_user_namespaces").write_text("0\n")
    assert "user.max_user_namespaces=0" in userns_hint(proc_sys, tmp_path / "apparmor.d")


# ------------------------------------------------------ unit: delegated cgroup v2 subtrees

FAKE_UID = 1500  # a user of the fake tree (the test needs root to chown to it)


class FakeCgroupfs:
    """A cgroup2 tree in a tmp dir, with the files detection reads."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path / "cgroup"
        self.mounts = tmp_path / "mounts"
        self.own = tmp_path / "self-cgroup"
        self.mounts.write_text(
            "proc /proc proc rw 0 0\n"
            f"cgroup2 {self.root} cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"
        )
        self.make("", owner=0)

    def make(self, relative: str, *, owner: int, controllers: str = "cpu memory pids io") -> Path:
        d = self.root / relative if relative else self.root
        d.mkdir(parents=True, exist_ok=True)
        for name, content in (
            ("cgroup.procs", ""),
            ("cgroup.subtree_control", ""),
            ("cgroup.controllers", controllers),
        ):
            (d / name).write_text(content)
            os.chown(d / name, owner, owner)
            (d / name).chmod(0o644)
        os.chown(d, owner, owner)
        return d

    def place_self(self, relative: str) -> None:
        self.own.write_text(f"0::/{relative}\n")

    def find(self, configured: str | None = None) -> tuple[Any, str]:
        return find_delegated(
            FAKE_UID, configured=configured, mounts_file=self.mounts, proc_self_cgroup=self.own
        )


@pytest.fixture
def cgroupfs(tmp_path: Path) -> FakeCgroupfs:
    if os.geteuid() != 0:
        pytest.skip("the fake tree needs root to give its directories to another uid")
    return FakeCgroupfs(tmp_path)


def test_systemd_user_session_is_found(cgroupfs: FakeCgroupfs) -> None:
    cgroupfs.make("user.slice", owner=0)
    cgroupfs.make(f"user.slice/user-{FAKE_UID}.slice", owner=0)
    service = f"user.slice/user-{FAKE_UID}.slice/user@{FAKE_UID}.service"
    cgroupfs.make(service, owner=FAKE_UID)
    cgroupfs.make(f"{service}/app.slice", owner=FAKE_UID)
    cgroupfs.make(f"{service}/app.slice/run-r1.scope", owner=FAKE_UID)
    cgroupfs.place_self(f"{service}/app.slice/run-r1.scope")
    found, why = cgroupfs.find()
    assert found is not None, why
    assert found.root == cgroupfs.root / service  # the highest directory still ours
    assert found.how.startswith("systemd user session") and not found.configured


def test_login_session_scope_is_not_delegated_and_says_how(cgroupfs: FakeCgroupfs) -> None:
    cgroupfs.make(f"user.slice/user-{FAKE_UID}.slice/session-3.scope", owner=0)
    cgroupfs.make(f"user.slice/user-{FAKE_UID}.slice/user@{FAKE_UID}.service", owner=FAKE_UID)
    cgroupfs.place_self(f"user.slice/user-{FAKE_UID}.slice/session-3.scope")
    found, why = cgroupfs.find()
    assert found is None and "systemd-run --user --scope -p Delegate=yes" in why


def test_subtree_chowned_by_an_administrator_is_found(cgroupfs: FakeCgroupfs) -> None:
    cgroupfs.make("sandboxes", owner=0)
    cgroupfs.make("sandboxes/alice", owner=FAKE_UID)
    cgroupfs.place_self("sandboxes/alice")
    found, _ = cgroupfs.find()
    assert found is not None and found.root == cgroupfs.root / "sandboxes/alice"
    assert found.how == f"a subtree chowned to uid {FAKE_UID}"


def test_writable_bit_and_ownership_both_count(cgroupfs: FakeCgroupfs) -> None:
    d = cgroupfs.make("alice", owner=FAKE_UID)
    cgroupfs.place_self("alice")
    (d / "cgroup.subtree_control").chmod(0o444)
    assert cgroupfs.find()[0] is None
    (d / "cgroup.subtree_control").chmod(0o644)
    os.chown(d / "cgroup.procs", 0, 0)
    assert cgroupfs.find()[0] is None


def test_missing_controllers_are_named(cgroupfs: FakeCgroupfs) -> None:
    cgroupfs.make("alice", owner=FAKE_UID, controllers="memory pids")
    cgroupfs.place_self("alice")
    found, why = cgroupfs.find()
    assert found is None and "lacks the cpu controller" in why


def test_configured_root_must_hold_this_process(cgroupfs: FakeCgroupfs) -> None:
    cgroupfs.make("jobs", owner=FAKE_UID)
    cgroupfs.make("other", owner=0)
    cgroupfs.place_self("other")
    found, why = cgroupfs.find(configured="jobs")
    assert found is None and "not inside it" in why
    cgroupfs.make("jobs/me", owner=FAKE_UID)
    cgroupfs.place_self("jobs/me")
    found, _ = cgroupfs.find(configured=str(cgroupfs.root / "jobs"))
    assert found is not None and found.configured and found.root == cgroupfs.root / "jobs"


def test_no_cgroup2_mount(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n")
    found, why = find_delegated(1000, mounts_file=mounts, proc_self_cgroup=tmp_path / "x")
    assert found is None and "no cgroup v2" in why


def test_prepare_moves_the_roots_processes_to_a_leaf(cgroupfs: FakeCgroupfs) -> None:
    d = cgroupfs.make("alice", owner=FAKE_UID)
    (d / "cgroup.procs").write_text("4242\n")
    cgroupfs.place_self("alice")
    found, _ = cgroupfs.find()
    assert found is not None
    driver = prepare(found)
    assert (d / MANAGER_LEAF / "cgroup.procs").read_text() == "4242"
    assert driver.version == 2 and driver.roots == {"unified": d}


def test_opening_up_a_tree_follows_no_parent_swapped_for_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing a rootless sandbox's tree gives the owner back its locked directories. Code
    still dying in the sandbox may swap a directory already listed for a symlink into the
    user's home: the walk goes by descriptors, so what it changes next is the real child,
    never the symlink's target. (A walk by path strings re-resolved ``t/a/b`` through it.)"""
    from sandlot.backends import disk

    outside = tmp_path / "home-dir"
    (outside / "b").mkdir(parents=True)
    (outside / "b").chmod(0o500)
    tree = tmp_path / "t"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b").chmod(0o500)
    real = disk._chmod_and_list
    calls = []

    def swap_after_listing_a(path_fd: int) -> Any:
        level = real(path_fd)
        calls.append(1)
        if len(calls) == 2:  # `a` was just listed: replace it under the walk
            (tree / "a").rename(tree / "a.moved")
            (tree / "a").symlink_to(outside)
        return level

    monkeypatch.setattr(disk, "_chmod_and_list", swap_after_listing_a)
    disk._open_up(tree)
    assert (outside / "b").stat().st_mode & 0o777 == 0o500
    assert (tree / "a.moved" / "b").stat().st_mode & 0o777 == 0o700

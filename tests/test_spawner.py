"""The spawner (backends/bubblewrap/spawner.py, spawner_server.py): as root, it starts each
templated sandbox's bwrap in place of ``sh`` and ``nsenter``. What its child must be when it
execs: in the sandbox's cgroup and namespaces, the sandbox's uid and group with no other group
and no capability, with only its stdio and the fds bwrap's argv names, SIGPIPE as the
default. Each test fails on a spawner that skips the step it checks."""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandlot import SandboxManager
from sandlot.backends.bubblewrap import spawner as spawner_module
from sandlot.backends.bubblewrap.spawner import Spawner, spawn_chain
from sandlot.backends.bubblewrap.template import Template
from sandlot.backends.cgroups import Cgroup, CgroupDriver, CgroupLimits
from sandlot.errors import SandboxStartError
from sandlot.requests import RunCode, SandboxSpec
from tests.conftest import make_settings

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("root_bubblewrap")]

UID = 297_321  # outside every test's uid range: nobody else's files or processes
# What the child sees of itself once exec'd (the program stands in for bwrap).
REPORT = r"""
grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapAmb|SigIgn):' /proc/self/status
echo "fds: $(ls /proc/self/fd | sort -n | tr '\n' ' ')"
echo "net: $(readlink /proc/self/ns/net)"
echo "cgroup: $(tr '\n' ' ' < /proc/self/cgroup)"
echo "seccomp fd: $(cat <&3)"
echo "env: $(env | sort | tr '\n' ' ')"
"""


@pytest.fixture
async def client() -> AsyncIterator[Template]:
    """A spawner started with groups of ours, which its children must not keep."""
    kept = os.getgroups()
    os.setgroups([0, 4242])
    spawner = Spawner()
    try:
        found = await spawner.get()
    finally:
        os.setgroups(kept)
    assert found is not None
    try:
        yield found
    finally:
        await spawner.close()


@pytest.fixture
def cgroup() -> Iterator[Cgroup]:
    driver = CgroupDriver.detect()
    made = driver.create(
        ("sandlot-test-spawner", uuid.uuid4().hex[:8]),
        CgroupLimits(memory_bytes=64 << 20, pids_max=32, cpu_cores=1.0),
    )
    try:
        yield made
    finally:
        made.kill_all()
        made.remove()


@pytest.fixture
def other_netns() -> Iterator[int]:
    """A network namespace that is not ours, held by a sleeping process."""
    holder = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    try:
        path = f"/proc/{holder.pid}/ns/net"
        for _ in range(100):
            if os.readlink(path) != os.readlink("/proc/self/ns/net"):
                break
            subprocess.run(["sleep", "0.02"], check=True)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            yield fd
        finally:
            os.close(fd)
    finally:
        holder.kill()
        holder.wait()


async def _run(
    client: Template,
    argv: list[str],
    *,
    cgroup_files: list[Path],
    namespaces: dict[str, int],
    uid: int = UID,
) -> tuple[int, str, str]:
    """``argv`` through the spawner, fd 3 a pipe holding "filter"; exit status, stdout, and
    the tail of stderr."""
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    seccomp_r, seccomp_w = os.pipe2(os.O_CLOEXEC)
    os.write(seccomp_w, b"filter")
    os.close(seccomp_w)
    # The report goes to fd 4 (stdout is /dev/null for a spawned bwrap).
    try:
        chain = await spawn_chain(
            client,
            ["/bin/sh", "-c", f"exec >&4; {argv[0]}", *argv[1:]],
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            cgroup_files=cgroup_files,
            namespaces=namespaces,
            passed={3: seccomp_r, 4: out_w},
            uid=uid,
        )
    finally:
        os.close(seccomp_r)
        os.close(out_w)
    chain.close_stdin()
    async with asyncio.timeout(10):
        code = await chain.wait()
    with os.fdopen(out_r, "rb") as out:
        return code, out.read().decode(), chain.stderr_tail()


async def test_the_child_execs_in_its_cgroup_and_namespace_as_the_sandboxs_uid_alone(
    client: Template, cgroup: Cgroup, other_netns: int
) -> None:
    code, out, _ = await _run(
        client, [REPORT], cgroup_files=cgroup.enter_files, namespaces={"net": other_netns}
    )
    assert code == 0, out
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    assert fields["Uid"].split() == [str(UID)] * 4
    assert fields["Gid"].split() == [str(UID)] * 4
    assert fields["Groups"].split() == []
    for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(fields[caps], 16) == 0, caps
    assert not int(fields["SigIgn"], 16) & (1 << (13 - 1)), "SIGPIPE still ignored"
    # 0-2, the two passed fds, and the one ls opens to list them: nothing of the spawner's.
    assert fields["fds"].split() == ["0", "1", "2", "3", "4", "5"]
    assert fields["net"].strip() == os.readlink(f"/proc/self/fd/{other_netns}")
    assert fields["net"].strip() != os.readlink("/proc/self/ns/net")
    leaf = next(iter(cgroup.dirs.values())).name
    for line in fields["cgroup"].split():
        _, controllers, path = line.split(":", 2)
        if set(controllers.split(",")) & set(cgroup.dirs) or cgroup.version == 2:
            assert path.endswith(f"/{leaf}"), line
    assert fields["seccomp fd"].strip() == "filter"
    names = {pair.split("=", 1)[0] for pair in fields["env"].split()}
    assert names - {"PWD", "SHLVL", "OLDPWD", "_"} == {"LANG", "PATH"}


async def test_a_child_that_cannot_exec_ends_at_once_and_says_why(client: Template) -> None:
    chain = await spawn_chain(
        client,
        ["/nonexistent/bwrap"],
        env={},
        cgroup_files=[],
        namespaces={},
        passed={},
        uid=UID,
    )
    async with asyncio.timeout(10):
        assert await chain.wait() == 125
    assert "sandlot spawner" in chain.stderr_tail()
    assert "/nonexistent/bwrap" in chain.stderr_tail()


async def test_root_and_requests_cut_short_are_refused_and_the_spawner_goes_on(
    client: Template,
) -> None:
    """Each refused with its reason, at once (a refusal whose id was lost hung its caller)."""
    with pytest.raises(SandboxStartError, match="never stays root"):
        async with asyncio.timeout(10):
            await spawn_chain(
                client, ["/bin/true"], env={}, cgroup_files=[], namespaces={}, passed={}, uid=0
            )
    # A request that says it carries more fds than it does.
    with pytest.raises(SandboxStartError, match="carries"):
        async with asyncio.timeout(10):
            await client.spawn(
                {
                    "argv": ["/bin/true"],
                    "env": {},
                    "cgroup_files": [],
                    "ns": ["net"],
                    "uid": UID,
                    "gid": UID,
                    "targets": [],
                },
                [],
            )
    code, _, _ = await _run(client, ["true"], cgroup_files=[], namespaces={})
    assert code == 0


async def test_a_templated_create_starts_bwrap_through_the_spawner(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No sh, no nsenter: the manager starts no launcher of its own."""
    started: list[str] = []
    real = asyncio.create_subprocess_exec

    async def spy(*argv: str, **kwargs: object) -> asyncio.subprocess.Process:
        started.append(argv[0])
        return await real(*argv, **kwargs)  # type: ignore[arg-type]

    async with SandboxManager(make_settings(data_root)) as mgr:
        first = await mgr.create(SandboxSpec())  # starts the template and the spawner
        monkeypatch.setattr(asyncio, "create_subprocess_exec", spy)
        info = await mgr.create(SandboxSpec())
        result = await mgr.run_code(info.id, RunCode(code="6 * 7"))
        assert result.text == "42"
        assert started == []
        backend = mgr._backend("bubblewrap")
        assert backend._spawner._client is not None and backend._spawner._client.alive
        await mgr.destroy(info.id)
        await mgr.destroy(first.id)


async def test_without_a_spawner_creates_go_through_the_launchers(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spawner_module, "SERVER", data_root / "no-such-spawner.py")
    async with SandboxManager(make_settings(data_root)) as mgr:
        info = await mgr.create(SandboxSpec())
        assert (await mgr.run_code(info.id, RunCode(code="6 * 7"))).text == "42"
        backend = mgr._backend("bubblewrap")
        assert backend._spawner._failed
        await mgr.destroy(info.id)

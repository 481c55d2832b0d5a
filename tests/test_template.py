"""The template guest (guest/template.py, backends/bubblewrap/template.py): as root with the
mount API, each new guest is forked from one imported interpreter per system and joins the
namespaces bwrap made. Each test here fails on the path it guards: a guest started afresh
(it would not be the template's child), a join that keeps a capability or the host's /proc,
a failed join that ran anyway, random state shared between sandboxes."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import gc
import json
import os
import select
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from sandlot import SandboxManager
from sandlot.backends import launch
from sandlot.backends.base import GuestProcess
from sandlot.backends.bubblewrap import backend as bubblewrap_backend
from sandlot.backends.bubblewrap import forks as bubblewrap_forks
from sandlot.backends.bubblewrap import launching
from sandlot.backends.bubblewrap import template as bubblewrap_template
from sandlot.backends.bubblewrap.forks import TemplateGuest
from sandlot.backends.bubblewrap.template import Template
from sandlot.backends.rootfs import find_tree
from sandlot.environments import HOST_ENVIRONMENT, get_environment
from sandlot.errors import SandboxStartError
from sandlot.requests import MAX_ENV_JSON_CHARS, RunCode, RunCommand, SandboxSpec
from tests import leaks
from tests.conftest import make_settings

pytestmark = [pytest.mark.asyncio, pytest.mark.usefixtures("root_bubblewrap")]

# What the guest sees of itself, its /proc and its walls, from a shell command in it.
INSIDE = r"""
grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' \
  /proc/1/status /proc/self/status
echo "procs: $(ls /proc | grep -E '^[0-9]+$' | sort -n | tr '\n' ' ')"
echo "pid1: $(tr '\0' ' ' < /proc/1/cmdline)"
for f in /proc/sys/kernel/hostname /proc/sysrq-trigger; do
  ( echo x > "$f" ) 2>/dev/null && echo "writable: $f"
done
echo "cmdline bytes: $(wc -c < /proc/cmdline)"
echo "hostname: $(hostname)"
"""


def _fields(text: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("/proc/"):
            _, key, value = line.split(":", 2)
            found.setdefault(key, set()).add(" ".join(value.split()))
    return found


@pytest.mark.parametrize("system", ["tree", "host"])
async def test_a_template_guest_is_pid_1_of_its_own_proc_without_any_capability(
    data_root: Path, system: str
) -> None:
    """The forked guest keeps every wall a guest started by bwrap had: pid 1 (``--as-pid-1``)
    of a pid namespace whose /proc shows only the sandbox, the sandbox's uid with no group
    and no capability in any set (bounding included), no_new_privs and the seccomp filter,
    bwrap's read-only covers and the host's masks over that /proc; and it is the template's
    child, not bwrap's (the path under test)."""
    data_dir = data_root / f"template-walls-{system}"
    data_dir.mkdir()
    extra = {} if system == "tree" else {"rootfs_dir": data_root / "no-trees"}
    settings = make_settings(data_dir, **extra)
    if (
        system == "tree"
        and find_tree(get_environment(HOST_ENVIRONMENT), settings.rootfs_dir) is None
    ):
        pytest.skip("no python3 tree is built here (`make image` builds it; `make test` runs that)")
    async with SandboxManager(settings) as mgr:
        info = await mgr.create(SandboxSpec())
        backend = mgr._backend("bubblewrap")
        guest = backend._boxes[info.id].guest
        assert isinstance(guest, TemplateGuest), guest
        # From the host: the guest is the template's child, as the sandbox's uid.
        tree = backend._boxes[info.id].system
        assert (tree is None) == (system == "host"), tree
        # The template of the sandbox's system and owner (the tenant scope, the default).
        key = f"{'host' if tree is None else tree} for local"
        # bwrap's, whose child is the template.
        monitor = backend._templates.running[key]._process.pid
        host_view = leaks.read_proc(guest.pid)
        assert host_view is not None
        parent = leaks.read_proc(host_view.ppid)
        assert parent is not None and parent.ppid == monitor, (host_view, parent, monitor)
        host_status = leaks.status_fields(guest.pid)
        assert host_status is not None
        uid = leaks.host_uid(mgr, info.id)
        assert set(host_view.uids) == {uid} and host_view.groups == (), host_view
        assert host_status["CapBnd"] == "0000000000000000", host_status
        ran = await mgr.run_command(info.id, RunCommand(command=INSIDE))
        assert ran.exit_code == 0, ran
        fields = _fields(ran.stdout)
        assert fields["Uid"] == {"65534 65534 65534 65534"}, fields
        assert fields["Groups"] == {""}, fields
        for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert fields[cap] == {"0000000000000000"}, (cap, fields)
        assert fields["NoNewPrivs"] == {"1"} and fields["Seccomp"] == {"2"}, fields
        lines = dict(line.split(": ", 1) for line in ran.stdout.splitlines() if ": " in line)
        procs = [int(p) for p in lines["procs"].split()]
        # Only the sandbox's: pid 1, its kernel, the shell and what it ran (a host /proc would
        # list hundreds, with the manager's pid among them).
        assert procs[0] == 1 and max(procs) < 100 and os.getpid() not in procs, procs
        assert "import template" in lines["pid1"], lines["pid1"]
        assert "writable" not in ran.stdout, ran.stdout
        assert lines["cmdline bytes"] == "0"  # the host's mask
        assert lines["hostname"] == "sandbox"
        ping = await mgr.run_code(info.id, RunCode(code="import os; os.getppid(), os.getpid()"))
        assert ping.text == "(1, 2)", ping  # the kernel, forked by pid 1
        await mgr.destroy(info.id)


async def test_sandboxes_forked_from_one_template_do_not_share_random_state(
    data_root: Path,
) -> None:
    """A fork copies the template's memory: ``random``'s state must be drawn again in each
    guest's kernel (``os.register_at_fork``), or every fresh sandbox would draw the same
    numbers (and make the same temporary names)."""
    data_dir = data_root / "template-random"
    data_dir.mkdir()
    code = (
        "import random, tempfile, uuid, os\n"
        "(random.getrandbits(64), uuid.uuid4().hex, os.urandom(8).hex(),"
        " next(tempfile._get_candidate_names()))"
    )
    async with SandboxManager(make_settings(data_dir)) as mgr:
        drawn = []
        for _ in range(3):
            info = await mgr.create(SandboxSpec())
            assert isinstance(mgr._backend("bubblewrap")._boxes[info.id].guest, TemplateGuest)
            got = await mgr.run_code(info.id, RunCode(code=code))
            assert got.error is None and got.text is not None, got
            drawn.append(ast.literal_eval(got.text))
            await mgr.destroy(info.id)
    for column in zip(*drawn, strict=True):
        assert len(set(column)) == len(column), drawn


async def test_a_guest_that_cannot_join_never_runs_and_says_why(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A join step that fails ends the child before the supervisor: here the user namespace
    it is given is the host's own (which setns refuses), the one step that would otherwise
    leave a guest as host root. The create fails with the child's reason, and nothing of
    the sandbox is left."""
    data_dir = data_root / "template-join-fails"
    data_dir.mkdir()
    real = bubblewrap_forks.namespace_fds

    def hosts_user_namespace(pid: int, parent: int) -> tuple[list[int], int]:
        fds, pidfd = real(pid, parent)
        os.close(fds[0])
        fds[0] = os.open("/proc/self/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        return fds, pidfd

    monkeypatch.setattr(bubblewrap_forks, "namespace_fds", hosts_user_namespace)
    async with SandboxManager(make_settings(data_dir)) as mgr:
        baseline = leaks.snapshot(mgr)
        with pytest.raises(SandboxStartError, match="user namespace"):
            await mgr.create(SandboxSpec())
        await mgr.settle()
        assert leaks.wait_for_baseline(mgr, baseline) == {}


async def test_a_request_whose_fds_were_cut_short_is_refused(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel cuts a message's fds past what the receiver takes (MSG_CTRUNC): a guest
    sent more cgroup files than the template takes must not start outside the hierarchies
    whose files were cut (on cgroup v1 the fifth, pids, was, before the template checked)."""
    data_dir = data_root / "template-cut-short"
    data_dir.mkdir()
    from sandlot.backends.cgroups import Cgroup

    real = Cgroup.enter_files
    monkeypatch.setattr(Cgroup, "enter_files", property(lambda self: real.fget(self) * 20))
    async with SandboxManager(make_settings(data_dir)) as mgr:
        baseline = leaks.snapshot(mgr)
        with pytest.raises(SandboxStartError, match=r"cut short|carries"):
            await mgr.create(SandboxSpec())
        await mgr.settle()
        assert leaks.wait_for_baseline(mgr, baseline) == {}


async def test_guests_die_with_their_template_and_the_next_one_is_started(
    data_root: Path,
) -> None:
    """A template that dies takes its guests with it (their death signal): a sandbox's next
    call finds its guest gone and restarts it, from a new template; new creates work."""
    data_dir = data_root / "template-dies"
    data_dir.mkdir()
    async with SandboxManager(make_settings(data_dir)) as mgr:
        info = await mgr.create(SandboxSpec())
        backend = mgr._backend("bubblewrap")
        system = backend._boxes[info.id].system
        first = backend._templates.running[f"{'host' if system is None else system} for local"]
        guest = backend._boxes[info.id].guest
        assert isinstance(guest, TemplateGuest)
        # The template itself is bwrap's child: kill the python under it.
        template_python = next(p.pid for p in leaks.all_procs() if p.ppid == first._process.pid)
        os.kill(template_python, signal.SIGKILL)
        assert await asyncio.wait_for(guest.wait(), 10) != 0
        again = await mgr.run_code(info.id, RunCode(code="6 * 7"))
        # Answered by a guest restarted first, or told the guest died under it.
        assert again.text == "42" or again.error is not None or again.state_lost, again
        after = await mgr.run_code(info.id, RunCode(code="6 * 7"))
        assert after.text == "42", after
        assert backend._boxes[info.id].guest is not guest
        other = await mgr.create(SandboxSpec())
        assert (await mgr.run_code(other.id, RunCode(code="1 + 1"))).text == "2"
        assert not first.alive
        await mgr.destroy(info.id)
        await mgr.destroy(other.id)


async def test_without_the_template_guests_start_afresh(data_root: Path) -> None:
    """``SANDBOX_GUEST_TEMPLATE=false``, and a template that will not start, both start each
    guest as bwrap's own (the path rootless always takes)."""
    data_dir = data_root / "template-off"
    data_dir.mkdir()
    async with SandboxManager(make_settings(data_dir, guest_template=False)) as mgr:
        info = await mgr.create(SandboxSpec())
        assert isinstance(mgr._backend("bubblewrap")._boxes[info.id].guest, GuestProcess)
        assert (await mgr.run_code(info.id, RunCode(code="import os; os.getpid()"))).text == "2"
        await mgr.destroy(info.id)
    broken = data_root / "template-broken"
    broken.mkdir()
    async with SandboxManager(make_settings(broken)) as mgr:
        backend = mgr._backend("bubblewrap")
        backend._argvs.template = lambda system: ["/bin/false"]
        info = await mgr.create(SandboxSpec())
        assert isinstance(backend._boxes[info.id].guest, GuestProcess)
        assert backend._templates.failed
        assert (await mgr.run_code(info.id, RunCode(code="1 + 1"))).text == "2"
        await mgr.destroy(info.id)


# A later sandbox's own code reads every byte of its own memory (no permission needed).
SCAN_OWN_MEMORY = r"""
import ctypes, re
hits = set()
with open("/proc/self/maps") as maps:
    for line in maps:
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if "r" not in fields[1] or (len(fields) > 5 and fields[5].startswith("[v")):
            continue
        for found in re.finditer(rb"sk-tenant-a-[A-Za-z0-9]{20,}", ctypes.string_at(lo, hi - lo)):
            hits.add(found.group()[:40])
sorted(hits)
"""


def _memory_of(pid: int, needle: bytes) -> bool:
    """Whether ``needle`` is anywhere in ``pid``'s readable memory (root reads it all)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb") as mem:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if "r" not in fields[1] or (len(fields) > 5 and fields[5].startswith("[v")):
                continue
            try:
                mem.seek(lo)
                if needle in mem.read(hi - lo):
                    return True
            except OSError:
                continue
    return False


async def test_a_callers_env_never_reaches_the_template_nor_a_later_sandbox(
    data_root: Path,
) -> None:
    """The template must never hold a sandbox's data: every later guest is a fork of its
    memory. Failed before (the red team's find): the template parsed each request, env
    included, and a later tenant's code read an earlier caller's API key in its own memory,
    in each of twelve sandboxes made after the first was gone."""
    data_dir = data_root / "template-no-secrets"
    data_dir.mkdir()
    secrets = {
        "OPENAI_API_KEY": "sk-tenant-a-" + "Q" * 150,
        "DB_PASSWORD": "sk-tenant-a-" + "Z" * 400,
        "SHORT": "sk-tenant-a-" + "W" * 30,
    }
    async with SandboxManager(make_settings(data_dir)) as mgr:
        first = await mgr.create(SandboxSpec(env=secrets))
        seen = await mgr.run_command(first.id, RunCommand(command="echo ${#DB_PASSWORD}"))
        assert seen.stdout == "412\n", seen  # it did reach the sandbox it was given to
        await mgr.destroy(first.id)
        backend = mgr._backend("bubblewrap")
        (template,) = backend._templates.running.values()
        template_python = next(p.pid for p in leaks.all_procs() if p.ppid == template._process.pid)
        for value in secrets.values():
            assert not _memory_of(template_python, value.encode()), "the template holds it"
        for _ in range(3):
            later = await mgr.create(SandboxSpec())
            assert isinstance(backend._boxes[later.id].guest, TemplateGuest)
            got = await mgr.run_code(later.id, RunCode(code=SCAN_OWN_MEMORY))
            assert got.text == "[]", got
            await mgr.destroy(later.id)


async def test_a_create_too_large_for_one_message_fails_or_runs_alone(data_root: Path) -> None:
    """A caller's env travels in a memfd, never in the template's message: an env of any
    size the API admits starts its own sandbox and nobody else's is touched. Failed before
    (the red team's find): 65,000 backslashes made a ~260 KB message, its send failed with
    EMSGSIZE, the host took that for a dead template and closed it, and every sandbox forked
    from it died."""
    data_dir = data_root / "template-large-env"
    data_dir.mkdir()
    async with SandboxManager(make_settings(data_dir)) as mgr:
        victim = await mgr.create(SandboxSpec())
        await mgr.run_code(victim.id, RunCode(code="state = 'kept'"))
        backend = mgr._backend("bubblewrap")
        (template,) = backend._templates.running.values()
        large = await mgr.create(SandboxSpec(env={"X": "\\" * 65_000}))
        got = await mgr.run_command(large.id, RunCommand(command='echo "${#X}"'))
        assert got.stdout == "65000\n", got
        # A request that cannot be sent at all (a closed fd) fails alone, too.
        with pytest.raises(SandboxStartError):
            await template.spawn({"cgroup_files": 1}, [12345])
        assert template.alive
        kept = await mgr.run_code(victim.id, RunCode(code="state"))
        assert kept.text == "'kept'" and not kept.state_lost, kept
        await mgr.destroy(large.id)
        await mgr.destroy(victim.id)


async def test_a_template_of_a_changed_system_is_retired_once_its_guests_end(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rebuilt tree (or an upgraded python) gets a new template: the old one imported the
    old files, and holds the old tree, which the store removes only once nothing runs on it
    (test_rootfs.py's rebuild test failed on that). It is not killed under its guests: it
    closes when the last one ends."""
    data_dir = data_root / "template-retired"
    data_dir.mkdir()
    identity = ["before"]
    monkeypatch.setattr(launching, "system_identity", lambda *_: identity[0])
    async with SandboxManager(make_settings(data_dir)) as mgr:
        backend = mgr._backend("bubblewrap")
        old = await mgr.create(SandboxSpec())
        await mgr.run_code(old.id, RunCode(code="state = 'kept'"))
        (first,) = backend._templates.running.values()
        identity[0] = "after"
        new = await mgr.create(SandboxSpec())
        (second,) = backend._templates.running.values()
        assert second is not first and first.retired and first.alive
        assert (await mgr.run_code(old.id, RunCode(code="state"))).text == "'kept'"
        await mgr.destroy(old.id)
        await mgr.settle()
        for _ in range(100):
            if not first.alive:
                break
            await asyncio.sleep(0.05)
        assert not first.alive and second.alive
        assert (await mgr.run_code(new.id, RunCode(code="1 + 1"))).text == "2"
        await mgr.destroy(new.id)


@pytest.mark.parametrize("status", [-9, 125])
async def test_a_guest_that_ends_right_behind_its_reply_is_seen_to_end(status: int) -> None:
    """The template reports a guest killed at once (-9), or one that failed at once (125: it
    could not join), right behind the reply that named it, often in the same read. Failed
    before (the red team's finds): the report was dispatched before the create had
    registered the pid, dropped, and the guest's end never came (a retired template then
    never closed); then, once registered, it resolved a future nobody held yet and
    ``exit_of`` made up a kill (-9) where the status was 125 (2026-11-27)."""
    template = Template("unit")
    ours, theirs = socket.socketpair()
    template.alive, template._sock = True, ours
    pidfd, other = os.pipe()

    async def one_read(message: bytes, fds: list[int]) -> None:
        call_id = json.loads(message)["id"]
        template._dispatch({"id": call_id, "pid": 4242}, [pidfd])
        template._dispatch({"exit": 4242, "status": status}, [])

    template._send = one_read  # type: ignore[method-assign]
    try:
        pid, got = await template.spawn({"cgroup_files": 1}, [])
        assert (pid, got) == (4242, pidfd)
        ended = template.exit_of(pid)
        assert ended.done() and ended.result() == status
        assert not template._exits
        assert template.idle
    finally:
        for fd in (pidfd, other):
            os.close(fd)
        theirs.close()
        template._gone()


async def test_a_request_longer_than_the_template_reads_is_refused_before_it_is_sent() -> None:
    """The template reads at most MAX_MESSAGE bytes of a request; a longer one arrives cut
    short and cannot be answered by its id. Failed before (a red team's find, on the
    same protocol): its caller waited for ever."""
    template = Template("unit")
    ours, theirs = socket.socketpair()
    template.alive, template._sock = True, ours
    sent: list[bytes] = []

    async def record(message: bytes, fds: list[int]) -> None:
        sent.append(message)

    template._send = record  # type: ignore[method-assign]
    try:
        with pytest.raises(SandboxStartError, match="bytes, over the"):
            async with asyncio.timeout(5):
                await template.spawn({"padding": "x" * 5000, "cgroup_files": 1}, [])
        assert sent == [] and not template._replies
    finally:
        theirs.close()
        template._gone()


async def test_a_retired_template_waits_for_the_creates_that_hold_it() -> None:
    """A create takes its template, then starts bwrap (milliseconds) before it asks for the
    guest. Failed before (the red team's find): another create that retired the template in
    that window closed it, and the first failed with TemplateGone."""
    template = Template("unit", "before", lambda: "after")
    ours, theirs = socket.socketpair()
    template.alive, template._sock = True, ours
    try:
        template.hold()
        template.retire()
        assert template._closing is None and template.alive
        template.release()
        assert template._closing is not None
        await template._closing
        assert not template.alive
    finally:
        theirs.close()


async def test_the_callers_env_is_on_no_host_command_line(data_root: Path) -> None:
    """bwrap's argv is every host user's to read in /proc: a template's placeholder gets no
    env of the caller's (its guest's comes in a sealed memfd). Failed before: the env's JSON
    stood on bwrap's command line while the sandbox started."""
    data_dir = data_root / "template-argv"
    data_dir.mkdir()
    marker = "sk-tenant-marker-" + "M" * 40
    async with SandboxManager(make_settings(data_dir)) as mgr:
        backend = mgr._backend("bubblewrap")
        seen: list[bytes] = []
        join = backend._join

        async def read_cmdlines(template: Any, box: Any, spec: Any, chain: Any, pid: int) -> Any:
            for alive in (chain.pid, pid):  # bwrap and its placeholder, both running now
                seen.append(Path(f"/proc/{alive}/cmdline").read_bytes())
            return await join(template, box, spec, chain, pid)

        backend._join = read_cmdlines
        info = await mgr.create(SandboxSpec(env={"TOKEN": marker}))
        assert len(seen) == 2 and all(b"bwrap" in c or b"sh" in c for c in seen), seen
        assert not any(marker.encode() in cmdline for cmdline in seen), seen
        got = await mgr.run_command(info.id, RunCommand(command="echo $TOKEN"))
        assert got.stdout == marker + "\n"
        await mgr.destroy(info.id)


async def test_a_guest_started_afresh_has_the_callers_env_on_no_host_command_line(
    data_root: Path,
) -> None:
    """Where a guest starts afresh (here the template off; rootless: test_rootless.py) bwrap
    lives as long as the sandbox, and reads the guest's environment from a memfd. Failed
    before: the env's JSON stood on bwrap's argv for the sandbox's whole life, and the
    largest env the API admits failed the create with E2BIG there."""
    data_dir = data_root / "template-off-argv"
    data_dir.mkdir()
    marker = "sk-tenant-marker-" + "A" * 40
    # As large as the API admits, in escapes that double (requests.MAX_ENV_JSON_CHARS).
    large = "\\" * ((MAX_ENV_JSON_CHARS - 100) // 2)
    async with SandboxManager(make_settings(data_dir, guest_template=False)) as mgr:
        info = await mgr.create(SandboxSpec(env={"TOKEN": marker, "LARGE": large}))
        assert isinstance(mgr._backend("bubblewrap")._boxes[info.id].guest, GuestProcess)
        assert leaks.cmdlines_holding(marker.encode()) == {}
        got = await mgr.run_command(info.id, RunCommand(command='echo "$TOKEN ${#LARGE}"'))
        assert got.stdout == f"{marker} {len(large)}\n", got
        await mgr.destroy(info.id)
    with pytest.raises(ValidationError, match="as JSON; at most"):
        SandboxSpec(env={"LARGE": large + "\\" * 100})


async def test_bwraps_child_waits_at_its_block_fd_and_never_execs(data_root: Path) -> None:
    """bwrap's child makes the namespaces and waits at its --block-fd, with no capability
    left: the guest joins it there, and it is killed once the guest is in, never having
    exec'd anything (a placeholder `sh` it once exec'd cost ~2.5 ms of CPU a create)."""
    data_dir = data_root / "template-block"
    data_dir.mkdir()
    async with SandboxManager(make_settings(data_dir)) as mgr:
        backend = mgr._backend("bubblewrap")
        seen: dict[str, Any] = {}
        join = backend._join

        async def record(template: Any, box: Any, spec: Any, chain: Any, pid: int) -> Any:
            seen["pid"] = pid
            seen["comm"] = Path(f"/proc/{pid}/comm").read_text().strip()
            status = leaks.status_fields(pid) or {}
            seen["caps"] = {status.get(k) for k in ("CapPrm", "CapEff", "CapInh", "CapAmb")}
            seen["pidfd"] = os.pidfd_open(pid)
            return await join(template, box, spec, chain, pid)

        backend._join = record
        info = await mgr.create(SandboxSpec())
        try:
            assert seen["comm"] == "bwrap" and seen["caps"] == {"0000000000000000"}, seen
            # Killed once the guest was in: gone by the time the create returned, or soon.
            ready = await asyncio.to_thread(select.select, [seen["pidfd"]], [], [], 5.0)
            assert ready[0], f"bwrap's child {seen['pid']} still alive"
            got = await mgr.run_code(info.id, RunCode(code="6 * 7"))
            assert got.text == "42", got
        finally:
            os.close(seen["pidfd"])
        await mgr.destroy(info.id)


async def test_a_guest_whose_end_is_never_reported_is_still_seen_to_end() -> None:
    """A guest's wait ends when its pidfd says it is gone, even if the template's report of
    its end is lost: the create that waits for a killed guest has no deadline of its own
    (core/live.py), and a report dropped by the race above hung it (the red team saw two
    creates hang before that fix)."""
    template = Template("unit")
    victim = await asyncio.create_subprocess_exec("sleep", "30")
    placeholder = await asyncio.create_subprocess_exec(
        "sleep",
        "30",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    blocked = await asyncio.create_subprocess_exec("sleep", "30")  # bwrap's blocked child
    template._exits[victim.pid] = asyncio.get_running_loop().create_future()  # never told
    (in_r, in_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
    guest = TemplateGuest(
        template,
        victim.pid,
        os.pidfd_open(victim.pid),
        in_w,
        out_r,
        err_r,
        GuestProcess(placeholder),
        os.pidfd_open(blocked.pid),
    )
    try:
        guest.connect()
        guest.kill()
        assert await asyncio.wait_for(guest.wait(), 5.0) == -signal.SIGKILL
        assert await asyncio.wait_for(blocked.wait(), 5.0) == -signal.SIGKILL
    finally:
        guest.writer.close()  # the guest's connection closes it, in the manager
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        await victim.wait()


# What forks of one template have in common: Python's hash secret and the memory layout.
SHARED_PROBE = """
import os
libc = next(line.split("-")[0] for line in open("/proc/self/maps") if "libc.so" in line)
(hash("sandlot"), libc)
"""


async def _shared_state(mgr: SandboxManager, sandbox_id: str) -> tuple[int, str]:
    got = await mgr.run_code(sandbox_id, RunCode(code=SHARED_PROBE))
    value: tuple[int, str] = ast.literal_eval(got.text)
    return value


async def test_two_tenants_never_fork_from_one_template(data_root: Path) -> None:
    """In the tenant scope (the default) each owner's guests fork from a template of their
    own: a tenant can read its own hash secret and memory layout, and must learn nothing of
    another tenant's from them. Failed before: one template per system served every owner,
    and alice's sandbox held bob's hash secret and libc address; the system scope still
    shares them, as documented."""
    data_dir = data_root / "template-tenants"
    data_dir.mkdir()
    async with SandboxManager(make_settings(data_dir)) as mgr:
        alice = [await mgr.create(SandboxSpec(), owner="alice") for _ in range(2)]
        bob = await mgr.create(SandboxSpec(), owner="bob")
        backend = mgr._backend("bubblewrap")
        for info in (*alice, bob):
            assert isinstance(backend._boxes[info.id].guest, TemplateGuest)
        first, second = [await _shared_state(mgr, info.id) for info in alice]
        assert first == second  # the probe sees what one template's forks share
        theirs = await _shared_state(mgr, bob.id)
        assert theirs[0] != first[0] and theirs[1] != first[1], (first, theirs)
        assert {k.rsplit(" for ", 1)[1] for k in backend._templates.running} == {"alice", "bob"}
        # The synthesized /proc files follow the same rule (_sharers): a set per tenant.
        sets = [backend._boxes[info.id].proc_files for info in (*alice, bob)]
        assert sets[0] == sets[1] != sets[2], sets
        for info in (*alice, bob):
            await mgr.destroy(info.id)
    shared = data_root / "template-system-scope"
    shared.mkdir()
    async with SandboxManager(make_settings(shared, guest_template_scope="system")) as mgr:
        alice_box = await mgr.create(SandboxSpec(), owner="alice")
        bob_box = await mgr.create(SandboxSpec(), owner="bob")
        assert await _shared_state(mgr, alice_box.id) == await _shared_state(mgr, bob_box.id)
        boxes = mgr._backend("bubblewrap")._boxes
        assert boxes[alice_box.id].proc_files == boxes[bob_box.id].proc_files
        await mgr.destroy(alice_box.id)
        await mgr.destroy(bob_box.id)


@pytest.mark.parametrize("scope", ["tenant", "system"])
async def test_a_pooled_sandbox_forks_from_no_tenants_template(data_root: Path, scope: str) -> None:
    """A pooled sandbox is started before anyone owns it: in the tenant scope it starts
    afresh (forked from a template, it would share it with whoever gets the pool's next
    one) until the pool's last creates were one tenant's, and once claimed a restarted
    guest forks from its owner's template. The system scope forks pooled guests too."""
    data_dir = data_root / f"template-pool-{scope}"
    data_dir.mkdir()
    settings = make_settings(data_dir, pool_size=1, guest_template_scope=scope)
    async with SandboxManager(settings) as mgr:
        for _ in range(600):
            if mgr.pooled_count():
                break
            await asyncio.sleep(0.05)
        assert mgr.pooled_count() == 1
        pooled = mgr._pools.ids() if mgr._pools else set()
        info = await mgr.create(SandboxSpec(), owner="alice")
        assert {info.id} == pooled, (info.id, pooled)
        backend = mgr._backend("bubblewrap")
        guest = backend._boxes[info.id].guest
        assert isinstance(guest, GuestProcess if scope == "tenant" else TemplateGuest), guest
        # Its guest killed: the next call restarts it, as its owner's.
        guest.kill()
        again = await mgr.run_code(info.id, RunCode(code="6 * 7"))
        if again.state_lost and again.text != "42":
            again = await mgr.run_code(info.id, RunCode(code="6 * 7"))
        assert again.text == "42", again
        assert isinstance(backend._boxes[info.id].guest, TemplateGuest)
        if scope == "tenant":
            assert list(backend._templates.running) == [
                f"{_system_key(backend, info.id)} for alice"
            ]
        await mgr.destroy(info.id)


async def test_a_pool_refills_for_its_one_tenant_and_serves_nobody_else_from_it(
    data_root: Path,
) -> None:
    """A pool whose last creates were one tenant's refills with sandboxes forked from that
    tenant's template (as fast as the system scope's: BENCHMARKS.md), handed to that tenant
    alone: another tenant's create never gets one, and shares nothing with it."""
    data_dir = data_root / "template-pool-follows"
    data_dir.mkdir()
    async with SandboxManager(make_settings(data_dir, pool_size=1)) as mgr:
        backend = mgr._backend("bubblewrap")

        async def pooled() -> Any:
            for _ in range(200):
                if mgr.pooled_count():
                    return next(iter(mgr._pools.ids())) if mgr._pools else None
                await asyncio.sleep(0.05)
            raise AssertionError("the pool did not refill")

        for _ in range(3):  # the pool's last creates: alice's
            await pooled()
            await mgr.destroy((await mgr.create(SandboxSpec(), owner="alice")).id)
        waiting = await pooled()
        alice = await mgr.create(SandboxSpec(), owner="alice")
        assert alice.id == waiting  # from the pool, and forked from her template
        assert isinstance(backend._boxes[alice.id].guest, TemplateGuest)
        for _ in range(4):  # the pool is alice's again after this many of hers
            await pooled()
            await mgr.destroy((await mgr.create(SandboxSpec(), owner="alice")).id)
        waiting = await pooled()
        bob = await mgr.create(SandboxSpec(), owner="bob")
        assert bob.id != waiting  # not alice's pooled one
        assert await _shared_state(mgr, bob.id) != await _shared_state(mgr, alice.id)
        await mgr.destroy(bob.id)
        await mgr.destroy(alice.id)


def _system_key(backend: Any, sandbox_id: str) -> str:
    system = backend._boxes[sandbox_id].system
    return "host" if system is None else str(system)


async def test_running_templates_are_capped_and_the_idle_ones_go_first(data_root: Path) -> None:
    """``SANDBOX_MAX_GUEST_TEMPLATES`` bounds the templates (each a few MB of host memory) a
    host keeps for its tenants: a new tenant's template closes the least recently used one
    idle for ``evict_idle_s``; with none such, the new tenant's guests start afresh, and
    nobody's create fails. Failed before (the red team's find): one idle a moment was closed
    at once, so that more busy tenants than the cap started a template a create, each
    costing three times the CPU of starting afresh."""
    data_dir = data_root / "template-cap"
    data_dir.mkdir()
    async with SandboxManager(make_settings(data_dir, max_guest_templates=2)) as mgr:
        backend = mgr._backend("bubblewrap")
        templates = backend._templates
        for owner in ("a", "b"):
            info = await mgr.create(SandboxSpec(), owner=owner)
            await mgr.destroy(info.id)
        await mgr.settle()
        # Both idle, but used a moment ago: c starts afresh and closes neither.
        c = await mgr.create(SandboxSpec(), owner="c")
        assert isinstance(backend._boxes[c.id].guest, GuestProcess)
        assert sorted(k.rsplit(" ", 1)[1] for k in templates.running) == ["a", "b"]
        await mgr.destroy(c.id)
        templates.evict_idle_s = 0.0  # as if both had been idle long enough
        a_template = next(t for k, t in templates.running.items() if k.endswith(" for a"))
        c = await mgr.create(SandboxSpec(), owner="c")  # a's is the least recently used
        assert isinstance(backend._boxes[c.id].guest, TemplateGuest)
        assert sorted(k.rsplit(" ", 1)[1] for k in templates.running) == ["b", "c"]
        for _ in range(100):
            if not a_template.alive:
                break
            await asyncio.sleep(0.05)
        assert not a_template.alive  # closed, not kept beside the cap
        b = await mgr.create(SandboxSpec(), owner="b")
        d = await mgr.create(SandboxSpec(), owner="d")  # b and c both hold live guests
        assert isinstance(backend._boxes[d.id].guest, GuestProcess)
        assert isinstance(backend._boxes[b.id].guest, TemplateGuest)
        assert len(templates.running) == 2
        assert (await mgr.run_code(d.id, RunCode(code="6 * 7"))).text == "42"
        for info in (b, c, d):
            await mgr.destroy(info.id)


async def test_a_cancelled_or_failed_start_costs_only_its_own_create(
    data_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create cancelled while its tenant's template starts is cancelled (not a sandbox
    started afresh behind the caller's back), and leaves the other tenants' templates in
    use; a template that fails to start on a system where another runs fails that key
    alone, for a while. Failed before (the red team's find): the cancel was taken for a
    failed start, which marked the system failed, and every tenant's guests started afresh
    from then on, for the manager's life."""
    data_dir = data_root / "template-cancel"
    data_dir.mkdir()
    real_start = Template.start
    async with SandboxManager(make_settings(data_dir)) as mgr:
        backend = mgr._backend("bubblewrap")
        templates = backend._templates
        alice = await mgr.create(SandboxSpec(), owner="alice")
        # Templates started from now on say ready half a second late (the cancel lands
        # while the start waits for it).
        real_argv = backend._argvs.template
        backend._argvs.template = lambda system: [
            "/bin/sh",
            "-c",
            'sleep 0.5; exec "$@"',
            "sh",
            *real_argv(system),
        ]
        loop_errors: list[dict[str, Any]] = []
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: loop_errors.append(context))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(mgr.create(SandboxSpec(), owner="mallory"), 0.2)
        await mgr.settle()
        for _ in range(40):  # the cancelled template's close, then its collection, where
            await asyncio.sleep(0.05)  # asyncio says if a future's error was never read
            gc.collect()
        assert loop_errors == [], loop_errors
        loop.set_exception_handler(None)
        assert templates.failed == set()
        bob = await mgr.create(SandboxSpec(), owner="bob")
        mallory = await mgr.create(SandboxSpec(), owner="mallory")  # tried again, and up
        for info in (alice, bob, mallory):
            assert isinstance(backend._boxes[info.id].guest, TemplateGuest), info.owner
            await mgr.destroy(info.id)

        async def broken_start(self: Template, argv: list[str], timeout_s: float) -> None:
            if "eve" in self.name:
                raise bubblewrap_template.TemplateGone("it did not start today")
            await real_start(self, argv, timeout_s)

        monkeypatch.setattr(Template, "start", broken_start)
        eve = await mgr.create(SandboxSpec(), owner="eve")
        assert isinstance(backend._boxes[eve.id].guest, GuestProcess)  # afresh, and working
        assert (await mgr.run_code(eve.id, RunCode(code="6 * 7"))).text == "42"
        assert templates.failed == set()
        alice = await mgr.create(SandboxSpec(), owner="alice")
        assert isinstance(backend._boxes[alice.id].guest, TemplateGuest)
        monkeypatch.setattr(Template, "start", real_start)
        again = await mgr.create(SandboxSpec(), owner="eve")  # not retried at once
        assert isinstance(backend._boxes[again.id].guest, GuestProcess)
        for info in (eve, alice, again):
            await mgr.destroy(info.id)


def _pidfds_and_uid_locks() -> tuple[int, int]:
    pidfds = locks = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        pidfds += target == "anon_inode:[pidfd]"
        locks += target.startswith("/run/sandlot/uids")
    return pidfds, locks


@pytest.mark.parametrize(
    "where",
    [
        "while its launcher is forked",
        "while bwrap starts",
        "before its guest joins",
        "while its guest joins",
    ],
)
async def test_a_create_cancelled_at_the_join_unwinds_at_once_and_leaves_nothing_open(
    data_root: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A create cancelled while bwrap makes the namespaces or while its child waits at its
    block-fd (an HTTP client gone, a timeout) unwinds at once and leaves nothing open and
    nothing running. Failed before (a red team's side find, 2026-11-27): while the guest
    joined, the guest was killed but never waited for, and its pidfd stayed open (3-4 in 40
    creates cancelled at random points); before it joined, bwrap's blocked child outlived its
    killed bwrap, holding the launcher's pipes, and the launcher's wait ran to its 5 s
    deadline. A chain started outside the sandbox's cgroup (tried 2026-11-28) left bwrap's
    children running for good: nothing running is asserted too."""
    async with SandboxManager(make_settings(data_root)) as mgr:
        warm = await mgr.create(SandboxSpec())  # the template is up
        await mgr.destroy(warm.id)
        await mgr.settle()
        before = _pidfds_and_uid_locks()
        # Another manager's sandboxes of the same uids (the session's) are not this one's.
        uids = (mgr.settings.uid_base, mgr.settings.uid_count)
        others = {p.pid for p in leaks.running_in_uids(*uids)}
        blocked = asyncio.Event()

        async def joins_for_ever(guest: TemplateGuest, notify_r: int, timeout_s: float) -> None:
            os.close(notify_r)
            blocked.set()
            await asyncio.Event().wait()

        async def never_joins(*_: object) -> TemplateGuest:
            blocked.set()
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        async def no_volume_yet(*_: object, **__: object) -> None:
            blocked.set()
            await asyncio.Event().wait()

        send = bubblewrap_template.Template._send

        async def launcher_asked(
            self: bubblewrap_template.Template, message: bytes, fds: list[int]
        ) -> None:
            # The template forks the launcher (which enters the cgroup and runs bwrap) while
            # the create is cancelled: its reply comes to nobody.
            await send(self, message, fds)
            if b'"launch"' in message:
                blocked.set()
                await asyncio.Event().wait()

        if where == "while its launcher is forked":
            monkeypatch.setattr(bubblewrap_template.Template, "_send", launcher_asked)
        elif where == "while its guest joins":
            monkeypatch.setattr(bubblewrap_forks, "_joined", joins_for_ever)
        elif where == "before its guest joins":
            monkeypatch.setattr(bubblewrap_backend.BubblewrapBackend, "_join", never_joins)
        else:
            monkeypatch.setattr(bubblewrap_backend, "make_sandbox_disk", no_volume_yet)
        create = asyncio.ensure_future(mgr.create(SandboxSpec()))
        async with asyncio.timeout(15):
            await blocked.wait()
        loop = asyncio.get_running_loop()
        cancelled_at = loop.time()
        create.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await create
        # Not a speed check: the only way to take this long is the launcher's 5 s deadline.
        assert loop.time() - cancelled_at < 3.0
        await mgr.settle()
        assert _pidfds_and_uid_locks() == before
        assert [p for p in leaks.running_in_uids(*uids) if p.pid not in others] == []


def _after_preload(probe: str) -> str:
    """What ``probe`` prints in a ``python3 -I -S`` (the template's flags) that has imported
    the guest's template and run its ``preload()``."""
    guest = launch.GUEST_SOURCE_DIR
    setup = f"import sys; sys.path.insert(0, {str(guest)!r}); import template; template.preload()"
    out = subprocess.run(
        ["/usr/bin/python3", "-I", "-S", "-c", f"{setup}\n{probe}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


async def test_the_template_runs_nothing_of_the_site_directories() -> None:
    """The template is root outside the sandbox: what it imports before it forks is the
    standard library and the guest's own modules, never a package's (.pth lines,
    sitecustomize, site-packages), which each kernel loads inside its sandbox. Loading them
    once in the template would save 4-6 ms a python-data sandbox (measured, issue 13's
    thirteenth pass) by running a package's code as that root."""
    probe = (
        "import json; print(json.dumps([sorted(m for m, mod in sys.modules.items() "
        "if '-packages' in (getattr(mod, '__file__', None) or '')), "
        "'sitecustomize' in sys.modules, any('-packages' in p for p in sys.path)]))"
    )
    assert json.loads(_after_preload(probe)) == [[], False, False]


async def test_the_template_names_every_guest_module_for_its_kernels_to_hide() -> None:
    """Each kernel forked from a template's guest hides the guest's modules from its user's
    imports by the names the template took (``kernel.GUEST_MODULES``): that list must be
    every guest module, none imported later (the kernel then looks at no other module:
    ~1.2 ms and ~240 pages copied on write less a kernel)."""
    names = _after_preload("import kernel; print(' '.join(sorted(kernel.guest_modules())))")
    assert names.split() == [p.stem for p in launch.guest_sources()]


async def test_the_fds_of_a_request_are_closed_when_a_later_one_cannot_be_opened(
    tmp_path: Path,
) -> None:
    """A request's fds go into its hand-over list as each is opened: the guest's request
    opened its cgroup files in one list first, so a file that could not be opened left the
    ones before it open, and raised a bare OSError instead of the create's typed error."""
    opened = tmp_path / "procs"
    opened.write_text("")
    mine: list[int] = []
    theirs: list[int] = []
    before = sorted(os.listdir("/proc/self/fd"))
    with (
        pytest.raises(SandboxStartError, match=r"could not join it: .*missing"),
        bubblewrap_forks.handed_over(mine, theirs),
    ):
        bubblewrap_forks._open_into(
            theirs,
            [opened, tmp_path / "missing"],
            os.O_WRONLY,
            "the sandbox's guest could not join it",
        )
    assert sorted(os.listdir("/proc/self/fd")) == before

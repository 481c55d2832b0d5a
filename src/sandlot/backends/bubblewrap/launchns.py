"""The launch namespace: a mount namespace the launchers start bwrap in, holding none of the
host's per-sandbox mounts.

A new sandbox's mount namespace is a copy of the one bwrap starts in, and bwrap makes each of
its ~20 binds with a parse of that namespace's whole mount table. In the manager's own
namespace every live sandbox has its workspace mounted, so each create cost more than the
last: 49 ms with none live, 124-158 ms with 750-999 (``bench/scale.py``, BENCHMARKS.md; the
kernel's mount table printing and bwrap's parsing were most of it). The launchers enter this
namespace instead (``nsenter --mount``): a private copy of the host's, made when the backend
first starts a sandbox, in which no sandbox's volume is ever mounted (the manager attaches a
new sandbox's volume in its own namespace once bwrap has made it: ``mountns.py``).

Pinned by a bind mount of its namespace file at ``<instance dir>/launch-ns`` (so it outlives
the thread that made it, and a crashed manager's is found and removed by the next start's
sweep of its instance). Root's backends only, with the kernel's mount API (mountns.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path

from sandlot.backends import mountns
from sandlot.backends.mountns import (
    CLONE_FS,
    CLONE_NEWNS,
    MS_BIND,
    MS_PRIVATE,
    MS_REC,
)

PIN = "launch-ns"
_OCTAL = re.compile(rb"\\([0-7]{3})")


def make(pin: Path, clean_below: Path, needs: Sequence[str]) -> None:
    """Make the launch namespace and pin it at ``pin`` (an existing one there is kept),
    without the mounts the host has below ``clean_below`` (the volumes of sandboxes already
    live, or being made, as it is copied) and without every mount that none of ``needs``,
    the paths bwrap and the sandboxes use, lies on or under (:func:`unneeded`).

    The kernel refuses to pin a mount namespace whose id is not above the pinning thread's
    own (EINVAL: its guard against a namespace holding itself), and since Linux 6.18 a new
    namespace's id comes from its CPU's batch of ids, which can be older than the one the
    manager runs in wherever that is not the host's first (a container, a pod, bwrap: 143
    and 216 of 300 refused in a bwrap on 2 CPUs, 2026-12-06, and the manager ran without).
    The manager's own namespace's id came from some CPU's batch, and each CPU's ids only
    grow, so one more try on each CPU finds a newer id unless that CPU is no longer the
    manager's to use.

    Raises:
        OSError: it could not be made or pinned (nothing is left behind).
    """
    if pinned(pin):
        return
    pin.touch(mode=0o600)
    made = False
    try:
        # Every CPU of the machine, not this thread's mask: the thread may be bound to one.
        cpus = (None, *range(os.cpu_count() or 1))
        made = any(_make_on(cpu, pin, clean_below, needs) for cpu in cpus)
    finally:
        if not made:
            with contextlib.suppress(OSError):
                pin.unlink()
    if not made:
        raise OSError(errno.EINVAL, f"pin the launch namespace at {pin}: no newer id")


def _make_on(cpu: int | None, pin: Path, clean_below: Path, needs: Sequence[str]) -> bool:
    """One try of :func:`make`, its namespace made on ``cpu`` (None: where the thread is);
    False if the kernel refused the pin as a namespace older than ours."""
    entered = threading.Event()
    done = threading.Event()
    failure: list[BaseException] = []
    tid: list[int] = []

    def visit() -> None:
        # This thread moves into the new namespace and stays there until it is pinned: its
        # namespace file is what the pin binds.
        try:
            if cpu is not None:
                # This thread only, which ends with the try; a CPU outside the manager's
                # cpuset is refused (EINVAL), and not tried.
                try:
                    os.sched_setaffinity(0, {cpu})
                except OSError:
                    return
            _ok(mountns._libc.unshare(CLONE_FS | CLONE_NEWNS), "unshare(CLONE_NEWNS)")
            # Private all the way down: nothing mounted on the host later (other sandboxes'
            # volumes, docker's layers) reaches it, and nothing made in it reaches the host.
            _ok(
                mountns._libc.mount(None, b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None),
                "mount --make-rprivate /",
            )
            _unmount(clean_below, needs)
            tid.append(threading.get_native_id())
        except BaseException as exc:
            failure.append(exc)
        finally:
            entered.set()
        done.wait()

    thread = threading.Thread(target=visit, name="sandlot-launchns", daemon=True)
    thread.start()
    try:
        entered.wait()
        if failure:
            raise failure[0]
        if not tid:
            return False  # the CPU was not ours
        source = os.fsencode(f"/proc/self/task/{tid[0]}/ns/mnt")
        flags = ctypes.c_ulong(MS_BIND)
        if mountns._libc.mount(source, os.fsencode(pin), None, flags, None) == 0:
            return True
        if (err := ctypes.get_errno()) != errno.EINVAL:
            raise OSError(err, f"pin the launch namespace at {pin}")
        return False
    finally:
        done.set()
        thread.join()


def _mount_points() -> list[str]:
    """This thread's mount namespace's mount points (not the process's)."""
    with open("/proc/thread-self/mountinfo", "rb") as f:
        escaped = [line.split()[4] for line in f]
    # \040 and the like are how mountinfo spells a space, a tab, a newline or a backslash.
    return [os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m[1], 8)]), p)) for p in escaped]


def _detach_all(points: list[str]) -> None:
    for point in sorted(points, key=len, reverse=True):  # deepest first
        mountns.detach(point, missing_ok=True)


def _unmount(root: Path, needs: Sequence[str]) -> None:
    """Unmount, in this thread's mount namespace, everything mounted below ``root``, every
    sandbox volume of any other data directory (``.../sandboxes/sb-*/volume``) and every
    mount none of ``needs`` lies on or under."""
    prefix = str(root) + "/"
    points = _mount_points()
    doomed = set(unneeded(points, needs))
    _detach_all([p for p in points if p in doomed or p.startswith(prefix) or _is_volume(Path(p))])


def unneeded(points: Sequence[str], needs: Sequence[str]) -> list[str]:
    """The mount points of ``points`` that no path of ``needs`` lies on or under: neither
    ``/``, nor a mount on the way to a needed path (``/usr`` for ``/usr/bin/bwrap``), nor
    one inside it (``/dev/pts`` for ``/dev``).

    bwrap parses the whole mount table of the namespace it starts in for each of its ~20
    binds, and copies every mount of it into the sandbox's new namespace before it unmounts
    them again: a host's /sys tree (a dozen cgroup mounts on v1), docker's layers or a
    Kubernetes node's pod volumes cost every create and serve none.
    """
    spelled = {os.path.normpath(n) for n in needs}  # "/usr/" must not keep "/usr2"
    if "/" in spelled:
        return []  # everything lies inside it

    def needed(point: str) -> bool:
        on_the_way = point + "/"
        return point == "/" or any(
            n == point or n.startswith(on_the_way) or point.startswith(n + "/") for n in spelled
        )

    return [p for p in points if not needed(p)]


def _is_volume(point: Path) -> bool:
    return (
        point.name == "volume"
        and point.parent.name.startswith("sb-")
        and point.parent.parent.name in ("sandboxes", "docker-sandboxes")
    )


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(ctypes.get_errno(), what)


def pinned(pin: Path) -> bool:
    """Whether a namespace is pinned at ``pin`` (a mount of the nsfs file there)."""
    try:
        return os.path.ismount(pin)
    except OSError:
        return False


def drop(pin: Path) -> None:
    """Unpin and remove it (idempotent); the namespace ends with its last launcher."""
    mountns.detach(str(pin), missing_ok=True)
    with contextlib.suppress(FileNotFoundError):
        pin.unlink()

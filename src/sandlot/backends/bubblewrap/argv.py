"""The argvs a bubblewrap sandbox is started with: bwrap's (the walls, in the order
DESIGN.md lists as having passed every probe here), the launch chain's before it where guests
start afresh (sh into the cgroup, nsenter or setpriv to the sandbox's uid), and a guest
template's (template.py). Pure: the backend (backend.py) makes what they name."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sandlot.backends import hostnet, mountns
from sandlot.backends.base import GuestSpec
from sandlot.backends.bubblewrap.box import SANDBOX_UID, Box
from sandlot.backends.bubblewrap.forks import sealed_memfd
from sandlot.backends.bubblewrap.rootless import SETPRIV
from sandlot.backends.bubblewrap.seccomp import build_filter
from sandlot.backends.bubblewrap.template import LAUNCHER as TEMPLATE_LAUNCHER
from sandlot.backends.launch import (
    GUEST_DIR_INSIDE,
    GUEST_PYTHON,
    SANDBOX_PATH,
    WORKSPACE_INSIDE,
    guest_argv,
    identity_files,
)
from sandlot.backends.rootfs import carries_identity

HOST_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
ETC_BINDS = (
    "/etc/ld.so.cache",
    "/etc/alternatives",
    "/etc/localtime",
    "/etc/python3",
    "/etc/python3.11",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/mime.types",
    # Debian's matplotlib reads its defaults from /etc and fonts through fontconfig: without
    # these, `import matplotlib` fails inside the sandbox even where the host has it.
    "/etc/matplotlibrc",
    "/etc/fonts",
)
# A networked sandbox's resolver files: resolv.conf is hostnet.sandbox_resolv_conf()'s.
ETC_NETWORK_BINDS = ("/etc/gai.conf",)
# Written to (by root, or rootless by the user into a delegated cgroup) before the switch to
# the sandbox uid, so the process (and everything it will ever fork) is inside the cgroup
# before a single instruction of sandbox code runs. Then it waits for "go" on stdin (sh's
# `read` takes a pipe a byte at a time in dash, bash and busybox: nothing after it is eaten;
# EOF, a manager gone, ends it), while the manager makes the sandbox's network (and, where
# bwrap binds them, its disk and files: otherwise they are made while bwrap starts). It
# writes "0", itself, to Cgroup.enter_files: on v1 its thread's `tasks`, which the kernel
# moves without waiting out an RCU grace period (7-20 ms a create through cgroup.procs,
# BENCHMARKS.md); on v2, cgroup.procs, whose wait the disk's making overlaps.
PLACE_IN_CGROUP = (
    'while [ "$1" != "--" ]; do echo 0 > "$1" || exit 125; shift; done; shift; '
    'read -r go && [ "$go" = go ] || exit 125; exec "$@"'
)
BWRAP = "/usr/bin/bwrap"
NSENTER = "/usr/bin/nsenter"
# No LANG: in the C locale sh and nsenter load no locale files (~0.2 ms of CPU a create,
# BENCHMARKS.md); bwrap clears the environment, and the guest gets its own (guest_env).
HOST_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
# Where a template's guest joins the namespaces (template.py), bwrap's child waits on its
# stdin (--block-fd) once it has made them, and is killed once the guest is in: no exec (a
# placeholder `sh` that read its stdin cost ~2.5 ms of CPU a create). Should the manager die
# first, the EOF of that stdin lets the child go on, and this ends it.
PLACEHOLDER = ("/bin/true",)


def setenv_args(env: dict[str, str]) -> list[str]:
    args: list[str] = []
    for key, value in env.items():
        args += ["--setenv", key, value]
    return args


def seccomp_pipe(network: bool) -> int:
    """The read end of a pipe holding the sandbox's seccomp filter, for bwrap's --seccomp."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    try:
        os.write(write_fd, build_filter(network))
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    return read_fd


def env_args(env: dict[str, str]) -> int:
    """A sealed memfd with ``env`` as bwrap's ``--setenv`` options, NUL-separated, for its
    ``--args``: off every command line. The caller closes it."""
    return sealed_memfd("sandlot-guest-env", b"".join(a.encode() + b"\0" for a in setenv_args(env)))


def mask_binds(masks: Sequence[mountns.Mask]) -> list[str]:
    """/proc's masks as bwrap's binds, where the manager cannot make them itself."""
    return [arg for m in masks for arg in ("--ro-bind", m.source, m.target)]


def system_binds(system: Path | None) -> list[str]:
    """The sandbox's system: its environment's whole tree as ``/``, or the host's /usr
    and the links into it (host mode: the backend's ``_system_root``)."""
    if system is not None:
        return ["--ro-bind", str(system), "/"]
    argv = ["--ro-bind", "/usr", "/usr"]
    for link in map(Path, HOST_LINKS):
        if link.is_symlink():
            argv += ["--symlink", str(link.readlink()), str(link)]
        elif link.is_dir():
            argv += ["--ro-bind", str(link), str(link)]
    return argv


@dataclass
class Argvs:
    """A backend's launchers: ``etc_dir`` holds the generated identity files (passwd,
    group, hosts, nsswitch.conf), ``guest_dir`` the guest's code; ``rootless``: bwrap runs
    as this very user (rootless.py)."""

    etc_dir: Path
    guest_dir: Path
    rootless: bool

    def bwrap(
        self,
        box: Box,
        spec: GuestSpec,
        seccomp_fd: int,
        info_fd: int | None = None,
        *,
        env_fd: int | None = None,
        manager_mounts: bool = False,
        templated: bool = False,
        proc_masks: Sequence[str] = (),
        rlimits: Sequence[str] = (),
    ) -> list[str]:
        """bwrap's argv; the guest's environment is read from ``env_fd`` (:func:`env_args`).
        With ``manager_mounts`` the manager attaches /proc's masks and the volume (/workspace,
        /tmp) once bwrap has made the namespace (the backend's ``_mount_inside``), and bwrap
        only makes their mount points; else bwrap binds ``proc_masks`` (:func:`mask_binds`).
        ``rlimits``: prlimit's options, rootless. ``templated`` (with ``manager_mounts``): no
        pid namespace and no /proc (the template's guest makes both: template.py), and bwrap's
        child waits at its --block-fd instead of exec'ing the guest (PLACEHOLDER)."""
        if templated:
            # --unshare-all less the pid namespace.
            argv = [BWRAP, "--unshare-user", "--unshare-ipc", "--unshare-uts"]
            argv += ["--unshare-cgroup-try", "--disable-userns"]
            argv += [] if spec.network else ["--unshare-net"]
        else:
            argv = [BWRAP, "--unshare-all", "--unshare-user", "--disable-userns"]
        if info_fd is not None:
            argv += ["--info-fd", str(info_fd)]  # the sandbox's first pid, for devpts.py
        if templated:
            argv += ["--block-fd", "0"]  # its child waits there for the guest (PLACEHOLDER)
        if spec.network:
            # The namespace it is started in: the sandbox's own (netns.py), never the host's.
            assert box.net is not None
            argv.append("--share-net")
        argv += [
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--hostname",
            "sandbox",
            "--die-with-parent",
            "--new-session",
            # The guest is pid 1 itself: bwrap's own init would run as the sandbox uid, hold
            # the pipes to the host and be dumpable, so sandboxed code could write to its
            # memory and forge results. The guest makes itself non-dumpable instead. (A
            # template's guest is pid 1 of a pid namespace of its own.)
            *([] if templated else ["--as-pid-1"]),
            *system_binds(box.system),
            *(["--dir", "/proc"] if templated else ["--proc", "/proc"]),
            "--dev",
            "/dev",
            # Where it can, the manager puts the masks in itself, cheaper (_finish_namespace).
            *([] if manager_mounts else proc_masks),
            *(["--dir", "/tmp"] if manager_mounts else ["--bind", str(box.tmp), "/tmp"]),
        ]
        # The generated identity files over the tree's own (its mount points exist:
        # rootfs.py), unless the tree was built with them.
        argv += [] if box.system is not None else ["--dir", "/etc"]
        if box.system is None or not carries_identity(box.system):
            for name in identity_files():
                argv += ["--ro-bind", str(self.etc_dir / name), f"/etc/{name}"]
        # A tree has its own /etc; the host's resolver files only for network=True.
        etc_binds = () if box.system is not None else ETC_BINDS
        for path in etc_binds + (ETC_NETWORK_BINDS if spec.network else ()):
            if Path(path).exists():
                argv += ["--ro-bind", path, path]
        if spec.network and (resolv := hostnet.sandbox_resolv_conf()).exists():
            argv += ["--ro-bind", str(resolv), "/etc/resolv.conf"]
        if manager_mounts:
            argv += ["--dir", WORKSPACE_INSIDE]
        else:
            argv += ["--bind", str(box.workspace), WORKSPACE_INSIDE]
        argv += [
            "--ro-bind",
            str(self.guest_dir),
            GUEST_DIR_INSIDE,
            "--chdir",
            WORKSPACE_INSIDE,
            "--clearenv",
            # An argv is every host user's to read in /proc, for bwrap's whole life: the
            # guest's environment (the caller's env in it) is read from a memfd instead, and a
            # template's guest gets its own in one (template.py), so bwrap's child needs none.
            *(setenv_args({"PATH": SANDBOX_PATH}) if templated else ["--args", str(env_fd)]),
            "--seccomp",
            str(seccomp_fd),
            # The host's /usr hangs off a tmpfs root, made read-only last; a tree is the
            # root itself, bound read-only (a remount of it is one more parse of the mount
            # table, ~0.1 ms of bwrap's CPU a create).
            *(["--remount-ro", "/"] if box.system is None else []),
        ]
        # Rootless: set inside the sandbox's user namespace, where RLIMIT_NPROC counts this
        # sandbox.
        argv += rlimits
        return argv + (list(PLACEHOLDER) if templated else guest_argv())

    def chain(
        self,
        box: Box,
        spec: GuestSpec,
        seccomp_fd: int,
        info_fd: int | None,
        *,
        env_fd: int | None,
        manager_mounts: bool,
        pin: Path | None,
        proc_masks: Sequence[str] = (),
        rlimits: Sequence[str] = (),
    ) -> list[str]:
        """sh (into the cgroup, then the wait for "go"), nsenter or setpriv (to the sandbox's
        uid), bwrap and the guest: where guests start afresh (a template forks the launcher
        otherwise: the backend's ``_launch_templated``). ``pin``: the launch namespace
        (the backend's ``_launch_pin``), where the manager attaches the volume."""
        # The host-side chain (sh as root, nsenter or setpriv, bwrap) runs with a fixed
        # environment and absolute paths: a caller's env (PATH, LD_PRELOAD, ...) reaching a
        # root process would run code of their choosing as root. Their env is set inside the
        # sandbox only.
        # sh moves itself ("0": the writer) through Cgroup.enter_files, before bwrap.
        enter_files = [str(p) for p in box.cgroup.enter_files]
        place = ["/bin/sh", "-c", PLACE_IN_CGROUP, "sh", *enter_files, "--"]
        if self.rootless:
            # bwrap runs as this user, unprivileged; into the delegated cgroup if there is one.
            # Tied to us by a death signal, as the root path is (the sh before it by EOF on
            # its stdin): without it a killed manager left its sandboxes running, and with no
            # cgroup no sweep could find them.
            return [
                *place,  # no cgroup: no write, but the wait for "go" all the same
                SETPRIV,
                "--pdeathsig=SIGKILL",
                "--",
                *self.bwrap(box, spec, seccomp_fd, env_fd=env_fd, rlimits=rlimits),
            ]
        enter = [f"--net={box.net.path}"] if box.net is not None else []
        # Only where the manager attaches the volume: the launch namespace has none for bwrap
        # to bind.
        if pin is not None and manager_mounts:
            enter.append(f"--mount={pin}")
        bwrap = self.bwrap(
            box,
            spec,
            seccomp_fd,
            info_fd,
            env_fd=env_fd,
            manager_mounts=manager_mounts,
            proc_masks=proc_masks,
        )
        if enter:
            # nsenter drops to the sandbox's uid itself once inside (setgroups(0), setgid,
            # setuid, as setpriv does): one exec fewer per create (~1.5 ms of CPU). Its
            # death signal is bwrap's own --die-with-parent, set at bwrap's start; a manager
            # gone before it leaves a guest that ends at the EOF of its stdin.
            drop = [f"--setuid={box.uid}", f"--setgid={box.uid}"]
            return [*place, NSENTER, *enter, *drop, "--", *bwrap]
        return [
            *place,
            SETPRIV,
            f"--reuid={box.uid}",
            f"--regid={box.uid}",
            "--clear-groups",
            "--pdeathsig=SIGKILL",
            "--",
            *bwrap,
        ]

    def template(self, system: Path | None) -> list[str]:
        """bwrap as root for a template (template.py): no user namespace, every capability,
        the sandbox's system read-only and the guest at the path sandboxes see; the fd of its
        socket follows (Template.start)."""
        argv = [BWRAP, "--die-with-parent", "--new-session", "--cap-add", "ALL"]
        argv += [*system_binds(system), "--proc", "/proc", "--dev", "/dev"]
        if system is None:
            argv += ["--dir", "/etc"]
            for path in ETC_BINDS:
                if Path(path).exists():
                    argv += ["--ro-bind", path, path]
        argv += ["--ro-bind", str(self.guest_dir), GUEST_DIR_INSIDE, "--chdir", "/"]
        argv += ["--clearenv", *setenv_args({"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"})]
        return [*argv, "--", GUEST_PYTHON, "-I", "-S", "-c", TEMPLATE_LAUNCHER % GUEST_DIR_INSIDE]

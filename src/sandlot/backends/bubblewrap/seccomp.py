"""The seccomp filter loaded into every bubblewrap sandbox.

Namespaces and a dropped capability set already stop most of these calls; the filter is the
second wall, and it closes kernel surfaces (bpf, io_uring, perf, keyrings) that no sandboxed
program needs and that have a history of privilege-escalation bugs, and Linux AIO, whose one
host-wide pool a sandbox could drain.
"""

from __future__ import annotations

import errno
import functools
import os
import socket

from sandlot.errors import BackendUnavailable

DENIED_SYSCALLS = (
    # debugging other processes
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    # mounts and namespaces
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "unshare",
    "setns",
    # kernel surfaces
    "kexec_load",
    "kexec_file_load",
    "bpf",
    "keyctl",
    "add_key",
    "request_key",
    "perf_event_open",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "quotactl",
    "userfaultfd",
    "open_by_handle_at",
    "name_to_handle_at",
    "lookup_dcookie",
    "syslog",
    "iopl",
    "ioperm",
    "vhangup",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # clocks
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
)

# Linux AIO draws from one pool for the whole host (fs.aio-max-nr, 65536 events by default),
# with no share per namespace, cgroup or uid: one sandbox's io_setup(32768), twice, left
# every other sandbox and the host's own databases EAGAIN until it was destroyed (red team,
# 2026-11-28). Refused as missing (ENOSYS), so that libaio's users fall back to plain I/O;
# glibc's POSIX aio_* runs on threads and never calls these.
UNSUPPORTED_SYSCALLS = (
    "io_setup",
    "io_destroy",
    "io_submit",
    "io_cancel",
    "io_getevents",
    "io_pgetevents",
)

CLONE_NAMESPACE_FLAGS = (
    0x00020000,  # CLONE_NEWNS
    0x02000000,  # CLONE_NEWCGROUP
    0x04000000,  # CLONE_NEWUTS
    0x08000000,  # CLONE_NEWIPC
    0x10000000,  # CLONE_NEWUSER
    0x20000000,  # CLONE_NEWPID
    0x40000000,  # CLONE_NEWNET
    0x00000080,  # CLONE_NEWTIME
)

AF_MAX = 64
# Terminal ioctls that type into a terminal or reach the console: a sandbox may own terminals
# (pty.create) but never inject keystrokes, not even into its own. The kernel reads the
# request as 32 bits: only those are compared, so high bits set cannot slip past.
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
DENIED_IOCTLS = (TIOCSTI, TIOCLINUX)
# Every call that makes a socket of a family it is told: socketpair() loads a family's module
# and reaches its code as surely as socket() does. (accept() only clones a socket that exists;
# io_uring's IORING_OP_SOCKET is closed with io_uring itself; the 32-bit socketcall() never
# runs, since a syscall of another architecture kills the process: libseccomp's default.)
FAMILY_SYSCALLS = ("socket", "socketpair")
# Offline, IP sockets still work on the sandbox's own loopback (a server a program starts is
# reachable from that sandbox): its network namespace holds nothing but `lo`, so there is no
# route out, and the host's and other sandboxes' loopbacks are other namespaces'. Netlink (the
# interfaces and routes), packet and every other family stay refused.
OFFLINE_FAMILIES = frozenset({socket.AF_UNIX, socket.AF_INET, socket.AF_INET6})
ONLINE_FAMILIES = frozenset({socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK})


@functools.lru_cache(maxsize=2)
def build_filter(network: bool) -> bytes:
    """The BPF program (as bwrap's ``--seccomp FD`` expects it) for one network setting.

    Raises:
        BackendUnavailable: libseccomp (the ``pyseccomp`` binding) is missing.
    """
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as exc:
        raise BackendUnavailable(
            "pyseccomp could not load libseccomp; install Debian's libseccomp2"
        ) from exc

    flt = sc.SyscallFilter(defaction=sc.ALLOW)
    for refusal, names in ((errno.EPERM, DENIED_SYSCALLS), (errno.ENOSYS, UNSUPPORTED_SYSCALLS)):
        for name in names:
            try:
                flt.add_rule(sc.ERRNO(refusal), name)
            except (RuntimeError, ValueError, OSError):
                continue  # a syscall this architecture does not have
    for flag in CLONE_NAMESPACE_FLAGS:
        flt.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    # clone3 passes flags in memory a filter cannot read; ENOSYS makes libc fall back to clone.
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    # A process may set its own limits (pid 0: setrlimit() is prlimit64(0, ...)), never
    # another's: lowering the guest's file limit to 3 wedged every later call.
    flt.add_rule(sc.ERRNO(errno.EPERM), "prlimit64", sc.Arg(0, sc.NE, 0))
    for request in DENIED_IOCTLS:
        flt.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    allowed = ONLINE_FAMILIES if network else OFFLINE_FAMILIES
    for call in FAMILY_SYSCALLS:
        for family in range(AF_MAX):
            if family not in allowed:
                flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.EQ, family))
        flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.GE, AF_MAX))
    # libseccomp writes to a file descriptor, so give it an anonymous in-memory file.
    fd = os.memfd_create("sandlot-seccomp", os.MFD_CLOEXEC)
    with os.fdopen(fd, "w+b") as buffer:
        flt.export_bpf(buffer)
        buffer.seek(0)
        return buffer.read()

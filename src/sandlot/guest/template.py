"""The template guest: one interpreter per system, imported once, forked into each new sandbox.

Standard library only, Python >= 3.9 (shipped with the guest). A guest started by bwrap pays
an interpreter's start and the supervisor's imports, ~10 ms of CPU of a ~30 ms lifecycle
(BENCHMARKS.md, issue 13). The template pays them once: the backend starts it as root, in a
mount namespace that looks like the sandbox's system (the same ``/usr`` or tree, this
directory at ``/opt/sandlot``), and for each new sandbox it forks a child that *joins* the
namespaces bwrap made and becomes that sandbox's guest. bwrap still builds the sandbox (user,
mount, network, ipc, uts and cgroup namespaces, the root file system, ``--disable-userns``), and
its child waits at ``--block-fd`` until the host kills it once we have joined; it no longer
makes the pid namespace.

What the child keeps of the walls, in order (each step needs the one before):

1. The sandbox's cgroup, entered while the child is still root and alone (every process it
   will ever start is counted there).
2. No supplementary groups, then the network, ipc, uts and cgroup namespaces.
3. A pid namespace of its own, made by the template before the fork: the child is its pid 1,
   as bwrap's ``--as-pid-1`` guest was (``kill -9 -1`` spares it; no other process can open
   its memory). Its ``/proc`` is made by the child (the pid namespace a procfs shows is its
   maker's) while it is still in the template's mount namespace, where the host's user
   namespace allows it, then attached in the sandbox's, with bwrap's read-only covers over
   ``sys``, ``sysrq-trigger``, ``irq`` and ``bus``. The host's masks go over it next (the
   manager, told by one byte on ``notify``), before the guest is given its key.
4. bwrap's innermost user namespace, uid and gid 65534 there (the sandbox's host uid), then no
   capability at all: effective, permitted, inheritable, ambient and the bounding set.
5. A new session, death with the template, no_new_privs and the sandbox's seccomp filter,
   the same bytes bwrap loads.
6. Only its stdio left open, the guest's environment, and the supervisor's ``main``.

A failure at any step ends the child (exit 125) with the reason on the guest's stderr, which
the host reports; it never runs the supervisor half-joined.

What a forked guest shares with the other sandboxes of its template, unlike a fresh start:
its address-space layout (ASLR) and Python's string-hash secret. Neither is reachable from
another sandbox (SECURITY.md). ``random`` is reseeded by every fork (``os.register_at_fork``).

The protocol with the host (``sandlot.backends.bubblewrap.template`` and ``.forks``): one
SOCK_SEQPACKET socket, whose fd the template's argv names. The host sends ``{"id",
"cgroup_files"}`` with the fds ``NS_NAMES``, stdin, stdout, stderr, notify, config (a sealed
memfd: ``uid``, ``gid``, ``env``, ``seccomp``, ``workspace``, read by the child alone), then
``cgroup_files`` files of the cgroup to write "0" to (a request whose fds are fewer, more,
or were cut short is refused). Before that, the sandbox's bwrap: ``{"id", "launch": true,
"net", "cgroup_files"}`` with the ``LAUNCH_FDS`` (the launch mount namespace, bwrap's stdin
and stderr, its seccomp and info pipes, the launch: a sealed memfd with ``uid``, ``argv``
and ``env``, read by the child alone), the network namespace if ``net``, then the cgroup's
files: the template forks a *launcher* (:func:`launcher`) that enters them and the
namespaces, drops to the uid and execs bwrap, in place of the host's ``sh`` and ``nsenter``.
The template answers ``{"id", "pid"}`` with a pidfd of the guest or launcher (or ``{"id",
"error"}``), and ``{"exit": pid, "status": code}`` once one has ended. ``{"ready": true}``
comes first. Nothing of a sandbox's ever enters the template's memory (every later fork
would carry it): it reads ids, counts and whether a sandbox has a network, and passes fds
on.
"""

import _signal as signal
import ctypes
import fcntl
import gc
import os
import select
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
# The namespace fds a request carries, in this order.
NS_NAMES = ("user", "mnt", "net", "ipc", "uts", "cgroup")
# Joined before the mount namespace, as root (the user namespace comes last: once in it, the
# child has no capability over the namespaces bwrap made outside it).
JOINED_FIRST = (
    ("net", CLONE_NEWNET),
    ("ipc", CLONE_NEWIPC),
    ("uts", CLONE_NEWUTS),
    ("cgroup", CLONE_NEWCGROUP),
)
STDIO_FDS = 5  # stdin, stdout, stderr, notify, config
# + the cgroup's files, one per v1 hierarchy (the host sends 5 on a v1 host, 1 on v2). A
# message with more fds than this arrives cut short (MSG_CTRUNC): it is refused, never run
# with a cgroup missing.
MAX_CGROUP_FILES = 16
MAX_FDS = len(NS_NAMES) + STDIO_FDS + MAX_CGROUP_FILES
# A launcher's request (``{"launch": true, "net", "cgroup_files"}``) carries: the launch mount
# namespace, bwrap's stdin (its --block-fd), its stderr, the read end of the seccomp pipe, the
# write end of the info pipe, the launch (a sealed memfd: ``uid``, ``argv``, ``env``), then the
# sandbox's network namespace where it has one, then the cgroup's files.
LAUNCH_FDS = 6
# Where the launcher puts the seccomp and info pipes for bwrap, whose argv names them.
LAUNCH_SECCOMP_FD = 3
LAUNCH_INFO_FD = 4
# bwrap's fds are first copied to numbers from here (free ones), then put in place: putting
# one at 3 must not close another request fd that happened to be 3.
_HIGH_FD = 64
MAX_MESSAGE = 4096  # ids and counts: a longer message arrives cut short, and is refused
# bwrap's covers over /proc after its mount (its SETUP_MOUNT_PROC): read-only binds.
PROC_COVERS = ("sys", "sysrq-trigger", "irq", "bus")
# The same on every architecture (the syscalls after 424 share one table).
SYS_OPEN_TREE = 428
SYS_MOVE_MOUNT = 429
SYS_FSOPEN = 430
SYS_FSCONFIG = 431
SYS_FSMOUNT = 432
SYS_MOUNT_SETATTR = 442
FSOPEN_CLOEXEC = 1
FSCONFIG_CMD_CREATE = 6
FSMOUNT_CLOEXEC = 1
OPEN_TREE_CLONE = 1
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_SYMLINK_NOFOLLOW = 0x100
MOVE_MOUNT_F_EMPTY_PATH = 4
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_GET_DUMPABLE = 3
PR_SET_SECCOMP = 22
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECCOMP_MODE_FILTER = 2
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SIGKILL = 9
SIGCHLD = 17
FAILED = 125  # the child's exit status when it could not become the guest

_libc = ctypes.CDLL(None, use_errno=True)


def _dumps(value):
    """The guest's own JSON codec, from ``wire`` (a sibling module here, in the template):
    ``json`` would be in every guest's and kernel's ``sys.modules``, which a fresh guest's
    never holds. Imported where it is used: the host imports this module for its
    constants, and has no top-level ``wire``."""
    import wire

    return wire.dumps(value)


def _loads(text):
    import wire

    return wire.loads(text)


_libc.syscall.restype = ctypes.c_long


class MountAttr(ctypes.Structure):
    """``struct mount_attr`` (mount_setattr(2)); the host's mountns.py uses it too."""

    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class JoinFailed(Exception):
    """A step of becoming the guest failed: the child must end, not run the supervisor."""


def _check(result, what):
    if result < 0:
        err = ctypes.get_errno()
        raise JoinFailed("%s: %s" % (what, os.strerror(err)))
    return result


def _syscall(number, *args):
    return _libc.syscall(number, *args)


def _setns(fd, flag, name):
    _check(_libc.setns(fd, flag), "setns into the sandbox's %s namespace" % name)


def new_proc():
    """A detached procfs of this process's pid namespace (nosuid, nodev, noexec, as bwrap's)."""
    fs = _check(_syscall(SYS_FSOPEN, b"proc", FSOPEN_CLOEXEC), "fsopen(proc)")
    try:
        _check(_syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0), "fsconfig(proc)")
        flags = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC
        return _check(_syscall(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC, flags), "fsmount(proc)")
    finally:
        os.close(fs)


def _attach(fd, target):
    _check(
        _syscall(SYS_MOVE_MOUNT, fd, b"", AT_FDCWD, os.fsencode(target), MOVE_MOUNT_F_EMPTY_PATH),
        "move_mount onto %s" % target,
    )


def _cover_read_only(path):
    """A read-only bind of ``path`` over itself; a path this kernel lacks is left alone."""
    flags = OPEN_TREE_CLONE | os.O_CLOEXEC | AT_SYMLINK_NOFOLLOW
    fd = _syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path), flags)
    if fd < 0:
        if ctypes.get_errno() == 2:  # ENOENT
            return
        _check(fd, "open_tree(%s)" % path)
    try:
        sealed = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC
        attr = MountAttr(sealed, 0, MS_PRIVATE, 0)
        _check(
            _syscall(
                SYS_MOUNT_SETATTR, fd, b"", AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)
            ),
            "mount_setattr(%s)" % path,
        )
        _attach(fd, path)
    finally:
        os.close(fd)


def drop_capabilities(last_cap):
    """No capability left in any set, the bounding set included (it needs CAP_SETPCAP, so
    it goes first)."""
    for cap in range(last_cap + 1):
        _check(_libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "dropping capability %d" % cap)
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient")
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), data), "capset")


def load_seccomp(program):
    """no_new_privs, then the filter (a BPF program, as bwrap's ``--seccomp`` takes it)."""
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    if not program:
        raise JoinFailed("no seccomp filter given")
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    _check(
        _libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0),
        "loading the seccomp filter",
    )


def read_config(fd):
    """The guest's config (``uid``, ``gid``, ``env``, ``seccomp``, ``workspace``): a sealed
    memfd the host wrote, read here in the child, after the fork. The template never reads
    it: whatever its heap ever held, every later guest would inherit (a caller's env, read
    back from a later tenant's sandbox by its own code: the red team's find)."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size, 0) if size else b""
    if len(data) != size:
        raise JoinFailed("the guest's config was cut short")
    config = _loads(data)
    if not isinstance(config, dict):
        raise JoinFailed("the guest's config is not an object")
    return config


def join(fds, last_cap):
    """Become the sandbox's guest (the steps in this module's docstring); returns only as
    the guest, with stdio on 0-2 and nothing else open."""
    ns = dict(zip(NS_NAMES, fds))
    stdin, stdout, stderr, notify, config_fd = fds[len(NS_NAMES) : len(NS_NAMES) + STDIO_FDS]
    os.dup2(stderr, 2)  # every failure from here is told on the guest's stderr
    request = read_config(config_fd)
    for enter in fds[len(NS_NAMES) + STDIO_FDS :]:
        try:
            os.write(enter, b"0")
        except OSError as exc:
            raise JoinFailed("entering the sandbox's cgroup: %s" % exc) from None
    os.setgroups([])
    for name, flag in JOINED_FIRST:
        _setns(ns[name], flag, name)
    # Made here, in the template's mount namespace (the host's user namespace owns it, so a
    # new procfs is allowed), then attached in the sandbox's, which has none.
    proc = new_proc()
    _setns(ns["mnt"], CLONE_NEWNS, "mount")
    _attach(proc, "/proc")
    os.close(proc)
    for name in PROC_COVERS:
        _cover_read_only("/proc/" + name)
    os.write(notify, b"1")  # the host puts its masks over /proc now
    _setns(ns["user"], CLONE_NEWUSER, "user")
    gid, uid = int(request["gid"]), int(request["uid"])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    drop_capabilities(last_cap)
    os.setsid()
    # After the uid change, which clears it: the guest dies with the template, which dies
    # with the manager (its bwrap's --die-with-parent).
    _check(_libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "the death signal")
    load_seccomp(bytes.fromhex(request["seccomp"]))
    os.dup2(stdin, 0)
    os.dup2(stdout, 1)
    os.closerange(3, _open_max())
    # The whole environment: what the host's /proc/<pid>/environ shows of a fork is the
    # template's own exec-time block (PATH, LANG), never this.
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in request["env"].items()})
    try:
        os.chdir(request["workspace"])
    except OSError:
        os.chdir("/")  # the host attaches the volume there before the key (supervisor.py)


def child(fds, last_cap):
    """The forked child: join, then run the supervisor; never returns."""
    status = FAILED
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(SIGCHLD, signal.SIG_DFL)
        join(fds, last_cap)
        import supervisor

        supervisor.main([sys.argv[0]])
        status = 0
    except BaseException as exc:  # told on the guest's stderr (fd 2 once join began)
        _tell("sandlot template", exc)
    finally:
        os._exit(status)


def _tell(who, exc):
    """Why a forked child ends, on its stderr (fd 2), as far as that can be written."""
    try:
        os.write(2, ("%s: %s\n" % (who, exc)).encode("utf-8", "replace"))
    except OSError:
        pass


def preload():
    """Import everything a guest imports at its start or on its first calls, and (the
    ``importlib`` pair) what the common namespace-package .pth line (setuptools'
    "-nspkg.pth": matplotlib's, in python-data) imports in every kernel's site.main(): ~1.3
    ms and ~70 pages copied on write there. Standard library only: nothing of the site
    directories' own runs in the template, which is root outside the sandbox."""
    import importlib.machinery
    import importlib.util  # noqa: F401
    import resource  # noqa: F401
    import shutil  # noqa: F401
    import subprocess  # noqa: F401
    import tempfile  # noqa: F401

    import calls  # noqa: F401
    import cells  # noqa: F401
    import files  # noqa: F401
    import kernel  # noqa: F401
    import ptys  # noqa: F401
    import shells  # noqa: F401
    import supervisor  # noqa: F401


def spawn(sock, request, fds, own_pid_ns, last_cap):
    """Fork one guest into a pid namespace of its own; answer with its pid and a pidfd."""
    _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    try:
        pid = os.fork()
        if pid == 0:
            child(fds, last_cap)
    finally:
        # Back to our own for the next fork (a second unshare would be refused).
        _setns(own_pid_ns, CLONE_NEWPID, "template's pid")
    _answer(sock, request, pid)


def start_launcher(sock, request, fds):
    """Fork one sandbox's launcher (:func:`launcher`); answer with its pid and a pidfd."""
    pid = os.fork()
    if pid == 0:
        launcher(fds, bool(request.get("net")))
    _answer(sock, request, pid)


def _answer(sock, request, pid):
    pidfd = os.pidfd_open(pid)
    try:
        socket.send_fds(sock, [_dumps({"id": request["id"], "pid": pid}).encode()], [pidfd])
    finally:
        os.close(pidfd)


def launcher(fds, has_net):
    """The forked child that becomes a sandbox's bwrap, in place of the host's ``sh`` and
    ``nsenter`` (two execs, ~2 ms of CPU a create: BENCHMARKS.md, issue 13): into the
    sandbox's cgroup first, while still root and alone (bwrap and every process it makes are
    counted there, and a destroy's emptying of the cgroup catches them all), then its network
    namespace if it has one, the launch mount namespace (the host's, less the sandboxes'
    volumes: launchns.py), no groups and the sandbox's uid (no capability left), a death
    signal, and bwrap's fds in place; then bwrap. Never returns."""
    status = FAILED
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(SIGCHLD, signal.SIG_DFL)
        mnt, stdin, stderr, seccomp, info, launch_fd = fds[:LAUNCH_FDS]
        rest = list(fds[LAUNCH_FDS:])
        net = rest.pop(0) if has_net else None
        os.dup2(stderr, 2)  # every failure from here is told on bwrap's stderr
        launch = read_config(launch_fd)
        for enter in rest:
            try:
                os.write(enter, b"0")
            except OSError as exc:
                raise JoinFailed("entering the sandbox's cgroup: %s" % exc) from None
        if net is not None:
            _setns(net, CLONE_NEWNET, "net")
        _check(_libc.setns(mnt, CLONE_NEWNS), "setns into the launch namespace")
        os.chdir("/")
        uid = int(launch["uid"])
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        # After the uid change, which clears it; bwrap's --die-with-parent sets it again.
        _check(_libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "the death signal")
        placed = [stdin, stderr, stderr, seccomp, info]
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, _HIGH_FD) for fd in placed]
        for target, fd in enumerate(high):
            os.dup2(fd, target)
        os.closerange(len(placed), _open_max())
        argv = [str(arg) for arg in launch["argv"]]
        env = {str(k): str(v) for k, v in launch["env"].items()}
        os.execve(argv[0], argv, env)
    except BaseException as exc:
        _tell("sandlot launcher", exc)
    finally:
        os._exit(status)


def _open_max():
    limit = os.sysconf("SC_OPEN_MAX")
    return limit if limit > 0 else 65536


def serve(sock):
    own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last_cap = int(f.read())
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w)
    signal.signal(SIGCHLD, lambda signum, frame: None)
    preload()
    # Every guest module is imported now, and none can be imported after: each kernel forked
    # from our guests hides these names from its user's imports without looking at every
    # module.
    sys.modules["kernel"].GUEST_MODULES = tuple(sys.modules["kernel"].guest_modules())
    sys.modules["procs"].prctl(PR_GET_DUMPABLE)  # made once here, for every guest and kernel
    # Every object so far to the permanent generation: a collection in a guest would write
    # into each one's header and copy the page it shares with us.
    gc.freeze()
    sock.sendall(_dumps({"ready": True}).encode())
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    while True:
        for ready, _ in poller.poll():
            if ready == wake_r:
                _drain(wake_r)
                _reap(sock)
                continue
            message, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, MAX_FDS)
            if not message:
                return  # the host is gone; its guests die with us
            request = None
            try:
                request = _loads(message)
                if request.get("launch"):
                    _check_launch_fds(request, fds, flags)
                    start_launcher(sock, request, fds)
                else:
                    _check_fds(request, fds, flags)
                    spawn(sock, request, fds, own_pid_ns, last_cap)
            except Exception as exc:  # one bad request never ends the template
                request_id = request.get("id") if isinstance(request, dict) else None
                reply = {"id": request_id, "error": "%s" % (exc,)}
                sock.sendall(_dumps(reply).encode())
            finally:
                for fd in fds:
                    os.close(fd)


def _check_fds(request, fds, flags):
    """Every fd the request says it carries arrived: a guest that missed one of its cgroup's
    files would run outside that hierarchy (no pids or memory limit)."""
    _check_count(request, fds, flags, len(NS_NAMES) + STDIO_FDS)


def _check_launch_fds(request, fds, flags):
    """The same for a launcher's request, whose network namespace is one fd more."""
    _check_count(request, fds, flags, LAUNCH_FDS + (1 if request.get("net") else 0))


def _check_count(request, fds, flags, before_cgroup):
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        raise JoinFailed("the request was cut short (%d fds arrived)" % len(fds))
    wanted = before_cgroup + int(request["cgroup_files"])
    if len(fds) != wanted or not 0 < int(request["cgroup_files"]) <= MAX_CGROUP_FILES:
        raise JoinFailed("the request carries %d fds, not %d" % (len(fds), wanted))


def _drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _reap(sock):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        sock.sendall(_dumps({"exit": pid, "status": code}).encode())

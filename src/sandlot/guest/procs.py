"""The guest's processes: starting children, killing them, and reaping orphans as pid 1.

Standard library only, Python >= 3.9 (shipped into every sandbox).
"""

import _signal as signal  # the C core: `signal` imports enum (~2.5 ms of every start)
import os
import select
import time

import threads


def set_oom_preferred(pid):
    """Make the kernel's OOM killer pick user code before the supervisor."""
    try:
        with open("/proc/%d/oom_score_adj" % pid, "w") as f:
            f.write("1000")
    except OSError:
        pass


def killpg(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def kill_group_except(pgid, keep_pid):
    """SIGKILL every process in group ``pgid`` but ``keep_pid`` (children a cell left behind)."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == keep_pid:
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                os.kill(int(name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue


def kill_session(sid):
    """SIGKILL every process of session ``sid`` (a terminal's: its jobs have process groups
    of their own, so killing the leader's group would leave them running)."""
    killpg(sid)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:
                os.kill(int(name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue


def signal_exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


# The reaper's scan without any SIGCHLD: a safety net, never the means.
REAP_FALLBACK_MS = 30_000
CHILDREN = set()
CHILDREN_LOCK = threads.Lock()


def spawn(*args, **kwargs):
    """Popen, remembering the pid so the orphan reaper never takes our child's exit status."""
    import subprocess  # ~8 ms of CPU (locale, re): paid by the first shell, not by every start

    with CHILDREN_LOCK:
        proc = subprocess.Popen(*args, **kwargs)
        CHILDREN.add(proc.pid)
    return proc


def forget(proc):
    with CHILDREN_LOCK:
        CHILDREN.discard(proc.pid)


_PRCTL = []  # libc's prctl, made on first use and kept: a guest template makes it once


def prctl(option, arg=0):
    """libc's ``prctl(option, arg, 0, 0, 0)``; raises OSError or AttributeError where ctypes
    or libc cannot give it. A ctypes library made afresh on each call cost every guest and
    kernel ~0.25 ms of CPU and ~50 pages copied on write (a template makes it once)."""
    if not _PRCTL:
        import ctypes

        _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl)
    return _PRCTL[0](option, arg, 0, 0, 0)


def become_subreaper():
    """Unless we are pid 1 already: adopt the orphans of our descendants (double-forked
    daemons), so that every process a call started stays one we can find and end."""
    if os.getpid() == 1:
        return True
    pr_set_child_subreaper = 36
    try:
        return prctl(pr_set_child_subreaper, 1) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid):
    """Every process below ``pid``, from one pass over /proc (which needs no kernel option,
    unlike /proc/<pid>/task/<tid>/children)."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(name))
    found = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def watch_children():
    """Have every SIGCHLD written to a pipe, whichever thread the kernel delivers it to;
    return its read end for :func:`reap_orphans_forever`. Main thread only (a handler, and
    the wakeup fd, can only be set there), after the first kernel's fork: the kernel must
    not inherit the handler.

    The reaper polled /proc every 0.5 s instead: ~260 us of CPU a second in every idle
    sandbox, a quarter of a core for 1,000 idle ones, each wake-up counted in the load."""
    read_fd, write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.signal(signal.SIGCHLD, _on_child)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    return read_fd


def _on_child(signum, frame):
    """Nothing to do here: the C handler has already written to the wakeup pipe."""


def reap_orphans_forever(wake_fd):
    """Reap the zombies of orphans (double-forked daemons) reparented to us, as pid 1 or as
    a subreaper, each time a child of ours ends (``wake_fd``, :func:`watch_children`).

    Never waitpid(-1): that would steal the exit status of a command still being waited for.
    """
    me = str(os.getpid())
    poller = select.poll()
    poller.register(wake_fd, select.POLLIN)
    while True:
        # A wake-up lost to a full pipe is caught up by the next one, or by this timeout.
        poller.poll(REAP_FALLBACK_MS)
        try:
            while os.read(wake_fd, 4096):
                pass
        except BlockingIOError:
            pass
        with CHILDREN_LOCK:
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in CHILDREN or name == me:
                    continue
                try:
                    with open("/proc/%s/stat" % name) as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if fields[0] == "Z" and fields[1] == me:
                        os.waitpid(int(name), os.WNOHANG)
                except (OSError, IndexError, ValueError):
                    continue


def freeze_all_but(keep_pid):
    """End every process the guest and its calls started, but stop ``keep_pid`` instead.

    Stopped first, killed after: a stopped process cannot fork, so nothing outruns the walk.
    As pid 1, kill(-1, SIGSTOP) stops them all at once (the kernel of the OS makes that atomic
    with fork). Stopped and SIGKILLed processes run no more user code, not even a write to
    another's /proc/<pid>/mem; this returns once they are gone or zombies (at most ~2 s).
    """
    me = os.getpid()
    if not _shared_pids():
        # Our own pid namespace (bubblewrap's, as its pid 1; a container's): kill(-1) reaches
        # every process in it but us and its init, at once.
        _signal(-1, signal.SIGSTOP)
    stopped = set()
    for _ in range(1000):
        new = _ours(me) - stopped
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped |= new
    doomed = stopped - {keep_pid}
    for pid in doomed:
        _signal(pid, signal.SIGKILL)
    # Outside a pid namespace of our own, a process not yet stopped may have sent SIGCONT to
    # one that was, and that one forked again: end whatever the walk finds until it is quiet.
    for _ in range(1000):
        late = _ours(me) - doomed - {keep_pid}
        if not late:
            break
        for pid in late:
            _signal(pid, signal.SIGKILL)
        doomed |= late
    deadline = time.monotonic() + 2.0
    while doomed and time.monotonic() < deadline:
        doomed = {pid for pid in doomed if _state(pid) not in (None, "Z", "X")}
        if doomed:
            time.sleep(0.005)


# What each thread of a process has run: its state, its voluntary and involuntary context
# switches, and its nanoseconds on a CPU (where the OS kernel keeps them).
_MARK_KEYS = ("State", "voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")


def thread_marks(pid):
    """{tid: marks} of every thread of ``pid`` ({} once it is gone).

    A stopped thread's marks change only if it runs again: SIGCONT undoes SIGSTOP, and a
    process can have one sent to itself while stopped (a POSIX timer, F_SETSIG, mq_notify:
    the red team's find, 2026-11-28), so a stop alone proves nothing. Its switches count
    every time it is woken, even to stop again; a thread made or ended shows as a tid
    added or gone; an exec replaces the threads. Two reads that match mean it ran nothing
    in between."""
    marks = {}
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return marks
    for tid in tids:
        base = "/proc/%d/task/%s/" % (pid, tid)
        try:
            fields = {}
            with open(base + "status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in _MARK_KEYS:
                        fields[key] = value.split()[0]
            try:
                with open(base + "schedstat") as f:
                    ran_ns = f.read().split()[0]
            except (OSError, IndexError):
                ran_ns = None  # no schedstats in this OS kernel: the switches still count
        except OSError:
            marks[tid] = None  # it ended while read
            continue
        marks[tid] = (*(fields.get(key) for key in _MARK_KEYS), ran_ns)
    return marks


def stopped_marks(pid, timeout_s=2.0):
    """:func:`thread_marks` of ``pid`` once every thread of it is stopped (SIGSTOP is
    delivered to each thread in its own time); None if that is not so within ``timeout_s``
    (a thread asleep in the OS kernel, or the process gone), or where this OS kernel keeps
    no counter that would show a run (switches or CPU time: gVisor's /proc may lack both)."""
    deadline = time.monotonic() + timeout_s
    while True:
        marks = thread_marks(pid)
        if not marks:
            return None
        if all(m is not None and m[0] in ("T", "t") for m in marks.values()):
            if not all(any(v is not None for v in m[1:]) for m in marks.values()):
                return None
            time.sleep(SETTLE_S)  # settled: the same again once any switch-out is done
            if thread_marks(pid) == marks:
                return marks
        if time.monotonic() >= deadline:
            return None  # it does not stay stopped (woken again and again, say)
        time.sleep(0.001)


# A thread shows "T" as soon as it has set its state, but its switch counts only once it is
# switched out, microseconds later (or longer, preempted): marks read in between change
# without it running again. Read again after this: what the thread was finishing is done.
SETTLE_S = 0.0005


def settled_marks(pid):
    """:func:`thread_marks` of ``pid``, read twice :data:`SETTLE_S` apart; None unless the
    two reads agree (a thread was still being switched out, or it runs)."""
    first = thread_marks(pid)
    time.sleep(SETTLE_S)
    second = thread_marks(pid)
    return first if first == second else None


def _shared_pids():
    return os.environ.get("SANDLOT_SHARED_PIDS") == "1"


def _ours(me):
    """The processes the guest answers for: in a pid namespace of our own, every one but its
    init and us (an orphan a daemon left is adopted by the container's init when we cannot
    be its subreaper, as under gVisor); sharing the host's, only our descendants."""
    if _shared_pids():
        return descendants(me)
    return {int(name) for name in os.listdir("/proc") if name.isdigit()} - {1, me}


def _signal(pid, signum):
    try:
        os.kill(pid, signum)
    except OSError:
        pass


def _state(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def count_tasks():
    """Processes alive in the sandbox's pid namespace, the guest's included.

    The host reads the same figure from the pids cgroup, except under gVisor: there the
    cgroup holds the sentry, the sandbox's processes live inside it, and a fork bomb held at
    RLIMIT_NPROC shows up in no host counter. Listing /proc forks nothing, so it works at
    the limit too. None where the guest shares the host's pid namespace (unsafe-local): every
    host process would count.
    """
    if _shared_pids():
        return None
    try:
        return sum(1 for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return None


def harden():
    """Keep other processes of the sandbox (same uid) out of this one's memory and fds.

    Non-dumpable: /proc/<pid>/mem, /fd and ptrace now need a capability nobody here has.
    The supervisor does it so background jobs cannot forge its replies to the host; the
    kernel, so they cannot forge a cell's result from outside the cell.
    """
    import resource

    pr_set_dumpable = 4
    try:
        prctl(pr_set_dumpable, 0)
    except (OSError, AttributeError):
        pass
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files in the workspace
    except (ValueError, OSError):
        pass

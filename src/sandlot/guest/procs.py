"""The guest's processes: starting children, killing them, and reaping orphans as pid 1.

Standard library only, Python >= 3.9 (shipped into every sandbox).
"""

import os
import signal
import subprocess
import threading
import time


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


def signal_exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


CHILDREN = set()
CHILDREN_LOCK = threading.Lock()


def spawn(*args, **kwargs):
    """Popen, remembering the pid so the orphan reaper never takes our child's exit status."""
    with CHILDREN_LOCK:
        proc = subprocess.Popen(*args, **kwargs)
        CHILDREN.add(proc.pid)
    return proc


def forget(proc):
    with CHILDREN_LOCK:
        CHILDREN.discard(proc.pid)


def reap_orphans_forever():
    """As pid 1, reap the zombies of orphans (double-forked daemons) that were reparented to us.

    Never waitpid(-1): that would steal the exit status of a command still being waited for.
    """
    while True:
        time.sleep(0.5)
        with CHILDREN_LOCK:
            for name in os.listdir("/proc"):
                if not name.isdigit() or int(name) in CHILDREN or name == "1":
                    continue
                try:
                    with open("/proc/%s/stat" % name) as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if fields[0] == "Z" and fields[1] == "1":
                        os.waitpid(int(name), os.WNOHANG)
                except (OSError, IndexError, ValueError):
                    continue


def count_tasks():
    """Processes alive in the sandbox's pid namespace, the guest's included.

    The host reads the same figure from the pids cgroup, except under gVisor: there the
    cgroup holds the sentry, the sandbox's processes live inside it, and a fork bomb held at
    RLIMIT_NPROC shows up in no host counter. Listing /proc forks nothing, so it works at
    the limit too.
    """
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
    import ctypes
    import resource

    pr_set_dumpable = 4
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files in the workspace
    except (ValueError, OSError):
        pass

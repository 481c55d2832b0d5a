"""What a sandbox's ``/proc`` may show of the host.

A pid namespace gives a sandbox its own ``/proc/<pid>`` entries, but many files of ``/proc``
stay host-wide: they identify the host and its boot (boot id, kernel command line and config,
symbols), or count what every other tenant does (CPU times, load, fork and context-switch
counters, memory, disks, interrupts, file locks). Each entry is decided on its own:

- *hidden* (an empty file or directory bound over it) where no ordinary program needs it;
- *synthesized* (a file the backend writes) where programs read it to size themselves or
  would fail without it: ``meminfo`` (the sandbox's memory limit as its total, so a runtime
  sizes its heap to what it may use, not to the host's RAM), ``stat`` (one line per CPU,
  which glibc counts when ``/sys`` is absent, and zero counters), ``uptime`` and ``loadavg``.
  They are written once (by bubblewrap's root backend once per tenant and memory limit,
  shared by that tenant's sandboxes of that limit: ``btime`` is then when the set was
  written, not when the sandbox started): live use is what ``usage()`` is for.

``cpuinfo``, ``version``, ``filesystems`` and ``mounts`` stay: programs need them, and they say
no more than ``uname`` or the sandbox's own mount namespace does.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HIDDEN_FILES = (
    "sys/kernel/random/boot_id",  # names this boot of this host
    "cmdline",
    "config.gz",
    "kallsyms",
    "modules",
    "bootconfig",
    "sched_debug",  # every task of the host, by name
    "schedstat",
    "timer_list",
    "vmstat",
    "zoneinfo",
    "buddyinfo",
    "pagetypeinfo",
    "slabinfo",
    "diskstats",
    "partitions",
    "swaps",
    "interrupts",
    "softirqs",
    "locks",  # every file lock of the host, with inode numbers
    "key-users",
    "keys",
    "latency_stats",
    "cgroups",  # how many cgroups (sandboxes) the host has
    "iomem",
    "ioports",
    "dma",
    "mtrr",
    "consoles",
    "kcore",
    "kpagecount",
    "kpageflags",
    "kpagecgroup",
    "sys/fs/file-nr",  # open files, inodes, dentries and ptys host-wide
    "sys/fs/inode-nr",
    "sys/fs/inode-state",
    "sys/fs/dentry-state",
    "sys/kernel/pty/nr",
    "sys/fs/aio-nr",  # async I/O contexts host-wide (a red team's find, 2026-11-24)
)
HIDDEN_DIRS = ("pressure", "fs", "driver", "acpi", "scsi", "asound", "bus", "irq")
SYNTHESIZED = ("meminfo", "stat", "uptime", "loadavg")
PROC = Path("/proc")


def present(names: tuple[str, ...]) -> list[str]:
    """The entries of ``names`` this host's ``/proc`` has (a mount needs its target)."""
    return [name for name in names if (PROC / name).exists()]


def _meminfo(memory_bytes: int) -> str:
    total_kb = memory_bytes // 1024
    fields = {"MemTotal": total_kb, "MemFree": total_kb, "MemAvailable": total_kb}
    for name in ("Buffers", "Cached", "SwapCached", "Active", "Inactive", "Shmem"):
        fields[name] = 0
    fields.update(SwapTotal=0, SwapFree=0, SReclaimable=0)
    return "".join(f"{name + ':':<16}{kb:>8} kB\n" for name, kb in fields.items())


def _stat(cpus: int, boot_s: int) -> str:
    zeros = " 0" * 10
    lines = [f"cpu {zeros}"] + [f"cpu{n}{zeros}" for n in range(cpus)]
    lines += ["intr 0", "ctxt 0", f"btime {boot_s}", "processes 0"]
    lines += ["procs_running 1", "procs_blocked 0", "softirq 0" + " 0" * 10]
    return "\n".join(lines) + "\n"


# In the directory of write_proc_files: what hides a directory, and a file. (Not /dev/null:
# a bind mount of it is nodev, and a read of it fails rather than ends, which some parsers
# take worse than an empty file.)
EMPTY_DIR = "empty"
EMPTY_FILE = "empty-file"


def write_proc_files(directory: Path, memory_bytes: int) -> dict[str, Path]:
    """Write the synthesized entries (and an empty directory, :data:`EMPTY_DIR`) into
    ``directory``; map each ``/proc`` name to its file.

    Readable by all: they say nothing but the sandbox's own limit and start time, and the
    directory they live in is what guards who may reach them.
    """
    directory.mkdir(mode=0o755, exist_ok=True)
    (directory / EMPTY_DIR).mkdir(mode=0o555, exist_ok=True)
    (directory / EMPTY_FILE).touch(mode=0o444)
    contents = {
        "meminfo": _meminfo(memory_bytes),
        "stat": _stat(os.cpu_count() or 1, int(time.time())),
        "uptime": "0.00 0.00\n",
        "loadavg": "0.00 0.00 0.00 1/1 1\n",
    }
    files = {}
    for name, content in contents.items():
        path = directory / name
        path.write_text(content)
        path.chmod(0o644)
        files[name] = path
    return files

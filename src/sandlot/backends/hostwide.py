"""Host-wide kernel tables that no cgroup divides, set so that sandboxes cannot fill them.

A sandbox's open files are charged to its memory cgroup (each ``struct file`` is accounted
kernel memory), but the kernel also caps all open files of the host together, ``fs.file-max``
(by default about 10% of RAM at ~1 KiB a file: 2.47 million on a 24 GiB host). One 256 MB
sandbox opened 560,000 (2026-11-28): a tenant's ten would fill the table, and every process
without ``CAP_SYS_ADMIN`` (other tenants' sandboxes, the host's services) would then get
ENFILE. systemd (since v240) sets ``fs.file-max`` to its maximum at boot, so that memory, which
is charged per sandbox, is the only bound; on a host whose init does not, the manager does
the same (``SANDBOX_RAISE_FILE_MAX``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

FILE_MAX = Path("/proc/sys/fs/file-max")
# systemd's value: the largest the sysctl takes on a 64-bit kernel (LONG_MAX).
FILE_MAX_UNBOUNDED = sys.maxsize


def raise_file_max(path: Path = FILE_MAX) -> bool:
    """Lift the host's open-file cap to its maximum; True if it is there now (or was)."""
    try:
        current = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    if current >= FILE_MAX_UNBOUNDED:
        return True
    try:
        path.write_text(f"{FILE_MAX_UNBOUNDED}\n")
    except OSError as exc:
        # A container's read-only /proc/sys, say: sandboxes can then fill the table.
        log.warning(
            "fs.file-max could not be raised: sandboxes can fill the host's file table",
            file_max=current,
            error=str(exc),
        )
        return False
    log.warning(
        "raised fs.file-max to its maximum, as systemd does: open files are bounded by "
        "each sandbox's memory instead (SANDBOX_RAISE_FILE_MAX=false to keep it)",
        was=current,
    )
    return True

"""Reading bwrap's ``--info-fd`` (backends/devpts.py) on a busy manager's descriptors."""

from __future__ import annotations

import os
import resource
import subprocess
import time
from pathlib import Path

import pytest

from sandlot.backends import devpts
from sandlot.backends.devpts import read_child_pid
from sandlot.errors import SandboxStartError

HIGH_FD = 1500  # past select()'s FD_SETSIZE (1024)


def test_bwraps_info_is_read_on_a_descriptor_past_select_s_limit() -> None:
    # A manager with ~200 live sandboxes holds more than 1024 fds: select() refused the info
    # pipe there ("filedescriptor out of range in select()", bench/scale.py at 203
    # sandboxes), and every later create failed.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= HIGH_FD:
        pytest.skip(f"the hard open-file limit ({hard}) is too low")
    if soft != resource.RLIM_INFINITY and soft <= HIGH_FD:
        resource.setrlimit(resource.RLIMIT_NOFILE, (HIGH_FD + 1, hard))
    read_end, write_end = os.pipe()
    try:
        high = os.dup2(read_end, HIGH_FD)
        os.write(write_end, b'{"child-pid": 4242, "net-namespace": 1}')
        assert read_child_pid(high, 2.0) == 4242
    finally:
        for fd in (read_end, write_end, HIGH_FD):
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("look", ["wait_for_block", "wait_for_exec"])
def test_a_zombie_is_seen_to_have_exited_not_waited_for(look: str) -> None:
    # bwrap's child, killed with its cgroup when a create fails or is cancelled, is a zombie
    # until the host's init reaps it (never, under an init that does not reap): the looks
    # that wait for it to block or to exec went on until their deadline (a worker thread
    # held 15 s after the create had ended). A zombie has exited.
    child = subprocess.Popen(["/bin/sleep", "0"])
    try:
        status = Path(f"/proc/{child.pid}/status")
        deadline = time.monotonic() + 5.0
        while "\nState:\tZ" not in status.read_text():
            assert time.monotonic() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        with pytest.raises(SandboxStartError, match="exited"):
            if look == "wait_for_block":
                devpts.wait_for_block(child.pid, timeout_s=2.0)
            else:
                devpts.wait_for_exec(child.pid, "sleep", timeout_s=2.0)
    finally:
        child.wait()

"""The guest's cells handler in a process of its own, outside any sandbox, where the order of
its threads can be fixed: what a sandbox run can only hit by chance, under load."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import sandlot.guest

GUEST_DIR = Path(sandlot.guest.__file__).parent

# Three cells; the second ignores its interrupt and is killed at its timeout. The background
# restart after that kill is switched off, the worst order for the next cell: its own start
# makes the fresh kernel.
SCRIPT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
import cells
from calls import Calls
from supervisor import KERNEL_LAUNCHER

class Writer:
    def send(self, frame):
        pass

kernel = cells.Kernel(dict(os.environ), KERNEL_LAUNCHER % sys.argv[1])
cells.threads.start = lambda *args, **kwargs: None
handler = cells.Cells(Writer(), Calls(), kernel)
seen = []
ignores = "import signal, time\\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\\ntime.sleep(30)"
for i, (code, timeout_s) in enumerate([("x = 1", 10), (ignores, 0.3), ("'x' in globals()", 10)]):
    result = handler.exec_code({"id": "c%d" % i, "code": code, "timeout_s": timeout_s})
    seen.append([result["state_lost"], result.get("text"), result.get("kill_reason")])
kernel.stop()
print(json.dumps(seen))
"""


def test_a_lost_kernel_is_reported_once(tmp_path: Path) -> None:
    # It was reported twice when the next cell came before the background restart: by the
    # killed cell, and again by the next (seen in CI under load, 2 runs in 5).
    done = subprocess.run(
        [sys.executable, "-I", "-c", SCRIPT, str(GUEST_DIR)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == [
        [False, None, None],
        [True, None, "timeout"],
        [False, "False", None],
    ]

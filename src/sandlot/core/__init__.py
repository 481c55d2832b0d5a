"""The core: sandboxes' lifecycle above the backends, one small room per concern.

::

    manager.py     SandboxManager: create, get/list, destroy, quotas, reaping, recovery
    live.py        Live: one running sandbox and its guest link (start, restart, drop)
    execution.py   one run of code or a command: backstop timeout, kill_reason from counters
    files.py       the file verbs, moved through the guest in bounded chunks
    artifacts.py   /workspace/artifacts kept on the host after a sandbox ends
    pools.py       warm pools of pre-started sandboxes
    placement.py   backend + runtime + environment, checked together (creates and pools)
    admission.py   quotas and host capacity: whether a sandbox may start
    recovery.py    at start: keep a crashed run's artifacts, then sweep its leftovers
    guest_link.py  the framed protocol to the guest (op names from sandlot.guest.ops)
    store.py       the SQLite record of sandboxes and artifacts
"""

from sandlot.core.manager import SandboxManager

__all__ = ["SandboxManager"]

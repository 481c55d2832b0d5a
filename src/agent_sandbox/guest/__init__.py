"""The guest agent that runs inside every sandbox (see ``agent.py``).

The host never imports ``agent.py``: it ships the file into the sandbox and runs it with the
sandbox's own ``python3``.
"""

from pathlib import Path

GUEST_SCRIPT = Path(__file__).with_name("agent.py")

__all__ = ["GUEST_SCRIPT"]

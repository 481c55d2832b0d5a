"""The guest agent that runs inside every sandbox (see ``agent.py``).

The host never imports ``agent.py`` for its own use: it ships the file into the sandbox and
runs it with the sandbox's own ``python3``.
"""

from pathlib import Path

GUEST_SCRIPT = Path(__file__).with_name("agent.py")

# How every backend starts the guest: as an import of module ``agent`` from a directory, so
# that a precompiled .pyc is used. Must equal ``LAUNCHER`` in agent.py (a test checks).
LAUNCHER = "import sys; sys.path.insert(0, %r); import agent; agent.main(sys.argv)"


def launcher(directory: str) -> str:
    """The ``python -c`` program that starts the guest found in ``directory``."""
    return LAUNCHER % directory


__all__ = ["GUEST_SCRIPT", "LAUNCHER", "launcher"]

"""The guest agent that runs inside every sandbox (see ``supervisor.py``).

The host never imports ``supervisor.py`` for its own use: it ships the file into the sandbox and
runs it with the sandbox's own ``python3``.
"""

from pathlib import Path

GUEST_SCRIPT = Path(__file__).with_name("supervisor.py")

# How every backend starts the guest: as an import of module ``supervisor`` from a directory, so
# that a precompiled .pyc is used. Must equal ``LAUNCHER`` in supervisor.py (a test checks).
LAUNCHER = "import sys; sys.path.insert(0, %r); import supervisor; supervisor.main(sys.argv)"


def launcher(directory: str) -> str:
    """The ``python -c`` program that starts the guest found in ``directory``."""
    return LAUNCHER % directory


__all__ = ["GUEST_SCRIPT", "LAUNCHER", "launcher"]

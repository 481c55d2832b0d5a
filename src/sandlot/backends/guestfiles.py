"""The guest agent's files as every isolating backend mounts them: read-only, precompiled."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from sandlot.errors import BackendUnavailable
from sandlot.guest import GUEST_SCRIPT

GUEST_DIR_INSIDE = "/opt/sandlot"  # where sandboxes see the guest directory
GUEST_PYTHON = "/usr/bin/python3"  # the sandbox's own interpreter (never a pyenv shim)

_COMPILE = (
    "import importlib.util, os, py_compile, sys; "
    "cfile = importlib.util.cache_from_source(sys.argv[1]); "
    "py_compile.compile(sys.argv[1], cfile=cfile, dfile=sys.argv[2], doraise=True); "
    "os.chmod(cfile, 0o644); os.chmod(os.path.dirname(cfile), 0o755)"
)


def install_guest(
    directory: Path, python: str = GUEST_PYTHON, inside: str = GUEST_DIR_INSIDE
) -> Path:
    """Copy ``supervisor.py`` into ``directory`` and compile it there; return the script's path.

    A copy every sandbox uid can read (the package may live under a 0700 home), compiled by
    the sandbox's python under the path the sandbox sees, so a guest start loads bytecode
    instead of compiling a thousand lines every time. An image whose python differs simply
    ignores the .pyc.

    Raises:
        BackendUnavailable: ``python`` cannot compile the guest.
    """
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    script = directory / "supervisor.py"
    tmp = script.with_suffix(".tmp")
    shutil.copyfile(GUEST_SCRIPT, tmp)
    tmp.chmod(0o644)
    tmp.replace(script)
    done = subprocess.run(
        [python, "-I", "-c", _COMPILE, str(script), f"{inside}/supervisor.py"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise BackendUnavailable(f"{python} cannot compile the guest agent: {done.stderr.strip()}")
    return script

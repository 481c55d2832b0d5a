"""The guest agent's files as every isolating backend mounts them: read-only, precompiled."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from sandlot.errors import BackendUnavailable
from sandlot.guest import GUEST_SCRIPT

GUEST_DIR_INSIDE = "/opt/sandlot"  # where sandboxes see the guest directory
GUEST_PYTHON = "/usr/bin/python3"  # the sandbox's own interpreter (never a pyenv shim)

# Arguments: pairs of (file here, the same file's path inside the sandbox).
_COMPILE = (
    "import importlib.util, os, py_compile, sys\n"
    "for src, inside in zip(sys.argv[1::2], sys.argv[2::2]):\n"
    "    cfile = importlib.util.cache_from_source(src)\n"
    "    py_compile.compile(src, cfile=cfile, dfile=inside, doraise=True)\n"
    "    os.chmod(cfile, 0o644); os.chmod(os.path.dirname(cfile), 0o755)"
)


def install_guest(
    directory: Path, python: str = GUEST_PYTHON, inside: str = GUEST_DIR_INSIDE
) -> Path:
    """Copy the guest's modules into ``directory`` and compile them there; return the path
    of ``supervisor.py``, the one the launcher imports.

    A copy every sandbox uid can read (the package may live under a 0700 home), compiled by
    the sandbox's python under the path the sandbox sees, so a guest start loads bytecode
    instead of compiling a thousand lines every time. An image whose python differs simply
    ignores the .pyc.

    Raises:
        BackendUnavailable: ``python`` cannot compile the guest.
    """
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    pairs: list[str] = []
    for source in sorted(GUEST_SCRIPT.parent.glob("*.py")):
        if source.name == "__init__.py":  # the host's package, not the guest's
            continue
        script = directory / source.name
        tmp = script.with_suffix(".tmp")
        shutil.copyfile(source, tmp)
        tmp.chmod(0o644)
        tmp.replace(script)
        pairs += [str(script), f"{inside}/{source.name}"]
    done = subprocess.run(
        [python, "-I", "-c", _COMPILE, *pairs], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise BackendUnavailable(f"{python} cannot compile the guest agent: {done.stderr.strip()}")
    return directory / "supervisor.py"

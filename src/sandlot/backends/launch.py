"""How every backend starts the guest agent: where its files are, which python runs them, the
environment it is given and its command line.

Isolating backends (``bubblewrap/``, ``docker/``) :func:`install_guest` into a directory of
their data dir and mount it read-only at :data:`GUEST_DIR_INSIDE`; ``local.py`` runs the
package's own guest directory with the host's interpreter.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from sandlot.errors import BackendUnavailable
from sandlot.guest import GUEST_SCRIPT, launcher

GUEST_SOURCE_DIR = GUEST_SCRIPT.parent  # src/sandlot/guest: the files shipped into sandboxes
GUEST_DIR_INSIDE = "/opt/sandlot"  # where sandboxes see the guest directory
GUEST_PYTHON = "/usr/bin/python3"  # the sandbox's own interpreter (never a pyenv shim)
WORKSPACE_INSIDE = "/workspace"
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
SANDBOX_UID = 65534  # "nobody" inside a bubblewrap sandbox; the host uid behind it differs


def identity_files() -> dict[str, str]:
    """A sandbox's /etc files that name who it is (its user, group and host name): a tree
    is built with them (rootfs.py), and bound over one built before (bubblewrap's argv)."""
    return {
        "passwd": f"root:x:0:0:root:/root:/bin/sh\n"
        f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{WORKSPACE_INSIDE}:/bin/bash\n",
        "group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n",
        "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files dns\n",
    }


# Compiles each (source, path-the-sandbox-sees) pair of its arguments, in one interpreter start.
_COMPILE = (
    "import importlib.util, os, py_compile, sys\n"
    "for src, shown in zip(sys.argv[1::2], sys.argv[2::2]):\n"
    "    cfile = importlib.util.cache_from_source(src)\n"
    "    py_compile.compile(src, cfile=cfile, dfile=shown, doraise=True)\n"
    "    os.chmod(cfile, 0o644)\n"
    "    os.chmod(os.path.dirname(cfile), 0o755)\n"
)


def guest_sources() -> list[Path]:
    """The guest's modules: every ``.py`` file of ``sandlot/guest`` but the host's
    ``__init__.py`` (the supervisor imports its siblings, such as ``ops.py``)."""
    return sorted(p for p in GUEST_SOURCE_DIR.glob("*.py") if p.name != "__init__.py")


def install_guest(
    directory: Path, python: str = GUEST_PYTHON, inside: str = GUEST_DIR_INSIDE
) -> list[Path]:
    """Copy the guest's modules into ``directory`` and compile them there; return the copies.

    A copy every sandbox uid can read (the package may live under a 0700 home), compiled by
    the sandbox's python under the path the sandbox sees, so a guest start loads bytecode
    instead of compiling a thousand lines every time. An image whose python differs simply
    ignores the .pyc. Modules no longer shipped are removed, so none is imported stale.

    Raises:
        BackendUnavailable: ``python`` cannot compile the guest.
    """
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o755)
    sources = guest_sources()
    copies = [directory / source.name for source in sources]
    for source, copy in zip(sources, copies, strict=True):
        # A private temporary name: two backends of one data dir may install at once.
        fd, tmp_name = tempfile.mkstemp(prefix=f".{copy.name}.", dir=directory)
        os.close(fd)
        tmp = Path(tmp_name)
        shutil.copyfile(source, tmp)
        tmp.chmod(0o644)
        tmp.replace(copy)
    for stale in set(directory.glob("*.py")) - set(copies):
        stale.unlink(missing_ok=True)
    pairs = [arg for copy in copies for arg in (str(copy), f"{inside}/{copy.name}")]
    done = subprocess.run(
        [python, "-I", "-c", _COMPILE, *pairs], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise BackendUnavailable(f"{python} cannot compile the guest agent: {done.stderr.strip()}")
    return copies


def guest_argv(python: str = GUEST_PYTHON, directory: str = GUEST_DIR_INSIDE) -> list[str]:
    """The command that starts the guest found in ``directory`` (isolated mode, no site)."""
    return [python, "-I", "-S", "-c", launcher(directory)]


def guest_env(
    user_env: Mapping[str, str],
    *,
    workspace: str = WORKSPACE_INSIDE,
    path: str = SANDBOX_PATH,
    shell_state: str | None = None,
    shared_pids: bool = False,
) -> dict[str, str]:
    """The guest supervisor's own environment.

    The caller's variables travel as one JSON value, ``SANDLOT_USER_ENV``, that the guest
    applies to the processes it starts, never to itself: as the supervisor's own environment,
    a caller's ``LD_LIBRARY_PATH=/workspace/lib`` let sandboxed code plant the libraries the
    next guest start would load, and so forge every later result.
    """
    env = {"PATH": path, "HOME": workspace, "LANG": "C.UTF-8"}
    # The default escapes: requests.MAX_ENV_JSON_CHARS bounds exactly this string.
    env["SANDLOT_USER_ENV"] = json.dumps(dict(user_env))
    env["SANDLOT_WORKSPACE"] = workspace
    if shell_state is not None:
        env["SANDLOT_SHELL_STATE"] = shell_state
    if shared_pids:  # the guest sees the host's processes: its own count means nothing
        env["SANDLOT_SHARED_PIDS"] = "1"
    return env

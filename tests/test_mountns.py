"""The manager's visit to a sandbox's mount namespace (backends/mountns.py), as root.

Real mounts, made in a throwaway mount namespace of a child process (never the test run's
own): the masks' clones are read-only and private (a clone of a path on a shared mount used to
join its peer group), and a failure of any kind inside the visit reaches the caller.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sandlot.backends import mountns

pytestmark = pytest.mark.skipif(not mountns.supported(), reason="needs root and the mount API")

IN_OWN_NAMESPACE = textwrap.dedent(
    """
    import os, subprocess, sys
    from pathlib import Path
    from sandlot.backends import mountns
    top = Path(sys.argv[1])
    shared = top / "shared"
    shared.mkdir()
    # A shared mount, as systemd makes /: a clone of a path on it would join its peer group.
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(shared)], check=True)
    subprocess.run(["mount", "--make-shared", str(shared)], check=True)
    (shared / "source").write_text("mask")
    target = top / "target"
    target.write_text("host data")
    fd = mountns.clone_read_only(str(shared / "source"))
    mountns.attach(fd, str(target))
    os.close(fd)
    line = next(ln for ln in open("/proc/self/mountinfo") if ln.split()[4] == str(target))
    try:
        target.write_text("planted")
        written = True
    except OSError:
        written = False
    print(repr((line.split(), target.read_text(), written)))
    """
)


def test_a_mask_is_a_read_only_private_clone_even_of_a_shared_mount(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            "-c",
            IN_OWN_NAMESPACE,
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(mountns.__file__).parents[2])},
    ).stdout
    fields, content, written = ast.literal_eval(out)
    options, tags = fields[5].split(","), fields[6 : fields.index("-")]
    assert "ro" in options and {"nosuid", "nodev", "noexec"} <= set(options), fields
    assert not any(tag.startswith("shared:") for tag in tags), fields
    assert content == "mask" and not written


def test_a_failure_of_any_kind_inside_the_visit_reaches_the_caller() -> None:
    # Only OSError was caught once: a ValueError ended the thread silently and the caller
    # went on as if every mask were in (a red team's finding).
    child = subprocess.Popen(["unshare", "--mount", "sleep", "30"])  # a namespace of its own
    try:

        def work() -> None:
            raise ValueError("boom")

        for _ in range(100):  # until unshare has exec'd sleep in its new namespace
            if Path(f"/proc/{child.pid}/comm").read_text().strip() == "sleep":
                break
            time.sleep(0.01)
        with pytest.raises(ValueError, match="boom"):
            mountns.run_inside(child.pid, work, parent=os.getpid())
    finally:
        child.kill()
        child.wait()


SYMLINK_SOURCE = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from sandlot.backends import mountns
    top = Path(sys.argv[1])
    (top / "elsewhere").mkdir()
    (top / "elsewhere" / "secret").write_text("not the sandbox's")
    (top / "workspace").symlink_to(top / "elsewhere")
    (top / "target").mkdir()
    outcome = []
    for clone in (mountns.clone_writable, mountns.clone_read_only):
        fd = clone(str(top / "workspace"))
        try:
            mountns.attach(fd, str(top / "target"))
            outcome.append(sorted(os.listdir(top / "target")))
        except OSError as exc:
            outcome.append(exc.errno)
        finally:
            os.close(fd)
    print(repr(outcome))
    """
)


def test_a_clone_of_a_symlink_never_mounts_what_it_names(tmp_path: Path) -> None:
    """The manager clones a sandbox's volume directories by their host paths: were one a
    symlink, a followed clone would mount wherever it points inside the sandbox."""
    in_own_namespace = ["unshare", "--mount", "--propagation", "private"]
    out = subprocess.run(
        [*in_own_namespace, sys.executable, "-c", SYMLINK_SOURCE, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(mountns.__file__).parents[2])},
    ).stdout
    outcome = ast.literal_eval(out)
    assert all(isinstance(o, int) for o in outcome), outcome  # refused, not ['secret']

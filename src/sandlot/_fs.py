"""Deleting a tree that sandboxed code made: as deep as it likes, full of links it planted.

``shutil.rmtree`` recurses once per level: a sandbox that made a directory 1,500 levels deep
(a loop of ``mkdir a; cd a``, milliseconds) made it raise ``RecursionError``, even with
``ignore_errors``: its destroy left the directory and the sandbox's uid held, and every later
start of the manager on that data directory failed in recovery's sweep (red team,
2026-12-06). :func:`remove_tree` keeps an explicit stack instead, and never holds more than
:data:`MAX_DEPTH` directories open: a directory found deeper is renamed up into the tree's
top, to be emptied from there.

It goes by descriptors only, one name at a time relative to its parent's, and never follows
a symlink (``O_NOFOLLOW``): a link planted by sandboxed code is deleted, never entered. It
stays on the tree's file system (a directory on another device, a mount, is left alone, and
so is its parent), and gives each directory's owner write and search on it before emptying
it (rootless, sandboxed code may leave a directory mode 0, which its owner, unlike root,
could not empty otherwise).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

# Directories open at once, at most: deeper ones are renamed up to the top.
MAX_DEPTH = 64
# Entries of one directory read at once, then deleted before the next are read.
BATCH = 4096
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class _Level:
    fd: int
    name: str  # in its parent ("" for the top)
    stuck: set[str] = field(default_factory=set)  # entries it could not remove


def remove_tree(root: Path | str) -> bool:
    """Delete ``root`` and everything below it; whether it is gone. Errors are skipped (what
    cannot be deleted stays), never raised."""
    root = Path(root)
    try:
        top = os.open(root, _DIR_FLAGS)
    except FileNotFoundError:
        return True
    except OSError:
        with contextlib.suppress(OSError):
            root.unlink()  # a file or a symlink where the tree was
        return not os.path.lexists(root)
    device = os.fstat(top).st_dev
    levels = [_Level(top, "")]
    try:
        while levels:
            level = levels[-1]
            child = _empty_until_a_directory(level, device, deep=len(levels) >= MAX_DEPTH)
            if child is level:
                continue  # the next batch
            if isinstance(child, _Level):
                levels.append(child)
                continue
            if child is not None:  # too deep: moved up to the top, emptied from there
                up = f".sandlot-deep-{secrets.token_hex(8)}"
                try:
                    os.rename(child, up, src_dir_fd=level.fd, dst_dir_fd=top)
                except OSError:
                    level.stuck.add(child)
                continue
            levels.pop()
            os.close(level.fd)
            if levels:
                try:
                    os.rmdir(level.name, dir_fd=levels[-1].fd)
                except OSError:
                    levels[-1].stuck.add(level.name)
    finally:
        for level in levels:
            os.close(level.fd)
    with contextlib.suppress(OSError):
        root.rmdir()
    return not os.path.lexists(root)


def _empty_until_a_directory(level: _Level, device: int, *, deep: bool) -> _Level | str | None:
    """Delete ``level``'s entries up to its first directory, a batch of them: that directory
    opened as a new level, or its name when ``deep`` (to be moved up); ``level`` itself
    when the batch is done and more may follow; None once nothing is left but what is
    stuck."""
    with contextlib.suppress(OSError):
        os.fchmod(level.fd, 0o700)
    try:
        entries, exhausted = _names(level.fd, level.stuck)
    except OSError:
        return None
    for name, is_dir in entries:
        if not is_dir:
            try:
                os.unlink(name, dir_fd=level.fd)
            except FileNotFoundError:
                pass
            except OSError:
                level.stuck.add(name)
            continue
        if deep:
            return name
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=level.fd)
        except OSError:
            level.stuck.add(name)
            continue
        if os.fstat(fd).st_dev != device:
            os.close(fd)  # another file system mounted here: not ours to empty
            level.stuck.add(name)
            continue
        return _Level(fd, name)
    return None if exhausted else level


def _names(fd: int, skip: set[str]) -> tuple[list[tuple[str, bool]], bool]:
    """At most BATCH of a directory's entries not in ``skip`` (name, is a directory and not
    a link), and whether the listing ended. Read before any is deleted (a listing read
    while its directory changes may skip entries), and in batches, so that a directory of a
    million names (hard links cost a sandbox no inodes) is not held in memory at once."""
    found: list[tuple[str, bool]] = []
    with os.scandir(fd) as listing:
        for entry in listing:
            if entry.name not in skip:
                found.append((entry.name, entry.is_dir(follow_symlinks=False)))
                if len(found) >= BATCH:
                    return found, False
    return found, True

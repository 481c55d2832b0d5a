"""A sandbox disk's own cost, made and removed alone: what the manager's worker thread spends
on it per create (issue 13's sixteenth pass).

Each cycle copies an empty image of ``--size-mb`` from a template (``disk._sparse_copy``),
attaches it to a loop device and mounts it (``disk._loop_mount``: LOOP_CONFIGURE, which
fsyncs the backing file, then mount(2)), then unmounts it and removes the image. Two kinds of
template, made here with ``disk.MKFS_ARGV`` with and without ``^resize_inode``, take turns
in ``--rounds`` rounds of ``--cycles`` each, so that both see the same machine. Prints, per
kind: the template's written bytes (what each create copies and writes out), the make's and
the removal's wall p50 / p95, the thread's CPU (the kernel's work in its calls included) and
the KiB written to the block device under ``--dir`` per cycle (its ``stat``: anything else
writing there counts too). As root, with loop devices; in a scratch directory under
``--dir``.

Usage::

    .venv/bin/python bench/volume_cycle.py [--size-mb 64] [--rounds 8] [--cycles 25]
                                           [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `bench.`

from bench.bench_core import percentile
from sandlot.backends import disk


def mkfs_argv(resize_inode: bool) -> list[str]:
    """``disk.MKFS_ARGV``, with the resize inode put back if asked (the tree before)."""
    argv = list(disk.MKFS_ARGV)
    if resize_inode:
        features = argv.index("-O") + 1
        argv[features] = ",".join(f for f in argv[features].split(",") if f != "^resize_inode")
    return argv


def make_template(path: Path, size_mb: int, resize_inode: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size_mb << 20)
    finally:
        os.close(fd)
    subprocess.run([*mkfs_argv(resize_inode), str(path)], check=True)


def cycle(template: Path, work: Path, size_mb: int) -> tuple[float, float, float]:
    """(make ms, removal ms, thread CPU ms) of one disk."""
    image, point = work / "disk.img", work / "mnt"
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    disk._sparse_copy(template, image, size_mb << 20)
    point.mkdir()
    disk._loop_mount(image, point)
    wall1 = time.perf_counter()
    disk._unmount_now(point)
    image.unlink()
    point.rmdir()
    wall2, cpu1 = time.perf_counter(), time.thread_time()
    return 1000 * (wall1 - wall0), 1000 * (wall2 - wall1), 1000 * (cpu1 - cpu0)


def device_written_kib(directory: Path) -> int | None:
    """KiB written so far to the block device holding ``directory``, None where /sys has no
    such device (a file system with no block device: tmpfs, overlay)."""
    dev = directory.stat().st_dev
    stat = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    try:
        return int(stat.read_text().split()[6]) // 2  # sectors written, of 512 bytes
    except (OSError, IndexError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--cycles", type=int, default=25)
    parser.add_argument("--dir", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    if not disk.loop_disks_available()[0]:
        sys.exit("needs root and loop devices")
    root = Path(tempfile.mkdtemp(prefix="sandlot-volume-", dir=args.dir))
    try:
        kinds = {"now (^resize_inode)": False, "before (resize inode)": True}
        templates = {}
        for i, (name, resize_inode) in enumerate(kinds.items()):
            templates[name] = root / f"template-{i}.img"
            make_template(templates[name], args.size_mb, resize_inode)
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in kinds}
        written: dict[str, int | None] = dict.fromkeys(kinds, 0)
        for _ in range(args.rounds):
            for name, template in templates.items():
                before = device_written_kib(root)
                results[name] += [cycle(template, root, args.size_mb) for _ in range(args.cycles)]
                after, so_far = device_written_kib(root), written[name]
                if before is None or after is None or so_far is None:
                    written[name] = None
                else:
                    written[name] = so_far + after - before
        print(
            f"{args.size_mb} MB disks, {args.rounds} rounds x {args.cycles} cycles per kind, "
            f"alternated; under {args.dir}"
        )
        print(
            "| template | its written KiB | make p50 / p95 ms | removal p50 / p95 ms "
            "| CPU p50 ms | KiB to the device a cycle |"
        )
        print("|---|---:|---|---|---:|---:|")
        for name, rows in results.items():
            make, removal, cpu = ([row[i] for row in rows] for i in range(3))
            held = templates[name].stat().st_blocks // 2
            total = written[name]
            to_device = "-" if total is None else f"{total / len(rows):.0f}"
            print(
                f"| {name} | {held} | {statistics.median(make):.2f} / {percentile(make, 95):.2f} | "
                f"{statistics.median(removal):.2f} / {percentile(removal, 95):.2f} | "
                f"{statistics.median(cpu):.2f} | {to_device} |"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What a named volume costs a sandbox's lifecycle (seed 004's persistent storage).
Alternated rounds on one embedded manager (bubblewrap, root): a lifecycle (create, one
command, destroy) without a volume, and the same with one volume attached (its lease, the
loop device, the idmapped mount and the attach inside); medians and p95, and their ratio.
Also what making and deleting a volume takes (mkfs.ext4 of an image with a journal).

    .venv/bin/python bench/bench_volumes.py --rounds 5 --lifecycles 20
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from sandlot import SandboxManager, Settings
from sandlot.models import VolumeMount
from sandlot.requests import CreateVolume, RunCommand, SandboxSpec


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(0.95 * len(ordered)) - 1)]


def _line(name: str, values: list[float]) -> str:
    return (
        f"{name:14} n={len(values):3} median {statistics.median(values):7.2f} ms "
        f"p95 {_p95(values):7.2f} ms"
    )


async def lifecycle(manager: SandboxManager, spec: SandboxSpec, command: str) -> float:
    started = time.perf_counter()
    info = await manager.create(spec)
    result = await manager.run_command(info.id, RunCommand(command=command))
    await manager.destroy(info.id)
    elapsed = (time.perf_counter() - started) * 1000
    assert result.exit_code == 0, result
    return elapsed


async def main(rounds: int, lifecycles: int, size_mb: int) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="bench-volumes-", dir="/tmp"))
    data_dir.chmod(0o711)
    settings = Settings(data_dir=data_dir, log_level="WARNING")  # type: ignore[call-arg]
    timings: dict[str, list[float]] = {"plain": [], "volume": [], "mkfs": [], "delete": []}
    async with SandboxManager(settings) as manager:
        await manager.create_volume(CreateVolume(name="bench", size_mb=size_mb))
        mounted = SandboxSpec(volumes=[VolumeMount(name="bench", mount_path="data")])
        await lifecycle(manager, SandboxSpec(), "true")  # templates, trees: warm
        await lifecycle(manager, mounted, "true")
        for _ in range(rounds):
            for _ in range(lifecycles):
                timings["plain"].append(await lifecycle(manager, SandboxSpec(), "echo x > f"))
            for _ in range(lifecycles):
                timings["volume"].append(await lifecycle(manager, mounted, "echo x > data/f"))
            started = time.perf_counter()
            await manager.create_volume(CreateVolume(name="other", size_mb=size_mb))
            timings["mkfs"].append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            await manager.delete_volume("other")
            timings["delete"].append((time.perf_counter() - started) * 1000)
        await manager.settle()
        await manager.delete_volume("bench")
    for name, values in timings.items():
        print(_line(name, values))
    ratio = statistics.median(timings["volume"]) / statistics.median(timings["plain"])
    print(f"volume / plain lifecycle (median): {ratio:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lifecycles", type=int, default=20)
    parser.add_argument("--size-mb", type=int, default=256)
    args = parser.parse_args()
    asyncio.run(main(args.rounds, args.lifecycles, args.size_mb))

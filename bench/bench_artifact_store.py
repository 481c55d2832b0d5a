"""What reserving one kept artifact costs as its owner's kept files grow (issue of 2026-12-06:
a reservation summed the owner's rows, so a sandbox of 100,000 empty files took a crashed
manager's restart past 13 minutes).

For each count of rows the owner already has, a fresh store file: the rows (one sandbox per
100 files), then ``--reserves`` reservations and copies recorded, each timed. Runs on
whichever ``sandlot`` is importable, so a tree before a change can be measured with its
``src`` first on ``PYTHONPATH``.

    python bench/bench_artifact_store.py --rows 0 10000 50000 --reserves 200
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from sandlot.core.store import Store
from sandlot.models import ArtifactInfo


def fill(store: Store, rows: int) -> None:
    db = store._db
    db.execute("BEGIN")
    for n in range(max(1, rows // 100)):
        db.execute(
            "INSERT INTO sandboxes (id, owner, status, created_at, info) "
            "VALUES (?, 'acme', 'destroyed', 0, '{}')",
            (f"sb-{n}",),
        )
    for n in range(rows):
        db.execute("INSERT INTO artifacts VALUES (?, ?, 0, 'x', 0)", (f"sb-{n // 100}", f"f{n}"))
    db.execute("COMMIT")


def one(rows: int, reserves: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store.db"
        filler = Store(path, "bench")
        fill(filler, rows)
        filler.close()
        store = Store(path, "bench")  # reopened: an upgraded file's usage is filled once
        spent = []
        try:
            for n in range(reserves):
                started = time.perf_counter()
                assert store.reserve_artifact("acme", "sb-0", f"new{n}", 0, 1 << 40)
                store.add_artifact(
                    ArtifactInfo(
                        sandbox_id="sb-0",
                        path=f"new{n}",
                        size_bytes=0,
                        sha256="y",
                        created_at=time.time(),
                    )
                )
                spent.append(time.perf_counter() - started)
        finally:
            store.close()
    return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[0, 10_000, 50_000])
    parser.add_argument("--reserves", type=int, default=200)
    args = parser.parse_args()
    print("| owner's rows | reserve + record p50 ms | p95 ms |")
    print("|---:|---:|---:|")
    for rows in args.rows:
        spent = sorted(one(rows, args.reserves))
        p50 = statistics.median(spent) * 1000
        p95 = spent[int(len(spent) * 0.95) - 1] * 1000
        print(f"| {rows:,} | {p50:.3f} | {p95:.3f} |")


if __name__ == "__main__":
    main()

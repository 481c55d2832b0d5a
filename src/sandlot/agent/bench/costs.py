"""What sample-and-select costs, measured: ``python -m sandlot.agent.bench.costs``.

Two questions, each against a baseline measured in the same run, repeated ``--rounds``
times (medians and p95):

- **sandbox**: N candidates, each run in a sandbox of its own created for it, concurrently
  (what :class:`SampleSelect` does), against the same N run one after another in one
  sandbox; sandbox-seconds per candidate (the run itself) and wall per candidate;
- **decoding**: N samples of one prompt from the local model, from one model context (calls
  take turns: a context is not thread-safe) against N contexts decoding at once. The second
  wins only where cores are free: llama.cpp's decoding is bound by the cores it gets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sandlot.agent.code import function_task, program_to_run
from sandlot.agent.executor import SandboxExecutor
from sandlot.agent.models import Check

CANDIDATE = "def add_one(n):\n    return n + 1\n"
PROMPT = 'def add_one(n: int) -> int:\n    """Return n plus one."""\n'


def _stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"median": statistics.median(ordered), "p95": p95, "n": len(ordered)}


async def _timed(make: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    started = time.monotonic()
    value = await make()
    return time.monotonic() - started, value


async def sandbox_costs(candidates: int, rounds: int, options: dict[str, Any]) -> dict[str, Any]:
    checks = [
        Check(source=f"assert add_one({i}) == {i + 1}", call=f"add_one({i})", expected=f"{i + 1}")
        for i in range(6)
    ]
    spec = function_task(PROMPT, "add_one").model_copy(update={"checks": checks})
    program = program_to_run(spec, CANDIDATE)

    failures: list[str] = []

    async def own_sandbox(i: int) -> float:
        async with SandboxExecutor(**options) as executor:
            run = await executor.run(program, name=f"c{i}.py")
        if not run.ok:
            failures.append(run.failure_summary(200))
        return run.duration_s

    async def concurrent() -> list[float]:
        return list(await asyncio.gather(*(own_sandbox(i) for i in range(candidates))))

    async def one_sandbox() -> list[float]:
        async with SandboxExecutor(**options) as executor:
            runs = [await executor.run(program, name=f"c{i}.py") for i in range(candidates)]
        failures.extend(r.failure_summary(200) for r in runs if not r.ok)
        return [r.duration_s for r in runs]

    walls: dict[str, list[float]] = {"concurrent_own_sandboxes": [], "serial_one_sandbox": []}
    run_s: dict[str, list[float]] = {k: [] for k in walls}
    for _ in range(rounds):
        ways = (("serial_one_sandbox", one_sandbox), ("concurrent_own_sandboxes", concurrent))
        for name, way in ways:
            wall, durations = await _timed(way)
            walls[name].append(wall / candidates)
            run_s[name].extend(durations)
    base = statistics.median(walls["serial_one_sandbox"])
    return {
        "candidates": candidates,
        "wall_s_per_candidate": {k: _stats(v) for k, v in walls.items()},
        "sandbox_s_per_candidate": {k: _stats(v) for k, v in run_s.items()},
        "ratio_concurrent_to_serial": statistics.median(walls["concurrent_own_sandboxes"]) / base,
        "failed_runs": failures,  # a measurement of failing runs would measure nothing
    }


async def decoding_costs(
    model: str, model_path: Path | None, samples: int, rounds: int, max_tokens: int
) -> dict[str, Any]:
    from sandlot.agent.providers.local import LocalProvider

    def provider(instance: int) -> LocalProvider:
        return LocalProvider(
            model,
            model_path=model_path,
            max_tokens=max_tokens,
            temperature=0.8,
            context_tokens=1024,
            instance=instance,
        )

    shared = provider(0)
    own = [provider(100 + i) for i in range(samples)]
    prompt = f"Complete this function in Python:\n{PROMPT}"
    await shared.generate("warm up", max_tokens=4)
    for p in own:
        await p.generate("warm up", max_tokens=4)

    async def one_context() -> list[Any]:
        return list(await asyncio.gather(*(shared.generate(prompt) for _ in range(samples))))

    async def contexts() -> list[Any]:
        return list(await asyncio.gather(*(p.generate(prompt) for p in own)))

    walls: dict[str, list[float]] = {"one_context": [], "own_contexts": []}
    tokens_per_s: dict[str, list[float]] = {k: [] for k in walls}
    for _ in range(rounds):
        for name, way in (("one_context", one_context), ("own_contexts", contexts)):
            wall, completions = await _timed(way)
            walls[name].append(wall)
            tokens_per_s[name].append(sum(c.output_tokens for c in completions) / wall)
    return {
        "samples": samples,
        "max_tokens": max_tokens,
        "wall_s_for_all_samples": {k: _stats(v) for k, v in walls.items()},
        "output_tokens_per_s": {k: _stats(v) for k, v in tokens_per_s.items()},
        "ratio_own_to_one": statistics.median(walls["own_contexts"])
        / statistics.median(walls["one_context"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=None, help="a shipped model name; unset: no decoding")
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args()

    async def run() -> dict[str, Any]:
        result: dict[str, Any] = {
            "sandbox": await sandbox_costs(args.candidates, args.rounds, {}),
        }
        if args.model:
            result["decoding"] = await decoding_costs(
                args.model, args.model_path, args.candidates, args.rounds, args.max_tokens
            )
        return result

    result = asyncio.run(run())
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

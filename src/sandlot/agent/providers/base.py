"""One interface for every model: ``generate``, ``generate_many``, ``stream`` and
``generate_json``.

A provider turns a list of chat messages into a :class:`Completion` (text plus token counts
and time). ``generate_json`` asks for a JSON object, validates it into a pydantic model and
gives the model one chance to repair a reply that does not fit, quoting the validation
error; a second miss raises :class:`~sandlot.errors.ModelOutputError`.

HTTP providers share :class:`HttpProvider`: one ``httpx.AsyncClient``, bounded retries of
429, 5xx and dropped connections (honouring ``Retry-After``), errors mapped to
:class:`~sandlot.errors.ProviderError` and its subclasses, and a server-sent-events
reader for streaming.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import httpx
from pydantic import BaseModel, Field, ValidationError, field_validator

from sandlot.errors import (
    ModelOutputError,
    ProviderAuthError,
    ProviderError,
    ProviderRateLimited,
    ProviderRequestRefused,
)

Role = Literal["system", "user", "assistant"]
T = TypeVar("T", bound=BaseModel)
# Whose task a provider call serves (a tenant, or None): set around a task by the agent
# runtime; a provider that keeps state between calls (the local model's cache) keeps it
# per caller.
CALLER: ContextVar[str | None] = ContextVar("sandlot_provider_caller", default=None)

RETRY_BASE_S = 0.5
RETRY_CAP_S = 20.0
ERROR_BODY_CHARS = 500  # of a provider's error body quoted in our message


class Message(BaseModel):
    role: Role
    content: str


class Completion(BaseModel):
    """One reply of a model, with what it cost. ``text`` is always valid Unicode: lone
    surrogates are replaced (see :func:`valid_text`)."""

    text: str
    provider: str
    model: str
    input_tokens: int = 0
    output_tokens: int = 0
    duration_s: float = 0.0
    finish_reason: str | None = Field(
        default=None, description="stop, length (max_tokens reached), or the provider's word."
    )

    @field_validator("text")
    @classmethod
    def _valid_text(cls, text: str) -> str:
        return valid_text(text)


def valid_text(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (a split pair is joined).

    A provider's JSON may escape a lone surrogate (``"\\ud800"``), which decodes into a
    ``str`` that no UTF-8 encoder takes: the code run, ``ast.parse`` and the server's reply
    would each raise ``UnicodeEncodeError`` (a red team's 500 on POST /execute, 2026-12-07).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 1024
    temperature: float = 0.2
    stop: tuple[str, ...] = ()
    json_mode: bool = False  # ask the provider for a JSON object where its API can
    # The JSON schema asked for, for providers that can constrain decoding to it (local).
    json_schema: Mapping[str, Any] | None = None


Prompt = str | Sequence[Message]


def as_messages(prompt: Prompt, system: str | None = None) -> list[Message]:
    """A bare string is one user message; ``system`` goes first if given."""
    messages = [Message(role="user", content=prompt)] if isinstance(prompt, str) else [*prompt]
    if system is not None:
        messages.insert(0, Message(role="system", content=system))
    return messages


class Provider(ABC):
    """Every model behind one interface. Subclasses implement :meth:`_complete`."""

    name: ClassVar[str]

    def __init__(self, model: str, *, max_tokens: int = 1024, temperature: float = 0.2) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature

    def _params(
        self,
        max_tokens: int | None,
        temperature: float | None,
        stop: Sequence[str] | None,
        json_mode: bool = False,
        json_schema: Mapping[str, Any] | None = None,
    ) -> GenerationParams:
        return GenerationParams(
            max_tokens=self.max_tokens if max_tokens is None else max_tokens,
            temperature=self.temperature if temperature is None else temperature,
            stop=tuple(stop or ()),
            json_mode=json_mode,
            json_schema=json_schema,
        )

    async def generate(
        self,
        prompt: Prompt,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        stop: Sequence[str] | None = None,
    ) -> Completion:
        """The model's reply to ``prompt`` (a string or chat messages)."""
        started = time.monotonic()
        completion = await self._complete(
            as_messages(prompt, system), self._params(max_tokens, temperature, stop)
        )
        if not completion.duration_s:
            completion.duration_s = time.monotonic() - started
        return completion

    async def generate_many(
        self,
        prompt: Prompt,
        count: int,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> list[Completion | ProviderError]:
        """``count`` replies to one prompt (samples: give a temperature), each a completion
        or the error that lost it: one lost reply leaves the others.

        A provider that reads the prompt once for all of them (local: its cache keeps the
        prompt between the replies) charges its input tokens once, on the first reply, as
        an API's ``n`` bills them; the others make ``count`` calls, each charged in full."""
        return await self._complete_many(
            as_messages(prompt, system), self._params(max_tokens, temperature, None), count
        )

    async def _complete_many(
        self, messages: list[Message], params: GenerationParams, count: int
    ) -> list[Completion | ProviderError]:
        """``count`` calls at once, each timed on its own (a reply's model time is its
        call's, as with ``generate``)."""

        async def one() -> Completion | ProviderError:
            started = time.monotonic()
            try:
                completion = await self._complete(messages, params)
            except ProviderError as exc:
                return exc
            if not completion.duration_s:
                completion.duration_s = time.monotonic() - started
            return completion

        return list(await asyncio.gather(*(one() for _ in range(count))))

    async def stream(
        self,
        prompt: Prompt,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        stop: Sequence[str] | None = None,
    ) -> AsyncIterator[str]:
        """The reply as it is produced."""
        params = self._params(max_tokens, temperature, stop)
        async for chunk in self._stream(as_messages(prompt, system), params):
            yield valid_text(chunk)

    async def _stream(
        self, messages: list[Message], params: GenerationParams
    ) -> AsyncIterator[str]:
        """Providers without streaming yield the whole reply at once."""
        completion = await self._complete(messages, params)
        yield completion.text

    async def generate_json(
        self,
        prompt: Prompt,
        schema: type[T],
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> tuple[T, Completion]:
        """A reply validated into ``schema``, and the (last) completion it came from.

        The schema is put in the prompt; a reply that is not valid JSON of that shape gets
        one repair turn that quotes the error. Token counts of both turns are summed on the
        completion returned.
        """
        json_schema = schema.model_json_schema()
        shape = json.dumps(json_schema, separators=(",", ":"))
        instruction = (
            "Answer with one JSON object and nothing else, matching this JSON schema:\n" + shape
        )
        messages = as_messages(prompt, system)
        messages.append(Message(role="user", content=instruction))
        params = self._params(
            max_tokens, temperature, None, json_mode=True, json_schema=json_schema
        )
        spent_in = spent_out = 0
        started = time.monotonic()
        problem = ""
        for _ in range(2):
            completion = await self._complete(messages, params)
            spent_in += completion.input_tokens
            spent_out += completion.output_tokens
            try:
                value = schema.model_validate(extract_json(completion.text))
            except (ValueError, ValidationError) as exc:
                problem = str(exc)
                messages += [
                    Message(role="assistant", content=completion.text),
                    Message(
                        role="user",
                        content=f"That reply was not valid: {problem[:800]}\n{instruction}",
                    ),
                ]
                continue
            completion.input_tokens, completion.output_tokens = spent_in, spent_out
            completion.duration_s = time.monotonic() - started
            return value, completion
        raise ModelOutputError(
            f"{self.name} model {self.model} did not answer with a valid "
            f"{schema.__name__} after a repair turn: {problem[:300]}"
        )

    @abstractmethod
    async def _complete(self, messages: list[Message], params: GenerationParams) -> Completion:
        """One call to the model."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook, most providers hold nothing
        """Release connections or the loaded model."""


_FENCE = re.compile(r"```(?:json)?\s*\n?(.*?)```", re.DOTALL)


def extract_json(text: str) -> Any:
    """The first JSON object in a model's reply: bare, inside a ``` fence, or amid prose."""
    candidates = [text.strip(), *(m.strip() for m in _FENCE.findall(text))]
    for candidate in candidates:
        try:
            return json.loads(candidate)
        except ValueError:
            pass
    decoder = json.JSONDecoder()
    for start in (i for i, ch in enumerate(text) if ch == "{"):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        return value
    raise ValueError(f"no JSON object in the reply: {text[:200]!r}")


# ----------------------------------------------------------------------------- HTTP


class HttpProvider(Provider):
    """A provider reached over HTTP: retries, error mapping and SSE in one place."""

    def __init__(
        self,
        model: str,
        *,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 2,
        max_tokens: int = 1024,
        temperature: float = 0.2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(model, max_tokens=max_tokens, temperature=temperature)
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.retries = retries
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout_s, connect=min(10.0, timeout_s)),
            headers=self._headers(),
            transport=transport,
        )

    def _headers(self) -> dict[str, str]:
        """Auth and version headers of the provider's API."""
        return {}

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _post(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST a JSON body; the JSON reply. Retries what is worth retrying."""
        for attempt in range(self.retries + 1):
            try:
                response = await self._client.post(path, json=body)
            except httpx.TimeoutException as exc:
                raise ProviderError(
                    f"{self.name} did not answer within {self.timeout_s:g} s "
                    "(raise LLM_TIMEOUT_SECONDS)"
                ) from exc
            except httpx.TransportError as exc:
                if attempt < self.retries:
                    await asyncio.sleep(_backoff_s(attempt, None))
                    continue
                raise ProviderError(f"{self.name} at {self.base_url}: {exc!r}") from exc
            if _retryable(response.status_code) and attempt < self.retries:
                await asyncio.sleep(_backoff_s(attempt, response.headers.get("retry-after")))
                continue
            self._raise_for_status(response)
            try:
                data = response.json()
            except ValueError as exc:
                raise ProviderError(
                    f"{self.name} answered with something that is not JSON: "
                    f"{response.text[:ERROR_BODY_CHARS]!r}"
                ) from exc
            if not isinstance(data, dict):
                raise ProviderError(f"{self.name} answered with JSON that is not an object")
            return data
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def _stream_lines(self, path: str, body: Mapping[str, Any]) -> AsyncGenerator[str, None]:
        """POST and yield the reply's lines as they come (SSE or newline-delimited JSON).

        A stream is retried only before its first line: after that, output was seen.
        """
        started = False
        for attempt in range(self.retries + 1):
            try:
                async with self._client.stream("POST", path, json=body) as response:
                    if _retryable(response.status_code) and attempt < self.retries:
                        await response.aread()
                        delay = _backoff_s(attempt, response.headers.get("retry-after"))
                        await asyncio.sleep(delay)
                        continue
                    if response.status_code >= 400:
                        await response.aread()
                        self._raise_for_status(response)
                    async for line in response.aiter_lines():
                        if line:
                            started = True
                            yield line
                    return
            except httpx.TimeoutException as exc:
                raise ProviderError(
                    f"{self.name} stream stalled for {self.timeout_s:g} s "
                    "(raise LLM_TIMEOUT_SECONDS)"
                ) from exc
            except httpx.TransportError as exc:
                # Before the first line nothing was seen: a dropped link is worth a retry.
                if not started and attempt < self.retries:
                    await asyncio.sleep(_backoff_s(attempt, None))
                    continue
                raise ProviderError(f"{self.name} stream broke: {exc!r}") from exc

    def _raise_for_status(self, response: httpx.Response) -> None:
        status = response.status_code
        if status < 400:
            return
        detail = _error_detail(response)
        message = f"{self.name} answered HTTP {status}: {detail}"
        if status in (401, 403):
            raise ProviderAuthError(message + f" (check the {self.name} API key)")
        if status == 429:
            raise ProviderRateLimited(message)
        if status < 500:
            raise ProviderRequestRefused(message)
        raise ProviderError(message)


def streamed_object(provider: str, payload: str) -> dict[str, Any]:
    """One streamed JSON object (an SSE payload, an NDJSON line), or a ProviderError."""
    try:
        value = json.loads(payload)
    except ValueError as exc:
        raise ProviderError(
            f"{provider} streamed something that is not JSON: {payload[:200]!r}"
        ) from exc
    if not isinstance(value, dict):
        raise ProviderError(f"{provider} streamed JSON that is not an object: {payload[:200]!r}")
    return value


def no_text(provider: str, finish: str | None, field: str, refusal: object = None) -> str:
    """Why a reply had no text: the provider's refusal, or its finish reason (``field`` is
    what the API calls it)."""
    if refusal:
        return f"{provider} refused to answer: {str(refusal)[:300]}"
    hint = " (raise LLM_MAX_TOKENS)" if finish == "length" else ""
    return f"{provider} returned no text ({field} {finish}){hint}"


def sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line, or None for comments, events and blanks."""
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


def _backoff_s(attempt: int, retry_after: str | None) -> float:
    if retry_after is not None:
        try:
            return min(max(float(retry_after), 0.0), RETRY_CAP_S)
        except ValueError:
            pass
    return float(min(RETRY_BASE_S * 2**attempt, RETRY_CAP_S))


def _error_detail(response: httpx.Response) -> str:
    """The provider's own error message where its body has one (all use ``error``)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:ERROR_BODY_CHARS] or response.reason_phrase
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])[:ERROR_BODY_CHARS]
    if isinstance(error, str):
        return error[:ERROR_BODY_CHARS]
    return json.dumps(body)[:ERROR_BODY_CHARS]

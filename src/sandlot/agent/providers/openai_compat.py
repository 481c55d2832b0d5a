"""OpenAI's chat-completions wire format, and the services that speak it.

``POST {base}/chat/completions`` with ``Authorization: Bearer KEY``. A reply carries
``choices[0].message.content``; a stream is server-sent events of
``{"choices": [{"delta": {"content": ...}}]}`` ending with ``data: [DONE]``. An error that
happens after the stream began arrives as a chunk with an ``error`` object (OpenAI, OpenRouter),
since the HTTP status has already been sent.

OpenAI, Groq and OpenRouter differ only in base URL and, for OpenRouter, attribution headers.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, ClassVar

from sandlot.agent.providers.base import (
    Completion,
    GenerationParams,
    HttpProvider,
    Message,
    no_text,
    sse_data,
    streamed_object,
)
from sandlot.errors import ProviderAuthError, ProviderError, ProviderRequestRefused

_FINISH = {"stop": "stop", "length": "length"}


class OpenAICompatibleProvider(HttpProvider):
    """Any service that speaks OpenAI chat completions (vLLM, LiteLLM and the like too)."""

    name: ClassVar[str] = "openai-compatible"
    path: ClassVar[str] = "/chat/completions"

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _body(
        self, messages: list[Message], params: GenerationParams, *, stream: bool
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m.role, "content": m.content} for m in messages],
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "stream": stream,
        }
        # Some compatible servers reject an empty list, so no stop sequences means no field.
        if params.stop:
            body["stop"] = list(params.stop)
        if params.json_mode:
            body["response_format"] = {"type": "json_object"}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def _complete(self, messages: list[Message], params: GenerationParams) -> Completion:
        data = await self._post(self.path, self._body(messages, params, stream=False))
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ProviderError(f"{self.name} answered without choices: {json.dumps(data)[:300]}")
        text, finish = self._choice_text(choices[0])
        usage = data.get("usage") or {}
        return Completion(
            text=text,
            provider=self.name,
            model=self.model,
            input_tokens=int(usage.get("prompt_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or 0),
            finish_reason=finish,
        )

    def _choice_text(self, choice: dict[str, Any]) -> tuple[str, str | None]:
        """A choice's text and finish reason; a ProviderError naming why it has no text."""
        message = choice.get("message") or {}
        finish = _finish_reason(choice.get("finish_reason"))
        text = message.get("content") or ""
        if not text:
            raise ProviderError(no_text(self.name, finish, "finish_reason", message.get("refusal")))
        return str(text), finish

    async def _stream(
        self, messages: list[Message], params: GenerationParams
    ) -> AsyncIterator[str]:
        """The reply's text deltas as the service sends them.

        Raises:
            ProviderError: the stream carried an error chunk, broke, stalled, or had no text.
        """
        body = self._body(messages, params, stream=True)
        finish: str | None = None
        saw_text = False
        # Closed explicitly so that an error raised here releases the connection at once.
        lines = self._stream_lines(self.path, body)
        async with aclosing(lines):
            async for line in lines:
                payload = sse_data(line)
                if payload is None:  # comments such as OpenRouter's ": OPENROUTER PROCESSING"
                    continue
                if payload == "[DONE]":
                    break
                chunk = streamed_object(self.name, payload)
                if chunk.get("error"):
                    raise ProviderError(f"{self.name} stream failed: {_error_text(chunk['error'])}")
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        saw_text = True
                        yield str(content)
                    finish = _finish_reason(choice.get("finish_reason")) or finish
        if not saw_text:
            raise ProviderError(no_text(self.name, finish, "finish_reason", None))


class OpenAIProvider(OpenAICompatibleProvider):
    name: ClassVar[str] = "openai"

    async def _complete_many(
        self, messages: list[Message], params: GenerationParams, count: int
    ) -> list[Completion | ProviderError]:
        """One request with ``n``: OpenAI reads and bills the prompt once for all choices.
        The usage is one total: the prompt is charged to the first reply and the output
        shared by the replies' lengths. Choices a server leaves out are asked for one by
        one."""
        if count < 2:
            return await super()._complete_many(messages, params, count)
        started = time.monotonic()
        body = self._body(messages, params, stream=False) | {"n": count}
        try:
            data = await self._post(self.path, body)
        except ProviderAuthError as exc:
            return [exc] * count
        except ProviderRequestRefused:
            # A server behind this URL that does not take n: one call a sample.
            return await super()._complete_many(messages, params, count)
        except ProviderError as exc:
            return [exc] * count  # down, too slow or limited: one call a sample would be too
        elapsed_s = time.monotonic() - started
        raw = data.get("choices")
        choices = [c for c in raw if isinstance(c, dict)][:count] if isinstance(raw, list) else []
        replies: list[tuple[str, str | None] | ProviderError] = []
        for choice in choices:
            try:
                replies.append(self._choice_text(choice))
            except ProviderError as exc:
                replies.append(exc)
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        output_tokens = int(usage.get("completion_tokens") or 0)
        lengths = [len(r[0]) if isinstance(r, tuple) else 0 for r in replies]
        answered = [i for i, reply in enumerate(replies) if isinstance(reply, tuple)]
        out: list[Completion | ProviderError] = []
        shared = 0
        for i, reply in enumerate(replies):
            if isinstance(reply, ProviderError):
                out.append(reply)
                continue
            text, finish = reply
            # The output total split by length; the last reply takes the rounding.
            share = output_tokens * lengths[i] // max(sum(lengths), 1)
            if i == answered[-1]:
                share = output_tokens - shared
            shared += share
            first = i == answered[0]
            out.append(
                Completion(
                    text=text,
                    provider=self.name,
                    model=self.model,
                    input_tokens=prompt_tokens if first else 0,
                    output_tokens=share,
                    # One request's time, charged once like its prompt.
                    duration_s=elapsed_s if first else 0.0,
                    finish_reason=finish,
                )
            )
        if len(out) < count:
            out += await super()._complete_many(messages, params, count - len(out))
        return out


class GroqProvider(OpenAICompatibleProvider):
    name: ClassVar[str] = "groq"


class OpenRouterProvider(OpenAICompatibleProvider):
    """OpenRouter, with the attribution headers it documents (its rankings key on them)."""

    name: ClassVar[str] = "openrouter"
    app_url: ClassVar[str] = "https://pypi.org/project/sandlot/"
    app_title: ClassVar[str] = "sandlot"

    def _headers(self) -> dict[str, str]:
        return {
            **super()._headers(),
            "HTTP-Referer": self.app_url,
            "X-Title": self.app_title,
        }


def _finish_reason(raw: object) -> str | None:
    if not raw:
        return None
    return _FINISH.get(str(raw), str(raw))


def _error_text(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or json.dumps(error))[:500]
    return str(error)[:500]

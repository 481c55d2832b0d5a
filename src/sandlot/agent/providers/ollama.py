"""A local or remote Ollama server's chat API.

``POST {base}/api/chat`` with no key. Limits go in ``options`` (``num_predict``, ``temperature``,
``stop``); ``format: "json"`` constrains the reply to JSON. A stream is newline-delimited JSON
objects (not server-sent events), the last with ``done: true`` and the token counts. Errors are
``{"error": "..."}``, as the whole body of a failed request or as a line of a stream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, ClassVar

import httpx

from sandlot.agent.providers.base import (
    Completion,
    GenerationParams,
    HttpProvider,
    Message,
    no_text,
    streamed_object,
)
from sandlot.errors import ProviderError


class OllamaProvider(HttpProvider):
    name: ClassVar[str] = "ollama"
    path: ClassVar[str] = "/api/chat"

    def __init__(
        self,
        model: str,
        *,
        base_url: str = "http://localhost:11434",
        timeout_s: float = 120.0,
        retries: int = 2,
        max_tokens: int = 1024,
        temperature: float = 0.2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        # OLLAMA_HOST is often written the way Ollama itself accepts it: "127.0.0.1:11434".
        if "://" not in base_url:
            base_url = "http://" + base_url
        super().__init__(
            model,
            base_url=base_url,
            timeout_s=timeout_s,
            retries=retries,
            max_tokens=max_tokens,
            temperature=temperature,
            transport=transport,
        )

    def _body(
        self, messages: list[Message], params: GenerationParams, *, stream: bool
    ) -> dict[str, Any]:
        options: dict[str, Any] = {
            "num_predict": params.max_tokens,
            "temperature": params.temperature,
        }
        if params.stop:
            options["stop"] = list(params.stop)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": m.role, "content": m.content} for m in messages],
            "stream": stream,
            "options": options,
        }
        if params.json_mode:
            body["format"] = "json"
        return body

    async def _complete(self, messages: list[Message], params: GenerationParams) -> Completion:
        data = await self._post(self.path, self._body(messages, params, stream=False))
        if data.get("error"):
            raise ProviderError(f"{self.name} failed: {str(data['error'])[:500]}")
        text = str((data.get("message") or {}).get("content") or "")
        finish = _finish_reason(data)
        if not text:
            raise ProviderError(no_text(self.name, finish, "done_reason"))
        return Completion(
            text=text,
            provider=self.name,
            model=self.model,
            input_tokens=int(data.get("prompt_eval_count") or 0),
            output_tokens=int(data.get("eval_count") or 0),
            finish_reason=finish,
        )

    async def _stream(
        self, messages: list[Message], params: GenerationParams
    ) -> AsyncIterator[str]:
        """The reply's text as the server sends it, one JSON object per line.

        Raises:
            ProviderError: an ``error`` line, a broken or stalled stream, or no text.
        """
        body = self._body(messages, params, stream=True)
        finish: str | None = None
        saw_text = False
        # Closed explicitly so that an error raised here releases the connection at once.
        lines = self._stream_lines(self.path, body)
        async with aclosing(lines):
            async for line in lines:
                chunk = streamed_object(self.name, line)
                if chunk.get("error"):
                    raise ProviderError(f"{self.name} stream failed: {str(chunk['error'])[:500]}")
                content = (chunk.get("message") or {}).get("content")
                if content:
                    saw_text = True
                    yield str(content)
                if chunk.get("done"):
                    finish = _finish_reason(chunk)
                    break
        if not saw_text:
            raise ProviderError(no_text(self.name, finish, "done_reason"))

    def _raise_for_status(self, response: httpx.Response) -> None:
        # The commonest failure: the model was never pulled onto this server.
        if response.status_code == 404 and "not found" in response.text:
            raise ProviderError(
                f"{self.name} at {self.base_url} does not have model {self.model!r} "
                f"(run `ollama pull {self.model}` or set LLM_MODEL): {response.text[:300]}"
            )
        super()._raise_for_status(response)


def _finish_reason(data: dict[str, Any]) -> str | None:
    # "stop" and "length" are already our words; others ("load", "unload") pass through.
    raw = data.get("done_reason")
    return str(raw) if raw else None

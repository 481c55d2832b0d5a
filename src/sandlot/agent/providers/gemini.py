"""Google's Gemini API (generativelanguage.googleapis.com).

``POST {base}/v1beta/models/{model}:generateContent`` with ``x-goog-api-key``. Turns are
``contents`` of role ``user`` or ``model``; the system prompt is ``systemInstruction``. Streaming
is ``:streamGenerateContent?alt=sse``, each ``data:`` line a whole GenerateContentResponse.

A reply may have no text: the prompt was blocked (``promptFeedback.blockReason``, no
candidates) or the candidate stopped for safety, recitation and the like (``finishReason``).
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
    sse_data,
    streamed_object,
)
from sandlot.errors import ProviderAuthError, ProviderError

_FINISH = {"STOP": "stop", "MAX_TOKENS": "length"}


class GeminiProvider(HttpProvider):
    name: ClassVar[str] = "google"

    def _headers(self) -> dict[str, str]:
        return {"x-goog-api-key": self.api_key} if self.api_key else {}

    def _path(self, method: str) -> str:
        # The API's own model listing names models "models/gemini-..."; accept both spellings.
        model = self.model.removeprefix("models/")
        return f"/v1beta/models/{model}:{method}"

    def _body(self, messages: list[Message], params: GenerationParams) -> dict[str, Any]:
        contents: list[dict[str, Any]] = []
        for message in messages:
            if message.role == "system":
                continue
            role = "model" if message.role == "assistant" else "user"
            # Consecutive turns of one role become parts of one content: turns must alternate.
            if contents and contents[-1]["role"] == role:
                contents[-1]["parts"].append({"text": message.content})
            else:
                contents.append({"role": role, "parts": [{"text": message.content}]})
        config: dict[str, Any] = {
            "maxOutputTokens": params.max_tokens,
            "temperature": params.temperature,
        }
        if params.stop:
            config["stopSequences"] = list(params.stop)
        if params.json_mode:
            config["responseMimeType"] = "application/json"
        body: dict[str, Any] = {"contents": contents, "generationConfig": config}
        system = "\n\n".join(m.content for m in messages if m.role == "system")
        if system:
            body["systemInstruction"] = {"parts": [{"text": system}]}
        return body

    async def _complete(self, messages: list[Message], params: GenerationParams) -> Completion:
        data = await self._post(self._path("generateContent"), self._body(messages, params))
        _raise_if_blocked(self.name, data)
        text, finish = _text_and_finish(data)
        if not text:
            raise ProviderError(no_text(self.name, finish, "finishReason"))
        usage = data.get("usageMetadata") or {}
        return Completion(
            text=text,
            provider=self.name,
            model=self.model,
            input_tokens=int(usage.get("promptTokenCount") or 0),
            output_tokens=_output_tokens(usage),
            finish_reason=finish,
        )

    async def _stream(
        self, messages: list[Message], params: GenerationParams
    ) -> AsyncIterator[str]:
        """The reply's text as the API sends it, one GenerateContentResponse at a time.

        Raises:
            ProviderError: a blocked prompt, an error chunk, a broken or stalled stream, or a
                stream without text (the last finishReason is named).
        """
        body = self._body(messages, params)
        finish: str | None = None
        saw_text = False
        path = self._path("streamGenerateContent") + "?alt=sse"
        # Closed explicitly so that an error raised here releases the connection at once.
        lines = self._stream_lines(path, body)
        async with aclosing(lines):
            async for line in lines:
                payload = sse_data(line)
                if payload is None:
                    continue
                chunk = streamed_object(self.name, payload)
                if chunk.get("error"):
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    raise ProviderError(f"{self.name} stream failed: {str(message)[:500]}")
                _raise_if_blocked(self.name, chunk)
                text, chunk_finish = _text_and_finish(chunk)
                finish = chunk_finish or finish
                if text:
                    saw_text = True
                    yield text
        if not saw_text:
            raise ProviderError(no_text(self.name, finish, "finishReason"))

    def _raise_for_status(self, response: httpx.Response) -> None:
        # A wrong key is HTTP 400 INVALID_ARGUMENT with reason API_KEY_INVALID, not 401/403.
        if response.status_code == 400 and "API_KEY_INVALID" in response.text:
            raise ProviderAuthError(
                f"{self.name} answered HTTP 400: API key not valid "
                "(check GOOGLE_API_KEY or GEMINI_API_KEY)"
            )
        super()._raise_for_status(response)


def _text_and_finish(data: dict[str, Any]) -> tuple[str, str | None]:
    candidates = data.get("candidates") or []
    if not candidates or not isinstance(candidates[0], dict):
        return "", None
    candidate: dict[str, Any] = candidates[0]
    parts = (candidate.get("content") or {}).get("parts") or []
    # Parts marked "thought" are a thinking model's reasoning summary, not its answer.
    text = "".join(
        str(part.get("text") or "")
        for part in parts
        if isinstance(part, dict) and not part.get("thought")
    )
    raw = candidate.get("finishReason")
    finish = _FINISH.get(str(raw), str(raw).lower()) if raw else None
    return text, finish


def _raise_if_blocked(provider: str, data: dict[str, Any]) -> None:
    reason = (data.get("promptFeedback") or {}).get("blockReason")
    if reason:
        raise ProviderError(f"{provider} blocked the prompt (blockReason {reason})")


def _output_tokens(usage: dict[str, Any]) -> int:
    # Thinking models bill their hidden reasoning as output, counted apart from the answer.
    return int(usage.get("candidatesTokenCount") or 0) + int(usage.get("thoughtsTokenCount") or 0)

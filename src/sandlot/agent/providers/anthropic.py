"""Anthropic's Messages API.

``POST {base}/v1/messages`` with ``x-api-key`` and ``anthropic-version``. The system prompt is a
top-level ``system`` string, not a message, and ``messages`` must alternate user and assistant,
so system messages are lifted out and consecutive turns of one role are merged. A stream is
server-sent events whose ``data`` carries its own ``type`` (``message_start``,
``content_block_delta``, ``message_delta``, ``message_stop``, ``ping``, ``error``).

There is no JSON switch: ``generate_json`` relies on its prompt.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
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
from sandlot.errors import ProviderError

API_VERSION = "2023-06-01"
# The API rejects a temperature above 1, while LLM_TEMPERATURE allows up to 2 for others.
MAX_TEMPERATURE = 1.0
_FINISH = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length"}


class AnthropicProvider(HttpProvider):
    name: ClassVar[str] = "anthropic"
    path: ClassVar[str] = "/v1/messages"

    def _headers(self) -> dict[str, str]:
        headers = {"anthropic-version": API_VERSION}
        if self.api_key:
            headers["x-api-key"] = self.api_key
        return headers

    def _body(
        self, messages: list[Message], params: GenerationParams, *, stream: bool
    ) -> dict[str, Any]:
        system, turns = _split_system(messages)
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": params.max_tokens,
            "messages": turns,
            "temperature": min(params.temperature, MAX_TEMPERATURE),
        }
        if system:
            body["system"] = system
        if params.stop:
            body["stop_sequences"] = list(params.stop)
        if stream:
            body["stream"] = True
        return body

    async def _complete(self, messages: list[Message], params: GenerationParams) -> Completion:
        data = await self._post(self.path, self._body(messages, params, stream=False))
        blocks = data.get("content") or []
        text = "".join(
            str(block.get("text") or "")
            for block in blocks
            if isinstance(block, dict) and block.get("type") == "text"
        )
        finish = _finish_reason(data.get("stop_reason"))
        if not text:
            raise ProviderError(no_text(self.name, finish, "stop_reason"))
        usage = data.get("usage") or {}
        return Completion(
            text=text,
            provider=self.name,
            model=self.model,
            input_tokens=int(usage.get("input_tokens") or 0),
            output_tokens=int(usage.get("output_tokens") or 0),
            finish_reason=finish,
        )

    async def _stream(
        self, messages: list[Message], params: GenerationParams
    ) -> AsyncIterator[str]:
        """The reply's text deltas as the API sends them.

        Raises:
            ProviderError: an ``error`` event (e.g. overloaded), a broken or stalled stream,
                or a stream without text.
        """
        body = self._body(messages, params, stream=True)
        finish: str | None = None
        saw_text = False
        # Closed explicitly so that an error raised here releases the connection at once.
        lines = self._stream_lines(self.path, body)
        async with aclosing(lines):
            async for line in lines:
                payload = sse_data(line)
                if payload is None:  # the "event:" lines repeat the payload's own type
                    continue
                event = streamed_object(self.name, payload)
                kind = event.get("type")
                if kind == "content_block_delta":
                    delta = event.get("delta") or {}
                    if delta.get("type") == "text_delta" and delta.get("text"):
                        saw_text = True
                        yield str(delta["text"])
                elif kind == "message_delta":
                    finish = _finish_reason((event.get("delta") or {}).get("stop_reason"))
                elif kind == "error":
                    error = event.get("error") or {}
                    raise ProviderError(
                        f"{self.name} stream failed: {error.get('type', 'error')}: "
                        f"{str(error.get('message') or '')[:500]}"
                    )
                elif kind == "message_stop":
                    break
                # message_start, content_block_start/stop, ping and event types added later
                # carry no text: the API's versioning policy says to ignore unknown events.
        if not saw_text:
            raise ProviderError(no_text(self.name, finish, "stop_reason"))


def _split_system(messages: Sequence[Message]) -> tuple[str, list[dict[str, str]]]:
    """The joined system prompt, and the other turns with consecutive same-role ones merged."""
    system = "\n\n".join(m.content for m in messages if m.role == "system")
    turns: list[dict[str, str]] = []
    for message in messages:
        if message.role == "system":
            continue
        if turns and turns[-1]["role"] == message.role:
            turns[-1]["content"] += "\n\n" + message.content
        else:
            turns.append({"role": message.role, "content": message.content})
    return system, turns


def _finish_reason(raw: object) -> str | None:
    if not raw:
        return None
    return _FINISH.get(str(raw), str(raw))

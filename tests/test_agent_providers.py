"""The HTTP LLM providers against local servers that speak each service's real wire format.

Each of the six providers talks real HTTP to a uvicorn server (tests/wire_servers.py) whose
replies are shaped like the real API's: the same JSON fields, the same SSE or NDJSON framing,
the same error bodies. What the provider sent is recorded and asserted field by field, so a
wrong path, header or body shape fails here. A test scripts the server with a list of actions
(the last one repeats): a reply, an HTTP error, a stall, an error mid-stream, an empty reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sandlot.agent.config import AgentSettings
from sandlot.agent.providers import PROVIDERS, create_provider, provider_class
from sandlot.agent.providers import base as providers_base
from sandlot.agent.providers.anthropic import AnthropicProvider
from sandlot.agent.providers.base import HttpProvider, Message, Provider
from sandlot.agent.providers.gemini import GeminiProvider
from sandlot.agent.providers.ollama import OllamaProvider
from sandlot.agent.providers.openai_compat import (
    GroqProvider,
    OpenAIProvider,
    OpenRouterProvider,
)
from sandlot.errors import (
    ConfigError,
    ModelOutputError,
    ProviderAuthError,
    ProviderError,
    ProviderRateLimited,
)
from tests.wire_servers import WireServer, serve_all

API_KEY = "test-key-0123"
SHORT_TIMEOUT_S = 0.15  # the client's limit in the stall tests; the server stalls far longer
STALL_S = 3.0

# ----------------------------------------------------------------------------- scripts


@dataclass(frozen=True)
class Reply:
    chunks: tuple[str, ...] = ("Hello", ", wire", " world")
    input_tokens: int = 11
    output_tokens: int = 7
    finish: str = "stop"  # our word; each dialect writes its own

    @property
    def text(self) -> str:
        return "".join(self.chunks)


@dataclass(frozen=True)
class Fail:
    status: int
    message: str
    retry_after: str | None = None


@dataclass(frozen=True)
class Stall:
    """Answer nothing for ``seconds``; with ``chunks``, stall after streaming them."""

    seconds: float = STALL_S
    chunks: tuple[str, ...] | None = None


@dataclass(frozen=True)
class StreamError:
    chunks: tuple[str, ...]
    message: str


@dataclass(frozen=True)
class Empty:
    """The dialect's reply with no text (blocked, refused, filtered)."""


@dataclass(frozen=True)
class Raw:
    status: int
    body: dict[str, Any]


Action = Reply | Fail | Stall | StreamError | Empty | Raw


@dataclass(frozen=True)
class Want:
    """The generation parameters a request body must carry."""

    max_tokens: int = 1024
    temperature: float = 0.2
    stop: tuple[str, ...] = ()
    json_mode: bool = False
    stream: bool = False


@dataclass
class Script:
    actions: list[Action] = field(default_factory=lambda: [Reply()])
    lock: threading.Lock = field(default_factory=threading.Lock)

    def set(self, *actions: Action) -> None:
        with self.lock:
            self.actions = list(actions)

    def next(self) -> Action:
        with self.lock:
            return self.actions.pop(0) if len(self.actions) > 1 else self.actions[0]


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


class EscapedJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped, as many APIs send it: so a reply may carry a lone
    surrogate (``"\\ud800"``), which Starlette's own UTF-8 rendering cannot."""

    def render(self, content: Any) -> bytes:
        return _compact(content).encode("ascii")


# ----------------------------------------------------------------------------- dialects


def _leading_system(body: dict[str, Any]) -> str | None:
    """The system message of an OpenAI-style message list, which must come first."""
    systems = [m for m in body["messages"] if m["role"] == "system"]
    if not systems:
        return None
    assert len(systems) == 1
    assert body["messages"][0] == systems[0], "the system message must come first"
    return str(systems[0]["content"])


class Dialect:
    """One service's wire format, as its server writes it and as a test reads a request."""

    name: str
    cls: type[HttpProvider]
    media_type = "text/event-stream"
    finish_words: ClassVar[dict[str, str]] = {"stop": "stop", "length": "length"}
    empty_reason: str  # what the provider's error must name for an Empty reply

    @property
    def model(self) -> str:
        return PROVIDERS[self.name].recommended_model

    def path(self, *, stream: bool) -> str:
        raise NotImplementedError

    def query(self, *, stream: bool) -> dict[str, str]:
        return {}

    def is_stream(self, path: str, body: dict[str, Any]) -> bool:
        return bool(body.get("stream"))

    def reply(self, r: Reply) -> dict[str, Any]:
        raise NotImplementedError

    def empty(self) -> dict[str, Any]:
        raise NotImplementedError

    def frames(self, r: Reply, *, complete: bool) -> list[str]:
        raise NotImplementedError

    def stream_error(self, message: str) -> str:
        raise NotImplementedError

    def error(self, status: int, message: str) -> dict[str, Any]:
        raise NotImplementedError

    def check_headers(self, headers: dict[str, str]) -> None:
        raise NotImplementedError

    def system(self, body: dict[str, Any]) -> str | None:
        """The system prompt, read from where this API wants it."""
        raise NotImplementedError

    def turns(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        """(user|assistant, text) of each non-system turn."""
        raise NotImplementedError

    def check_params(self, body: dict[str, Any], want: Want) -> None:
        raise NotImplementedError


class OpenAIDialect(Dialect):
    name = "openai"
    cls: type[HttpProvider] = OpenAIProvider
    empty_reason = "content_filter"

    def path(self, *, stream: bool) -> str:
        return "/chat/completions"

    def _usage(self, r: Reply) -> dict[str, Any]:
        return {
            "prompt_tokens": r.input_tokens,
            "completion_tokens": r.output_tokens,
            "total_tokens": r.input_tokens + r.output_tokens,
            "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        }

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {
            "id": "chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT",
            "object": kind,
            "created": 1741569952,
            "model": self.model + "-2024-07-18",
            "system_fingerprint": "fp_06737a9306",
        }

    def _choice(
        self, message: dict[str, Any], finish: str | None, *, delta: bool
    ) -> dict[str, Any]:
        return {
            "index": 0,
            "delta" if delta else "message": message,
            "logprobs": None,
            "finish_reason": finish,
        }

    def reply(self, r: Reply) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": r.text,
            "refusal": None,
            "annotations": [],
        }
        return {
            **self._envelope("chat.completion"),
            "choices": [self._choice(message, self.finish_words[r.finish], delta=False)],
            "usage": self._usage(r),
            "service_tier": "default",
        }

    def empty(self) -> dict[str, Any]:
        message = {"role": "assistant", "content": None, "refusal": None}
        return {
            **self._envelope("chat.completion"),
            "choices": [self._choice(message, "content_filter", delta=False)],
            "usage": self._usage(Reply(output_tokens=0)),
        }

    def _chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> str:
        body = {**self._envelope("chat.completion.chunk"), "choices": choices, "usage": usage}
        return f"data: {_compact(body)}\n\n"

    def frames(self, r: Reply, *, complete: bool) -> list[str]:
        out = [self._chunk([self._choice({"role": "assistant", "content": ""}, None, delta=True)])]
        out += [self._chunk([self._choice({"content": c}, None, delta=True)]) for c in r.chunks]
        if complete:
            out.append(self._chunk([self._choice({}, self.finish_words[r.finish], delta=True)]))
            out.append(self._chunk([], self._usage(r)))  # stream_options.include_usage
            out.append("data: [DONE]\n\n")
        return out

    def stream_error(self, message: str) -> str:
        error = {"message": message, "type": "server_error", "param": None, "code": None}
        return f"data: {_compact({'error': error})}\n\n"

    def error(self, status: int, message: str) -> dict[str, Any]:
        kind, code = {
            401: ("invalid_request_error", "invalid_api_key"),
            429: ("requests", "rate_limit_exceeded"),
        }.get(status, ("server_error", None))
        return {"error": {"message": message, "type": kind, "param": None, "code": code}}

    def check_headers(self, headers: dict[str, str]) -> None:
        assert headers["authorization"] == f"Bearer {API_KEY}"
        assert headers["content-type"] == "application/json"

    def system(self, body: dict[str, Any]) -> str | None:
        return _leading_system(body)

    def turns(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        for message in body["messages"]:
            assert set(message) == {"role", "content"}
        return [(m["role"], m["content"]) for m in body["messages"] if m["role"] != "system"]

    def check_params(self, body: dict[str, Any], want: Want) -> None:
        assert body["model"] == self.model
        assert body["max_tokens"] == want.max_tokens
        assert body["temperature"] == want.temperature
        assert body["stream"] is want.stream
        assert body.get("stop") == (list(want.stop) if want.stop else None)
        assert ("stop" in body) == bool(want.stop)  # omitted, not [] or null, when none
        expected_format = {"type": "json_object"} if want.json_mode else None
        assert body.get("response_format") == expected_format
        assert body.get("stream_options") == ({"include_usage": True} if want.stream else None)
        allowed = {"model", "messages", "max_tokens", "temperature", "stream", "stop"}
        allowed |= {"response_format", "stream_options"}
        assert set(body) <= allowed


class GroqDialect(OpenAIDialect):
    name = "groq"
    cls = GroqProvider

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {
            "id": "chatcmpl-f51b2cd2-bef7-417e-964e-a08f0b513c22",
            "object": kind,
            "created": 1730241104,
            "model": self.model,
            "system_fingerprint": "fp_179b0f92c9",
            "x_groq": {"id": "req_01jbd6g2qdfw2adyrt2az8hz4w"},
        }

    def _usage(self, r: Reply) -> dict[str, Any]:
        return {
            "queue_time": 0.037493756,
            "prompt_tokens": r.input_tokens,
            "prompt_time": 0.000680594,
            "completion_tokens": r.output_tokens,
            "completion_time": 0.463333333,
            "total_tokens": r.input_tokens + r.output_tokens,
            "total_time": 0.464013927,
        }

    def error(self, status: int, message: str) -> dict[str, Any]:
        code = {401: "invalid_api_key", 429: "rate_limit_exceeded"}.get(status, "internal_error")
        return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


class OpenRouterDialect(OpenAIDialect):
    name = "openrouter"
    cls = OpenRouterProvider

    def _envelope(self, kind: str) -> dict[str, Any]:
        return {
            "id": "gen-1741569952-hZqYq7R0dXmbO5wDlB1c",
            "provider": "Chutes",
            "model": self.model,
            "object": kind,
            "created": 1741569952,
        }

    def frames(self, r: Reply, *, complete: bool) -> list[str]:
        # OpenRouter keeps a slow connection open with SSE comments.
        return [": OPENROUTER PROCESSING\n\n", *super().frames(r, complete=complete)]

    def stream_error(self, message: str) -> str:
        # After the first token OpenRouter cannot change the status, so the error rides a chunk.
        body = {
            **self._envelope("chat.completion.chunk"),
            "error": {"code": "server_error", "message": message},
            "choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "error"}],
        }
        return f"data: {_compact(body)}\n\n"

    def error(self, status: int, message: str) -> dict[str, Any]:
        return {"error": {"message": message, "code": status}}

    def check_headers(self, headers: dict[str, str]) -> None:
        super().check_headers(headers)
        assert headers["x-title"] == "sandlot"
        assert headers["http-referer"].startswith("https://")


class AnthropicDialect(Dialect):
    name = "anthropic"
    cls = AnthropicProvider
    finish_words: ClassVar[dict[str, str]] = {"stop": "end_turn", "length": "max_tokens"}
    empty_reason = "refusal"

    def path(self, *, stream: bool) -> str:
        return "/v1/messages"

    def _message(
        self, content: list[dict[str, Any]], stop_reason: str | None, r: Reply
    ) -> dict[str, Any]:
        return {
            "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": r.input_tokens,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": r.output_tokens,
            },
        }

    def reply(self, r: Reply) -> dict[str, Any]:
        content = [{"type": "text", "text": r.text}]
        return self._message(content, self.finish_words[r.finish], r)

    def empty(self) -> dict[str, Any]:
        return self._message([], "refusal", Reply(output_tokens=0))

    @staticmethod
    def _event(data: dict[str, Any]) -> str:
        return f"event: {data['type']}\ndata: {_compact(data)}\n\n"

    def frames(self, r: Reply, *, complete: bool) -> list[str]:
        start = self._message([], None, Reply(input_tokens=r.input_tokens, output_tokens=1))
        out = [
            self._event({"type": "message_start", "message": start}),
            self._event(
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                }
            ),
            self._event({"type": "ping"}),
        ]
        out += [
            self._event(
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": c},
                }
            )
            for c in r.chunks
        ]
        if complete:
            out += [
                self._event({"type": "content_block_stop", "index": 0}),
                self._event(
                    {
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": self.finish_words[r.finish],
                            "stop_sequence": None,
                        },
                        "usage": {"output_tokens": r.output_tokens},
                    }
                ),
                self._event({"type": "message_stop"}),
            ]
        return out

    def stream_error(self, message: str) -> str:
        return self._event(
            {"type": "error", "error": {"type": "overloaded_error", "message": message}}
        )

    def error(self, status: int, message: str) -> dict[str, Any]:
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(status, "api_error")
        return {
            "type": "error",
            "error": {"type": kind, "message": message},
            "request_id": "req_011CSHoEeqs5C35K2UUqR7Fy",
        }

    def check_headers(self, headers: dict[str, str]) -> None:
        assert headers["x-api-key"] == API_KEY
        assert headers["anthropic-version"] == "2023-06-01"
        assert "authorization" not in headers

    def system(self, body: dict[str, Any]) -> str | None:
        assert all(m["role"] in ("user", "assistant") for m in body["messages"])
        return body.get("system")

    def turns(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        roles = [m["role"] for m in body["messages"]]
        assert all(a != b for a, b in itertools.pairwise(roles)), "must alternate"
        return [(m["role"], m["content"]) for m in body["messages"]]

    def check_params(self, body: dict[str, Any], want: Want) -> None:
        assert body["model"] == self.model
        assert body["max_tokens"] == want.max_tokens
        assert body["temperature"] == want.temperature
        assert body.get("stream", False) is want.stream
        assert body.get("stop_sequences") == (list(want.stop) if want.stop else None)
        # No JSON switch in this API: want.json_mode changes nothing in the body.
        allowed = {"model", "max_tokens", "messages", "temperature", "system", "stop_sequences"}
        assert set(body) <= allowed | {"stream"}


class GeminiDialect(Dialect):
    name = "google"
    cls = GeminiProvider
    finish_words: ClassVar[dict[str, str]] = {"stop": "STOP", "length": "MAX_TOKENS"}
    empty_reason = "blockReason SAFETY"

    def path(self, *, stream: bool) -> str:
        method = "streamGenerateContent" if stream else "generateContent"
        return f"/v1beta/models/{self.model}:{method}"

    def query(self, *, stream: bool) -> dict[str, str]:
        return {"alt": "sse"} if stream else {}

    def is_stream(self, path: str, body: dict[str, Any]) -> bool:
        return path.endswith(":streamGenerateContent")

    def _usage(self, r: Reply, *, output: bool = True) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "promptTokenCount": r.input_tokens,
            "totalTokenCount": r.input_tokens + (r.output_tokens if output else 0),
            "promptTokensDetails": [{"modality": "TEXT", "tokenCount": r.input_tokens}],
        }
        if output:
            usage["candidatesTokenCount"] = r.output_tokens
        return usage

    def _response(self, text: str, finish: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        candidate: dict[str, Any] = {
            "content": {"parts": [{"text": text}], "role": "model"},
            "index": 0,
        }
        if finish:
            candidate["finishReason"] = finish
            candidate["avgLogprobs"] = -0.0521
        return {
            "candidates": [candidate],
            "usageMetadata": usage,
            "modelVersion": self.model + "-002",
            "responseId": "mPjzZ8z6JILu7M8PmPH3yQs",
        }

    def reply(self, r: Reply) -> dict[str, Any]:
        return self._response(r.text, self.finish_words[r.finish], self._usage(r))

    def empty(self) -> dict[str, Any]:
        ratings = [
            {"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH", "blocked": True}
        ]
        return {
            "promptFeedback": {"blockReason": "SAFETY", "safetyRatings": ratings},
            "usageMetadata": self._usage(Reply(), output=False),
            "modelVersion": self.model + "-002",
        }

    def frames(self, r: Reply, *, complete: bool) -> list[str]:
        # Google ends SSE lines with CRLF; each event is a whole GenerateContentResponse.
        out = []
        for i, chunk in enumerate(r.chunks):
            last = complete and i == len(r.chunks) - 1
            finish = self.finish_words[r.finish] if last else None
            body = self._response(chunk, finish, self._usage(r, output=last))
            out.append(f"data: {_compact(body)}\r\n\r\n")
        return out

    def stream_error(self, message: str) -> str:
        error = {"code": 503, "message": message, "status": "UNAVAILABLE"}
        return f"data: {_compact({'error': error})}\r\n\r\n"

    def error(self, status: int, message: str) -> dict[str, Any]:
        word = {401: "UNAUTHENTICATED", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}
        return {
            "error": {"code": status, "message": message, "status": word.get(status, "INTERNAL")}
        }

    def check_headers(self, headers: dict[str, str]) -> None:
        assert headers["x-goog-api-key"] == API_KEY
        assert "authorization" not in headers

    def system(self, body: dict[str, Any]) -> str | None:
        if "systemInstruction" not in body:
            return None
        [part] = body["systemInstruction"]["parts"]
        return str(part["text"])

    def turns(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        roles = {"user": "user", "model": "assistant"}
        return [
            (roles[c["role"]], "\n\n".join(p["text"] for p in c["parts"])) for c in body["contents"]
        ]

    def check_params(self, body: dict[str, Any], want: Want) -> None:
        config = body["generationConfig"]
        assert config["maxOutputTokens"] == want.max_tokens
        assert config["temperature"] == want.temperature
        assert config.get("stopSequences") == (list(want.stop) if want.stop else None)
        assert config.get("responseMimeType") == ("application/json" if want.json_mode else None)
        assert set(body) <= {"contents", "generationConfig", "systemInstruction"}


class OllamaDialect(Dialect):
    name = "ollama"
    cls = OllamaProvider
    media_type = "application/x-ndjson"
    empty_reason = "done_reason length"

    def path(self, *, stream: bool) -> str:
        return "/api/chat"

    def _final(self, text: str, finish: str, r: Reply) -> dict[str, Any]:
        return {
            "model": self.model,
            "created_at": "2025-03-10T09:12:31.512339Z",
            "message": {"role": "assistant", "content": text},
            "done_reason": finish,
            "done": True,
            "total_duration": 4883583458,
            "load_duration": 1334875,
            "prompt_eval_count": r.input_tokens,
            "prompt_eval_duration": 342546000,
            "eval_count": r.output_tokens,
            "eval_duration": 4535599000,
        }

    def reply(self, r: Reply) -> dict[str, Any]:
        return self._final(r.text, self.finish_words[r.finish], r)

    def empty(self) -> dict[str, Any]:
        # A thinking model can spend all of num_predict before it writes any content.
        return self._final("", "length", Reply())

    def frames(self, r: Reply, *, complete: bool) -> list[str]:
        out = [
            _compact(
                {
                    "model": self.model,
                    "created_at": "2025-03-10T09:12:30.1Z",
                    "message": {"role": "assistant", "content": c},
                    "done": False,
                }
            )
            + "\n"
            for c in r.chunks
        ]
        if complete:
            out.append(_compact(self._final("", self.finish_words[r.finish], r)) + "\n")
        return out

    def stream_error(self, message: str) -> str:
        return _compact({"error": message}) + "\n"

    def error(self, status: int, message: str) -> dict[str, Any]:
        return {"error": message}

    def check_headers(self, headers: dict[str, str]) -> None:
        assert "authorization" not in headers
        assert headers["content-type"] == "application/json"

    def system(self, body: dict[str, Any]) -> str | None:
        return _leading_system(body)

    def turns(self, body: dict[str, Any]) -> list[tuple[str, str]]:
        return [(m["role"], m["content"]) for m in body["messages"] if m["role"] != "system"]

    def check_params(self, body: dict[str, Any], want: Want) -> None:
        assert body["model"] == self.model
        assert body["stream"] is want.stream
        options = body["options"]
        assert options["num_predict"] == want.max_tokens
        assert options["temperature"] == want.temperature
        assert options.get("stop") == (list(want.stop) if want.stop else None)
        assert body.get("format") == ("json" if want.json_mode else None)
        assert set(body) <= {"model", "messages", "stream", "options", "format"}


DIALECTS: dict[str, Dialect] = {
    d.name: d
    for d in (
        OpenAIDialect(),
        GroqDialect(),
        OpenRouterDialect(),
        AnthropicDialect(),
        GeminiDialect(),
        OllamaDialect(),
    )
}


# ----------------------------------------------------------------------------- servers


def make_app(dialect: Dialect, script: Script) -> Starlette:
    async def wait_or_disconnect(request: Request, seconds: float) -> None:
        # Polled, so that a stall ends when the client gives up and the server can stop.
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline:
            if await request.is_disconnected():
                return
            await asyncio.sleep(0.01)

    def streamed(frames: list[str], stall_s: float = 0.0) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            for frame in frames:
                yield frame
                await asyncio.sleep(0)  # a chunk of its own on the wire
            if stall_s:
                await asyncio.sleep(stall_s)  # StreamingResponse cancels this on disconnect

        return StreamingResponse(body(), media_type=dialect.media_type)

    async def handle(request: Request) -> Response:
        body = await request.json()
        stream = dialect.is_stream(request.url.path, body)
        action = script.next()
        match action:
            case Fail(status, message, retry_after):
                headers = {"retry-after": retry_after} if retry_after is not None else None
                return JSONResponse(dialect.error(status, message), status, headers=headers)
            case Raw(status, raw):
                return JSONResponse(raw, status)
            case Empty():
                return JSONResponse(dialect.empty())
            case Stall(seconds, None):
                await wait_or_disconnect(request, seconds)
                return JSONResponse(dialect.reply(Reply()))
            case Stall(seconds, chunks):
                return streamed(dialect.frames(Reply(chunks or ()), complete=False), seconds)
            case StreamError(chunks, message):
                frames = dialect.frames(Reply(chunks), complete=False)
                return streamed([*frames, dialect.stream_error(message)])
            case Reply() if stream:
                return streamed(dialect.frames(action, complete=True))
            case Reply() if body.get("n", 1) > 1 and dialect.name == "openai":
                # OpenAI's n: that many choices in one reply, one usage for them all.
                reply = dialect.reply(action)
                count = int(body["n"])
                first = reply["choices"][0]
                reply["choices"] = [
                    first
                    | {"index": i, "message": first["message"] | {"content": f"{action.text} #{i}"}}
                    for i in range(count)
                ]
                reply["usage"]["completion_tokens"] = action.output_tokens * count
                return JSONResponse(reply)
            case Reply():
                return EscapedJSONResponse(dialect.reply(action))
        raise AssertionError(action)

    return Starlette(routes=[Route("/{path:path}", handle, methods=["POST"])])


@dataclass
class Wire:
    dialect: Dialect
    server: WireServer
    script: Script

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [r.json for r in self.server.requests]


@pytest.fixture(scope="module")
def wires() -> Iterator[dict[str, Wire]]:
    """One server per dialect for the whole module: six start-ups and one shutdown."""
    scripts = {name: Script() for name in DIALECTS}
    apps = {name: make_app(d, scripts[name]) for name, d in DIALECTS.items()}
    with serve_all(apps) as servers:
        yield {name: Wire(DIALECTS[name], servers[name], scripts[name]) for name in DIALECTS}


@pytest.fixture(params=list(DIALECTS))
def wire(request: pytest.FixtureRequest, wires: dict[str, Wire]) -> Wire:
    chosen = wires[request.param]
    chosen.server.clear()
    chosen.script.set(Reply())
    return chosen


Connect = Callable[..., HttpProvider]


@pytest.fixture
async def connect(wire: Wire) -> AsyncIterator[Connect]:
    """Build the wire's provider class pointed at its server; closed after the test."""
    made: list[HttpProvider] = []

    def make(**overrides: Any) -> HttpProvider:
        kwargs: dict[str, Any] = {"base_url": wire.server.url, "timeout_s": 5.0, "retries": 2}
        if wire.dialect.name != "ollama":
            kwargs["api_key"] = API_KEY
        model = overrides.pop("model", wire.dialect.model)
        provider = wire.dialect.cls(model, **(kwargs | overrides))
        made.append(provider)
        return provider

    yield make
    for provider in made:
        await provider.aclose()


async def collect(stream: AsyncIterator[str], into: list[str]) -> None:
    async for chunk in stream:
        into.append(chunk)


# ----------------------------------------------------------------------------- every provider


async def test_generate_sends_the_wire_request_and_reads_the_reply(
    wire: Wire, connect: Connect
) -> None:
    wire.script.set(Reply(("def f():", "\n    return 1"), input_tokens=21, output_tokens=9))
    completion = await connect().generate(
        "Write f.", max_tokens=77, temperature=0.5, stop=["```", "\n\n\n"]
    )
    [request] = wire.server.requests
    assert (request.method, request.path) == ("POST", wire.dialect.path(stream=False))
    assert request.query == wire.dialect.query(stream=False)
    wire.dialect.check_headers(request.headers)
    wire.dialect.check_params(
        request.json, Want(max_tokens=77, temperature=0.5, stop=("```", "\n\n\n"))
    )
    assert wire.dialect.turns(request.json) == [("user", "Write f.")]
    assert wire.dialect.system(request.json) is None
    assert completion.text == "def f():\n    return 1"
    assert (completion.provider, completion.model) == (wire.dialect.name, wire.dialect.model)
    assert (completion.input_tokens, completion.output_tokens) == (21, 9)
    assert completion.finish_reason == "stop"
    assert completion.duration_s > 0


async def test_defaults_and_a_reply_cut_at_max_tokens(wire: Wire, connect: Connect) -> None:
    wire.script.set(Reply(("cut sho",), finish="length"))
    completion = await connect(max_tokens=300, temperature=0.0).generate("Explain.")
    assert completion.finish_reason == "length"
    wire.dialect.check_params(wire.bodies[0], Want(max_tokens=300, temperature=0.0))


async def test_system_prompt_goes_where_the_api_wants_it(wire: Wire, connect: Connect) -> None:
    history = [
        Message(role="user", content="Q1"),
        Message(role="assistant", content="A1"),
        Message(role="user", content="Q2"),
    ]
    await connect().generate(history, system="Be terse.")
    [body] = wire.bodies
    assert wire.dialect.system(body) == "Be terse."
    assert wire.dialect.turns(body) == [("user", "Q1"), ("assistant", "A1"), ("user", "Q2")]


async def test_stream_yields_the_chunks_in_order(wire: Wire, connect: Connect) -> None:
    wire.script.set(Reply(("Hel", "lo, ", "str", "eam")))
    chunks = [c async for c in connect().stream("Say it.", system="S.", max_tokens=50)]
    assert chunks == ["Hel", "lo, ", "str", "eam"]
    [request] = wire.server.requests
    assert request.path == wire.dialect.path(stream=True)
    assert request.query == wire.dialect.query(stream=True)
    wire.dialect.check_headers(request.headers)
    wire.dialect.check_params(request.json, Want(max_tokens=50, stream=True))
    assert wire.dialect.system(request.json) == "S."


class Verdict(BaseModel):
    passed: bool
    reasons: list[str]


async def test_generate_json_asks_for_json(wire: Wire, connect: Connect) -> None:
    wire.script.set(Reply(('{"passed": true, "reasons": ["tests pass"]}',), 40, 12))
    verdict, completion = await connect().generate_json("Judge this.", Verdict)
    assert verdict == Verdict(passed=True, reasons=["tests pass"])
    assert (completion.input_tokens, completion.output_tokens) == (40, 12)
    [body] = wire.bodies
    wire.dialect.check_params(body, Want(json_mode=True))
    assert '"reasons"' in wire.dialect.turns(body)[-1][1]  # the schema is in the prompt


async def test_generate_json_repairs_an_invalid_reply(wire: Wire, connect: Connect) -> None:
    wire.script.set(
        Reply(("Sure! passed: yes",), input_tokens=30, output_tokens=5),
        Reply(('```json\n{"passed": false, "reasons": ["off by one"]}\n```',), 50, 14),
    )
    verdict, completion = await connect().generate_json("Judge this.", Verdict)
    assert verdict == Verdict(passed=False, reasons=["off by one"])
    assert (completion.input_tokens, completion.output_tokens) == (80, 19)
    first, second = wire.bodies
    assert wire.dialect.turns(second)[: len(wire.dialect.turns(first))] == wire.dialect.turns(first)
    (role_a, said), (role_u, repair) = wire.dialect.turns(second)[-2:]
    assert (role_a, said) == ("assistant", "Sure! passed: yes")
    assert role_u == "user"
    assert "That reply was not valid: no JSON object in the reply" in repair
    assert "JSON schema" in repair


async def test_generate_json_gives_up_after_one_repair(wire: Wire, connect: Connect) -> None:
    wire.script.set(Reply(('{"passed": "perhaps"}',)))
    with pytest.raises(ModelOutputError, match="Verdict"):
        await connect().generate_json("Judge this.", Verdict)
    assert len(wire.server.requests) == 2


@pytest.mark.parametrize("mode", ["generate", "stream"])
async def test_401_is_an_auth_error_and_not_retried(
    wire: Wire, connect: Connect, mode: str
) -> None:
    wire.script.set(Fail(401, "Incorrect API key provided: test-key"))
    provider = connect()
    with pytest.raises(ProviderAuthError, match="401: Incorrect API key provided") as caught:
        if mode == "generate":
            await provider.generate("hi")
        else:
            await collect(provider.stream("hi"), [])
    assert wire.dialect.name in str(caught.value)
    assert len(wire.server.requests) == 1


@pytest.mark.parametrize("mode", ["generate", "stream"])
async def test_429_is_retried_after_retry_after(wire: Wire, connect: Connect, mode: str) -> None:
    wire.script.set(Fail(429, "Rate limit reached", retry_after="0"), Reply(("ok",)))
    provider = connect()
    if mode == "generate":
        assert (await provider.generate("hi")).text == "ok"
    else:
        assert [c async for c in provider.stream("hi")] == ["ok"]
    assert len(wire.server.requests) == 2


async def test_429_every_time_is_rate_limited(wire: Wire, connect: Connect) -> None:
    wire.script.set(Fail(429, "Rate limit reached", retry_after="0"))
    with pytest.raises(ProviderRateLimited, match="429"):
        await connect(retries=1).generate("hi")
    assert len(wire.server.requests) == 2


async def test_500_every_time_fails_after_the_retries(
    wire: Wire, connect: Connect, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(providers_base, "RETRY_BASE_S", 0.0)  # real backoff is 0.5 s, 1 s
    wire.script.set(Fail(500, "The server had an error while processing your request"))
    with pytest.raises(ProviderError, match="HTTP 500: The server had an error") as caught:
        await connect(retries=2).generate("hi")
    assert not isinstance(caught.value, ProviderAuthError | ProviderRateLimited)
    assert len(wire.server.requests) == 3


async def test_a_stalled_server_times_out(wire: Wire, connect: Connect) -> None:
    wire.script.set(Stall())
    with pytest.raises(ProviderError, match=r"within 0.15 s \(raise LLM_TIMEOUT_SECONDS\)"):
        await connect(timeout_s=SHORT_TIMEOUT_S).generate("hi")


async def test_a_stream_that_stalls_midway_times_out(wire: Wire, connect: Connect) -> None:
    wire.script.set(Stall(chunks=("partial",)))
    received: list[str] = []
    with pytest.raises(ProviderError, match=r"stalled for 0.15 s \(raise LLM_TIMEOUT_SECONDS\)"):
        await collect(connect(timeout_s=SHORT_TIMEOUT_S).stream("hi"), received)
    assert received == ["partial"]


async def test_an_error_event_mid_stream_raises(wire: Wire, connect: Connect) -> None:
    wire.script.set(StreamError(("partial ", "answer"), "Overloaded"))
    received: list[str] = []
    with pytest.raises(ProviderError, match=r"stream failed: .*Overloaded"):
        await collect(connect().stream("hi"), received)
    assert received == ["partial ", "answer"]
    assert len(wire.server.requests) == 1  # output was seen: never retried


async def test_a_lone_surrogate_in_a_reply_is_replaced(wire: Wire, connect: Connect) -> None:
    # Failed before (red team, 2026-12-07): "\\ud800" in a reply's JSON decoded into a str
    # that no UTF-8 encoder takes; the loop's ast.parse raised, and POST /execute was a 500.
    wire.script.set(Reply(("print('", "\ud800", "')")))
    provider = connect()
    completion = await provider.generate("hi")
    assert completion.text == "print('\ufffd')"
    chunks = [chunk async for chunk in provider.stream("hi")]
    assert "".join(chunks) == "print('\ufffd')"


def test_completion_text_is_always_valid_unicode() -> None:
    def text(raw: str) -> str:
        return providers_base.Completion(text=raw, provider="p", model="m").text

    assert text("plain é 😀") == "plain é 😀"
    assert text("a\ud800b\udfff") == "a\ufffdb\ufffd"
    assert text("\ud83d\ude00") == "😀"  # a pair split into two code points is joined
    for raw in ("\ud800", "x\udc00\ud800y"):
        text(raw).encode("utf-8")


async def test_a_reply_without_text_is_an_error_naming_why(wire: Wire, connect: Connect) -> None:
    wire.script.set(Empty())
    with pytest.raises(ProviderError, match=wire.dialect.empty_reason):
        await connect().generate("hi")


async def test_create_provider_from_settings(wire: Wire) -> None:
    name = wire.dialect.name
    where: dict[str, Any] = {"ollama_host": wire.server.url}
    if name != "ollama":
        where = {f"{name}_api_key": API_KEY, f"{name}_base_url": wire.server.url}
    settings = AgentSettings(
        llm_model=None, llm_max_tokens=64, llm_temperature=0.7, llm_timeout_s=5, **where
    )
    provider = create_provider(name, settings=settings)
    try:
        assert type(provider) is wire.dialect.cls
        assert (await provider.generate("hi")).text == Reply().text
    finally:
        await provider.aclose()
    [request] = wire.server.requests
    wire.dialect.check_headers(request.headers)
    wire.dialect.check_params(request.json, Want(max_tokens=64, temperature=0.7))


# ----------------------------------------------------------------------------- one provider


def test_create_provider_without_a_key_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="GROQ_API_KEY"):
        create_provider("groq", settings=AgentSettings(groq_api_key=None))


def test_every_provider_row_names_a_provider_class() -> None:
    for name, spec in PROVIDERS.items():
        cls = provider_class(name)
        assert issubclass(cls, Provider) and cls.__name__ == spec.target.partition(":")[2]
        if spec.key_setting is not None:
            assert spec.key_setting in AgentSettings.model_fields
        if spec.url_setting is not None:
            assert spec.url_setting in AgentSettings.model_fields
    with pytest.raises(ConfigError, match="choose one of: anthropic, google"):
        provider_class("gpt-17")


def test_a_missing_optional_dependency_names_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = dataclasses.replace(PROVIDERS["local"], requires="no_such_module_0123")
    monkeypatch.setitem(PROVIDERS, "local", missing)
    with pytest.raises(
        ConfigError, match=r"no_such_module_0123 module: pip install 'sandlot\[local\]'"
    ):
        create_provider("local", settings=AgentSettings())


@pytest.mark.parametrize("wire", ["anthropic"], indirect=True)
async def test_anthropic_lifts_system_and_merges_turns(wire: Wire, connect: Connect) -> None:
    messages = [
        Message(role="system", content="Rule one."),
        Message(role="user", content="u1"),
        Message(role="user", content="u2"),
        Message(role="system", content="Rule two."),
        Message(role="assistant", content="a1"),
        Message(role="user", content="u3"),
    ]
    await connect(temperature=1.6).generate(messages)
    [body] = wire.bodies
    assert body["system"] == "Rule one.\n\nRule two."
    assert body["messages"] == [
        {"role": "user", "content": "u1\n\nu2"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "u3"},
    ]
    assert body["temperature"] == 1.0  # the API's maximum


@pytest.mark.parametrize("wire", ["google"], indirect=True)
async def test_gemini_merges_turns_into_parts(wire: Wire, connect: Connect) -> None:
    messages = [
        Message(role="user", content="u1"),
        Message(role="user", content="u2"),
        Message(role="assistant", content="a1"),
    ]
    await connect(model="models/" + wire.dialect.model).generate(messages)
    [request] = wire.server.requests
    assert request.path == wire.dialect.path(stream=False)  # "models/" not doubled
    assert request.json["contents"] == [
        {"role": "user", "parts": [{"text": "u1"}, {"text": "u2"}]},
        {"role": "model", "parts": [{"text": "a1"}]},
    ]


@pytest.mark.parametrize("wire", ["google"], indirect=True)
async def test_gemini_invalid_key_is_an_auth_error(wire: Wire, connect: Connect) -> None:
    # What the real API answers for a wrong key: 400, not 401.
    detail = {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": "API_KEY_INVALID",
        "domain": "googleapis.com",
    }
    error = {
        "code": 400,
        "message": "API key not valid. Please pass a valid API key.",
        "status": "INVALID_ARGUMENT",
        "details": [detail],
    }
    wire.script.set(Raw(400, {"error": error}))
    with pytest.raises(ProviderAuthError, match="GOOGLE_API_KEY"):
        await connect().generate("hi")


@pytest.mark.parametrize("wire", ["google"], indirect=True)
async def test_gemini_candidate_stopped_for_safety(wire: Wire, connect: Connect) -> None:
    candidate = {"finishReason": "SAFETY", "index": 0, "safetyRatings": []}
    wire.script.set(Raw(200, {"candidates": [candidate], "usageMetadata": {"promptTokenCount": 5}}))
    with pytest.raises(ProviderError, match="finishReason safety"):
        await connect().generate("hi")


@pytest.mark.parametrize("wire", ["ollama"], indirect=True)
async def test_ollama_model_not_pulled(wire: Wire, connect: Connect) -> None:
    missing = "model 'nope:1b' not found, try pulling it first"
    wire.script.set(Raw(404, {"error": missing}))
    with pytest.raises(ProviderError, match=r"ollama pull nope:1b.*try pulling it first"):
        await connect(model="nope:1b").generate("hi")


@pytest.mark.parametrize("wire", ["ollama"], indirect=True)
async def test_ollama_host_without_a_scheme(wire: Wire, connect: Connect) -> None:
    bare = wire.server.url.removeprefix("http://")
    assert (await connect(base_url=bare).generate("hi")).text == Reply().text


# ----------------------------------------------------------------------------- samples


@pytest.mark.parametrize("name", ["openai", "groq"])
async def test_samples_of_one_prompt(wires: dict[str, Wire], name: str) -> None:
    # OpenAI draws the samples in one request with n and bills the prompt once; a service
    # without n (Groq refuses n > 1) gets one request a sample, each charged in full.
    wire = wires[name]
    wire.server.clear()
    wire.script.set(Reply(("def f():", " return 1"), input_tokens=30, output_tokens=10))
    provider = wire.dialect.cls(
        wire.dialect.model, base_url=wire.server.url, api_key=API_KEY, timeout_s=5.0
    )
    try:
        replies = await provider.generate_many("Write f.", 3, temperature=0.8)
    finally:
        await provider.aclose()
    completions = [r for r in replies if not isinstance(r, ProviderError)]
    assert len(completions) == 3
    bodies = [r.json for r in wire.server.requests]
    assert all(b["temperature"] == 0.8 for b in bodies)
    if name == "openai":
        assert [b.get("n") for b in bodies] == [3]
        assert [c.text for c in completions] == [f"def f(): return 1 #{i}" for i in range(3)]
        assert [c.input_tokens for c in completions] == [30, 0, 0]
        assert sum(c.output_tokens for c in completions) == 30
    else:
        assert [b.get("n") for b in bodies] == [None] * 3
        assert [(c.input_tokens, c.output_tokens) for c in completions] == [(30, 10)] * 3


async def test_a_server_that_refuses_n_gets_one_request_a_sample(wires: dict[str, Wire]) -> None:
    wire = wires["openai"]
    wire.server.clear()
    wire.script.set(Fail(400, "n is not supported"), Reply(input_tokens=30, output_tokens=10))
    provider = OpenAIProvider(
        wire.dialect.model, base_url=wire.server.url, api_key=API_KEY, timeout_s=5.0
    )
    try:
        replies = await provider.generate_many("Write f.", 2, temperature=0.8)
    finally:
        await provider.aclose()
    assert [b.get("n") for b in (r.json for r in wire.server.requests)] == [2, None, None]
    assert [(c.input_tokens, c.output_tokens) for c in replies] == [(30, 10)] * 2  # type: ignore[union-attr]

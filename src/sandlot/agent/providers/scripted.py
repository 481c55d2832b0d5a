"""``scripted``: a provider that replays replies given in advance.

A real implementation of the interface (``generate_json`` and ``stream`` go through the same
code as for any model), used to test the loop and the swarm end to end, and to replay a
recorded session. Each call takes the next reply of the script; a reply may be a string, an
exception to raise (a provider failing), or a function of the messages (a reply that
depends on the prompt). Every call's messages are kept in ``calls``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import ClassVar

from sandlot.agent.providers.base import Completion, GenerationParams, Message, Provider
from sandlot.errors import ProviderError

Reply = str | BaseException | Callable[[list[Message]], str]


class ScriptedProvider(Provider):
    name: ClassVar[str] = "scripted"

    def __init__(
        self,
        replies: Iterable[Reply] = (),
        *,
        model: str = "script",
        max_tokens: int = 1024,
        temperature: float = 0.0,
        by_role: dict[str, list[Reply]] | None = None,
    ) -> None:
        """``by_role`` scripts calls whose system prompt starts with ``You are the <role>``
        separately (the swarm's concurrent roles), the rest take ``replies`` in order."""
        super().__init__(model, max_tokens=max_tokens, temperature=temperature)
        self.replies = list(replies)
        self.by_role = {role: list(script) for role, script in (by_role or {}).items()}
        self.calls: list[list[Message]] = []
        self.temperatures: list[float] = []

    def _next(self, messages: list[Message]) -> Reply:
        system = messages[0].content if messages and messages[0].role == "system" else ""
        for role, script in self.by_role.items():
            if system.lower().startswith(f"you are the {role}") and script:
                return script.pop(0)
        if not self.replies:
            raise ProviderError(
                f"the script ran out of replies after {len(self.calls)} calls; last prompt: "
                f"{messages[-1].content[:200]!r}"
            )
        return self.replies.pop(0)

    async def _complete(self, messages: list[Message], params: GenerationParams) -> Completion:
        self.calls.append(list(messages))
        self.temperatures.append(params.temperature)
        reply = self._next(messages)
        if isinstance(reply, BaseException):
            raise reply
        text = reply if isinstance(reply, str) else reply(messages)
        words = text.split()
        finish = "stop"
        if len(words) > params.max_tokens:
            words, finish = words[: params.max_tokens], "length"
            text = " ".join(words)
        return Completion(
            text=text,
            provider=self.name,
            model=self.model,
            # Whitespace words stand in for tokens: the counts stay comparable run to run.
            input_tokens=sum(len(m.content.split()) for m in messages),
            output_tokens=len(words),
            finish_reason=finish,
        )

    @property
    def remaining(self) -> int:
        return len(self.replies) + sum(len(s) for s in self.by_role.values())

"""Token accounting: what model calls cost, added up in one place.

An attempt is charged each completion it took; a result is the sum of its attempts; the
benchmark reads the totals. The loop, the swarm and the benchmark all count through here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandlot.agent.providers.base import Completion


class Usage:
    """Mixin for a model that carries a cost: tokens in and out, seconds waiting on the model.

    The model declares the three fields itself, where its JSON has always had them: fields
    inherited from a pydantic base would move to the front of every dump.
    """

    if TYPE_CHECKING:
        input_tokens: int
        output_tokens: int
        llm_s: float

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def charge(self, completion: Completion) -> None:
        """Add one reply's cost."""
        self.input_tokens += completion.input_tokens
        self.output_tokens += completion.output_tokens
        self.llm_s += completion.duration_s

    def add(self, others: Iterable[Usage]) -> None:
        """Add the costs of others (a result's attempts)."""
        for other in others:
            self.input_tokens += other.input_tokens
            self.output_tokens += other.output_tokens
            self.llm_s += other.llm_s

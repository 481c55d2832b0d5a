"""What the agent memory keeps of a task, and how a recall reads in a prompt.

A :class:`MemoryRecord` is one finished task; :func:`bounded` cuts it to what
:func:`format_recall` shows of it before it is stored, so a record's size is bounded whatever
the task and code (a red team's 1,500 records of 20,000 characters grew a server's RSS by
159 MiB, 2026-12-07). :mod:`sandlot.agent.memory` stores and recalls them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

# Bounds of format_recall: the local model has a 4096-token context, most of it for the task.
RECALL_MAX_CHARS = 1500
RECALL_CODE_MAX_CHARS = 500
RECALL_TEXT_MAX_CHARS = 200
RECALL_MIN_SECTION_CHARS = 80  # less than this of a record tells the model nothing
# What a record keeps of its errors: the runtime passes its last three, recall shows one.
STORED_ERRORS = 3
OLDEST = datetime.min.replace(tzinfo=UTC)


class MemoryRecord(BaseModel):
    """One finished task, as the agent remembers it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str = Field(min_length=1, description="The task as the user asked it.")
    code: str = Field(description="The final code if solved, else the last code tried.")
    outcome: Literal["solved", "failed"] = Field(description="Whether the last code passed.")
    errors: list[str] = Field(
        default_factory=list, description="Short summaries of the errors met on the way."
    )
    fix: str | None = Field(
        default=None, description="The critique that led to the working code, if one did."
    )
    attempts: int = Field(default=1, ge=1, description="Code generations the task took.")
    created_at: AwareDatetime = Field(
        default_factory=lambda: datetime.now(UTC), description="When the task finished (UTC)."
    )
    tenant: str | None = Field(
        default=None,
        description="Whose task it was (the server's tenant); None for the SDK's and CLI's "
        "own runs. Recalled only for the same tenant.",
    )


def format_recall(
    hits: Sequence[tuple[MemoryRecord, float]], max_chars: int = RECALL_MAX_CHARS
) -> str:
    """A compact prompt section of recalled records, at most ``max_chars`` characters.

    Empty when there are no hits, so the caller can add it unconditionally. Code and texts are
    cut to fixed lengths; records that would overflow the budget are left out, except the
    best one, which is cut to fit.
    """
    if not hits:
        return ""
    header = "Similar past tasks (use what helps, ignore the rest):"
    sections: list[str] = []
    used_chars = len(header)
    for number, (record, score) in enumerate(hits, start=1):
        lines = [f"{number}. {_cut(record.task, RECALL_TEXT_MAX_CHARS)} (similarity {score:.2f})"]
        if record.errors:
            lines.append(f"   failed with: {_cut(record.errors[-1], RECALL_TEXT_MAX_CHARS)}")
        if record.fix:
            lines.append(f"   fixed by: {_cut(record.fix, RECALL_TEXT_MAX_CHARS)}")
        verdict = "worked" if record.outcome == "solved" else "last try, still failing"
        lines.append(f"   {verdict}:\n{_cut(record.code, RECALL_CODE_MAX_CHARS)}")
        section = "\n".join(lines)
        left_chars = max_chars - used_chars - 1
        if len(section) > left_chars:
            # The best hit is worth a cut; later ones are not worth crowding it.
            if sections or left_chars < RECALL_MIN_SECTION_CHARS:
                break
            section = _cut(section, left_chars)
        sections.append(section)
        used_chars += 1 + len(section)
    if not sections:
        return ""
    return "\n".join([header, *sections])


def bounded(record: MemoryRecord) -> MemoryRecord:
    """``record`` cut to what :func:`format_recall` shows of it, so a record's size is
    bounded whatever the task and code."""
    return record.model_copy(
        update={
            "task": _stored(record.task, RECALL_TEXT_MAX_CHARS),
            "code": _stored(record.code, RECALL_CODE_MAX_CHARS),
            "errors": [
                _stored(error, RECALL_TEXT_MAX_CHARS) for error in record.errors[-STORED_ERRORS:]
            ],
            "fix": None if record.fix is None else _stored(record.fix, RECALL_TEXT_MAX_CHARS),
        }
    )


def _stored(text: str, max_chars: int) -> str:
    # Cut as format_recall cuts, so the prompt shows the same; a text that fits is kept as
    # it is, and a long one of blanks keeps a mark (a task must not be empty).
    if len(text) <= max_chars:
        return text
    return _cut(text, max_chars) or "..."


def created_at(payload: dict[str, Any] | None) -> datetime:
    """A stored record's ``created_at``; one that is missing or unreadable counts as the
    oldest (it is no record this version can recall)."""
    value = (payload or {}).get("created_at")
    try:
        when = datetime.fromisoformat(value) if isinstance(value, str) else OLDEST
    except ValueError:
        return OLDEST
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _cut(text: str, max_chars: int) -> str:
    text = text.strip()
    if len(text) <= max_chars:
        return text
    return text[: max_chars - 4].rstrip() + " ..."

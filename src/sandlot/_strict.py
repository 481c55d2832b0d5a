"""One base for every model that refuses fields it does not know, cheaply.

With ``extra="forbid"`` alone, pydantic reports each unknown field as an error of its own, and
every layer above builds and formats each one: a 256 KiB body of 25,000 unknown keys took
the server's one event loop 150-400 ms and came back as a 1-3 MB error, for one request of
its key's rate (red team, 2026-12-06). Here the keys are compared with the model's before
any is validated, and all the unknown ones make one error naming the first few.
"""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

NAMED_AT_MOST = 5


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = _known_keys(cls)
            if known is not None and not data.keys() <= known:
                raise ValueError(unknown_fields(k for k in data if k not in known))
        return data


def unknown_fields(keys: Any) -> str:
    """The error for the unknown ``keys``: the first few named, and how many more."""
    unknown = list(keys)
    named = ", ".join(repr(str(k))[:40] for k in unknown[:NAMED_AT_MOST])
    more = len(unknown) - NAMED_AT_MOST
    return f"unknown field{'s' if len(unknown) > 1 else ''}: {named}" + (
        f" and {more} more" if more > 0 else ""
    )


@functools.cache
def _known_keys(model: type[BaseModel]) -> frozenset[str] | None:
    """The keys ``model`` takes (names and aliases); None where it takes others too, or
    names its inputs in ways this check does not follow (alias choices and paths)."""
    if model.model_config.get("extra") != "forbid":
        return None
    known: set[str] = set()
    for name, field in model.model_fields.items():
        known.add(name)
        for alias in (field.alias, field.validation_alias):
            if isinstance(alias, str):
                known.add(alias)
            elif alias is not None:
                return None
    return frozenset(known)


def at_most(count: int, what: str) -> Any:
    """A before-validator: a dict or list of more than ``count`` items is refused before
    any item is validated (pydantic checks ``max_length`` after, one error an item)."""

    def check(value: Any) -> Any:
        if isinstance(value, dict | list) and len(value) > count:
            raise ValueError(f"{what} has {len(value)} items; at most {count}")
        return value

    return check


def problems(errors: list[Any], at_most: int = 10) -> str:
    """Pydantic's errors as one line, the first ``at_most`` of them and how many more."""
    said = "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:at_most]
    )
    more = len(errors) - at_most
    return said + (f"; and {more} more" if more > 0 else "")

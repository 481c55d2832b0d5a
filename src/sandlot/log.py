"""structlog set-up: console lines for people, JSON lines for machines (``LOG_FORMAT``)."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

# Code points a terminal acts on rather than shows: C0 and C1 controls (ESC starts the
# sequences that move the cursor, erase lines or set a window's title), DEL, and the bidi
# controls that reorder what follows. Newlines and tabs stay: the console renderer quotes
# values that hold them, and a traceback needs them.
_CONTROLS = [*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0)]
_CONTROLS += [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
_ESCAPES = {code: f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" for code in _CONTROLS}


def escape_controls(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Show control characters in log lines as escapes: names and messages from inside a
    sandbox (artifact paths, a guest's listing errors) are logged, and the console renderer
    prints a string raw unless it holds whitespace or quotes, so sandboxed code could write
    escape sequences to an operator's terminal (fake lines, a hidden rest of the line; red
    team, 2026-11-25)."""
    for key, value in event.items():
        if isinstance(value, str):
            event[key] = value.translate(_ESCAPES)
    return event


def processors(fmt: str = "console") -> list[structlog.types.Processor]:
    """The chain every log event goes through, rendered as JSON or for the console."""
    # JSON escapes control characters itself (and keeps the value exact for machines).
    rendering: list[structlog.types.Processor] = (
        [structlog.processors.JSONRenderer()]
        if fmt == "json"
        else [escape_controls, structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    )
    return [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        *rendering,
    ]


def configure_logging(level: str = "INFO", fmt: str = "console") -> None:
    """Route structlog and stdlib logging to stderr at ``level``."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    structlog.configure(
        processors=processors(fmt),
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    if not root.handlers:
        # The stdlib's records (asyncio's errors, libraries') in the same lines. A process
        # whose root logger has no handler takes the first library's: the MCP SDK's
        # basicConfig put rich's on it, which spent ~0.1-1 s of the server's one event loop
        # on each traceback it drew, so a client that made asyncio log errors stalled the
        # server (red team, 2026-12-06). With a handler there, basicConfig does nothing.
        *chain, render = processors(fmt)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            structlog.stdlib.ProcessorFormatter(
                foreign_pre_chain=[structlog.stdlib.add_logger_name, *chain],
                processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, render],
            )
        )
        root.addHandler(handler)
        root.setLevel(numeric)

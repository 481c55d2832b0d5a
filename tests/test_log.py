"""Log lines never carry a terminal's control sequences from inside a sandbox."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from sandlot.log import processors

# A title set, a line erased, a carriage return and a fake line, a bidi override; no space,
# which the console renderer would have quoted.
HOSTILE = "\x1b]0;pwned\x07\x1b[2K\rINFO:all_good\u202e"


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_a_sandboxs_names_are_logged_with_their_controls_escaped(fmt: str) -> None:
    # Failed before (red team, 2026-11-25): an artifact's name went raw to the console (the
    # renderer quotes only strings with whitespace or quotes): ESC, BEL and CR reached the
    # operator's terminal. The chain configure_logging() installs, on a private stream.
    out = io.StringIO()
    log = structlog.wrap_logger(structlog.PrintLogger(out), processors=processors(fmt))
    log.warning("artifact not kept", path=HOSTILE, n=1)
    line = out.getvalue()
    assert not any(ch in line for ch in "\x1b\x07\r\u202e"), repr(line)
    if fmt == "json":  # escaped by JSON itself, and exact
        assert json.loads(line)["path"] == HOSTILE
    else:
        assert "\\x1b]0;pwned\\x07\\x1b[2K\\x0dINFO:all_good\\u202e" in line

"""Log lines never carry a terminal's control sequences from inside a sandbox."""

from __future__ import annotations

import json

import pytest
import structlog

from sandlot.log import configure_logging

# A title set, a line erased, a carriage return and a fake line, a bidi override; no space,
# which the console renderer would have quoted.
HOSTILE = "\x1b]0;pwned\x07\x1b[2K\rINFO:all_good\u202e"


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_a_sandboxs_names_are_logged_with_their_controls_escaped(
    fmt: str, capfd: pytest.CaptureFixture[str]
) -> None:
    # Failed before (red team, 2026-11-25): an artifact's name went raw to the console (the
    # renderer quotes only strings with whitespace or quotes): ESC, BEL and CR reached the
    # operator's terminal.
    configure_logging("INFO", fmt)
    try:
        structlog.get_logger("test").warning("artifact not kept", path=HOSTILE, n=1)
        err = capfd.readouterr().err
    finally:
        configure_logging("WARNING", "console")
    assert not any(ch in err for ch in "\x1b\x07\r\u202e"), repr(err)
    if fmt == "json":  # escaped by JSON itself, and exact
        assert json.loads(err)["path"] == HOSTILE
    else:
        assert "\\x1b]0;pwned\\x07\\x1b[2K\\x0dINFO:all_good\\u202e" in err

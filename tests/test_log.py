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


STDLIB_PROBE = r"""
import logging, sys, time
from sandlot.log import configure_logging
configure_logging("INFO", sys.argv[1])
from sandlot.mcp.tools import make_server
make_server(lambda *a: None)  # the MCP SDK's basicConfig runs here
print("handlers", [type(h).__name__ for h in logging.getLogger().handlers], file=sys.stderr)
try:
    raise OSError(107, "Transport endpoint is not connected")
except OSError:
    logging.getLogger("asyncio").error("Exception in callback \x1b[2K", exc_info=True)
"""


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_the_stdlibs_records_take_our_lines_not_a_librarys_handler(fmt: str) -> None:
    # Failed before (red team, 2026-12-06): nothing handled the root logger, so the MCP SDK's
    # basicConfig put rich's handler there, and each asyncio error a client provoked was
    # drawn as a rich traceback (26 ms here, up to ~1 s on the server's loop).
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", STDLIB_PROBE, fmt],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stderr.splitlines()
    assert "handlers ['StreamHandler']" in lines, lines[:5]
    assert not any(ch in done.stderr for ch in "│╭╰\x1b"), done.stderr[-1000:]
    if fmt == "json":
        record = json.loads(lines[-1])
        assert record["logger"] == "asyncio" and record["level"] == "error"
        assert record["exception"].endswith(
            "OSError: [Errno 107] Transport endpoint is not connected"
        )
    else:
        assert "Exception in callback \\x1b[2K" in done.stderr
        assert lines[-1] == "OSError: [Errno 107] Transport endpoint is not connected"

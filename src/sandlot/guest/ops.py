"""The guest protocol's names, written once: the operations the host may ask for and the
events the guest sends back.

Standard library only and Python >= 3.9: this file is shipped into every sandbox beside
``supervisor.py``, which dispatches on :class:`Op`; the host (``sandlot.core.guest_link``)
sends the same members. Both are ``str`` enums, so a frame carries the plain name.
"""

from enum import Enum

# Sent in the "ready" event; the host refuses a guest that speaks another version.
# 2: rich outputs (DISPLAY events, "results" in exec_code's result); 3: PTY_OPEN, PTY_RESIZE;
# 4: HELLO, and every later frame sealed (``seal.py``)
PROTOCOL_VERSION = 4


class Op(str, Enum):
    """A request the host sends (``{"id": N, "op": <Op>, ...}``)."""

    # The host's first frame, unsealed: ``{"id": 0, "op": "hello", "key": <hex>}``, the key
    # that seals every later frame both ways (seal.py). Read once, before the loop.
    HELLO = "hello"
    PING = "ping"
    CANCEL = "cancel"  # stop the call ``target``
    STDIN = "stdin"  # bytes (base64) for the running command ``target``
    PID = "pid"  # the process id of the running (or just ended) command ``target``
    EXEC_CODE = "exec_code"
    EXEC_SHELL = "exec_shell"
    CLOSE_SESSION = "close_session"
    # A terminal: a call that runs until its process ends, like a background exec_shell (the
    # same CANCEL, STDIN and PID apply); its STDOUT events carry the raw bytes, base64.
    PTY_OPEN = "pty_open"
    PTY_RESIZE = "pty_resize"  # new size (cols, rows) of the terminal of call ``target``
    FILE_READ = "file_read"
    FILE_WRITE = "file_write"
    FILE_LIST = "file_list"
    FILE_STAT = "file_stat"
    FILE_REMOVE = "file_remove"
    FILE_MKDIR = "file_mkdir"
    SHUTDOWN = "shutdown"  # handled by the read loop itself: the guest exits


class Event(str, Enum):
    """What the guest sends (``{"id": N, "event": <Event>, ...}``)."""

    READY = "ready"  # id 0, once, before anything else
    STDOUT = "stdout"
    STDERR = "stderr"
    RESULT = "result"
    DISPLAY = "display"  # a rich output of a running cell (a MIME bundle), streamed
    ERROR = "error"

"""The guest protocol's names, written once: the operations the host may ask for and the
events the guest sends back.

Standard library only and Python >= 3.9: this file is shipped into every sandbox beside
``supervisor.py``, which dispatches on :class:`Op`; the host (``sandlot.core.guest_link``)
sends the same members. Each member is a ``str`` (its name in lower case), so a frame carries
the plain name. Not :class:`enum.Enum`: ``enum`` (with ``functools`` and ``collections``) was
~2.5 ms of the guest supervisor's start, in every sandbox's create (issue 13).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing's own import costs the guest as much as enum's
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any, ClassVar


class _Table(type):
    """The class of :class:`Op` and :class:`Event`: each name annotated in the class body
    becomes a member, ``cls(name.lower())``; iterating the class gives them in order."""

    def __init__(cls, name: str, bases: tuple[type, ...], namespace: dict[str, Any]) -> None:
        super().__init__(name, bases, namespace)
        members = []
        # Strings, unevaluated, thanks to ``from __future__ import annotations`` (kept on
        # Python 3.14's lazy annotations too): without it this table would be empty.
        for member_name in namespace.get("__annotations__", {}):
            member = str.__new__(cls, member_name.lower())
            setattr(cls, member_name, member)
            members.append(member)
        if bases != (str,) and not members:
            raise TypeError(f"{name} names no members")
        cls._members = tuple(members)

    def __call__(cls, value: object) -> Any:
        """The member named ``value``, as ``Enum(value)`` finds it; ValueError if none."""
        for member in cls._members:
            if member == value:
                return member
        raise ValueError(f"{value!r} is not a valid {cls.__name__}")

    def __iter__(cls) -> Iterator[Any]:
        return iter(cls._members)


class _Name(str, metaclass=_Table):
    """A protocol name: a plain ``str`` to json and to ``==``, named in reprs."""

    __slots__ = ()

    @property
    def value(self) -> str:
        return str.__str__(self)

    def __repr__(self) -> str:
        return "<%s.%s>" % (type(self).__name__, self.upper())


# Sent in the "ready" event; the host refuses a guest that speaks another version.
# 2: rich outputs (DISPLAY events, "results" in exec_code's result); 3: PTY_OPEN, PTY_RESIZE;
# 4: HELLO, and every later frame sealed (``seal.py``)
PROTOCOL_VERSION = 4


class Op(_Name):
    """A request the host sends (``{"id": N, "op": <Op>, ...}``)."""

    # The host's first frame, unsealed: ``{"id": 0, "op": "hello", "key": <hex>}``, the key
    # that seals every later frame both ways (seal.py). Read once, before the loop.
    HELLO: ClassVar[Op]
    PING: ClassVar[Op]
    CANCEL: ClassVar[Op]  # stop the call ``target``
    STDIN: ClassVar[Op]  # bytes (base64) for the running command ``target``
    PID: ClassVar[Op]  # the process id of the running (or just ended) command ``target``
    # Start (``"on": true``) or stop streaming the output of the running command ``target``:
    # a background command started with ``stream_paused`` streams only while the host has a
    # listener for it.
    STREAM: ClassVar[Op]
    EXEC_CODE: ClassVar[Op]
    EXEC_SHELL: ClassVar[Op]
    CLOSE_SESSION: ClassVar[Op]
    # A terminal: a call that runs until its process ends, like a background exec_shell (the
    # same CANCEL, STDIN and PID apply); its STDOUT events carry the raw bytes, base64.
    PTY_OPEN: ClassVar[Op]
    PTY_RESIZE: ClassVar[Op]  # new size (cols, rows) of the terminal of call ``target``
    FILE_READ: ClassVar[Op]
    FILE_WRITE: ClassVar[Op]
    FILE_LIST: ClassVar[Op]
    FILE_STAT: ClassVar[Op]
    FILE_REMOVE: ClassVar[Op]
    FILE_MKDIR: ClassVar[Op]
    SHUTDOWN: ClassVar[Op]  # handled by the read loop itself: the guest exits


class Event(_Name):
    """What the guest sends (``{"id": N, "event": <Event>, ...}``)."""

    READY: ClassVar[Event]  # id 0, once, before anything else
    STDOUT: ClassVar[Event]
    STDERR: ClassVar[Event]
    RESULT: ClassVar[Event]
    DISPLAY: ClassVar[Event]  # a rich output of a running cell (a MIME bundle), streamed
    ERROR: ClassVar[Event]
    # A call that must wait its turn (a cell behind a cell, a command behind its session's):
    # QUEUED when it starts waiting, STARTED when it can run, so that the host's backstop,
    # its timeout and a few seconds, counts from there too (calls.turn).
    QUEUED: ClassVar[Event]
    STARTED: ClassVar[Event]

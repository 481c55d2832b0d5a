"""Frames the sandbox's own code cannot forge: each direction of the host-guest channel is
authenticated by a key only the host and the supervisor hold.

Standard library only and Python >= 3.9: shipped into every sandbox beside ``supervisor.py``;
the host (``sandlot.core.guest_link``) uses the same class.

Why: the guest's channel is a pair of pipes (the supervisor's stdin and stdout) that the
sandbox's own processes must never reach. bubblewrap and runc keep them out (the supervisor
is not dumpable, so ``/proc/<pid>/fd`` refuses them), but gVisor does not apply that check to
``/proc/<pid>/fd``: code in the sandbox can open the supervisor's pipes, write frames into them
and read frames out. Memory stays shut there (``/proc/<pid>/mem``, ptrace and
``process_vm_readv`` are refused), so a key the supervisor holds is out of reach.

How: the host draws a fresh key for each guest start and sends it as the first frame, before
any of the sandbox's code can run; the supervisor forks its first kernel before reading it, so
no process that runs code ever holds it. From then on every frame, each way, is
``length | tag | body``, the tag a keyed BLAKE2b of the frame's sequence number and body,
personalised per direction. A frame written in is not authentic, a frame read out leaves a
gap in the sequence, a frame replayed carries an old number: each breaks the channel (the
guest is restarted and the call says so), none can pass for a result.
"""

try:  # the C core: ``hashlib`` would cost every supervisor's start its OpenSSL import
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - an interpreter built without it
    from hashlib import blake2b

# ``hmac.compare_digest`` itself, without ``hmac``'s import of ``hashlib`` and OpenSSL.
from _operator import _compare_digest as compare_digest

KEY_BYTES = 32
TAG_BYTES = 16
TO_GUEST = b"sandlot-h2g"
TO_HOST = b"sandlot-g2h"


class NotAuthentic(ValueError):
    """A frame whose tag is not the one its place in the sequence needs."""


class Seal:
    """One direction's tags: the ``n``-th frame sealed or opened uses sequence number ``n``."""

    def __init__(self, key: bytes, person: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError("a seal's key is %d bytes, got %d" % (KEY_BYTES, len(key)))
        self.key = key
        self.person = person
        self.seq = 0

    def _tag(self, body: bytes) -> bytes:
        mac = blake2b(
            self.seq.to_bytes(8, "big"), digest_size=TAG_BYTES, key=self.key, person=self.person
        )
        mac.update(body)
        self.seq += 1
        return mac.digest()

    def seal(self, body: bytes) -> bytes:
        """``tag | body`` for the next frame (callers keep frames in the order sealed)."""
        return self._tag(body) + body

    def open(self, sealed: bytes) -> bytes:
        """The body of the next frame, if its tag is right.

        Raises:
            NotAuthentic: the tag is wrong: the frame was written by someone without the key,
                or frames before it went missing or were replayed.
        """
        if len(sealed) < TAG_BYTES:
            raise NotAuthentic("a sealed frame of %d bytes has no tag" % len(sealed))
        tag, body = sealed[:TAG_BYTES], sealed[TAG_BYTES:]
        if not compare_digest(tag, self._tag(body)):
            raise NotAuthentic("frame %d of the channel is not authentic" % (self.seq - 1))
        return body

"""The supervisor's end of the kernel's control socket: only what the kernel itself sent counts.

Standard library only, Python >= 3.9 (shipped into every sandbox). A process forked by a cell
holds a copy of the kernel's end, and no flag survives ``fork()`` to take it away, so whoever
writes must be checked on every read: the socket passes each writer's pid (``SO_PASSCRED``,
filled in by the kernel of the OS, not by the writer), a stream read never joins bytes of two
writers, and bytes from any pid but the kernel's are dropped. What remains is exactly the
stream the kernel wrote.
"""

# The C core of ``socket``: the module's wrapper builds enums of every constant at import,
# ~5 ms of CPU under each sandbox's quota, for names this file never shows anyone.
import _socket as socket
import struct

from wire import HEADER, MAX_FRAME_BYTES, encode_frame, loads

UCRED = struct.Struct("3i")  # pid, uid, gid
RECV_BYTES = 1 << 16


class KernelChannel:
    def __init__(self):
        self.sock, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.peer = peer
        self.kernel_pid = None
        self.buf = bytearray()

    def peer_fd(self):
        """The kernel's end, to pass to its process."""
        return self.peer.fileno()

    def started(self, pid):
        """The kernel runs as ``pid``: only its bytes count from now on."""
        self.kernel_pid = pid
        self.peer.close()

    def fileno(self):
        return self.sock.fileno()

    def send(self, obj):
        self.sock.sendall(encode_frame(obj))

    def receive(self):
        """Read what is waiting; return the next frame the kernel sent, or None for now.

        Raises EOFError when every holder of the other end has closed it, and ValueError for
        a frame over the limit.
        """
        frame = self._take()  # one read can bring several frames (display bundles, reply)
        if frame is not None:
            return frame
        try:
            data, ancillary, _, _ = self.sock.recvmsg(
                RECV_BYTES, socket.CMSG_SPACE(UCRED.size), socket.MSG_DONTWAIT
            )
        except BlockingIOError:
            return None
        if not data:
            raise EOFError
        sender = None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                sender = UCRED.unpack(payload[: UCRED.size])[0]
        if sender is not None and sender == self.kernel_pid:
            self.buf += data
        return self._take()

    def _take(self):
        """The first whole frame in the buffer, removed from it; None if none is whole yet."""
        if len(self.buf) < HEADER.size:
            return None
        (size,) = HEADER.unpack(self.buf[: HEADER.size])
        if size > MAX_FRAME_BYTES:
            raise ValueError("frame of %d bytes is over the limit" % size)
        if len(self.buf) < HEADER.size + size:
            return None
        frame = bytes(self.buf[HEADER.size : HEADER.size + size])
        del self.buf[: HEADER.size + size]
        return loads(frame.decode("utf-8"))

    def close(self):
        self.sock.close()
        self.peer.close()

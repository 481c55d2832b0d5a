"""Threads, locks and events on ``_thread``, without the ``threading`` module.

Standard library only, Python >= 3.9 (shipped into every sandbox). ``threading`` imports
``functools`` and with it ``collections``, ``operator``, ``keyword`` and ``reprlib``: ~3 ms
of CPU at every supervisor's start, under the sandbox's quota, for three names. Everything
here is what the guest uses of it, and behaves the same for that use.
"""

import _thread

Lock = _thread.allocate_lock


class Turn:
    """Hold ``locks``, in order, for a call; one that has to wait for them tells the host
    (``Event.QUEUED``, then ``Event.STARTED`` once it holds them): the host's backstop for
    a call counted from when it was sent, so a call queued behind another ran out of it and
    the host restarted a healthy guest, its state lost (a red team's find, 2026-12-06)."""

    def __init__(self, send, *locks):
        self.send = send  # send(event): a frame of this call's, "queued" or "started" (ops.Event)
        self.locks = locks
        self.held = []

    def __enter__(self):
        waited = False
        try:
            for lock in self.locks:
                if not lock.acquire(False):
                    if not waited:
                        waited = True
                        self.send("queued")
                    lock.acquire()
                self.held.append(lock)
        except BaseException:
            self.__exit__()
            raise
        if waited:
            self.send("started")
        return self

    def __exit__(self, *exc_info):
        while self.held:
            self.held.pop().release()


def start(target, *args):
    """Run ``target(*args)`` in a new thread; it dies with the process, like a daemon thread.

    Raises:
        RuntimeError: no thread can be made (the sandbox's pids limit is reached).
    """
    _thread.start_new_thread(target, args)


class Event:
    """``threading.Event``'s ``set``, ``is_set`` and ``wait``: waiters block on a lock that
    ``set`` releases once; each one that gets it hands it on to the next."""

    def __init__(self):
        self._flag = False
        self._gate = _thread.allocate_lock()
        self._gate.acquire()
        self._setting = _thread.allocate_lock()

    def is_set(self):
        return self._flag

    def set(self):
        with self._setting:  # two setters must not both release the gate
            if not self._flag:
                self._flag = True
                self._gate.release()

    def wait(self, timeout=None):
        """Block until set, or for ``timeout`` seconds; return whether it is set."""
        if self._flag:
            return True
        got = self._gate.acquire(True, -1 if timeout is None else max(0.0, timeout))
        if got:
            self._gate.release()
        return self._flag

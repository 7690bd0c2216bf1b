"""Waiting for sockets to become readable or writable, for any file descriptor number.

``select.select`` refuses descriptors from 1024 on (``FD_SETSIZE``): in a process that has
that many files open (a busy worker, a web server), every round would raise ``ValueError``
instead of reaching its masters, and so would ``release()``. ``select.poll`` has no such
limit, so it is used where it exists. Under gevent's aggressive monkey-patching ``poll`` is
removed and ``select.select`` is gevent's own (no ``FD_SETSIZE`` limit either), so the
fallback keeps both working; the standard library's ``selectors`` would add an object and a
registration per call on the hot path for nothing more.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Sequence

__all__ = ["readable", "writable"]

_READ = (
    select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
    if hasattr(select, "poll")
    else 0
)
_WRITE = select.POLLOUT | select.POLLERR | select.POLLHUP if hasattr(select, "poll") else 0


def _wait(
    socks: Sequence[socket.socket], events: int, timeout: float, write: bool
) -> list[socket.socket]:
    if not socks:
        return []
    poll = getattr(select, "poll", None)
    if poll is None:  # gevent's patched select module, or a platform without poll
        if write:
            return list(select.select([], socks, [], max(timeout, 0.0))[1])
        return list(select.select(socks, [], [], max(timeout, 0.0))[0])
    poller = poll()
    by_fd = {}
    for sock in socks:
        fd = sock.fileno()
        by_fd[fd] = sock
        poller.register(fd, events)
    # poll takes milliseconds; round up so a short wait never becomes a busy poll of 0.
    ms = max(0.0, timeout) * 1000.0
    return [by_fd[fd] for fd, _ in poller.poll(ms if ms == 0.0 else max(ms, 1.0))]


def readable(socks: Sequence[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets of ``socks`` with something to read (or an error), within ``timeout`` s."""
    return _wait(socks, _READ, timeout, write=False)


def writable(socks: Sequence[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets of ``socks`` that can be written to (or failed), within ``timeout`` s."""
    return _wait(socks, _WRITE, timeout, write=True)

"""Waiting for sockets to become readable or writable, for any file descriptor number.

``select.select`` refuses descriptors from 1024 on (``FD_SETSIZE``): in a process that has
that many files open (a busy worker, a web server), every round would raise ``ValueError``
instead of reaching its masters, and so would ``release()``. ``select.poll`` has no such
limit, so it is used where it exists, and gevent's monkey-patching provides a green one.
Only where ``poll`` is really absent does the wait fall back to ``select.select``, and
there a descriptor from 1024 on still fails (gevent's ``select`` asks the standard
library's first); the standard library's ``selectors`` would add an object and a
registration per call on the hot path for nothing more. Waits take file descriptors
(:func:`readable_fds`): a round maps them straight to its masters.

Under eventlet's monkey-patching, ``select.select`` is eventlet's green one, and it cannot be
used with more than one socket: eventlet's hub gathers the callbacks of every descriptor one
poll found ready before it runs them, and each callback of its ``select`` switches to the
waiting greenlet unconditionally. When two masters answer together, the first callback
resumes our round; the second one is run later and resumes the same greenlet again, inside
whatever blocking call it made next: a task body's ``time.sleep(1.5)`` returned after a
millisecond. So under eventlet the wait registers its own one-shot listeners (only the first
event of a wait resumes it; the rest find the wait over and do nothing), and which sockets
are ready is then asked of the real, unpatched ``poll`` without blocking. eventlet has no
public primitive for "the first of several descriptors" that avoids this; its ``trampoline``
waits on one.
"""

from __future__ import annotations

import math
import os
import select
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from types import BuiltinFunctionType
from typing import Any, TypeVar

__all__ = ["Watcher", "cores_busy", "readable", "readable_fds", "watcher", "writable"]

#: Seconds between two reads of the load average by :func:`cores_busy`.
LOAD_CHECK_PERIOD = 1.0
_load_checked_at = -math.inf
_busy = False

T = TypeVar("T")

_READ = (
    select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP
    if hasattr(select, "poll")
    else 0
)
_WRITE = select.POLLOUT | select.POLLERR | select.POLLHUP if hasattr(select, "poll") else 0


def _wait(
    socks: Sequence[socket.socket], events: int, timeout: float, write: bool
) -> list[socket.socket]:
    return _wait_fds({sock.fileno(): sock for sock in socks}, events, timeout, write)


def _wait_fds(by_fd: Mapping[int, T], events: int, timeout: float, write: bool) -> list[T]:
    """``by_fd[fd]`` for each file descriptor ready for ``events`` within ``timeout``."""
    if not by_fd:
        return []
    poll = getattr(select, "poll", None)
    if poll is None:  # eventlet's or gevent's patched select module, or no poll here
        waiters = [_Fd(fd) for fd in by_fd]
        found: list[_Fd]
        green = sys.modules.get("eventlet.green.select")
        if green is not None and select.select is getattr(green, "select", None):
            found = _eventlet_wait(waiters, write, timeout)
        elif write:
            found = select.select([], waiters, [], max(timeout, 0.0))[1]
        else:
            found = select.select(waiters, [], [], max(timeout, 0.0))[0]
        return [by_fd[waiter.fd] for waiter in found]
    poller = poll()
    for fd in by_fd:
        poller.register(fd, events)
    events_found = poller.poll(_poll_ms(timeout))
    if len(events_found) == 1:  # the usual case: one master's reply
        return [by_fd[events_found[0][0]]]
    return [by_fd[fd] for fd, _ in events_found]


def _poll_ms(timeout: float) -> float:
    """``timeout`` (s) as ``poll`` takes it, in ms, rounded up so that a short wait never
    becomes a busy poll of 0."""
    return 0.0 if timeout <= 0.0 else max(timeout * 1000.0, 1.0)


class _Fd:
    """A file descriptor as ``select`` and eventlet's hub take it (``fileno()``)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


def _eventlet_wait(socks: Sequence[_Fd], write: bool, timeout: float) -> list[_Fd]:
    """Wait under eventlet: resumed once, by the first ready socket or the timeout."""
    import eventlet
    from eventlet.hubs import get_hub

    real: Any = eventlet.patcher.original("select")
    events = (
        real.POLLOUT | real.POLLERR | real.POLLHUP
        if write
        else real.POLLIN | real.POLLPRI | real.POLLERR | real.POLLHUP
    )

    def ready_now() -> list[_Fd]:
        poller = real.poll()
        by_fd = {}
        for sock in socks:
            by_fd[sock.fileno()] = sock
            poller.register(sock.fileno(), events)
        return [by_fd[fd] for fd, _ in poller.poll(0)]

    found = ready_now()
    if found or timeout <= 0:
        return found
    hub = get_hub()
    current = eventlet.getcurrent()
    if hub.greenlet is current:
        raise RuntimeError("a lock round cannot wait inside eventlet's hub")
    waiting = [True]

    def resume(*_: Any) -> None:
        if waiting[0]:
            waiting[0] = False
            current.switch()

    def fail(*exc: Any) -> None:
        if waiting[0]:
            waiting[0] = False
            current.throw(*exc)

    timer = hub.schedule_call_global(timeout, resume)
    kind = hub.WRITE if write else hub.READ
    listeners = []
    try:
        for sock in socks:
            # one by one, so the finally removes those added before a failing one
            listeners.append(hub.add(kind, sock.fileno(), resume, fail, lambda: None))  # noqa: PERF401
        hub.switch()
    finally:
        waiting[0] = False
        for listener in listeners:
            hub.remove(listener)
        timer.cancel()
    return ready_now()


class Watcher:
    """One socket's descriptor registered with ``poll`` once, for a link that waits on
    it alone again and again (a round on one master, or the last reply of a round):
    each wait is then one ``poll`` call, not a poll object and a registration."""

    __slots__ = ("_poll", "_poller")

    def __init__(self, poll: Any, fd: int) -> None:
        self._poll = poll
        self._poller = poll()
        self._poller.register(fd, _READ)

    def readable(self, timeout: float) -> bool | None:
        """Whether the socket has something to read (or an error) within ``timeout``
        s; None when ``select.poll`` is not the one this watcher was made with (an event
        library patched it since): the caller waits as :func:`readable_fds` does."""
        if getattr(select, "poll", None) is not self._poll:
            return None
        return bool(self._poller.poll(_poll_ms(timeout)))


def watcher(fd: int) -> Watcher | None:
    """A :class:`Watcher` of ``fd``, where ``select.poll`` is the standard library's; None
    elsewhere: eventlet's patched ``select`` has no ``poll``, and gevent's ``poll`` waits
    on the event loop of the thread that made it, where a lane's links serve whichever
    thread takes the lane (its replies would go unseen on any other thread's wait)."""
    poll = getattr(select, "poll", None)
    if type(poll) is not BuiltinFunctionType or poll.__module__ != "select":
        return None
    return Watcher(poll, fd)


def readable_fds(by_fd: Mapping[int, T], timeout: float) -> list[T]:
    """``by_fd[fd]`` for the file descriptors of ``by_fd`` with something to read (or an
    error) within ``timeout`` s: :func:`readable` without sockets (one map less per wait)."""
    return _wait_fds(by_fd, _READ, timeout, write=False)


def readable(socks: Sequence[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets of ``socks`` with something to read (or an error), within ``timeout`` s."""
    return _wait(socks, _READ, timeout, write=False)


def writable(socks: Sequence[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets of ``socks`` that can be written to (or failed), within ``timeout`` s."""
    return _wait(socks, _WRITE, timeout, write=True)


def cores_busy() -> bool:
    """True while the machine's 1-minute load average is at least the cores this process
    may run on: every core has a runnable process, so a thread polling for replies
    (``spin_wait``) would take CPU from the processes that have work, masters and task
    bodies included, rather than from idle time. Read at most once per
    :data:`LOAD_CHECK_PERIOD`; False where the load average cannot be read.
    """
    global _load_checked_at, _busy
    now = time.monotonic()
    if now - _load_checked_at < LOAD_CHECK_PERIOD:
        return _busy
    _load_checked_at = now
    try:
        load = os.getloadavg()[0]
    except OSError:
        _busy = False
        return _busy
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    _busy = load >= cores
    return _busy

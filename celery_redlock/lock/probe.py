"""Finding out when an unreachable master answers again, off the path of the jobs.

A master that cannot be connected to (a host that is down, a network that drops packets,
a stopped server) costs a connect attempt up to ``node_timeout`` long. Tried again by the
rounds themselves, every ``reconnect_backoff``, each attempt lands on whatever job runs
next: with one master of three blackholed and jobs more than a second apart, every job
waited a ``node_timeout`` (0.25 s by default) for nothing. A backoff that grows while the
master stays down spares the jobs, but then a master that came back goes unnoticed for
as long as the backoff has grown, and the quorum can fail with a majority up (measured
and reverted: with 16 s of backoff, acquires raised ``QuorumUnavailable`` with two of
three masters answering).

So once a connect fails, the rounds stop trying that master, and a daemon thread of its
own (``redlock-probe``, gone as soon as the master answers, is forgotten or is no longer
used by anyone) tries it instead, every :data:`PERIOD` seconds: a TCP (or unix socket)
connect and a ``PING``, each within the master's ``node_timeout``. Once connected, any
outcome but silence counts as an answer (``+PONG``, ``-NOAUTH``, the connection closed
or reset, as a TLS port does with a plaintext ``PING``): the server runs, and the master
is handed back to the rounds, whose next connect does the real handshake (if that fails
to reach it again, the master comes back here). One thread per master, not one for all:
a master with a long ``node_timeout`` that stays blackholed must not delay noticing
another one, so a returning master is counted within :data:`PERIOD` plus its own probe.

Whose watch it is is stamped with the process id (``Master.probe_ticket``): a forked
child, which has none of its parent's threads, sees no master as watched, and its rounds
connect by themselves. The thread keeps only a weak reference to its master between two
tries. No lock is held while a thread starts or sleeps (under gevent patched after this
module was imported, ``threading.Lock`` is a real lock and starting a thread switches
greenlets). Masters the thread cannot address by itself (Sentinel services, custom
connection classes), and masters that answered badly (an error or malformed handshake
reply, a duplicate of another master), keep the rounds' reconnect backoff.

No library fits: redis-py's health checks and retries run on the caller's connection,
inside the caller's command, which is exactly the cost this avoids.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING

import redis

from . import process

if TYPE_CHECKING:
    from .master import Master

__all__ = ["PERIOD", "address_of", "forget", "probe", "watch", "watching"]

logger = logging.getLogger("celery_redlock.lock")

#: Seconds between two tries of a master that is being watched.
PERIOD = 0.5

#: Guards the tickets and ``_watched``; held for a few assignments, never across a call
#: that could block or switch greenlets.
_lock = threading.Lock()
#: the masters this process watches, by id (weakly: for :func:`watching`)
_watched: weakref.WeakValueDictionary[int, Master] = weakref.WeakValueDictionary()


def address_of(master: Master) -> tuple[int, object, bool] | None:
    """(address family, address, TLS) to probe ``master`` at; None when it has none of
    its own (Sentinel, custom connection classes)."""
    cls = master._connection_class
    kwargs = master._connection_kwargs
    if cls is redis.connection.UnixDomainSocketConnection:
        path = kwargs.get("path")
        return (socket.AF_UNIX, path, False) if path else None
    if cls in (redis.connection.Connection, redis.connection.SSLConnection):
        host, port = kwargs.get("host", "localhost"), int(kwargs.get("port", 6379))
        return (socket.AF_UNSPEC, (host, port), cls is redis.connection.SSLConnection)
    return None


def probe(master: Master) -> bool:
    """Whether ``master``'s server answers: connect, send ``PING``, and see whether
    anything but silence comes back, each within its ``node_timeout``."""
    found = address_of(master)
    if found is None:
        return False
    family, address, _ = found
    timeout = master.node_timeout
    try:
        if family == socket.AF_UNIX:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(address)  # type: ignore[arg-type]
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection(address, timeout=timeout)  # type: ignore[arg-type]
    except OSError:
        return False  # refused, unreachable, timed out: nobody there
    with sock:
        try:
            sock.settimeout(timeout)
            sock.sendall(b"PING\r\n")
            sock.recv(64)  # a reply, or b"" when it closed the connection: it runs
        except TimeoutError:
            return False  # accepted by the kernel, but the server does not answer
        except OSError:
            return True  # reset or closed on us: a server is there and acting
    return True


def watch(master: Master) -> bool:
    """Keep the rounds off ``master`` and try it from a probe thread until it answers.

    Returns False (and changes nothing) for a master the thread cannot address: the
    rounds then keep trying it after their own backoff.
    """
    if address_of(master) is None:
        return False
    with _lock:
        if master.probing:  # already watched by a thread of this process
            return True
        ticket = (process.pid(), object())
        master.probe_ticket = ticket
        _watched[id(master)] = master
    thread = threading.Thread(
        target=_run, args=(weakref.ref(master), ticket), name="redlock-probe", daemon=True
    )
    try:
        thread.start()
    except RuntimeError:  # interpreter shutdown: the rounds keep their backoff
        _hand_back(master, ticket, answered=False)
        return False
    return True


def forget(master: Master) -> None:
    """Stop watching ``master`` and let the rounds connect to it again."""
    with _lock:
        _watched.pop(id(master), None)
        master.probe_ticket = None


def watching() -> list[Master]:
    """The masters this process watches now (for tests and ``check``)."""
    with _lock:
        return [master for master in _watched.values() if master.probing]


def _hand_back(master: Master, ticket: object, *, answered: bool) -> None:
    with _lock:
        if master.probe_ticket is ticket:
            master.probe_ticket = None
            _watched.pop(id(master), None)
            if answered:
                master.connect_after = 0.0


def _run(ref: weakref.ref[Master], ticket: object) -> None:
    while True:
        time.sleep(PERIOD)
        if _try(ref, ticket):
            return


def _try(ref: weakref.ref[Master], ticket: object) -> bool:
    """One try; True when the thread is done (answered, forgotten, or nobody's master).
    Holds the master only for the length of the try, so that it can be collected."""
    master = ref()
    if master is None or master.probe_ticket is not ticket:
        return True
    try:
        answered = probe(master)
    except Exception:  # a probe must never end the thread with the master still watched
        logger.debug("probe of master %s failed", master.name, exc_info=True)
        answered = False
    if answered:
        _hand_back(master, ticket, answered=True)
    return answered


def _after_fork_in_child() -> None:
    # The parent's tickets carry its pid: the child's masters are not watched (see
    # Master.probing). Only the lock, which a parent thread may have held, is renewed.
    global _lock
    _lock = threading.Lock()
    _watched.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

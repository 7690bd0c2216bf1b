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

So once a connect fails, the rounds stop trying that master, and one daemon thread per
process (started when the first master goes down, gone when none is left to watch) tries
it instead, every :data:`PERIOD` seconds: a TCP (or unix socket) connect and a ``PING``,
each within ``node_timeout``. Any answer (``+PONG``, ``-NOAUTH``, a TLS server closing
the plaintext connection) means the server runs: the master is then handed back to the
rounds, whose next connect does the real handshake (and if that fails, the master comes
back here). A returning master is so noticed within :data:`PERIOD` plus one round trip,
never later, however long it was down.

Masters the thread cannot address by itself (Sentinel services, custom connection
classes) keep the rounds' own reconnect backoff. The thread only reads and writes two
attributes of a master (``probing``, ``connect_after``), plain assignments, so the rounds
need no lock for it. In a forked child the thread is gone: the child forgets what the
parent watched and its rounds connect on their own again.

No library fits: redis-py's health checks and retries run on the caller's connection,
inside the caller's command, which is exactly the cost this avoids.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import weakref
from typing import TYPE_CHECKING

import redis

if TYPE_CHECKING:
    from .master import Master

__all__ = ["PERIOD", "address_of", "forget", "probe", "watch", "watching"]

logger = logging.getLogger("celery_redlock.lock")

#: Seconds between two tries of a master that is being watched.
PERIOD = 0.5

_lock = threading.Lock()
_wake = threading.Condition(_lock)
#: the masters watched, by id; a master nobody uses any more is dropped with its client
_watched: weakref.WeakValueDictionary[int, Master] = weakref.WeakValueDictionary()
_thread: threading.Thread | None = None


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
    """Whether ``master``'s server answers: connect, send ``PING``, wait for any reply,
    each within its ``node_timeout``. A TLS server that closes the plaintext connection
    has answered too."""
    found = address_of(master)
    if found is None:
        return False
    family, address, tls = found
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
        with sock:
            sock.settimeout(timeout)
            sock.sendall(b"PING\r\n")
            got = sock.recv(64)
    except OSError:
        return False
    return bool(got) or tls


def watch(master: Master) -> bool:
    """Keep the rounds off ``master`` and try it from the probe thread until it answers.

    Returns False (and changes nothing) for a master the thread cannot address: the
    rounds then keep trying it after their own backoff.
    """
    global _thread
    if address_of(master) is None:
        return False
    with _lock:
        if _thread is None or not _thread.is_alive():
            thread = threading.Thread(target=_run, name="redlock-probe", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # interpreter shutdown: the rounds keep their backoff
                return False
            _thread = thread
        master.probing = True
        _watched[id(master)] = master
    return True


def forget(master: Master) -> None:
    """Stop watching ``master`` and let the rounds connect to it again."""
    with _lock:
        _watched.pop(id(master), None)
        master.probing = False


def watching() -> list[Master]:
    """The masters being watched now (for tests and ``check``)."""
    with _lock:
        return list(_watched.values())


def _run() -> None:
    global _thread
    me = threading.current_thread()
    while True:
        with _lock:
            for key, master in list(_watched.items()):
                if not master.probing:  # handed back meanwhile (check_masters, forget)
                    del _watched[key]
            if not _watched or _thread is not me:
                if _thread is me:
                    _thread = None
                return
            _wake.wait(PERIOD)
            masters = list(_watched.values())
        for master in masters:
            try:
                answered = probe(master)
            except Exception:  # a probe must never end the thread
                logger.debug("probe of master %s failed", master.name, exc_info=True)
                answered = False
            if answered:
                with _lock:
                    _watched.pop(id(master), None)
                    master.connect_after = 0.0
                    master.probing = False


def _after_fork_in_child() -> None:
    global _lock, _wake, _thread
    for master in _watched.values():
        master.probing = False
    _watched.clear()
    _lock = threading.Lock()
    _wake = threading.Condition(_lock)
    _thread = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

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

So once a connect cannot reach a master, the rounds stop trying it, and a daemon thread
of its own (``redlock-probe``) tries it instead, every :data:`PERIOD` seconds: a connect
and a ``PING`` (after ``AUTH`` and ``SELECT`` where configured), each within the
master's ``node_timeout``. ``PONG`` means the rounds' connect would succeed: the master is
handed back to the rounds, whose next connect does the real handshake (if that cannot
reach it again, the master comes back here; if the server answers badly, the rounds'
backoff applies). Anything else (silence, a close, ``-ERR max number of clients
reached``, a password or certificate refused) keeps the watch. Plain TCP masters are
tried at every address their name resolves to, and the one that answered is the one the
rounds connect to next. TLS masters are tried
through redis-py's own connection (TLS handshake, ``AUTH``, then ``PING``), so that a TLS
terminator whose server behind it does not answer is not taken for a running master.

One thread per master, not one for all: a master with a long ``node_timeout`` that stays
blackholed must not delay noticing another one, so a returning master is counted within
:data:`PERIOD` plus its own probe. A master watched again while its thread still runs
keeps that thread. A watch ends after :data:`WATCH_LIMIT` seconds without an answer: the
rounds then try the master once more (one connect attempt a minute on the jobs' path at
most), which also ends the thread of a client that was dropped without ``close()`` (its
masters are in a reference cycle and wait for a full garbage collection).

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
import ssl
import threading
import time
import weakref
from typing import TYPE_CHECKING, cast

import redis

from . import process, resolve, wire

if TYPE_CHECKING:
    from .master import Master

__all__ = [
    "PERIOD",
    "WATCH_LIMIT",
    "address_of",
    "forget",
    "probe",
    "tls_refused",
    "watch",
    "watching",
]

logger = logging.getLogger("celery_redlock.lock")

#: Seconds between two tries of a master that is being watched.
PERIOD = 0.5
#: connection kwargs that, when set, mean redis-py does the connect's authentication
_LEFT_TO_REDIS_PY = ("credential_provider", "redis_connect_func", "username")
#: Seconds a watch lasts without an answer; then the rounds try the master themselves.
WATCH_LIMIT = 60.0

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
    """Whether a connect of the rounds would reach ``master`` now: its server answers
    ``PING`` with ``PONG`` (after ``AUTH``/``SELECT`` where configured), each step within
    its ``node_timeout``. A server out of connection slots (``-ERR max number of clients
    reached``), refusing the password or a TLS certificate, is not handed back: the
    watch's limit gives it to the rounds, whose backoff then applies."""
    found = address_of(master)
    if found is None:
        return False
    family, address, tls = found
    pipelined = master._pipelined
    # Credentials the pipelined handshake leaves to redis-py (a credential provider, a
    # custom connect function, a username without a password) stay in its kwargs.
    if (
        tls
        or family == socket.AF_UNIX
        or pipelined is None
        or any(pipelined[0].get(name) for name in _LEFT_TO_REDIS_PY)
    ):
        return _probe_with_redis_py(master)
    commands = [c for c in pipelined[1] if c[0] in ("AUTH", "SELECT")]
    payload = wire.pack(*commands, ("PING",))
    host, port = cast("tuple[str, int]", address)
    try:
        infos = resolve.resolve(host, port, 0, socket.SOCK_STREAM, master.node_timeout)
    except OSError:
        return False
    for info in infos:
        if _ping(info[0], info[4], payload, len(commands) + 1, master.node_timeout):
            master.good_address = info[4]
            return True
    resolve.distrust(host, port)  # the next try asks the resolver again: it may have moved
    return False


def _ping(family: int, sockaddr: object, payload: bytes, replies: int, timeout: float) -> bool:
    """Connect to ``sockaddr``, send ``payload``; True when its last reply is PONG."""
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return False
    reader = wire.reader()
    got: list[object] = []
    deadline = time.monotonic() + 2 * timeout  # connect, then the replies
    with sock:
        try:
            sock.settimeout(timeout)
            sock.connect(sockaddr)  # type: ignore[arg-type]
            sock.sendall(payload)
            while len(got) < replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                sock.settimeout(left)
                data = sock.recv(4096)
                if not data:
                    return False
                reader.feed(data)
                while (reply := reader.gets()) is not False:
                    got.append(reply)
        except (OSError, wire.ProtocolError):
            return False
    return got[-1] == b"PONG"


def _probe_with_redis_py(master: Master) -> bool:
    """The same through redis-py's own connection (TLS, unix sockets, credentials that
    are not a plain password): its connect does the TLS handshake and ``AUTH``."""
    conn = master.new_connection()
    try:
        conn.connect()
        conn.send_command("PING")
        return bool(conn.read_response() in (True, b"PONG", "PONG"))
    except (redis.RedisError, OSError):
        return False
    finally:
        conn.disconnect()


def tls_refused(exc: BaseException | None) -> bool:
    """Whether ``exc`` says a TLS handshake was refused by a peer that speaks (a
    certificate refused, a plaintext server on a TLS port), not a connection closed or
    reset on the way (``SSLEOFError`` and the like: nobody serving)."""
    return isinstance(exc, ssl.SSLError) and not isinstance(
        exc, ssl.SSLEOFError | ssl.SSLZeroReturnError | ssl.SSLSyscallError
    )


def watch(master: Master) -> bool:
    """Keep the rounds off ``master`` and try it from its probe thread until it answers.

    Returns False (and changes nothing) for a master the thread cannot address: the
    rounds then keep trying it after their own backoff.
    """
    if address_of(master) is None:
        return False
    me = process.pid()
    with _lock:
        ticket = (me, object())
        master.probe_ticket = ticket
        _watched[id(master)] = master
        running = master.probe_thread
        if running is not None and running[0] == me:
            return True  # its thread is running: it takes the new ticket
        thread = threading.Thread(
            target=_run, args=(weakref.ref(master),), name="redlock-probe", daemon=True
        )
        master.probe_thread = (me, thread)
    try:
        thread.start()
    except RuntimeError:  # interpreter shutdown: the rounds keep their backoff
        with _lock:
            master.probe_thread = None
        _hand_back(master, ticket, answered=False)
        return False
    return True


def forget(master: Master) -> None:
    """Stop watching ``master`` and let the rounds connect to it again."""
    with _lock:
        _watched.pop(id(master), None)
        master.probe_ticket = None


def watching() -> list[Master]:
    """The masters this process watches now (for tests)."""
    with _lock:
        return [master for master in _watched.values() if master.probing]


def _hand_back(master: Master, ticket: object, *, answered: bool) -> None:
    with _lock:
        if master.probe_ticket is ticket:
            master.probe_ticket = None
            _watched.pop(id(master), None)
            # Answered: connect at once. Given up: the rounds try once more, now.
            master.connect_after = 0.0


def _run(ref: weakref.ref[Master]) -> None:
    ticket: object = None
    since = time.monotonic()
    while True:
        time.sleep(PERIOD)
        master = ref()
        if master is None:
            return
        with _lock:
            if not master.probing:
                master.probe_thread = None  # watched again after this: a new thread
                return
            if master.probe_ticket is not ticket:  # watched anew (check_masters, ...)
                ticket, since = master.probe_ticket, time.monotonic()
        try:
            answered = probe(master)
        except Exception:  # a probe must never end the thread with the master watched
            logger.debug("probe of master %s failed", master.name, exc_info=True)
            answered = False
        if answered or time.monotonic() - since >= WATCH_LIMIT:
            _hand_back(master, ticket, answered=answered)
        del master  # between two tries the thread holds no reference


def _after_fork_in_child() -> None:
    # The parent's tickets carry its pid: the child's masters are not watched (see
    # Master.probing). Only the lock, which a parent thread may have held, is renewed.
    global _lock
    _lock = threading.Lock()
    _watched.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

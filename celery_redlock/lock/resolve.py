"""Resolving a master's host name within a deadline.

``socket.getaddrinfo`` takes no timeout. A resolver that does not answer (a DNS outage,
a dead first ``nameserver`` in ``resolv.conf``) holds the caller for the system's own
timeout, 5 s per try and nameserver by default: a connect on the jobs' path then cost a
job seconds where ``node_timeout`` promises a fraction of one (measured before this
module: 6 s, one lookup here and one in redis-py's connect, for a master whose name took
3 s to fail).

:func:`resolve` runs the system resolver (so ``/etc/hosts``, ``nsswitch.conf`` and
search domains apply as for any other connect) on a thread of its own and waits for it
at most ``timeout`` seconds. A lookup that outlasts the wait goes on: one lookup per
name at a time, whatever the number of callers, and its answer is kept for the next
connect. :func:`prefetch` starts the lookups of several names together, so that they
share one wait. An answer is used for :data:`FRESH` seconds without asking again, or
until :func:`distrust` (no address of it could be connected to); after that, when a new
lookup does not finish in time or fails, the last answer is used (a master's address
changes far more rarely than its resolver fails). A failed lookup stands for the name's
next ones for :data:`FAILED_FOR` seconds. No library fits here: aiodns and
pycares need an event loop or a channel of their own and bypass ``nsswitch.conf``, and
the standard library's resolver has no deadline.

Numeric addresses (``127.0.0.1``, ``::1``) never reach the resolver.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

__all__ = ["FRESH", "distrust", "prefetch", "resolve"]

logger = logging.getLogger("celery_redlock.lock")

#: Seconds an answer is used without asking the resolver again.
FRESH = 30.0
#: Seconds a failed lookup stands for the name's next ones (one lookup per name and
#: second at most while it fails).
FAILED_FOR = 1.0

Addresses = list[tuple[Any, ...]]
_Key = tuple[str, int, int, int]


class _Lookup:
    """One lookup under way on its own thread; ``done`` is set when it has an outcome."""

    __slots__ = ("addresses", "done", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.addresses: Addresses | None = None
        self.error: OSError | None = None


#: Guards the maps below; never held across a lookup.
_lock = threading.Lock()
#: the last answer per name, and when it came (``time.monotonic``)
_answers: dict[_Key, tuple[Addresses, float]] = {}
#: the lookup under way per name
_under_way: dict[_Key, _Lookup] = {}
#: the last failed lookup per name, and when it ended (reused for ``FAILED_FOR`` s)
_failures: dict[_Key, tuple[_Lookup, float]] = {}
#: names whose last known addresses serve while they do not resolve (logged once)
_stale_in_use: set[str] = set()


def resolve(host: str, port: int, family: int, socktype: int, timeout: float) -> Addresses:
    """``socket.getaddrinfo(host, port, family, socktype)``, waiting at most ``timeout`` s.

    :raises OSError: the name does not resolve (``socket.gaierror``, as getaddrinfo
        raises it), or it did not resolve within ``timeout`` and was never resolved
        before (``TimeoutError``, naming the host).
    """
    if _is_address(host, port, family, socktype):
        return socket.getaddrinfo(host, port, family, socktype, 0, socket.AI_NUMERICHOST)
    known, lookup = _begin((host, port, family, socktype))
    if lookup is None:
        assert known is not None
        return known[0]
    if lookup.done.wait(max(timeout, 0.0)):
        if lookup.addresses is not None:
            _recovered(host)
            return lookup.addresses
        error = lookup.error
        assert error is not None
        if known is None:
            raise _copy(error)
        _falling_back(host, f"does not resolve now ({error})")
        return known[0]
    if known is not None:
        _falling_back(host, "did not resolve in time")
        return known[0]
    raise TimeoutError(f"{host} did not resolve in time (the lookup goes on)")


def prefetch(host: str, port: int, family: int, socktype: int) -> None:
    """Start looking ``host`` up unless an answer is fresh or a lookup is under way; do not
    wait. Lookups of several names started this way run together, so the
    :func:`resolve` calls that follow share one wait rather than queueing one each."""
    if not _is_address(host, port, family, socktype):
        _begin((host, port, family, socktype))


def _is_address(host: str, port: int, family: int, socktype: int) -> bool:
    """Whether ``host`` is a numeric address (no lookup). Anything else, a name that
    is not valid included (its lookup then says why), is for the resolver."""
    try:
        socket.getaddrinfo(host, port, family, socktype, 0, socket.AI_NUMERICHOST)
    except (OSError, ValueError):  # gaierror; UnicodeError for a label idna refuses
        return False
    return True


def _begin(key: _Key) -> tuple[tuple[Addresses, float] | None, _Lookup | None]:
    """The last answer for ``key`` and the lookup to wait for (None: the answer is fresh),
    started here when none is under way."""
    with _lock:
        known = _answers.get(key)
        if known is not None and time.monotonic() - known[1] < FRESH:
            return known, None
        lookup = _under_way.get(key)
        if lookup is None:
            failed = _failures.get(key)
            if failed is not None and time.monotonic() - failed[1] < FAILED_FOR:
                return known, failed[0]  # failed a moment ago (a prefetch's, say)
            lookup = _under_way[key] = _Lookup()
            try:
                threading.Thread(
                    target=_look_up, args=(key, lookup), name="redlock-resolve", daemon=True
                ).start()
            except BaseException as exc:  # a signal's too: cleaned up, then re-raised
                # No thread (a process limit, interpreter shutdown): a lookup left under
                # way would make every later call wait for one that never ends.
                del _under_way[key]
                lookup.error = OSError(f"{key[0]}: cannot start a lookup: {exc}")
                lookup.done.set()
                if not isinstance(exc, Exception):
                    raise
        return known, lookup


def distrust(host: str, port: int) -> None:
    """A connect to the addresses ``host`` resolved to failed: the next connect asks the
    resolver again (the master may have moved), and falls back to them only if the
    lookup is late or fails."""
    with _lock:
        for key, (addresses, _) in list(_answers.items()):
            if key[0] == host and key[1] == port:
                _answers[key] = (addresses, float("-inf"))


def _falling_back(host: str, why: str) -> None:
    """Log that ``host``'s last known addresses serve, once until it resolves again
    (the probe asks twice a second during an outage)."""
    with _lock:
        if host in _stale_in_use:
            return
        _stale_in_use.add(host)
    logger.warning("%s %s; connecting to its last known addresses", host, why)


def _recovered(host: str) -> None:
    if host in _stale_in_use:
        with _lock:
            _stale_in_use.discard(host)
        logger.warning("%s resolves again", host)


def _copy(error: OSError) -> OSError:
    """A copy of a lookup's error for one caller (several may wait for one lookup, and
    raising one object from several threads would mix their tracebacks)."""
    try:
        return type(error)(*error.args)
    except Exception:  # noqa: BLE001 - a subclass with another constructor
        return OSError(str(error))


def _look_up(key: _Key, lookup: _Lookup) -> None:
    host, port, family, socktype = key
    try:
        addresses = socket.getaddrinfo(host, port, family, socktype)
    except OSError as exc:
        lookup.error = exc
    except Exception as exc:  # noqa: BLE001 - UnicodeError for a bad name, and the like
        lookup.error = socket.gaierror(socket.EAI_NONAME, f"not a valid host name ({exc})")
    else:
        lookup.addresses = addresses
    with _lock:
        if lookup.addresses is not None:
            _answers[key] = (lookup.addresses, time.monotonic())
            _failures.pop(key, None)
        else:
            _failures[key] = (lookup, time.monotonic())
        if _under_way.get(key) is lookup:
            del _under_way[key]
    lookup.done.set()


def forget() -> None:
    """Drop every answer and lookup (tests; and a forked child, whose copies of the
    parent's lookups have no thread to finish them)."""
    global _lock
    _lock = threading.Lock()
    _answers.clear()
    _under_way.clear()
    _failures.clear()
    _stale_in_use.clear()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _under_way.clear()  # their threads are the parent's; the answers stay good


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

"""One round of commands to every master at once, from one thread.

A round writes each master's payload to its socket, then waits for replies on
all sockets together with one deadline (``select``), so N masters cost one round
trip, not N, and no thread is started per call. The caller's ``decided``
predicate ends the wait as soon as the outcome is certain; replies that arrive
later are read past by the next round on the same link.

Timeline of a round on 3 masters, one of them paused::

    t0  send A, B, C                       (three sendall, no wait between)
    t1  A answers   -> decided? no
    t2  B answers   -> decided? yes (2 of 3) -> return; C's slot is left behind
    t9  C resumes and answers; the next round on this link discards the reply

Replies that come within microseconds (masters on this host or a fast LAN) are
polled for without sleeping, for at most ``spin`` seconds a round: on such links
waking a sleeping thread costs more than the wait itself (measured on 3 local
masters: 7,968 acquire+release cycles/s sleeping, 12,122 polling for up to 20 µs,
at the same CPU per cycle). The caller decides when polling pays off (see
``Redlock(spin_wait=...)``).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import redis

from . import interrupts, probe, resolve, waiting
from .master import Link, Slot
from .wire import ReplyError

__all__ = ["Lane", "RoundResult", "Validator", "run_round"]

#: Says whether one master's replies to a round have the shape its commands return. It
#: never accepts an error reply (:class:`.wire.ReplyError`): those are told apart only
#: when it refuses (tests/core/test_link.py checks every validator of the rounds).
Validator = Callable[[list[object]], bool]


class Lane:
    """One link per master, used by one thread at a time (``lock``).

    Taken locked from :meth:`Redlock._lane`; as a context manager it unlocks on exit
    and notes when (``idle_since``, on ``clock``), so that idle lanes can be closed.
    A ``retired`` lane was closed for good: it is never handed out again.
    """

    __slots__ = ("clock", "idle_since", "links", "lock", "retired")

    def __init__(self, links: list[Link], clock: Callable[[], float] = time.monotonic) -> None:
        self.links = links
        self.lock = threading.Lock()
        self.clock = clock
        self.idle_since = clock()
        self.retired = False

    def __enter__(self) -> Lane:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # Unlocked first: an exception (a signal's) landing here must not leave the lane
        # locked for good (see Redlock._lane for one that did anyway).
        self.lock.release()
        self.idle_since = self.clock()


class RoundResult:
    """Replies per master index; ``errors`` says why a master has none.

    (A plain class with slots rather than a dataclass: one is made per round.)
    """

    __slots__ = ("errors", "late", "not_waited", "replies", "waited")

    def __init__(
        self,
        replies: list[list[object] | None],
        errors: dict[int, str] | None = None,
        not_waited: set[int] | None = None,
        late: dict[int, Slot] | None = None,
        waited: float = 0.0,
    ) -> None:
        self.replies = replies
        self.errors: dict[int, str] = {} if errors is None else errors
        #: masters whose reply we stopped waiting for because the outcome was certain
        self.not_waited: set[int] = set() if not_waited is None else not_waited
        #: the slots of the replies not waited for (and those that timed out): they fill
        #: in when a later round on the same link reads past them
        self.late: dict[int, Slot] = {} if late is None else late
        #: seconds from the last send until the round was decided or gave up (0.0 when
        #: it did not wait for any reply)
        self.waited = waited

    def __repr__(self) -> str:
        return (
            f"RoundResult(replies={self.replies!r}, errors={self.errors!r}, "
            f"not_waited={self.not_waited!r}, late={self.late!r}, waited={self.waited!r})"
        )


Decider = Callable[[RoundResult], bool]


def run_round(
    links: Sequence[Link],
    payloads: Sequence[tuple[bytes, int] | None],
    *,
    clock: Callable[[], float],
    node_timeout: float,
    reconnect_backoff: float,
    decided: Decider | None = None,
    wait_on_down: bool = False,
    awaiting: Mapping[int, Slot] | None = None,
    spin: float = 0.0,
    wait: bool = True,
    valid: Validator | None = None,
) -> RoundResult:
    """Send ``payloads[i]`` (bytes, number of replies) to ``links[i]``; collect replies.

    A master that cannot be reached, does not answer before the deadline or
    breaks the connection gets an entry in ``errors`` instead of replies. A
    master known to be down is sent its payload (to keep the per-link order)
    but not waited for unless ``wait_on_down``.

    ``awaiting`` maps master indexes to the late slots of an earlier round on these
    links (:attr:`RoundResult.late`): this round collects those replies instead of
    sending (give ``None`` payloads there). A slot whose link was closed since is
    reported in ``errors``.

    ``spin`` (seconds, real time) lets the round poll for replies without sleeping
    for that long after sending, then sleep as usual; it never outlasts
    ``node_timeout``. :attr:`RoundResult.waited` says how long the round waited.

    ``wait=False`` sends and returns at once: no reply is waited for, every slot is
    left to later rounds on the same links (:attr:`RoundResult.not_waited`).

    A master's replies land in :attr:`RoundResult.replies` only when they are what the
    commands return: one with an error reply (``-ERR``, ``NOSCRIPT`` ...) gets an entry
    in ``errors`` instead (``NOSCRIPT`` also closes the link: reconnecting loads the
    scripts), and so does one whose replies ``valid`` refuses, or whose bytes are not
    RESP at all: that link is closed and its master marked down, not tried again for
    ``reconnect_backoff`` seconds. ``decided`` only ever sees accepted replies, and no
    reply, however malformed, makes this function raise.
    """

    def accept(i: int, slot: Slot) -> None:
        link = links[i]
        replies = slot.replies
        ok = True
        if valid is not None:
            try:
                ok = valid(replies)
            except interrupts.ASYNC:
                raise  # a signal's (a soft time limit): not this master's failure
            except Exception:  # noqa: BLE001 - a validator tripping on a reply means "bad"
                ok = False
        if not ok or valid is None:  # (a validator never accepts an error reply)
            for reply in replies:
                if isinstance(reply, ReplyError):
                    if "NOSCRIPT" in str(reply):
                        link.close()  # flushed on the master: reconnecting loads them again
                    errors[i] = f"error reply: {reply}"
                    link.master.mark_up()  # it answered
                    return
        if ok:
            result.replies[i] = replies
            master = link.master
            if master.down or master.last_error:  # (mark_up does nothing else)
                master.mark_up()
        else:
            problem = f"unexpected reply {replies!r:.120}"
            _broken(link, i, problem, errors, clock() + reconnect_backoff)

    n = len(links)
    result = RoundResult([None] * n)
    errors = result.errors
    slots: dict[int, Slot] = {}
    unconnected = False
    some_down = False
    for link in links:
        if link.in_doubt:
            # An exception cut a send or a hand-out of replies short (a signal's): which
            # reply answers what is no longer known. Reconnected below; a reply matched
            # to the wrong command could count a vote that was never given.
            link.close()
        if link.sock is None:
            unconnected = True
        if link.master.down:
            some_down = True
    if unconnected:
        # Connected before anything is sent: an exception (a signal's) landing in the
        # connects finds nothing of this round on the masters to undo.
        _connect_all(links, payloads, errors, clock, node_timeout, reconnect_backoff)
    for i, payload in enumerate(payloads):
        if payload is None:
            continue
        link = links[i]
        if link.sock is None:  # could not connect: _connect_all said why in errors
            continue
        try:
            slots[i] = link.send(payload[0], payload[1])
        except (OSError, ConnectionError) as exc:
            link.close()
            master = link.master
            master.connect_after = clock() + reconnect_backoff
            master.mark_down(f"send failed: {exc}")
            errors[i] = master.last_error
    if awaiting:
        for i, slot in awaiting.items():
            if slot.done:
                accept(i, slot)
            elif any(s is slot for s in links[i].outstanding):
                slots[i] = slot
            else:
                errors[i] = links[i].master.last_error or "connection closed since"
    if not wait:
        # Nothing is waited for: every slot is left to later rounds on these links.
        result.late.update(slots)
        result.not_waited.update(slots)
        return result
    deadline = clock() + node_timeout
    # ``spin`` is real time (the injectable ``clock`` may stand still in tests).
    sent_at = time.monotonic()
    spin_until = sent_at + min(spin, node_timeout) if spin > 0.0 else 0.0
    waited = False
    pending = slots
    # Every master was sent its payload and nothing is known yet: the first look at
    # ``decided`` can wait for the first replies.
    blank = len(slots) == n and not awaiting
    # Masters only turn down here by failing, which ends their wait: with none down at
    # the start (the usual case), the check below need not run on every wake-up.
    some_down = some_down and not wait_on_down
    while pending:
        if decided is not None and not blank and decided(result):
            break
        blank = False
        if some_down and all(links[i].master.down for i in pending):
            # Nothing we are still waiting for is known to be up: take what is
            # already there without blocking, and stop.
            timeout = 0.0
        else:
            timeout = deadline - clock()
            if timeout <= 0:
                break
        if timeout > 0.0:
            waited = True
        if spin_until and timeout > 0.0:
            ready = _spin(links, pending, spin_until)
            if not ready:
                spin_until = 0.0  # the spin is spent: sleep until replies come
                ready = _ready(links, pending, max(0.0, deadline - clock()))
        else:
            ready = _ready(links, pending, timeout)
        for i in ready:
            link = links[i]
            try:
                link.read_available()
            except (OSError, ConnectionError) as exc:
                link.close()
                link.master.mark_down(f"read failed: {exc}")
                errors[i] = link.master.last_error
                del pending[i]
                continue
            except interrupts.ASYNC:
                raise  # a signal's (a soft time limit): not this master's failure
            except Exception as exc:  # noqa: BLE001 - not RESP (hiredis.ProtocolError) or worse
                _broken(link, i, f"malformed reply: {exc}", errors, clock() + reconnect_backoff)
                del pending[i]
                continue
            slot = pending[i]
            if len(slot.replies) >= slot.expected:  # slot.done
                accept(i, slot)
                del pending[i]
            elif link.master.down:
                # Well-formed replies to an earlier round came in: the master answers
                # again, so it is waited for (a master known down is only polled, and
                # behind any latency its own reply would never be in time to mark it up).
                link.master.mark_up()
        if timeout == 0.0 and not ready:
            break
    if waited:
        result.waited = time.monotonic() - sent_at
    if pending:
        timed_out = clock() >= deadline
        for i, slot in pending.items():
            result.late[i] = slot
            master = links[i].master
            if timed_out or master.down:
                if not master.down:
                    master.mark_down(f"no reply within {node_timeout}s")
                errors[i] = master.last_error or "no reply"
            else:
                result.not_waited.add(i)
    return result


def _broken(link: Link, i: int, why: str, errors: dict[int, str], retry_at: float) -> None:
    """Close a link whose master answered what no command returns, and mark it down
    until ``retry_at`` (its replies cannot be matched to commands any more)."""
    link.close()
    link.master.connect_after = retry_at
    link.master.mark_down(why)
    errors[i] = link.master.last_error


def _answered(exc: BaseException) -> bool:
    """Whether a failed connect by redis-py (TLS, unix sockets, credential providers) was
    refused by a server that answers: AUTH refused, an error reply, a TLS certificate or
    handshake refused. Probing such a master would hand it straight back."""
    return any(
        isinstance(found, redis.AuthenticationError | redis.ResponseError)
        or probe.tls_refused(found)
        for found in (exc, exc.__cause__ or exc.__context__)
    )


def _ready(links: Sequence[Link], indexes: Collection[int], timeout: float) -> list[int]:
    """Which of ``links[i]`` for ``i`` in ``indexes`` have something to read.

    A TLS socket may hold decrypted bytes that ``select`` does not see: those count
    at once; otherwise ``select`` waits up to ``timeout`` for the first readable ones.
    One link left to wait for is waited on through its :attr:`Link.watcher`.
    """
    if len(indexes) == 1:
        for i in indexes:
            watcher = links[i].watcher
            if watcher is not None:
                found = watcher.readable(timeout)
                if found is not None:
                    return [i] if found else []
    by_fd = {}
    ready: list[int] = []
    for i in indexes:
        link = links[i]
        sock = link.sock
        if sock is None:
            continue
        if not link._nonblocking and link.buffered():
            ready.append(i)
        by_fd[sock.fileno()] = i
    if ready:
        return ready
    return waiting.readable_fds(by_fd, timeout)


def _spin(links: Sequence[Link], indexes: Collection[int], until: float) -> list[int]:
    """Like :func:`_ready`, polling without sleeping until ``until`` (``time.monotonic``)."""
    while True:
        ready = _ready(links, indexes, 0.0)
        if ready or time.monotonic() >= until:
            return ready


def _connect_all(
    links: Sequence[Link],
    payloads: Sequence[tuple[bytes, int] | None],
    errors: dict[int, str],
    clock: Callable[[], float],
    node_timeout: float,
    reconnect_backoff: float,
) -> None:
    """Connect every link that has a payload and no connection, all at once.

    The TCP connects to plain TCP masters are started together and waited for within
    one ``node_timeout`` (masters that drop packets cost one timeout in all, not one
    each); other masters (TLS, unix sockets, Sentinel) are connected by redis-py, one
    after another. Then each handshake is sent and all are waited for together within
    one ``node_timeout``, so masters that accept a connection but do not answer (a
    stopped process) also cost one timeout in all. A master that cannot be connected
    gets an entry in ``errors`` and is not tried again for ``reconnect_backoff`` seconds,
    nor at all while :mod:`.probe` watches it (until its server answers a ``PING``).
    """

    def failed(i: int, why: object, *, unreachable: bool = True) -> None:
        link = links[i]
        link.close()
        link.master.connect_after = clock() + reconnect_backoff
        link.master.mark_down(f"connect failed: {why}")
        errors[i] = link.master.last_error
        if unreachable:
            # Further tries happen off the jobs' path, until the server answers again.
            # A master that answered badly keeps the backoff: the probe would hand it
            # straight back.
            probe.watch(link.master)

    connecting: dict[socket.socket, tuple[int, Any]] = {}
    to_open: list[tuple[int, Any]] = []
    handshakes: dict[int, Slot] = {}
    try:
        now = clock()
        wanted: list[int] = []
        for i, payload in enumerate(payloads):
            link = links[i]
            if payload is None or link.sock is not None:
                continue
            if link.master.probing or now < link.master.connect_after:
                errors[i] = link.master.last_error or "not connected"
                continue
            wanted.append(i)
        for i in wanted:
            # The lookups of every name start together: names that hang cost the round
            # one node_timeout in all, not one each (see .resolve). A failure to start
            # one shows again, and is reported, at its connect below.
            try:
                links[i].master.prefetch_address()
            except interrupts.ASYNC:
                raise  # a signal's (a soft time limit): not this master's failure
            except Exception:  # noqa: BLE001 - reported at its connect below
                pass
        # Real time: the lookups run on threads (the injectable clock may stand still).
        resolved_by = time.monotonic() + node_timeout
        for i in wanted:
            link = links[i]
            try:
                started = link.master.start_connect(max(0.0, resolved_by - time.monotonic()))
            except interrupts.ASYNC:
                raise  # a signal's (a soft time limit): not this master's failure
            except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
                failed(i, exc)
                continue
            if started is None:
                to_open.append((i, None))
            else:
                connecting[started[1]] = (i, started[0])
        deadline = clock() + node_timeout
        while connecting:
            timeout = deadline - clock()
            if timeout <= 0:
                break
            writable = waiting.writable(list(connecting), timeout)
            for sock in writable:
                i, conn = connecting.pop(sock)
                error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if error:
                    # Refused, or the like: the name's next address, within the same
                    # deadline (not redis-py's connect, which would resolve the name
                    # again with no deadline; see .resolve).
                    sock.close()
                    conn.last_error = OSError(error, os.strerror(error))
                    try:
                        connecting[links[i].master.connect_next(conn)] = (i, conn)
                    except interrupts.ASYNC:
                        raise  # a signal's (a soft time limit): not this master's failure
                    except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
                        failed(i, exc)
                else:
                    to_open.append((i, conn))
        for sock, (i, conn) in list(connecting.items()):
            del connecting[sock]
            sock.close()
            resolve.distrust(conn.host, conn.port)  # the master may have moved
            failed(i, f"TCP connect timed out after {node_timeout}s")
        to_open.sort(key=lambda item: item[0])
        while to_open:
            # Taken off the list once opened: an exception (a signal's) landing before the
            # open (which closes its socket when it fails) leaves it to the cleanup below.
            i, conn = to_open[0]
            try:
                handshakes[i] = links[i].open(conn)
            except interrupts.ASYNC:
                raise  # a signal's (a soft time limit): not this master's failure
            except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
                failed(i, exc, unreachable=not _answered(exc))
            del to_open[0]
        deadline = clock() + node_timeout
        while handshakes:
            timeout = deadline - clock()
            if timeout <= 0:
                break
            for i in _ready(links, handshakes, timeout):
                slot = handshakes[i]
                try:
                    links[i].read_available()
                except interrupts.ASYNC:
                    raise  # a signal's (a soft time limit): not this master's failure
                except Exception as exc:  # noqa: BLE001 - any failure means "not reachable"
                    del handshakes[i]
                    # Closed or reset without a word: unreachable. Closed after a reply
                    # (-ERR max number of clients reached) or bytes that are not RESP:
                    # it answers, badly.
                    failed(i, exc, unreachable=isinstance(exc, OSError) and not slot.replies)
                    continue
                if slot.done:
                    del handshakes[i]
                    try:
                        links[i].finish_handshake(slot, clock())
                    except interrupts.ASYNC:
                        raise  # a signal's (a soft time limit): not this master's failure
                    except Exception as exc:  # noqa: BLE001 - an error or unusable reply
                        failed(i, exc, unreachable=False)
        for i in list(handshakes):
            del handshakes[i]
            failed(i, f"no handshake reply within {node_timeout}s")
    except BaseException:
        for sock in connecting:
            sock.close()
        for _, conn in to_open:
            if conn is not None and conn.given_sock is not None:
                conn.given_sock.close()
        for i in handshakes:  # half-open links must not carry the next round's commands
            links[i].close()
        raise

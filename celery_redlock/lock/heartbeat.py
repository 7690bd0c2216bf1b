"""The renewal engine: one thread per process renews every auto-renewed lease.

Leases are kept in a heap by due time. When the earliest is due, the engine
takes every lease due within a short window, groups them per :class:`Redlock`,
and extends each group with one pipelined script call per master, sent to all
masters at once. So 10,000 leases cost one round per tick, not 10,000 threads.

Loss is an event: a lease that a quorum no longer knows, or that could not be
renewed before its validity ended, is marked lost (``held`` turns false) and
its ``on_lost`` callbacks run on a separate dispatcher thread, so a slow or
failing callback never delays renewal of the others.

Fork safety (Celery prefork): the child starts with no engine and no leases of
its own; ``os.register_at_fork`` drops the parent's engine state in the child,
and the child's engine starts lazily on its first auto-renewed lease. The
parent's engine thread keeps running in the parent, undisturbed.

No argument can stop the engine: its waits are capped (``MAX_WAIT``; a
``Condition.wait`` past ``threading.TIMEOUT_MAX`` raises), every step of its loop is
guarded, and a thread that died anyway is started again (logged) by the next
:meth:`Heartbeat.add` or :func:`engine` call.

Renewals and a holder's own ``extend()`` never run at once for one lease: the
engine only *tries* the lease's extension lock, and renews a busy lease a moment
later (its holder is extending it right now).
"""

from __future__ import annotations

import atexit
import contextlib
import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from ..redact import guard
from . import events, process
from .callbacks import dispatch_lost
from .lease import HELD

if TYPE_CHECKING:
    from .lease import Lease
    from .redlock import Redlock

__all__ = ["Heartbeat", "dispatch_lost", "engine", "forget"]

logger = guard(logging.getLogger("celery_redlock.heartbeat"))  # see celery_redlock.redact

#: Leases due within this share of their renew interval are renewed in the same tick.
COALESCE = 0.25
#: Entries of released leases the renewal heap may carry beyond the live ones.
COMPACT_SLACK = 64
#: Seconds interpreter exit may spend releasing leases still held.
EXIT_BUDGET = 2.0
#: The longest single wait of the engine thread (seconds): it looks again after that.
MAX_WAIT = 60.0
#: Seconds until the engine tries again a lease whose holder was extending it.
BUSY_RETRY = 0.01
#: Seconds a client's renewal thread (only with several clients) waits for work, then ends.
RENEWER_IDLE = 60.0


class Heartbeat:
    """Renews every auto-renewed lease of this process on one daemon thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, Lease]] = []
        self._seq = itertools.count()
        #: the lock of ``_cond``, taken directly where no wait or notify is needed (add and
        #: remove run once per task: Condition's own ``with`` costs two Python calls)
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._active: dict[int, Lease] = {}
        #: per lease, the sequence number of its one live heap entry (others are stale)
        self._entry: dict[int, int] = {}
        #: per client (``id(redlock)``), how many of its leases are renewed: with more than
        #: one client, each client's rounds run on a thread of its own (see _tick)
        self._clients: dict[int, int] = {}
        self._renewers: dict[int, queue.SimpleQueue[list[Lease]]] = {}
        #: leases no longer renewed (max_hold reached), to mark lost at their deadline
        self._ending: dict[int, str] = {}
        self._thread: threading.Thread | None = None
        self._stopped = False
        #: when the engine thread looks at the heap again (``inf``: only when notified);
        #: an added lease due no earlier needs no wake-up (see :meth:`add`)
        self._wake_at = float("inf")
        #: the shortest renew interval added since the engine last went idle
        self._shortest = float("inf")
        self._pid = process.pid()
        #: ticks run, leases renewed, times the thread woke up and was restarted, for tests,
        #: benchmarks and operators
        self.ticks = 0
        self.wakeups = 0
        self.renewals = 0
        self.restarts = 0
        self.last_tick_seconds = 0.0

    def __len__(self) -> int:
        return len(self._active)

    def add(self, lease: Lease) -> None:
        """Start renewing ``lease`` every ``lease.renew_every`` seconds."""
        renew_every = lease.renew_every
        due = self._clock() + renew_every
        ident = id(lease)
        with self._mutex:  # self._cond's lock: notify() below may run under it
            if self._active.get(ident) is not lease:
                self._active[ident] = lease
                client = id(lease.redlock)
                self._clients[client] = self._clients.get(client, 0) + 1
            self._push(due, lease)
            if renew_every < self._shortest:
                self._shortest = renew_every
            if self._thread is None or not self._thread.is_alive():
                self._start_thread()
            elif due < self._wake_at:
                # Only a lease due before the engine's next look wakes it: a process
                # running short tasks adds and releases a lease per task, and waking
                # the thread for each cost two context switches per task.
                self._cond.notify()

    def reschedule(self, lease: Lease) -> None:
        """Renew ``lease`` next ``lease.renew_every`` seconds from now, or sooner when its
        validity ends before that (its TTL or interval changed, or a failed extension
        lowered its deadline: it must not wait for a renewal planned for the longer)."""
        now = self._clock()
        due = now + min(lease.renew_every, max(BUSY_RETRY, (lease.deadline - now) / 3))
        with self._cond:
            if self._active.get(id(lease)) is not lease:
                return
            self._push(due, lease)
            self._shortest = min(self._shortest, lease.renew_every)
            if due < self._wake_at:
                self._cond.notify()

    def alive(self) -> bool:
        """True while the engine thread runs (it starts with the first lease)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def ensure_running(self) -> None:
        """Start the engine thread again if it died while leases wait for it (logged)."""
        with self._cond:
            if self._active and not self._stopped and not self.alive():
                self._start_thread()

    def _start_thread(self) -> None:
        # Under self._cond.
        if self._thread is not None:
            self.restarts += 1
            logger.error(
                "the renewal engine thread had stopped; started again (%d leases waiting)",
                len(self._active),
            )
        self._thread = threading.Thread(target=self._run, name="redlock-heartbeat", daemon=True)
        self._thread.start()

    def _push(self, due: float, lease: Lease) -> None:
        # Under self._cond: the lease's one live entry; any earlier one becomes stale.
        seq = next(self._seq)
        self._entry[id(lease)] = seq
        heapq.heappush(self._heap, (due, seq, lease))

    def _live(self, entry: tuple[float, int, Lease]) -> bool:
        lease = entry[2]
        return self._active.get(id(lease)) is lease and self._entry.get(id(lease)) == entry[1]

    def remove(self, lease: Lease) -> None:
        """Stop renewing ``lease``.

        Its heap entry is dropped when it comes up, or when entries of released leases
        outnumber the live ones (a worker running short tasks releases hundreds of
        leases per renew interval): then the heap is rebuilt from the live ones, so it
        holds at most about twice as many entries, and no released lease stays in memory
        for a whole renew interval.
        """
        ident = id(lease)
        with self._mutex:  # self._cond's lock
            if self._active.get(ident) is lease:
                del self._active[ident]
                self._entry.pop(ident, None)
                if self._ending:
                    self._ending.pop(ident, None)
                client = id(lease.redlock)
                left = self._clients.get(client, 1) - 1
                if left:
                    self._clients[client] = left
                else:
                    self._clients.pop(client, None)
            heap, active = self._heap, self._active
            if len(heap) > 2 * len(active) + COMPACT_SLACK:
                heap[:] = [entry for entry in heap if self._live(entry)]
                heapq.heapify(heap)

    def leases(self) -> list[Lease]:
        with self._cond:
            return list(self._active.values())

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _take_due(self) -> list[Lease] | None:
        """Block until leases are due; return them (None when stopped)."""
        with self._cond:
            while not self._stopped:
                heap = self._heap
                while heap and not self._live(heap[0]):
                    heapq.heappop(heap)
                if not heap:
                    # Idle. Leases were added lately (and released before they came
                    # up): look again after the shortest of their intervals, so the
                    # next lease like them is due after that look and needs no
                    # wake-up. Nothing was added: sleep until notified.
                    shortest, self._shortest = self._shortest, float("inf")
                    if shortest == float("inf"):
                        self._wake_at = float("inf")
                        self._cond.wait(MAX_WAIT)
                    else:
                        shortest = min(shortest, MAX_WAIT)
                        self._wake_at = self._clock() + shortest
                        self._cond.wait(shortest)
                    self.wakeups += 1
                    continue
                now = self._clock()
                wait = heap[0][0] - now
                if wait > 0:
                    wait = min(wait, MAX_WAIT)
                    self._wake_at = now + wait
                    self._cond.wait(wait)
                    self.wakeups += 1
                    continue
                # Ticking: the thread looks at the heap again when done, so no add
                # needs to wake it.
                self._wake_at = float("-inf")
                due: list[Lease] = []
                while heap:
                    when, _, lease = heap[0]
                    if when > now + COALESCE * lease.renew_every:
                        break
                    entry = heapq.heappop(heap)
                    if self._live(entry):
                        del self._entry[id(lease)]
                        due.append(lease)
                if due:
                    return due
            return None

    def _schedule(self, lease: Lease, due: float) -> None:
        self._schedule_many(((due, lease),))

    def _schedule_many(self, entries: Iterable[tuple[float, Lease]]) -> None:
        """Put ``(due, lease)`` entries of leases still renewed on the heap, under one lock
        acquisition (a tick schedules all the leases it renewed at once)."""
        with self._cond:
            active = self._active
            earliest = float("inf")
            for due, lease in entries:
                if active.get(id(lease)) is lease:
                    self._push(due, lease)
                    earliest = min(earliest, due)
            if earliest < self._wake_at:
                # Scheduled from a client's renewal thread (see _tick) while the engine
                # sleeps past it: wake it. (While it ticks, _wake_at is -inf: it looks.)
                self._cond.notify()

    def _run(self) -> None:
        while True:
            try:
                due = self._take_due()
            except Exception:
                # Nothing in the wait should raise (its waits are capped); if it does, the
                # engine must live on: look again shortly.
                logger.exception("renewal engine: waiting for due leases failed; going on")
                due = []
                with self._cond:
                    self._cond.wait(0.05)
            if due is None:
                return
            if not due:
                continue
            started = self._clock()
            try:
                self._tick(due)
            except Exception:
                logger.exception("renewal tick failed; retrying its leases shortly")
                with contextlib.suppress(Exception):
                    for lease in due:
                        self._schedule(lease, self._clock() + 0.05)
            self.ticks += 1
            self.last_tick_seconds = self._clock() - started

    def _tick(self, due: Sequence[Lease]) -> None:
        groups: dict[int, tuple[Redlock, list[Lease]]] = {}
        for lease in due:
            groups.setdefault(id(lease.redlock), (lease.redlock, []))[1].append(lease)
        with self._cond:
            several = len(self._clients) > 1
        if not several:
            for redlock, leases in groups.values():
                self._renew_group(redlock, leases)
            return
        # Leases of several clients (sets of masters) are renewed: each client's rounds run
        # on a thread of its own, so one client's slow master (a round or a connect waits
        # up to its node_timeout) never holds up the renewal of another client's leases.
        # This thread only hands them over; the leases come back to the heap when done.
        for redlock, leases in groups.values():
            self._hand_over(redlock, leases)

    def _hand_over(self, redlock: Redlock, leases: list[Lease]) -> None:
        """Give ``leases`` to ``redlock``'s renewal thread (started if there is none).

        Under ``self._cond``, as the thread's retirement is: work handed over is never
        left in a queue nobody reads. If no thread can be started, renew here.
        """
        with self._cond:
            found = self._renewers.get(id(redlock))
            if found is None:
                found = queue.SimpleQueue()
                try:
                    threading.Thread(
                        target=self._run_renewer,
                        args=(redlock, found),
                        name="redlock-heartbeat-client",
                        daemon=True,
                    ).start()
                except Exception:  # noqa: BLE001 - a thread limit: renew on this thread
                    found = None
                else:
                    self._renewers[id(redlock)] = found
            if found is not None:
                found.put(leases)
                return
        logger.warning("renewal: could not start a client thread; renewing on the engine's")
        self._renew_group_guarded(redlock, leases)

    def _run_renewer(self, redlock: Redlock, work: queue.SimpleQueue[list[Lease]]) -> None:
        while True:
            try:
                leases = work.get(timeout=RENEWER_IDLE)
            except queue.Empty:
                with self._cond:
                    if work.empty():  # nothing was handed over meanwhile: retire
                        self._renewers.pop(id(redlock), None)
                        return
                continue
            self._renew_group_guarded(redlock, leases)

    def _renew_group_guarded(self, redlock: Redlock, leases: list[Lease]) -> None:
        try:
            self._renew_group(redlock, leases)
        except Exception:
            logger.exception("renewal of %d leases failed; retrying them shortly", len(leases))
            with contextlib.suppress(Exception):
                self._schedule_many((self._clock() + 0.05, lease) for lease in leases)

    def _renew_group(self, redlock: Redlock, leases: list[Lease]) -> None:
        """Renew the due ``leases`` of one client in one round."""
        renew: list[Lease] = []
        try:
            ttls = self._take_for_renewal(redlock, leases, renew)
        except BaseException:
            for lease in renew:  # never leave a lease's extension lock taken
                lease._ext_lock.release()
            raise
        if not renew:
            return
        sent = self._clock()
        margins = [lease.deadline - sent for lease in renew]
        try:
            outcomes = redlock._renew_many(renew, ttls)
        except Exception as exc:  # noqa: BLE001 - treated as a failed renewal
            logger.warning("renewal round failed: %s", exc)
            outcomes = [f"renewal round failed: {exc}"] * len(renew)
        finally:
            for lease in renew:
                lease._ext_lock.release()
        now = self._clock()
        renewed: list[Lease] = []
        renewed_margins: list[float] = []
        for lease, outcome, margin in zip(renew, outcomes, margins, strict=True):
            if lease.state != HELD:
                self.remove(lease)
            elif outcome == "ok":
                renewed.append(lease)
                renewed_margins.append(margin)
            elif outcome == "gone":
                self.remove(lease)
                lease._lose("a quorum of masters no longer knows this holder")
            else:
                self._retry(lease, now, outcome)
        self._schedule_many((now + lease.renew_every, lease) for lease in renewed)
        with self._cond:
            self.renewals += len(renewed)
        if renewed and events.listening("lock_renewed"):
            for lease, margin in zip(renewed, renewed_margins, strict=True):
                events.emit(
                    "lock_renewed", key=lease.key, lease=lease, took=now - sent, margin=margin
                )

    def _take_for_renewal(
        self, redlock: Redlock, leases: list[Lease], renew: list[Lease]
    ) -> list[float]:
        """Sort the due ``leases``: those to renew go to ``renew`` with their extension lock
        taken (the TTLs to ask for are returned); the others are lost, left to expire or
        tried again shortly."""
        now = self._clock()
        ttls: list[float] = []
        for lease in leases:
            if lease.state != HELD:
                self.remove(lease)
                continue
            ending = self._ending.get(id(lease))
            if ending is not None:
                if now >= lease.deadline:
                    self.remove(lease)
                    lease._lose(ending)
                else:
                    self._schedule(lease, lease.deadline)
                continue
            if now >= lease.deadline:
                # Its validity ended (renewals failed until now, or this thread ran
                # late): it already reads as not held, and stays so. A renewal now
                # could still find the key and bring it back, unannounced.
                self.remove(lease)
                lease._lose("could not renew before its validity ended: renewal came late")
                continue
            ttl = lease.ttl
            if lease.max_hold is not None:
                left = lease.acquired_at + lease.max_hold - now
                if left < ttl:
                    ttl = left
                if ttl <= redlock.node_timeout:
                    # max_hold reached: stop renewing; the lease expires on its own.
                    self._expire_at_deadline(lease, "max_hold reached")
                    continue
            if not lease._ext_lock.acquire(blocking=False):
                # Its holder is extending it right now: renew it a moment later.
                self._schedule(lease, now + BUSY_RETRY)
                continue
            renew.append(lease)
            ttls.append(ttl)
        return ttls

    def _retry(self, lease: Lease, now: float, error: str) -> None:
        remaining = lease.deadline - now
        retry_in = max(0.01, min(lease.renew_every / 2, remaining / 3))
        if retry_in >= remaining:  # no time for another try before the validity ends
            self.remove(lease)
            lease._lose(f"could not renew before its validity ended: {error}")
            return
        logger.info("renewal of %r failed (%s); retrying, %.3fs left", lease.key, error, remaining)
        self._schedule(lease, now + retry_in)

    def _expire_at_deadline(self, lease: Lease, reason: str) -> None:
        # No more renewals: the lease is marked lost when its validity ends, from this
        # thread's heap (a timer thread per lease would defeat one engine per process).
        with self._cond:
            self._ending[id(lease)] = reason
        self._schedule(lease, lease.deadline)

    def release_all(self, budget: float = EXIT_BUDGET) -> None:
        """Release every lease still held, within ``budget`` seconds (at exit)."""
        end = self._clock() + budget
        for lease in self.leases():
            if self._clock() >= end:
                logger.warning("exit: ran out of time releasing leases; the rest expire")
                return
            try:
                lease.release()
            except Exception:
                logger.debug("exit: could not release %r", lease.key, exc_info=True)


_engine: Heartbeat | None = None
#: engines of clients made with their own ``clock=`` (tests): a lease's deadline is a
#: time on its client's clock, so only an engine on that clock can tell when it is due
_clocked: dict[Callable[[], float], Heartbeat] = {}
_lock = threading.Lock()


def engine(clock: Callable[[], float] = time.monotonic) -> Heartbeat:
    """This process's renewal engine (for ``clock``), created on first use.

    Also starts its thread again when it died with leases waiting (see the module).
    """
    global _engine
    if clock is not time.monotonic:
        with _lock:
            found = _clocked.get(clock)
            if found is None or found._pid != process.pid():
                found = _clocked[clock] = Heartbeat(clock)
        found.ensure_running()
        return found
    if _engine is None or _engine._pid != process.pid():
        with _lock:
            if _engine is None or _engine._pid != process.pid():
                _engine = Heartbeat()
    if _engine._active and not _engine.alive():
        _engine.ensure_running()
    return _engine


def forget(lease: Lease) -> None:
    """Stop renewing ``lease`` (called by release before it deletes the keys)."""
    if not lease.auto_renew:
        return
    clock = lease.redlock._clock
    found = _engine if clock is time.monotonic else _clocked.get(clock)
    if found is not None:
        found.remove(lease)


def _after_fork_in_child() -> None:
    global _engine, _lock
    _engine = None
    _clocked.clear()
    _lock = threading.Lock()


def _at_exit() -> None:
    for found in (_engine, *_clocked.values()):
        if found is not None and found._pid == process.pid():
            found.release_all()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_at_exit)

"""Beat that never double-fires: a leader lease, and a quorum claim per occurrence.

Any number of beat processes (or ``celery worker -B``) may run. Each one, on
``beat_init``, wraps its scheduler's ``apply_entry`` and starts a
:class:`BeatLeader`: one of them holds the leader lease (renewed by the process's
heartbeat, on its own timer, not the scheduler's tick); the others stand by and
try to take it over a few times per lease TTL.

Before the leader sends an occurrence it claims ``(entry name, occurrence)`` on
the quorum; only a fresh claim is sent, so two beats that both believe they lead
for a moment still send it once. Interval entries are numbered from an anchor
stored on the quorum, not from each beat's local ``last_run_at``, and the local
schedule is realigned to that anchor after each send; crontab and other entries
are identified by the minute they are due.

Timeline of a failover (lease TTL 10 s)::

    t0   leader A renews every 3.3 s; B polls every 1 s: contended
    t1   A is SIGKILLed (its lease stays on the masters until ~t1 + 10 s)
    t1+9 the key expires; B's next poll takes the lease and B leads
    A paused (SIGSTOP) instead and resumed later: its lease validity ran out on
    its own monotonic clock, so it sends nothing, and a stale send is refused by
    the occurrence claim anyway.

The worker side (:class:`DropDuplicateOccurrences`) drops a message whose
occurrence already ran or runs elsewhere; a rescheduled duplicate would be a
double fire, so it is never rescheduled.
"""

from __future__ import annotations

import copy
import datetime as dt
import logging
import math
import os
import secrets
import socket
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from celery import bootsteps
from celery.schedules import schedule as interval_schedule
from celery.utils import uuid

from . import signals
from .client import redlock_for
from .exceptions import LockContended, QuorumUnavailable, RedlockError
from .lock import Lease, limits
from .redact import guard
from .settings import get_settings
from .task import drop_held_duplicate

__all__ = ["OCCURRENCE_HEADER", "BeatLeader", "DropDuplicateOccurrences", "guard_scheduler"]

logger = guard(logging.getLogger("celery_redlock.beat"))  # see celery_redlock.redact

#: Message header carrying the occurrence a beat message belongs to.
OCCURRENCE_HEADER = "redlock_occurrence"
CLAIM_SUFFIX = "sent"
RUN_SUFFIX = "run"
ANCHOR_SUFFIX = "anchor"
#: At most this many missed interval occurrences are sent after a takeover.
MAX_CATCH_UP = 100
#: Seconds by which a tick may come early and still name its slot (the aligned
#: ``last_run_at`` is rounded to the microsecond).
ALIGN_TOLERANCE = 1e-3
#: Anchors of interval entries live this long. A claim never refreshes an existing key,
#: and a new anchor renumbers the entry's occurrences (beats that cached the old one
#: disagree with those that did not), so it must outlive any deployment.
ANCHOR_TTL = 10 * 365 * 24 * 3600.0


class BeatLeader:
    """Holds, or waits for, the beat leader lease of one app."""

    def __init__(self, app: Any, *, lease_ttl: float, identity: str | None = None) -> None:
        self.app = app
        self.redlock = redlock_for(app)
        self.lease_ttl = lease_ttl
        self.key = f"beat:leader:{app.main or 'celery'}"
        # Unique per process even where hostname and pid repeat (containers: pid 1), since
        # a claim holding our identity is taken for ours.
        self.identity = identity or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.lease: Lease | None = None
        self.status = "standby"
        #: wall time we last saw another leader alive (our acquire was contended);
        #: after a takeover, interval occurrences due since then are caught up
        self.other_leader_seen: float | None = None
        #: bumped on each takeover, so each entry catches up once per takeover
        self.term = 0
        self.poll_interval = min(1.0, lease_ttl / 10)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()

    @property
    def leading(self) -> bool:
        """True while this beat holds a valid leader lease (answered locally)."""
        lease = self.lease
        return lease is not None and lease.held

    def is_leading(self) -> bool:
        """:attr:`leading`, as a method (it is re-read, never cached)."""
        return self.leading

    def start(self) -> None:
        """Try to lead at once, then keep watching from a daemon thread."""
        self._try_lead()
        logger.info(
            "beat: celery-redlock leader election on %s (quorum %d): %s",
            self.redlock.master_names,
            self.redlock.quorum,
            "LEADER" if self.leading else "standby",
        )
        self._thread = threading.Thread(target=self._watch, name="redlock-beat-leader", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()

    def _set_status(self, status: str) -> None:
        with self._mutex:
            previous, self.status = self.status, status
        if previous != status:
            log = logger.warning if status == "standby" else logger.info
            log("beat: %s -> %s (%s)", previous, status, self.identity)
            signals.beat_status.send(sender=self, status=status, previous=previous)

    def _try_lead(self) -> None:
        try:
            lease = self.redlock.acquire(
                self.key,
                self.lease_ttl,
                auto_renew=True,
                meta={"beat": self.identity},
            )
        except LockContended:
            self.other_leader_seen = time.time()  # noqa: TID251 - compared with due times
            return
        except QuorumUnavailable as exc:
            logger.warning("beat: cannot reach a quorum to lead: %s", exc)
            return
        lease.on_lost(lambda lost: self._set_status("standby"))
        self.lease = lease
        self.term += 1
        self._set_status("leader")

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_interval):
            if self.leading:
                continue
            if self.status == "leader":
                self._set_status("standby")
            self._try_lead()


def _guard_window(lease_ttl: float) -> float:
    """How long an occurrence claim guards "sent once" against a master restart.

    A beat claims an occurrence when it falls due, or (catching up after a takeover)
    within the window it looks back over: a few lease periods. A restarted master that
    lost the claim is kept out of the quorum that long (restart quarantine), not for the
    claim's whole TTL (an hour or more, kept only to let workers drop a second delivery).
    """
    poll_interval = min(1.0, lease_ttl / 10)  # as BeatLeader's
    return min(limits.MAX_TTL, 4 * (lease_ttl + 2 * poll_interval))


def occurrence_of(
    redlock: Any, entry: Any, now: dt.datetime, anchors: dict[str, tuple[float, float]]
) -> tuple[str, float | None]:
    """Identify the occurrence of ``entry`` due at ``now``.

    Returns ``(occurrence id, aligned due timestamp or None)``. Interval entries
    are numbered from an anchor claimed on the quorum; others use the minute.
    """
    schedule = entry.schedule
    timestamp = now.timestamp()
    if _numbered(schedule):
        interval = schedule.run_every.total_seconds()
        if interval > 0:
            cached = anchors.get(entry.name)
            if cached is None or cached[1] != interval:
                holder, _ = redlock.claim(
                    f"beat:{entry.name}",
                    f"{ANCHOR_SUFFIX}:{interval:g}",
                    f"{timestamp:.6f}",
                    max(ANCHOR_TTL, 100 * interval),
                    guard_for=0,
                )
                cached = (float(holder), interval)
                anchors[entry.name] = cached
            anchor = cached[0]
            # The latest slot due at ``now``: Celery never runs an entry early, only late,
            # so a tick late by up to a whole interval still names the slot that fell due
            # (round() would skip one once a loaded beat is half an interval late). The
            # tolerance absorbs the microsecond rounding of the aligned ``last_run_at``.
            index = math.floor((timestamp - anchor + ALIGN_TOLERANCE) / interval)
            return f"{entry.name}#{index}", anchor + index * interval
    return _minute_occurrence(entry.name, timestamp), None


def _numbered(schedule: Any) -> bool:
    """Whether ``schedule``'s occurrences are numbered from an anchor (interval entries)."""
    return isinstance(schedule, interval_schedule) and type(schedule).__name__ != "clocked"


def _minute_occurrence(name: str, timestamp: float) -> str:
    """The id of a crontab (or other non-interval) occurrence: its entry and UTC minute."""
    minute = math.floor(timestamp / 60) * 60
    return f"{name}@{dt.datetime.fromtimestamp(minute, dt.timezone.utc):%Y-%m-%dT%H:%MZ}"


def guard_scheduler(scheduler: Any, leader: BeatLeader) -> None:
    """Wrap ``scheduler.apply_entry``: only the leader sends, each occurrence once."""
    original: Callable[..., Any] = scheduler.apply_entry
    redlock = leader.redlock
    settings = get_settings(leader.app)
    anchors: dict[str, tuple[float, float]] = {}
    caught_up: dict[str, int] = {}
    #: per interval entry, the highest occurrence index this beat has sent
    last_sent: dict[str, int] = {}
    #: per entry, the entry reserve() returned: the one the next tick runs. The base
    #: Scheduler also stores it in .schedule; django-celery-beat's DatabaseScheduler does
    #: not (its .schedule keeps the entry just sent), so _align needs it from here.
    reserved: dict[str, Any] = {}
    original_reserve: Callable[..., Any] = scheduler.reserve

    #: per entry, (the upcoming entry, its aligned due time), for the heap slot the tick
    #: pushes right after apply_entry returns
    realigned: dict[str, tuple[Any, float]] = {}
    original_when: Callable[..., Any] = scheduler._when
    original_tick: Callable[..., Any] = scheduler.tick
    #: per crontab (non-interval) entry, the last occurrence this beat let pass while it
    #: stood by: (entry, occurrence id, wall time it fell due). A standby's scheduler moves
    #: past a due entry like a leader's, so after a takeover this is how the new leader
    #: knows which occurrence fell due while the old leader's lease ran out.
    passed: dict[str, tuple[Any, str, float]] = {}
    #: the leader term whose crontab catch-up has run
    crontab_term: list[int] = [0]

    def reserve(self: Any, entry: Any) -> Any:
        upcoming = original_reserve(entry)
        reserved[entry.name] = upcoming
        return upcoming

    def _when(self: Any, entry: Any, next_time_to_run: Any, *args: Any, **kwargs: Any) -> Any:
        # Celery >= 5.5 ticks an entry when its heap slot comes (now + interval at the
        # last send), whatever its last_run_at says: time the slot from the anchor too.
        pending = realigned.get(getattr(entry, "name", ""))
        if pending is not None and pending[0] is entry:
            del realigned[entry.name]
            next_time_to_run = max(0.0, pending[1] - time.time())  # noqa: TID251 - wall
        return original_when(entry, next_time_to_run, *args, **kwargs)

    def realign(self: Any, entry: Any, aligned: float) -> None:
        upcoming = reserved.get(entry.name)
        _align(self, entry, aligned, upcoming)
        if upcoming is not None and upcoming is not entry:
            every = entry.schedule.run_every.total_seconds()
            realigned[entry.name] = (upcoming, aligned + every)

    def tick(self: Any, *args: Any, **kwargs: Any) -> Any:
        if leader.leading and crontab_term[0] != leader.term:
            crontab_term[0] = leader.term
            _catch_up_passed()
        return original_tick(*args, **kwargs)

    def apply_entry(self: Any, entry: Any, producer: Any = None) -> Any:
        if not leader.leading:
            logger.debug("beat standby: not sending %s", entry.name)
            if not _numbered(getattr(entry, "schedule", None)):
                due = time.time()  # noqa: TID251 - occurrences are named by wall time
                passed[entry.name] = (entry, _minute_occurrence(entry.name, due), due)
            return None
        now = (
            entry.default_now()
            if hasattr(entry, "default_now")
            else dt.datetime.now(dt.timezone.utc)
        )
        try:
            occurrence, aligned = occurrence_of(redlock, entry, now, anchors)
            claim_ttl = _claim_ttl(entry)
            holder, fresh = redlock.claim(
                f"beat:{occurrence}",
                CLAIM_SUFFIX,
                leader.identity,
                claim_ttl,
                guard_for=_guard_window(leader.lease_ttl),
            )
        except RedlockError as exc:
            _not_sent(entry.name, None, f"cannot claim it: {exc}")
            return None
        if not leader.is_leading():
            redlock.unclaim(f"beat:{occurrence}", CLAIM_SUFFIX, leader.identity)
            _not_sent(entry.name, occurrence, "lost the leader lease while claiming it")
            return None
        if holder != leader.identity or not fresh:
            logger.info("beat: occurrence %s already sent by %s", occurrence, holder)
            if aligned is not None:
                # Realign anyway: a new leader whose local schedule runs just before the
                # slots would otherwise name the slot already sent, and send the next one
                # almost a whole interval late.
                realign(self, entry, aligned)
            return None
        if aligned is not None:
            realign(self, entry, aligned)
            index = int(occurrence.rpartition("#")[2])
            last = last_sent.get(entry.name)
            window = leader.lease_ttl + 2 * leader.poll_interval
            if caught_up.get(entry.name) != leader.term:
                caught_up[entry.name] = leader.term
                # After a takeover: what fell due while the old leader's lease ran out.
                # Only then: a beat that starts when no leader was ever seen runs an
                # entry once, like Celery.
                seen = leader.other_leader_seen
                if seen is not None:
                    _catch_up(entry, index, aligned, claim_ttl, producer, seen - window)
            elif last is not None and index > last + 1:
                # A gap in our own term: a claim that failed (a timeout, a short outage)
                # or a tick that stalled for over an interval. Bounded like a failover
                # (plus the interval), so a long outage does not end in a burst.
                every = entry.schedule.run_every.total_seconds()
                oldest = time.time() - every - window  # noqa: TID251 - due times are wall
                _catch_up(entry, index, aligned, claim_ttl, producer, oldest)
            last_sent[entry.name] = max(index, last if last is not None else index)
        return original(_tagged(entry, occurrence), producer=producer)

    def _catch_up(
        entry: Any,
        index: int,
        aligned: float,
        claim_ttl: float,
        producer: Any,
        oldest: float,
    ) -> None:
        # Walk back over the interval occurrences due since ``oldest``, down to the last
        # one somebody sent (or this beat sent); claim and send the ones nobody sent.
        name = entry.name
        interval = entry.schedule.run_every.total_seconds()
        last = last_sent.get(name)
        missed: list[tuple[str, str | None]] = []
        for back in range(1, MAX_CATCH_UP + 1):
            if aligned - back * interval < oldest or (last is not None and index - back <= last):
                break
            earlier = f"{name}#{index - back}"
            outcome = _claim_missed(name, earlier, claim_ttl)
            if outcome is None:
                break
            missed.append(outcome)
            if outcome[1] is not None:
                break  # the old leader claimed this one, and every one before it
        for earlier, task_id in reversed(missed):
            _send_missed(entry, earlier, task_id, producer)

    def _claim_ttl(entry: Any) -> float:
        # redlock_dedupe_ttl, or three intervals (three minutes for crontab entries).
        interval = getattr(getattr(entry, "schedule", None), "run_every", None)
        return max(settings.dedupe_ttl, 3 * (interval.total_seconds() if interval else 60.0))

    def _not_sent(name: str, occurrence: str | None, reason: str) -> None:
        # Nothing is dropped silently: a warning and the signal, wherever it happens.
        logger.warning("beat: not sending %s: %s", occurrence or name, reason)
        signals.beat_not_sent.send(sender=leader, entry=name, occurrence=occurrence, reason=reason)

    def _claim_missed(
        name: str, occurrence: str, claim_ttl: float
    ) -> tuple[str, str | None] | None:
        """Claim an occurrence nobody may have sent: what to send, or None for nothing.

        ``(occurrence, None)``: ours (fresh, or ours from a claim whose reply was lost),
        send it. ``(occurrence, task_id)``: another beat (the old leader) claimed it but
        may have died between its claim and its publish; no worker has taken it, so send
        it again as ``task_id``, whose run is claimed: a worker drops the old leader's
        copy if it was sent after all. None: unreachable masters, or somebody sent it and
        a worker took it.
        """
        try:
            holder, _ = redlock.claim(
                f"beat:{occurrence}",
                CLAIM_SUFFIX,
                leader.identity,
                claim_ttl,
                guard_for=_guard_window(leader.lease_ttl),
            )
        except RedlockError as exc:
            _not_sent(name, occurrence, f"cannot claim it (missed): {exc}")
            return None
        if holder == leader.identity:
            return occurrence, None
        task_id = _claim_run(name, occurrence)
        return None if task_id is None else (occurrence, task_id)

    def _send_missed(entry: Any, occurrence: str, task_id: str | None, producer: Any) -> None:
        if task_id is None:
            logger.warning("beat: sending %s late: nobody sent it when it fell due", occurrence)
        else:
            logger.warning(
                "beat: sending %s again: no worker has it (its sender may have died "
                "before publishing it; a worker drops a second copy)",
                occurrence,
            )
        original(_tagged(entry, occurrence, task_id), producer=producer)

    def _catch_up_passed() -> None:
        # After a takeover: crontab occurrences this beat let pass as a standby while the
        # old leader's lease ran out (interval entries catch up in apply_entry instead).
        seen = leader.other_leader_seen
        if seen is None:
            return
        oldest = seen - (leader.lease_ttl + 2 * leader.poll_interval)
        for name, (entry, occurrence, due) in list(passed.items()):
            del passed[name]
            if due < oldest:
                continue
            outcome = _claim_missed(name, occurrence, _claim_ttl(entry))
            if outcome is not None:
                _send_missed(entry, *outcome, None)

    def _claim_run(name: str, occurrence: str) -> str | None:
        task_id = uuid()
        try:
            holder, fresh = redlock.claim(
                f"beat:{occurrence}",
                RUN_SUFFIX,
                task_id,
                settings.dedupe_ttl,
                guard_for=_guard_window(leader.lease_ttl),
            )
        except RedlockError as exc:
            _not_sent(name, occurrence, f"cannot claim its run: {exc}")
            return None
        return task_id if holder == task_id and fresh else None

    scheduler.apply_entry = types.MethodType(apply_entry, scheduler)
    scheduler.reserve = types.MethodType(reserve, scheduler)
    scheduler._when = types.MethodType(_when, scheduler)
    scheduler.tick = types.MethodType(tick, scheduler)


def _tagged(entry: Any, occurrence: str, task_id: str | None = None) -> Any:
    """A shallow copy of ``entry`` whose message carries the occurrence header."""
    try:
        # Not copy.copy(): it rebuilds through ScheduleEntry.__reduce__, whose arguments
        # django-celery-beat's ModelEntry.__init__(model, app) does not take (TypeError).
        sent = object.__new__(type(entry))
        sent.__dict__.update(vars(entry))
    except TypeError:  # no __dict__
        sent = copy.copy(entry)
    options = dict(entry.options or {})
    headers = dict(options.get("headers") or {})
    headers[OCCURRENCE_HEADER] = occurrence
    options["headers"] = headers
    if task_id is not None:
        options["task_id"] = task_id
    sent.options = options
    return sent


def _align(scheduler: Any, entry: Any, aligned: float, upcoming: Any = None) -> None:
    """Make the next local due time follow the quorum anchor, not this beat's drift."""
    try:
        if upcoming is None:
            upcoming = scheduler.schedule.get(entry.name)
        if upcoming is None or upcoming is entry:
            return
        last = upcoming.last_run_at
        tz = last.tzinfo if isinstance(last, dt.datetime) and last.tzinfo else dt.timezone.utc
        upcoming.last_run_at = dt.datetime.fromtimestamp(aligned, tz)
        if isinstance(last, dt.datetime) and last.tzinfo is None:
            upcoming.last_run_at = upcoming.last_run_at.replace(tzinfo=None)
    except Exception:
        logger.debug("beat: could not align %s", entry.name, exc_info=True)


def on_beat_init(service: Any) -> BeatLeader | None:
    """Set up leadership for the beat ``service`` (called from the beat_init handler)."""
    app = service.app
    settings = get_settings(app)
    if not settings.beat_leader:
        logger.info("beat: redlock_beat_leader is off; every beat sends (no claims)")
        return None
    leader = BeatLeader(app, lease_ttl=settings.beat_lease_ttl)
    guard_scheduler(service.scheduler, leader)
    leader.start()
    return leader


def is_duplicate_occurrence(app: Any, occurrence: str, task_id: str) -> bool:
    """Claim the run of ``occurrence`` for ``task_id``; True if it ran or runs already.

    Only a message with another task id is a duplicate: the same task id is the same
    job coming back (its own ``retry()``, a contention or outage reschedule, a
    redelivery), which keeps the id and the headers. Masters unavailable: not a
    duplicate (the task's own lock, if any, still guards it).
    """
    redlock = redlock_for(app)
    try:
        settings = get_settings(app)
        holder, _ = redlock.claim(
            f"beat:{occurrence}",
            RUN_SUFFIX,
            task_id,
            settings.dedupe_ttl,
            guard_for=_guard_window(settings.beat_lease_ttl),
        )
    except RedlockError as exc:
        logger.warning("cannot check beat occurrence %s: %s; running it", occurrence, exc)
        return False
    return holder != task_id


class DropDuplicateOccurrences(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: drop a beat message whose occurrence already ran or runs,
    and a skip-on-contention job whose key is locked (:func:`drop_held_duplicate`).

    Celery's signals cannot stop a task, so this wraps the consumer's task
    strategies; a message of a plain task costs a few dict lookups.
    """

    name = "celery_redlock.drop_duplicate_occurrences"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        for name, strategy in list(c.strategies.items()):
            if not getattr(strategy, "_redlock_wrapped", False):
                c.strategies[name] = _wrap_strategy(
                    c.app, name, strategy, tuple(getattr(c, "connection_errors", ()) or ())
                )


def _wrap_strategy(
    app: Any, name: str, strategy: Callable[..., Any], connection_errors: tuple[Any, ...] = ()
) -> Callable[..., Any]:
    recent: dict[str, float] = {}  # keys of this task just dispatched

    def handler(
        message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kwargs: Any
    ) -> Any:
        headers = getattr(message, "headers", None) or {}
        occurrence = headers.get(OCCURRENCE_HEADER)
        if occurrence:
            task_id = headers.get("id") or ""
            if is_duplicate_occurrence(app, occurrence, task_id):
                logger.warning(
                    "%s[%s]: beat occurrence %s already ran; dropped", name, task_id, occurrence
                )
                signals.duplicate_dropped.send(
                    sender=app.tasks.get(name),
                    key=occurrence,
                    task_id=task_id,
                    stage="worker",
                    existing_id=None,
                )
                # The consumer hands strategies ``message.ack_log_error`` (wrapped in a
                # promise), which takes (logger, connection_errors) like Request.acknowledge
                # passes them; a bare ack() raises TypeError in the event loop and kills
                # the worker.
                ack(logger, connection_errors)
                return None
        elif drop_held_duplicate(app.tasks.get(name), message, headers, recent):
            ack(logger, connection_errors)
            return None
        return strategy(message, body, ack, reject, callbacks, **kwargs)

    handler._redlock_wrapped = True  # type: ignore[attr-defined]
    return handler

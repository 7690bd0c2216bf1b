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
are identified by the minute they are due. Every key is namespaced by the app's main
name (:func:`beat_namespace`), so apps sharing masters never share claims.

After a takeover (or an outage, or claims that failed), the missed occurrences of
an entry are found by walking the claims back from the latest one due, the same
window whichever beat leads, and go out as ``redlock_beat_catch_up`` says: by
default one late send standing for all of them, never a burst.

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

from . import signals
from .client import redlock_for
from .exceptions import ImproperlyConfigured, LockContended, QuorumUnavailable, RedlockError
from .lock import Lease, limits
from .redact import guard
from .settings import get_settings
from .task import drop_held_duplicate

__all__ = [
    "ANCHOR_SUFFIX",
    "CATCH_UP_HEADER",
    "CATCH_UP_OF_HEADER",
    "OCCURRENCE_HEADER",
    "OPT_OUT_OPTION",
    "BeatLeader",
    "DropDuplicateOccurrences",
    "anchor_key",
    "beat_namespace",
    "beat_status",
    "claim_occurrences",
    "guard_scheduler",
    "is_anchor_key",
    "occurrence_key",
]

logger = guard(logging.getLogger("celery_redlock.beat"))  # see celery_redlock.redact

#: Message header carrying the occurrence a beat message belongs to.
OCCURRENCE_HEADER = "redlock_occurrence"
#: Header of a coalesced late send: how many occurrences it stands for (absent: one).
CATCH_UP_HEADER = "redlock_catch_up"
#: Header of a coalesced late send: the other occurrences it stands for, newest first.
#: The worker keeps those no other message ran (:func:`claim_occurrences`) and rewrites
#: this header, :data:`CATCH_UP_HEADER` and :data:`OCCURRENCE_HEADER` to what it won.
CATCH_UP_OF_HEADER = "redlock_catch_up_of"
#: Message header: how long the occurrence's claims live (the entry's claim TTL), so the
#: worker's run claim lives as long as the beat's send claim: a run claim gone before it
#: would let a new leader take the occurrence for unsent and send it again.
CLAIM_TTL_HEADER = "redlock_claim_ttl"
#: Entry option (``options={"redlock_beat": False}``): every beat sends this entry on its
#: own schedule, with no leader and no claims (as plain Celery beat; N beats, N sends).
OPT_OUT_OPTION = "redlock_beat"
CLAIM_SUFFIX = "sent"
RUN_SUFFIX = "run"
ANCHOR_SUFFIX = "anchor"
#: At most this many missed occurrences of one entry are looked back over (and, with
#: ``redlock_beat_catch_up = "all"``, sent) after a takeover or an outage.
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
        self.namespace = beat_namespace(app)
        self.key = leader_key(self.namespace)
        # Unique per process even where hostname and pid repeat (containers: pid 1), since
        # a claim holding our identity is taken for ours.
        self.identity = identity or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.lease: Lease | None = None
        self.status = "standby"
        #: bumped on each takeover, so each entry catches up once per takeover
        self.term = 0
        #: monotonic time since which no beat could lead (quorum unreachable), or None
        self.no_leader_since: float | None = None
        self._no_leader_logged = -math.inf
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
            signals.beat_status.send(
                sender=self, status=status, previous=previous, identity=self.identity
            )

    def _try_lead(self) -> None:
        try:
            lease = self.redlock.acquire(
                self.key,
                self.lease_ttl,
                auto_renew=True,
                meta={"beat": self.identity},
            )
        except LockContended:
            self.no_leader_since = None  # somebody leads
            return
        except QuorumUnavailable as exc:
            self._no_leader(exc)
            return
        self.no_leader_since = None
        lease.on_lost(lambda lost: self._set_status("standby"))
        self.lease = lease
        self.term += 1
        self._set_status("leader")

    def _no_leader(self, exc: QuorumUnavailable) -> None:
        """No quorum, no leader, no send (never a double fire), but loudly: once it has
        lasted a lease period (every lease ran out: no beat leads), an ERROR and
        ``beat_no_leader`` once per lease period while it lasts."""
        now = time.monotonic()
        if self.no_leader_since is None:
            self.no_leader_since = now
            logger.warning("beat: cannot reach a quorum to lead: %s", exc)
        # A blip shorter than a lease period leaves the leader leading: no alarm yet.
        if now - self.no_leader_since < self.lease_ttl:
            return
        if now - self._no_leader_logged < self.lease_ttl:
            return
        self._no_leader_logged = now
        down_for = now - self.no_leader_since
        logger.error(
            "beat: NO LEADER for %.0f s: cannot reach a quorum of the masters, so no beat "
            "entry is sent (entries with options={'redlock_beat': False} excepted): %s",
            down_for,
            exc,
        )
        signals.beat_no_leader.send(sender=self, reason=str(exc), down_for=down_for)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_interval):
            if self.leading:
                continue
            if self.status == "leader":
                self._set_status("standby")
            self._try_lead()


def leader_key(namespace: str) -> str:
    """The leader lease's key (before prefix) of the beats of ``namespace``."""
    return f"beat:leader:{namespace}"


def beat_status(app: Any) -> dict[str, Any]:
    """Beat leadership of ``app`` as the masters see it (for ``celery redlock check``).

    Returns ``{"namespace", "key", "state", "leader", "detail"}``; ``state`` is ``"led"``
    (a beat holds the leader lease on a quorum), ``"no leader"`` (none does: no beat runs,
    or one is taking over) or ``"unreachable"`` (too few masters answer: no beat can lead,
    so no guarded entry is sent); ``leader`` is the leading beat's identity
    (``host:pid:random``, as its log lines and ``beat_status`` signal name it), else None.
    Never raises for unreachable masters.
    """
    namespace = beat_namespace(app)
    key = leader_key(namespace)
    redlock = redlock_for(app)
    try:
        led = redlock.locked(key)
        found = redlock.holder(key, ("beat",)) if led else None
    except QuorumUnavailable as exc:
        return {
            "namespace": namespace,
            "key": key,
            "state": "unreachable",
            "leader": None,
            "detail": str(exc),
        }
    leader = found[1]["beat"] or None if found is not None else None
    if led:
        detail = f"beat {leader} holds the leader lease" if leader else "a beat leads"
    else:
        detail = "no beat holds the leader lease: no beat runs, or a takeover is under way"
    return {
        "namespace": namespace,
        "key": key,
        "state": "led" if led else "no leader",
        "leader": leader,
        "detail": detail,
    }


def _guard_window(lease_ttl: float) -> float:
    """How long an occurrence claim guards "sent once" against a master restart.

    A beat claims an occurrence when it falls due, or (catching up after a takeover)
    within the window it looks back over: a few lease periods. A restarted master that
    lost the claim is kept out of the quorum that long (restart quarantine), not for the
    claim's whole TTL (an hour or more, kept only to let workers drop a second delivery).
    """
    poll_interval = min(1.0, lease_ttl / 10)  # as BeatLeader's
    return min(limits.MAX_TTL, 4 * (lease_ttl + 2 * poll_interval))


def beat_namespace(app: Any) -> str:
    """The namespace of every beat key of ``app``: its ``main`` name (``Celery("proj")``).

    Apps sharing masters and a key prefix never share leader leases, occurrence claims
    or anchors as long as their names differ.
    """
    return str(getattr(app, "main", None) or "celery")


def occurrence_key(namespace: str, occurrence: str) -> str:
    """The claim key (before prefix and suffix) of ``occurrence`` in ``namespace``."""
    return f"beat:{namespace}:{occurrence}"


def anchor_key(namespace: str, entry_name: str) -> str:
    """The key (before prefix) whose ``anchor:<interval>`` companions number an entry.

    The Redis key is ``<prefix>:{beat:<namespace>:<entry>}:anchor:<interval seconds>``;
    :func:`is_anchor_key` recognises one (``celery redlock clear --all`` keeps them).
    """
    return f"beat:{namespace}:{entry_name}"


def is_anchor_key(name: str | bytes) -> bool:
    """Whether the Redis key ``name`` is an interval entry's anchor (new or old layout)."""
    text = name.decode() if isinstance(name, bytes) else name
    head, sep, suffix = text.rpartition("}:")
    return bool(sep) and "{beat:" in head and suffix.startswith(f"{ANCHOR_SUFFIX}:")


def occurrence_of(
    redlock: Any,
    entry: Any,
    now: dt.datetime,
    anchors: dict[str, tuple[float, float]],
    namespace: str = "celery",
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
            anchor = _anchor(redlock, entry.name, interval, timestamp, anchors, namespace)[0]
            # The latest slot due at ``now``: Celery never runs an entry early, only late,
            # so a tick late by up to a whole interval still names the slot that fell due
            # (round() would skip one once a loaded beat is half an interval late). The
            # tolerance absorbs the microsecond rounding of the aligned ``last_run_at``.
            index = math.floor((timestamp - anchor + ALIGN_TOLERANCE) / interval)
            return f"{entry.name}#{index}", anchor + index * interval
    return _minute_occurrence(entry.name, timestamp), None


def _anchor(
    redlock: Any,
    name: str,
    interval: float,
    timestamp: float,
    anchors: dict[str, tuple[float, float]],
    namespace: str,
) -> tuple[float, bool]:
    """The entry's anchor on the quorum (claimed at ``timestamp`` if none), and whether
    this call created it."""
    cached = anchors.get(name)
    if cached is not None and cached[1] == interval:
        return cached[0], False
    holder, fresh = redlock.claim(
        anchor_key(namespace, name),
        f"{ANCHOR_SUFFIX}:{interval:g}",
        f"{timestamp:.6f}",
        max(ANCHOR_TTL, 100 * interval),
        guard_for=0,
    )
    anchors[name] = (float(holder), interval)
    return float(holder), fresh


def _numbered(schedule: Any) -> bool:
    """Whether ``schedule``'s occurrences are numbered from an anchor (interval entries)."""
    return isinstance(schedule, interval_schedule) and type(schedule).__name__ != "clocked"


def _minute_occurrence(name: str, timestamp: float) -> str:
    """The id of a crontab (or other non-interval) occurrence: its entry and UTC minute."""
    minute = math.floor(timestamp / 60) * 60
    return f"{name}@{dt.datetime.fromtimestamp(minute, dt.timezone.utc):%Y-%m-%dT%H:%MZ}"


def _opted_out(entry: Any) -> bool:
    """An entry with ``options={"redlock_beat": False}`` is sent by every beat, unguarded."""
    return (getattr(entry, "options", None) or {}).get(OPT_OUT_OPTION) is False


def _index(occurrence: str) -> int:
    return int(occurrence.rpartition("#")[2])


def guard_scheduler(scheduler: Any, leader: BeatLeader) -> None:
    """Wrap ``scheduler.apply_entry``: only the leader sends, each occurrence once.

    Missed occurrences (after a takeover, after an outage, after claims that failed) are
    found the same way by every beat: walking back from the latest one due, claiming
    each on the quorum, down to the first one a worker took (at most
    :data:`MAX_CATCH_UP`, and no further back than a claim lives); one another beat
    claimed but no worker took is listed too (its beat may have died before sending it),
    and the worker's run claims decide which message stands for it. What is done with
    them is ``redlock_beat_catch_up``: ``"one"`` sends the latest, once, standing for all
    of them (logged with the count; header ``redlock_catch_up``), ``"all"`` sends each,
    ``"none"`` sends none (logged). The walk's claims are what makes the window the
    same for a standby that takes over and for an old leader that wins its lease back.
    """
    original: Callable[..., Any] = scheduler.apply_entry
    redlock = leader.redlock
    settings = get_settings(leader.app)
    namespace = leader.namespace
    mode = settings.beat_catch_up
    anchors: dict[str, tuple[float, float]] = {}
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
    #: per crontab (non-interval) entry, the occurrences this beat let pass (standing by,
    #: or leading without a quorum), oldest first, at most MAX_CATCH_UP: (entry, occurrence
    #: id, wall time it fell due). A standby's scheduler moves past a due entry like a
    #: leader's, so after a takeover this is how the new leader knows what fell due.
    passed: dict[str, list[tuple[Any, str, float]]] = {}
    #: the leader term whose catch-up has run
    caught_up_term: list[int] = [0]
    #: per interval entry, (latest missed index, how many) a takeover left to the next
    #: on-time send because that one was due within a moment (no two sends in a row)
    carried: dict[str, tuple[int, list[str]]] = {}

    def reserve(self: Any, entry: Any) -> Any:
        model = getattr(entry, "model", None)
        count = getattr(model, "total_run_count", None)
        upcoming = original_reserve(entry)
        reserved[entry.name] = upcoming
        if not leader.leading and not _opted_out(entry):
            _keep_local(self, entry.name, model, count)
        return upcoming

    def _when(self: Any, entry: Any, next_time_to_run: Any, *args: Any, **kwargs: Any) -> Any:
        # Celery >= 5.5 ticks an entry when its heap slot comes (now + interval at the
        # last send), whatever its last_run_at says: time the slot from the anchor too.
        pending = realigned.get(getattr(entry, "name", ""))
        if pending is not None and pending[0] is entry:
            del realigned[entry.name]
            next_time_to_run = max(0.0, pending[1] - _wall())
        return original_when(entry, next_time_to_run, *args, **kwargs)

    def realign(self: Any, entry: Any, aligned: float) -> None:
        upcoming = reserved.get(entry.name)
        _align(self, entry, aligned, upcoming)
        if upcoming is not None and upcoming is not entry:
            every = entry.schedule.run_every.total_seconds()
            realigned[entry.name] = (upcoming, aligned + every)

    def tick(self: Any, *args: Any, **kwargs: Any) -> Any:
        if leader.leading and caught_up_term[0] != leader.term:
            caught_up_term[0] = leader.term
            _catch_up_takeover(self)
        return original_tick(*args, **kwargs)

    def _pass(entry: Any) -> None:
        if _numbered(getattr(entry, "schedule", None)):
            return  # interval occurrences are found again from the anchor
        due = _wall()
        kept = passed.setdefault(entry.name, [])
        occurrence = _minute_occurrence(entry.name, due)
        if not kept or kept[-1][1] != occurrence:
            kept.append((entry, occurrence, due))
            del kept[:-MAX_CATCH_UP]

    def apply_entry(self: Any, entry: Any, producer: Any = None) -> Any:
        if _opted_out(entry):
            return original(_without_opt_out(entry), producer=producer)
        if not leader.leading:
            logger.debug("beat standby: not sending %s", entry.name)
            _pass(entry)
            return None
        now = (
            entry.default_now()
            if hasattr(entry, "default_now")
            else dt.datetime.now(dt.timezone.utc)
        )
        try:
            occurrence, aligned = occurrence_of(redlock, entry, now, anchors, namespace)
            claim_ttl = _claim_ttl(entry)
            holder, fresh = redlock.claim(
                occurrence_key(namespace, occurrence),
                CLAIM_SUFFIX,
                leader.identity,
                claim_ttl,
                guard_for=_guard_window(leader.lease_ttl),
            )
        except RedlockError as exc:
            _pass(entry)
            _not_sent(entry.name, None, f"cannot claim it: {exc}")
            return None
        if not leader.is_leading():
            try:
                redlock.unclaim(
                    occurrence_key(namespace, occurrence), CLAIM_SUFFIX, leader.identity
                )
            except RedlockError as exc:  # the next leader finds it claimed, no run: re-sends
                logger.warning("beat: claim on %s not withdrawn: %s", occurrence, exc)
            _pass(entry)
            _not_sent(entry.name, occurrence, "lost the leader lease while claiming it")
            return None
        if (holder != leader.identity or not fresh) and not _unsent_by_other(
            entry.name, occurrence, holder
        ):
            logger.info("beat: occurrence %s already sent by %s", occurrence, holder)
            if aligned is not None:
                # Realign anyway: a new leader whose local schedule runs just before the
                # slots would otherwise name the slot already sent, and send the next one
                # almost a whole interval late.
                realign(self, entry, aligned)
                last_sent[entry.name] = max(_index(occurrence), last_sent.get(entry.name, -1))
            return None
        missed: list[str] = []
        if aligned is not None:
            realign(self, entry, aligned)
            index = _index(occurrence)
            last = last_sent.get(entry.name)
            if last is not None and index > last + 1:
                # A gap in our own term: claims that failed (a timeout, a short outage)
                # or a tick that stalled for over an interval.
                missed = _walk(entry.name, _interval_ids(entry, index - 1, last + 1))
            last_sent[entry.name] = max(index, last if last is not None else index)
            held_over = carried.pop(entry.name, None)
            if held_over is not None and index > held_over[0]:
                missed += held_over[1]
        elif passed.get(entry.name):
            earlier = [o for _, o, due in passed.pop(entry.name) if _fresh_enough(entry, due)]
            missed = _walk(entry.name, [o for o in reversed(earlier) if o != occurrence])
        return _deliver(entry, occurrence, missed, producer)

    def _deliver(entry: Any, current: str | None, missed: list[str], producer: Any) -> Any:
        """Send ``current`` (or, at a takeover, the latest missed) by ``mode``.

        ``missed`` are occurrences nobody sent or ran, newest first (see ``_walk``). A
        coalesced send lists the others it stands for (header ``redlock_catch_up_of``);
        the worker that gets it keeps those no other message ran
        (:func:`claim_occurrences`).
        """
        name = entry.name
        if mode == "all":
            if len(missed) >= MAX_CATCH_UP:
                logger.warning(
                    "beat: %s: catching up at most %d missed occurrences (older ones skipped)",
                    name,
                    MAX_CATCH_UP,
                )
            for occurrence in reversed(missed):
                logger.warning("beat: sending %s late: nobody sent it when it fell due", occurrence)
                original(_tagged(entry, occurrence, claim_ttl=_claim_ttl(entry)), producer=producer)
            return (
                None
                if current is None
                else original(
                    _tagged(entry, current, claim_ttl=_claim_ttl(entry)), producer=producer
                )
            )
        if mode == "none" or (current is None and not missed):
            if missed:
                _not_sent(
                    name,
                    missed[0],
                    f"missed {len(missed)} occurrence(s) ({missed[-1]} .. {missed[0]}) and "
                    "redlock_beat_catch_up is 'none'",
                )
            return (
                None
                if current is None
                else original(
                    _tagged(entry, current, claim_ttl=_claim_ttl(entry)), producer=producer
                )
            )
        latest = current if current is not None else missed[0]
        covers = missed if current is not None else missed[1:]
        count = len(covers) + 1
        if count > 1 or current is None:
            logger.warning(
                "beat: sending %s%s, standing for %d occurrence(s) nobody sent%s "
                "(redlock_beat_catch_up='one')",
                latest,
                " late" if current is None else "",
                count,
                f" ({missed[-1]} .. {latest})" if count > 1 else "",
            )
        return original(
            _tagged(entry, latest, covers=covers, claim_ttl=_claim_ttl(entry)), producer=producer
        )

    def _interval_ids(entry: Any, newest: int, oldest: int | None = None) -> list[str]:
        """Ids of interval occurrences ``newest`` down to ``oldest`` (or as far back as
        a claim lives), at most MAX_CATCH_UP."""
        interval = entry.schedule.run_every.total_seconds()
        reach = max(1, min(MAX_CATCH_UP, int(_claim_ttl(entry) / interval) - 1))
        floor = max(0, newest - reach + 1, oldest if oldest is not None else 0)
        return [f"{entry.name}#{i}" for i in range(newest, floor - 1, -1)]

    def _unsent_by_other(name: str, occurrence: str, holder: str) -> bool:
        """Whether ``occurrence``, claimed by another beat, is to be sent by this one.

        That beat may have died between its claim and its send (a crontab minute whose
        leader was killed just after it fell due): with no run claim, no worker took it,
        and it is sent again. A worker runs it once either way (its run claim, see
        :func:`claim_occurrences`).
        """
        if holder == leader.identity:
            return False
        try:
            taken = redlock.claimed(occurrence_key(namespace, occurrence), RUN_SUFFIX)
        except RedlockError as exc:
            _not_sent(name, occurrence, f"claimed by {holder}; cannot read whether it ran: {exc}")
            return False
        if not taken:
            logger.warning(
                "beat: %s was claimed by %s but no worker took it (its sender may have died "
                "before publishing it): sending it again (a worker runs it once)",
                occurrence,
                holder,
            )
        return not taken

    def _walk(name: str, candidates: list[str]) -> list[str]:
        """Claim ``candidates`` (newest first) down to the first one that ran.

        An occurrence another beat claimed but no worker took (no run claim) may never
        have been published: its beat can die between the claim and the send. It is
        listed too (except with ``"none"``), and the walk goes on: the worker that gets
        our message runs it only if no other message ran it first (its run claim, see
        :func:`claim_occurrences`), so listing one that was sent after all costs nothing.

        Returns the ones to send, newest first: claimed fresh by us, or claimed by
        another beat and not taken by a worker. Unreachable masters end the walk
        (logged).
        """
        mine: list[str] = []
        for occurrence in candidates:
            key = occurrence_key(namespace, occurrence)
            try:
                holder, fresh = redlock.claim(
                    key,
                    CLAIM_SUFFIX,
                    leader.identity,
                    _claim_ttl_of(name),
                    guard_for=_guard_window(leader.lease_ttl),
                )
                taken = holder != leader.identity and redlock.claimed(key, RUN_SUFFIX)
            except RedlockError as exc:
                _not_sent(name, occurrence, f"cannot claim it (missed): {exc}")
                break
            if taken:
                break
            if holder == leader.identity and not fresh:
                break
            if holder != leader.identity:
                logger.info(
                    "beat: %s was claimed by %s but no worker took it (its sender may have "
                    "died before publishing it): %s",
                    occurrence,
                    holder,
                    "missed" if mode == "none" else "sending it again (a worker runs it once)",
                )
            mine.append(occurrence)
        return mine

    claim_ttls: dict[str, float] = {}

    def _claim_ttl_of(name: str) -> float:
        return claim_ttls.get(name, max(settings.dedupe_ttl, 180.0))

    def _claim_ttl(entry: Any) -> float:
        # redlock_dedupe_ttl, or three intervals (three minutes for crontab entries).
        interval = getattr(getattr(entry, "schedule", None), "run_every", None)
        ttl = max(settings.dedupe_ttl, 3 * (interval.total_seconds() if interval else 60.0))
        claim_ttls[entry.name] = ttl
        return ttl

    def _fresh_enough(entry: Any, due: float) -> bool:
        # Past a claim's TTL a claim may be gone: a fresh claim would not mean "unsent".
        return _wall() - due < _claim_ttl(entry) / 2

    def _not_sent(name: str, occurrence: str | None, reason: str) -> None:
        # Nothing is dropped silently: a warning and the signal, wherever it happens.
        logger.warning("beat: not sending %s: %s", occurrence or name, reason)
        signals.beat_not_sent.send(sender=leader, entry=name, occurrence=occurrence, reason=reason)

    def _catch_up_takeover(scheduler: Any) -> None:
        """On each new term: the same rule for every entry, whoever led before."""
        try:
            entries = list(scheduler.schedule.values())
        except Exception:
            logger.warning("beat: cannot list the schedule to catch up", exc_info=True)
            return
        for entry in entries:
            try:
                _catch_up_entry(entry, scheduler)
            except RedlockError as exc:
                _not_sent(entry.name, None, f"cannot catch it up: {exc}")

    def _catch_up_entry(entry: Any, scheduler: Any) -> None:
        if _opted_out(entry):
            return
        name = entry.name
        if _numbered(getattr(entry, "schedule", None)):
            interval = entry.schedule.run_every.total_seconds()
            if interval <= 0:
                return
            timestamp = _wall()
            # A new anchor is this beat's own start of the entry (its last_run_at): slot 1
            # is then exactly when Celery first runs it. Anchored at this tick instead
            # (a few ms later), Celery's first run named slot 0, and its realignment made
            # slot 1 due at once: two sends at the first due time (found by review).
            started = _last_run_timestamp(entry)
            anchor_at = started if started is not None and started <= timestamp else timestamp
            anchor, created = _anchor(redlock, name, interval, anchor_at, anchors, namespace)
            if created:
                return  # numbered from its start: nothing of it fell due yet
            latest = math.floor((timestamp - anchor + ALIGN_TOLERANCE) / interval)
            if latest < 0:
                return
            _claim_ttl(entry)
            floor = last_sent.get(name)
            candidates = _interval_ids(entry, latest, None if floor is None else floor + 1)
        else:
            kept = [o for _, o, due in passed.pop(name, []) if _fresh_enough(entry, due)]
            if not kept:
                return
            _claim_ttl(entry)
            candidates = list(reversed(kept))
        missed = _walk(name, candidates)
        if missed:
            if _numbered(entry.schedule):
                latest = _index(missed[0])
                last_sent[name] = max(latest, last_sent.get(name, -1))
                interval = entry.schedule.run_every.total_seconds()
                next_due = anchors[name][0] + (latest + 1) * interval
                if mode == "one" and next_due - _wall() < min(interval / 4, 1.0):
                    # The next occurrence is due in a moment: it stands for these too,
                    # rather than two sends of one entry in a row.
                    carried[name] = (latest, missed)
                    return
            _deliver(entry, None, missed, None)
            if not _numbered(entry.schedule) and mode != "none":
                _record_late_send(scheduler, entry)

    scheduler.apply_entry = types.MethodType(apply_entry, scheduler)
    scheduler.reserve = types.MethodType(reserve, scheduler)
    scheduler._when = types.MethodType(_when, scheduler)
    scheduler.tick = types.MethodType(tick, scheduler)


def _keep_local(scheduler: Any, name: str, model: Any, count: Any) -> None:
    """A beat that did not send an entry keeps its reservation to itself.

    Celery reserves an entry (``last_run_at``, ``total_run_count``) before
    ``apply_entry``. django-celery-beat's DatabaseScheduler writes that to the shared
    database, and disables a ``one_off`` task once its count is above 0: a standby (or a
    beat without a quorum) would advance every task's counters and disable a one-off
    task that nobody sent. So for such a beat the count goes back and the entry is not
    written; its own ``last_run_at`` still moves, in memory, so it does not tick again.
    """
    dirty = getattr(scheduler, "_dirty", None)
    if isinstance(dirty, set):
        dirty.discard(name)
    if model is not None and isinstance(count, int):
        model.total_run_count = count


def _record_late_send(scheduler: Any, entry: Any) -> None:
    """A late send of a database entry counts as its run (a ``one_off`` is then done)."""
    model = getattr(entry, "model", None)
    dirty = getattr(scheduler, "_dirty", None)
    if model is None or not isinstance(dirty, set):
        return
    try:
        model.total_run_count = int(model.total_run_count) + 1
        model.last_run_at = entry.default_now()
        dirty.add(entry.name)
        if getattr(model, "one_off", False):
            # Its scheduler does not look at it again (a clocked entry is checked once),
            # so disable it here, as django-celery-beat's is_due would.
            model.enabled = False
            model.no_changes = False
            model.save()
    except Exception:
        logger.debug("beat: could not record the late send of %s", entry.name, exc_info=True)


def _last_run_timestamp(entry: Any) -> float | None:
    """``entry.last_run_at`` as a unix timestamp (a naive one read as UTC, as Celery's
    default ``now`` is), or None."""
    last = getattr(entry, "last_run_at", None)
    if not isinstance(last, dt.datetime):
        return None
    if last.tzinfo is None:
        last = last.replace(tzinfo=dt.timezone.utc)
    try:
        return last.timestamp()
    except (OverflowError, OSError, ValueError):
        return None


def _wall() -> float:
    """Wall time: occurrences are named, and due, by the wall clock (beats compare it)."""
    return time.time()  # noqa: TID251 - due times are wall times


def _without_opt_out(entry: Any) -> Any:
    sent = _copy_entry(entry)
    sent.options = {k: v for k, v in (entry.options or {}).items() if k != OPT_OUT_OPTION}
    return sent


def _copy_entry(entry: Any) -> Any:
    try:
        # Not copy.copy(): it rebuilds through ScheduleEntry.__reduce__, whose arguments
        # django-celery-beat's ModelEntry.__init__(model, app) does not take (TypeError).
        sent = object.__new__(type(entry))
        sent.__dict__.update(vars(entry))
    except TypeError:  # no __dict__
        sent = copy.copy(entry)
    return sent


def _tagged(
    entry: Any,
    occurrence: str,
    *,
    task_id: str | None = None,
    covers: list[str] | None = None,
    claim_ttl: float | None = None,
) -> Any:
    """A shallow copy of ``entry`` whose message carries the occurrence header (and,
    for a coalesced late send, how many occurrences it stands for and which others)."""
    sent = _copy_entry(entry)
    options = {k: v for k, v in (entry.options or {}).items() if k != OPT_OUT_OPTION}
    headers = dict(options.get("headers") or {})
    headers[OCCURRENCE_HEADER] = occurrence
    if covers:
        headers[CATCH_UP_HEADER] = len(covers) + 1
        headers[CATCH_UP_OF_HEADER] = list(covers)
    if claim_ttl is not None:
        headers[CLAIM_TTL_HEADER] = claim_ttl
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


def refuse_scheduler(scheduler: Any) -> None:
    """Refuse schedulers whose own locking fights beat leadership.

    celery-redbeat's ``RedBeatScheduler`` takes a lock of its own (one beat ticks) and
    keeps each entry's due time in Redis, where every beat's reservation lands: with our
    leader on top, the beat holding RedBeat's lock may be a standby here and nobody sends.

    :raises ImproperlyConfigured: naming ``redlock_beat_leader`` and what to do.
    """
    cls = type(scheduler)
    if any(k.__module__.split(".")[0] == "redbeat" for k in cls.__mro__):
        raise ImproperlyConfigured(
            f"beat scheduler {cls.__module__}.{cls.__name__} (celery-redbeat) has its own "
            "beat lock and cannot run under celery-redlock's beat leadership; set "
            "redlock_beat_leader = False (RedBeat's lock then keeps one beat sending; "
            "workers do not drop duplicate occurrences), or use another scheduler"
        )


def on_beat_init(service: Any) -> BeatLeader | None:
    """Set up leadership for the beat ``service`` (called from the beat_init handler)."""
    app = service.app
    settings = get_settings(app)
    if not settings.beat_leader:
        logger.info("beat: redlock_beat_leader is off; every beat sends (no claims)")
        return None
    refuse_scheduler(service.scheduler)
    leader = BeatLeader(app, lease_ttl=settings.beat_lease_ttl)
    guard_scheduler(service.scheduler, leader)
    leader.start()
    return leader


def is_duplicate_occurrence(
    app: Any, occurrence: str, task_id: str, claim_ttl: object = None
) -> bool:
    """Claim the run of ``occurrence`` for ``task_id``; True if it ran or runs already.

    Only a message with another task id is a duplicate: the same task id is the same
    job coming back (its own ``retry()``, a contention or outage reschedule, a
    redelivery), which keeps the id and the headers. Masters unavailable: not a
    duplicate (the task's own lock, if any, still guards it).
    """
    return not claim_occurrences(app, [occurrence], task_id, claim_ttl)


def claim_occurrences(
    app: Any, occurrences: list[str], task_id: str, claim_ttl: object = None
) -> list[str]:
    """Claim the run of each of ``occurrences`` for ``task_id``; return those it won.

    A beat message stands for its occurrence and, if it is a coalesced late send, the
    others it lists (:data:`CATCH_UP_OF_HEADER`). Each occurrence runs under the first
    task id that claims its run on the quorum and under no other: a message that wins
    none is a duplicate. The same task id wins again (the same job coming back). An
    occurrence whose claim cannot be made (masters unavailable) counts as won: the
    message runs, as before this check existed (the task's own lock, if any, still
    guards it); a warning says so.
    """
    redlock = redlock_for(app)
    namespace = beat_namespace(app)
    won: list[str] = []
    try:
        settings = get_settings(app)
        ttl = settings.dedupe_ttl
        if isinstance(claim_ttl, (int, float)) and not isinstance(claim_ttl, bool):
            # As long as the beat's claims of the occurrence (bounded like any claim).
            ttl = max(ttl, min(float(claim_ttl), limits.MAX_CLAIM_TTL))
        guard_for = _guard_window(settings.beat_lease_ttl)
    except RedlockError as exc:
        logger.warning("cannot check beat occurrences %s: %s; running it", occurrences, exc)
        return list(occurrences)
    for occurrence in occurrences:
        try:
            holder, _ = redlock.claim(
                occurrence_key(namespace, occurrence),
                RUN_SUFFIX,
                task_id,
                ttl,
                guard_for=guard_for,
            )
        except RedlockError as exc:
            logger.warning("cannot check beat occurrence %s: %s; running it", occurrence, exc)
            won.append(occurrence)
            continue
        if holder == task_id:
            won.append(occurrence)
    return won


def _stands_for(headers: dict[str, Any]) -> list[str]:
    """The occurrences a beat message stands for, its own first (a malformed list of
    others is ignored: the message stands for its own occurrence)."""
    occurrences = [str(headers[OCCURRENCE_HEADER])]
    others = headers.get(CATCH_UP_OF_HEADER)
    if isinstance(others, (list, tuple)):
        occurrences += [str(o) for o in others[:MAX_CATCH_UP] if o and str(o) not in occurrences]
    return occurrences


def _keep_won(headers: dict[str, Any], won: list[str]) -> None:
    """Make a beat message's headers say what it stands for after the run claims: the
    newest occurrence it won, how many and which others (``won`` is newest first)."""
    headers[OCCURRENCE_HEADER] = won[0]
    if len(won) > 1:
        headers[CATCH_UP_HEADER] = len(won)
        headers[CATCH_UP_OF_HEADER] = won[1:]
    else:
        headers.pop(CATCH_UP_HEADER, None)
        headers.pop(CATCH_UP_OF_HEADER, None)


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
            stands_for = _stands_for(headers)
            won = claim_occurrences(app, stands_for, task_id, headers.get(CLAIM_TTL_HEADER))
            if won != stands_for and won:
                # A coalesced send some of whose occurrences ran under another message:
                # it stands for the rest. The request is built from these headers.
                logger.warning(
                    "%s[%s]: beat occurrence(s) %s ran already; this run stands for %s",
                    name,
                    task_id,
                    [o for o in stands_for if o not in won],
                    won,
                )
                _keep_won(headers, won)
            if not won:
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

"""The :class:`Redlock` client: a lock on a quorum of N independent Redis masters."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from itertools import chain
from typing import Literal, NamedTuple, TypeVar, cast

from ..backoff import full_jitter
from ..exceptions import ImproperlyConfigured, LockContended, LockLost, QuorumUnavailable
from ..keys import redis_key, validate_key, validate_prefix, validate_suffix
from ..redact import guard
from . import heartbeat, limits, probe, process, scripts, waiting
from . import master as master_mod
from .fanout import Lane, RoundResult, Validator, run_round
from .lease import Lease
from .master import Link, Master, MasterSpec, MasterStatus, Slot, make_master
from .wire import fragment as wire_fragment
from .wire import pack

__all__ = ["Redlock"]

_R = TypeVar("_R")

#: :meth:`Redlock.holder_state`'s answers.
HolderState = Literal["matches", "free", "other"]

logger = guard(logging.getLogger("celery_redlock.lock"))  # see celery_redlock.redact

#: Blocking acquire retries with full jitter between these bounds (seconds).
RETRY_BASE, RETRY_CAP = 0.010, 0.200
#: Fence counters live this long without use (ms); safe because fences are seeded
#: from the wall clock, so a counter that expired and starts again still issues
#: tokens larger than those handed out before.
DEFAULT_FENCE_TTL = 7 * 24 * 3600.0
#: Leases per EXTEND_MANY call; bounds one script's run time on the master.
RENEW_CHUNK = 500
#: Leases per renewal round: a round waits ``node_timeout`` for replies whatever it carries,
#: and 10,000 extensions kept a master busy past 0.25 s on a slow 2-core host, so it was
#: taken for not answering, and the renewals it did make were not counted.
RENEW_ROUND = 2000
#: Key names kept ready per client (the cache starts over when full).
NAMES_CACHED = 4096
#: how many combinations of acquire's numeric arguments a client remembers as checked
NUMBERS_CACHED = 64
#: Keys remembered per client as "holders read the fence" (see ``eager_fence_keys``).
DEFAULT_EAGER_FENCE_KEYS = 4096
#: Idle lanes (one connection per master each) kept open per client; more are closed
#: once idle for LANE_IDLE seconds, so a burst of threads does not leave its
#: connections open for good.
IDLE_LANES_KEPT = 2
LANE_IDLE = 2.0

_instances: weakref.WeakSet[Redlock] = weakref.WeakSet()


#: Suffixes of the keys a lock keeps beside itself; ``claim`` refuses them.
RESERVED_SUFFIXES = frozenset({"meta", "fence"})


class AcquireArguments(NamedTuple):
    """:meth:`Redlock.acquire`'s arguments, checked, with their defaults filled in."""

    ttl: float
    blocking_timeout: float | None
    max_hold: float | None
    renew_every: float
    #: whether ``renew_every`` was left to its default (ttl/3, followed on extend)
    renew_every_default: bool
    #: ``meta`` as the str fields stored beside the lock
    fields: dict[str, str]


_JUST_STR = {str}
#: the types whose checked numbers may be remembered: a subclass of int or float may
#: compare and hash as one value and convert (``float()``) to another
_PLAIN_NUMBERS = frozenset({int, float, type(None)})

#: ttl, blocking_timeout, max_hold, renew_every, renew_every_default (see AcquireArguments)
CheckedNumbers = tuple[float, float | None, float | None, float, bool]


def _undo_interrupted(lane: Lane, undo: Callable[[], bytes], kind: type[BaseException]) -> None:
    """An exception (a soft time limit's, a revoke's or a ``KeyboardInterrupt``, raised by
    a signal handler while a round waits) escaped a round that may take something on the
    masters (an acquire, a claim): undo what it may have taken, and close the lane's
    connections.

    The undo is written behind the command on each connection, so a master runs it after
    the command, and the connection is then closed (the master still runs what it has
    read; the replies are not waited for, so a command written without a slot for its
    reply is undone too). A connection on which a command may be partly written is only
    closed: the master drops a partial command. But an exception can also land as the
    send returns, the whole command written and the link not yet told: so after the
    close, such a link's undo is sent again on a new connection, off this thread (see
    :func:`_undo_on_new_connections`). Without this, an interrupted acquire's keys stood
    on the masters for their whole TTL, held by nobody.

    Called from an ``except`` clause, not a context manager's ``__exit__``: the success
    path then calls no Python function after the round, where a signal's exception could
    land past the guard with the lock taken (see :meth:`Redlock._try_acquire`).
    """
    payload: bytes | None = None
    cut: list[Master] = []
    for link in lane.links:
        if link.sock is None:
            continue
        if link.partial:
            cut.append(link.master)
        else:
            try:
                payload = payload or undo()
                link.send(payload, 1)
            except Exception:  # noqa: BLE001 - best effort, the link closes anyway
                logger.debug("could not send the undo to %s", link.master.name)
        link.close()
    if cut:
        _undo_on_new_connections(cut, payload or undo())
    logger.warning(
        "a lock operation was interrupted (%s); what it may have taken on the masters is undone",
        kind.__name__,
    )


def _undo_on_new_connections(masters: Sequence[Master], payload: bytes) -> None:
    """Send ``payload`` (an undo by token or value) to each of ``masters`` on a connection
    of its own, from a daemon thread, and wait for its reply up to ``node_timeout``.

    For links an exception closed with a command maybe partly written: the master dropped
    a partial command with the connection, and ran a whole one before it read the close
    (it had read the command first), so this undo, sent after a new connection's
    handshake was answered, runs after it either way; where nothing stands, it deletes
    nothing. A thread, since the caller is on its way out with an exception (a soft time
    limit) and connecting can take a ``node_timeout``.
    """

    def not_undone(where: Sequence[Master], exc: Exception) -> None:
        logger.warning(
            "could not undo an interrupted lock operation on %s (%s): what it took there "
            "stands until its TTL ends",
            ", ".join(m.name for m in where),
            exc,
        )

    def run() -> None:
        for master in masters:
            link = Link(master)
            try:
                link.connect(time.monotonic())
                link.wait_for(link.send(payload, 1))
            except Exception as exc:  # noqa: BLE001 - best effort: the keys expire anyway
                not_undone([master], exc)
            finally:
                link.close()

    try:
        threading.Thread(target=run, name="redlock-undo", daemon=True).start()
    except Exception as exc:  # noqa: BLE001 - never in place of the interrupting exception
        not_undone(masters, exc)


class Redlock:
    """A Redlock client over N independent masters (N=1 works, as a plain lock).

    :param masters: URLs (``redis://``, ``rediss://``, ``unix://``, with ACL user and
        password), dicts of ``redis.Redis`` arguments, ``redis.Redis`` clients, or
        Sentinel specs ``{"sentinels": [(host, port)], "service_name": ...}``. A server
        listed twice is refused (it would count twice towards the quorum).
    :param key_prefix: first part of every Redis key (``<prefix>:{<key>}``).
    :param node_timeout: connect and read timeout per master call, in seconds; no
        client-side retries. Must be well below the TTLs you use.
    :param clock_drift_factor: share of the TTL subtracted from validity for clock
        drift between the masters (plus 2 ms).
    :param fence_ttl: seconds an unused fence counter lives.
    :param restart_quarantine: seconds a master seen to restart stays out of the
        quorum; by default the longest TTL this client has used.
    :param eager_fence_keys: how many keys this client remembers as fenced. Once a
        lease's fence has been read, later acquires of the same key through this
        client send the fence commit in the acquire round, so reading the fence then
        costs no extra round trip (only waiting for the slowest master's reply). The
        least recently used keys are forgotten beyond this many; 0 turns it off.
    :param spin_wait: seconds a round may poll for replies without sleeping, while
        replies typically come within that time (masters on this host or a fast
        LAN): waking a sleeping thread costs more than such a wait. Adaptive: the
        client keeps a moving average of how long rounds wait and polls only while
        it stays at or below ``spin_wait``, so slower links never burn CPU on it,
        and not while every core is busy (the 1-minute load average is at least the
        cores this process may use): polling would then take CPU from processes that
        have work. 0 turns it off.

    One instance is safe to share between threads and survives ``fork()``: the
    child opens its own connections and holds none of the parent's leases.
    """

    def __init__(
        self,
        masters: Sequence[MasterSpec] | MasterSpec,
        *,
        key_prefix: str = "redlock",
        node_timeout: float = 0.25,
        clock_drift_factor: float = 0.01,
        fence_ttl: float = DEFAULT_FENCE_TTL,
        restart_quarantine: float | None = None,
        eager_fence_keys: int = DEFAULT_EAGER_FENCE_KEYS,
        spin_wait: float = 50e-6,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(masters, str | Mapping) or not isinstance(masters, Sequence):
            masters = [masters]
        if not masters:
            raise ImproperlyConfigured("masters: give at least one Redis master")
        validate_prefix(key_prefix)
        try:
            self.node_timeout = limits.seconds(
                "node_timeout", node_timeout, limits.MIN_NODE_TIMEOUT, limits.MAX_NODE_TIMEOUT
            )
            drift = limits.seconds(
                "clock_drift_factor",
                clock_drift_factor,
                0.0,
                limits.MAX_DRIFT,
                high_open=True,
                unit="(a share of the TTL)",
            )
            self.fence_ttl = limits.seconds("fence_ttl", fence_ttl, 1.0, limits.MAX_FENCE_TTL)
            if restart_quarantine is not None:
                restart_quarantine = limits.seconds(
                    "restart_quarantine", restart_quarantine, 0.0, limits.MAX_QUARANTINE
                )
            spin_wait = limits.seconds("spin_wait", spin_wait, 0.0, limits.MAX_SPIN_WAIT)
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(str(exc)) from None
        if (
            isinstance(eager_fence_keys, bool)
            or not isinstance(eager_fence_keys, int)
            or eager_fence_keys < 0
        ):
            raise ImproperlyConfigured(
                f"eager_fence_keys must be an int >= 0 (0 turns it off), got {eager_fence_keys!r}"
            )
        self.eager_fence_keys = eager_fence_keys
        #: keys whose holders read the fence (most recently used last)
        self._fence_keys: OrderedDict[str, None] = OrderedDict()
        self._fence_keys_lock = threading.Lock()
        #: key -> its lock, metadata and fence counter names (see _keys)
        self._names: dict[str, tuple[str, str, str]] = {}
        #: acquire's numeric arguments (with their types) -> checked (see _acquire_arguments)
        self._checked_numbers: dict[tuple[object, ...], CheckedNumbers] = {}
        #: claim's ttl and guard_for (with their types) -> checked (see claim)
        self._checked_claims: dict[tuple[object, ...], tuple[float, float | None]] = {}
        #: the masters' run_ids and the order of claim_order() they give
        self._claim_order: tuple[tuple[str | None, ...], list[int]] = ((), [])
        if spin_wait >= self.node_timeout:
            raise ImproperlyConfigured(
                f"spin_wait must be shorter than node_timeout ({self.node_timeout}s), "
                f"got {spin_wait!r}"
            )
        self.clock_drift_factor = drift
        self.key_prefix = key_prefix
        self.restart_quarantine = restart_quarantine
        self._clock = clock
        self.masters: list[Master] = [make_master(m, self.node_timeout) for m in masters]
        master_mod.refuse_duplicates(self.masters)
        master_mod.group(self.masters)
        self.quorum = len(self.masters) // 2 + 1
        self.reconnect_backoff = max(1.0, 4 * self.node_timeout)
        #: how long a claim's writer id is kept, in ms (see scripts.CLAIMED_BY): longer
        #: than a claim() call lasts (up to 4 attempts, each a round, an undo, a backoff,
        #: and connecting takes two node_timeouts), so calls racing on one value read
        #: each other's ids
        self._writer_ms = int(max(5.0, 4 * (4 * self.node_timeout + RETRY_CAP)) * 1000)
        self.spin_wait = spin_wait
        #: moving average of how long rounds waited for their replies (see _round)
        self._reply_wait = 0.0
        self._lanes: list[Lane] = []
        self._lanes_lock = threading.Lock()
        #: clock time after which _lane looks for idle lanes to close
        self._prune_at = 0.0
        self._renew_lane: Lane | None = None
        _instances.add(self)
        if len(self.masters) == 1:
            logger.info(
                "Redlock on a single master (%s): an efficiency lock; it does not survive "
                "that master failing or restarting",
                self.masters[0].name,
            )

    def __repr__(self) -> str:
        return f"<Redlock {len(self.masters)} masters, quorum {self.quorum}: {self.master_names}>"

    @property
    def master_names(self) -> list[str]:
        """The masters, described without passwords."""
        return [m.name for m in self.masters]

    # -- public API ----------------------------------------------------------

    def acquire(
        self,
        key: str,
        ttl: float,
        *,
        blocking_timeout: float | None = 0,
        auto_renew: bool = False,
        max_hold: float | None = None,
        renew_every: float | None = None,
        meta: Mapping[str, str] | None = None,
        clear_companion: tuple[str, str] | None = None,
    ) -> Lease:
        """Take the lock on ``key`` for ``ttl`` seconds on a quorum of masters.

        ``blocking_timeout=0`` tries once; a positive number keeps trying for that
        long with full-jitter pauses of 10 to 200 ms; ``None`` waits forever.
        Raises :class:`LockContended` when somebody else holds the key (also
        this client: locks are not re-entrant) and :class:`QuorumUnavailable`
        when too few masters answer (a blocking acquire keeps trying through both,
        and at its timeout raises what the last try raised). With ``auto_renew``
        the process's renewal engine extends the lease every ``renew_every``
        seconds (default ttl/3),
        for at most ``max_hold`` seconds in all when given. ``meta`` is stored in a
        hash beside the lock (same TTL, deleted with it) for operators.
        ``clear_companion=(suffix, value)`` deletes ``<prefix>:{key}:<suffix>`` if it
        holds ``value``, in the same atomic step as a successful acquire (the task
        layer clears its enqueue-dedupe marker this way, without a round trip).

        Ranges (``ValueError`` naming the argument otherwise; NaN and infinities are
        refused everywhere): ``ttl`` in (``node_timeout``, 86400]; ``blocking_timeout``
        None or in [0, 7 days]; ``max_hold`` None or in (0, 30 days]; ``renew_every`` in
        [0.01, ``ttl``) and below the lease's validity, ``ttl - (ttl * clock_drift_factor
        + 0.002)``.
        """
        checked = self._acquire_arguments(
            key, ttl, blocking_timeout, max_hold, renew_every, meta, clear_companion, auto_renew
        )
        ttl, blocking_timeout, max_hold = checked.ttl, checked.blocking_timeout, checked.max_hold
        companion = ("dedupe", "") if clear_companion is None else clear_companion
        meta_args: list[str] = [
            companion[0],
            companion[1],
            *chain.from_iterable(checked.fields.items()),
        ]
        deadline = None if blocking_timeout is None else self._clock() + blocking_timeout
        attempt = 0
        box: list[Lease] = []
        while True:
            try:
                # A fresh token per attempt: the undo of a failed attempt (queued on its
                # lane's connections, which may deliver it late) can then only ever delete
                # that attempt's own key, never the one a later attempt won.
                lease = self._try_acquire(
                    key, process.token_hex(), ttl, meta_args, checked.renew_every, max_hold, box
                )
                break
            except (LockContended, QuorumUnavailable):
                if blocking_timeout == 0:
                    raise
                pause = full_jitter(attempt, RETRY_BASE, RETRY_CAP)
                attempt += 1
                if deadline is not None:
                    left = deadline - self._clock()
                    if left <= 0:
                        raise
                    pause = min(pause, left)
                time.sleep(pause)
            except BaseException:
                # Won, then interrupted on its way out (a signal's exception as the lane
                # was given back): nobody else would ever release it.
                if box:
                    box[0].release(wait=False)
                raise
        try:
            lease._renew_every_default = checked.renew_every_default
            self._granted(ttl)
            if auto_renew:
                lease.auto_renew = True
                self._engine().add(lease)
        except BaseException:
            # Interrupted (see _undo_interrupted) before the caller has the lease: nobody
            # would release it, and the renewal engine might keep it for ever.
            lease.release(wait=False)
            raise
        return lease

    def _acquire_arguments(
        self,
        key: str,
        ttl: float,
        blocking_timeout: float | None,
        max_hold: float | None,
        renew_every: float | None,
        meta: Mapping[str, str] | None,
        clear_companion: tuple[str, str] | None,
        auto_renew: bool = False,
    ) -> AcquireArguments:
        """Check :meth:`acquire`'s arguments and fill in its defaults.

        The one place they are checked, for every backend (the in-process one calls it
        too), so each refuses the same values with the same message.

        :raises TypeError, ValueError: naming the argument (see :meth:`acquire`).
        """
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty str, got {key!r}")
        # The numbers a caller passes are the same on almost every call (a task's options):
        # once checked, they are remembered, with their types (True is not 1 here).
        numbers = (
            ttl, type(ttl), blocking_timeout, type(blocking_timeout), max_hold,
            type(max_hold), renew_every, type(renew_every), auto_renew, type(auto_renew),
            self.node_timeout, self.clock_drift_factor,
        )  # fmt: skip
        cache: dict[tuple[object, ...], CheckedNumbers] | None = self._checked_numbers
        try:
            checked = cache.get(numbers)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - unhashable: _check_numbers says what is wrong
            checked, cache = None, None
        if checked is None:
            checked = self._check_numbers(ttl, blocking_timeout, max_hold, renew_every, auto_renew)
            if (
                cache is not None
                and _PLAIN_NUMBERS.issuperset(numbers[1:8:2])
                and type(auto_renew) in (bool, int)
            ):
                # Only plain numbers: the key holds the types, so a subclass is never
                # looked up as a plain number, and is itself checked on every call.
                if len(cache) >= NUMBERS_CACHED:
                    cache.clear()
                cache[numbers] = checked
        if clear_companion is not None:
            self._check_companion(clear_companion)
        fields: dict[str, str]
        if not meta:
            fields = {}
        elif (
            type(meta) is dict
            and {*map(type, meta), *map(type, meta.values())} == _JUST_STR
            and scripts.EXTENSION_FIELD not in meta
        ):
            fields = dict(meta)  # the usual case: a plain dict of str, taken as it is
        else:
            fields = {}
            for field, value in meta.items():
                name = str(field)
                if name == scripts.EXTENSION_FIELD:
                    raise ValueError(f"meta: the field {field!r} is reserved for the lock itself")
                fields[name] = str(value)
        return AcquireArguments._make((*checked, fields))

    def _check_numbers(
        self,
        ttl: float,
        blocking_timeout: float | None,
        max_hold: float | None,
        renew_every: float | None,
        auto_renew: bool,
    ) -> CheckedNumbers:
        """The numbers of :meth:`_acquire_arguments`, checked, with their defaults."""
        ttl = self._check_ttl("ttl", ttl)
        if blocking_timeout is not None:
            blocking_timeout = limits.seconds(
                "blocking_timeout", blocking_timeout, 0.0, limits.MAX_BLOCKING_TIMEOUT
            )
        if max_hold is not None:
            max_hold = limits.seconds("max_hold", max_hold, 0.0, limits.MAX_HOLD, low_open=True)
        renew_every_default = renew_every is None
        # A renewal due after the lease's validity ended always comes too late: the lease
        # is lost at its first renewal, while the key may live on, and another holder
        # takes it when it expires, with the body still running.
        validity = ttl - self._drift(ttl)
        if renew_every is None:
            renew_every = self._default_renew_every(ttl)
        else:
            renew_every = limits.seconds(
                "renew_every", renew_every, limits.MIN_RENEW_EVERY, ttl, high_open=True
            )
        if renew_every >= validity and (auto_renew or not renew_every_default):
            raise ValueError(
                f"renew_every ({renew_every:g}s) must be shorter than the lease's validity: "
                f"ttl less its clock drift allowance (ttl * clock_drift_factor + "
                f"{limits.DRIFT_FLOOR * 1000:g} ms), {validity:g}s for ttl {ttl:g}s"
            )
        return ttl, blocking_timeout, max_hold, renew_every, renew_every_default

    def _check_ttl(self, name: str, ttl: object) -> float:
        value = limits.seconds(name, ttl, limits.MIN_TTL, limits.MAX_TTL)
        if value <= self.node_timeout:
            raise ValueError(
                f"{name} ({value:g}s) must be longer than node_timeout ({self.node_timeout:g}s)"
            )
        return value

    def _granted(self, ttl: float) -> None:
        """Note a TTL the masters granted: a restarted master's quarantine follows the longest
        granted in this process (see :func:`.master.note_granted_ttl`)."""
        master_mod.note_granted_ttl(ttl)

    def _engine(self) -> heartbeat.Heartbeat:
        """The renewal engine for this client's leases: the process's, on this client's clock."""
        return heartbeat.engine(self._clock)

    @contextlib.contextmanager
    def lock(
        self,
        key: str,
        ttl: float,
        *,
        blocking_timeout: float | None = 0,
        auto_renew: bool = False,
        max_hold: float | None = None,
        renew_every: float | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> Iterator[Lease]:
        """:meth:`acquire` as a context manager that releases on exit.

        Leaving the block raises :class:`LockLost` when the lease was lost inside it
        (see :meth:`Lease.__exit__`), as redis-py raises ``LockNotOwnedError``.
        """
        lease = self.acquire(
            key,
            ttl,
            blocking_timeout=blocking_timeout,
            auto_renew=auto_renew,
            max_hold=max_hold,
            renew_every=renew_every,
            meta=meta,
        )
        # Not ``with lease:``: an exception (a signal's) landing as Lease.__enter__ is
        # called would leave the lease unreleased, and an auto-renewed one renewed for as
        # long as the process lives. This try starts right as acquire() returns; and a
        # generator closed before it resumes (contextlib's __enter__ interrupted after
        # the yield) runs the except clause with GeneratorExit.
        try:
            yield lease
        except BaseException as exc:
            lease.__exit__(type(exc), exc, exc.__traceback__)
            raise
        lease.__exit__(None, None, None)  # raises LockLost when it was lost inside the block

    def close(self) -> None:
        """Close every connection (leases still held simply expire)."""
        with self._lanes_lock:
            lanes = list(self._lanes)
            if self._renew_lane is not None:
                lanes.append(self._renew_lane)
        for lane in lanes:
            # A lane left locked for good (see _lane) is closed all the same.
            taken = lane.lock.acquire(timeout=8 * self.node_timeout + 1.0)
            try:
                for link in lane.links:
                    link.close()
            finally:
                if taken:
                    lane.lock.release()
        for master in self.masters:
            probe.forget(master)

    def check_masters(self) -> list[MasterStatus]:
        """Reach every master now and say how each stands, in the order given.

        Connects wherever no connection is open, also to masters still waiting out a
        reconnect backoff, so that the answer is current; a master that turns out to
        be the same server as another one (the same ``run_id`` under two names, or
        another db number) has ``duplicate_of`` set to that one's number and is never
        counted towards the quorum. Never raises for unreachable masters.
        """
        for master in self.masters:
            probe.forget(master)
            master.connect_after = 0.0
        payload = (pack(("PING",)), 1)
        with self._lane() as lane:
            self._round(lane, [payload] * len(self.masters), valid=_pong)
        return [master.status() for master in self.masters]

    def release_owned_by(self, key: str, field: str, value: str) -> bool:
        """Delete the lock on ``key`` if its metadata says ``field == value``.

        For a holder that cannot release itself, such as a task killed by a revoke
        with terminate: the worker's main process knows the task id, not the token.
        Returns True when a quorum deleted it; never raises for unreachable masters.
        """
        lock_key, meta_key, _ = self._keys(key)
        payload = (
            scripts.RELEASE_OWNER.call(2, lock_key, meta_key, field, value),
            1,
        )
        with self._lane() as lane:
            result = self._round(lane, [payload] * len(self.masters))
        deleted = sum(1 for x in result.replies if x is not None and x[0] == 1)
        self._note_unreached(result)
        return deleted >= self.quorum

    def holder(self, key: str, fields: Sequence[str]) -> tuple[str, dict[str, str]] | None:
        """The token of the lock on ``key`` and the metadata ``fields`` of its holder, as a
        quorum of masters agree on them (one read); None when no quorum agrees (the key is
        free, or unreachable masters leave it in doubt).

        For a process that must release a lock it does not hold, once its holder is gone
        (the worker's main process for a killed pool child): it reads the token here and
        releases by that token (:meth:`release_token`), so a later holder is never freed.
        """
        if not fields:
            raise ValueError("holder: name at least one metadata field")
        lock_key, meta_key, _ = self._keys(key)
        payload = (pack(("GET", lock_key), ("HMGET", meta_key, *fields)), 2)
        with self._lane() as lane:
            result = self._round(lane, [payload] * len(self.masters), valid=_holder_replies)
        votes: dict[tuple[object, ...], int] = {}
        for replies in result.replies:
            if replies is not None and isinstance(replies[0], bytes):
                seen = (replies[0], *cast("list[object]", replies[1]))
                votes[seen] = votes.get(seen, 0) + 1
        self._note_unreached(result)
        for seen, count in votes.items():
            if count >= self.quorum:
                token, *values = (v.decode() if isinstance(v, bytes) else "" for v in seen)
                return token, dict(zip(fields, values, strict=True))
        return None

    def release_token(self, key: str, token: str) -> bool:
        """Delete the lock on ``key`` (and its metadata) where it still holds ``token``.

        True when a quorum deleted it; never raises for unreachable masters.
        """
        lock_key, meta_key, _ = self._keys(key)
        payload = (scripts.RELEASE.call(3, lock_key, meta_key, meta_key, token, ""), 1)
        with self._lane() as lane:
            result = self._round(lane, [payload] * len(self.masters))
        self._note_unreached(result)
        return sum(1 for x in result.replies if x is not None and x[0] == 1) >= self.quorum

    def force_delete(self, names: Iterable[str]) -> list[str]:
        """Delete the Redis keys ``names`` on every master; return those deleted somewhere.

        An operator's tool (``clear_lock``, ``clear_dedupe``): no ownership check. Masters
        that cannot be reached are logged (their copy expires with its TTL);
        :class:`QuorumUnavailable` when none answered.
        """
        names = list(names)
        deleted: set[str] = set()
        errors: dict[str, str] = {}
        for master in self.masters:
            client = master.client()
            try:
                pipe = client.pipeline(transaction=False)
                for name in names:
                    pipe.delete(name)
                for name, count in zip(names, pipe.execute(), strict=True):
                    if count:
                        deleted.add(name)
            except Exception as exc:  # noqa: BLE001 - reported below, per master
                errors[master.name] = f"{type(exc).__name__}: {exc}"
            finally:
                client.close()
                client.connection_pool.disconnect()
        if errors:
            if len(errors) == len(self.masters):
                raise QuorumUnavailable(
                    f"no master answered the deletion of {', '.join(names)}",
                    names[0] if names else None,
                    self.master_names,
                    errors,
                )
            logger.warning(
                "deleted %s on the masters that answered; not reached: %s",
                ", ".join(names),
                "; ".join(f"{m}: {e}" for m, e in errors.items()),
            )
        return sorted(deleted)

    def claim(
        self,
        key: str,
        suffix: str,
        value: str,
        ttl: float,
        *,
        guard_for: float | None = None,
    ) -> tuple[str, bool]:
        """Set ``<prefix>:{key}:<suffix>`` to ``value`` on a quorum unless somebody has.

        Returns ``(holder, fresh)``: the value that holds a quorum afterwards
        (``value`` when the claim is ours, else the other claimant's) and whether
        this call created it: True when it wrote the value on a quorum, False when it
        found the value already there on a quorum. Several calls claiming the same value
        at once may each write it on some masters only, neither case: then the one that
        wrote it on the first master holding it, in an order every client agrees on
        (:meth:`claim_order`), gets True, the others False (when a master before it did
        not answer, every such call that wrote it somewhere gets True: a second publish
        rather than none). When no
        value reaches a quorum (several claimants raced), our partial claim is
        undone and the claim tried again a few times. Raises
        :class:`QuorumUnavailable` when too few masters answer and
        :class:`LockContended` when racing claims never settle. ``suffix`` may not
        be one the lock itself uses (``meta``, ``fence``); ``ttl`` is in (0, 36500 days].

        ``guard_for`` is how long after it is won the claim guards an "only once": a master
        that restarts empty loses it, so such a master is kept out of the quorum that long
        (see restart quarantine). By default the claim's TTL, at most a day; 0 when losing
        it costs no safety (an enqueue-dedupe marker: a duplicate publish is still kept
        apart by the run-time lock). Beat passes the window in which an occurrence can
        still be claimed again (a few leader lease periods).
        """
        name, ttl, guard_for = self._claim_arguments(key, suffix, ttl, guard_for)
        # The call's own id, stored beside the value where it writes it: a call that finds
        # its value tells another call's write of it (the same job id published twice at
        # once) from its own, and from a finished claim's (see _claim_created).
        ttl_ms = max(1, int(ttl * 1000))
        writer, call = name + scripts.CLAIMED_BY, process.token_hex()
        own = call.encode()
        payload = (
            scripts.CLAIM.call(2, name, writer, value, ttl_ms, call, min(ttl_ms, self._writer_ms)),
            1,
        )
        ours = value.encode()
        n, q = len(self.masters), self.quorum

        def holder_of(reply: list[object]) -> bytes | None:
            first = reply[0]
            if first == 1:
                return ours
            return first[0] if type(first) is list else None

        # Every attempt uses the first attempt's lane (its connections): the value is the
        # same in all of them, so an attempt's undo must reach each master before the
        # next attempt's claim, as one connection keeps commands in order. On another
        # lane a late undo could delete the claim a later attempt counted as won.
        first: Lane | None = None

        def unclaim() -> bytes:
            return scripts.UNCLAIM.call(2, name, writer, value)

        def unclaim_own() -> bytes:
            # An interrupted claim undoes only what this call wrote: a copy it found (the
            # same job id claimed by another call, which publishes it) stays.
            return scripts.UNCLAIM.call(2, name, writer, value, call)

        created = False
        try:
            for attempt in range(4):
                lane = self._lane(first)
                try:
                    try:
                        first = lane
                        quarantined = self._quarantined(self._clock())

                        def decided(r: RoundResult, quarantined: set[int] = quarantined) -> bool:
                            votes: dict[bytes | None, int] = {}
                            made = 0
                            for i, x in enumerate(r.replies):
                                if x is not None and i not in quarantined:
                                    h = holder_of(x)
                                    votes[h] = votes.get(h, 0) + 1
                                    made += x[0] == 1
                            for held, c in votes.items():
                                if held is not None and c >= q:
                                    # Ours, neither written nor found on a quorum by this
                                    # call: split with other calls of the same value, or
                                    # one of them wrote a quorum: every master's answer
                                    # tells (see _claim_created).
                                    return (
                                        held != ours
                                        or made >= q
                                        or _by_one_other(r, quarantined, ours, own) >= q
                                        or _all_answered(r, quarantined, self.masters)
                                    )
                            return False

                        payloads = (
                            [None if i in quarantined else payload for i in range(n)]
                            if quarantined
                            else [payload] * n
                        )
                        result = self._round(lane, payloads, decided, valid=_claim_replies)
                        votes: dict[bytes, int] = {}
                        fresh = 0
                        for i, x in enumerate(result.replies):
                            h = None if x is None or i in quarantined else holder_of(x)
                            if h is not None:
                                votes[h] = votes.get(h, 0) + 1
                                fresh += x is not None and x[0] == 1
                        winner = None
                        for h, c in votes.items():
                            if c >= q:
                                winner = h
                                break
                        if winner == ours:
                            guarded = min(ttl, limits.MAX_TTL) if guard_for is None else guard_for
                            if guarded:
                                self._granted(guarded)
                            # (made on a quorum, the usual publish: no count of the others)
                            created = fresh >= q or _claim_created(
                                result,
                                quarantined,
                                ours,
                                q,
                                fresh,
                                _by_one_other(result, quarantined, ours, own),
                                self.claim_order,
                            )
                            if not created and (fresh or result.not_waited):
                                self._cede(lane, result, quarantined, ours, writer, call)
                            return value, created
                        mine = {
                            i
                            for i, x in enumerate(result.replies)
                            if x is not None and holder_of(x) == ours
                        }
                        mine |= {
                            i for i in result.errors if lane.links[i].connected
                        } | result.not_waited
                        if mine:
                            undo = (unclaim(), 1)
                            # Lost to another claimant: nothing of ours follows the undo, and
                            # later commands on these connections run after it, so it is not
                            # waited for (a slow master would otherwise cost every lost claim
                            # its round trip: a worker's consumer dropping duplicates stalled).
                            self._round(
                                lane,
                                [undo if i in mine else None for i in range(n)],
                                wait=winner is None,
                            )
                    except BaseException as exc:
                        _undo_interrupted(lane, unclaim_own, type(exc))
                        raise
                finally:
                    # Unlocked here rather than by Lane.__exit__ (see _try_acquire).
                    lane.lock.release()
                    lane.idle_since = self._clock()
                if winner is not None:
                    return winner.decode(), False
                if sum(votes.values()) < q:
                    raise QuorumUnavailable(
                        f"only {sum(votes.values())} of {n} masters answered the claim {name!r}, "
                        f"{q} needed",
                        key,
                        self.master_names,
                        self._errors(result),
                    )
                time.sleep(full_jitter(attempt, RETRY_BASE, RETRY_CAP))
        except BaseException as exc:
            if created and first is not None:
                # Won, then interrupted on its way out (a signal's exception as the lane
                # was given back): a marker naming a job its caller never published.
                lane = self._lane(first)
                try:
                    _undo_interrupted(lane, unclaim_own, type(exc))
                finally:
                    lane.lock.release()
            raise
        raise LockContended(f"racing claims on {name!r} did not settle", key, self.master_names)

    def _cede(
        self,
        lane: Lane,
        result: RoundResult,
        excluded: Set[int],
        ours: bytes,
        writer: str,
        call: str,
    ) -> None:
        """After a claim that wrote its value somewhere declined: put the id of the call
        it declined for on its copies (``RELABEL``), so that they count as that call's.

        Left with its own id, a copy reads to a later claim as one more call's write: the
        value of one finished publish then carries several ids, none on a quorum, and a
        claim that writes it again where a copy was lost (a master restarted empty) would
        read a split and publish the job again. Not when the call it declined for is not
        known (a split with a master unheard); not waited for, as an undo.
        """
        target = _ceded_to(result, excluded, ours, self.quorum, self.claim_order, call.encode())
        if target is None:
            return
        relabel = (scripts.RELABEL.call(1, writer, call, target), 1)
        late = result.not_waited
        # Where it wrote, and where its reply was not waited for (the round was decided
        # without it): sent behind the claim on the same connection, the script runs after
        # it and changes the id only if this call's stands there.
        self._round(
            lane,
            [
                relabel if (x and x[0] == 1) or (x is None and i in late) else None
                for i, x in enumerate(result.replies)
            ],
            wait=False,
        )

    def claim_order(self) -> list[int]:
        """The indexes of :attr:`masters` in an order every client of these servers agrees
        on, whatever names or order it was given them in: by run_id (learnt on connect),
        then by name. :meth:`claim` tells several calls that claimed one value at once
        apart by it."""
        run_ids = tuple(m.run_id for m in self.masters)
        known, order = self._claim_order
        if known != run_ids:
            masters = self.masters
            order = sorted(range(len(masters)), key=lambda i: (run_ids[i] or "", masters[i].name))
            self._claim_order = (run_ids, order)
        return order

    def _claim_arguments(
        self, key: str, suffix: str, ttl: float, guard_for: float | None
    ) -> tuple[str, float, float | None]:
        """:meth:`claim`'s marker name, ``ttl`` and ``guard_for``, checked (in that order of
        errors: ``guard_for``, the name, ``ttl``).

        A publish claims with the same ``ttl`` and ``guard_for`` every time: once checked,
        they are remembered with their types, as acquire's numbers are.
        """
        numbers = (ttl, type(ttl), guard_for, type(guard_for))
        cache: dict[tuple[object, ...], tuple[float, float | None]] | None = self._checked_claims
        try:
            checked = cache.get(numbers)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001 - unhashable: the checks below say what is wrong
            checked, cache = None, None
        if checked is not None:
            return self._claim_name(key, suffix), checked[0], checked[1]
        if guard_for is not None:
            guard_for = limits.seconds("guard_for", guard_for, 0.0, limits.MAX_TTL)
        name = self._claim_name(key, suffix)
        ttl = limits.seconds("ttl", ttl, 0.0, limits.MAX_CLAIM_TTL, low_open=True)
        if cache is not None and _PLAIN_NUMBERS.issuperset(numbers[1::2]):
            # Only plain numbers (see _acquire_arguments).
            if len(cache) >= NUMBERS_CACHED:
                cache.clear()
            cache[numbers] = (ttl, guard_for)
        return name, ttl, guard_for

    def locked(self, key: str) -> bool:
        """True when anyone (this client included) holds ``key`` on a quorum right now.

        redis-py's ``Lock.locked()``: one read (``GET`` on every master, decided as soon
        as the answer is certain), for callers that can drop work early instead of trying
        to take the lock. Raises :class:`QuorumUnavailable` when too few masters answer.
        """
        return self._read_vote(key, lambda value: value is not None)

    def held_elsewhere(self, key: str) -> bool:
        """Deprecated alias of :meth:`locked` (it was also True for the caller's own lock)."""
        return self.locked(key)

    def owned_by(self, key: str, field: str, value: str) -> bool:
        """True when the metadata of the lock on ``key`` says ``field == value`` on a quorum.

        One read (``HGET`` of the metadata hash, which lives and expires with the lock),
        for a caller that must tell its own earlier holder (a crashed run of the same
        task id) from another. Raises :class:`QuorumUnavailable` when too few answer.
        """
        want = value.encode()
        command = pack(("HGET", self._keys(key)[1], field))
        return self._read_vote(key, lambda got: got == want, command)

    def holder_state(self, key: str, field: str, value: str) -> HolderState:
        """Who holds the lock on ``key``, told against one holder: the one whose metadata
        says ``field == value`` (a redelivered job's earlier run, by task id). One read
        (``GET`` of the lock and ``HGET`` of its metadata, pipelined, on every master).

        * ``"matches"``: that holder has the lock on at least one master, and with the
          masters where no lock stands those make a quorum: the lock is that holder's
          on a quorum, or was, and has expired or been released on some of them since
          (a redelivered job's dead run whose lock is expiring); no other holder has
          it on a quorum;
        * ``"free"``: no lock on a quorum and that holder's nowhere (released or
          expired since the caller saw it held);
        * ``"other"``: another holder (or one without that field) has it on more masters
          than the first two answers could still leave.

        Masters kept out after a restart are not counted. Raises
        :class:`QuorumUnavailable` when too few masters answer to decide.
        """
        lock_key, meta_key, _ = self._keys(key)
        payload = (pack(("GET", lock_key), ("HGET", meta_key, field)), 2)
        want = value.encode()
        n, q = len(self.masters), self.quorum

        def judge(r: RoundResult, quarantined: Set[int], final: bool) -> HolderState | None:
            same = free = other = 0
            for i, replies in enumerate(r.replies):
                if replies is None or i in quarantined:
                    continue
                if replies[0] is None:
                    free += 1
                elif replies[1] == want:
                    same += 1
                else:
                    other += 1
            return _holder_verdict(same, free, other, n, q, final=final)

        return self._read(key, payload, judge, f"{key!r}'s holder")

    def _owned(self, lease: Lease) -> bool:
        token = lease.token.encode()
        return self._read_vote(lease.key, lambda value: value == token)

    def _read_vote(
        self, key: str, yes: Callable[[object], bool], command: bytes | None = None
    ) -> bool:
        """Read the lock on every master: True when ``yes(value)`` holds on a quorum,
        False when it fails on more than ``n - quorum``; masters kept out after a
        restart are not counted. Raises :class:`QuorumUnavailable` otherwise.
        ``command`` (one read whose reply is a string or nil) replaces ``GET`` of the lock."""
        payload = (command or pack(("GET", self._keys(key)[0])), 1)
        n, q = len(self.masters), self.quorum

        def judge(r: RoundResult, quarantined: Set[int], final: bool) -> bool | None:
            ayes, noes = _tally(r, lambda x: bool(yes(x)), quarantined, excluded_noes=False)
            return True if ayes >= q else False if noes > n - q else None

        return self._read(key, payload, judge, repr(key))

    def _read(
        self,
        key: str,
        payload: tuple[bytes, int],
        judge: Callable[[RoundResult, Set[int], bool], _R | None],
        what: str,
    ) -> _R:
        """One read (``payload``) on every master, answered by ``judge(result,
        quarantined, final)``: the round stops once it answers before the end (not
        ``final``), and its answer at the end is returned. Raises
        :class:`QuorumUnavailable` when it cannot answer; masters kept out after a
        restart (``quarantined``) are not counted as answering."""
        n = len(self.masters)
        quarantined = self._quarantined(self._clock())

        def decided(r: RoundResult) -> bool:
            return judge(r, quarantined, False) is not None

        with self._lane() as lane:
            result = self._round(lane, [payload] * n, decided, valid=_get_replies)
        answer = judge(result, quarantined, True)
        if answer is not None:
            return answer
        answered = sum(
            1
            for i, replies in enumerate(result.replies)
            if replies is not None and i not in quarantined
        )
        raise QuorumUnavailable(
            f"only {answered} of {n} masters answered the read of {what}, {self.quorum} needed",
            key,
            self.master_names,
            self._errors(result, dict.fromkeys(quarantined, "kept out after a restart")),
        )

    def claimed(self, key: str, suffix: str) -> bool:
        """True when ``<prefix>:{key}:<suffix>`` (a :meth:`claim`) holds a value on a quorum.

        One read (``GET`` on every master, decided as soon as the answer is certain);
        masters kept out after a restart are not counted. Raises
        :class:`QuorumUnavailable` when too few masters answer.
        """
        command = pack(("GET", self._claim_name(key, suffix)))
        return self._read_vote(key, lambda value: value is not None, command)

    def unclaim(self, key: str, suffix: str, value: str) -> bool:
        """Delete ``<prefix>:{key}:<suffix>`` where it holds ``value``; True if on a quorum.

        False when it held another value (or none) on a quorum. Raises
        :class:`QuorumUnavailable` when too few masters answered to tell: the claim may
        still stand, and the caller must not take it for gone.
        """
        name = self._claim_name(key, suffix)
        payload = (scripts.UNCLAIM.call(2, name, name + scripts.CLAIMED_BY, value), 1)
        with self._lane() as lane:
            result = self._round(lane, [payload] * len(self.masters))
        answered = sum(1 for x in result.replies if x is not None)
        if answered < self.quorum:
            raise QuorumUnavailable(
                f"only {answered} of {len(self.masters)} masters answered the removal of"
                f" the {suffix} claim on {key!r}, {self.quorum} needed",
                key,
                self.master_names,
                self._errors(result),
            )
        return sum(1 for x in result.replies if x is not None and x[0] == 1) >= self.quorum

    # -- keys ------------------------------------------------------------------

    @staticmethod
    def _check_companion(companion: tuple[str, str]) -> None:
        suffix, value = companion
        _own_suffix(suffix)
        if not isinstance(value, str):
            raise TypeError(f"a companion's value must be a str, got {value!r}")

    def _claim_name(self, key: str, suffix: str) -> str:
        # The lock's own name (prefix checked in __init__, key here, both cached) plus
        # the suffix: what redis_key(prefix, key, suffix) returns, without re-checking
        # the prefix on every claim.
        return f"{self._keys(key)[0]}:{_own_suffix(suffix)}"

    def lock_key(self, key: str) -> str:
        """The Redis key of the lock on ``key``."""
        return redis_key(self.key_prefix, key)

    def _keys(self, key: str) -> tuple[str, str, str]:
        """The lock, metadata and fence counter names of ``key`` (see :func:`redis_key`).

        Built here rather than by three :func:`redis_key` calls because this runs on
        every acquire, extend and release: the prefix was validated once, in
        ``__init__``, the suffixes are constants, and the names of recently used keys
        are kept.
        """
        names = self._names.get(key)
        if names is None:
            lock_key = f"{self.key_prefix}:{{{validate_key(key)}}}"
            names = (lock_key, lock_key + ":meta", lock_key + ":fence")
            if len(self._names) >= NAMES_CACHED:
                self._names.clear()
            self._names[key] = names
        return names

    # -- lanes -------------------------------------------------------------------

    def _new_lane(self) -> Lane:
        return Lane([Link(m) for m in self.masters], self._clock)

    def _lane(self, lane: Lane | None = None) -> Lane:
        """A lane for one operation, locked: ``with self._lane() as lane: ...``.

        ``lane`` asks for that one (waiting for it); otherwise the first idle lane
        is taken, or a new one opened. (A plain method returning the lane, whose
        ``__exit__`` unlocks it, rather than a generator context manager: this runs
        twice per acquire+release.)
        """
        if lane is not None:
            # An operation holds a lane for a round or two; one held far longer was left
            # locked by an exception (a signal's) that landed as it was given back, and
            # would hang this call for good: a fresh lane serves instead (its commands
            # were answered, or timed out, long ago).
            if lane.lock.acquire(timeout=8 * self.node_timeout + 1.0):
                if not lane.retired:
                    return lane
                # Closed as idle since (a lease's release on its acquire's lane): its
                # connections, and with them the order of its commands, are gone anyway.
                lane.lock.release()
            else:
                logger.warning("a connection lane stayed locked; another one is used")
        lanes = self._lanes
        if len(lanes) > IDLE_LANES_KEPT and self._clock() >= self._prune_at:
            self._close_idle_lanes()
        for candidate in lanes:
            if candidate.lock.acquire(blocking=False):
                if not candidate.retired:
                    return candidate
                candidate.lock.release()
        lane = self._new_lane()
        lane.lock.acquire()
        with self._lanes_lock:
            self._lanes.append(lane)
        return lane

    def _close_idle_lanes(self) -> None:
        """Close idle lanes beyond :data:`IDLE_LANES_KEPT` once idle :data:`LANE_IDLE` s.

        A burst of N threads opens N lanes (N connections per master); this gives them
        back. The first lanes of the list are the ones taken first, so the kept ones
        are the busiest. A closed lane is retired: its connections (and any late
        replies they owed) are dropped, and it is never handed out again.
        """
        now = self._clock()
        self._prune_at = now + min(LANE_IDLE, 1.0) / 4
        kept = 0
        retired: list[Lane] = []
        with self._lanes_lock:
            for lane in list(self._lanes):
                if not lane.lock.acquire(blocking=False):
                    continue  # busy
                if kept < IDLE_LANES_KEPT or now - lane.idle_since < LANE_IDLE:
                    kept += 1
                    lane.lock.release()
                    continue
                lane.retired = True
                retired.append(lane)
            if retired:
                self._lanes = [lane for lane in self._lanes if not lane.retired]
        for lane in retired:
            for link in lane.links:
                link.close()
            lane.lock.release()

    def _drift(self, ttl: float) -> float:
        return limits.drift(ttl, self.clock_drift_factor)

    def _default_renew_every(self, ttl: float) -> float:
        """``renew_every`` when not given: a third of ``ttl``, and never more than half
        the lease's validity (which binds only for a ``clock_drift_factor`` above about a
        third, or a TTL of a few ms)."""
        return max(min(ttl / 3, (ttl - self._drift(ttl)) / 2), limits.MIN_RENEW_EVERY)

    def _quarantined(self, now: float) -> set[int]:
        out: set[int] = set()
        if not master_mod.restarts_seen:
            return out  # the usual case, on every round: no master was ever seen to restart
        period = self.restart_quarantine
        if period is None:
            period = master_mod.longest_granted_ttl()
        for i, master in enumerate(self.masters):
            if master.restarted_at is not None and now < master.restarted_at + period:
                out.add(i)
        return out

    def _round(
        self,
        lane: Lane,
        payloads: Sequence[tuple[bytes, int] | None],
        decided: Callable[[RoundResult], bool] | None = None,
        *,
        wait_on_down: bool = False,
        awaiting: Mapping[int, Slot] | None = None,
        wait: bool = True,
        valid: Validator | None = None,
    ) -> RoundResult:
        """One round on ``lane`` (see :func:`.fanout.run_round`).

        ``valid`` says what replies to accept from a master; by default those of our
        scripts (an int, maybe followed by a fence pair). Any other reply counts as
        that master failing, never as a vote.
        """
        spin_wait = self.spin_wait
        # Polling pays while replies come quickly and a core is idle to poll on; with
        # every core busy it would take CPU from the masters and the task bodies.
        spin = (
            spin_wait
            if wait and spin_wait and self._reply_wait <= spin_wait and not waiting.cores_busy()
            else 0.0
        )
        result = run_round(
            lane.links,
            payloads,
            clock=self._clock,
            node_timeout=self.node_timeout,
            reconnect_backoff=self.reconnect_backoff,
            decided=decided,
            wait_on_down=wait_on_down,
            awaiting=awaiting,
            spin=spin,
            wait=wait,
            valid=valid or _script_replies,
        )
        if result.waited and spin_wait:
            # Polling pays while rounds usually wait no longer than spin_wait. A long
            # wait counts as 4 * spin_wait, so one timeout does not stop polling for
            # hundreds of rounds; a few in a row do. (Unlocked: threads racing here
            # only blur the average.)
            waited = min(result.waited, 4 * spin_wait)
            self._reply_wait += (waited - self._reply_wait) / 8
        return result

    def _note_unreached(self, result: RoundResult) -> None:
        """Count the masters a release could not reach; their logging is rate-limited."""
        for i, error in result.errors.items():
            self.masters[i].note_unreached(error)

    def _errors(
        self, result: RoundResult, extra: Mapping[int, str] | None = None
    ) -> dict[str, str]:
        errors = {self.masters[i].name: text for i, text in result.errors.items()}
        for i, text in (extra or {}).items():
            errors[self.masters[i].name] = text
        return errors

    # -- operations ----------------------------------------------------------------

    def _try_acquire(
        self,
        key: str,
        token: str,
        ttl: float,
        meta_args: Sequence[str],
        renew_every: float,
        max_hold: float | None,
        box: list[Lease],
    ) -> Lease:
        """One acquire attempt; the lease it wins also goes into ``box`` (see acquire)."""
        lock_key, meta_key, fence_key = self._keys(key)
        companion_key = f"{lock_key}:{_own_suffix(meta_args[0])}"
        ttl_ms = max(1, int(ttl * 1000))
        n, q = len(self.masters), self.quorum
        command = scripts.ACQUIRE.call(
            3, lock_key, meta_key, companion_key, token, ttl_ms, *meta_args[1:]
        )
        proposal = 0
        if key in self._fence_keys:
            # Holders of this key read the fence: commit one in the same round (the
            # FENCE script runs right after ACQUIRE on each master, so it finds the
            # lock ours exactly where ACQUIRE took it).
            proposal = _fence_proposal()
            command += scripts.FENCE.call(
                2, lock_key, fence_key, token, proposal, max(1, int(self.fence_ttl * 1000))
            )

        def undo_command() -> bytes:
            return scripts.RELEASE.call(3, lock_key, meta_key, meta_key, token, "")

        lane = self._lane()
        try:
            try:
                start = self._clock()
                quarantined = self._quarantined(start)
                payload = (command, 2 if proposal else 1)
                if quarantined:
                    payloads = [None if i in quarantined else payload for i in range(n)]
                else:
                    payloads = [payload] * n

                def decided(r: RoundResult) -> bool:
                    out = quarantined
                    if master_mod.restarts_seen:
                        # A link that reconnects during the round may find its master restarted.
                        out = quarantined | self._quarantined(self._clock())
                    ok = held = 0
                    for i, x in enumerate(r.replies):
                        if x is not None and i not in out:
                            if x[0] == 1:
                                ok += 1
                            else:
                                held += 1
                    unreachable = len(out | r.errors.keys()) if out else len(r.errors)
                    if ok >= q:
                        return True
                    # Stop once winning is impossible *and* contention can be told from an
                    # outage; stopping earlier would report a held key as unavailable.
                    return unreachable + held > n - q and (ok + held >= q or unreachable > n - q)

                result = self._round(lane, payloads, decided)
                if master_mod.restarts_seen:
                    quarantined |= self._quarantined(self._clock())
                landed: list[int] = []
                won: list[int] = []
                held: list[int] = []
                for i, x in enumerate(result.replies):
                    if x is not None:
                        if x[0] == 1:
                            landed.append(i)
                            if i not in quarantined:
                                won.append(i)
                        elif i not in quarantined:
                            held.append(i)
                deadline = start + ttl - self._drift(ttl)
                now = self._clock()
                if len(won) >= q and now < deadline:
                    lease = Lease(
                        self,
                        key,
                        token,
                        ttl,
                        deadline=deadline,
                        acquired_at=start,
                        lane=lane,
                        renew_every=renew_every,
                        max_hold=max_hold,
                        auto_renew=False,
                    )
                    box.append(lease)  # first, before anything a signal could interrupt
                    if proposal:
                        lease._eager_fence = (proposal, result.replies, result.late, quarantined)
                    return lease
                # Failed: undo wherever our SET may have landed. On a master that did
                # not answer, the release is queued behind the SET on the same link.
                undo = set(landed) | {i for i in result.errors if lane.links[i].connected}
                undo |= result.not_waited
                if undo:
                    release = (undo_command(), 1)
                    won_set = set(landed)
                    self._round(
                        lane,
                        [release if i in undo else None for i in range(n)],
                        lambda r: all(r.replies[i] is not None or i in r.errors for i in won_set),
                    )
            except BaseException as exc:
                _undo_interrupted(lane, undo_command, type(exc))
                raise
        finally:
            # Unlocked here rather than by Lane.__exit__: no Python call (where a signal's
            # exception could land first) stands between a won round and the unlock.
            lane.lock.release()
            lane.idle_since = self._clock()
        extra = dict.fromkeys(quarantined, "kept out after a restart")
        if len(won) >= q:
            raise QuorumUnavailable(
                f"acquired {key!r} on {len(won)} of {n} masters but it took "
                f"{now - start:.3f}s, longer than its validity",
                key,
                self.master_names,
                self._errors(result, extra),
            )
        if len(won) + len(held) < q:
            # Masters that did answer may not be counted here: the round stops as soon
            # as too many have failed for a quorum, so name the failed ones instead.
            reachable = n - len(result.errors) - len(quarantined)
            raise QuorumUnavailable(
                f"{key!r}: only {reachable} of {n} masters reachable, {q} needed",
                key,
                self.master_names,
                self._errors(result, extra),
            )
        raise LockContended(
            f"{key!r} is held by another owner ({len(held)} of {n} masters)",
            key,
            self.master_names,
            self._errors(result, extra),
        )

    def _release(self, lease: Lease, *, wait: bool = True) -> tuple[bool, bool]:
        """Delete the lease's lock where it is still ours.

        Returns (a quorum confirmed the deletion, a quorum answered it was not ours).
        """
        heartbeat.forget(lease)
        lock_key, meta_key, _ = self._keys(lease.key)
        suffix, value = lease.clear_on_release or ("dedupe", "")
        companion_key = f"{lock_key}:{_own_suffix(suffix)}"
        payload = (
            scripts.RELEASE.call(3, lock_key, meta_key, companion_key, lease.token, value),
            1,
        )
        n, q = len(self.masters), self.quorum

        def count(r: RoundResult) -> tuple[int, int]:
            return _tally(r, lambda x: x == 1)

        def decided(r: RoundResult) -> bool:
            deleted, refused = count(r)
            return deleted >= q or refused > n - q

        with self._lane(lease._lane) as lane:
            result = self._round(lane, [payload] * n, decided, wait=wait)
        # Not waited for, no reply is read: none is counted (every slot is left late).
        deleted, refused = count(result) if wait else (0, 0)
        if result.errors:
            # Per master, rate-limited: a master that stays down must not cost a log
            # line per release (thousands a second).
            self._note_unreached(result)
            if wait and deleted < q:
                # No quorum confirmed: this lock outlives the call (until its TTL).
                logger.warning(
                    "released %r on %d of %d masters, %d needed; it expires by itself "
                    "on the others; not reached: %s",
                    lease.key,
                    deleted,
                    len(self.masters),
                    q,
                    self._errors(result),
                )
        return deleted >= q, refused > n - q

    def _extend(self, lease: Lease, ttl: float) -> None:
        ttl = self._check_ttl("ttl", ttl)
        # Before the extension lock: in a forked child a parent's thread may have held it
        # at fork time (the child's copy then never unlocks), and the lease is not held here.
        lease.ensure_held()
        try:
            self._extend_held(lease, ttl)
        finally:
            if lease.auto_renew:
                # Also after a failure: a failed extension may have lowered the deadline
                # below the renewal the engine had planned.
                self._engine().reschedule(lease)

    def _extend_held(self, lease: Lease, ttl: float) -> None:
        lock_key, meta_key, _ = self._keys(lease.key)
        ttl_ms = max(1, int(ttl * 1000))
        n, q = len(self.masters), self.quorum
        with lease._ext_lock:  # one extension of a lease at a time (see Lease)
            start = self._clock()
            validity_end = start + ttl - self._drift(ttl)
            number = lease._begin_extension(validity_end, start)
            if not number:
                lease.ensure_held()  # raises: released, lost or expired
                raise LockLost(  # pragma: no cover - ensure_held raised
                    f"lease on {lease.key!r} is not held", lease.key, self.master_names
                )
            payload = (
                scripts.EXTEND.call(2, lock_key, meta_key, lease.token, ttl_ms, number),
                1,
            )
            with self._lane() as lane:
                quarantined = self._quarantined(start)

                def decided(r: RoundResult) -> bool:
                    ok, gone = _tally(r, _extended, quarantined)
                    return ok >= q or gone > n - q

                result = self._round(lane, [payload] * n, decided)
                quarantined |= self._quarantined(self._clock())
            ok, gone = _tally(result, _extended, quarantined)
            if ok >= q:
                self._granted(ttl)
                if lease._confirm_extension(number, validity_end, ttl, self._clock()):
                    return
            elif gone > n - q:
                lease._lose(f"{gone} of {n} masters no longer know this holder")
                raise LockLost(
                    f"lease on {lease.key!r} is lost: {gone} of {n} masters no longer know it",
                    lease.key,
                    self.master_names,
                )
        lease.ensure_held()
        raise QuorumUnavailable(
            f"extended {lease.key!r} on {ok} of {n} masters, {q} needed (the lease now ends "
            f"no later than this extension would have: {lease.remaining():.3f}s left)",
            lease.key,
            self.master_names,
            self._errors(result),
        )

    def _commit_fence(self, lease: Lease) -> int:
        self._remember_fence_key(lease.key)
        eager, lease._eager_fence = lease._eager_fence, None
        if eager is not None:
            fence = self._check_eager_fence(lease, *eager)
            if fence is not None:
                return fence
        lock_key, _, fence_key = self._keys(lease.key)
        n, q = len(self.masters), self.quorum
        fence_ttl_ms = max(1, int(self.fence_ttl * 1000))
        proposal = _fence_proposal()
        for _ in range(8):
            payload = (
                scripts.FENCE.call(2, lock_key, fence_key, lease.token, proposal, fence_ttl_ms),
                1,
            )
            with self._lane() as lane:
                quarantined = self._quarantined(self._clock())

                # No early stop at the first quorum: the token must exceed the counter
                # on every master that answers (a previous token lives on a majority,
                # which may not be the one that accepts this proposal first).
                result = self._round(lane, [payload] * n, valid=_fence_replies)
                quarantined |= self._quarantined(self._clock())
            accepted, not_owner, higher = _fence_votes(
                [x[0] if x else None for x in result.replies], proposal, quarantined
            )
            if accepted >= q and not higher:
                lease.ensure_held()
                return proposal
            if not_owner > n - q:
                lease._lose(f"{not_owner} of {n} masters no longer know this holder")
                lease.ensure_held()
            if not higher:
                raise QuorumUnavailable(
                    f"fence for {lease.key!r} committed on {accepted} of {n} masters, {q} needed",
                    lease.key,
                    self.master_names,
                    self._errors(result),
                )
            proposal = max(higher) + 1
            lease.ensure_held()
        raise QuorumUnavailable(  # pragma: no cover - needs 8 racing proposals in a row
            f"could not commit a fence for {lease.key!r}", lease.key, self.master_names
        )

    def _remember_fence_key(self, key: str) -> None:
        if not self.eager_fence_keys:
            return
        with self._fence_keys_lock:
            keys = self._fence_keys
            keys[key] = None
            keys.move_to_end(key)
            if len(keys) > self.eager_fence_keys:
                keys.popitem(last=False)

    def _check_eager_fence(
        self,
        lease: Lease,
        proposal: int,
        replies: list[list[object] | None],
        late: Mapping[int, Slot],
        quarantined: set[int],
    ) -> int | None:
        """The fence committed in the acquire round, or None to commit one now.

        The acquire round stopped at the first quorum; the other masters' replies
        (which also carry their counters) are collected first, so that, as in the
        separate round, every reachable master's counter is compared with the
        proposal. Usually they are already in the socket buffers.
        """
        n, q = len(self.masters), self.quorum
        replies = list(replies)
        if late:
            with self._lane(lease._lane) as lane:
                result = self._round(lane, [None] * n, awaiting=late)
            for i, x in enumerate(result.replies):
                if x is not None:
                    replies[i] = x
            quarantined = quarantined | self._quarantined(self._clock())
        accepted, _, higher = _fence_votes(
            [x[1] if x and len(x) > 1 else None for x in replies], proposal, quarantined
        )
        if higher or accepted < q:
            return None  # the separate round proposes again (past any higher counter)
        lease.ensure_held()
        return proposal

    def _renew_many(self, leases: Sequence[Lease], ttls: Sequence[float]) -> list[str]:
        """Extend ``leases[i]`` to ``ttls[i]`` on every master, in one round per
        :data:`RENEW_ROUND` leases.

        Returns, per lease, ``"ok"`` (a quorum extended it; its deadline moved),
        ``"gone"`` (a quorum no longer knows it) or an error text (try again). The
        caller holds each lease's ``_ext_lock``; each renewal is an extension of its
        lease (numbered, lowering the deadline until confirmed: see :class:`Lease`).

        This is the heartbeat's whole cost per tick, so it avoids per-lease work
        that can be done once: each lease's RESP-encoded keys and token are built
        on its first renewal and kept on the lease (they never change), and the
        votes are counted per master over the reply strings, not per lease.
        """
        if len(leases) <= RENEW_ROUND:
            return self._renew_round(leases, ttls)
        # One round per RENEW_ROUND leases, each numbered and timed as it is sent.
        outcomes: list[str] = []
        for lo in range(0, len(leases), RENEW_ROUND):
            part = slice(lo, lo + RENEW_ROUND)
            outcomes += self._renew_round(leases[part], ttls[part])
        return outcomes

    def _renew_round(self, leases: Sequence[Lease], ttls: Sequence[float]) -> list[str]:
        """:meth:`_renew_many` of at most :data:`RENEW_ROUND` leases, in one round."""
        start = self._clock()
        ends = [start + ttl - self._drift(ttl) for ttl in ttls]
        numbers = [
            lease._begin_extension(end, start) for lease, end in zip(leases, ends, strict=True)
        ]
        if all(numbers):
            return self._renew_numbered(leases, ttls, numbers, ends, start)
        # Leases no longer held (released meanwhile, or their validity ended before the
        # send) are not sent at all: nothing may renew them, and an extension without a
        # number would only be refused by every master.
        out = ["not held when its renewal was sent"] * len(leases)
        live = [j for j, number in enumerate(numbers) if number]
        if live:
            outcomes = self._renew_numbered(
                [leases[j] for j in live],
                [ttls[j] for j in live],
                [numbers[j] for j in live],
                [ends[j] for j in live],
                start,
            )
            for j, outcome in zip(live, outcomes, strict=True):
                out[j] = outcome
        return out

    def _renew_numbered(
        self,
        leases: Sequence[Lease],
        ttls: Sequence[float],
        numbers: Sequence[int],
        ends: Sequence[float],
        start: float,
    ) -> list[str]:
        """:meth:`_renew_many` of leases whose extensions are numbered (all held)."""
        n, q = len(self.masters), self.quorum
        commands: list[bytes] = []
        ttl_args: dict[float, bytes] = {}
        for lo in range(0, len(leases), RENEW_CHUNK):
            chunk = leases[lo : lo + RENEW_CHUNK]
            keys: list[bytes] = []
            args: list[bytes] = []
            for lease, ttl, number in zip(
                chunk, ttls[lo : lo + RENEW_CHUNK], numbers[lo : lo + RENEW_CHUNK], strict=True
            ):
                fragment = lease._renew_fragment
                if fragment is None:
                    lock_key, meta_key, _ = self._keys(lease.key)
                    fragment = lease._renew_fragment = (
                        wire_fragment((lock_key, meta_key)),
                        wire_fragment((lease.token,)),
                    )
                keys.append(fragment[0])
                args.append(fragment[1])
                ttl_arg = ttl_args.get(ttl)
                if ttl_arg is None:
                    ttl_arg = ttl_args[ttl] = wire_fragment((max(1, int(ttl * 1000)),))
                args.append(ttl_arg)
                args.append(wire_fragment((number,)))
            commands.append(
                b"*%d\r\n" % (3 + 5 * len(chunk))
                + scripts.EXTEND_MANY.head
                + wire_fragment((2 * len(chunk),))
                + b"".join(keys)
                + b"".join(args)
            )
        payload = (b"".join(commands), len(commands))
        if self._renew_lane is None:
            self._renew_lane = self._new_lane()
        count = len(leases)
        every = b"1" * count

        def split(r: RoundResult, quarantined: set[int]) -> tuple[int, list[tuple[int, bytes]]]:
            """The masters (outside ``quarantined``) that extended every lease (the usual
            reply: counted once for all), and the others' flags, to count lease by lease."""
            extended_all = 0
            mixed: list[tuple[int, bytes]] = []
            for i, replies in enumerate(r.replies):
                flags = _flags(replies)
                if flags is None or len(flags) != count:
                    continue
                if flags == every:
                    extended_all += i not in quarantined
                else:
                    mixed.append((i, flags))
            return extended_all, mixed

        def tally(
            extended_all: int, mixed: list[tuple[int, bytes]], quarantined: set[int]
        ) -> tuple[list[int], list[int]]:
            """Per lease, the masters that extended it (``ok``) and that said it is not
            ours there (``gone``)."""
            ok = [extended_all] * count
            gone = [0] * count
            for i, flags in mixed:
                for j, flag in enumerate(flags):
                    if flag == 49:  # b"1": extended on this master
                        if i not in quarantined:
                            ok[j] += 1
                    elif flag == 48:  # b"0": not ours there (b"2": a later extension was)
                        gone[j] += 1
            return ok, gone

        with self._lane(self._renew_lane) as lane:
            quarantined = self._quarantined(start)

            def decided(r: RoundResult) -> bool:
                # Every lease's outcome is certain: no need to wait for a slow master
                # (the engine's one thread renews every other lease of the process too).
                extended_all, mixed = split(r, quarantined)
                if extended_all >= q:
                    return True
                ok, gone = tally(extended_all, mixed, quarantined)
                return all(a >= q or g > n - q for a, g in zip(ok, gone, strict=True))

            result = self._round(lane, [payload] * n, decided, valid=_renew_replies)
            quarantined |= self._quarantined(self._clock())
        ok, gone = tally(*split(result, quarantined), quarantined)
        out: list[str] = []
        errors: str | None = None
        granted = 0.0
        for j, (lease, ttl) in enumerate(zip(leases, ttls, strict=True)):
            if ok[j] >= q:
                if ttl > granted:
                    granted = ttl
                    self._granted(ttl)
                if lease._confirm_extension(numbers[j], ends[j], None, self._clock()):
                    out.append("ok")
                else:  # its validity ended while the round ran: it stays not held
                    out.append("confirmed after its validity had ended")
            elif gone[j] > n - q:
                out.append("gone")
            else:
                if errors is None:
                    errors = str(self._errors(result))
                out.append(f"renewed on {ok[j]} of {n} masters ({q} needed); {errors}")
        return out

    def _after_fork_in_child(self) -> None:
        # The parent's sockets stay the parent's: forget them without a shutdown,
        # and replace locks that a parent thread may have held at fork time.
        self._lanes_lock = threading.Lock()
        for lane in self._lanes:
            lane.lock = threading.Lock()
            for link in lane.links:
                link.forget()
        self._lanes = []
        self._renew_lane = None
        self._fence_keys_lock = threading.Lock()


def _all_answered(result: RoundResult, excluded: Set[int], masters: Sequence[Master]) -> bool:
    """Whether every master outside ``excluded`` has answered, failed or is known down."""
    replies, errors = result.replies, result.errors
    for i, reply in enumerate(replies):
        if reply is None and i not in excluded and i not in errors and not masters[i].down:
            return False
    return True


def _by_one_other(result: RoundResult, excluded: Set[int], ours: bytes, own: bytes = b"") -> int:
    """The most masters (outside ``excluded``) on which one other call wrote ``ours``: a
    claim's replies say which call wrote the value each master holds (``CLAIM``). Where
    any copy carries no writer's id (an older client wrote it, or its id expired: written
    longer ago than a claim call lasts, by a finished claim), every copy found counts as
    one call's, as before ids were stored: only calls claiming at this moment are told
    apart. A copy under this call's own id (``own``) that the script did not take for its
    own (ceded to it with TTLs unlike its own, or its id beside a value written later) is
    neither: it is left out."""
    by = _writers(result, excluded, ours, own)
    if b"" in by:
        return sum(by.values())
    return max(by.values(), default=0)


def _writers(result: RoundResult, excluded: Set[int], ours: bytes, own: bytes) -> dict[bytes, int]:
    """How many copies of ``ours`` each other call wrote, by its id (b'' for none), outside
    ``excluded`` and leaving out copies under ``own`` (see :func:`_by_one_other`)."""
    by: dict[bytes, int] = {}
    for i, reply in enumerate(result.replies):
        if reply is not None and i not in excluded:
            first = reply[0]
            if type(first) is list and first[0] == ours and (first[1] != own or not own):
                by[first[1]] = by.get(first[1], 0) + 1
    return by


def _ceded_to(
    result: RoundResult,
    excluded: Set[int],
    ours: bytes,
    quorum: int,
    order: Callable[[], Sequence[int]],
    own: bytes,
) -> str | None:
    """The id of the call a declining claim of ``ours`` (its own id ``own``) declined for:
    '' when a copy has no id (all copies count as one call's then, see
    :func:`_by_one_other`), the call with a quorum of copies, else (a split) the one that
    wrote the first master in ``order()``.
    None when that is not known: a split with a master unheard (or in ``excluded``)."""
    by = _writers(result, excluded, ours, own)
    if b"" in by:
        return ""
    for writer, count in by.items():
        if count >= quorum:
            return writer.decode()
    if any(reply is None or i in excluded for i, reply in enumerate(result.replies)):
        return None
    for i in order():
        if i in excluded:
            continue
        first = result.replies[i][0]  # type: ignore[index]
        if first == 1:
            return None  # the first is ours: not declined by the order
        if type(first) is list and first[0] == ours:
            return first[1].decode()  # type: ignore[no-any-return]
    return None


def _claim_created(
    result: RoundResult,
    excluded: Set[int],
    ours: bytes,
    quorum: int,
    made: int,
    other: int,
    order: Callable[[], Sequence[int]],
) -> bool:
    """Whether a claim whose value ``ours`` holds a quorum stands for creating it: it
    wrote it on ``made`` masters, and one other call wrote it on ``other`` of those it
    found it on, no other call on more (:func:`_by_one_other`; counted outside
    ``excluded``).

    Made on a quorum: yes. Otherwise no when another call may have made it on a quorum:
    one call's masters, with those this call could not see (no reply, down, ``excluded``),
    reach a quorum (a finished claim's value, or a racing call that wrote a quorum where
    this one could not look; a copy written again on a master that had lost it is no new
    creation either). Otherwise the value was split between calls claiming it at once,
    none with a quorum (two calls, two masters each of four; three, one master each of
    three), and :func:`_created_first` elects one of them (``order()`` is asked only then).
    """
    if made >= quorum:
        return True
    if made == 0 or other >= quorum:
        return False
    unseen = sum(1 for i, reply in enumerate(result.replies) if reply is None or i in excluded)
    if other + unseen >= quorum:
        return False
    return _created_first(result, order(), excluded, ours, made)


def _created_first(
    result: RoundResult, order: Sequence[int], excluded: Set[int], ours: bytes, fresh: int
) -> bool:
    """Whether a claim whose value holds a quorum stands for creating it.

    Several calls claiming the same value at once (publishes of one job id) each create it
    on the masters they reach first, and each reads it as written by another call on the
    others: by its count alone none may have created it on a quorum, and every one would
    take the job for published by another. The call that created it on the first master
    holding it (in ``order``, which every client of these servers agrees on) stands for
    creating it; the others see that master's value as written by another call, first.
    When a master before that one gave no reply, the call cannot tell: it stands for
    creating it if it created the value anywhere (``fresh``), so that a race then costs a
    second publish, never the job.
    """
    replies = result.replies
    for i in order:
        if i in excluded:
            continue
        reply = replies[i]
        if reply is None:
            return fresh > 0
        first = reply[0]
        if first == 1:
            return True
        if type(first) is list and first[0] == ours:
            return False  # another call created it here
        # another value (a claim that lost the race) is no creation of ours: look further
    return fresh > 0


def _tally(
    result: RoundResult,
    vote: Callable[[object], bool | None],
    excluded: Set[int] = frozenset(),
    *,
    excluded_noes: bool = True,
) -> tuple[int, int]:
    """Count the masters whose first reply ``vote`` calls yes (True) and no (False).

    None counts neither way. A yes from a master in ``excluded`` (kept out after a
    restart) never counts; its no does unless ``excluded_noes`` is False (a read of who
    holds a key must not take a restarted master's empty answer as a "free").
    """
    ayes = noes = 0
    for i, replies in enumerate(result.replies):
        if replies is not None:
            answer = vote(replies[0])
            if answer is True:
                ayes += i not in excluded
            elif answer is False and (excluded_noes or i not in excluded):
                noes += 1
    return ayes, noes


def _holder_verdict(
    same: int, free: int, other: int, n: int, q: int, *, final: bool = True
) -> HolderState | None:
    """:meth:`Redlock.holder_state` from the masters counted (``same``: the lock is the
    matching holder's; ``free``: no lock; ``other``: anyone else's); None when it cannot
    be told. Before the round ends (not ``final``), None also while the masters still to
    answer could turn a ``"free"`` into ``"matches"``."""
    if same and same + free >= q:
        return "matches"
    if other > n - q:
        return "other"  # the matching holder and the free masters can no longer reach q
    if not same and free >= q and (final or free + other == n):
        return "free"
    return None


def _extended(reply: object) -> bool | None:
    """EXTEND's reply as a vote: 1 yes, 0 no (not ours), 2 neither (a later one applied)."""
    return True if reply == 1 else False if reply == 0 else None


def _own_suffix(suffix: str) -> str:
    """``suffix`` if a claim or a companion key may use it; ``ValueError`` otherwise.

    The lock's own keys (``meta``, ``fence``) are refused: a claim there would overwrite
    the lock's metadata or fence counter, a companion deleted with the lock would take
    the fence counter with it.
    """
    if suffix in _checked_suffixes:
        return suffix
    if suffix in RESERVED_SUFFIXES:
        raise ValueError(
            f"suffix {suffix!r} is the lock's own ({', '.join(sorted(RESERVED_SUFFIXES))}"
            " are reserved): a claim or companion there would overwrite its metadata or fence"
        )
    validate_suffix(suffix)
    if len(_checked_suffixes) >= NAMES_CACHED:
        _checked_suffixes.clear()
    _checked_suffixes.add(suffix)
    return suffix


#: Suffixes :func:`_own_suffix` accepted (a few per task: checked once, not per call).
_checked_suffixes: set[str] = set()


def _fence_proposal() -> int:
    # Seeded from the wall clock (microseconds) so that a counter lost with a
    # restarted master, or expired, still yields larger tokens than before.
    return max(1, time.time_ns() // 1000)


def _fence_votes(
    replies: Sequence[object], proposal: int, quarantined: set[int]
) -> tuple[int, int, list[int]]:
    """Count FENCE replies, one per master (None where there is none).

    Returns (masters outside quarantine that accepted the proposal, masters where the
    lock is not ours, counters at or above the proposal). The last also come from
    masters where we are not the holder: they may carry the last token handed out.
    """
    accepted = not_owner = 0
    higher: list[int] = []
    for i, reply in enumerate(replies):
        if not isinstance(reply, list) or len(reply) < 2:
            continue
        code, value = int(reply[0]), int(reply[1])
        if code == 1:
            accepted += i not in quarantined
            continue
        not_owner += code == 0
        if value >= proposal:
            higher.append(value)
    return accepted, not_owner, higher


def _script_replies(replies: list[object]) -> bool:
    """Replies of ACQUIRE, RELEASE, RELEASE_OWNER, EXTEND, UNCLAIM (an int), each maybe
    followed by FENCE's (a list of two ints), as the acquire round sends them."""
    if type(replies[0]) is not int:
        return False
    return len(replies) == 1 or all(_fence_reply(x) for x in replies[1:])


def _fence_reply(reply: object) -> bool:
    return (
        isinstance(reply, list)
        and len(reply) == 2
        and type(reply[0]) is int
        and type(reply[1]) is int
    )


def _pong(replies: list[object]) -> bool:
    return replies == [b"PONG"]


def _fence_replies(replies: list[object]) -> bool:
    return all(_fence_reply(x) for x in replies)


def _claim_replies(replies: list[object]) -> bool:
    """CLAIM returns 1, or the value that holds the claim and the id of the call that
    wrote it (two strings)."""
    for x in replies:
        if x == 1 and type(x) is int:
            continue
        if not (
            type(x) is list and len(x) == 2 and isinstance(x[0], bytes) and isinstance(x[1], bytes)
        ):
            return False
    return True


def _holder_replies(replies: list[object]) -> bool:
    """GET of the lock, then HMGET of its metadata (a list of strings or nils)."""
    return (
        len(replies) == 2
        and (replies[0] is None or isinstance(replies[0], bytes))
        and isinstance(replies[1], list)
        and all(x is None or isinstance(x, bytes) for x in replies[1])
    )


def _get_replies(replies: list[object]) -> bool:
    return all(x is None or isinstance(x, bytes) for x in replies)


def _renew_replies(replies: list[object]) -> bool:
    """EXTEND_MANY returns a string of '0', '1' and '2', one per lease."""
    return all(isinstance(x, bytes) and not x.strip(b"012") for x in replies)


def _flags(replies: list[object] | None) -> bytes | None:
    """The b'1'/b'0' flags of one master's EXTEND_MANY replies, joined; None if unusable."""
    if not replies or not all(isinstance(r, bytes) for r in replies):
        return None
    return b"".join(r for r in replies if isinstance(r, bytes))


def _after_fork_in_child() -> None:
    for instance in list(_instances):
        instance._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

"""Test-only Redlock subclasses that write what the lock does into the history.

:class:`InstrumentedRedlock` is the real lock with recording at its seams (``_round``,
``_try_acquire``, ``_release``, ``_extend``, ``_commit_fence``, ``_renew_many``, and the
lease's ``_begin_extension``/``_confirm_extension``/``_lose``). It changes no decision of
the lock.

:class:`BrokenRedlock` is the negative control: the lock a careful engineer must be able to
tell apart from ours. It models the fixed-expiry "cookbook" lock this project replaces:

* release is a plain ``DEL`` of the key on every master (no owner check), so a holder whose
  key expired deletes the next holder's lock;
* no validity check: its lease is held until released, whatever its deadline says, and it
  is never renewed (nothing to renew: it believes it holds the lock).

Every round to the masters is recorded as an ``rpc`` event with its duration and its bound:
``node_timeout`` for the round, plus, per master the round (re)connects to, a TCP connect
and a handshake reply (``2 * node_timeout``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from celery_redlock.lock import Lease, Redlock
from celery_redlock.lock.fanout import Lane, RoundResult
from celery_redlock.lock.lease import HELD, RELEASED
from celery_redlock.lock.wire import pack

from .history import History, ns

__all__ = ["BrokenRedlock", "InstrumentedLease", "InstrumentedRedlock", "lease_id"]

_tls = threading.local()


def lease_id(lease: Lease) -> str:
    """A short name for a lease in the history (its token is random and unique)."""
    return lease.token[:12]


def _codes(result: RoundResult, payloads: Sequence[object]) -> str:
    out = []
    for i, payload in enumerate(payloads):
        if payload is None:
            out.append("-")
        elif i in result.errors:
            out.append("E")
        elif i in result.not_waited:
            out.append("w")
        else:
            replies = result.replies[i]
            first = replies[0] if replies else None
            if isinstance(first, list) and first:
                first = first[0]
            if isinstance(first, bytes):
                first = first[:4].decode(errors="replace")
            out.append(str(first) if first is not None else "?")
    return "".join(out) if all(len(c) == 1 for c in out) else ",".join(out)


class InstrumentedLease(Lease):
    """A :class:`Lease` that records renewals and its loss. Adds no state (no slots)."""

    __slots__ = ()

    def _begin_extension(self, validity_end: float, now: float) -> int:
        before = self._deadline
        number = super()._begin_extension(validity_end, now)
        if number and self._deadline < before:
            # Lowered when sent (a shorter extension): from now on the lease believes in
            # the earlier deadline (recorded after the move: later than it was, which can
            # only show more overlap).
            self._record(self._deadline)
        return number

    def _confirm_extension(
        self, number: int, validity_end: float, ttl: float | None, now: float
    ) -> bool:
        # Recorded *before* the deadline moves: the checker then believes the lease valid
        # slightly earlier than it was, never later, which can only show more overlap.
        if self._state == HELD and number == self._ext_sent and now < self._deadline:
            self._record(validity_end)
        return super()._confirm_extension(number, validity_end, ttl, now)

    def _record(self, deadline: float) -> None:
        self.redlock.history.write(  # type: ignore[attr-defined]
            "renew", key=self.key, lease=lease_id(self), deadline_ns=ns(deadline)
        )

    def _lose(self, reason: str) -> bool:
        lost = super()._lose(reason)
        if lost:
            self.redlock.history.write(  # type: ignore[attr-defined]
                "lost", key=self.key, lease=lease_id(self), reason=reason[:120]
            )
        return lost


class BrokenLease(InstrumentedLease):
    """Held until released, whatever its validity (negative control)."""

    __slots__ = ()

    @property
    def held(self) -> bool:
        return self._state != RELEASED

    def remaining(self) -> float:
        return float("inf") if self._state != RELEASED else 0.0


class InstrumentedRedlock(Redlock):
    """The real :class:`Redlock`, recording every round and operation."""

    lease_class: type[Lease] = InstrumentedLease
    #: the deadline the holder believes in, for the history (None = never expires)
    believes_deadline = True

    def __init__(self, masters: Any, *, history: History, **kwargs: Any) -> None:
        super().__init__(masters, **kwargs)
        self.history = history

    @contextlib.contextmanager
    def _op(self, name: str) -> Iterator[None]:
        previous = getattr(_tls, "op", None)
        _tls.op = name
        started = time.monotonic_ns()
        try:
            yield
        finally:
            _tls.op = previous
            self.history.write("op", op=name, dur_ns=time.monotonic_ns() - started)

    def _round(
        self,
        lane: Lane,
        payloads: Sequence[tuple[bytes, int] | None],
        decided: Callable[[RoundResult], bool] | None = None,
        **options: Any,
    ) -> RoundResult:
        now = self._clock()
        connects = sum(
            1
            for i, payload in enumerate(payloads)
            if payload is not None
            and not lane.links[i].connected
            and not lane.links[i].master.probing
            and now >= lane.links[i].master.connect_after
        )
        started = time.monotonic_ns()
        result = super()._round(lane, payloads, decided, **options)
        took = time.monotonic_ns() - started
        self.history.write(
            "rpc",
            op=getattr(_tls, "op", None) or "other",
            dur_ns=took,
            bound_ns=int(self.node_timeout * (1 + 2 * connects) * 1e9),
            connects=connects,
            codes=_codes(result, payloads),
        )
        _tls.codes = _codes(result, payloads)
        return result

    def _try_acquire(self, *args: Any, **kwargs: Any) -> Lease:
        with self._op("acquire"):
            lease = super()._try_acquire(*args, **kwargs)
        lease.__class__ = self.lease_class
        return lease

    def _release(self, lease: Lease, *, wait: bool = True) -> tuple[bool, bool]:
        with self._op("release"):
            return super()._release(lease, wait=wait)

    def _extend(self, lease: Lease, ttl: float) -> None:
        with self._op("extend"):
            super()._extend(lease, ttl)

    def _commit_fence(self, lease: Lease) -> int:
        with self._op("fence"):
            return super()._commit_fence(lease)

    def _renew_many(self, leases: Sequence[Lease], ttls: Sequence[float]) -> list[str]:
        with self._op("renew"):
            return super()._renew_many(leases, ttls)

    @staticmethod
    def last_codes() -> str:
        """Per-master reply codes of this thread's last round (the votes)."""
        return str(getattr(_tls, "codes", ""))


class BrokenRedlock(InstrumentedRedlock):
    """Negative control: plain ``DEL`` release, lease held regardless of validity."""

    lease_class = BrokenLease
    believes_deadline = False

    def _release(self, lease: Lease, *, wait: bool = True) -> tuple[bool, bool]:
        from celery_redlock.lock.heartbeat import forget

        forget(lease)
        lock_key, meta_key, _ = self._keys(lease.key)
        payload = (pack(("DEL", lock_key, meta_key)), 1)
        with self._op("release"), self._lane(lease._lane) as lane:
            result = self._round(lane, [payload] * len(self.masters))
        return sum(1 for x in result.replies if x is not None) >= self.quorum, False

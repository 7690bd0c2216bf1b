"""The :class:`Lease`: what a holder gets back from :meth:`Redlock.acquire`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..exceptions import LockLost
from . import process

if TYPE_CHECKING:
    from .fanout import Lane
    from .master import Slot
    from .redlock import Redlock

__all__ = ["Lease"]

logger = logging.getLogger("celery_redlock.lock")

HELD, RELEASED, LOST = "held", "released", "lost"

LostCallback = Callable[["Lease"], Any]


class Lease:
    """A held Redlock on one key, valid until a monotonic deadline.

    ``held`` and ``remaining()`` are answered locally: the deadline is computed
    when a quorum confirmed the lock (``ttl - elapsed - drift``) and moved only by
    a successful extension. A lease belongs to the process that acquired it: in a
    forked child it is never held and releasing it there does nothing.
    """

    __slots__ = (
        "__weakref__",
        "_callbacks",
        "_deadline",
        "_eager_fence",
        "_fence",
        "_fence_lock",
        "_lane",
        "_mutex",
        "_pid",
        "_renew_fragment",
        "_state",
        "acquired_at",
        "auto_renew",
        "clear_on_release",
        "key",
        "lost_reason",
        "max_hold",
        "redlock",
        "renew_every",
        "token",
        "ttl",
    )

    def __init__(
        self,
        redlock: Redlock,
        key: str,
        token: str,
        ttl: float,
        *,
        deadline: float,
        acquired_at: float,
        lane: Lane,
        renew_every: float,
        max_hold: float | None,
        auto_renew: bool,
    ) -> None:
        self.redlock = redlock
        self.key = key
        #: random 128-bit value identifying this holder on the masters
        self.token = token
        self.ttl = ttl
        self.acquired_at = acquired_at
        self.renew_every = renew_every
        self.max_hold = max_hold
        self.auto_renew = auto_renew
        #: ``(suffix, value)``: on release, also delete ``<prefix>:{key}:<suffix>``
        #: where it holds ``value`` (same atomic step)
        self.clear_on_release: tuple[str, str] | None = None
        #: why the lease was lost, once it is
        self.lost_reason: str | None = None
        self._deadline = deadline
        self._lane = lane
        self._pid = process.pid()
        self._state = HELD
        self._fence: int | None = None
        #: (proposal, replies, late slots, quarantined) when the acquire round also
        #: committed a fence; checked on first read of :attr:`fence`
        self._eager_fence: (
            tuple[int, list[list[object] | None], dict[int, Slot], set[int]] | None
        ) = None
        #: the RESP-encoded (keys, token) of this lease in a renewal, built on first use
        self._renew_fragment: tuple[bytes, bytes] | None = None
        self._callbacks: list[LostCallback] = []
        # Re-entrant: reading `fence` holds it while a failed commit marks the lease lost.
        self._mutex = threading.RLock()
        # Held across the fence round trip; _mutex is not, because that round may
        # mark the lease lost (_lose takes _mutex) and the renewal engine must never
        # wait on one lease's network call. Made on first read (most leases never
        # read the fence), under _mutex.
        self._fence_lock: threading.Lock | None = None

    def __repr__(self) -> str:
        return f"<Lease {self.key!r} {self.state} remaining={self.remaining():.3f}s>"

    @property
    def state(self) -> str:
        """``"held"``, ``"released"`` or ``"lost"`` (expiry alone does not change it)."""
        return self._state

    @property
    def held(self) -> bool:
        """True while the lease is neither released nor lost and its validity lasts."""
        return (
            self._state == HELD
            and self._pid == process.pid()
            and self.redlock._clock() < self._deadline
        )

    def remaining(self) -> float:
        """Seconds of validity left (0.0 once released, lost or expired)."""
        if self._state != HELD or self._pid != process.pid():
            return 0.0
        return max(0.0, self._deadline - self.redlock._clock())

    @property
    def deadline(self) -> float:
        """The monotonic time at which the validity ends."""
        return self._deadline

    def ensure_held(self) -> None:
        """Raise :class:`LockLost` unless the lease is held right now."""
        if not self.held:
            reason = self.lost_reason or (
                "released" if self._state == RELEASED else "validity ran out"
            )
            raise LockLost(
                f"lease on {self.key!r} is not held: {reason}",
                self.key,
                self.redlock.master_names,
            )

    @property
    def fence(self) -> int:
        """The fencing token: strictly larger than any earlier holder's of this key.

        Committed on a quorum on first read, while the lock is held (one round
        trip; later reads are free). Raises :class:`LockLost` when the lease is
        no longer held and :class:`QuorumUnavailable` when too few masters answer.
        """
        if self._fence is not None:
            return self._fence
        if self._fence_lock is None:
            with self._mutex:
                if self._fence_lock is None:
                    self._fence_lock = threading.Lock()
        with self._fence_lock:
            if self._fence is None:
                self.ensure_held()
                self._fence = self.redlock._commit_fence(self)
            return self._fence

    def extend(self, ttl: float | None = None) -> None:
        """Reset the lock's TTL on the masters to ``ttl`` (default: the lease's TTL).

        Raises :class:`LockLost` when the lease is not held or a quorum no longer
        knows it, :class:`QuorumUnavailable` when too few masters answer (the
        lease keeps its current deadline then).
        """
        self.ensure_held()
        self.redlock._extend(self, self.ttl if ttl is None else ttl)

    def release(self, *, wait: bool = True) -> bool:
        """Delete the lock on every master where it is still ours.

        Never raises because masters are unreachable (they are logged). Returns
        True when a quorum confirmed the deletion. Releasing a lease twice, or
        an expired one, never touches another holder's lock.

        ``wait=False`` writes the release to every master and returns at once
        (False: unconfirmed); the replies are read by the next call on the same
        connections, which Redis runs after the release. For a caller that has
        nothing left to order after the release (a task body that returned).
        """
        if self._pid != process.pid():
            logger.debug("not releasing %r: it belongs to process %d", self.key, self._pid)
            return False
        with self._mutex:
            if self._state == RELEASED:
                return False
            self._state = RELEASED
        return self.redlock._release(self, wait=wait)

    def on_lost(self, callback: LostCallback) -> None:
        """Call ``callback(lease)`` once if the lease is lost while held.

        Callbacks run on a helper thread, never inside the renewal engine; an
        exception in one is logged. Registered on a lease already lost, the
        callback is scheduled at once.
        """
        with self._mutex:
            if self._state != LOST:
                self._callbacks.append(callback)
                return
        from .heartbeat import dispatch_lost

        dispatch_lost(self, [callback])

    def _set_deadline(self, deadline: float, ttl: float | None = None) -> bool:
        """Move the deadline after a confirmed extension; False if no longer held."""
        with self._mutex:
            if self._state != HELD:
                return False
            self._deadline = max(self._deadline, deadline)
            if ttl is not None:
                self.ttl = ttl
            return True

    def _lose(self, reason: str) -> bool:
        """Mark the lease lost (once); schedules the callbacks. Returns True if it was held."""
        with self._mutex:
            if self._state != HELD:
                return False
            self._state = LOST
            self.lost_reason = reason
            callbacks, self._callbacks = self._callbacks, []
        logger.warning("lost the lock on %r: %s", self.key, reason)
        from .heartbeat import dispatch_lost

        dispatch_lost(self, callbacks)
        return True

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

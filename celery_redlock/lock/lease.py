"""The :class:`Lease`: what a holder gets back from :meth:`Redlock.acquire`."""

from __future__ import annotations

import logging
import threading
from types import TracebackType
from typing import TYPE_CHECKING

from ..exceptions import LockLost
from ..redact import guard, scrub
from . import process
from .callbacks import LostCallback, dispatch_lost

if TYPE_CHECKING:
    from .fanout import Lane
    from .master import Slot
    from .redlock import Redlock

__all__ = ["Lease"]

logger = guard(logging.getLogger("celery_redlock.lock"))  # see celery_redlock.redact

HELD, RELEASED, LOST = "held", "released", "lost"


class Lease:
    """A held Redlock on one key, valid until a monotonic deadline.

    ``held`` and ``remaining()`` are answered locally: the deadline is computed
    when a quorum confirmed the lock (``ttl - elapsed - drift``). A lease belongs to
    the process that acquired it: in a forked child it is never held and releasing
    it there does nothing.

    The deadline, the state and the extension count have one writer: the methods
    ``_begin_extension``, ``_confirm_extension``, ``_lose`` and ``release`` of this
    object, each under ``_mutex``. The rule that keeps the deadline safe, whatever the
    order in which extensions reach the masters::

        send of extension k (ttl t, sent at s): deadline = min(deadline, s + t - drift)
        quorum confirms k, no later one sent:   deadline = s + t - drift   (even if shorter)
        an extension that fails:                 the lowered deadline stays

    and on the masters an extension carries ``k``: a master that already applied a later
    one refuses it (a delayed ``PEXPIRE`` can never shorten the key behind the holder's
    back, nor lengthen it past what the holder believes).
    """

    __slots__ = (
        "__weakref__",
        "_callbacks",
        "_clear_on_release",
        "_deadline",
        "_eager_fence",
        "_ext_lock",
        "_ext_sent",
        "_fence",
        "_fence_lock",
        "_lane",
        "_loss_reported",
        "_mutex",
        "_pid",
        "_release_unsent",
        "_renew_every_default",
        "_renew_fragment",
        "_state",
        "acquired_at",
        "auto_renew",
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
        renew_every_default: bool = True,
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
        self._clear_on_release: tuple[str, str] | None = None
        #: why the lease was lost, once it is
        self.lost_reason: str | None = None
        self._deadline = deadline
        #: the number of the last extension sent (0: none); see the class docstring
        self._ext_sent = 0
        #: held across one extension round, so that extensions of one lease are sent and
        #: confirmed one at a time (the renewal engine only tries it: it never waits)
        self._ext_lock = threading.Lock()
        #: renew_every was not given: it follows the TTL (ttl / 3) when extend() changes it
        self._renew_every_default = renew_every_default
        self._lane = lane
        self._pid = process.pid()
        self._state = HELD
        #: a lost callback logs the loss itself (see on_lost): _lose does not repeat it
        self._loss_reported = False
        #: the thread whose release may not have been written yet (0: none): sending, or
        #: cut short by an exception (a signal's). That thread's next release() or block
        #: exit sends it again; another thread's release() meanwhile is a second release
        #: (False at once), never a second round racing the first.
        self._release_unsent = 0
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
    def clear_on_release(self) -> tuple[str, str] | None:
        """``(suffix, value)``: on release, also delete ``<prefix>:{key}:<suffix>`` where it
        holds ``value`` (same atomic step). Checked when set (``ValueError`` for the lock's
        own suffixes), so that release itself never raises for it."""
        return self._clear_on_release

    @clear_on_release.setter
    def clear_on_release(self, companion: tuple[str, str] | None) -> None:
        if companion is not None:
            self.redlock._check_companion(companion)
        self._clear_on_release = companion

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
        trip; later reads are answered locally). Raises :class:`LockLost` when the
        lease is no longer held (released, lost, expired, or in a forked child), also
        after an earlier read succeeded, and :class:`QuorumUnavailable` when too few
        masters answer.
        """
        fence = self._fence
        if fence is not None:
            self.ensure_held()
            return fence
        if self._fence_lock is None:
            with self._mutex:
                if self._fence_lock is None:
                    self._fence_lock = threading.Lock()
        with self._fence_lock:
            if self._fence is None:
                self.ensure_held()
                self._fence = self.redlock._commit_fence(self)
            return self._fence

    @property
    def fence_committed(self) -> bool:
        """Whether :attr:`fence` was committed (read once with success): a
        :class:`QuorumUnavailable` raised after that came from another round."""
        return self._fence is not None

    def extend(self, ttl: float | None = None) -> None:
        """Set the lock's remaining time on the masters to ``ttl`` seconds (default: the
        lease's TTL), shorter or longer than what is left.

        After a confirmed extension the lease's deadline is exactly that extension's
        validity, measured from before its send. ``ttl`` becomes the lease's TTL (what
        the renewal engine renews to), and a ``renew_every`` that was not given follows
        it (``ttl / 3``). Raises :class:`LockLost` when the lease is not held or a quorum
        no longer knows it, :class:`QuorumUnavailable` when too few masters answer (the
        deadline is then the earlier of the old one and the new ``ttl``'s: the masters
        that did apply it may expire the key that soon).
        """
        self.redlock._extend(self, self.ttl if ttl is None else ttl)

    def owned(self) -> bool:
        """Ask the masters whether this lease's token still holds the key on a quorum.

        redis-py's ``Lock.owned()``: one read on every master, not the local clock (see
        :attr:`held`). False without asking once the lease was released, or in a forked
        child. Raises :class:`QuorumUnavailable` when too few masters answer to tell.
        """
        if self._pid != process.pid() or self._state == RELEASED:
            return False
        return self.redlock._owned(self)

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
        me = threading.get_ident()
        with self._mutex:
            if self._state == RELEASED and self._release_unsent != me:
                return False
            self._state = RELEASED
            self._release_unsent = me
        return self._send_release(wait)[0]

    def _send_release(self, wait: bool = True) -> tuple[bool, bool]:
        """Release on the masters. An exception that cuts this short (a soft time limit,
        a revoke's signal) leaves ``_release_unsent`` set, so the release is sent again
        by the next :meth:`release` or the block's exit instead of the lock standing,
        held by nobody, for its TTL. Releasing by token twice never touches another
        holder's lock."""
        outcome = self.redlock._release(self, wait=wait)
        self._release_unsent = 0
        return outcome

    def on_lost(self, callback: LostCallback, *, reports_loss: bool = False) -> None:
        """Call ``callback(lease)`` once if the lease is lost while held.

        Callbacks run on a helper thread, never inside the renewal engine; an
        exception in one is logged. Registered on a lease already lost, the
        callback is scheduled at once.

        The loss is logged once, at WARNING: by the lease, or with
        ``reports_loss=True`` by the callback, which then says it with more context
        (SingletonTask names the task and its policy); the lease's own line drops to
        DEBUG.
        """
        with self._mutex:
            if reports_loss:
                self._loss_reported = True
            if self._state != LOST:
                self._callbacks.append(callback)
                return
        dispatch_lost(self, [callback])

    def _begin_extension(self, validity_end: float, now: float) -> int:
        """Number the extension about to be sent and lower the deadline to its end.

        ``validity_end`` is what the extension gives if confirmed (``sent + ttl -
        drift``). Until it is, the masters that apply it may expire the key that soon, so
        the deadline becomes the earlier of the two. Returns the extension's number, 0
        when the lease is no longer held at ``now``, the time the extension is measured
        from (nothing to send: a lease whose validity ended never reads held again, even
        if its key is still on the masters).
        """
        with self._mutex:
            if self._state != HELD or now >= self._deadline:
                return 0
            self._ext_sent += 1
            if validity_end < self._deadline:
                self._deadline = validity_end
            return self._ext_sent

    def _confirm_extension(
        self, number: int, validity_end: float, ttl: float | None, now: float
    ) -> bool:
        """A quorum applied extension ``number``: the deadline becomes ``validity_end``.

        Only for the last extension sent: an earlier one's late confirmation never
        undoes a later one (whose send already lowered the deadline). ``ttl`` (a user's
        ``extend``) becomes the lease's TTL; the renewal engine's own renewals pass None.
        Returns False when the lease is no longer held at ``now`` (the confirmation came
        after its validity ended: it never reads held again) or a later extension was sent.
        """
        with self._mutex:
            if self._state != HELD or number != self._ext_sent or now >= self._deadline:
                return False
            self._deadline = validity_end
            if ttl is not None and ttl != self.ttl:
                self.ttl = ttl
                # A renew_every given for a longer TTL may not fit this one's validity: a
                # renewal due after it would always come too late (the lease lost while
                # its key lives on).
                if self._renew_every_default or self.renew_every >= ttl - self.redlock._drift(ttl):
                    self.renew_every = self.redlock._default_renew_every(ttl)
            return True

    def _lose(self, reason: str) -> bool:
        """Mark the lease lost (once); schedules the callbacks. Returns True if it was held."""
        with self._mutex:
            if self._state != HELD:
                return False
            self._state = LOST
            self.lost_reason = scrub(reason)  # an error text: shown in signals and logs
            callbacks, self._callbacks = self._callbacks, []
        log = logger.debug if self._loss_reported else logger.warning
        log("lost the lock on %r: %s", self.key, reason)
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
        """Release; raise :class:`LockLost` if the lease was lost inside the block.

        Lost means: no longer held when the block ends (the renewal engine lost it, its
        validity ran out) or a quorum of masters answering the release that the lock was
        no longer this lease's (redis-py raises ``LockNotOwnedError`` there). A block
        that released the lease itself ends quietly. When the block is already raising,
        the loss is logged (and noted on that exception) but never replaces it.
        """
        if self._pid != process.pid():
            return
        if self._state == RELEASED:
            if self._release_unsent == threading.get_ident():  # a release() cut short
                self._send_release()
            return
        was_held = self.held
        reason = self.lost_reason or "its validity ran out"
        with self._mutex:
            if self._state == RELEASED:
                return
            self._state = RELEASED
            self._release_unsent = threading.get_ident()
        _, refused = self._send_release()
        if was_held and not refused:
            return
        if was_held:
            reason = "a quorum of masters no longer held it at release"
        lost = LockLost(
            f"lease on {self.key!r} was lost inside the block: {reason}",
            self.key,
            self.redlock.master_names,
        )
        if exc is None:
            raise lost
        logger.warning("%s (not raised: the block is raising %r)", lost, exc)
        add_note = getattr(exc, "add_note", None)
        if add_note is not None:  # Python 3.11+
            add_note(f"celery_redlock: {lost}")

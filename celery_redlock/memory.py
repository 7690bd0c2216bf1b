"""An in-process lock backend for unit tests: ``redlock_backend = "memory"``.

:class:`MemoryRedlock` answers every operation the Celery layer and the operator calls
use (acquire, extend, release, claim, unclaim, locked, fence, holder, owned_by,
holder_state, release_token, release_owned_by, force_delete) from a dictionary in this
process, with the semantics of the Redis backend: TTLs on the monotonic clock, locks not
re-entrant, claims held by one value, fence tokens that only increase. No Redis is needed,
so eager tasks (``task_always_eager``) and in-process test workers run without masters.

It is not shared between processes: two ``celery worker`` processes (or two prefork pool
children, each with its own copy) would each see their own locks and run the same key at
once. So a real worker (``celery worker``) and beat
refuse it with :class:`~celery_redlock.exceptions.ImproperlyConfigured` unless
``redlock_backend_force = True``.

A lease taken with ``auto_renew`` never lapses while held (there is no network to fail
its renewals), up to ``max_hold``; one without it expires after its TTL.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

from .exceptions import ImproperlyConfigured, LockContended, LockLost
from .keys import validate_prefix
from .lock import limits, process
from .lock.lease import Lease
from .lock.master import MasterStatus
from .lock.redlock import CheckedNumbers, HolderState, Redlock

__all__ = ["MemoryRedlock", "refuse_in_shared_process"]

_FOREVER = float("inf")


class MemoryRedlock(Redlock):
    """A :class:`Redlock` whose one "master" is a dictionary in this process.

    A subclass so that everything typed for :class:`Redlock` takes it; it never calls
    :meth:`Redlock.__init__` (no masters, no connections) and overrides every method that
    would reach a master.
    """

    #: read by the CLI, which has nothing to show for an in-process store
    in_process = True

    def __init__(
        self, *, key_prefix: str = "redlock", clock: Callable[[], float] = time.monotonic
    ) -> None:
        validate_prefix(key_prefix)
        self.key_prefix = key_prefix
        self._clock = clock
        self.masters = []
        self.quorum = 1
        self.node_timeout = limits.MIN_NODE_TIMEOUT
        self.clock_drift_factor = 0.0
        self.restart_quarantine = None
        self._mutex = threading.RLock()
        #: Redis key name -> (value, monotonic expiry)
        self._values: dict[str, tuple[str, float]] = {}
        #: Redis key name of a lock's metadata -> its fields
        self._meta: dict[str, dict[str, str]] = {}
        #: lock key -> last fencing token handed out (never forgotten: tokens only grow)
        self._fences: dict[str, int] = {}
        self._fence_seed = itertools.count(1)
        #: lock key -> its Redis key names (see Redlock._keys, which claims use too)
        self._names: dict[str, tuple[str, str, str]] = {}
        self._checked_numbers: dict[tuple[object, ...], CheckedNumbers] = {}
        self._checked_claims: dict[tuple[object, ...], tuple[float, float | None]] = {}
        #: Redis key name of a lock -> its lease, so that deleting its key by another way
        #: (``clear_lock``, a revoke's release) makes an auto-renewed one lost, as the Redis
        #: backend's next renewal would (one without renewal reads held until its TTL there
        #: too)
        self._leases: weakref.WeakValueDictionary[str, Lease] = weakref.WeakValueDictionary()

    def __repr__(self) -> str:
        return f"<MemoryRedlock prefix {self.key_prefix!r}: {len(self._values)} keys>"

    @property
    def master_names(self) -> list[str]:
        return ["memory"]

    # -- the store -------------------------------------------------------------------

    def _get(self, name: str) -> str | None:
        """The live value of ``name`` (expired ones are dropped); call under ``_mutex``."""
        entry = self._values.get(name)
        if entry is None:
            return None
        if self._clock() >= entry[1]:
            del self._values[name]
            self._meta.pop(f"{name}:meta", None)
            return None
        return entry[0]

    def _delete_if(self, name: str, value: str) -> bool:
        if self._get(name) != value:
            return False
        del self._values[name]
        self._meta.pop(f"{name}:meta", None)
        return True

    # -- locks -----------------------------------------------------------------------

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
        """:meth:`Redlock.acquire`, in this process (same arguments, same errors)."""
        checked = self._acquire_arguments(
            key, ttl, blocking_timeout, max_hold, renew_every, meta, clear_companion, auto_renew
        )
        ttl, blocking_timeout, max_hold = checked.ttl, checked.blocking_timeout, checked.max_hold
        name = self.lock_key(key)
        deadline = None if blocking_timeout is None else self._clock() + blocking_timeout
        while True:
            with self._mutex:
                if self._get(name) is None:
                    now = self._clock()
                    if auto_renew:
                        expiry = now + max_hold if max_hold is not None else _FOREVER
                    else:
                        expiry = now + ttl
                    token = process.token_hex()
                    self._values[name] = (token, expiry)
                    self._meta[f"{name}:meta"] = checked.fields
                    # As the Redis backend's eager fence: a key whose holders read fences
                    # gets its fence committed in the acquire itself (it stands even if the
                    # lock is deleted before the holder reads it).
                    eager = self._next_fence(key) if key in self._fences else None
                    if clear_companion is not None:
                        self._delete_if(
                            self._claim_name(key, clear_companion[0]), clear_companion[1]
                        )
                    break
            if deadline is not None and self._clock() >= deadline:
                raise LockContended(f"{key!r} is held", key, self.master_names)
            time.sleep(0.01)
        lease = Lease(
            self,
            key,
            token,
            ttl,
            deadline=expiry,
            acquired_at=now,
            lane=cast("Any", None),
            renew_every=checked.renew_every,
            max_hold=max_hold,
            auto_renew=auto_renew,
            renew_every_default=checked.renew_every_default,
        )
        lease._fence = eager
        with self._mutex:
            if self._values.get(name, ("", 0.0))[0] == token:
                self._leases[name] = lease
        return lease

    def _release(self, lease: Lease, *, wait: bool = True) -> tuple[bool, bool]:
        name = self.lock_key(lease.key)
        with self._mutex:
            deleted = self._delete_if(name, lease.token)
            if deleted and lease.clear_on_release is not None:
                suffix, value = lease.clear_on_release
                self._delete_if(self._claim_name(lease.key, suffix), value)
        return deleted, not deleted

    def _extend(self, lease: Lease, ttl: float) -> None:
        ttl = self._check_ttl("ttl", ttl)
        lease.ensure_held()
        name = self.lock_key(lease.key)
        with self._mutex:
            now = self._clock()
            if self._get(name) != lease.token:
                lease._lose("the key is no longer this lease's")
                raise LockLost(f"lease on {lease.key!r} was lost", lease.key, self.master_names)
            end = self._values[name][1] if lease.auto_renew else now + ttl
            number = lease._begin_extension(end, now)
            self._values[name] = (lease.token, end)
            lease._confirm_extension(number, end, ttl, now)

    def _owned(self, lease: Lease) -> bool:
        with self._mutex:
            return self._get(self.lock_key(lease.key)) == lease.token

    def _commit_fence(self, lease: Lease) -> int:
        with self._mutex:
            lease.ensure_held()
            if self._get(self.lock_key(lease.key)) != lease.token:
                raise LockLost(f"lease on {lease.key!r} is not held", lease.key, self.master_names)
            return self._next_fence(lease.key)

    def _next_fence(self, key: str) -> int:
        """Commit the next fence of ``key`` (under ``_mutex``)."""
        fence = max(self._fences.get(key, 0), next(self._fence_seed)) + 1
        self._fences[key] = fence
        return fence

    def locked(self, key: str) -> bool:
        with self._mutex:
            return self._get(self.lock_key(key)) is not None

    def release_owned_by(self, key: str, field: str, value: str) -> bool:
        name = self.lock_key(key)
        with self._mutex:
            token = self._get(name)
            if token is None or self._meta.get(f"{name}:meta", {}).get(field) != value:
                return False
            deleted = self._delete_if(name, token)
            lease = self._orphan(name, token) if deleted else None
        if lease is not None:
            lease._lose("its key was deleted by another process's release")
        return deleted

    def holder(self, key: str, fields: Sequence[str]) -> tuple[str, dict[str, str]] | None:
        """:meth:`Redlock.holder`, in this process (a field not stored reads ``""``)."""
        if not fields:
            raise ValueError("holder: name at least one metadata field")
        name = self.lock_key(key)
        with self._mutex:
            token = self._get(name)
            if token is None:
                return None
            meta = self._meta.get(f"{name}:meta", {})
            return token, {field: meta.get(field, "") for field in fields}

    def release_token(self, key: str, token: str) -> bool:
        """:meth:`Redlock.release_token`, in this process (its lease, if any, is lost)."""
        name = self.lock_key(key)
        with self._mutex:
            deleted = self._delete_if(name, token)
            lease = self._orphan(name, token) if deleted else None
        if lease is not None:
            lease._lose("its key was deleted by another process's release")
        return deleted

    def holder_state(self, key: str, field: str, value: str) -> HolderState:
        """:meth:`Redlock.holder_state`, in this process (one copy: never a mix, so
        ``"matches"`` only while that holder's lock stands)."""
        name = self.lock_key(key)
        with self._mutex:
            if self._get(name) is None:
                return "free"
            if self._meta.get(f"{name}:meta", {}).get(field) == value:
                return "matches"
            return "other"

    def owned_by(self, key: str, field: str, value: str) -> bool:
        """:meth:`Redlock.owned_by`, in this process."""
        return self.holder_state(key, field, value) == "matches"

    def force_delete(self, names: Iterable[str]) -> list[str]:
        """:meth:`Redlock.force_delete`, in this process: the names that existed (a lock's
        metadata exists while its lock does, when it has fields), all deleted."""
        lost = []
        with self._mutex:
            present = {name for name in names if self._exists(name)}
            for name in present:
                entry = self._values.pop(name, None)
                self._meta.pop(name, None)
                lease = self._orphan(name, entry[0]) if entry is not None else None
                if lease is not None:
                    lost.append(lease)
        for lease in lost:
            lease._lose("its key was deleted (clear_lock / force_delete)")
        return sorted(present)

    def _orphan(self, name: str, token: str) -> Lease | None:
        """The auto-renewed lease of lock ``name`` with ``token``, whose key was just
        deleted by some other way than its own release, for the caller to make lost
        outside ``_mutex`` (as the Redis backend's next renewal would); under ``_mutex``."""
        lease = self._leases.pop(name, None)
        if lease is not None and lease.token == token and lease.auto_renew:
            return lease
        return None

    def _exists(self, name: str) -> bool:
        # Under _mutex.
        if self._get(name) is not None:
            return True
        lock = name.removesuffix(":meta")
        return lock != name and bool(self._meta.get(name)) and self._get(lock) is not None

    # -- claims ----------------------------------------------------------------------

    def claim(
        self,
        key: str,
        suffix: str,
        value: str,
        ttl: float,
        *,
        guard_for: float | None = None,
    ) -> tuple[str, bool]:
        """:meth:`Redlock.claim`, in this process."""
        name, ttl, _ = self._claim_arguments(key, suffix, ttl, guard_for)
        with self._mutex:
            holder = self._get(name)
            if holder is not None:
                return holder, False
            self._values[name] = (value, self._clock() + ttl)
            return value, True

    def claimed(self, key: str, suffix: str) -> bool:
        """:meth:`Redlock.claimed`, in this process."""
        with self._mutex:
            return self._get(self._claim_name(key, suffix)) is not None

    def unclaim(self, key: str, suffix: str, value: str) -> bool:
        with self._mutex:
            return self._delete_if(self._claim_name(key, suffix), value)

    # -- what has no meaning here -----------------------------------------------------

    def close(self) -> None:
        """Nothing to close."""

    def check_masters(self) -> list[MasterStatus]:
        return []

    def _granted(self, ttl: float) -> None:
        """No master can restart: nothing to quarantine."""


def refuse_in_shared_process(backend_force: bool, where: str) -> None:
    """Raise :class:`ImproperlyConfigured` for the memory backend in ``where`` (a real
    worker or beat), unless ``redlock_backend_force`` is set."""
    if backend_force:
        return
    raise ImproperlyConfigured(
        f"redlock_backend (Django: CELERY_REDLOCK_BACKEND) is 'memory', which keeps locks "
        f"inside one process: {where} would share them with no other worker, so two runs "
        "of one key could overlap. Use it for unit tests (task_always_eager, in-process "
        "test workers); set redlock_backend='redis' here, or redlock_backend_force=True if "
        "you really mean one process"
    )

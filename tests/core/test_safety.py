"""Regression tests for the ways to get two holders (or a silent engine) found on afa3165.

Each test failed on afa3165: the local deadline after a shorter ``extend`` or a ``max_hold``
renewal, the renewal engine killed by one argument or by a custom clock, NaN and absurd
numbers accepted, and the API surprises against redis-py's ``Lock`` (``with`` exit after a
loss, ``fence`` after release, ``locked``/``owned``, claims over the lock's own keys).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redlock.exceptions import (
    ImproperlyConfigured,
    LockContended,
    LockLost,
    QuorumUnavailable,
)
from celery_redlock.lock import Lease, Redlock, heartbeat
from celery_redlock.testing import Masters, wait_for

from . import helpers
from .helpers import keys_on, lock_name, make_redlock

#: What a loaded 2-core machine may add to a deadline.
SLACK = 0.3


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


def first_acquire_while(rl: Redlock, key: str, lease: Lease, timeout: float) -> Lease:
    """Take ``key`` through ``rl`` as soon as it frees; assert ``lease`` no longer reads
    as held at that moment (the one promise: never two holders within validity)."""
    deadline = time.monotonic() + timeout
    while True:
        held_before = lease.held
        try:
            other = rl.acquire(key, 5)
        except LockContended:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
            continue
        assert not held_before, (
            f"two holders: the first lease read held={held_before}, "
            f"remaining={lease.remaining():.3f}s, when the second acquired"
        )
        assert not lease.held
        return other


# -- the deadline follows the last confirmed extension, also when it is shorter ---------------


def test_extend_to_a_shorter_ttl_shortens_the_local_deadline(masters: Masters) -> None:
    first, second = make_redlock(masters), make_redlock(masters)
    lease = first.acquire("job", 30)
    sent = time.monotonic()
    lease.extend(2)
    assert lease.remaining() <= 2 - (time.monotonic() - sent) + 0.001
    assert lease.ttl == 2
    first_acquire_while(second, "job", lease, timeout=2 + 2 * SLACK)


def test_a_failed_shorter_extension_still_lowers_the_deadline(masters: Masters) -> None:
    # Two of three masters stopped: the extension reaches one master, no quorum. That
    # master may have applied it (it did), so the lease cannot be believed past it.
    rl = make_redlock(masters, node_timeout=0.05)
    lease = rl.acquire("short", 30)
    masters[1].pause()
    masters[2].pause()
    try:
        with pytest.raises(QuorumUnavailable):
            lease.extend(1)
        assert lease.remaining() <= 1.0
    finally:
        masters[1].resume()
        masters[2].resume()


def test_renewal_follows_a_shorter_ttl(masters: Masters) -> None:
    # renew_every was ttl/3 = 10 s; after extend(1) it must follow the new TTL, and the
    # engine must not wait for the renewal it had planned for the 30 s lease.
    rl = make_redlock(masters)
    lease = rl.acquire("follow", 30, auto_renew=True)
    lease.extend(1)
    assert lease.renew_every == pytest.approx(1 / 3)
    end = time.monotonic() + 2.5
    while time.monotonic() < end:
        assert lease.held, f"lost: {lease.lost_reason}"
        time.sleep(0.02)
    assert lease.remaining() <= 1.0
    lease.release()


def test_max_hold_below_ttl_never_outlives_the_masters(masters: Masters) -> None:
    # The engine's last renewal asks only for what is left of max_hold (less than the
    # TTL): the masters expire the key then, so the lease must stop reading held.
    first, second = make_redlock(masters), make_redlock(masters)
    lease = first.acquire("capped", 10, auto_renew=True, renew_every=0.3, max_hold=1.5)
    first_acquire_while(second, "capped", lease, timeout=1.5 + 10 * SLACK)


def test_an_explicit_renew_every_longer_than_the_new_ttl_follows_it(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("explicit", 30, auto_renew=True, renew_every=5)
    lease.extend(10)
    assert lease.renew_every == 5  # given, and still below the TTL: kept
    lease.extend(3)
    assert lease.renew_every == pytest.approx(1.0)
    lease.release()


# -- the renewal engine cannot be killed --------------------------------------------------------


def test_a_huge_ttl_is_refused_before_it_reaches_the_engine(masters: Masters) -> None:
    rl = make_redlock(masters)
    with pytest.raises(ValueError, match=r"ttl must be a finite number in \[0.01, 86400\]"):
        rl.acquire("big", 1e11, auto_renew=True)
    assert not any(keys_on(s) for s in masters)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_thread_is_started_again(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    rl = make_redlock(masters)
    engine = heartbeat.engine()
    first = rl.acquire("before", 1, auto_renew=True, renew_every=0.1)

    class Killed(BaseException):
        pass

    original = heartbeat.Heartbeat._take_due
    kills = []

    def die_once(self: heartbeat.Heartbeat) -> Any:
        if not kills:
            kills.append(1)
            raise Killed  # nothing in the loop catches a BaseException: the thread ends
        return original(self)

    monkeypatch.setattr(heartbeat.Heartbeat, "_take_due", die_once)
    with engine._cond:
        engine._cond.notify()
    wait_for(lambda: not engine.alive(), timeout=2)
    lease = rl.acquire("after", 1, auto_renew=True, renew_every=0.1)
    assert engine.alive()
    assert engine.restarts >= 1
    end = time.monotonic() + 2
    while time.monotonic() < end:
        assert lease.held
        assert first.held
        time.sleep(0.02)
    lease.release()
    first.release()


def test_a_custom_clock_reaches_the_engine(masters: Masters) -> None:
    # A client on its own clock (here one running at half speed): its deadlines are times
    # on that clock; an engine comparing them with time.monotonic() lost the lease at once.
    def slow() -> float:
        return time.monotonic() / 2

    rl = make_redlock(masters, clock=slow)
    lease = rl.acquire("clocked", 1, auto_renew=True, renew_every=0.2)
    end = time.monotonic() + 2
    while time.monotonic() < end:
        assert lease.held, f"lost: {lease.lost_reason}"
        time.sleep(0.02)
    lease.release()


# -- every duration and factor is finite and within its range ---------------------------------


NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("arguments", "name"),
    [
        ({"ttl": NAN}, "ttl"),
        ({"ttl": INF}, "ttl"),
        ({"ttl": 1e12}, "ttl"),
        ({"ttl": 10, "renew_every": NAN}, "renew_every"),
        ({"ttl": 10, "renew_every": 1e-6}, "renew_every"),
        ({"ttl": 10, "blocking_timeout": NAN}, "blocking_timeout"),
        ({"ttl": 10, "blocking_timeout": INF}, "blocking_timeout"),
        ({"ttl": 10, "max_hold": NAN}, "max_hold"),
        ({"ttl": 10, "max_hold": -1}, "max_hold"),
    ],
)
def test_acquire_refuses_non_finite_and_absurd_numbers(
    arguments: dict[str, Any], name: str
) -> None:
    rl = make_redlock(["redis://127.0.0.1:1/0"])  # never reached: refused before any round
    ttl = arguments.pop("ttl")
    with pytest.raises(ValueError, match=rf"^{name} must be a finite number in [\[(]"):
        rl.acquire("k", ttl, **arguments)


@pytest.mark.parametrize(
    ("arguments", "name"),
    [
        ({"node_timeout": NAN}, "node_timeout"),
        ({"node_timeout": INF}, "node_timeout"),
        ({"clock_drift_factor": NAN}, "clock_drift_factor"),
        ({"fence_ttl": NAN}, "fence_ttl"),
        ({"restart_quarantine": INF}, "restart_quarantine"),
        ({"spin_wait": NAN}, "spin_wait"),
    ],
)
def test_client_refuses_non_finite_numbers(arguments: dict[str, Any], name: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=rf"^{name} must be a finite number") as raised:
        Redlock(["redis://127.0.0.1:1/0"], **arguments)
    assert isinstance(raised.value, ValueError)


def test_extend_and_claim_refuse_bad_numbers(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("k", 5)
    for bad in (NAN, INF, 1e12, 0):
        with pytest.raises(ValueError, match="ttl must be a finite number"):
            lease.extend(bad)
        with pytest.raises(ValueError, match="ttl must be a finite number"):
            rl.claim("c", "run", "me", bad)
    assert lease.held
    lease.release()


# -- the API as redis-py and pottery users expect it --------------------------------------------


def test_leaving_the_block_after_a_loss_raises_lock_lost(masters: Masters) -> None:
    rl = make_redlock(masters)
    with pytest.raises(LockLost, match="lost inside the block"), rl.lock("gone", 0.5):
        wait_for(lambda: all(not keys_on(s) for s in masters), timeout=2)
    with pytest.raises(LockLost, match="no longer held it at release"), rl.lock("deleted", 30):
        # an operator deletes it: the clock still says held
        all(server.client().delete(lock_name("deleted")) for server in masters)


def test_a_loss_never_masks_the_blocks_own_exception(
    masters: Masters, caplog: pytest.LogCaptureFixture
) -> None:
    rl = make_redlock(masters)
    with pytest.raises(KeyError, match="body"), rl.lock("masked", 0.5):  # noqa: PT012
        wait_for(lambda: all(not keys_on(s) for s in masters), timeout=2)
        raise KeyError("body")
    assert "lost inside the block" in caplog.text


def test_a_block_that_releases_itself_leaves_quietly(masters: Masters) -> None:
    rl = make_redlock(masters)
    with rl.lock("own", 5) as lease:
        assert lease.release() is True


def test_fence_raises_after_release_and_loss(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("fenced", 5)
    fence = lease.fence
    assert lease.fence == fence  # cached while held
    lease.release()
    with pytest.raises(LockLost):
        _ = lease.fence
    short = rl.acquire("expiring", 0.3)
    _ = short.fence
    wait_for(lambda: not short.held, timeout=2)
    with pytest.raises(LockLost):
        _ = short.fence


def test_fence_raises_in_a_forked_child(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("forked", 5)
    _ = lease.fence

    def read_fence() -> bytes:
        try:
            _ = lease.fence
        except LockLost:
            return b"lost"
        return b"returned"

    assert helpers.in_child(read_fence) == b"lost"
    assert lease.held
    lease.release()


def test_locked_and_owned(masters: Masters) -> None:
    mine, other = make_redlock(masters), make_redlock(masters)
    assert mine.locked("k") is False
    lease = mine.acquire("k", 5)
    assert mine.locked("k") is True  # also for the holder itself
    assert other.locked("k") is True
    assert lease.owned() is True
    for server in masters:
        server.client().set(lock_name("k"), "someone else")
    assert lease.held  # the local clock cannot know
    assert lease.owned() is False
    lease.release()
    assert lease.owned() is False


@pytest.mark.parametrize("suffix", ["meta", "fence"])
def test_claims_cannot_overwrite_the_locks_own_keys(masters: Masters, suffix: str) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("k", 5)
    _ = lease.fence
    with pytest.raises(ValueError, match="reserved"):
        rl.claim("k", suffix, "x", 10)
    with pytest.raises(ValueError, match="reserved"):
        rl.unclaim("k", suffix, "x")
    assert lease.fence > 0
    lease.release()


def test_concurrent_extends_of_one_lease_keep_the_last_confirmed(masters: Masters) -> None:
    # Threads extending one lease to different TTLs: whatever order they run in, the
    # deadline is the one of the extension confirmed last, never the longest.
    rl, other = make_redlock(masters), make_redlock(masters)
    lease = rl.acquire("many", 30)
    ttls = [30, 1, 20, 1.5, 25, 2]
    barrier = threading.Barrier(len(ttls))
    errors: list[BaseException] = []

    def extend(ttl: float) -> None:
        barrier.wait()
        try:
            lease.extend(ttl)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=extend, args=(t,)) for t in ttls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not errors
    assert lease.remaining() <= lease.ttl
    first_acquire_while(other, "many", lease, timeout=lease.ttl + 2 * SLACK)

"""The renewal engine: one thread per process keeps auto-renewed leases alive, or says
when it cannot (``held`` turns false, ``on_lost`` runs once)."""

from __future__ import annotations

import json
import logging
import random
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from celery_redlock.exceptions import LockContended, LockLost
from celery_redlock.lock import Lease, engine
from celery_redlock.lock.heartbeat import COMPACT_SLACK, Heartbeat
from celery_redlock.lock.lease import LOST
from celery_redlock.testing import Masters, wait_for

from . import helpers
from .helpers import keys_on, lock_name, make_redlock, value_on

#: What a loaded 2-core machine may add to a deadline.
SLACK = 0.3


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


def stays_held(lease: Lease, seconds: float) -> float:
    """Check ``lease.held`` every 10 ms for ``seconds``; return the least validity seen."""
    end = time.monotonic() + seconds
    least = lease.remaining()
    while time.monotonic() < end:
        assert lease.held, f"lost: {lease.lost_reason}"
        least = min(least, lease.remaining())
        time.sleep(0.01)
    return least


class Calls:
    """An ``on_lost`` callback that counts."""

    def __init__(self) -> None:
        self.leases: list[Lease] = []
        self.at: list[float] = []

    def __call__(self, lease: Lease) -> None:
        self.leases.append(lease)
        self.at.append(time.monotonic())


def stays_at_one(calls: Calls, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert len(calls.leases) == 1
        time.sleep(0.01)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_renewed_lease_outlives_its_ttl_and_stays_exclusive(masters: Masters) -> None:
    holder = make_redlock(masters)
    rival = make_redlock(masters)
    renewals = engine().renewals
    lease = holder.acquire("long", 1, auto_renew=True)
    end = time.monotonic() + 10
    refusals = 0
    while time.monotonic() < end:
        with pytest.raises(LockContended):
            rival.acquire("long", 1, blocking_timeout=0.25)
        refusals += 1
        assert lease.held
        for server in masters:
            with server.client() as conn:
                assert 0 < conn.pttl(lock_name("long")) <= 1000  # renewed to ttl, no more
    assert refusals >= 20
    assert engine().renewals - renewals >= 20  # ttl/3 = 333 ms for 10 s
    assert lease.release() is True


@pytest.mark.chaos
@pytest.mark.parametrize("masters", [3, 5], indirect=True)
def test_minority_killed_mid_renewal_still_held(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("minority", 1, auto_renew=True)
    stays_held(lease, 0.5)
    for server in masters[: (len(masters) - 1) // 2]:
        server.kill()
    assert stays_held(lease, 2.5) > 0.3  # more than twice the TTL, renewed on the rest
    lease.extend()
    assert lease.release() is True


@pytest.mark.chaos
@pytest.mark.parametrize("masters", [1, 3, 5], indirect=True)
def test_majority_killed_lease_lost_within_validity(masters: Masters) -> None:
    rl = make_redlock(masters)
    calls = Calls()
    lease = rl.acquire("majority", 1, auto_renew=True)
    lease.on_lost(calls)
    stays_held(lease, 0.4)
    for server in masters[: len(masters) // 2 + 1]:
        server.kill()
    killed_at = time.monotonic()
    wait_for(lambda: lease.state == "lost", timeout=1 + SLACK)
    # Lost when its validity ran out, not later (and renewals could not move it).
    assert time.monotonic() <= lease.deadline + SLACK
    assert lease.deadline <= killed_at + 1
    assert not lease.held
    assert "could not renew" in (lease.lost_reason or "")
    with pytest.raises(LockLost, match="could not renew"):
        lease.ensure_held()
    wait_for(lambda: calls.leases, timeout=1)
    assert calls.leases == [lease]
    assert lease not in engine().leases()
    stays_at_one(calls, 0.5)
    late = Calls()
    lease.on_lost(late)  # registered after the loss: called at once, once
    wait_for(lambda: late.leases, timeout=1)
    assert lease.release() is False


@pytest.mark.parametrize("masters", [3], indirect=True)
@pytest.mark.parametrize("how", ["deleted", "overwritten"])
def test_key_taken_away_is_noticed_within_one_interval(masters: Masters, how: str) -> None:
    rl = make_redlock(masters)
    calls = Calls()
    renew_every = 0.3
    lease = rl.acquire("away", 5, auto_renew=True, renew_every=renew_every)
    lease.on_lost(calls)
    for server in masters[:2]:  # a quorum
        with server.client() as conn:
            if how == "deleted":
                conn.delete(lock_name("away"))
            else:
                conn.set(lock_name("away"), "somebody-else", px=5000)
    taken_at = time.monotonic()
    wait_for(lambda: lease.state == "lost", timeout=renew_every + SLACK)
    assert time.monotonic() - taken_at <= renew_every + SLACK
    assert lease.remaining() == 0.0
    assert "no longer knows" in (lease.lost_reason or "")
    wait_for(lambda: calls.leases, timeout=1)
    stays_at_one(calls, 2 * renew_every)
    assert lease.release() is False  # not ours anywhere that counts
    if how == "overwritten":
        for server in masters[:2]:
            assert value_on(server, lock_name("away")) == "somebody-else"


@pytest.mark.chaos
@pytest.mark.parametrize("masters", [3], indirect=True)
def test_paused_master_does_not_stall_renewal(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("paused", 1, auto_renew=True)
    other = rl.acquire("paused-2", 1, auto_renew=True, renew_every=0.2)
    renewals = engine().renewals
    masters[0].pause()
    try:
        assert stays_held(lease, 3) > 0.2
        assert other.held
    finally:
        masters[0].resume()
    assert engine().renewals - renewals >= 2 * 3 / 0.35
    assert lease.release() is True
    assert other.release() is True


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_release_during_renewal_never_leaves_the_key(masters: Masters) -> None:
    rl = make_redlock(masters)
    rng = random.Random(7)
    renewals = engine().renewals
    keys = [f"race-{i}" for i in range(150)]
    for key in keys:
        lease = rl.acquire(key, 2, auto_renew=True, renew_every=0.01)
        time.sleep(rng.uniform(0, 0.02))  # release at a random moment of the renewal cycle
        assert lease.release() is True
    assert engine().renewals - renewals >= 50  # renewals did run during the loop
    # A key left behind would live its 2 s TTL; all must be gone long before that.
    wait_for(lambda: all(not keys_on(s) for s in masters), timeout=0.5)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_max_hold_stops_renewal(masters: Masters) -> None:
    rl = make_redlock(masters)
    calls = Calls()
    max_hold = 1.6
    lease = rl.acquire("bounded", 1, auto_renew=True, renew_every=0.2, max_hold=max_hold)
    lease.on_lost(calls)
    end_of_hold = lease.acquired_at + max_hold
    stays_held(lease, 1.3 - (time.monotonic() - lease.acquired_at))  # past its ttl: renewed
    wait_for(lambda: lease.state == "lost", timeout=end_of_hold + SLACK - time.monotonic())
    assert time.monotonic() >= end_of_hold - 0.25  # not before max_hold (minus a last slice)
    assert "max_hold" in (lease.lost_reason or "")
    with pytest.raises(LockLost, match="max_hold"):
        lease.ensure_held()
    wait_for(lambda: all(value_on(s, lock_name("bounded")) is None for s in masters), timeout=1)
    assert time.monotonic() <= end_of_hold + SLACK
    wait_for(lambda: calls.leases, timeout=1)
    assert calls.leases == [lease]


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_max_hold_of_many_leases_needs_no_thread_per_lease(masters: Masters) -> None:
    rl = make_redlock(masters)
    engine()  # the engine thread exists before counting
    threads = threading.active_count()
    leases = [
        rl.acquire(f"capped-{i}", 1, auto_renew=True, renew_every=0.2, max_hold=0.9)
        for i in range(200)
    ]
    most = threads
    end = time.monotonic() + 3
    while time.monotonic() < end and any(lease.state == "held" for lease in leases):
        most = max(most, threading.active_count())
        time.sleep(0.005)
    assert all("max_hold" in (lease.lost_reason or "") for lease in leases)
    assert most <= threads + 1  # at most the callback dispatcher besides the engine
    assert all(lease.acquired_at + 0.9 - 0.25 <= lease.deadline for lease in leases)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_no_thread_or_socket_leak_over_10000_cycles(masters: Masters) -> None:
    rl = make_redlock(masters)
    for _ in range(20):  # warm up: the engine thread and one lane of connections exist
        lease = rl.acquire("cycle", 5, auto_renew=True)
        lease.extend()
        lease.release()
    threads = threading.active_count()
    fds = helpers.open_fds()
    with masters[0].client() as conn:
        clients = len(conn.client_list())
    heap_peak = 0
    for _ in range(10_000):
        lease = rl.acquire("cycle", 5, auto_renew=True)
        lease.extend()
        assert lease.release() is True
        heap_peak = max(heap_peak, len(engine()._heap))
    # Released leases do not pile up in the renewal heap until their renewal comes due.
    assert heap_peak <= 2 * len(engine()) + COMPACT_SLACK + 1
    assert threading.active_count() <= threads
    assert helpers.open_fds() <= fds
    with masters[0].client() as conn:
        assert len(conn.client_list()) <= clients
    assert all(lease.key != "cycle" for lease in engine().leases())


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_short_leases_do_not_wake_the_engine_each(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker running short tasks adds and releases a lease per task, none of them due
    before the engine's next look: the engine thread is not woken for each (it was, two
    context switches per task). A lease due sooner than that look still wakes it."""
    from celery_redlock.lock import heartbeat

    beat = Heartbeat()
    monkeypatch.setattr(heartbeat, "_engine", beat)
    try:
        rl = make_redlock(masters)
        for i in range(200):
            lease = rl.acquire(f"short-{i}", 30, auto_renew=True)
            assert lease.release() is True
        assert beat.wakeups <= 3, beat.wakeups
        assert beat.renewals == 0
        # Idle until a lease of 10 s intervals comes up: this one is due in 0.2 s.
        soon = rl.acquire("soon", 3, auto_renew=True, renew_every=0.2)
        wait_for(lambda: beat.renewals >= 3, timeout=5, message="renewals of 'soon'")
        assert soon.release() is True
    finally:
        beat.stop()


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_one_engine_thread_for_1000_leases(masters: Masters) -> None:
    rl = make_redlock(masters)
    threads = threading.active_count()
    engine_ = engine()
    leases = [rl.acquire(f"many-{i}", 3, auto_renew=True, renew_every=1) for i in range(1000)]
    assert threading.active_count() <= threads + 2  # the engine and the callback dispatcher
    renewals, ticks = engine_.renewals, engine_.ticks
    wait_for(lambda: engine_.renewals >= renewals + 1000, timeout=3)
    assert engine_.ticks - ticks < 100  # grouped: far fewer rounds than leases
    assert all(lease.held for lease in leases)
    assert threading.active_count() <= threads + 2
    for lease in leases:
        lease.release()


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_failing_on_lost_callback_is_logged_not_fatal(
    masters: Masters, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="celery_redlock.heartbeat")
    rl = make_redlock(masters)

    def explode(lease: Lease) -> None:
        raise RuntimeError("callback bug")

    first = rl.acquire("cb-1", 5, auto_renew=True, renew_every=0.1)
    second = rl.acquire("cb-2", 5, auto_renew=True, renew_every=0.1)
    survivor = rl.acquire("cb-3", 1, auto_renew=True)
    calls = Calls()
    first.on_lost(explode)
    first.on_lost(calls)  # the next callback of the same lease still runs
    second.on_lost(calls)
    for server in masters:
        with server.client() as conn:
            conn.delete(lock_name("cb-1"), lock_name("cb-2"))
    wait_for(lambda: len(calls.leases) == 2, timeout=2)
    assert set(map(id, calls.leases)) == {id(first), id(second)}
    errors = [r for r in caplog.records if "on_lost callback" in r.getMessage()]
    assert len(errors) == 1
    assert errors[0].exc_info is not None
    assert "callback bug" in caplog.text
    # Renewal and callbacks go on.
    stays_held(survivor, 1.5)
    third = Calls()
    survivor.on_lost(third)
    for server in masters:
        with server.client() as conn:
            conn.delete(lock_name("cb-3"))
    wait_for(lambda: third.leases, timeout=2)


GEVENT_SCRIPT = textwrap.dedent(
    """
    from gevent import monkey

    monkey.patch_all()

    import json
    import sys
    import time

    import gevent

    from celery_redlock.lock import Redlock

    rl = Redlock(json.loads(sys.argv[1]))
    lease = rl.acquire("green", 1, auto_renew=True)
    ticks = []

    def busy():
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            ticks.append(lease.held)
            gevent.sleep(0.01)

    gevent.joinall([gevent.spawn(busy) for _ in range(3)])
    assert all(ticks) and len(ticks) > 100, ticks
    assert lease.release() is True
    print("ok")
    """
)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_renewal_under_gevent(masters: Masters) -> None:
    # gevent comes with the [test] extra: a missing one fails here rather than skipping.
    import gevent  # noqa: F401

    result = helpers.run_python(GEVENT_SCRIPT, json.dumps(masters.urls), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_lease_past_its_validity_is_lost_not_renewed(masters: Masters) -> None:
    """The heartbeat's tick comes after the lease's validity ended (renewals failed until
    then, or the thread ran late) while the keys still exist on the masters: the lease is
    lost and reported, not extended back to held."""
    now = [1000.0]
    rl = make_redlock(masters, clock=lambda: now[0])
    lease = rl.acquire("late-tick", 30)
    lost: list[Lease] = []
    lease.on_lost(lost.append)
    beat = Heartbeat(clock=lambda: now[0])
    now[0] = lease.deadline + 0.001  # our clock says over; Redis still has 30 s to go
    assert not lease.held
    assert all(value_on(s, lock_name("late-tick")) == lease.token for s in masters)
    beat._tick([lease])
    assert not lease.held
    wait_for(lambda: lost == [lease], timeout=5, message="lock_lost callback")
    assert lease.state == LOST

"""Fencing tokens: strictly increasing across successive holders of a key, whatever happens."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_redlock import Redlock
from celery_redlock.exceptions import ImproperlyConfigured, LockLost
from celery_redlock.testing import Masters, wait_for

from . import helpers
from .helpers import command_calls, lock_name, make_redlock, value_on

#: A token from a holder whose wall clock ran ~11 days ahead: time seeding alone cannot
#: beat it, only reading the counters can.
AHEAD_US = 10**12


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


def assert_fences_increase(holds: list[list[Any]]) -> None:
    """Holds are ``[enter_ns, exit_ns, fence, pid]``: disjoint, and fences rise with time."""
    helpers.assert_no_overlap(holds)
    fences = [fence for _, _, fence, _ in sorted(holds) if fence is not None]
    for before, after in itertools.pairwise(fences):
        assert before < after, f"token {after} handed out after {before}"


@pytest.mark.parametrize("masters", [1, 3, 5], indirect=True)
def test_successive_holders_get_larger_tokens(masters: Masters) -> None:
    one, two = make_redlock(masters), make_redlock(masters)
    tokens = []
    for i in range(30):
        with (one if i % 2 else two).lock("seq", 5) as lease:
            tokens.append(lease.fence)
    assert tokens == sorted(set(tokens))


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_tokens_increase_across_processes(masters: Masters, tmp_path: Path) -> None:
    holds = helpers.run_holders(
        3, masters.urls, tmp_path, key="fenced", acquisitions=700, fence=True, budget=90
    )
    assert len(holds) == 3 * 700
    assert sum(fence is None for _, _, fence, _ in holds) == 0
    assert_fences_increase(holds)


@pytest.mark.chaos
@pytest.mark.parametrize("masters", [1, 3], indirect=True)
@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
def test_tokens_increase_when_every_master_restarts_empty(masters: Masters, eager: bool) -> None:
    """Every counter is lost between holders (all masters restart without persistence):
    only the wall-clock seed keeps the next token larger, which is the assumption the
    docs state (client clocks that do not step back across holders)."""
    rl = make_redlock(masters, restart_quarantine=0, eager_fence_keys=4096 if eager else 0)
    fence_key = lock_name("reborn", "fence")
    tokens = []
    for _ in range(4):
        with rl.lock("reborn", 5, blocking_timeout=10) as lease:  # past the reconnect backoff
            tokens.append(lease.fence)
        committed = sum(value_on(s, fence_key) is not None for s in masters)
        assert committed > len(masters) // 2  # on a quorum (a master may still reconnect)
        for server in masters:
            server.restart(keep_data=False)
        assert all(value_on(s, fence_key) is None for s in masters)  # every counter gone
    assert tokens == sorted(set(tokens)), tokens


@pytest.mark.chaos
@pytest.mark.parametrize(
    ("masters", "together"),
    [(3, False), (5, False), (3, True)],
    indirect=["masters"],
    ids=["3-one-at-a-time", "5-one-at-a-time", "3-all-at-once"],
)
def test_tokens_increase_while_masters_restart_empty(
    masters: Masters, tmp_path: Path, together: bool
) -> None:
    """Masters restart without persistence while 3 processes take turns: one at a time
    (a majority stays up, with the highest counter on it), or all at once, twice (every
    counter lost: only the wall-clock seed keeps tokens rising, and each process keeps
    the restarted masters out of its quorum for its TTL, so holds never overlap)."""
    # Enough acquisitions for the holders to outlast every restart (a turn can see hundreds of
    # holds: the holders run on while a master restarts).
    acquisitions = 200 if together else 500
    started = helpers.start_holders(
        3, masters.urls, tmp_path, key="chaos", acquisitions=acquisitions, ttl=1.0, fence=True,
        budget=60,
    )  # fmt: skip
    outputs = [out for _, out in started]

    def progress() -> int:
        return sum(len(helpers.read_holds(out)) for out in outputs)

    def holders_done() -> bool:
        return all(proc.poll() is not None for proc, _ in started)

    turns = 2 if together else 2 * len(masters)
    restarts = 0
    try:
        for turn in range(turns):
            seen = progress()
            # Let the holders take the lock a few times with the masters back, then
            # crash the next one (or all of them).
            wait_for(lambda s=seen: progress() >= s + 25 or holders_done(), timeout=30)
            if holders_done():
                break
            for server in masters if together else [masters[turn % len(masters)]]:
                server.restart(keep_data=False)
            restarts += 1
    finally:
        holds = helpers.wait_holders(started, timeout=90)
    assert restarts == turns, f"the holders were done after {restarts} of {turns} restarts"
    assert len(holds) == 3 * acquisitions
    assert sum(fence is None for _, _, fence, _ in holds) <= 6  # reads cut by a restart
    assert_fences_increase(holds)


def learn_fenced(rl: Redlock, key: str) -> None:
    """One fence read on ``key``: later acquires of it commit the fence in their round."""
    with rl.lock(key, 5) as lease:
        _ = lease.fence
    assert key in rl._fence_keys


@pytest.mark.parametrize("masters", [3], indirect=True)
@pytest.mark.parametrize(
    "counters",
    [(5, 0, 0), (AHEAD_US, 0, 0), (AHEAD_US, AHEAD_US, 0), (0, 0, AHEAD_US)],
    ids=["5-0-0", "ahead-0-0", "ahead-ahead-0", "0-0-ahead"],
)
@pytest.mark.parametrize("eager", [False, True], ids=["lazy", "eager"])
def test_token_beats_every_counter_a_master_reports(
    masters: Masters, counters: tuple[int, int, int], eager: bool
) -> None:
    """The issue's 5,0,0 case: the last token lives on master 0, which the new holder
    does not hold (someone's stale key is still there); it wins on masters 1 and 2.
    Eager: the fence was committed in the acquire round, which reads the same counters."""
    rl = make_redlock(masters)
    if eager:
        learn_fenced(rl, "k")
    now_us = time.time_ns() // 1000  # the counters are wall-clock seeded
    values = [c + now_us if c >= AHEAD_US else c for c in counters]
    fence_key = lock_name("k", "fence")
    for server, value in zip(masters, values, strict=True):
        with server.client() as conn:
            if value:
                conn.set(fence_key, value)
    with masters[0].client() as conn:
        conn.set(lock_name("k"), "stale-holder", px=30000)
    lease = rl.acquire("k", 10)
    assert (lease._eager_fence is not None) == eager
    assert [value_on(s, lock_name("k")) for s in masters] == ["stale-holder"] + [lease.token] * 2
    token = lease.fence
    assert token > max(values)
    for server in masters[1:]:  # committed on the majority that holds the lock
        assert int(value_on(server, fence_key) or 0) == token
    lease.release()


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_fence_read_twice_costs_one_round(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("twice", 10)
    before = [command_calls(s) for s in masters]
    first = lease.fence
    after_first = [command_calls(s) for s in masters]
    assert [a - b for a, b in zip(after_first, before, strict=True)] == [1, 1, 1]
    assert lease.fence == first
    assert lease.fence == first
    assert [command_calls(s) for s in masters] == after_first
    lease.release()


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_eager_fence_costs_no_round_of_its_own(masters: Masters) -> None:
    rl = make_redlock(masters)
    learn_fenced(rl, "eager")
    tokens = []
    for _ in range(5):
        before = [command_calls(s) for s in masters]
        lease = rl.acquire("eager", 10)
        token = lease.fence
        # ACQUIRE and FENCE, in one write per master; reading the fence sent nothing more.
        assert [command_calls(s) - b for s, b in zip(masters, before, strict=True)] == [2, 2, 2]
        assert [value_on(s, lock_name("eager", "fence")) for s in masters] == [str(token)] * 3
        tokens.append(token)
        lease.release()
    assert tokens == sorted(set(tokens))


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_eager_fence_waits_for_a_late_master_that_reports_a_higher_counter(
    masters: Masters,
) -> None:
    """The acquire round stops at 2 of 3; the third master (busy, then answering with a
    counter far ahead) is read before the token is handed out, which is then larger."""
    rl = make_redlock(masters, node_timeout=0.5)
    learn_fenced(rl, "late")
    ahead = time.time_ns() // 1000 + AHEAD_US
    with masters[2].client() as conn:
        conn.set(lock_name("late", "fence"), ahead)
        conn.set(lock_name("late"), "stale-holder", px=30000)
    # Keep master 2 busy for 150 ms (a script that spins), sent just before the acquire.
    busy = masters[2].client()
    spin = (
        "local t = redis.call('TIME') local s = t[1] * 1000000 + t[2] "
        "repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] - s > 150000 return 1"
    )
    busy_conn = busy.connection_pool.get_connection()
    try:
        busy_conn.send_command("EVAL", spin, 0)
        lease = rl.acquire("late", 10)
        assert lease._eager_fence is not None
        assert 2 in lease._eager_fence[2], "master 2 answered within the acquire round"
        token = lease.fence
        assert token > ahead
        busy_conn.read_response()
    finally:
        busy.connection_pool.release(busy_conn)
        busy.close()
    lease.release()


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_eager_fence_keys_is_bounded_and_can_be_turned_off(masters: Masters) -> None:
    rl = make_redlock(masters, eager_fence_keys=2)
    for key in ("a", "b", "c"):
        learn_fenced(rl, key)
    assert list(rl._fence_keys) == ["b", "c"]
    off = make_redlock(masters, eager_fence_keys=0)
    with off.lock("d", 5) as lease:
        _ = lease.fence
    assert not off._fence_keys
    lease = off.acquire("d", 5)
    assert lease._eager_fence is None
    lease.release()
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ImproperlyConfigured, match="eager_fence_keys must be an int >= 0"):
            make_redlock(masters, eager_fence_keys=bad)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_fence_after_expiry_raises_lock_lost_without_a_round(masters: Masters) -> None:
    rl = make_redlock(masters, node_timeout=0.05)
    lease = rl.acquire("late", 0.3)
    wait_for(lambda: not lease.held, timeout=2)
    before = [command_calls(s) for s in masters]
    with pytest.raises(LockLost):
        _ = lease.fence
    assert [command_calls(s) for s in masters] == before


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_fence_of_a_lock_taken_away_raises_lock_lost(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("taken", 10)
    for server in masters[:2]:
        with server.client() as conn:
            conn.set(lock_name("taken"), "intruder", px=10000)
    with pytest.raises(LockLost):
        _ = lease.fence
    assert lease.state == "lost"
    assert not lease.held
    for server in masters[:2]:
        assert value_on(server, lock_name("taken", "fence")) is None


@pytest.mark.parametrize("masters", [1, 3], indirect=True)
def test_fence_counter_lives_fence_ttl(masters: Masters) -> None:
    rl = make_redlock(masters, fence_ttl=60)
    with rl.lock("ttl", 5) as lease:
        _ = lease.fence
    for server in masters:
        with server.client() as conn:
            assert 59_000 < conn.pttl(lock_name("ttl", "fence")) <= 60_000

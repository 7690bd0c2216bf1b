"""Reads and releases for a process that does not hold the lock: the worker's main process
freeing a dead pool child's lock (``holder`` then ``release_token``), and a redelivered job
recognising its own earlier run (``owned_by``, ``holder_state``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redlock import QuorumUnavailable, Redlock
from celery_redlock.lock.redlock import _holder_verdict
from celery_redlock.testing import Masters, RedisServer

from .helpers import lock_name, make_redlock

pytestmark = pytest.mark.timeout(30)


def test_holder_reads_the_token_and_metadata_a_quorum_agree_on(masters: Masters) -> None:
    rl = Redlock(masters.urls)
    try:
        assert rl.holder("job:1", ("task_id",)) is None
        lease = rl.acquire("job:1", 10, meta={"task_id": "t1", "pid": "42"})
        found = rl.holder("job:1", ("task_id", "pid", "host"))
        assert found == (lease.token, {"task_id": "t1", "pid": "42", "host": ""})
        with pytest.raises(ValueError, match="at least one metadata field"):
            rl.holder("job:1", ())
    finally:
        rl.close()


def test_release_token_frees_only_the_lock_holding_that_token(masters: Masters) -> None:
    rl = Redlock(masters.urls)
    try:
        first = rl.acquire("job:2", 10, meta={"task_id": "t2"})
        token = first.token
        assert rl.release_token("job:2", token) is True
        assert not rl.locked("job:2")
        # A later holder of the key (the same task id, redelivered) is never freed by the
        # earlier holder's token.
        second = rl.acquire("job:2", 10, meta={"task_id": "t2"})
        assert rl.release_token("job:2", token) is False
        assert second.owned()
        second.release()
    finally:
        rl.close()


def test_owned_by_tells_the_holders_task_id(masters: Masters) -> None:
    rl = Redlock(masters.urls)
    try:
        assert rl.owned_by("job:3", "task_id", "t3") is False
        lease = rl.acquire("job:3", 10, meta={"task_id": "t3"})
        assert rl.owned_by("job:3", "task_id", "t3") is True
        assert rl.owned_by("job:3", "task_id", "other") is False
        lease.release()
        assert rl.owned_by("job:3", "task_id", "t3") is False
    finally:
        rl.close()


# -- holder_state: the matching holder, a freed lock, or another ------------------------------

_STATES = ("free", "same", "other", "bare")  # "bare": a lock without metadata


def _plant(server: RedisServer, key: str, state: str) -> None:
    lock, meta = lock_name(key), lock_name(key, "meta")
    with server.client() as conn:
        conn.delete(lock, meta)
        if state != "free":
            conn.set(lock, f"token-{state}", px=30_000)
        if state in ("same", "other"):
            conn.hset(meta, "task_id", "t1" if state == "same" else "t2")
            conn.pexpire(meta, 30_000)


def _expected(states: Sequence[str], quorum: int) -> str:
    same, free = states.count("same"), states.count("free")
    if same and same + free >= quorum:
        return "matches"
    if not same and free >= quorum:
        return "free"
    return "other"


def test_holder_state_on_every_mix_of_three_masters(masters: Masters) -> None:
    """A redelivered job tells its own earlier run, a lock freed since its acquire failed,
    and another holder apart on every mix of what the masters hold. The mix CI met: its
    earlier run's lock expired on two masters between the failed acquire and this read
    ("same", "free", "free"), which ``owned_by`` answered False (contention: a skip
    policy dropped the job)."""
    rl = make_redlock(masters)
    for states in itertools.product(_STATES, repeat=3):
        for server, state in zip(masters, states, strict=True):
            _plant(server, "job:mix", state)
        assert rl.holder_state("job:mix", "task_id", "t1") == _expected(states, 2), states
    assert rl.owned_by("job:mix", "task_id", "t1") is False  # the last mix: all "bare"


def test_holder_state_with_a_master_down(masters: Masters) -> None:
    rl = make_redlock(masters, node_timeout=0.2)
    masters[2].stop()
    _plant(masters[0], "job:down", "same")
    _plant(masters[1], "job:down", "free")
    assert rl.holder_state("job:down", "task_id", "t1") == "matches"
    _plant(masters[0], "job:down", "free")
    assert rl.holder_state("job:down", "task_id", "t1") == "free"
    _plant(masters[0], "job:down", "same")
    _plant(masters[1], "job:down", "same")
    assert rl.holder_state("job:down", "task_id", "t1") == "matches"
    _plant(masters[1], "job:down", "other")
    with pytest.raises(QuorumUnavailable, match="holder"):
        rl.holder_state("job:down", "task_id", "t1")
    _plant(masters[0], "job:down", "bare")
    assert rl.holder_state("job:down", "task_id", "t1") == "other"


@st.composite
def _round_counts(draw: st.DrawFn) -> tuple[int, tuple[int, int, int], tuple[int, int, int]]:
    """n masters; the (same, free, other) counted when the round could stop early; more
    answers to add by the end (whoever does not answer counts nowhere)."""
    n = draw(st.integers(1, 7))
    seen = draw(st.lists(st.sampled_from((0, 1, 2, 3)), max_size=n))  # 3: no answer yet
    later = draw(
        st.lists(st.sampled_from((0, 1, 2, 3)), min_size=n - len(seen), max_size=n - len(seen))
    )
    first = tuple(seen.count(i) for i in range(3))
    more = tuple(later.count(i) for i in range(3))
    return n, first, more  # type: ignore[return-value]


@settings(max_examples=500, deadline=None)
@given(_round_counts())
def test_holder_verdict_never_stops_a_round_early_on_an_answer_the_rest_would_change(
    counts: tuple[int, tuple[int, int, int], tuple[int, int, int]],
) -> None:
    """The read stops as soon as the verdict is certain: whatever the masters still to
    answer say, the verdict at the end is the one it stopped on; and the final verdict is
    the documented one."""
    n, first, more = counts
    q = n // 2 + 1
    early = _holder_verdict(*first, n, q, final=False)
    same, free, other = (a + b for a, b in zip(first, more, strict=True))
    final = _holder_verdict(same, free, other, n, q)
    if early is not None:
        assert final == early, (first, more)
    if same and same + free >= q:
        assert final == "matches"
    elif not same and free >= q:
        assert final == "free"
    elif other > n - q:
        assert final == "other"
    else:
        assert final is None

"""Several calls claiming one value at once (publishes of one job id): exactly one of them
stands for creating it.

Found by a hostile review: each call created the marker on the masters it reached first and
read it as already there on the others, so none counted a quorum of its own creations and
every one returned ``fresh=False``; ``apply_async`` read that as "a duplicate of the queued
job" and none published it (a job id returned to every caller, and never run).
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_redlock.lock import process
from celery_redlock.lock.fanout import RoundResult
from celery_redlock.lock.redlock import _all_answered, _by_one_other, _claim_created
from celery_redlock.lock.scripts import CLAIMED_BY
from celery_redlock.testing import Masters, wait_for

from . import helpers
from .helpers import make_redlock

OURS = b"job-1"
OTHER = b"job-2"


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


class _Master:
    down = False


def _view(
    creators: list[int | None], racer: int, heard: set[int], errors: set[int] = frozenset()
) -> RoundResult:
    """What ``racer``'s claim round read: per master, its own creation (1), the value there
    before it with the id of the call that wrote it (``OURS`` by another racer, ``OURS``
    with no id where creators[i] is -1: a finished claim's, its id expired, or an older
    client's; ``OTHER`` where creators[i] is None), or nothing."""
    replies: list[list[object] | None] = []
    for i, creator in enumerate(creators):
        if i not in heard:
            replies.append(None)
        elif creator is None:
            replies.append([[OTHER, b"call-other"]])
        elif creator == -1:
            replies.append([[OURS, b""]])
        else:
            replies.append([1] if creator == racer else [[OURS, b"call-%d" % creator]])
    return RoundResult(replies, errors=dict.fromkeys(errors, "failed"))


@st.composite
def _races(draw: st.DrawFn, unlabelled: bool = False) -> tuple[list[int | None], int, list[int]]:
    """Masters each holding the value of the racer that reached it first (or, None, another
    value; with ``unlabelled``, or -1, the value with no writer's id), the number of racers
    and the order the clients agree on."""
    n = draw(st.integers(1, 5))
    racers = draw(st.integers(1, 4))
    low = -1 if unlabelled else 0
    creators = draw(
        st.lists(st.one_of(st.none(), st.integers(low, racers - 1)), min_size=n, max_size=n)
    )
    if all(c is None for c in creators):
        creators[draw(st.integers(0, n - 1))] = 0
    order = draw(st.permutations(range(n)))
    return creators, racers, order


def _outcomes(
    creators: list[int | None], racers: int, order: list[int], heard: list[set[int]]
) -> list[bool]:
    """Each racer's fresh, decided as claim() decides it from what that racer read."""
    quorum = len(creators) // 2 + 1
    out = []
    for r in range(racers):
        made = sum(1 for i, c in enumerate(creators) if i in heard[r] and c == r)
        found = sum(1 for i, c in enumerate(creators) if i in heard[r] and c not in (None, r))
        if made + found < quorum:
            out.append(False)  # not a quorum of the value in this view: claim() retries
            continue
        view = _view(creators, r, heard[r])
        other = _by_one_other(view, set(), OURS)
        out.append(_claim_created(view, set(), OURS, quorum, made, other, lambda: order))
    return out


def _made(creators: list[int | None], racer: int) -> int:
    return sum(1 for c in creators if c == racer)


def _heard(
    data: st.DataObject, creators: list[int | None], racers: int, own: bool = False
) -> list[set[int]]:
    """What each racer read: any masters (with ``own``, at least those it wrote)."""
    n = len(creators)
    return [
        {i for i in range(n) if own and creators[i] == r}
        | data.draw(st.sets(st.integers(0, n - 1)))
        for r in range(racers)
    ]


@given(st.one_of(_races(), _races(unlabelled=True)))
@settings(max_examples=300, deadline=None)
def test_racers_that_read_every_master_elect_at_most_one_creator(race: Any) -> None:
    creators, racers, order = race
    everything = set(range(len(creators)))
    winners = _outcomes(creators, racers, order, [everything] * racers)
    assert winners.count(True) <= 1, (creators, order, winners)


@given(_races())
@settings(max_examples=300, deadline=None)
def test_a_split_elects_its_first_creator_unless_it_found_a_quorum(race: Any) -> None:
    # Every racer read every master. A racer that wrote a quorum is elected; otherwise the
    # one that wrote the first master holding the value: three or more racers too, each
    # finding the value on a quorum written by the others (one master each of three; before
    # each call stored its own id beside the value, none of them was elected).
    creators, racers, order = race
    n, quorum = len(creators), len(creators) // 2 + 1
    holders = sum(1 for c in creators if c is not None)
    if holders < quorum:
        return  # the value holds no quorum: claim() undoes and tries again
    winners = _outcomes(creators, racers, order, [set(range(n))] * racers)
    first = next(creators[i] for i in order if creators[i] is not None)
    assert first is not None
    strong = [r for r in range(racers) if _made(creators, r) >= quorum]
    if strong:
        assert winners == [r == strong[0] for r in range(racers)], (creators, winners)
    else:
        assert winners == [r == first for r in range(racers)], (creators, order, winners)


@given(_races(), st.data())
@settings(max_examples=300, deadline=None)
def test_a_value_found_on_a_quorum_is_never_taken_for_created(
    race: Any, data: st.DataObject
) -> None:
    # A later claim of a finished claim's value, with the value lost on some masters (a
    # master restarted empty), writes it there again: it must not take the job for new
    # (found by the review of the first version of this rule: the job was published twice).
    # A finished claim is one call: the value found on a quorum written by one other call.
    creators, racers, order = race
    quorum = len(creators) // 2 + 1
    heard = _heard(data, creators, racers)
    winners = _outcomes(creators, racers, order, heard)
    for r in range(racers):
        for other in set(creators) - {None, r}:
            if sum(1 for i in heard[r] if creators[i] == other) >= quorum:
                assert not winners[r], (creators, heard[r], r)


@given(_races(unlabelled=True), st.data())
@settings(max_examples=300, deadline=None)
def test_a_value_found_on_a_quorum_beside_a_copy_with_no_writer_id_is_not_created(
    race: Any, data: st.DataObject
) -> None:
    # Found by the review of the writer ids: a finished claim's copies, written again on
    # masters that had lost them by calls that then declined, carry several ids, none on
    # a quorum; a later claim writing one more lost copy read that as a split and was
    # elected (the job published twice). A copy with no id (the finished claim's, its id
    # expired; or an older client's) means "there before": the copies count as one call's.
    creators, racers, order = race
    quorum = len(creators) // 2 + 1
    everything = set(range(len(creators)))
    heard = [everything] * racers if data.draw(st.booleans()) else _heard(data, creators, racers)
    winners = _outcomes(creators, racers, order, heard)
    for r in range(racers):
        found = [creators[i] for i in heard[r] if creators[i] not in (None, r)]
        if -1 in found and len(found) >= quorum:
            assert not winners[r], (creators, heard[r], r)


@given(_races(), st.data())
@settings(max_examples=300, deadline=None)
def test_missing_replies_never_cost_a_creator_the_old_rule_elected(
    race: Any, data: st.DataObject
) -> None:
    # Before this rule only a racer that wrote a quorum stood for creating the value: one
    # that still reads its own writes is elected whatever else it missed.
    creators, racers, order = race
    quorum = len(creators) // 2 + 1
    heard = _heard(data, creators, racers, own=True)
    winners = _outcomes(creators, racers, order, heard)
    for r in range(racers):
        if _made(creators, r) >= quorum:
            assert winners[r], (creators, heard, winners)


@given(_races(), st.data())
@settings(max_examples=300, deadline=None)
def test_no_racer_is_elected_beside_one_that_wrote_a_quorum(race: Any, data: st.DataObject) -> None:
    # Found by the third review: a racer that could not see one master (no reply, or kept
    # out after a restart in its process only) was elected by the order while the master
    # it could not see held another racer's quorum write: the job was published twice.
    creators, racers, order = race
    quorum = len(creators) // 2 + 1
    heard = _heard(data, creators, racers)
    winners = _outcomes(creators, racers, order, heard)
    strong = [r for r in range(racers) if _made(creators, r) >= quorum]
    for r in range(racers):
        if strong and r not in strong:
            assert not winners[r], (creators, heard[r], r)


def test_a_split_claim_waits_for_every_master_that_may_answer() -> None:
    # Split with other calls (neither written nor found on a quorum yet): only every
    # master's answer tells whether another call wrote a quorum.
    masters = [_Master(), _Master(), _Master()]
    waiting = RoundResult([None, [1], [OURS]])
    assert not _all_answered(waiting, set(), masters)  # type: ignore[arg-type]
    failed = RoundResult([None, [1], [OURS]], errors={0: "no reply"})
    assert _all_answered(failed, set(), masters)  # type: ignore[arg-type]
    assert _all_answered(waiting, {0}, masters)  # type: ignore[arg-type]  # kept out
    masters[0].down = True  # known down: not waited for
    assert _all_answered(waiting, set(), masters)  # type: ignore[arg-type]


@pytest.mark.parametrize("masters", [4], indirect=True)
def test_complementary_splits_give_the_creation_to_exactly_one(masters: Masters) -> None:
    # Two racers on 4 masters, each first on 2: the claim of each is replayed on real
    # masters, the other racer's markers written ahead of it. Exactly one stands for it.
    rl = make_redlock(masters)
    name = rl._claim_name("k", "dedupe:t")
    outcomes = []
    for mine in ({0, 1}, {2, 3}):
        for i, server in enumerate(masters):
            with server.client() as conn:
                conn.delete(name)
                if i not in mine:
                    conn.set(name, OURS, px=60_000)  # the other racer came first there
        holder, fresh = rl.claim("k", "dedupe:t", OURS.decode(), 60, guard_for=0)
        assert holder == OURS.decode()
        outcomes.append(fresh)
    assert sorted(outcomes) == [False, True]
    first = rl.claim_order()[0]
    assert outcomes[0] is (first in {0, 1})


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_three_racers_one_master_each_give_the_creation_to_exactly_one(masters: Masters) -> None:
    # The gap the last version documented: three racers on 3 masters, each first on one,
    # each finds the value on a quorum written by the other two. Each claim is replayed on
    # real masters with the other racers' writes (their values and call ids) made ahead of
    # it. Before each call stored its own id, all three returned fresh=False (a lost job).
    rl = make_redlock(masters)
    name = rl._claim_name("k", "dedupe:t")
    outcomes = []
    for mine in range(3):
        for i, server in enumerate(masters):
            with server.client() as conn:
                conn.delete(name, name + CLAIMED_BY)
                if i != mine:
                    conn.set(name, OURS, px=60_000)
                    conn.set(name + CLAIMED_BY, f"racer-{i}", px=60_000)
        holder, fresh = rl.claim("k", "dedupe:t", OURS.decode(), 60, guard_for=0)
        assert holder == OURS.decode()
        outcomes.append(fresh)
    assert outcomes == [i == rl.claim_order()[0] for i in range(3)]


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_value_an_older_client_wrote_on_a_quorum_is_not_fresh(masters: Masters) -> None:
    # Written with no call's id beside it (an older client): one call's, as before.
    rl = make_redlock(masters)
    name = rl._claim_name("k", "dedupe:t")
    for i in rl.claim_order()[1:]:
        with masters[i].client() as conn:
            conn.set(name, "job-x", px=60_000)
    assert rl.claim("k", "dedupe:t", "job-x", 60, guard_for=0) == ("job-x", False)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_writer_id_lives_as_long_as_a_claim_call_and_goes_with_an_unclaim(
    masters: Masters,
) -> None:
    # The id only tells racing calls apart: it is not kept for the claim's whole TTL (a
    # dedupe marker's can be hours, a key per job), and an unclaim takes it with the value.
    rl = make_redlock(masters, node_timeout=0.25)
    assert rl.claim("k", "dedupe:t", "job-x", 3600, guard_for=0) == ("job-x", True)
    name = rl._claim_name("k", "dedupe:t")
    for server in masters:
        with server.client() as conn:
            assert 3_000_000 < conn.pttl(name) <= 3_600_000
            assert 0 < conn.pttl(name + CLAIMED_BY) <= 5_000
    assert rl.claim("k2", "dedupe:t", "job-y", 2, guard_for=0) == ("job-y", True)
    with masters[0].client() as conn:  # never longer than the claim itself
        assert 0 < conn.pttl(rl._claim_name("k2", "dedupe:t") + CLAIMED_BY) <= 2_000
    assert rl.unclaim("k", "dedupe:t", "job-x")
    for server in masters:
        with server.client() as conn:
            assert not conn.exists(name, name + CLAIMED_BY)


@pytest.mark.parametrize("masters", [3, 5], indirect=True)
@pytest.mark.parametrize("expired", [True, False])
def test_a_finished_claim_written_again_by_several_calls_stays_not_fresh(
    masters: Masters, expired: bool
) -> None:
    # The review's reproduction (r1): a published job's marker is lost on one master at a
    # time, each time written again there by a claim of the same id that rightly declines,
    # each with an id of its own: no id holds a quorum, and the next claim took that for
    # a split (the job published twice). Once the publish's own ids have expired (a claim
    # call's time), its copies carry none, and every copy counts as one call's again;
    # before that, each declining call cedes its copy to the publish's id (RELABEL).
    rl = make_redlock(masters)
    assert rl.claim("k", "dedupe:t", "job-x", 60, guard_for=0) == ("job-x", True)
    name = rl._claim_name("k", "dedupe:t")
    with masters[0].client() as conn:
        publish = conn.get(name + CLAIMED_BY)
    if expired:  # the publish is older than a claim call
        publish = None
        for server in masters:
            with server.client() as conn:
                conn.delete(name + CLAIMED_BY)
    outcomes = []
    for i in reversed(rl.claim_order()[: len(masters) // 2 + 1]):
        with masters[i].client() as conn:
            conn.delete(name)  # lost there (restarted empty, or a contended acquire)
        outcomes.append(make_redlock(masters).claim("k", "dedupe:t", "job-x", 60, guard_for=0))
        with masters[i].client() as conn:  # its copy ceded (a round not waited for)
            wait_for(lambda conn=conn: conn.get(name + CLAIMED_BY) == publish, timeout=3)
    assert outcomes == [("job-x", False)] * len(outcomes)


A_ID = "a" * 32


def _ordered(masters: Masters) -> tuple[Any, list[int], str]:
    """A client connected to ``masters`` (their run_ids known), the order every client
    agrees on, and the name of the claim ``k`` / ``dedupe:t``."""
    rl = make_redlock(masters)
    rl.claim("warm-up", "dedupe:t", "w", 60, guard_for=0)
    return rl, rl.claim_order(), rl._claim_name("k", "dedupe:t")


def _copy(masters: Masters, i: int, name: str, writer: str | None, id_ms: int = 5_000) -> None:
    """Master ``i`` holds job-x for a minute, written by ``writer`` (None: no id stored)."""
    with masters[i].client() as conn:
        if writer is not None:
            conn.set(name + CLAIMED_BY, writer, px=id_ms)
        conn.set(name, "job-x", px=60_000)


def _claim_x(rl: Any) -> tuple[str, bool]:
    return rl.claim("k", "dedupe:t", "job-x", 60, guard_for=0)  # type: ignore[no-any-return]


def _lose_and_claim_again(masters: Masters, i: int, name: str) -> tuple[str, bool]:
    """Master ``i`` loses its copy (restarted empty); an identical publish claims."""
    with masters[i].client() as conn:
        conn.delete(name, name + CLAIMED_BY)
    return _claim_x(make_redlock(masters))


def _ceded_to_a(masters: Masters, i: int, name: str) -> None:
    """Wait for master ``i``'s copy to carry A's id (a cede is not waited for)."""
    with masters[i].client() as conn:
        wait_for(lambda: conn.get(name + CLAIMED_BY) == A_ID.encode(), timeout=3)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_write_left_by_an_earlier_attempt_of_the_call_is_its_own(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The review's reproduction (r4): an attempt's write whose undo never ran (its reply
    # lost with the connection) was read by the next attempt of the same call as another
    # call's, and elected by the order: with the other racer declining, nobody published.
    rl, (first, second, _), name = _ordered(masters)
    _copy(masters, first, name, A_ID, id_ms=60_000)
    _copy(masters, second, name, "racer-b", id_ms=60_000)
    monkeypatch.setattr(process, "token_hex", lambda: A_ID)
    assert _claim_x(rl) == ("job-x", True)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_race_then_one_lost_copy_does_not_publish_the_job_again(masters: Masters) -> None:
    # The second review's reproduction (x2): A wrote the id on 2 of 3 masters (published);
    # B, racing, wrote the third and declined. One of A's copies is lost (a restart) and an
    # identical publish C writes it again: it found A's id on one master and B's on one,
    # read that as a split and, first in the order, published the job a second time. A call
    # that declines now cedes its copies to the call it declined for: they count as A's.
    _, (first, second, third), name = _ordered(masters)
    for i in (first, second):
        _copy(masters, i, name, A_ID)
    assert _claim_x(make_redlock(masters)) == ("job-x", False)  # B
    _ceded_to_a(masters, third, name)
    assert _lose_and_claim_again(masters, first, name) == ("job-x", False)  # C


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_decliner_whose_own_reply_comes_last_still_cedes_its_copy(masters: Masters) -> None:
    # The third review's reproduction (f1): B's write landed on a slow master; A's quorum
    # decided B's round before B's own reply came, so B, counting no write of its own,
    # ceded nothing, and after one lost copy a later publish read a split. The cede is now
    # sent behind the reply not waited for, on the same connection.
    _, (first, second, third), name = _ordered(masters)
    for i in (first, second):
        _copy(masters, i, name, A_ID)
    b = make_redlock(masters, node_timeout=1.0)
    b.claim("warm-up-b", "dedupe:t", "w", 60, guard_for=0)  # connected before the pause
    masters[third].pause()
    try:
        assert _claim_x(b) == ("job-x", False)
    finally:
        masters[third].resume()
    _ceded_to_a(masters, third, name)
    assert _lose_and_claim_again(masters, first, name) == ("job-x", False)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_stale_own_id_beside_a_value_written_again_later_is_not_the_calls(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The second review's reproduction (x3), a rolling upgrade: an older client's undo
    # deletes a copy of A's first attempt but not A's id; the older client then writes the
    # value there itself (and on another master: a quorum, it publishes). A's next attempt
    # took that copy for its own (two publishes). The copy's TTL, far ahead of the id's,
    # tells it was written later.
    rl, (first, second, _), name = _ordered(masters)
    _copy(masters, first, name, A_ID, id_ms=4_000)  # A's id, a second old; the older copy
    _copy(masters, second, name, None)
    monkeypatch.setattr(process, "token_hex", lambda: A_ID)
    assert _claim_x(rl) == ("job-x", False)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_a_writer_id_never_overwrites_another_claims_value(masters: Masters) -> None:
    # The review's reproduction (r2): the id key of suffix "s" was the claim key of suffix
    # "s:claimed-by" (tasks "t" and "t:claimed-by" sharing a lock key): a claim overwrote
    # the other's value with its id, and that publish was dropped as a duplicate.
    rl = make_redlock(masters)
    for suffix in ("dedupe:t", "dedupe:t:claimed-by"):
        assert rl.claim("k", suffix, f"job-{suffix}", 60, guard_for=0) == (f"job-{suffix}", True)
    for suffix in ("dedupe:t", "dedupe:t:claimed-by"):
        assert rl.claim("k", suffix, "another", 60, guard_for=0) == (f"job-{suffix}", False)


@pytest.mark.parametrize("masters", [3, 5], indirect=True)
def test_a_claim_again_after_a_master_lost_the_value_is_not_fresh(masters: Masters) -> None:
    # The second review's reproduction: the marker of a published job is lost on the first
    # master of the order (restarted empty); publishing the same id again writes it there
    # and found it on the others. It is the same job: not fresh (the first version of the
    # rule said fresh, and the job was published twice).
    rl = make_redlock(masters)
    assert rl.claim("k", "dedupe:t", "job-x", 60, guard_for=0) == ("job-x", True)
    name = rl._claim_name("k", "dedupe:t")
    with masters[rl.claim_order()[0]].client() as conn:
        conn.delete(name)
    again = make_redlock(masters)
    assert again.claim("k", "dedupe:t", "job-x", 60, guard_for=0) == ("job-x", False)


def test_a_racer_that_cannot_see_a_master_leaves_the_creation_to_a_quorum_writer(
    masters: Masters,
) -> None:
    # The third review's reproduction: B wrote the value on the 2nd and 3rd masters of the
    # order (a quorum: B publishes); A writes it on the 1st, finds it on the 2nd, and the
    # 3rd does not answer A. A must not be elected by the order (two publishes).
    rl = make_redlock(masters, node_timeout=0.1)
    rl.claim("warm-up", "dedupe:t", "w", 60, guard_for=0)  # connected: run_ids known
    _first, second, third = (masters[i] for i in rl.claim_order())
    name = rl._claim_name("k", "dedupe:t")
    for server in (second, third):
        with server.client() as conn:
            conn.set(name, "job-x", px=60_000)  # B's quorum write
    third.pause()
    try:
        assert rl.claim("k", "dedupe:t", "job-x", 60, guard_for=0) == ("job-x", False)
    finally:
        third.resume()


def _claim_in_child(urls: list[str], key: str, value: str, barrier: Any, out: Any) -> None:
    rl = make_redlock(urls, node_timeout=1.0)
    rl.held_elsewhere("warm-up")  # connected before the race
    barrier.wait(10)
    try:
        out.put(rl.claim(key, "dedupe:t", value, 60, guard_for=0))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(exc)))


@pytest.mark.parametrize(
    ("masters", "racers"), [(4, 2), (3, 2), (5, 3), (3, 3)], indirect=["masters"]
)
def test_racing_claims_of_one_value_elect_one_creator(masters: Masters, racers: int) -> None:
    # Real processes racing on real masters (the review's reproduction: on 4 masters the
    # claims split 2/2 within a few trials, and no caller got fresh=True). Any number of
    # racers elect exactly one (three on three masters could each find the value on a
    # quorum written by the other two before each call stored its own id beside it).
    context = multiprocessing.get_context("fork")
    deadline = time.monotonic() + 20
    trials = 0
    while time.monotonic() < deadline and trials < 60:
        trials += 1
        key, value = f"k{uuid.uuid4().hex}", uuid.uuid4().hex
        barrier, out = context.Barrier(racers), context.Queue()
        children = [
            context.Process(target=_claim_in_child, args=(masters.urls, key, value, barrier, out))
            for _ in range(racers)
        ]
        for child in children:
            child.start()
        try:
            results = [out.get(timeout=15) for _ in children]
        except queue.Empty:
            pytest.fail(f"trial {trials}: a racer did not answer")
        finally:
            for child in children:
                child.join(5)
                if child.is_alive():
                    child.kill()
                    child.join(5)
        assert all(holder == value for holder, _ in results), results
        elected = [fresh for _, fresh in results].count(True)
        assert elected == 1, (trials, results)

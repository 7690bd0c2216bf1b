"""The Redlock client against real masters: exclusion, release, contention, keys, specs.

Faults (masters killed, paused, restarted) are in ``test_faults.py``; fencing tokens in
``test_fencing.py``; renewal in ``test_heartbeat.py``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from celery_redlock.exceptions import (
    ImproperlyConfigured,
    LockContended,
    LockLost,
    QuorumUnavailable,
    RedlockError,
)
from celery_redlock.lock import Redlock
from celery_redlock.testing import Masters, RedisServer, wait_for

from . import helpers
from .helpers import keys_on, lock_name, make_redlock, value_on

ALL_N = pytest.mark.parametrize("masters", [1, 3, 5], indirect=True)


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


# -- mutual exclusion ---------------------------------------------------------------------


@ALL_N
@pytest.mark.parametrize("shared", [True, False], ids=["one-client", "client-per-thread"])
def test_threads_never_hold_at_once(masters: Masters, shared: bool) -> None:
    threads, rounds = 4, 20
    one = make_redlock(masters)
    clients = [one if shared else make_redlock(masters) for _ in range(threads)]
    ledger = helpers.Ledger()
    counter = [0]

    def work(index: int) -> None:
        try:
            for _ in range(rounds):
                with clients[index].lock("excl", 5, blocking_timeout=20) as lease:
                    enter = time.monotonic_ns()
                    seen = counter[0]
                    time.sleep(0.0005)  # widen the window a second holder would race in
                    counter[0] = seen + 1
                    leave = time.monotonic_ns()
                    assert lease.held
                ledger.record(enter, leave, index)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            ledger.fail(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert not any(w.is_alive() for w in workers)
    assert not ledger.errors, ledger.errors
    assert counter[0] == threads * rounds
    assert len(ledger.holds) == threads * rounds
    helpers.assert_no_overlap(ledger.holds)
    assert {who for _, _, who in ledger.holds} == set(range(threads))


@pytest.mark.parametrize("masters", [1, 3, 5], indirect=True)
@pytest.mark.parametrize("lock", ["shared", "control: a key per holder"])
def test_processes_never_hold_at_once(masters: Masters, tmp_path: Path, lock: str) -> None:
    # Each hold increments a file-based counter (read, 2 ms, write): holders that overlap
    # lose increments and leave overlapping timestamps. The control run locks a key per
    # holder, so nothing excludes them, and shows that both checks catch it.
    counter = tmp_path / "counter"
    counter.write_text("0")
    holds = helpers.run_holders(
        3,
        masters.urls,
        tmp_path,
        key="procs",
        acquisitions=40,
        counter=counter,
        own_keys=lock != "shared",
    )
    assert len(holds) == 3 * 40
    assert len({pid for *_, pid in holds}) == 3
    if lock != "shared":
        assert int(counter.read_text()) < 3 * 40
        with pytest.raises(AssertionError, match="two holders at once"):
            helpers.assert_no_overlap(holds)
        return
    assert int(counter.read_text()) == 3 * 40
    helpers.assert_no_overlap(holds)


@ALL_N
def test_release_never_deletes_the_next_holders_lock(masters: Masters) -> None:
    a = make_redlock(masters, node_timeout=0.05)
    b = make_redlock(masters, node_timeout=0.05)
    lease_a = a.acquire("handover", 0.3)
    wait_for(lambda: not lease_a.held, timeout=2)
    name = lock_name("handover")
    wait_for(lambda: all(value_on(s, name) is None for s in masters), timeout=2)
    lease_b = b.acquire("handover", 5)

    assert lease_a.release() is False
    assert lease_a.release() is False  # twice: still nothing touched
    with pytest.raises(LockLost):
        lease_a.extend()
    for server in masters:
        assert value_on(server, name) == lease_b.token
    assert lease_b.held
    assert lease_b.release() is True


@pytest.mark.chaos
@ALL_N
def test_contended_and_unavailable_are_told_apart(masters: Masters) -> None:
    holder = make_redlock(masters, node_timeout=0.1)
    other = make_redlock(masters, node_timeout=0.1)
    lease = holder.acquire("apart", 10)
    with pytest.raises(LockContended) as contended:
        other.acquire("apart", 10)
    assert not isinstance(contended.value, QuorumUnavailable)
    assert contended.value.errors == {}
    assert contended.value.key == "apart"

    # A minority down: still contention, and the unreachable master is named.
    down = len(masters) // 2
    for server in masters[:down]:
        server.kill()
    for attempt in range(3 if down else 0):  # the first sees broken links, later ones refusals
        with pytest.raises(LockContended) as contended:
            other.acquire("apart", 10)
        named = set(contended.value.errors)
        if attempt == 0:
            # A send on a broken link may still succeed; the round then decides on the
            # others' replies before the link's EOF is read: it was not waited for.
            assert named
            assert named <= {s.url for s in masters[:down]}
        else:
            assert named == {s.url for s in masters[:down]}

    # A majority down: unavailable, whoever holds the key.
    masters[down].kill()
    with pytest.raises(QuorumUnavailable) as unavailable:
        other.acquire("apart", 10)
    assert not isinstance(unavailable.value, LockContended)
    assert set(unavailable.value.errors) == {s.url for s in masters[: down + 1]}
    with pytest.raises(QuorumUnavailable):
        other.acquire("free-key", 10)
    assert lease.held  # nobody told the holder anything: its validity is local


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_blocking_acquire_takes_a_freed_key_quickly(masters: Masters) -> None:
    holder = make_redlock(masters)
    waiter = make_redlock(masters)
    lease = holder.acquire("wait", 10)
    released_at: list[float] = []

    def release() -> None:
        lease.release()
        released_at.append(time.monotonic())

    timer = threading.Timer(0.5, release)
    timer.start()
    try:
        started = time.monotonic()
        got = waiter.acquire("wait", 10, blocking_timeout=5)
        acquired_at = time.monotonic()
    finally:
        timer.join(timeout=5)
    assert got.held
    assert acquired_at - started >= 0.5
    # Retries pause at most 200 ms (full jitter, capped), plus one round trip.
    assert acquired_at - released_at[0] < 0.3
    got.release()


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_blocking_acquire_gives_up_with_contended(masters: Masters) -> None:
    holder = make_redlock(masters)
    waiter = make_redlock(masters)
    lease = holder.acquire("busy", 10)
    started = time.monotonic()
    with pytest.raises(LockContended):
        waiter.acquire("busy", 10, blocking_timeout=0.6)
    elapsed = time.monotonic() - started
    assert 0.6 <= elapsed < 0.6 + 0.3
    assert lease.held
    lease.release()


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_blocking_timeout_none_waits_until_free(masters: Masters) -> None:
    holder = make_redlock(masters)
    waiter = make_redlock(masters)
    lease = holder.acquire("forever", 10)
    timer = threading.Timer(0.4, lease.release)
    timer.start()
    try:
        got = waiter.acquire("forever", 10, blocking_timeout=None)
    finally:
        timer.join(timeout=5)
    assert got.held
    assert lease.state == "released"
    got.release()


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_lock_context_releases_on_error(masters: Masters) -> None:
    rl = make_redlock(masters)
    with pytest.raises(RuntimeError), rl.lock("ctx", 10) as lease:
        raise RuntimeError("task failed")
    assert lease.state == "released"
    wait_for(lambda: all(not keys_on(s) for s in masters), timeout=2)


@pytest.mark.parametrize("masters", [1, 3], indirect=True)
def test_not_reentrant(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("once", 10)
    with pytest.raises(LockContended):
        rl.acquire("once", 10)
    with pytest.raises(LockContended), rl.lock("once", 10):
        pass  # pragma: no cover - never entered
    assert lease.held
    lease.release()
    with rl.lock("once", 10) as again:
        assert again.held
    assert not again.held
    assert again.state == "released"


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_release_without_waiting_returns_at_once_and_still_lands(masters: Masters) -> None:
    """``release(wait=False)`` (a task body that returned) writes and returns.

    With every master stopped, waiting for even one reply would take ``node_timeout``
    (0.5 s). The release runs once they resume, and the next round on the same
    connections reads past its replies.
    """
    rl = make_redlock(masters, node_timeout=0.5)
    lease = rl.acquire("no-wait", 10)
    for server in masters:
        server.pause()
    try:
        started = time.monotonic()
        confirmed = lease.release(wait=False)
        elapsed = time.monotonic() - started
    finally:
        for server in masters:
            server.resume()
    assert confirmed is False  # nothing was confirmed
    assert elapsed < 0.1
    assert not lease.held
    name = lock_name("no-wait")
    wait_for(lambda: all(value_on(s, name) is None for s in masters), timeout=5)
    again = rl.acquire("no-wait", 10)
    assert again.held
    assert again.release() is True
    assert all(value_on(s, name) is None for s in masters)


@pytest.mark.chaos
@pytest.mark.parametrize("masters", [3], indirect=True)
def test_expired_lease_is_not_held_without_asking_redis(masters: Masters) -> None:
    # A call that reached the stopped masters would take node_timeout (0.2 s) at least.
    rl = make_redlock(masters, node_timeout=0.2)
    before = time.monotonic()
    lease = rl.acquire("expire", 0.3)
    assert lease.deadline <= before + 0.3
    for server in masters:
        server.pause()
    try:
        # Every answer is local: it comes at once although no master answers.
        for _ in range(20):
            started = time.monotonic()
            held = lease.held
            lease.remaining()
            assert time.monotonic() - started < 0.05
        assert held
        wait_for(lambda: not lease.held, timeout=2)
        assert time.monotonic() >= lease.deadline
        assert lease.remaining() == 0.0
        started = time.monotonic()
        with pytest.raises(LockLost, match="validity ran out"):
            lease.ensure_held()
        with pytest.raises(LockLost):
            _ = lease.fence
        assert time.monotonic() - started < 0.05
        assert lease.state == "held"  # expiry alone is not a loss event
    finally:
        for server in masters:
            server.resume()


# -- keys on the masters ----------------------------------------------------------------------


@ALL_N
def test_release_leaves_only_the_fence_counter(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("tidy", 10, meta={"task_id": "t-1", "host": "worker-7"})
    _ = lease.fence
    for server in masters:
        keys = keys_on(server)
        assert set(keys) == {
            lock_name("tidy"),
            lock_name("tidy", "meta"),
            lock_name("tidy", "fence"),
        }
    assert lease.release() is True
    fence = lock_name("tidy", "fence")

    def only_fence_left() -> bool:
        return all(set(keys_on(s)) == {fence} for s in masters)

    wait_for(only_fence_left, timeout=2, message="lock or metadata left behind")
    for server in masters:
        assert keys_on(server)[fence] > 0  # the counter has a TTL

    plain = rl.acquire("plain", 10)
    assert plain.release() is True
    wait_for(lambda: all(lock_name("plain") not in keys_on(s) for s in masters), timeout=2)
    assert all(set(keys_on(s)) == {fence} for s in masters)


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_meta_has_the_lock_ttl_and_goes_with_it(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("meta", 10, meta={"task_id": "t-9", "pid": 1234})
    for server in masters:
        with server.client(decode_responses=True) as conn:
            assert conn.hgetall(lock_name("meta", "meta")) == {"task_id": "t-9", "pid": "1234"}
            lock_ttl = conn.pttl(lock_name("meta"))
            meta_ttl = conn.pttl(lock_name("meta", "meta"))
        assert 9000 < lock_ttl <= 10000
        assert abs(lock_ttl - meta_ttl) < 100
    lease.extend(20)
    for server in masters:
        with server.client() as conn:
            assert 19000 < conn.pttl(lock_name("meta", "meta")) <= 20000
            assert 19000 < conn.pttl(lock_name("meta")) <= 20000
    lease.release()
    wait_for(lambda: all(not keys_on(s) for s in masters), timeout=2)


# -- how masters are given ----------------------------------------------------------------------

ACL_PASSWORD = "acl-Secret-77"
SECRETS = ("pw-url-Secret-11", "pw-unix-Secret-22", "pw-dict-Secret-33", "pw-client-Secret-44")


def assert_no_secret(text: str) -> None:
    for secret in (ACL_PASSWORD, *SECRETS):
        assert secret not in text


def test_every_master_spec_form(master_factory, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO)
    acl = master_factory(password="default-Secret-00")
    with acl.client() as conn:
        conn.execute_command(
            "ACL", "SETUSER", "alice", "on", f">{ACL_PASSWORD}", "~*", "&*", "+@all"
        )
    by_url = master_factory(password=SECRETS[0])
    by_unix = master_factory(password=SECRETS[1], unix_socket=True)
    by_dict = master_factory(password=SECRETS[2])
    by_client = master_factory(password=SECRETS[3])
    servers: list[RedisServer] = [acl, by_url, by_unix, by_dict, by_client]
    client = by_client.client()
    specs = [
        f"redis://alice:{ACL_PASSWORD}@127.0.0.1:{acl.port}/0",
        by_url.url,
        by_unix.unix_url,
        {"host": "127.0.0.1", "port": by_dict.port, "password": SECRETS[2], "db": 0},
        client,
    ]
    assert SECRETS[1] in by_unix.unix_url  # the unix URL carries its password
    rl = make_redlock(specs)
    lease = rl.acquire("specs", 10)
    for server in servers:
        assert value_on(server, lock_name("specs")) == lease.token
    assert lease.release() is True
    assert_no_secret(repr(rl))
    assert_no_secret(json.dumps(rl.master_names))
    assert_no_secret(repr(lease))

    for server in servers[:3]:
        server.kill()
    with pytest.raises(QuorumUnavailable) as unavailable:
        rl.acquire("specs", 10)
    exc = unavailable.value
    assert len(exc.errors) == 3
    for text in (str(exc), repr(exc), json.dumps(exc.args)):
        assert_no_secret(text)
    assert_no_secret(caplog.text)
    client.close()


def test_wrong_password_is_unavailable_and_not_shown(master_factory) -> None:  # type: ignore[no-untyped-def]
    server = master_factory(password="right-Secret-55")
    wrong = f"redis://:{ACL_PASSWORD}@127.0.0.1:{server.port}/0"
    rl = make_redlock([wrong])
    with pytest.raises(QuorumUnavailable) as unavailable:
        rl.acquire("auth", 10)
    exc = unavailable.value
    assert list(exc.errors) == [f"redis://127.0.0.1:{server.port}/0"]
    for text in (str(exc), repr(exc), json.dumps(exc.args), repr(rl)):
        assert_no_secret(text)


def test_bad_specs_are_improperly_configured() -> None:
    with pytest.raises(ImproperlyConfigured) as bad_scheme:
        Redlock([f"http://alice:{ACL_PASSWORD}@127.0.0.1:1/0"])
    assert "http" in str(bad_scheme.value)
    assert_no_secret(str(bad_scheme.value))
    with pytest.raises(ImproperlyConfigured):
        Redlock([])
    with pytest.raises(ImproperlyConfigured):
        Redlock([{"host": "127.0.0.1", "no_such_argument": 1}])
    with pytest.raises(ImproperlyConfigured):
        Redlock([12345])  # type: ignore[list-item]
    with pytest.raises(ImproperlyConfigured):
        Redlock(["redis://127.0.0.1:1/0"], key_prefix="a{b}")
    with pytest.raises(ImproperlyConfigured):
        Redlock(["redis://127.0.0.1:1/0"], node_timeout=0)
    with pytest.raises(ImproperlyConfigured):
        Redlock(["redis://127.0.0.1:1/0"], clock_drift_factor=0.5)
    with pytest.raises(
        ImproperlyConfigured, match=r"spin_wait must be a finite number in \[0, 1\]"
    ):
        Redlock(["redis://127.0.0.1:1/0"], spin_wait=-1)
    with pytest.raises(ImproperlyConfigured, match=r"spin_wait must be shorter than node_timeout"):
        Redlock(["redis://127.0.0.1:1/0"], node_timeout=0.1, spin_wait=0.1)
    # A single URL (not a list) is one master.
    assert len(Redlock("redis://127.0.0.1:1/0").masters) == 1
    assert issubclass(ImproperlyConfigured, RedlockError)


def test_a_master_listed_twice_is_refused() -> None:
    """Listed twice, one server would count twice towards the quorum."""
    client = redis.Redis(host="127.0.0.1", port=1)
    for masters in (
        ["redis://R1:6379/0", "redis://r2:6379/0", "redis://r1"],
        ["redis://127.0.0.1:1/0", {"host": "127.0.0.1", "port": 1}],
        [client, "redis://r2:6379/0", client],
        ["unix:///run/r.sock", "unix:///run/r.sock?db=0"],
    ):
        with pytest.raises(ImproperlyConfigured, match=r"#\d and #\d are the same master"):
            Redlock(masters)
    # Another port of the same host is another server.
    assert len(Redlock(["redis://r1:6379/0", "redis://r1:6380/0"]).masters) == 2


def test_sentinel_masters_are_told_apart_by_their_sentinels() -> None:
    """Review r10: ``Sentinel.master_for()`` clients of distinct deployments were all taken
    for localhost:6379 (their pool has no host) and refused as one master."""
    from redis.sentinel import Sentinel

    clients = [Sentinel([(host, 26379)]).master_for("mymaster") for host in ("s1", "s2", "s3")]
    assert len(Redlock(clients).masters) == 3
    assert len(Redlock([clients[0], "redis://localhost:6379/0"]).masters) == 2
    with pytest.raises(ImproperlyConfigured, match=r"#1 and #2 are the same master"):
        Redlock([Sentinel([("S1", 26379)]).master_for("mymaster"), clients[0]])
    spec = {"sentinels": [("s1", 26379), ("s2", 26379)], "service_name": "mymaster"}
    shuffled = {"sentinels": [("S2", 26379), ("s1", 26379)], "service_name": "mymaster"}
    with pytest.raises(ImproperlyConfigured, match=r"#1 and #2 are the same master"):
        Redlock([spec, shuffled])
    assert len(Redlock([spec, {**spec, "db": 1}]).masters) == 2


def test_bad_arguments_raise_before_any_round() -> None:
    rl = Redlock(["redis://127.0.0.1:1/0"], node_timeout=0.25)  # nothing listens there
    with pytest.raises(ValueError, match="node_timeout"):
        rl.acquire("k", 0.25)
    with pytest.raises(ValueError, match="blocking_timeout"):
        rl.acquire("k", 10, blocking_timeout=-1)
    with pytest.raises(ValueError, match="renew_every"):
        rl.acquire("k", 10, renew_every=10)
    with pytest.raises(TypeError, match="ttl must be a number in"):
        rl.acquire("k", "10")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key"):
        rl.acquire("", 10)


@ALL_N
def test_single_master_logs_a_note(masters: Masters, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="celery_redlock.lock")
    rl = make_redlock(masters)
    notes = [r for r in caplog.records if "single master" in r.getMessage()]
    if len(masters) == 1:
        assert len(notes) == 1
        assert notes[0].levelno == logging.INFO
        with rl.lock("solo", 5) as lease:
            assert lease.held
            assert rl.quorum == 1
    else:
        assert notes == []
        assert rl.quorum == len(masters) // 2 + 1


@pytest.mark.parametrize("masters", [3], indirect=True)
def test_held_elsewhere_reads_whether_an_acquire_would_fail(masters: Masters) -> None:
    rl, other = make_redlock(masters), make_redlock(masters)
    assert rl.held_elsewhere("read") is False
    lease = other.acquire("read", 10)
    assert rl.held_elsewhere("read") is True
    # Locked on one master only (a stale minority key): an acquire can still win.
    lease.release()
    with masters[0].client() as conn:
        conn.set(lock_name("read"), "stale", px=10000)
    assert rl.held_elsewhere("read") is False
    masters[1].kill()
    masters[2].kill()
    with pytest.raises(QuorumUnavailable, match="only 1 of 3 masters answered the read"):
        rl.held_elsewhere("read")


def test_unclaim_without_a_quorum_raises_unavailable(masters: Masters) -> None:
    """Too few masters answering cannot tell whether the claim is gone: QuorumUnavailable,
    not the False that means "the claim named someone else"."""
    rl = make_redlock(masters)
    try:
        assert rl.claim("k", "marker", "me", 60) == ("me", True)
        assert rl.unclaim("k", "marker", "someone else") is False
        masters[0].kill()
        masters[1].kill()
        with pytest.raises(QuorumUnavailable, match="1 of 3 masters answered"):
            rl.unclaim("k", "marker", "me")
    finally:
        rl.close()

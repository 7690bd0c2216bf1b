"""Reproductions from the hostile review of the lock core, kept as regression tests.

Each failed on the tree it was found on (038625b): file descriptors from 1024 on made
every round raise; a client whose every master was marked down behind any latency never
recovered; one client's slow master starved another client's renewals; the restart
quarantine was bypassed by spelling a server another way (two holders); a claim's retry on
another lane could be undone by its earlier attempt's late undo; companions could name the
lock's own keys; and an expired lease could be extended back to held.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from celery_redlock.exceptions import LockContended, LockLost, QuorumUnavailable
from celery_redlock.lock import Redlock
from celery_redlock.lock.lease import Lease
from celery_redlock.testing import Masters, start_masters, wait_for
from tests.chaos.proxy import ProxyProcess

from . import helpers
from .helpers import keys_on, make_redlock


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    yield from helpers.clean_state()


@contextlib.contextmanager
def proxy_for(masters: Masters) -> Iterator[ProxyProcess]:
    proxy = ProxyProcess([(m.host, m.port) for m in masters])
    try:
        yield proxy
    finally:
        proxy.close()


@contextlib.contextmanager
def descriptors_above(number: int) -> Iterator[None]:
    """Open ``/dev/null`` until the next descriptor the process gets is above ``number``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < number + 200:
        pytest.fail(f"RLIMIT_NOFILE hard limit {hard} is too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, number + 200), hard))
    opened: list[int] = []
    try:
        while not opened or opened[-1] < number:
            opened.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in opened:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_descriptors_from_1024_on_work(masters: Masters) -> None:
    # select.select() refuses them (FD_SETSIZE); every round raised ValueError, and so did
    # release(), which must never raise.
    early = make_redlock(masters)
    lease = early.acquire("early", 5)
    early.close()  # its next round reconnects, on descriptors above 1024
    with descriptors_above(1100):
        rl = make_redlock(masters)
        late = rl.acquire("late", 5)
        assert late.held
        assert late.fence > 0
        assert late.release() is True
        assert lease.release() is True
    for server in masters:  # the fence counter stays; the locks are gone
        assert set(keys_on(server)) <= {helpers.lock_name("late", "fence")}


def test_every_master_down_behind_latency_recovers(masters: Masters) -> None:
    with proxy_for(masters) as proxy:
        proxy.set("*", "delay", 0.002, 0.002)
        rl = make_redlock(proxy.urls(), node_timeout=0.2)
        rl.acquire("warm", 5).release()
        proxy.set("*", "blackhole")
        with pytest.raises(QuorumUnavailable):
            rl.acquire("k", 5)
        proxy.set("*", "delay", 0.002, 0.002)

        def acquires() -> bool:
            try:
                rl.acquire("k", 5).release()
            except QuorumUnavailable:
                return False
            return True

        # It never recovered: a master known down was only polled (timeout 0), and only
        # a reply accepted in the round itself marked it up.
        wait_for(acquires, timeout=3, interval=0.02, message="no acquire after the heal")


def test_a_slow_client_does_not_starve_another_clients_renewals(masters: Masters) -> None:
    with start_masters(3) as other, proxy_for(other) as proxy:
        slow = make_redlock(proxy.urls(), node_timeout=2.0)
        fast = make_redlock(masters, node_timeout=0.05)
        slow_lease = slow.acquire("report", 30, auto_renew=True, renew_every=0.5)
        fast_lease = fast.acquire("job", 1, auto_renew=True)
        proxy.set(0, "blackhole")  # the slow client keeps a quorum of 2, waiting 2 s on #1
        end = time.monotonic() + 3
        while time.monotonic() < end:
            assert fast_lease.held, f"starved: {fast_lease.lost_reason}"
            time.sleep(0.02)
        assert slow_lease.held
        proxy.set(0, "pass")
        fast_lease.release()
        slow_lease.release()


def test_the_quarantine_holds_under_another_spelling(master_factory: Any) -> None:
    a, b, c = (master_factory(persistence="none") for _ in range(3))
    by_ip = [m.url for m in (a, b, c)]
    by_name = [url.replace("127.0.0.1", "localhost") for url in by_ip]
    first = make_redlock(by_ip, node_timeout=0.2)
    first.acquire("warm", 1).release()
    c.kill()
    held = first.acquire("k", 20)  # on a and b
    b.restart(keep_data=False)
    c.start()
    other = make_redlock(by_name, node_timeout=0.2)
    with pytest.raises((QuorumUnavailable, LockContended)):
        other.acquire("k", 20)
    assert held.held
    held.release()


def test_claim_retries_keep_their_first_lane(masters: Masters) -> None:
    # Attempt 1 finds no winner and undoes its claim; attempt 2 must go out on the same
    # connections, behind that undo: on another lane, the late undo could delete the
    # claim attempt 2 counted as won (two claimants told they hold it).
    rl = make_redlock(masters)
    for server, holder in ((masters[1], "y"), (masters[2], "z")):
        server.client().set(helpers.lock_name("c", "run"), holder, px=60_000)
    lanes: list[Any] = []
    real_round = rl._round

    def spy(lane: Any, *args: Any, **kwargs: Any) -> Any:
        lanes.append(lane)
        return real_round(lane, *args, **kwargs)

    rl._round = spy  # type: ignore[method-assign]
    release_first = threading.Event()

    def hold_first_lane() -> None:
        # While the claim sleeps between attempts, another thread of the client takes
        # the lane it used (a round of its own): without the rule, attempt 2 opens
        # another one.
        wait_for(lambda: lanes, timeout=5)
        lane = lanes[0]
        with lane.lock:
            release_first.wait(0.3)

    thread = threading.Thread(target=hold_first_lane)
    thread.start()
    try:
        with pytest.raises(LockContended, match="did not settle"):
            rl.claim("c", "run", "x", 30)
    finally:
        release_first.set()
        thread.join(5)
    assert len(lanes) >= 4  # claim and undo rounds of several attempts
    assert all(lane is lanes[0] for lane in lanes)


@pytest.mark.parametrize("suffix", ["meta", "fence"])
def test_companions_cannot_name_the_locks_own_keys(masters: Masters, suffix: str) -> None:
    rl = make_redlock(masters)
    with pytest.raises(ValueError, match="reserved"):
        rl.acquire("k", 5, clear_companion=(suffix, "x"))
    lease = rl.acquire("k", 5)
    _ = lease.fence
    with pytest.raises(ValueError, match="reserved"):
        lease.clear_on_release = (suffix, "x")
    assert lease.release() is True
    for server in masters:  # the lock and its metadata are gone; the fence counter stays
        assert set(keys_on(server)) == {helpers.lock_name("k", "fence")}


def test_an_expired_lease_cannot_be_extended_back(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("short", 0.5)
    wait_for(lambda: not lease.held, timeout=2)
    with pytest.raises(LockLost):
        lease.extend(30)
    assert not lease.held


def test_one_redlock_unaffected_by_the_descriptor_limit_in_a_child(masters: Masters) -> None:
    # The same in a forked child (its connections are new): acquire and release work.
    rl: Redlock = make_redlock(masters)
    rl.acquire("parent", 5).release()

    def acquire_and_release() -> bytes:
        with descriptors_above(1100):
            lease = rl.acquire("child", 5)
            return b"ok" if lease.release() else b"no"

    assert helpers.in_child(acquire_and_release) == b"ok"


# -- from a second review (code reading) ---------------------------------------------------------


def test_a_lease_not_held_at_its_renewal_is_left_out_not_the_masters(masters: Masters) -> None:
    # A lease whose validity ended (or that was released) just before its renewal was sent
    # went out with extension number 0; every master answered '2' for it, the reply was
    # taken for garbage and every master of the client was marked down.
    now = [1000.0]
    rl = make_redlock(masters, clock=lambda: now[0])
    expired = rl.acquire("expired", 30)
    now[0] += 31  # its validity ended; its key is still on the masters
    healthy = rl.acquire("healthy", 30)
    outcomes = rl._renew_many([expired, healthy], [30.0, 30.0])
    assert outcomes[1] == "ok"
    assert outcomes[0] != "ok"
    assert not any(m.down for m in rl.masters)
    assert not expired.held
    assert healthy.held
    healthy.release()


def test_a_failed_shorter_extend_brings_the_next_renewal_forward(masters: Masters) -> None:
    rl = make_redlock(masters, node_timeout=0.05)
    lease = rl.acquire("soon", 30, auto_renew=True)  # renewed every 10 s
    masters[1].pause()
    masters[2].pause()
    try:
        with pytest.raises(QuorumUnavailable):
            lease.extend(3)  # applied where it arrived; the deadline is now 3 s away
    finally:
        masters[1].resume()
        masters[2].resume()
    end = time.monotonic() + 4
    while time.monotonic() < end:  # renewed in time, not at the planned 10 s
        assert lease.held, f"lost: {lease.lost_reason}"
        time.sleep(0.02)
    lease.release()


def test_a_renewal_period_past_the_validity_is_refused() -> None:
    """Review r10: ``renew_every`` below ``ttl`` but past the lease's validity (``ttl``
    less its drift allowance) was accepted; every such lease was lost at its first renewal
    while its key lived on. No round is needed to refuse it."""
    rl = Redlock(["redis://127.0.0.1:1/0"], node_timeout=0.25)  # nothing listens there
    with pytest.raises(ValueError, match=r"renew_every \(9.95s\) must be shorter than the lease's"):
        rl.acquire("k", 10, renew_every=9.95)  # validity 10 - 0.102 = 9.898 s
    drifty = Redlock(["redis://127.0.0.1:1/0"], node_timeout=0.01, clock_drift_factor=0.45)
    with pytest.raises(ValueError, match="renew_every"):
        drifty.acquire("k", 1, renew_every=0.6)  # validity 0.548 s
    # The default is a third of the TTL, and half the validity where that is less.
    assert rl._default_renew_every(10) == pytest.approx(10 / 3)
    assert drifty._default_renew_every(1) == pytest.approx((1 - 0.452) / 2)
    # A lease too short to renew in time (validity 9 ms, renewals 10 ms apart at least)
    # may still be taken, but not renewed.
    with pytest.raises(ValueError, match="renew_every"):
        drifty.acquire("k", 0.02, auto_renew=True)


def test_extend_to_a_shorter_ttl_brings_a_given_renewal_period_within_its_validity(
    masters: Masters,
) -> None:
    """Review r10: a renew_every given for a longer TTL was kept after extend(ttl) unless
    it reached the new TTL, so one just below it renewed after the validity ended."""
    rl = make_redlock(masters)
    lease = rl.acquire("shrink", 30, auto_renew=True, renew_every=5.99)
    try:
        lease.extend(6)  # validity 6 - 0.062 = 5.938 s: a renewal every 5.99 s comes late
        assert lease.renew_every < 6 - rl._drift(6)
        assert lease.renew_every == pytest.approx(2)
    finally:
        lease.release()


def test_extend_in_a_forked_child_raises_instead_of_hanging(masters: Masters) -> None:
    rl = make_redlock(masters)
    lease = rl.acquire("forked-extend", 10)

    def extend() -> bytes:
        try:
            lease.extend(5)
        except LockLost:
            return b"lost"
        return b"extended"

    with lease._ext_lock:  # a parent thread is extending it at fork time
        assert helpers.in_child(extend, timeout=5) == b"lost"
    lease.release()


def _wait_undone(masters: Masters, name: str) -> None:
    """Wait until no master holds ``name`` (an interrupted operation's undo landed)."""
    for server in masters:
        wait_for(
            lambda server=server: name not in keys_on(server),
            timeout=10,
            message=f"{name} undone on {server!r}",
        )


class _Interrupted(Exception):
    """What a signal handler raises in these tests (as Celery's soft time limit does)."""


@contextlib.contextmanager
def _interrupt_after(seconds: float) -> Iterator[None]:
    def handler(signum: int, frame: object) -> None:
        raise _Interrupted("the soft time limit")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("operation", ["acquire", "claim"])
def test_an_interrupted_acquire_or_claim_leaves_nothing_on_the_masters(
    masters: Masters, operation: str
) -> None:
    """Review r12: a soft time limit landing while an acquire waited for its replies left
    the lock on every master for its whole TTL, held by nobody (no lease existed to
    release it): the job's next run, and every other job of the key, was refused for a
    minute. The same for a claim (a dedupe marker for a job that was never published)."""
    rl = make_redlock(masters, node_timeout=5.0)
    rl.acquire("warm-up", 10).release()  # connections open, scripts loaded
    masters[1].pause()
    masters[2].pause()  # the round waits for a quorum: the signal lands in the wait
    if operation == "acquire":
        call: Any = lambda: rl.acquire("k", 60, auto_renew=True)  # noqa: E731
    else:
        call = lambda: rl.claim("k", "dedupe:t", "job-1", 3600, guard_for=0)  # noqa: E731
    try:
        with pytest.raises(_Interrupted), _interrupt_after(0.2):
            call()
    finally:
        masters[1].resume()
        masters[2].resume()
    _wait_undone(masters, "redlock:{k}" if operation == "acquire" else "redlock:{k}:dedupe:t")
    # The client goes on: the key is free for the next one.
    lease = rl.acquire("k", 10)
    assert lease.held
    lease.release()


class _CutShort:
    """Makes the next ``count`` ``Slot`` constructions raise :class:`_Interrupted`: an
    exception landing right after a command was written, before its reply's slot is
    queued (where a signal handler's can land)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int = 1) -> None:
        from celery_redlock.lock import master

        self.left = count
        real = master.Slot

        def slot(expected: int) -> Any:
            if self.left > 0:
                self.left -= 1
                raise _Interrupted("the soft time limit")
            return real(expected)

        monkeypatch.setattr(master, "Slot", slot)


def test_an_acquire_cut_short_after_writing_its_command_is_undone(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r13: the undo skipped a link whose command was fully written when the
    exception landed before the reply's slot was queued; the master ran the command and
    the lock stood for its TTL, held by nobody."""
    rl = make_redlock(masters)
    rl.acquire("warm-up", 10).release()
    _CutShort(monkeypatch, count=1)
    with pytest.raises(_Interrupted):
        rl.acquire("k", 60)
    for server in masters:
        wait_for(lambda server=server: "redlock:{k}" not in keys_on(server), timeout=5)


class _AsSendReturns:
    """A ``sys.setprofile`` hook raising :class:`_Interrupted` as the ``nth`` socket send of
    ``Link.send`` returns (a pending signal's handler runs there): the whole command is
    written and the link still notes it as maybe partly written."""

    def __init__(self, nth: int) -> None:
        from celery_redlock.lock.master import Link

        self.code = Link.send.__code__
        self.left = nth
        self.fired = False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and frame.f_code is self.code and arg.__name__ == "send":
            if self.left == 0:
                self.fired = True
                sys.setprofile(None)
                raise _Interrupted("the soft time limit")
            self.left -= 1


@pytest.mark.parametrize("operation", ["acquire", "claim"])
@pytest.mark.parametrize("nth", [0, 1, 2])
def test_an_interrupt_as_a_send_returns_is_undone_on_a_new_connection(
    masters: Masters, operation: str, nth: int
) -> None:
    """Review of 2026-11-28: an exception landing as ``sock.send`` returned (the command
    whole on its way, ``partial`` still set) had the undo skip that link and only close
    it; the master ran the command, and the lock (or a claim for a job never published)
    stood there for its TTL, held by nobody."""
    rl = make_redlock(masters, node_timeout=1.0)
    rl.acquire("warm-up", 10).release()  # connections open, scripts loaded
    if operation == "acquire":
        call: Any = lambda: rl.acquire("k", 60)  # noqa: E731
    else:
        call = lambda: rl.claim("k", "dedupe:t", "job-1", 3600, guard_for=0)  # noqa: E731
    hook = _AsSendReturns(nth)
    sys.setprofile(hook)
    try:
        with pytest.raises(_Interrupted):
            call()
    finally:
        sys.setprofile(None)
    assert hook.fired
    _wait_undone(masters, "redlock:{k}" if operation == "acquire" else "redlock:{k}:dedupe:t")
    lease = rl.acquire("k", 10)  # the client goes on
    lease.release()


@pytest.mark.parametrize("masters", [1, 3], indirect=True)
def test_an_interrupted_duplicate_claim_leaves_the_first_claim(masters: Masters) -> None:
    """Review of the undo on a new connection: a claim of a job id another call had
    already claimed (a duplicate publish), interrupted as its send returned, wrote
    nothing, but its undo deleted the value wherever it was (the other call's marker, on a
    new connection too): a third publish of the id was then taken as fresh (published
    twice). An interrupted claim's undo now deletes only what its own call wrote."""
    first = make_redlock(masters, node_timeout=1.0)
    duplicate = make_redlock(masters, node_timeout=1.0)
    third = make_redlock(masters, node_timeout=1.0)
    duplicate.acquire("warm-up", 10).release()
    assert first.claim("k", "dedupe:t", "job-1", 3600, guard_for=0) == ("job-1", True)
    hook = _AsSendReturns(0)
    sys.setprofile(hook)
    try:
        with pytest.raises(_Interrupted):
            duplicate.claim("k", "dedupe:t", "job-1", 3600, guard_for=0)
    finally:
        sys.setprofile(None)
    assert hook.fired
    wait_for(
        lambda: not any(t.name == "redlock-undo" for t in threading.enumerate()),
        timeout=10,
        message="the undo's thread done",
    )
    assert all("redlock:{k}:dedupe:t" in keys_on(server) for server in masters)
    assert third.claim("k", "dedupe:t", "job-1", 3600, guard_for=0) == ("job-1", False)


@pytest.mark.parametrize("masters", [1], indirect=True)
def test_an_undo_thread_that_cannot_start_leaves_the_interrupt(
    masters: Masters, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Review of the undo on a new connection: where no thread could be started (a
    process at its thread or memory limit), ``RuntimeError`` replaced the interrupting
    exception (a task's soft time limit handler never ran). It is logged instead."""
    real = threading.Thread

    class Refused(real):  # type: ignore[valid-type,misc]
        def start(self) -> None:
            if self.name == "redlock-undo":
                raise RuntimeError("can't start new thread")
            super().start()

    rl = make_redlock(masters, node_timeout=1.0)
    rl.acquire("warm-up", 10).release()
    monkeypatch.setattr(threading, "Thread", Refused)
    hook = _AsSendReturns(0)
    sys.setprofile(hook)
    try:
        with pytest.raises(_Interrupted):
            rl.acquire("k", 60)
    finally:
        sys.setprofile(None)
    assert hook.fired
    assert "could not undo an interrupted lock operation" in caplog.text


@pytest.mark.parametrize("masters", [1], indirect=True)
def test_a_release_cut_short_never_lends_its_reply_to_the_next_round(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r13: a release cut short between writing its command and queueing the slot
    for its reply left the link open; the next round on it (an acquire of a key another
    client holds) took the release's ``1`` for its own vote: two holders."""
    rl = make_redlock(masters)
    other = make_redlock(masters)
    mine = rl.acquire("a", 60)
    theirs = other.acquire("b", 60)
    cut = _CutShort(monkeypatch, count=1)
    with pytest.raises(_Interrupted):
        mine.release()
    assert cut.left == 0
    monkeypatch.undo()
    with pytest.raises(LockContended):
        rl.acquire("b", 60)
    assert theirs.owned()
    theirs.release()


def test_a_lane_left_locked_does_not_hang_a_lease_release(masters: Masters) -> None:
    """Review r13: an exception landing as a lane was given back left it locked, and a
    later release of a lease taken on it waited for it for ever."""
    rl = make_redlock(masters, node_timeout=0.05)
    lease = rl.acquire("k", 60)
    assert lease._lane.lock.acquire(blocking=False)  # as if never given back
    started = time.monotonic()
    assert lease.release()  # on a fresh lane, after 8 * node_timeout + 1 s
    assert time.monotonic() - started < 5
    for server in masters:
        assert "redlock:{k}" not in keys_on(server)


class _NextCheckAfter:
    """A ``sys.setprofile`` hook that raises :class:`_Interrupted` at the ``nth`` point
    where CPython could run a pending signal handler (a Python function's entry, or the
    return of a C call) after ``code`` first returned: a soft time limit landing there."""

    def __init__(self, code: Any, nth: int = 1) -> None:
        self.code = code
        self.left = -1  # not armed
        self.nth = nth
        self.fired = False

    def __call__(self, frame: Any, event: str, arg: object) -> None:
        if self.left > 0 and event in ("call", "c_return"):
            self.left -= 1
            if self.left == 0:
                self.fired = True
                sys.setprofile(None)
                raise _Interrupted("the soft time limit")
        if self.left < 0 and event == "return" and frame.f_code is self.code:
            self.left = self.nth


def test_a_lock_block_interrupted_as_it_starts_releases(masters: Masters) -> None:
    """Review r14: ``with rl.lock(key, ttl, auto_renew=True)`` interrupted right after
    its acquire returned (at ``Lease.__enter__``'s entry) left the lease unreleased and
    renewed by the heartbeat for as long as the process lived: held by nobody, every
    other client refused."""
    rl = make_redlock(masters)
    other = make_redlock(masters)
    hook = _NextCheckAfter(Redlock.acquire.__code__)
    sys.setprofile(hook)
    try:
        with pytest.raises(_Interrupted), rl.lock("job", 1.0, auto_renew=True):
            pass  # pragma: no cover - interrupted before the block
    finally:
        sys.setprofile(None)
    assert hook.fired
    # Released at once (an orphan would be renewed for ever: 3 TTLs are plenty).
    lease = wait_for(lambda: _try(other, "job"), timeout=3, message="the key freed")
    lease.release()


def _try(rl: Redlock, key: str) -> Any:
    try:
        return rl.acquire(key, 1.0)
    except LockContended:
        return None


def test_a_release_cut_short_is_sent_again(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r14: a ``release()`` cut short before its command was written (a signal
    landing while it waited for its lane) marked the lease released; a second
    ``release()`` did nothing and the lock stood for its TTL, held by nobody. Now the
    next ``release()``, or the block's exit, sends it again."""
    rl = make_redlock(masters)
    real = rl._release
    cuts = [1]

    def cut_short(lease: Any, *, wait: bool = True) -> tuple[bool, bool]:
        if cuts:
            cuts.pop()
            raise _Interrupted("the soft time limit")
        return real(lease, wait=wait)

    monkeypatch.setattr(rl, "_release", cut_short)
    lease = rl.acquire("k", 60, auto_renew=True)
    with pytest.raises(_Interrupted):
        lease.release()
    assert not lease.held
    assert lease.release()  # sent again, and confirmed
    assert all("redlock:{k}" not in keys_on(server) for server in masters)
    # Inside a block: the block's exit sends it again.
    lease = rl.acquire("k2", 60)
    cuts.append(1)
    with pytest.raises(_Interrupted), lease:
        lease.release()
    assert all("redlock:{k2}" not in keys_on(server) for server in masters)


@pytest.mark.parametrize("nth", range(1, 9))
def test_an_acquire_won_then_interrupted_on_its_way_out_is_released(
    masters: Masters, nth: int
) -> None:
    """Review r14: an exception landing after a won round, as the round's guard and lane
    were left (at ``Lane.__exit__``'s entry), left the lock on every master for its TTL
    with no lease to release it, and the lane locked for good. Here it lands at each of
    the first points after the lease is built where a signal handler can run."""
    rl = make_redlock(masters)
    other = make_redlock(masters)
    rl.acquire("warm-up", 10).release()
    hook = _NextCheckAfter(Lease.__init__.__code__, nth)
    sys.setprofile(hook)
    try:
        lease = rl.acquire("job", 30, auto_renew=True)
    except _Interrupted:
        lease = None
    finally:
        sys.setprofile(None)
    if lease is not None:  # acquire had returned before the nth point
        assert not hook.fired
        lease.release()
    wait_for(
        lambda: all("redlock:{job}" not in keys_on(server) for server in masters),
        timeout=3,
        message="no lock left on the masters",
    )
    assert not any(lane.lock.locked() for lane in rl._lanes)
    other.acquire("job", 5).release()


@pytest.mark.parametrize("nth", range(1, 5))
def test_a_claim_won_then_interrupted_on_its_way_out_is_undone(masters: Masters, nth: int) -> None:
    """Review r14 (the claim's side of the same window): a claim won, then interrupted as
    its lane was given back, left a marker naming a job its caller never published;
    identical publishes were folded into it until the marker expired (lost jobs)."""
    rl = make_redlock(masters)
    rl.claim("warm-up", "dedupe:t", "x", 10, guard_for=0)
    hook = _NextCheckAfter(Redlock._granted.__code__, nth)
    sys.setprofile(hook)
    try:
        got: Any = rl.claim("k", "dedupe:t", "job-1", 3600)
    except _Interrupted:
        got = None
    finally:
        sys.setprofile(None)
    if got is not None:
        assert not hook.fired
        assert got == ("job-1", True)
        return
    wait_for(
        lambda: all("redlock:{k}:dedupe:t" not in keys_on(server) for server in masters),
        timeout=3,
        message="no marker left on the masters",
    )
    assert not any(lane.lock.locked() for lane in rl._lanes)
    assert rl.claim("k", "dedupe:t", "job-2", 3600) == ("job-2", True)


def test_a_release_from_another_thread_while_one_is_sending_is_a_second_release(
    masters: Masters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r15: with r14's resend, a ``release()`` from another thread while the block's
    own release was on its way sent a second release round; when it reached the masters
    first, the block's exit took the refusal for a loss and raised ``LockLost``."""
    rl = make_redlock(masters)
    real = rl._release
    sending = threading.Event()
    go_on = threading.Event()

    def slow_in_the_block(lease: Any, *, wait: bool = True) -> tuple[bool, bool]:
        if threading.current_thread().name == "block":
            sending.set()
            assert go_on.wait(10)
        return real(lease, wait=wait)

    monkeypatch.setattr(rl, "_release", slow_in_the_block)
    lease = rl.acquire("k", 60)
    errors: list[BaseException] = []

    def block() -> None:
        try:
            with lease:
                pass
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=block, name="block")
    thread.start()
    try:
        assert sending.wait(10)
        assert lease.release() is False  # a second release: nothing sent
    finally:
        go_on.set()
        thread.join(10)
    assert errors == []
    assert all("redlock:{k}" not in keys_on(server) for server in masters)

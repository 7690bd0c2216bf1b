"""How a run ends, in-process: exceptions and retries release the lock, a retry is never
blocked by its own lock or dedupe marker, and a lost lock is reported or interrupts the body.

(Exit paths that need a process to die, such as time limits, revoke with terminate and
SIGKILL, are in test_prefork.py.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery.result import AsyncResult
from celery.signals import before_task_publish

from celery_redlock import LockLost, LockLostInterrupt, Redlock, SingletonTask, signals
from celery_redlock.keys import redis_key
from celery_redlock.testing import wait_for

from .redlock_testkit import CeleryEnv, Recorder, SignalLog, opened_on_exit, run_worker

pytestmark = pytest.mark.timeout(60)


class Boom(Exception):
    pass


def test_an_exception_in_the_body_releases_the_lock(
    env: CeleryEnv, make_app: Any, recorder: Recorder
) -> None:
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="import:{n}", lock_ttl=30)
    def import_file(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            raise Boom(n)

    lock, meta = env.lock_names("import:1")
    with run_worker(app):
        started = time.monotonic()
        for _ in range(2):
            with pytest.raises(Boom):
                import_file.delay(1).get(timeout=10)
        wait_for(lambda: not any(env.on_masters(lock)), timeout=5, message="lock released")
        # Two runs back to back, both long before lock_ttl: nothing waited for an expiry.
        assert time.monotonic() - started < 10
    assert len(recorder.spans) == 2
    assert env.on_masters(meta) == [False] * 3


@pytest.mark.parametrize("dedupe", ["queued", "active"])
def test_retry_runs_again_unblocked_by_its_own_lock_or_marker(
    env: CeleryEnv, make_app: Any, recorder: Recorder, signal_log: SignalLog, dedupe: str
) -> None:
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="fetch:{url}", dedupe=dedupe, max_retries=3)
    def fetch(self: Any, url: str) -> int:
        with recorder.span(self.request.id):
            attempt = self.request.retries
        if attempt < 2:
            # countdown=0: the retry message is back in the queue at once, so a second
            # worker thread takes it while this one is still unwinding.
            raise self.retry(countdown=0 if attempt == 0 else 0.2)
        return attempt

    lock = env.lock_names("fetch:a")[0]
    marker = f"redlock:{{fetch:a}}:{fetch.dedupe_suffix()}"
    at_retry_publish: list[tuple[bool, bool]] = []

    def on_publish(sender: Any = None, headers: Any = None, **_: Any) -> None:
        if headers and headers.get("retries"):
            at_retry_publish.append((env.on_quorum(lock), env.on_quorum(marker)))

    before_task_publish.connect(on_publish, weak=False, dispatch_uid="test_retry.on_publish")
    try:
        with run_worker(app):
            result = fetch.delay("a")
            assert result.get(timeout=20) == 2
    finally:
        before_task_publish.disconnect(dispatch_uid="test_retry.on_publish")

    assert [s.task_id for s in recorder.spans] == [result.id] * 3
    starts = [s.enter for s in recorder.spans]
    assert starts == sorted(starts)
    assert signal_log.of("lock_contended", task_id=result.id) == []
    assert signal_log.of("duplicate_dropped") == []
    # Released before the retry message went out; the job stays deduplicated while it
    # waits for its retry: an "active" marker stays, a "queued" one (gone when the run
    # started) is claimed again for it.
    assert at_retry_publish == [(False, True)] * 2


def test_a_retry_past_max_retries_keeps_the_lock_and_clears_the_active_marker(
    env: CeleryEnv, make_app: Any, recorder: Recorder
) -> None:
    """Celery publishes no retry past ``max_retries``: the run keeps its lock (a body
    that catches MaxRetriesExceededError still holds it) and, when it ends, clears its
    "active" marker, so an identical publish is a new job, not the failed one's id."""
    app = make_app()
    held_after_refusal: list[bool] = []

    @app.task(bind=True, base=SingletonTask, lock_key="sync:{n}", dedupe="active", max_retries=1)
    def sync(self: Any, n: int) -> str:
        with recorder.span(self.request.id):
            try:
                raise self.retry(countdown=0)
            except self.MaxRetriesExceededError:
                held_after_refusal.append(self.lease is not None and self.lease.held)
                raise

    lock, _ = env.lock_names("sync:1")
    marker = redis_key("redlock", "sync:1", sync.dedupe_suffix())
    with run_worker(app):
        result = sync.delay(1)
        # Not result.state: Celery stores RETRY after it publishes the retry, so the
        # retry's FAILURE can land first and be overwritten by RETRY (Celery's own race).
        wait_for(
            lambda: [s.task_id for s in recorder.spans] == [result.id] * 2,
            timeout=20,
            message="retries used up",
        )
        wait_for(lambda: not env.on_quorum(lock), timeout=5, message="lock released")
        wait_for(lambda: not env.on_quorum(marker), timeout=5, message="marker cleared")
        again = sync.delay(1)
        assert again.id != result.id
        with pytest.raises(sync.MaxRetriesExceededError):
            again.get(timeout=20)
    assert held_after_refusal == [True, True]  # the first run's, the second job's
    assert [s.task_id for s in recorder.spans] == [result.id] * 2 + [again.id] * 2


def test_a_time_limit_the_pool_does_not_enforce_does_not_stop_renewal(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog
) -> None:
    """The threads pool enforces no time limit, so a run goes on past ``time_limit`` and
    must keep renewing its lock (only a prefork pool process stops renewal at the limit,
    where Celery kills the run)."""
    app = make_app()
    held: list[bool] = []

    @app.task(bind=True, base=SingletonTask, lock_key="long:{n}", lock_ttl=1.0, time_limit=1)
    def long(self: Any, n: int) -> None:
        deadline = time.monotonic() + 3.0  # three lock_ttl, past the unenforced limit
        while time.monotonic() < deadline and self.lease.held:
            time.sleep(0.05)
        held.append(self.lease.held)

    with run_worker(app):
        long.delay(1).get(timeout=20)
    assert held == [True]
    assert signal_log.of("lock_lost") == []


def test_contention_reschedules_do_not_use_up_max_retries(
    env: CeleryEnv, make_app: Any, recorder: Recorder, signal_log: SignalLog
) -> None:
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="mail:{n}", max_retries=1)
    def mail(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            retries = self.request.retries
        if retries == 0:
            raise self.retry(countdown=0)
        return retries

    holder = Redlock(env.masters.urls).acquire("mail:1", ttl=30)
    try:
        with run_worker(app):
            result = mail.delay(1)
            wait_for(
                lambda: len(signal_log.of("lock_contended", task_id=result.id)) >= 3,
                timeout=15,
                message="three contention reschedules",
            )
            assert recorder.spans == []
            holder.release()
            assert result.get(timeout=15) == 1
    finally:
        holder.release()
    assert len(recorder.spans) == 2


def test_interrupt_stops_a_body_whose_lock_was_lost(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog
) -> None:
    app = make_app()
    saw: list[BaseException] = []
    running = threading.Event()

    @app.task(
        bind=True, base=SingletonTask, lock_key="sweep:{n}", lock_ttl=1.5, on_lock_lost="interrupt"
    )
    def sweep(self: Any, n: int) -> str:
        deadline = time.monotonic() + 10
        try:
            running.set()
            while time.monotonic() < deadline:  # pure Python work: interruptible
                sum(range(1000))
        except LockLostInterrupt as exc:
            saw.append(exc)
            raise
        return "finished"  # not interrupted: the test fails below

    lock, meta = env.lock_names("sweep:1")
    with run_worker(app):
        result = sweep.delay(1)
        assert running.wait(10)
        wait_for(lambda: all(env.on_masters(lock)), timeout=5, message="lock on all masters")
        env.delete_on_masters(lock, meta)  # an operator (or an expiry) took it away
        lost_at = time.monotonic()
        with pytest.raises(LockLost):
            result.get(timeout=10)
        stopped_after = time.monotonic() - lost_at

    assert len(saw) == 1
    # Noticed at the next renewal (every lock_ttl/3), well before the body's 10 s were up.
    assert stopped_after < 5
    fresh = AsyncResult(result.id, app=app)
    assert fresh.state == "FAILURE"
    # Stored with its context, as the backend rebuilt it from its args.
    assert isinstance(fresh.result, LockLostInterrupt)
    assert fresh.result.key == "sweep:1"
    assert len(fresh.result.masters) == 3
    assert "'sweep:1' was lost" in str(fresh.result)
    [lost] = signal_log.of("lock_lost", task_id=result.id)
    assert lost["key"] == "sweep:1"
    assert lost["policy"] == "interrupt"


def test_log_policy_signals_the_loss_and_lets_the_body_finish(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog
) -> None:
    app = make_app()
    running = threading.Event()
    held_after: list[bool] = []

    @app.task(bind=True, base=SingletonTask, lock_key="sweep:{n}", lock_ttl=1.5, on_lock_lost="log")
    def sweep(self: Any, n: int) -> str:
        running.set()
        deadline = time.monotonic() + 10
        while self.lease.held and time.monotonic() < deadline:
            time.sleep(0.02)
        held_after.append(self.lease.held)
        return "finished"

    lock, meta = env.lock_names("sweep:2")
    with run_worker(app), opened_on_exit(running):
        result = sweep.delay(2)
        assert running.wait(10)
        wait_for(lambda: all(env.on_masters(lock)), timeout=5, message="lock on all masters")
        env.delete_on_masters(lock, meta)
        assert result.get(timeout=15) == "finished"

    assert held_after == [False]
    [lost] = signal_log.of("lock_lost", task_id=result.id)
    assert lost["key"] == "sweep:2"
    assert lost["policy"] == "log"
    assert lost["reason"]
    assert lost["lease"].held is False


def test_a_retry_starts_a_new_wait_for_the_lock(
    env: CeleryEnv, make_app: Any, recorder: Recorder, signal_log: SignalLog
) -> None:
    """Contention reschedules before a ``retry()`` do not count after it: the retry's
    message carries none of the wait counters, so ``max_contention_retries`` (and the
    backoff) start over. Before, the first contention after the retry gave up."""
    app = make_app()
    others = Redlock(env.masters.urls)
    held: list[Any] = [others.acquire("flaky:1", ttl=30)]

    contentions: list[int] = []

    def free_after(sender: Any, attempt: int, **_: Any) -> None:
        # Freed from the signal itself, before the reschedule is published: the next try
        # always finds the key free (freeing it from the test's thread raced a 4th try).
        if sender.name != flaky.name:
            return
        contentions.append(attempt)
        if len(contentions) in (2, 3) and held:
            held.pop().release()  # the third try, and the retry's second try, find it free

    retried: list[str] = []

    def retry_published(sender: str, headers: dict[str, Any], **_: Any) -> None:
        if sender == flaky.name and headers.get("retries") == 1 and not retried:
            retried.append(headers["id"])
            held.append(others.acquire("flaky:1", ttl=30))  # held when the retry arrives

    @app.task(
        bind=True,
        base=SingletonTask,
        lock_key="flaky:{n}",
        max_contention_retries=2,
        contention_backoff=(0.05, 0.1),
    )
    def flaky(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            retries = self.request.retries
        if retries == 0:
            raise self.retry(countdown=0)
        return retries

    signals.lock_contended.connect(free_after)
    before_task_publish.connect(retry_published)
    try:
        with run_worker(app):
            result = flaky.delay(1)
            assert result.get(timeout=20) == 1
    finally:
        signals.lock_contended.disconnect(free_after)
        before_task_publish.disconnect(retry_published)
        while held:
            held.pop().release()
        others.close()
    contended = signal_log.of("lock_contended", task_id=result.id)
    assert [(s["attempt"], s["action"]) for s in contended] == [
        (0, "retry"),
        (1, "retry"),
        (0, "retry"),  # a new wait: was (2, "give_up")
    ]
    assert len(recorder.spans) == 2


def _soft_limit_lands_once(
    monkeypatch: pytest.MonkeyPatch,
    owner: type,
    name: str,
    where: Callable[[Any], bool] = lambda _: True,
) -> list[bool]:
    """Make ``owner.name`` raise ``SoftTimeLimitExceeded`` (as a soft time limit landing
    there does) the first time it is called with a first argument ``where`` accepts;
    returns the list that records it."""
    from celery.exceptions import SoftTimeLimitExceeded

    original = getattr(owner, name)
    landed: list[bool] = []

    def soft_limit_lands_here(self: Any, first: Any, *args: Any, **kwargs: Any) -> Any:
        if not landed and where(first):
            landed.append(True)
            raise SoftTimeLimitExceeded()
        return original(self, first, *args, **kwargs)

    monkeypatch.setattr(owner, name, soft_limit_lands_here)
    return landed


def test_an_exception_between_acquire_and_body_releases_the_lock(
    env: CeleryEnv, make_app: Any, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception after the lock is taken but before the body starts (a soft time limit
    can land anywhere) releases the lock. Before, the lease was left to the heartbeat,
    which renewed it for as long as the worker lived: the key stayed locked."""
    from celery.exceptions import SoftTimeLimitExceeded

    from celery_redlock.lock.lease import Lease

    app = make_app()
    landed = _soft_limit_lands_once(monkeypatch, Lease, "on_lost")

    @app.task(bind=True, base=SingletonTask, lock_key="early:{n}", lock_ttl=1.5)
    def early(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            return n

    lock, _ = env.lock_names("early:1")
    with run_worker(app):
        first = early.delay(1)
        with pytest.raises(SoftTimeLimitExceeded):
            first.get(timeout=10)
        # Three lock_ttl: a lease left to the heartbeat is renewed past this.
        wait_for(lambda: not any(env.on_masters(lock)), timeout=4.5, message="lock released")
        assert early.delay(1).get(timeout=10) == 1
    assert landed == [True]
    assert len(recorder.spans) == 1


def test_a_release_cut_short_at_the_end_of_a_run_is_sent_again(
    env: CeleryEnv, make_app: Any, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review r14: a soft time limit landing in the run's final release, before its
    command was written, left the lock on the masters for its whole TTL, held by nobody
    (the lease read released, so nothing sent it again)."""
    from celery.exceptions import SoftTimeLimitExceeded

    from celery_redlock.lock.redlock import Redlock as Core

    app = make_app()
    landed = _soft_limit_lands_once(
        monkeypatch, Core, "_release", lambda lease: lease.key.endswith("late:1")
    )

    @app.task(bind=True, base=SingletonTask, lock_key="late:{n}", lock_ttl=60)
    def late(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            return n

    lock, _ = env.lock_names("late:1")
    with run_worker(app):
        first = late.delay(1)
        with pytest.raises(SoftTimeLimitExceeded):
            first.get(timeout=10)
        # lock_ttl is 60 s: a release left unsent keeps the key far past this.
        wait_for(lambda: not any(env.on_masters(lock)), timeout=5, message="lock released")
        assert late.delay(1).get(timeout=10) == 1
    assert landed == [True]
    assert len(recorder.spans) == 2


def test_a_fence_the_masters_cannot_commit_reschedules_the_job(
    env: CeleryEnv,
    make_app: Any,
    recorder: Recorder,
    signal_log: SignalLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The body's first ``lease.fence`` needs a quorum round; when too few masters answer
    it (they died after the acquire), the body cannot write safely, and the job waits for
    the lock service as it does when the outage comes before its run. Before, the job
    failed with QuorumUnavailable (chaos scenario 14: an item never finished)."""
    from celery_redlock.exceptions import QuorumUnavailable
    from celery_redlock.lock.redlock import Redlock as CoreRedlock

    app = make_app()
    original = CoreRedlock._commit_fence
    failed: list[bool] = []

    def masters_gone(self: Any, lease: Any) -> int:
        if not failed:
            failed.append(True)
            raise QuorumUnavailable(
                f"fence for {lease.key!r} committed on 1 of 3 masters, 2 needed",
                lease.key,
                self.master_names,
                {},
            )
        return original(self, lease)

    monkeypatch.setattr(CoreRedlock, "_commit_fence", masters_gone)

    @app.task(bind=True, base=SingletonTask, lock_key="fenced:{n}")
    def fenced(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            return self.lease.fence

    with run_worker(app):
        result = fenced.delay(1)
        assert result.get(timeout=20) >= 1
    assert failed == [True]
    assert len(recorder.spans) == 2
    assert [s["task_id"] for s in signal_log.of("lock_unavailable")] == [result.id]

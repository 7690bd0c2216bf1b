"""Enqueue dedupe as a publisher sees it: which publishes return the queued job's result.

Identity is the lock key; ``"queued"`` coalesces while the job waits, ``"active"`` also
while it runs, ``None`` never. Canvas members are never deduplicated, and a lock service
that is down never stops a publish.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from decimal import Decimal
from typing import Any

import pytest
from celery import chain, chord, group
from celery.canvas import Signature

from celery_redlock import Redlock, SingletonTask
from celery_redlock.keys import redis_key
from celery_redlock.testing import wait_for

from .redlock_testkit import (
    BROKERS,
    CeleryEnv,
    Recorder,
    SignalLog,
    opened_on_exit,
    queue_length,
    run_worker,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("env", BROKERS, indirect=True)
def test_queued_returns_the_waiting_job_until_it_starts(
    env: CeleryEnv, make_app: Any, recorder: Recorder
) -> None:
    app = make_app()
    gate = threading.Event()

    @app.task(bind=True, base=SingletonTask, lock_key="sync:{account}", dedupe="queued")
    def sync(self: Any, account: int) -> int:
        with recorder.span(self.request.id):
            gate.wait(10)
        return account

    first = sync.delay(1)
    assert sync.delay(1).id == first.id
    assert sync.apply_async((1,)).id == first.id
    other = sync.delay(2)
    assert other.id != first.id  # another key is another job
    assert queue_length(app, env.queue) == 2

    with run_worker(app), opened_on_exit(gate):
        wait_for(lambda: first.id in recorder.entered, timeout=10, message="first job started")
        second = sync.delay(1)  # the first one runs: this is a new job
        assert second.id != first.id
        gate.set()
        assert first.get(timeout=10) == 1
        assert second.get(timeout=10) == 1

    assert [s.task_id for s in recorder.spans if s.task_id != other.id] == [first.id, second.id]


def test_active_returns_the_running_job_until_it_ends(make_app: Any, recorder: Recorder) -> None:
    app = make_app()
    gate = threading.Event()

    @app.task(bind=True, base=SingletonTask, lock_key="sync:{account}", dedupe="active")
    def sync(self: Any, account: int) -> int:
        with recorder.span(self.request.id):
            gate.wait(10)
        return account

    with run_worker(app), opened_on_exit(gate):
        first = sync.delay(1)
        recorder.wait_entered(1)
        assert sync.delay(1).id == first.id  # still running: the same job
        gate.set()
        assert first.get(timeout=10) == 1
        second = sync.delay(1)  # it ended: a new job
        assert second.id != first.id
        assert second.get(timeout=10) == 1

    assert [s.task_id for s in recorder.spans] == [first.id, second.id]


def test_none_publishes_every_time(env: CeleryEnv, make_app: Any) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="sync:{account}", dedupe=None)
    def sync(account: int) -> int:
        return account

    ids = {sync.delay(1).id for _ in range(3)}
    assert len(ids) == 3
    assert queue_length(app, env.queue) == 3


def test_explicit_task_id_of_the_queued_job_is_that_job(env: CeleryEnv, make_app: Any) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="sync:{account}")
    def sync(account: int) -> int:
        return account

    queued = sync.apply_async((1,), task_id="job-1")
    assert queued.id == "job-1"
    assert sync.apply_async((1,), task_id="job-1").id == "job-1"
    assert sync.apply_async((1,), task_id="job-2").id == "job-1"
    assert queue_length(app, env.queue) == 1

    with run_worker(app):
        assert queued.get(timeout=10) == 1


def test_eta_and_countdown_do_not_make_a_job_different(env: CeleryEnv, make_app: Any) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="sync:{account}")
    def sync(account: int) -> int:
        return account

    later = sync.apply_async((1,), countdown=600)
    assert sync.delay(1).id == later.id
    eta = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=900)
    assert sync.apply_async((1,), eta=eta).id == later.id
    assert sync.apply_async((1,), countdown=5).id == later.id
    assert queue_length(app, env.queue) == 1
    # The marker outlives the delay of the job it stands for (dedupe_ttl + countdown).
    marker = f"redlock:{{sync:1}}:{sync.dedupe_suffix()}"
    wait_for(lambda: all(env.on_masters(marker)), timeout=5, message="marker on every master")
    for server in env.masters:
        with server.client() as conn:
            assert conn.get(marker) == later.id.encode()
            assert conn.pttl(marker) > (3600 + 600 - 30) * 1000


@pytest.mark.parametrize("canvas", ["chain", "group", "chord", "link"])
def test_canvas_members_are_never_deduplicated(env: CeleryEnv, make_app: Any, canvas: str) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="sync:{account}")
    def sync(account: int) -> int:
        return account

    @app.task(base=SingletonTask, lock_key="total:{values}")
    def total(values: list[int]) -> int:
        return sum(values)

    @app.task
    def start() -> str:
        return "started"

    # Identical jobs wait in the queue (held by the worker until their countdown) the whole
    # time: a canvas member deduplicated against them would never report its result.
    standalone = [sync.apply_async((1,), countdown=60), total.apply_async(([1, 1],), countdown=60)]

    with run_worker(app):
        expected: Any
        if canvas == "chain":
            result = chain(start.si(), sync.si(1)).apply_async()
            expected = 1
        elif canvas == "group":
            result = group(sync.s(1), sync.s(1)).apply_async()
            expected = [1, 1]
        elif canvas == "chord":
            result = chord([sync.s(1), sync.s(1)], total.s()).apply_async()
            expected = 2
        else:
            result = start.apply_async(link=sync.si(1))
            expected = "started"
        assert result.get(timeout=20) == expected
        if canvas == "link":
            [child] = wait_for(lambda: result.children, timeout=10, message="callback sent")
            assert child.id != standalone[0].id
            assert child.get(timeout=20) == 1
        for job in standalone:
            assert job.state == "PENDING"  # still waiting for its countdown: not run early


def test_masters_down_at_publish_publishes_anyway_with_a_warning(
    env: CeleryEnv, make_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="sync:{account}")
    def sync(account: int) -> int:
        return account

    env.masters[0].kill()
    env.masters[1].kill()
    caplog.set_level(logging.WARNING, logger="celery_redlock")
    started = time.monotonic()
    first, second = sync.delay(1), sync.delay(1)
    assert time.monotonic() - started < 3  # the caller (often a web request) is not held up

    assert first.id != second.id  # no dedupe possible, but nothing was dropped either
    assert queue_length(app, env.queue) == 2
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "dedupe" in r.getMessage()
    ]
    assert len(warnings) == 2
    assert first.id in warnings[0].getMessage()
    assert "sync:1" in warnings[0].getMessage()


def test_non_json_arguments_key_stably(env: CeleryEnv, make_app: Any, recorder: Recorder) -> None:
    app = make_app()
    gate = threading.Event()
    seen: list[str] = []

    @app.task(bind=True, base=SingletonTask)
    def refund(self: Any, order: uuid.UUID, at: dt.datetime, amount: Decimal) -> str:
        assert isinstance(order, uuid.UUID)  # kombu's json carries these types through
        seen.append(self.request.redlock_key)
        with recorder.span(self.request.id):
            gate.wait(10)
        return str(amount)

    order = uuid.UUID("12345678-1234-5678-1234-567812345678")
    at = dt.datetime(2024, 5, 1, 3, 0, tzinfo=dt.timezone.utc)
    first = refund.delay(order, at, Decimal("9.90"))
    # Equal values built anew (another UUID object, another zone, another exponent): the same job.
    same = refund.delay(
        uuid.UUID(str(order)),
        at.astimezone(dt.timezone(dt.timedelta(hours=2))),
        Decimal("9.9"),
    )
    assert same.id == first.id
    assert refund.delay(order, at, Decimal("9.91")).id != first.id
    key = refund.redlock_options().lock_key((order, at, Decimal("9.90")), {})
    marker = f"redlock:{{{key}}}:{refund.dedupe_suffix()}"
    assert env.on_quorum(marker)

    with run_worker(app), opened_on_exit(gate):
        wait_for(lambda: first.id in recorder.entered, timeout=10, message="first job started")
        # The worker rebuilt the same key from the deserialized arguments: its lock is on
        # the publisher's key, and taking it cleared the publisher's marker.
        assert seen[recorder.entered.index(first.id)] == key
        assert env.on_quorum(f"redlock:{{{key}}}")
        assert not env.on_quorum(marker)
        assert refund.delay(order, at, Decimal("9.90")).id != first.id
        gate.set()
        assert first.get(timeout=10) == "9.90"


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_a_job_that_met_the_lock_leaves_no_marker_behind(
    make_app: Any, recorder: Recorder, policy: str
) -> None:
    app = make_app()
    gate = threading.Event()

    @app.task(bind=True, base=SingletonTask, lock_key="sync:{account}", on_contention=policy)
    def sync(self: Any, account: int) -> int:
        with recorder.span(self.request.id):
            gate.wait(10)
        return account

    with run_worker(app), opened_on_exit(gate):
        running = sync.delay(1)
        recorder.wait_entered(1)
        turned_away = sync.delay(1)  # a new job: the first one started
        assert turned_away.id != running.id
        final = "FAILURE"  # skipped (skip_result="failure") or raised: both LockContended
        wait_for(lambda: turned_away.state == final, timeout=10, message=f"{final} stored")
        gate.set()
        assert running.get(timeout=10) == 1
        # Nothing runs any more: the next publish is a new job that runs, not the old one.
        later = sync.delay(1)
        assert later.id != turned_away.id
        assert later.get(timeout=10) == 1


def test_queued_job_waiting_for_its_retry_takes_identical_publishes(
    env: CeleryEnv, make_app: Any, recorder: Recorder
) -> None:
    """A "queued" job's marker goes when it starts; when it retries with a countdown it
    waits in the queue again, so identical publishes return it again (and it is not
    blocked by the marker it claims for itself)."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="poll:{n}", dedupe="queued", max_retries=1)
    def poll(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            retries = self.request.retries
        if retries == 0:
            raise self.retry(countdown=2)
        return retries

    marker = f"redlock:{{poll:1}}:{poll.dedupe_suffix()}"
    with run_worker(app):
        first = poll.delay(1)
        wait_for(lambda: first.state == "RETRY", timeout=10, message="first run retried")
        assert env.on_quorum(marker)
        assert poll.delay(1).id == first.id  # the job waiting for its retry
        assert first.get(timeout=20) == 1
        wait_for(lambda: not env.on_quorum(marker), timeout=5, message="marker cleared")
        later = poll.delay(1)
        assert later.id != first.id
        assert later.get(timeout=20) == 1  # its own retry is not deduplicated away
    spans = [s.task_id for s in recorder.spans]
    assert spans == [first.id, first.id, later.id, later.id]


def test_a_contended_acquire_on_a_minority_keeps_the_queued_marker(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog
) -> None:
    """The ACQUIRE script clears a "queued" marker on each master that grants the lock. When
    only a minority grants it (the holder's lock is missing on one master), the acquire
    fails and the job is rescheduled, still queued: it claims its marker again. Before,
    the marker stayed gone on that master, so with one more master down an identical
    publish found no quorum for it and became a second job."""
    app = make_app()

    @app.task(
        bind=True,
        base=SingletonTask,
        lock_key="waiter:{n}",
        dedupe="queued",
        contention_backoff=(1, 1),
    )
    def waiter(self: Any, n: int) -> int:
        return n

    others = Redlock(env.masters.urls)
    holder = others.acquire("waiter:1", ttl=60)
    lock, meta = env.lock_names("waiter:1")
    with env.masters[0].client() as conn:
        conn.delete(lock, meta)  # held on the other two masters only
    marker = redis_key("redlock", "waiter:1", waiter.dedupe_suffix())
    try:
        with run_worker(app):
            job = waiter.delay(1)
            wait_for(
                lambda: signal_log.of("lock_contended", task_id=job.id),
                timeout=15,
                message="the job met the lock",
            )
            wait_for(
                lambda: all(env.on_masters(marker)),
                timeout=10,
                message="the marker back on every master",
            )
            assert waiter.delay(1).id == job.id
            holder.release()
            assert job.get(timeout=30) == 1
    finally:
        holder.release()
        others.close()


def test_a_marker_that_cannot_be_removed_is_logged(
    env: CeleryEnv, make_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Dropping a job's marker (revoke, skip, give-up, a killed run) with too few masters
    answering logs a WARNING naming the key: the marker may still stand, and identical
    publishes return the job until its TTL. Before, the removal's "no quorum" was taken
    for "not this job's marker", and nothing was said."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="gone:{n}", dedupe="queued")
    def gone(self: Any, n: int) -> int:
        return n

    redlock = Redlock(env.masters.urls)
    try:
        assert redlock.claim("gone:1", gone.dedupe_suffix(), "job-1", 60)[0] == "job-1"
    finally:
        redlock.close()
    env.masters[0].kill()
    env.masters[1].kill()
    with caplog.at_level(logging.WARNING, logger="celery_redlock"):
        gone._drop_dedupe_marker("gone:1", None, "job-1", "revoke")
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("gone:1" in r.getMessage() and "revoke" in r.getMessage() for r in warned), [
        r.getMessage() for r in caplog.records
    ]


def test_a_contended_canvas_member_claims_no_marker(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog
) -> None:
    """A chain member rescheduled for contention waits without a dedupe marker, as canvas
    members always publish without one: an identical plain publish is its own job, not
    the member (whose result the chain waits for)."""
    app = make_app()

    @app.task(
        bind=True,
        base=SingletonTask,
        lock_key="member:{n}",
        dedupe="queued",
        contention_backoff=(1, 1),
    )
    def member(self: Any, n: int) -> int:
        return n

    others = Redlock(env.masters.urls)
    holder = others.acquire("member:1", ttl=60)
    marker = redis_key("redlock", "member:1", member.dedupe_suffix())
    try:
        with run_worker(app):
            canvas = chain(member.si(1), member.si(2)).apply_async()
            wait_for(
                lambda: signal_log.of("lock_contended", action="retry"),
                timeout=15,
                message="the chain's first member met the lock",
            )
            wait_for(
                lambda: len(signal_log.of("lock_contended", action="retry")) >= 2,
                timeout=15,
                message="a second reschedule (after the first one's claim, if any)",
            )
            assert not any(env.on_masters(marker))
            holder.release()
            assert canvas.get(timeout=30) == 2
    finally:
        holder.release()
        others.close()


def test_a_reschedule_that_cannot_be_published_drops_the_marker(
    env: CeleryEnv, make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A contention reschedule whose publish fails ends the job (the broker error is its
    result): its "queued" marker goes with it. Before, it stayed on a quorum and every
    identical publish returned the dead job until the TTL (hostile review r6)."""
    from kombu.exceptions import OperationalError

    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="resched:{n}", dedupe="queued")
    def resched(self: Any, n: int) -> int:
        return n

    def broker_down(*_: Any, **__: Any) -> None:
        raise OperationalError("broker unreachable")

    others = Redlock(env.masters.urls)
    holder = others.acquire("resched:1", ttl=60)
    marker = redis_key("redlock", "resched:1", resched.dedupe_suffix())
    try:
        with run_worker(app):
            # The reschedule is published as a signature (Signature.apply_async).
            monkeypatch.setattr(Signature, "apply_async", broker_down)
            job = resched.delay(1)
            with pytest.raises(OperationalError):
                job.get(timeout=15)
            monkeypatch.undo()
            assert not env.on_quorum(marker)
            holder.release()
            again = resched.delay(1)
            assert again.id != job.id
            assert again.get(timeout=15) == 1
    finally:
        holder.release()
        others.close()


def test_a_beat_occurrence_is_never_coalesced_at_publish(env: CeleryEnv, make_app: Any) -> None:
    """Beat messages skip publish-time dedupe: their claims send and run an occurrence
    once. A marker naming a job that was never published (a beat killed between its
    marker and its publish) swallowed every later occurrence until its TTL (hostile
    review r6), and a late send standing for several occurrences could be folded into
    a queued job standing for one."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="tick:{n}", dedupe="queued")
    def tick(self: Any, n: int) -> int:
        return n

    redlock = Redlock(env.masters.urls)
    try:
        assert redlock.claim("tick:1", tick.dedupe_suffix(), "phantom", 3600)[0] == "phantom"
    finally:
        redlock.close()
    with run_worker(app):
        sent = tick.apply_async((1,), headers={"redlock_occurrence": "tick@2026-11-26T00:00Z"})
        assert sent.id != "phantom"
        assert sent.get(timeout=15) == 1
        assert tick.delay(1).id == "phantom"  # a caller's publish still coalesces


@pytest.mark.parametrize("dedupe", ["queued", "active"])
def test_a_retry_whose_publish_fails_leaves_no_marker_behind(
    env: CeleryEnv, make_app: Any, recorder: Recorder, dedupe: str
) -> None:
    """Review r9: ``retry()`` claims (``"queued"``) or keeps (``"active"``) the job's marker
    before Celery publishes the retry; when that publish failed (a broker restarting), the
    job ended there (Celery rejects it) and its marker stayed, so every identical publish
    returned a job that never ran, for ``redlock_dedupe_ttl`` (an hour)."""
    app = make_app()
    real_send = app.amqp.send_task_message

    def send(producer: Any, name: str, message: Any, **kwargs: Any) -> Any:
        if message.headers.get("retries"):
            raise ConnectionError("the broker went away")
        return real_send(producer, name, message, **kwargs)

    app.amqp.send_task_message = send

    @app.task(bind=True, base=SingletonTask, lock_key="pay:{n}", dedupe=dedupe, shared=False)
    def pay(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            retries = self.request.retries
        if retries == 0 and len(recorder.spans) == 1:
            raise self.retry(countdown=1)
        return retries

    marker = f"redlock:{{pay:1}}:{pay.dedupe_suffix()}"
    with run_worker(app):
        first = pay.delay(1)
        wait_for(lambda: len(recorder.spans) == 1, timeout=10, message="first run")
        wait_for(lambda: not env.on_quorum("redlock:{pay:1}"), timeout=10, message="released")
        wait_for(lambda: not env.on_quorum(marker), timeout=5, message="marker dropped")
        later = pay.delay(1)
        assert later.id != first.id  # a new job, not the dead one
        assert later.get(timeout=20) == 0


def test_a_job_that_may_expire_or_keeps_no_result_stands_for_no_duplicate(
    env: CeleryEnv, make_app: Any, recorder: Recorder
) -> None:
    """Review r9: a caller's ``delay(42)`` was folded into a queued fire-and-forget
    ``apply_async((42,), ignore_result=True)`` (its ``.get()`` never returned: the run
    stored nothing) and ``delay(43)`` into a queued ``apply_async((43,), expires=2)`` that
    expired unrun (the caller's job never ran). Such publishes take no marker and join
    none."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="sync:{n}", shared=False)
    def sync(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            pass
        return n

    fire_and_forget = sync.apply_async((42,), ignore_result=True)
    caller = sync.delay(42)
    assert caller.id != fire_and_forget.id
    assert sync.apply_async((42,), ignore_result=True).id != caller.id  # joins none either
    # Expired already when a worker takes it: the worker revokes it unrun.
    expiring = sync.apply_async((43,), expires=dt.datetime.now(dt.timezone.utc) - dt.timedelta(1))
    other = sync.delay(43)
    assert other.id != expiring.id
    assert sync.delay(43).id == other.id  # alike publishes still coalesce
    with run_worker(app):
        assert caller.get(timeout=20) == 42
        assert other.get(timeout=20) == 43
    assert caller.id in {s.task_id for s in recorder.spans}
    assert expiring.id not in {s.task_id for s in recorder.spans}


def test_no_marker_names_a_job_that_may_expire_or_keeps_no_result_when_it_waits(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog
) -> None:
    """Review r11: the rule above held at publish only. A task-level ``expires`` (which
    Celery adds after SingletonTask's publish) still took a marker, and a fire-and-forget
    job rescheduled on contention, or retried, claimed one: a caller's ``delay()`` was then
    folded into a job that expired unrun, or whose ``.get()`` never returned."""
    app = make_app()

    @app.task(base=SingletonTask, lock_key="exp:{n}", expires=3600, shared=False)
    def expiring(n: int) -> int:
        return n

    @app.task(bind=True, base=SingletonTask, lock_key="wait:{n}", shared=False)
    def waiting(self: Any, n: int) -> int:
        if n == 2 and not self.request.retries:
            raise self.retry(countdown=1)
        return n

    first = expiring.delay(1)
    assert expiring.delay(1).id != first.id  # the task's own expires: no marker taken
    others = Redlock(env.masters.urls)
    holder = others.acquire("wait:1", ttl=60)
    try:
        with run_worker(app):
            quiet = waiting.apply_async((1,), ignore_result=True)
            wait_for(
                lambda: signal_log.of("lock_contended", action="retry"),
                timeout=10,
                message="the fire-and-forget job met the lock and was rescheduled",
            )
            caller = waiting.delay(1)
            assert caller.id != quiet.id  # not folded into the job that keeps no result
            holder.release()
            assert caller.get(timeout=20) == 1
            retried = waiting.apply_async((2,), ignore_result=True)
            marker = redis_key("redlock", "wait:2", waiting.dedupe_suffix())
            wait_for(
                lambda: signal_log.of("lock_released", task_id=retried.id),
                timeout=10,
                message="its first run retried",
            )
            assert not env.on_quorum(marker)  # the retry claimed no marker
            assert waiting.delay(2).get(timeout=20) == 2
    finally:
        holder.release()
        others.close()

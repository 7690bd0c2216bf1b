"""A soft time limit landing in SingletonTask's own steps, before or around the body.

Celery's soft limit is billiard's ``SIGUSR1`` handler raising ``SoftTimeLimitExceeded``
(an ``Exception``) wherever the job is; ``revoke(terminate=True, signal="SIGUSR1")`` sends
the same. A review found it taken, at five places, for the failure of the step it landed
in: a job reported skipped, a caller waiting for ever, a marker left naming a job that
ended (identical publishes returned it), a job rescheduled without its marker or with its
marker dropped though its reschedule was queued (an identical publish became a second job,
and the body ran twice). Each test makes it land at one such point: by raising it from a
wrapped step in an in-process worker, or, where the outcome hangs on where the signal lands
after a message went out, with a real ``SIGUSR1`` and billiard's handler in the main thread.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from billiard.pool import soft_timeout_sighandler
from celery.app.trace import build_tracer
from celery.backends.base import Backend
from celery.exceptions import SoftTimeLimitExceeded

from celery_redlock import Redlock, SingletonTask
from celery_redlock.lock import master as master_module
from celery_redlock.task import CONTENTION_HEADER
from celery_redlock.testing import wait_for

from .redlock_testkit import CeleryEnv, SignalLog, run_worker

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def outside(env: CeleryEnv) -> Iterator[Redlock]:
    """A client of the masters apart from the app's: it holds keys the jobs meet."""
    client = Redlock(env.masters.urls)
    yield client
    client.close()


def _fails_at_its_soft_limit(app: Any, task: Any, outside: Redlock, key: str) -> Any:
    """Publish ``task(1)`` while ``outside`` holds ``key``, to an in-process worker: its
    result raises SoftTimeLimitExceeded (the step it lands in is the test's). Returns it."""
    holder = outside.acquire(key, ttl=30, meta={"task_id": "another-run"})
    try:
        with run_worker(app):
            result = task.delay(1)
            with pytest.raises(SoftTimeLimitExceeded):
                result.get(timeout=20)
    finally:
        holder.release()
    return result


def test_landing_as_a_skip_stores_its_result_the_job_fails_with_it(
    env: CeleryEnv,
    make_app: Any,
    outside: Redlock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In the result backend's write of the skip: it was logged as "could not store" and
    swallowed, the run raised ``Ignore``, nothing was stored, and ``.get()`` waited for
    ever (PENDING)."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="s1:{n}", on_contention="skip")
    def job(self: Any, n: int) -> int:
        return n

    store = Backend.store_result
    landed: list[str] = []

    def store_in_time(self: Any, task_id: str, result: Any, state: str, *a: Any, **kw: Any) -> Any:
        if state == "FAILURE" and not landed and not isinstance(result, SoftTimeLimitExceeded):
            landed.append(task_id)
            raise SoftTimeLimitExceeded()
        return store(self, task_id, result, state, *a, **kw)

    monkeypatch.setattr(Backend, "store_result", store_in_time)
    result = _fails_at_its_soft_limit(app, job, outside, "s1:1")
    assert landed == [result.id]


@pytest.mark.parametrize("policy", ["skip", "raise"])
def test_landing_in_the_removal_of_its_marker_still_removes_it(
    env: CeleryEnv,
    make_app: Any,
    outside: Redlock,
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
) -> None:
    """In the removal of the "queued" marker of a job that ends on contention: the
    removal was given up and logged, so the marker named the ended job, and every
    identical publish returned it until ``redlock_dedupe_ttl``."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="s2:{n}", on_contention=policy)
    def job(self: Any, n: int) -> int:
        return n

    unclaim = Redlock.unclaim
    landed: list[str] = []

    def unclaim_in_time(self: Redlock, key: str, suffix: str, value: str) -> bool:
        if self is not outside and not landed:
            landed.append(value)
            raise SoftTimeLimitExceeded()
        return unclaim(self, key, suffix, value)

    monkeypatch.setattr(Redlock, "unclaim", unclaim_in_time)
    holder = outside.acquire("s2:1", ttl=30, meta={"task_id": "another-run"})
    try:
        with run_worker(app):
            first = job.delay(1)
            with pytest.raises(SoftTimeLimitExceeded):
                first.get(timeout=20)
            holder.release()
            again = job.delay(1)
            assert again.id != first.id  # a new job: the ended one is not queued
            assert again.get(timeout=20) == 1
    finally:
        holder.release()
    assert landed == [first.id]


def test_landing_as_a_waiting_job_claims_its_marker_again_fails_it(
    env: CeleryEnv,
    make_app: Any,
    outside: Redlock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job redelivered while its own dead run's lock stands waits for it, and claims its
    "queued" marker again first (that run's start had cleared it). Landing in that claim, it
    was swallowed: the job was rescheduled without a marker (past its soft limit), an
    identical publish became a second job, and both ran once the dead lock expired."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="s3:{n}", acks_late=True)
    def job(self: Any, n: int) -> int:
        return n

    claim = Redlock.claim
    landed: list[str] = []

    def claim_in_time(self: Redlock, key: str, suffix: str, value: str, *a: Any, **kw: Any) -> Any:
        if self is not outside and not landed and value == job_id:
            landed.append(value)
            claim(self, key, suffix, value, *a, **kw)  # its copies written ...
            raise SoftTimeLimitExceeded()  # ... and the signal lands on its way out
        return claim(self, key, suffix, value, *a, **kw)

    job_id = f"job-{uuid.uuid4().hex}"
    dead = outside.acquire("s3:1", ttl=3, meta={"task_id": job_id})  # its dead earlier run
    first = job.apply_async((1,), task_id=job_id)
    job.clear_dedupe(1)  # as that run's start left it
    monkeypatch.setattr(Redlock, "claim", claim_in_time)
    try:
        with run_worker(app):
            with pytest.raises(SoftTimeLimitExceeded):
                first.get(timeout=20)
            again = job.delay(1)
            assert again.id != first.id  # the failed job is not the queued one
            assert again.get(timeout=20) == 1
    finally:
        dead.release()
    assert landed == [job_id]


def test_landing_as_the_holder_read_connects_fails_the_job_not_skips_it(
    env: CeleryEnv,
    make_app: Any,
    outside: Redlock,
    signal_log: SignalLog,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a connect's handshake, in the read of who holds a contended key (its connections
    were closed): the round took it for a master that failed to connect, read "another
    holder" from the two others, and the job was reported skipped."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="s5:{n}", on_contention="skip")
    def job(self: Any, n: int) -> int:
        return n

    read, open_link = Redlock.holder_state, master_module.Link.open
    reading: list[bool] = []
    landed: list[str] = []

    def read_on_new_connections(self: Redlock, key: str, field: str, value: str) -> Any:
        if self is not outside:
            for lane in self._lanes:  # closed as idle, or by the server
                for link in lane.links:
                    link.close()
            reading.append(True)
        try:
            return read(self, key, field, value)
        finally:
            reading.clear()

    def open_in_time(self: Any, *args: Any) -> Any:
        if reading and not landed:
            landed.append(self.master.name)
            raise SoftTimeLimitExceeded()
        return open_link(self, *args)

    monkeypatch.setattr(Redlock, "holder_state", read_on_new_connections)
    monkeypatch.setattr(master_module.Link, "open", open_in_time)
    _fails_at_its_soft_limit(app, job, outside, "s5:1")
    assert len(landed) == 1
    assert signal_log.of("lock_contended") == []


def _run_as_a_prefork_child(task: Any, task_id: str, env: CeleryEnv) -> None:
    """Run one delivery of ``task`` here, in the main thread, with billiard's soft-limit
    handler on ``SIGUSR1``, as a prefork pool's process runs it."""
    tracer = build_tracer(task.name, task, app=task.app, eager=False)
    request = {
        "id": task_id,
        "task": task.name,
        "hostname": "celery@soft-limits",
        "delivery_info": {"routing_key": env.queue},
        "headers": {},
    }
    previous = signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
    try:
        tracer(task_id, (1,), {}, request)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_real_soft_limit_right_after_a_reschedule_went_out_keeps_its_marker(
    env: CeleryEnv, make_app: Any, outside: Redlock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Billiard's handler and a real ``SIGUSR1`` in the main thread, as in a prefork pool's
    process: the signal comes right after the contention reschedule's message reached the
    broker. It was taken for a failed publish: the job's marker was dropped and it failed
    (FAILURE stored), while its reschedule waited in the queue; an identical publish became
    a second job. The signal is now held back while the message goes out: the reschedule
    stands (RETRY, the marker names it) and the soft limit, with nothing left to stop in
    this delivery, is logged."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="s4:{n}")
    def job(self: Any, n: int) -> int:
        return n

    send = app.amqp.send_task_message
    signalled: list[str] = []

    def send_then_signal(producer: Any, name: str, message: Any, *a: Any, **kw: Any) -> Any:
        sent = send(producer, name, message, *a, **kw)
        if CONTENTION_HEADER in (message.headers or {}) and not signalled:
            signalled.append(message.headers["id"])
            os.kill(os.getpid(), signal.SIGUSR1)  # lands at once, in the main thread
        return sent

    holder = outside.acquire("s4:1", ttl=30, meta={"task_id": "another-run"})
    try:
        first = job.delay(1)
        monkeypatch.setattr(app.amqp, "send_task_message", send_then_signal)
        _run_as_a_prefork_child(job, first.id, env)
        assert signalled == [first.id]
        wait_for(lambda: first.state != "PENDING", timeout=10, message="the run's state")
        assert first.state == "RETRY"
        assert job.delay(1).id == first.id  # its reschedule is the queued job of its key
    finally:
        holder.release()


def test_a_real_soft_limit_during_retry_without_throw_reaches_the_body(
    env: CeleryEnv, make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Second review: ``retry(throw=False)`` returns, and the body goes on. The soft limit
    that came while the retry was published was held, then only logged ("nothing left to
    stop"): the body ran past its soft limit. It now gets it where ``retry()`` returns;
    the retry that went out stands."""
    app = make_app()
    after: list[str] = []

    @app.task(bind=True, base=SingletonTask, lock_key="s6:{n}")
    def job(self: Any, n: int) -> int:
        self.retry(countdown=30, throw=False)
        after.append("went on past its soft limit")
        return n

    send = app.amqp.send_task_message

    def send_then_signal(producer: Any, name: str, message: Any, *a: Any, **kw: Any) -> Any:
        sent = send(producer, name, message, *a, **kw)
        os.kill(os.getpid(), signal.SIGUSR1)
        return sent

    first = job.delay(1)
    monkeypatch.setattr(app.amqp, "send_task_message", send_then_signal)
    _run_as_a_prefork_child(job, first.id, env)
    assert after == []
    wait_for(lambda: first.state != "PENDING", timeout=10, message="the run's state")
    assert first.state == "FAILURE"
    assert isinstance(first.result, SoftTimeLimitExceeded)
    assert job.delay(1).id == first.id  # its retry is the queued job of its key


def test_a_real_soft_limit_in_retrys_marker_claim_keeps_the_retry_and_its_marker(
    env: CeleryEnv, make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Second review: the soft limit came while ``retry()`` claimed the job's "queued"
    marker again (the masters slow to answer): the claim undid what it wrote, and the
    failure was logged and swallowed, so the retry went out without a marker and an
    identical publish became a second job. Held through the release, the claim and the
    publish, the retry goes out with its marker, and its ``Retry`` ends the delivery."""
    from celery_redlock import signals, softlimit

    monkeypatch.setattr(softlimit, "HOLD_FOR", 10.0)  # where it lands, not the bound
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="s7:{n}")
    def job(self: Any, n: int) -> int:
        self.retry(countdown=30)
        return n

    def slow_masters_then_signal(**kwargs: Any) -> None:
        # Right after the release: the masters pause, so the claim that comes next waits
        # for them, and the signal comes during that wait.
        for server in env.masters:
            with server.client() as conn:
                conn.execute_command("CLIENT", "PAUSE", 150)  # < node_timeout
        timer = threading.Timer(0.03, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        timers.append(timer)

    timers: list[threading.Timer] = []
    first = job.delay(1)
    signals.lock_released.connect(slow_masters_then_signal, weak=False)
    try:
        _run_as_a_prefork_child(job, first.id, env)
    finally:
        signals.lock_released.disconnect(slow_masters_then_signal)
        for timer in timers:
            timer.join(5)
    assert len(timers) == 1
    wait_for(lambda: first.state != "PENDING", timeout=10, message="the run's state")
    assert first.state == "RETRY"
    assert job.delay(1).id == first.id  # its retry is the queued job of its key


def test_the_worker_notes_its_own_time_limits_as_it_starts(
    make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``celery worker --time-limit --soft-time-limit`` reach only its pool: the worker's
    bootstep notes them (before a prefork pool forks), for the hold's length."""
    from celery_redlock import softlimit

    monkeypatch.setattr(softlimit, "_worker_limits", (None, None))
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="s8:{n}")
    def job(self: Any, n: int) -> float:
        return softlimit.hold_for(self)

    with run_worker(app, time_limit=30, soft_time_limit=10):
        assert softlimit._worker_limits == (30, 10)
        assert job.delay(1).get(timeout=20) == 10.0


def test_the_hold_reads_the_limits_of_the_job_the_worker_runs_not_of_one_applied_in_it(
    make_app: Any,
) -> None:
    """Fifth review: a body running another task with ``apply()`` (eagerly, inside it):
    Celery's ``current_worker_task`` is that task, whose limits the pool does not enforce;
    the hold read its (none: 5 s) and outlasted the running job's hard limit."""
    from celery_redlock import softlimit

    app = make_app()

    @app.task(bind=True)
    def helper(self: Any) -> str | None:
        running = softlimit.running_job()
        return None if running is None else running[0].name

    @app.task(bind=True, base=SingletonTask, lock_key="s9:{n}")
    def outer(self: Any, n: int) -> str | None:
        return helper.apply(throw=True).get()

    with run_worker(app):
        assert outer.delay(1).get(timeout=20) == outer.name


def test_the_running_job_is_found_when_the_task_applies_itself(make_app: Any) -> None:
    """Sixth review: a task running its own next step with ``self.apply()``: Celery's
    stack then holds the task twice, and each entry's ``request`` is the top one (the
    eager one), so no job was found and the hold fell back to 5 s, past the job's hard
    limit. The job's own request is found in the task's stack of requests."""
    from celery_redlock import softlimit

    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="s10:{n}:{depth}")
    def walk(self: Any, n: int, depth: int) -> Any:
        if depth:
            return walk.apply((n, depth - 1), throw=True).get()
        found = softlimit.running_job()
        assert self.request.is_eager
        return None if found is None else (found[0].name, found[1].id)

    with run_worker(app):
        result = walk.delay(1, 1)
        assert result.get(timeout=20) == [walk.name, result.id]


def test_a_body_in_a_greenlet_of_its_own_holds_nothing(make_app: Any) -> None:
    """Sixth review: a body running its work in a greenlet of its own (as SQLAlchemy's
    asyncio layer runs sync code): Celery's stack of tasks is per greenlet, so there no job
    is found; the hold was 5 s, past the job's hard limit. Its limits unknown, nothing is
    held."""
    import greenlet

    from celery_redlock import softlimit

    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="s11:{n}")
    def job(self: Any, n: int) -> Any:
        return greenlet.greenlet(
            lambda: (softlimit.running_job(), softlimit.running_hold())
        ).switch()

    with run_worker(app):
        assert job.delay(1).get(timeout=20) == [None, 0.0]


def test_a_real_soft_limit_during_an_eager_retry_reaches_the_job_around_it(
    env: CeleryEnv, make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seventh review: a job running a SingletonTask step with ``apply()``, the step
    calling ``retry()``: the soft limit that came during that retry was held and, as
    ``Retry`` was taken to end the delivery, only logged. An eager ``Retry`` ends nothing
    (``apply()`` runs the step again), so the job ran on past its soft limit."""
    app = make_app()
    notes: list[str] = []

    @app.task(bind=True, base=SingletonTask, lock_key="s12:{n}")
    def step(self: Any, n: int) -> int:
        notes.append(f"step attempt {self.request.retries}")
        if not self.request.retries:
            self.retry(countdown=0)
        return n

    @app.task(bind=True, soft_time_limit=1, time_limit=30)
    def job(self: Any, n: int) -> str:
        step.apply((n,), throw=True).get()
        notes.append("went on past its soft limit")
        return "done"

    rebuild = step.signature_from_request

    def signal_in_retry(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGUSR1)  # held, while retry() builds its message
        return rebuild(*args, **kwargs)

    monkeypatch.setattr(step, "signature_from_request", signal_in_retry)
    first = job.delay(1)
    _run_as_a_prefork_child(job, first.id, env)
    wait_for(lambda: first.state != "PENDING", timeout=10, message="the run's state")
    assert notes == ["step attempt 0"]
    assert first.state == "FAILURE"
    assert isinstance(first.result, SoftTimeLimitExceeded)

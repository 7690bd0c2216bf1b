"""What celery-once and celery-singleton users reach for: ``raise_on_duplicate``, per-call
``redlock={...}`` options that follow the job to the worker, and clearing a stuck lock or
marker from Python."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_redlock import AlreadyQueued, ImproperlyConfigured, SingletonTask, redlock_for
from celery_redlock.keys import redis_key

from .redlock_testkit import BROKERS, CeleryEnv, SignalLog, opened_on_exit, queue_length, run_worker

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("where", ["task option", "setting", "per call"])
def test_raise_on_duplicate_names_the_queued_job(env: CeleryEnv, make_app: Any, where: str) -> None:
    conf = {"redlock_raise_on_duplicate": True} if where == "setting" else {}
    app = make_app(**conf)
    option = {"raise_on_duplicate": True} if where == "task option" else {}

    @app.task(base=SingletonTask, lock_key="sync:{account}", **option)
    def sync(account: int) -> int:
        return account

    call = {"redlock": {"raise_on_duplicate": True}} if where == "per call" else {}
    first = sync.apply_async((1,), **call)
    with pytest.raises(AlreadyQueued) as raised:
        sync.apply_async((1,), **call)
    assert raised.value.task_id == first.id
    assert raised.value.key == "sync:1"
    assert first.id in str(raised.value)
    # Rebuilt as a result backend does.
    rebuilt = AlreadyQueued(*raised.value.args)
    assert (rebuilt.task_id, rebuilt.key) == (first.id, "sync:1")
    # The same job (its own id) is not a duplicate; dedupe off publishes another job.
    assert sync.apply_async((1,), task_id=first.id, **call).id == first.id
    other = sync.apply_async((1,), redlock={"dedupe": None, "raise_on_duplicate": True})
    assert other.id != first.id
    assert queue_length(app, env.queue) == 2
    with run_worker(app):
        assert first.get(timeout=10) == 1
        assert other.get(timeout=10) == 1


def test_duplicates_return_the_queued_job_by_default(make_app: Any) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="sync:{account}")
    def sync(account: int) -> int:
        return account

    first = sync.delay(1)
    assert sync.delay(1).id == first.id
    with pytest.raises(AlreadyQueued):
        sync.apply_async((1,), redlock={"raise_on_duplicate": True})
    assert sync.apply_async((1,), redlock={"raise_on_duplicate": False}).id == first.id


@pytest.mark.parametrize(
    ("redlock", "names"),
    [
        ({"lock_tll": 5}, ["lock_tll", "accepted: dedupe, lock_ttl"]),
        ({"on_contention": "wait"}, ["on_contention", "'retry', 'skip', 'raise'", "'wait'"]),
        ({"lock_ttl": -1}, ["lock_ttl", "seconds"]),
        ({"raise_on_duplicate": "yes"}, ["raise_on_duplicate", "True or False"]),
        ({"dedupe": "always"}, ["dedupe", "'queued', 'active', None"]),
        ({"lock_ttl": None}, ["lock_ttl", "None"]),
        ("skip", ["redlock= publish option must be a dict"]),
    ],
)
def test_bad_call_options_are_refused_by_name(
    env: CeleryEnv, make_app: Any, redlock: Any, names: list[str]
) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="sync:{account}")
    def sync(account: int) -> int:
        return account

    with pytest.raises(ImproperlyConfigured) as raised:
        sync.apply_async((1,), redlock=redlock)
    for name in names:
        assert name in str(raised.value)
    assert sync.name in str(raised.value)
    sync.apply_async((2,), redlock={"lock_ttl": 5})
    assert queue_length(app, env.queue) == 1  # the refused publish sent nothing


@pytest.mark.parametrize("env", BROKERS, indirect=True)
def test_call_options_apply_at_run_time_through_reschedules_and_retries(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog
) -> None:
    """``lock_ttl`` and ``on_contention`` given at publish are what the worker uses, also
    after a contention reschedule and after the task's own ``retry()``."""
    app = make_app()
    ttls: list[tuple[int, float]] = []

    @app.task(bind=True, base=SingletonTask, lock_key="sync:{account}", lock_ttl=30)
    def sync(self: Any, account: int) -> int:
        assert self.lease is not None
        ttls.append((self.request.retries, self.lease.ttl))
        if self.request.retries == 0:
            raise self.retry(countdown=0)
        return account

    held = redlock_for(app).acquire("sync:1", 30)
    try:
        with run_worker(app):
            job = sync.apply_async((1,), redlock={"lock_ttl": 7})
            # Rescheduled on contention (the task says "retry"), with the header kept.
            signal_log_wait(signal_log, job.id, "retry")
            held.release()
            assert job.get(timeout=20) == 1
            assert ttls == [(0, 7), (1, 7)]

            # on_contention="skip" for this job only: it is skipped, not rescheduled.
            held = redlock_for(app).acquire("sync:2", 30)
            skipped = sync.apply_async((2,), redlock={"on_contention": "skip"})
            signal_log_wait(signal_log, skipped.id, "skip")
            assert not signal_log.of("lock_contended", task_id=skipped.id, action="retry")
    finally:
        held.release()


def signal_log_wait(log: SignalLog, task_id: str, action: str) -> None:
    from celery_redlock.testing import wait_for

    wait_for(
        lambda: log.of("lock_contended", task_id=task_id, action=action),
        timeout=10,
        message=f"{task_id} contended with action {action}",
    )


def test_dedupe_active_per_call_keeps_the_marker_while_the_job_runs(make_app: Any) -> None:
    app = make_app()
    gate = threading.Event()
    started = threading.Event()

    @app.task(base=SingletonTask, lock_key="sync:{account}")
    def sync(account: int) -> int:
        started.set()
        gate.wait(10)
        return account

    with run_worker(app), opened_on_exit(gate):
        first = sync.apply_async((1,), redlock={"dedupe": "active"})
        assert started.wait(10)
        assert sync.apply_async((1,), redlock={"dedupe": "active"}).id == first.id
        gate.set()
        assert first.get(timeout=10) == 1


def test_clear_lock_and_clear_dedupe(env: CeleryEnv, make_app: Any) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="batch:{ids}")
    def batch(ids: list[int]) -> int:
        return len(ids)

    # Tuples, as the caller writes them: the key is the worker's ("batch:[1, 2]").
    first = batch.delay((1, 2))
    marker = redis_key("redlock", "batch:[1, 2]", batch.dedupe_suffix())
    assert env.on_quorum(marker)
    assert batch.clear_dedupe((1, 2)) == [marker]
    assert not any(env.on_masters(marker))
    assert batch.clear_dedupe((1, 2)) == []  # nothing left to delete
    second = batch.delay((1, 2))
    assert second.id != first.id

    lease = redlock_for(app).acquire("batch:[1, 2]", 30, meta={"task_id": "stuck"})
    lock, meta = env.lock_names("batch:[1, 2]")
    assert batch.clear_lock(ids=[1, 2]) == sorted([lock, meta])
    assert not redlock_for(app).locked("batch:[1, 2]")
    lease.release()  # a no-op now: never raises
    with run_worker(app):
        assert first.get(timeout=10) == 2
        assert second.get(timeout=10) == 2


def test_clear_reaches_the_masters_that_answer(env: CeleryEnv, make_app: Any) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="sync:{account}")
    def sync(account: int) -> int:
        return account

    sync.delay(1)
    marker = redis_key("redlock", "sync:1", sync.dedupe_suffix())
    env.masters[0].kill()
    assert sync.clear_dedupe(1) == [marker]
    for server in list(env.masters)[1:]:
        with server.client() as conn:
            assert not conn.exists(marker)

"""SingletonTask on in-process workers: one run per key at a time, contention policies,
the lock as operators see it in Redis, fencing, registration-time checks and signals.

Workers are real Celery workers in this process (threads pool, 2 threads) on a harness
Redis broker; the key scenarios run again on RabbitMQ. Bodies record their (enter, exit)
``time.monotonic_ns()``; overlap is checked on those.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import pytest
from celery.result import AsyncResult
from celery.signals import task_prerun

from celery_redlock import ImproperlyConfigured, LockContended, Redlock, SingletonTask
from celery_redlock.testing import wait_for

from .redlock_testkit import (
    BROKERS,
    CeleryEnv,
    Recorder,
    SignalLog,
    assert_no_overlap,
    opened_on_exit,
    run_worker,
)

pytestmark = pytest.mark.timeout(60)


def _state(result: AsyncResult) -> str:
    return str(result.state)


@pytest.mark.parametrize("env", BROKERS, indirect=True)
def test_retry_runs_identical_jobs_one_after_the_other(
    env: CeleryEnv, make_app: Any, recorder: Recorder, signal_log: SignalLog
) -> None:
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="sync:{account}", dedupe=None)
    def sync(self: Any, account: int) -> int:
        with recorder.span(self.request.id):
            time.sleep(0.4)  # the job's work
        return account

    with run_worker(app):
        first, second = sync.delay(7), sync.delay(7)
        assert first.get(timeout=20) == 7
        assert second.get(timeout=20) == 7

    spans = assert_no_overlap(recorder.spans)
    assert len(spans) == 2
    # Both were delivered at once to two threads: one of them met the lock and was
    # rescheduled (same id), then ran once the other had finished.
    contended = signal_log.of("lock_contended", key="sync:7", action="retry")
    assert contended, "the second job never met the lock: the test did not test contention"
    assert {c["task_id"] for c in contended} <= {first.id, second.id}
    assert spans[1].task_id == contended[0]["task_id"]


@pytest.mark.parametrize("env", BROKERS, indirect=True)
def test_skip_runs_once_and_stores_a_failure(
    env: CeleryEnv, make_app: Any, recorder: Recorder, signal_log: SignalLog
) -> None:
    app = make_app()
    gate = threading.Event()

    @app.task(
        bind=True, base=SingletonTask, lock_key="nightly:{day}", on_contention="skip", dedupe=None
    )
    def nightly(self: Any, day: str) -> str:
        with recorder.span(self.request.id):
            gate.wait(10)
        return day

    with run_worker(app), opened_on_exit(gate):
        first = nightly.delay("mon")
        recorder.wait_entered(1)
        second = nightly.delay("mon")
        # skip_result="failure" (the default): a ready state, .get() raises at once.
        with pytest.raises(LockContended):
            second.get(timeout=10)
        gate.set()
        assert first.get(timeout=10) == "mon"

    assert [s.task_id for s in recorder.spans] == [first.id]
    assert AsyncResult(second.id, app=app).state == "FAILURE"
    assert signal_log.of("lock_contended", task_id=second.id, action="skip", key="nightly:mon")


def test_skip_duplicates_of_a_held_key_are_dropped_before_the_pool(
    env: CeleryEnv, make_app: Any, recorder: Recorder, signal_log: SignalLog
) -> None:
    """A storm of duplicates while the first job runs: the worker's main process drops
    them (FAILURE stored, signal sent) without handing them to the pool; once the key
    is free again, the next duplicate runs."""
    app = make_app()
    gate = threading.Event()
    started: list[str] = []

    @app.task(
        bind=True, base=SingletonTask, lock_key="feed:{name}", on_contention="skip", dedupe=None
    )
    def feed(self: Any, name: str) -> str:
        with recorder.span(self.request.id):
            gate.wait(10)
        return name

    def on_prerun(task_id: str | None = None, **_: Any) -> None:
        started.append(str(task_id))

    task_prerun.connect(on_prerun, weak=False)
    try:
        with run_worker(app), opened_on_exit(gate):
            first = feed.delay("news")
            recorder.wait_entered(1)
            storm = [feed.delay("news") for _ in range(30)]
            for result in storm:
                wait_for(lambda r=result: _state(r) == "FAILURE", timeout=20, message="FAILURE")
            assert started == [first.id], "a duplicate of a held key went to the pool"
            gate.set()
            assert first.get(timeout=10) == "news"
            later = feed.delay("news")
            assert later.get(timeout=10) == "news"
    finally:
        task_prerun.disconnect(on_prerun)
    assert [s.task_id for s in recorder.spans] == [first.id, later.id]
    skipped = {
        c["task_id"] for c in signal_log.of("lock_contended", key="feed:news", action="skip")
    }
    assert skipped == {r.id for r in storm}


@pytest.mark.parametrize("env", BROKERS, indirect=True)
def test_raise_fails_with_lock_contended_rebuilt_by_the_backend(
    env: CeleryEnv, make_app: Any, recorder: Recorder
) -> None:
    app = make_app()
    gate = threading.Event()

    @app.task(
        bind=True, base=SingletonTask, lock_key="export:{n}", on_contention="raise", dedupe=None
    )
    def export(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            gate.wait(10)
        return n

    with run_worker(app), opened_on_exit(gate):
        first = export.delay(3)
        recorder.wait_entered(1)
        second = export.delay(3)
        with pytest.raises(LockContended) as raised:
            second.get(timeout=10)
        gate.set()
        assert first.get(timeout=10) == 3

    fresh = AsyncResult(second.id, app=app)  # read back from the result backend
    assert fresh.state == "FAILURE"
    assert type(fresh.result) is LockContended
    assert fresh.result.key == "export:3"
    assert raised.value.key == "export:3"
    assert [s.task_id for s in recorder.spans] == [first.id]


def test_max_contention_retries_gives_up_with_lock_contended(
    env: CeleryEnv, make_app: Any, recorder: Recorder, signal_log: SignalLog
) -> None:
    app = make_app()

    @app.task(
        bind=True,
        base=SingletonTask,
        lock_key="held:{n}",
        max_contention_retries=2,
        contention_backoff=(0.05, 0.1),
    )
    def job(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            return n

    holder = Redlock(env.masters.urls).acquire("held:1", ttl=30)
    try:
        with run_worker(app):
            result = job.delay(1)
            with pytest.raises(LockContended, match="max_contention_retries=2"):
                result.get(timeout=15)
    finally:
        holder.release()

    assert result.state == "FAILURE"
    assert recorder.spans == []
    actions = [s["action"] for s in signal_log.of("lock_contended", task_id=result.id)]
    assert actions == ["retry", "retry", "give_up"]


def test_lock_key_is_verbatim_in_redis_with_owner_metadata(
    env: CeleryEnv, make_app: Any, recorder: Recorder
) -> None:
    app = make_app()
    gate = threading.Event()

    @app.task(bind=True, base=SingletonTask, lock_key="report:{account_id}", lock_ttl=20)
    def build_report(self: Any, account_id: int) -> int:
        with recorder.span(self.request.id):
            gate.wait(10)
        return account_id

    lock, meta = "redlock:{report:42}", "redlock:{report:42}:meta"
    assert env.lock_names("report:42") == (lock, meta)
    with run_worker(app), opened_on_exit(gate):
        result = build_report.delay(42)
        recorder.wait_entered(1)
        wait_for(lambda: all(env.on_masters(meta)), timeout=5, message="lock on every master")
        for server in env.masters:
            with server.client(decode_responses=True) as conn:
                assert 0 < conn.pttl(lock) <= 20_000
                info = conn.hgetall(meta)
                assert info["task_id"] == result.id
                assert info["task"] == build_report.name
                # Celery gives the threads pool the machine's name as request.hostname, and
                # the prefork pool the node name ("name@machine"): either names the machine.
                assert info["host"].rpartition("@")[2] == socket.gethostname()
                assert info["pid"] == str(os.getpid())
        gate.set()
        assert result.get(timeout=10) == 42

    # Released (and the metadata with it) on every master.
    wait_for(lambda: not any(env.on_masters(lock) + env.on_masters(meta)), timeout=5)


def test_bad_lock_key_template_fails_at_registration(make_app: Any) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="report:{acount_id}")
    def build_report(account_id: int) -> int:
        return account_id

    with pytest.raises(ImproperlyConfigured, match="acount_id") as raised:
        app.tasks  # noqa: B018 - finalizing the app registers (binds) the task
    assert "account_id" in str(raised.value)  # the names it could have used

    finalized = make_app()
    finalized.finalize()
    with pytest.raises(ImproperlyConfigured, match="acount_id"):

        @finalized.task(base=SingletonTask, lock_key="report:{acount_id}")
        def build_report_again(account_id: int) -> int:
            return account_id


def test_fence_increases_across_runs(make_app: Any) -> None:
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="ledger:{account}")
    def write(self: Any, account: int) -> int:
        return int(self.lease.fence)

    with run_worker(app):
        fences = [write.delay(5).get(timeout=10) for _ in range(3)]

    assert fences[0] < fences[1] < fences[2]


def test_signals_carry_key_and_task_id(
    env: CeleryEnv, make_app: Any, recorder: Recorder, signal_log: SignalLog
) -> None:
    app = make_app()
    gate = threading.Event()

    @app.task(bind=True, base=SingletonTask, lock_key="sig:{n}")
    def job(self: Any, n: int) -> int:
        with recorder.span(self.request.id):
            gate.wait(10)
        return n

    queued = job.delay(1)
    duplicate = job.delay(1)  # no worker yet: deduplicated against the queued job
    assert duplicate.id == queued.id
    [dropped] = signal_log.of("duplicate_dropped")
    assert dropped["key"] == "sig:1"
    assert dropped["existing_id"] == queued.id
    assert dropped["stage"] == "publish"
    assert dropped["task_id"] != queued.id  # the id the dropped publish would have had

    with run_worker(app), opened_on_exit(gate):
        recorder.wait_entered(1)
        later = job.delay(1)  # a new job (the first started), contends while it runs
        wait_for(
            lambda: signal_log.of("lock_contended", task_id=later.id),
            timeout=10,
            message="lock_contended for the later job",
        )
        gate.set()
        assert queued.get(timeout=10) == 1
        assert later.get(timeout=10) == 1

    for task_id in (queued.id, later.id):
        [acquired] = signal_log.of("lock_acquired", task_id=task_id)
        assert acquired["key"] == "sig:1"
        assert acquired["lease"].key == "sig:1"
        [released] = signal_log.of("lock_released", task_id=task_id)
        assert released["key"] == "sig:1"
        # Sent without waiting for the masters after a body returns (confirmed None).
        assert released["confirmed"] in (True, None)
    lock = env.lock_names("sig:1")[0]
    wait_for(lambda: not any(env.on_masters(lock)), timeout=5, message="lock released")
    contended = signal_log.of("lock_contended", task_id=later.id)
    assert all(c["key"] == "sig:1" and c["action"] == "retry" for c in contended)
    assert_no_overlap(recorder.spans)

"""What a job skipped on contention leaves behind, in-process (threads pool).

A skip stores a ready result by default (``skip_result="failure"``: ``.get()`` raises
LockContended at once) and IGNORED on request; a canvas member (chord header, chain step,
group member) is never skipped: it waits for the key, so its canvas completes.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from celery import chain, chord, group
from celery.result import AsyncResult

from celery_redlock import ImproperlyConfigured, LockContended, Redlock, SingletonTask
from celery_redlock.keys import redis_key
from celery_redlock.settings import get_settings
from celery_redlock.task import OCCURRENCE_HEADER
from celery_redlock.testing import wait_for

from .redlock_testkit import CeleryEnv, SignalLog, run_worker

pytestmark = pytest.mark.timeout(60)


def _held(env: CeleryEnv, key: str) -> Any:
    """An outside holder of ``key`` (30 s TTL): every run of it meets the lock."""
    return Redlock(env.masters.urls).acquire(key, ttl=30)


def test_a_skipped_job_is_ready_and_get_raises_lock_contended(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog
) -> None:
    """Skipped in the pool and dropped before it (a burst of duplicates of a held key):
    each ``.get()`` raises LockContended, none waits for its timeout."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="nightly:{d}", on_contention="skip")
    def nightly(self: Any, d: str) -> str:
        return d

    holder = _held(env, "nightly:mon")
    try:
        with run_worker(app):
            jobs = [nightly.apply_async(("mon",), task_id=uuid.uuid4().hex) for _ in range(4)]
            for job in jobs:
                with pytest.raises(LockContended) as caught:
                    job.get(timeout=10)
                assert caught.value.key == "nightly:mon"
                assert "skipped" in str(caught.value)
    finally:
        holder.release()
    assert {AsyncResult(j.id, app=app).state for j in jobs} == {"FAILURE"}
    skipped = {c["task_id"] for c in signal_log.of("lock_contended", action="skip")}
    assert skipped == {j.id for j in jobs}


def test_skip_result_ignored_keeps_the_old_state(env: CeleryEnv, make_app: Any) -> None:
    app = make_app(redlock_skip_result="ignored")

    @app.task(bind=True, base=SingletonTask, lock_key="nightly:{d}", on_contention="skip")
    def nightly(self: Any, d: str) -> str:
        return d

    holder = _held(env, "nightly:tue")
    try:
        with run_worker(app):
            job = nightly.delay("tue")
            wait_for(lambda: job.state == "IGNORED", timeout=10, message="IGNORED stored")
    finally:
        holder.release()


@pytest.mark.parametrize("value", ["rejected", None, True, 1])
def test_a_bad_skip_result_names_the_setting_and_the_choices(make_app: Any, value: Any) -> None:
    app = make_app(redlock_skip_result=value)
    with pytest.raises(ImproperlyConfigured) as caught:
        get_settings(app)
    message = str(caught.value)
    assert "redlock_skip_result" in message
    assert "'failure'" in message
    assert "'ignored'" in message


@pytest.mark.parametrize("canvas", ["chord", "chain", "group", "beat-chord"])
def test_a_canvas_member_that_meets_the_lock_waits_and_its_canvas_completes(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog, canvas: str
) -> None:
    """``on_contention="skip"`` (and a beat occurrence, always skipped): a chord header
    member, a chain step or a group member that met the lock is rescheduled until the key
    is free, then runs; the chord's body runs, the chain and the group complete."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="sync:{n}", on_contention="skip")
    def sync(self: Any, n: int) -> int:
        return n

    @app.task
    def report(results: list[int]) -> list[int]:
        return sorted(results)

    member = sync.s(1)
    if canvas == "beat-chord":
        member = member.set(headers={OCCURRENCE_HEADER: f"sync#{uuid.uuid4().hex}"})
    holder = _held(env, "sync:1")
    try:
        with run_worker(app, concurrency=3):
            if canvas in ("chord", "beat-chord"):
                result = chord([member, sync.s(1), sync.s(2)])(report.s())
                expected: Any = [1, 1, 2]
            elif canvas == "chain":
                result = chain(sync.si(2), sync.si(1), sync.si(1))()
                expected = 1
            else:
                result = group(sync.s(1), sync.s(1), sync.s(2))()
                expected = [1, 1, 2]
            wait_for(
                lambda: len(signal_log.of("lock_contended", key="sync:1")) >= 2,
                timeout=15,
                message="canvas members meeting the lock",
            )
            holder.release()
            assert result.get(timeout=20) == expected
    finally:
        holder.release()
    actions = {c["action"] for c in signal_log.of("lock_contended", key="sync:1")}
    assert actions == {"retry"}


def test_a_redelivery_whose_dead_runs_lock_expires_as_its_holder_is_read_runs(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by CI (the killed-worker chaos test): a job redelivered after its worker died
    failed its acquire on the dead run's lock, which then expired on two masters before
    the read of its holder. That read found the job's own task id on one master only: not
    its own run, so contention, and ``on_contention="skip"`` dropped the job for good. The
    lock is free by then: the job is rescheduled (not counted, no signal) and runs."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="sync:{n}", on_contention="skip")
    def sync(self: Any, n: int) -> int:
        return n

    task_id = uuid.uuid4().hex
    outside = Redlock(env.masters.urls)
    dead = outside.acquire("sync:1", ttl=30, meta={"task_id": task_id})
    acquire = Redlock.acquire
    expired: list[str] = []

    def acquire_then_expire(self: Redlock, key: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return acquire(self, key, *args, **kwargs)
        except LockContended:
            if not expired:  # the dead run's lock expires on two masters right then
                for server in env.masters[:2]:
                    with server.client() as conn:
                        conn.delete(redis_key("redlock", key), redis_key("redlock", key, "meta"))
                expired.append(key)
            raise

    monkeypatch.setattr(Redlock, "acquire", acquire_then_expire)
    try:
        with run_worker(app):
            job = sync.apply_async((1,), task_id=task_id)
            assert job.get(timeout=20) == 1
    finally:
        dead.release()
        outside.close()
    assert expired == ["sync:1"]
    assert signal_log.of("lock_contended") == []

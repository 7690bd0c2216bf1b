"""What a job skipped on contention leaves behind, in-process (threads pool).

A skip stores a ready result by default (``skip_result="failure"``: ``.get()`` raises
LockContended at once) and IGNORED on request; a canvas member (chord header, chain step,
group member) is never skipped: it waits for the key, so its canvas completes.

And what a run does when the key changes between its failed acquire and the read of the
key's holder (its own dead run's lock expiring, the holder ending, the next one taking
it), each race hit on purpose by wrapping ``Redlock.acquire`` or ``holder_state``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import chain, chord, group
from celery.result import AsyncResult

from celery_redlock import ImproperlyConfigured, LockContended, Redlock, SingletonTask
from celery_redlock.keys import redis_key
from celery_redlock.settings import get_settings
from celery_redlock.task import CONTENTION_HEADER, OCCURRENCE_HEADER, OWN_RUN_HEADER, _header
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


@pytest.mark.parametrize("occurrence", [False, True], ids=["skip", "beat-occurrence"])
def test_a_redelivery_whose_dead_runs_lock_expires_as_its_holder_is_read_runs(
    env: CeleryEnv,
    make_app: Any,
    signal_log: SignalLog,
    monkeypatch: pytest.MonkeyPatch,
    occurrence: bool,
) -> None:
    """Found by CI (the killed-worker chaos test): a job redelivered after its worker died
    failed its acquire on the dead run's lock, which then expired on two masters before
    the read of its holder. That read found the job's own task id on one master only: not
    its own run, so contention, and ``on_contention="skip"`` dropped the job for good (a
    beat occurrence too). It is its own run's lock, expiring: the job is rescheduled (not
    counted, no signal) and runs."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="sync:{n}", on_contention="skip")
    def sync(self: Any, n: int) -> int:
        return n

    task_id = uuid.uuid4().hex
    outside = Redlock(env.masters.urls)
    dead = outside.acquire("sync:1", ttl=30, meta={"task_id": task_id})

    def expire_on_two() -> None:  # the dead run's lock expires on two masters right then
        for server in env.masters[:2]:
            with server.client() as conn:
                conn.delete(redis_key("redlock", "sync:1"), redis_key("redlock", "sync:1", "meta"))

    expired = _after_first_contention(monkeypatch, "sync:1", expire_on_two)
    try:
        with run_worker(app):
            headers = {OCCURRENCE_HEADER: f"sync#{uuid.uuid4().hex}"} if occurrence else None
            job = sync.apply_async((1,), task_id=task_id, headers=headers)
            assert job.get(timeout=20) == 1
    finally:
        dead.release()
        outside.close()
    assert expired == ["sync:1"]
    assert signal_log.of("lock_contended") == []


def _after_first_contention(
    monkeypatch: pytest.MonkeyPatch, key: str, happen: Callable[[], None]
) -> list[str]:
    """``happen()`` right after the first failed acquire of ``key`` (as the acquire
    returns, before the read of the key's holder); returns ``[key]`` once it has."""
    acquire = Redlock.acquire
    done: list[str] = []

    def acquire_then(self: Redlock, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return acquire(self, name, *args, **kwargs)
        except LockContended:
            if not done and name == key:
                happen()
                done.append(name)
            raise

    monkeypatch.setattr(Redlock, "acquire", acquire_then)
    return done


@pytest.mark.parametrize("occurrence", [False, True], ids=["raise", "beat-occurrence"])
def test_a_key_freed_as_its_holder_is_read_is_tried_once_more_at_once(
    env: CeleryEnv,
    make_app: Any,
    signal_log: SignalLog,
    monkeypatch: pytest.MonkeyPatch,
    occurrence: bool,
) -> None:
    """A job whose acquire fails on a run that ends in the next moment, before the read of
    the key's holder: nobody holds the key any more, so the job tries once more at once
    and runs in its first delivery, as if it had come a moment later. Before, it was
    contended (``"raise"`` failed it; a beat occurrence was skipped), and in between (the
    first fix of the CI finding, found by review) it was rescheduled without counting,
    and a beat occurrence ran late."""
    app = make_app()
    ran: list[tuple[int, Any, Any]] = []

    @app.task(bind=True, base=SingletonTask, lock_key="tick:{n}", on_contention="raise")
    def tick(self: Any, n: int) -> int:
        request = self.request
        ran.append(
            (request.retries, _header(request, OWN_RUN_HEADER), _header(request, CONTENTION_HEADER))
        )
        return n

    outside = Redlock(env.masters.urls)
    previous = outside.acquire("tick:1", ttl=30, meta={"task_id": "the-previous-run"})
    released = _after_first_contention(monkeypatch, "tick:1", previous.release)
    headers = {OCCURRENCE_HEADER: f"tick#{uuid.uuid4().hex}"} if occurrence else None
    try:
        with run_worker(app):
            job = tick.apply_async((1,), headers=headers)
            assert job.get(timeout=20) == 1
    finally:
        outside.close()
    assert released == ["tick:1"]
    assert ran == [(0, None, None)]  # once, in its first delivery: never rescheduled
    assert signal_log.of("lock_contended") == []


def test_contention_stays_counted_when_the_key_changes_hands_in_that_moment(
    env: CeleryEnv, make_app: Any, signal_log: SignalLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review of the first fix: a job that met another run's lock, which then ended
    while the next run of the key took it, was rescheduled without counting; on a hot key
    whose runs keep handing it over, ``on_contention="raise"`` never raised (nor did
    ``max_contention_retries`` give up): here it ran once the hand-overs stopped. Its one
    more try meets the new holder, and the second miss is contention, as the policy says."""
    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="hot:{n}", on_contention="raise")
    def hot(self: Any, n: int) -> int:
        return n

    outside = Redlock(env.masters.urls)
    holders = [outside.acquire("hot:1", ttl=30, meta={"task_id": "run-0"})]
    acquire, read = Redlock.acquire, Redlock.holder_state

    def acquire_then_release(self: Redlock, key: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return acquire(self, key, *args, **kwargs)
        except LockContended:
            if self is not outside:
                holders[-1].release()  # the run holding the key ends right then
            raise

    def read_then_take(self: Redlock, key: str, field: str, value: str) -> Any:
        state = read(self, key, field, value)
        if self is not outside and len(holders) < 6:  # and the next run takes the key
            holders.append(outside.acquire(key, ttl=30, meta={"task_id": f"run-{len(holders)}"}))
        return state

    monkeypatch.setattr(Redlock, "acquire", acquire_then_release)
    monkeypatch.setattr(Redlock, "holder_state", read_then_take)
    try:
        with run_worker(app):
            job = hot.delay(1)
            with pytest.raises(LockContended):
                job.get(timeout=20)
    finally:
        for lease in holders:
            lease.release()
        outside.close()
    assert len(holders) == 3  # two misses: the first, and the one more try
    assert [s["action"] for s in signal_log.of("lock_contended")] == ["raise"]


def test_an_outage_on_the_one_more_try_keeps_the_queued_marker(
    env: CeleryEnv, make_app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Second review of the CI fix: the first try (contended) cleared the job's "queued"
    marker on the master that granted it, the key was freed, and the one more try met an
    outage (two masters refusing writes for that moment) after clearing the marker on the
    third: the outage reschedule left the marker on one master of three, and an identical
    publish became a second job while the first still waited in the queue."""
    app = make_app(redlock_outage_backoff=(60, 60))  # the job stays queued meanwhile

    @app.task(bind=True, base=SingletonTask, lock_key="k:{n}")  # dedupe="queued"
    def job(self: Any, n: int) -> int:
        return n

    outside = Redlock(env.masters.urls)
    holder = outside.acquire("k:1", ttl=30, meta={"task_id": "run-B"})
    with env.masters[0].client() as conn:  # B's lock already gone on the first master
        conn.delete(redis_key("redlock", "k:1"), redis_key("redlock", "k:1", "meta"))
    _after_first_contention(monkeypatch, "k:1", holder.release)
    acquire = Redlock.acquire
    tries: list[str] = []

    def acquire_with_an_outage(self: Redlock, key: str, *args: Any, **kwargs: Any) -> Any:
        if self is outside:
            return acquire(self, key, *args, **kwargs)
        tries.append(key)
        if len(tries) != 2:
            return acquire(self, key, *args, **kwargs)
        for server in env.masters[:2]:  # the one more try: two masters refuse writes
            with server.client() as conn:
                conn.config_set("maxmemory", "1")
        try:
            return acquire(self, key, *args, **kwargs)
        finally:
            for server in env.masters[:2]:
                with server.client() as conn:
                    conn.config_set("maxmemory", "0")

    first = job.delay(1)
    monkeypatch.setattr(Redlock, "acquire", acquire_with_an_outage)
    try:
        with run_worker(app):
            wait_for(lambda: first.state == "RETRY", timeout=15, message="outage reschedule")
            assert tries == ["k:1", "k:1"]
            assert job.delay(1).id == first.id  # still the queued job of its key
    finally:
        outside.close()


@pytest.mark.parametrize("where", ["holder-read", "acquire"])
def test_a_soft_time_limit_before_the_body_fails_the_job_and_leaves_no_marker(
    env: CeleryEnv,
    make_app: Any,
    signal_log: SignalLog,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """A soft time limit (``SoftTimeLimitExceeded``, raised by a signal wherever the run
    is) landing before the body: the job fails with it, as any job at its soft limit.
    Before, landing in the read of the key's holder it read as "another holder", so with
    ``skip`` the job was reported skipped (``LockContended``, ``lock_contended``); landing
    in the acquire it failed but its "queued" marker stood, so identical publishes
    returned the failed job until ``redlock_dedupe_ttl``."""
    from celery.exceptions import SoftTimeLimitExceeded

    app = make_app()

    @app.task(bind=True, base=SingletonTask, lock_key="soft:{n}", on_contention="skip")
    def soft(self: Any, n: int) -> int:
        return n

    outside = Redlock(env.masters.urls)
    holder = outside.acquire("soft:1", ttl=30, meta={"task_id": "another-run"})
    acquire, read = Redlock.acquire, Redlock.holder_state
    landed: list[str] = []

    def acquire_in_time(self: Redlock, key: str, *args: Any, **kwargs: Any) -> Any:
        if self is not outside and where == "acquire" and not landed:
            landed.append(key)
            raise SoftTimeLimitExceeded()
        return acquire(self, key, *args, **kwargs)

    def read_in_time(self: Redlock, key: str, field: str, value: str) -> Any:
        if self is not outside and where == "holder-read" and not landed:
            landed.append(key)
            raise SoftTimeLimitExceeded()
        return read(self, key, field, value)

    monkeypatch.setattr(Redlock, "acquire", acquire_in_time)
    monkeypatch.setattr(Redlock, "holder_state", read_in_time)
    try:
        with run_worker(app):
            job = soft.delay(1)
            with pytest.raises(SoftTimeLimitExceeded):
                job.get(timeout=20)
            assert landed == ["soft:1"]
            holder.release()
            again = soft.delay(1)  # identical: a new job, the failed one is not queued
            assert again.id != job.id
            assert again.get(timeout=20) == 1
    finally:
        holder.release()
        outside.close()
    assert signal_log.of("lock_contended") == []

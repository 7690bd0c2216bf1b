"""What rolling deploys rely on (docs/upgrading.rst): the storage format each lock carries,
and old and new versions of a task excluding each other while both run."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from celery_redlock import LockContended, SingletonTask, redlock_for
from celery_redlock.keys import STORAGE_FORMAT

from .redlock_testkit import CeleryEnv, run_worker

pytestmark = pytest.mark.timeout(60)


def test_every_lock_carries_the_storage_format(env: CeleryEnv, make_app: Any) -> None:
    app = make_app()
    seen: dict[str, Any] = {}

    @app.task(base=SingletonTask, lock_key="fmt:{n}")
    def fmt(n: int) -> int:
        with env.masters[0].client(decode_responses=True) as conn:
            seen.update(conn.hgetall(f"redlock:{{fmt:{n}}}:meta"))
        return n

    with run_worker(app):
        assert fmt.delay(1).get(timeout=15) == 1
    assert seen["format"] == STORAGE_FORMAT == "1"
    assert seen["task"] == fmt.name


def test_old_and_new_versions_of_a_task_exclude_each_other(env: CeleryEnv, make_app: Any) -> None:
    """v2 adds an optional parameter: for a call that does not pass it, v2 builds v1's key,
    so while a v1 run holds the lock a v2 worker cannot take it."""
    old_app, new_app = make_app(), make_app()
    holding, release = threading.Event(), threading.Event()

    @old_app.task(base=SingletonTask, name="proj.sync", dedupe=None)
    def sync_v1(account_id: int) -> str:
        holding.set()
        release.wait(20)
        return "v1"

    @new_app.task(base=SingletonTask, name="proj.sync", dedupe=None)
    def sync_v2(account_id: int, dry_run: bool = False) -> str:
        return "v2"

    assert sync_v1.redlock_options().lock_key((42,), {}) == sync_v2.redlock_options().lock_key(
        (42,), {}
    )
    with run_worker(old_app):
        first = sync_v1.delay(42)
        assert holding.wait(15)
        with pytest.raises(LockContended):
            redlock_for(new_app).acquire(sync_v2.redlock_options().lock_key((42,), {}), 5)
        release.set()
        assert first.get(timeout=15) == "v1"

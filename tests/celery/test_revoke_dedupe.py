"""A revoked job's dedupe marker goes when a worker that holds the job receives the revoke.

Celery discards a revoked job (and sends ``task_revoked``) only when it would have run it:
a job waiting in the worker's timer (a contention reschedule, an eta) when its time
comes, a job reserved behind a busy pool when a process is free. Until then its marker
made an identical publish, made after the revoke was acknowledged, return the revoked
job: only an INFO line said so, and that publish never ran (hostile review, R2 and R2b).

Each test revokes with ``reply=True`` and looks at the marker right after the reply, with
no waiting: the worker removes it before it replies.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery import states

from celery_redlock import Redlock
from celery_redlock.testing import wait_for

from .redlock_proj.project import LOOP, LOOPA, LOOPQ
from .redlock_testkit import CeleryProcess, ProjEnv

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

#: A contention reschedule lands anywhere in [0, 3600) s: the job stays in the worker's
#: timer for the test (below 10 s once in 360 draws, and then it is rescheduled again).
LONG_WAIT = {"redlock_contention_backoff": [3600, 3600]}


def _marker(env: ProjEnv, task_name: str, key: str) -> list[str | None]:
    """The value of ``task_name``'s dedupe marker of ``key`` on each master."""
    values: list[str | None] = []
    for server in env.masters:
        with server.client() as conn:
            raw = conn.get(f"redlock:{{{key}}}:dedupe:{task_name}")
        values.append(None if raw is None else raw.decode())
    return values


def _entered(env: ProjEnv, task_id: str) -> bool:
    return any(e["task_id"] == task_id and e["event"] == "enter" for e in env.events())


def _holds(app: Any, worker: CeleryProcess, kind: str, task_id: str) -> bool:
    """Whether ``worker`` lists ``task_id`` among its ``scheduled`` or ``reserved`` jobs."""
    replies = getattr(app.control.inspect([worker.nodename], timeout=1), kind)() or {}
    for jobs in replies.values():
        for job in jobs:
            request = job.get("request", job)  # scheduled: {"eta", "request": {...}}
            if request.get("id") == task_id:
                return True
    return False


def _revoke(app: Any, worker: CeleryProcess, task_id: str) -> None:
    replies = app.control.revoke(task_id, reply=True, timeout=5, destination=[worker.nodename])
    assert replies, "the worker did not acknowledge the revoke"


@pytest.mark.parametrize(
    ("pool", "task_name"),
    [
        ("prefork", LOOPQ),
        ("threads", LOOPQ),
        ("solo", LOOPQ),
        ("gevent", LOOPQ),
        ("eventlet", LOOPQ),
        ("threads", LOOPA),
    ],
)
def test_a_job_revoked_in_its_contention_wait_frees_identical_publishes_at_once(
    proj_env: ProjEnv, spawn_worker: Any, pool: str, task_name: str
) -> None:
    """R2: the job waits in the worker's timer for its contention reschedule."""
    worker = spawn_worker("a", pool=pool, conf=LONG_WAIT)
    app = proj_env.client_app()
    task = app.tasks[task_name]
    key = f"{task_name.rpartition('.')[2]}:k"
    holder = Redlock(proj_env.masters.urls).acquire(key, ttl=60)
    try:
        waiting = task.delay("k", 0)
        wait_for(
            lambda: _holds(app, worker, "scheduled", waiting.id),
            timeout=30,
            message="the job waits in the worker's timer for its contention reschedule",
        )
        assert _marker(proj_env, task_name, key).count(waiting.id) >= 2
        _revoke(app, worker, waiting.id)
        assert waiting.id not in _marker(proj_env, task_name, key)
    finally:
        holder.release()
    again = task.delay("k", 0)
    assert again.id != waiting.id, "a publish after the revoke returned the revoked job"
    assert again.get(timeout=30) == "k"
    assert waiting.state == states.REVOKED
    assert not _entered(proj_env, waiting.id)


def test_a_job_revoked_while_reserved_behind_a_busy_pool_frees_identical_publishes_at_once(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    """R2b: one prefork process, busy; the job is reserved (prefetched) behind it."""
    worker = spawn_worker("a", "-c", "1")
    app = proj_env.client_app()
    loopq = app.tasks[LOOPQ]
    busy = app.tasks[LOOP].delay("busy", 60)
    wait_for(lambda: _entered(proj_env, busy.id), timeout=20, message="the busy job started")
    waiting = loopq.delay("k", 0)
    wait_for(
        lambda: _holds(app, worker, "reserved", waiting.id),
        timeout=20,
        message="the job is reserved behind the busy one",
    )
    _revoke(app, worker, waiting.id)
    assert waiting.id not in _marker(proj_env, LOOPQ, "loopq:k")
    again = loopq.delay("k", 0)
    assert again.id != waiting.id, "a publish after the revoke returned the revoked job"
    proj_env.stop_loop("busy")
    assert busy.get(timeout=30) == "busy"
    assert again.get(timeout=30) == "k"
    assert waiting.state == states.REVOKED
    assert not _entered(proj_env, waiting.id)


def test_a_running_job_revoked_without_terminate_keeps_its_active_marker(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    """``dedupe="active"``: a revoke without ``terminate`` does not stop a run, so the
    running job stays the one identical publishes return, until it ends."""
    worker = spawn_worker("a", pool="threads")
    app = proj_env.client_app()
    loopa = app.tasks[LOOPA]
    running = loopa.delay("r", 60)
    wait_for(lambda: _entered(proj_env, running.id), timeout=20, message="the job started")
    _revoke(app, worker, running.id)
    assert _marker(proj_env, LOOPA, "loopa:r").count(running.id) >= 2
    assert loopa.delay("r", 0).id == running.id
    proj_env.stop_loop("r")
    wait_for(
        lambda: running.id not in _marker(proj_env, LOOPA, "loopa:r"),
        timeout=20,
        message="the marker went when the run ended",
    )
    again = loopa.delay("r", 0)
    assert again.id != running.id
    assert again.get(timeout=30) == "r"


def test_a_job_revoked_by_stamped_header_while_waiting_frees_identical_publishes(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    worker = spawn_worker("a", pool="threads", conf=LONG_WAIT)
    app = proj_env.client_app()
    loopq = app.tasks[LOOPQ]
    holder = Redlock(proj_env.masters.urls).acquire("loopq:s", ttl=60)
    try:
        signature = loopq.s("s", 0)
        signature.stamp(batch="b1")
        waiting = signature.apply_async()
        wait_for(
            lambda: _holds(app, worker, "scheduled", waiting.id),
            timeout=30,
            message="the job waits in the worker's timer for its contention reschedule",
        )
        replies = app.control.revoke_by_stamped_headers(
            {"batch": "b1"}, reply=True, timeout=5, destination=[worker.nodename]
        )
        assert replies
        assert waiting.id not in _marker(proj_env, LOOPQ, "loopq:s")
    finally:
        holder.release()
    again = loopq.delay("s", 0)
    assert again.id != waiting.id, "a publish after the revoke returned the revoked job"
    assert again.get(timeout=30) == "s"
    assert not _entered(proj_env, waiting.id)

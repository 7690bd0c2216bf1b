"""Real `celery worker` processes whose runs are killed or interrupted: a worker killed
mid-run with late acks (the redelivered job is the same job: it waits for its own dead
run's lock, then runs), a soft revoke (SIGUSR1: the body's cleanup still holds the lock),
and ``on_lock_lost="interrupt"`` on every pool.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_redlock import LockLostInterrupt
from celery_redlock.testing import wait_for

from .redlock_proj.project import CRASHY_RAISE, CRASHY_SKIP, NAPS, QUICK, SOFT
from .redlock_testkit import BROKERS, ProjEnv

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]

#: Redis broker: an unacknowledged message comes back after the visibility timeout, swept
#: by a live worker (both short here).
FAST_REDELIVERY = {
    "broker_transport_options": {
        "visibility_timeout": 2,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        "unacked_mutex_expire": 2,
    }
}


def _lock_names(key: str) -> tuple[str, str]:
    return f"redlock:{{{key}}}", f"redlock:{{{key}}}:meta"


def _on_masters(env: ProjEnv, name: str) -> list[bool]:
    found = []
    for server in env.masters:
        with server.client() as conn:
            found.append(bool(conn.exists(name)))
    return found


def _events_of(env: ProjEnv, task_id: str, event: str) -> list[dict[str, Any]]:
    return [e for e in env.events() if e["task_id"] == task_id and e["event"] == event]


@pytest.mark.parametrize("proj_env", BROKERS, indirect=True)
@pytest.mark.parametrize("task_name", [CRASHY_SKIP, CRASHY_RAISE])
def test_a_job_redelivered_after_its_worker_died_waits_for_its_own_lock_then_runs(
    proj_env: ProjEnv, spawn_worker: Any, task_name: str
) -> None:
    """acks_late, the worker running the job SIGKILLed: the broker redelivers the message
    (same task id) to the other worker, where it meets the dead run's lock. Whatever
    ``on_contention`` says (skip, raise), it is the same job, not a duplicate: it waits
    for that lock to expire, then runs to completion, once, never beside the dead run."""
    conf = FAST_REDELIVERY if proj_env.kind == "redis" else None
    workers = {w.nodename: w for w in (spawn_worker("a", conf=conf), spawn_worker("b", conf=conf))}
    task = proj_env.client_app().tasks[task_name]
    key = "crash-" + ("skip" if task_name == CRASHY_SKIP else "raise") + ":k"
    lock = _lock_names(key)[0]

    job = task.delay("k", 30)
    [first] = wait_for(
        lambda: _events_of(proj_env, job.id, "enter"), timeout=15, message="job started"
    )
    wait_for(lambda: all(_on_masters(proj_env, lock)), timeout=5, message="lock on masters")
    victim = workers.pop(first["host"])
    [survivor] = workers.values()
    victim.kill()
    killed_at = time.monotonic_ns()
    remaining = []
    for server in proj_env.masters:
        with server.client() as conn:
            remaining.append(conn.pttl(lock))
    assert all(0 < ms <= 6000 for ms in remaining), remaining
    expired_at = killed_at + sorted(remaining)[1] * 1_000_000

    reruns = wait_for(
        lambda: _events_of(proj_env, job.id, "enter")[1:],
        timeout=30,
        message="the redelivered job ran",
    )
    proj_env.stop_loop("k")
    assert job.get(timeout=20) == "k"
    [rerun] = reruns
    assert rerun["host"] == survivor.nodename
    # Not beside the dead run: only once its lock had expired on a quorum.
    assert rerun["t"] >= expired_at - 50_000_000
    assert "held by an earlier run of this same job" in survivor.log, (
        "the redelivered job never met its own dead run's lock: the test tested nothing"
    )
    # Not counted, skipped or failed as contention.
    assert [s for s in proj_env.signals("lock_contended") if s["task_id"] == job.id] == []
    assert len(_events_of(proj_env, job.id, "enter")) == 2
    assert len(_events_of(proj_env, job.id, "exit")) == 1
    assert job.state == "SUCCESS"


@pytest.mark.parametrize("proj_env", BROKERS, indirect=True)
def test_a_soft_revoke_keeps_the_lock_until_the_body_has_ended(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    """``revoke(terminate=True, signal="SIGUSR1")`` raises SoftTimeLimitExceeded in the
    body, which runs a 2 s cleanup: the next job of the key starts only after it ended."""
    worker = spawn_worker("a")
    app = proj_env.client_app()
    soft = app.tasks[SOFT]
    lock, meta = _lock_names("soft:s")

    first = soft.delay("s")
    wait_for(lambda: _events_of(proj_env, first.id, "enter"), timeout=15, message="started")
    wait_for(lambda: all(_on_masters(proj_env, meta)), timeout=5, message="lock and metadata")
    app.control.revoke(first.id, terminate=True, signal="SIGUSR1")
    second = soft.delay("s", 0.1)
    assert second.get(timeout=30) == "s"

    [first_exit] = wait_for(
        lambda: _events_of(proj_env, first.id, "exit"), timeout=10, message="cleanup ended"
    )
    [cleanup] = _events_of(proj_env, first.id, "soft")
    [second_enter] = _events_of(proj_env, second.id, "enter")
    assert cleanup["t"] < first_exit["t"]
    assert second_enter["t"] >= first_exit["t"], (
        f"the second job started {(first_exit['t'] - second_enter['t']) / 1e9:.2f} s before "
        "the soft-revoked body had ended"
    )
    wait_for(lambda: not any(_on_masters(proj_env, lock)), timeout=5, message="released")
    assert "released soft:s after revoke" not in worker.log  # the run released it itself
    # The same child goes on taking jobs.
    assert app.tasks[QUICK].delay("after").get(timeout=15) == "after"


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo", "gevent", "eventlet"])
def test_interrupt_stops_a_body_whose_lock_was_lost_on_every_pool(
    proj_env: ProjEnv, spawn_worker: Any, pool: str
) -> None:
    """The lock's keys deleted on every master 1 s into a body of 0.1 s sleeps: the body
    gets LockLostInterrupt at the next renewal (every 1 s), whatever the pool."""
    spawn_worker(f"p-{pool}", pool=pool)
    app = proj_env.client_app()
    lock, meta = _lock_names("naps:n")

    job = app.tasks[NAPS].delay("n", 30)
    wait_for(lambda: _events_of(proj_env, job.id, "enter"), timeout=15, message="started")
    wait_for(lambda: all(_on_masters(proj_env, meta)), timeout=5, message="lock and metadata")
    for server in proj_env.masters:
        with server.client() as conn:
            conn.delete(lock, meta)

    # Renewal notices within 1 s; 10 s is a generous bound, far below the body's 30 s.
    with pytest.raises(LockLostInterrupt):
        job.get(timeout=10)
    assert len(_events_of(proj_env, job.id, "interrupted")) == 1
    assert _events_of(proj_env, job.id, "exit") == []
    assert job.state == "FAILURE"
    # The worker still runs jobs.
    assert app.tasks[QUICK].delay(f"after-{pool}").get(timeout=15) == f"after-{pool}"

"""Real `celery worker` processes (prefork pool, 2 children) where fork, signals and kills
matter: time limits, revoke with terminate, a worker killed mid-task, masters going away.

Each worker is ``python -m celery -A redlock_proj.celery_app worker -P prefork -c 2`` in its
own process group, on a harness Redis broker; the tasks live in ``redlock_proj/project.py``
and record ``enter``/``exit`` events (with ``time.monotonic_ns()``, the node name and pid)
in a Redis list. Every process group is SIGTERMed, then SIGKILLed, after the test.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from celery_redlock.testing import process_running, wait_for

from .redlock_proj.project import CRASHY, LOOP, QUICK
from .redlock_testkit import ProjEnv

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]


def _lock_names(key: str) -> tuple[str, str]:
    return f"redlock:{{{key}}}", f"redlock:{{{key}}}:meta"


def _on_masters(env: ProjEnv, name: str) -> list[bool]:
    found = []
    for server in env.masters:
        if not server.alive:
            found.append(False)
            continue
        with server.client() as conn:
            found.append(bool(conn.exists(name)))
    return found


def _meta(env: ProjEnv, key: str) -> dict[str, str]:
    with env.masters[0].client(decode_responses=True) as conn:
        return dict(conn.hgetall(_lock_names(key)[1]))


def _entered(env: ProjEnv, task_id: str) -> list[dict[str, Any]]:
    return [e for e in env.events() if e["task_id"] == task_id and e["event"] == "enter"]


def test_time_limits_release_the_lock_at_once(proj_env: ProjEnv, spawn_worker: Any) -> None:
    worker = spawn_worker("a")
    loop = proj_env.client_app().tasks[LOOP]

    # Soft limit: the body unwinds. Default lock_ttl (30 s): only a release on the way out
    # lets the second job run soon.
    first = loop.apply_async(("soft",), soft_time_limit=1)
    wait_for(lambda: _entered(proj_env, first.id), timeout=15, message="first job started")
    second = loop.apply_async(("soft", 0.1))
    with pytest.raises(SoftTimeLimitExceeded):
        first.get(timeout=20)
    assert second.get(timeout=20) == "soft"

    [first_enter] = _entered(proj_env, first.id)
    [second_enter] = _entered(proj_env, second.id)
    waited = (second_enter["t"] - first_enter["t"]) / 1e9
    # 1 s of soft limit plus a contention backoff (< 0.5 s) or two: far below lock_ttl=30.
    assert 1.0 <= waited < 5
    lock = _lock_names("loop:soft")[0]
    wait_for(lambda: not any(_on_masters(proj_env, lock)), timeout=5, message="released")

    # Hard limit: the pool child is killed with no cleanup; the main process releases.
    hard = loop.apply_async(("hard",), time_limit=1)
    wait_for(lambda: _entered(proj_env, hard.id), timeout=15, message="hard-limited job started")
    started = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        hard.get(timeout=20)
    lock = _lock_names("loop:hard")[0]
    wait_for(lambda: not any(_on_masters(proj_env, lock)), timeout=5, message="released")
    assert time.monotonic() - started < 4  # 1 s limit, lock_ttl 30 s
    wait_for(
        lambda: "released loop:hard after TimeLimitExceeded" in worker.log,
        timeout=5,
        message="the main process's release in the worker log",
    )


def test_revoke_and_a_killed_pool_child_release_at_once(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    worker = spawn_worker("a")
    app = proj_env.client_app()
    loop = app.tasks[LOOP]

    def run_and_end(
        name: str, end: Callable[[Any, int], None], final_state: str, within: float = 3
    ) -> None:
        lock, meta = _lock_names(f"loop:{name}")
        job = loop.delay(name)
        wait_for(lambda: _entered(proj_env, job.id), timeout=15, message="job started")
        wait_for(lambda: all(_on_masters(proj_env, meta)), timeout=5, message="lock and metadata")
        owner = _meta(proj_env, f"loop:{name}")
        assert owner["task_id"] == job.id
        assert owner["host"] == worker.nodename
        child = int(owner["pid"])

        end(job, child)
        ended_at = time.monotonic()
        wait_for(lambda: not any(_on_masters(proj_env, lock)), timeout=20, message="released")
        assert time.monotonic() - ended_at < within, name  # lock_ttl is 30 s: no expiry
        wait_for(lambda: not process_running(child), timeout=5, message="pool child gone")
        wait_for(lambda: job.state == final_state, timeout=5, message=f"{final_state} stored")

    # SIGTERM (revoke's default) lets the pool child unwind and release; SIGKILL does not,
    # and then the worker's main process releases the lock by the task id in its metadata.
    run_and_end("rv-term", lambda job, _: app.control.revoke(job.id, terminate=True), "REVOKED")
    run_and_end(
        "rv-kill",
        lambda job, _: app.control.revoke(job.id, terminate=True, signal="SIGKILL"),
        "REVOKED",
    )
    assert "released loop:rv-kill after revoke with terminate" in worker.log
    # The OOM killer takes the pool child: the main process sees a WorkerLostError, after
    # up to Celery's worker_lost_wait (10 s) spent waiting for a result the child may have
    # sent before it died.
    run_and_end("oom", lambda _, child: os.kill(child, signal.SIGKILL), "FAILURE", within=13)
    assert "released loop:oom after WorkerLostError" in worker.log
    assert not any(e["event"] == "exit" for e in proj_env.events())


@pytest.mark.chaos
def test_a_killed_worker_lock_frees_within_lock_ttl_and_another_worker_runs_the_job(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    # With the Redis broker an unacknowledged (acks_late) message comes back only after the
    # transport's visibility timeout, swept by a live worker: both made short here, so the
    # surviving worker gets the very message the killed one was running (not a new publish).
    conf = {
        "broker_transport_options": {
            "visibility_timeout": 2,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 2,
        }
    }
    workers = {w.nodename: w for w in (spawn_worker("a", conf=conf), spawn_worker("b", conf=conf))}
    crashy = proj_env.client_app().tasks[CRASHY]  # lock_ttl=3, acks_late
    lock = _lock_names("crash:k")[0]

    job = crashy.delay("k", 30)
    [first] = wait_for(lambda: _entered(proj_env, job.id), timeout=15, message="job started")
    victim = workers.pop(first["host"])
    [survivor] = workers.values()
    victim.kill()  # SIGKILL of the main process and its children, mid-task
    killed_at = time.monotonic_ns()
    # Nobody released it: only its TTL frees it. A run elsewhere needs a quorum (2 of 3)
    # of masters where the key expired, so not before the second-earliest expiry.
    remaining = []
    for server in proj_env.masters:
        with server.client() as conn:
            remaining.append(conn.pttl(lock))
    assert all(0 < ms <= 3000 for ms in remaining), remaining
    expired_at = killed_at + sorted(remaining)[1] * 1_000_000

    reruns = wait_for(
        lambda: _entered(proj_env, job.id)[1:], timeout=20, message="job ran again elsewhere"
    )
    proj_env.stop_loop("k")
    assert job.get(timeout=20) == "k"

    [rerun] = reruns
    assert rerun["host"] == survivor.nodename
    assert rerun["t"] >= expired_at - 50_000_000  # 50 ms for reading the TTLs one by one
    # Within lock_ttl (3 s), plus the broker's redelivery (visibility 2 s, sweep 1 s), plus
    # slack for a loaded machine; the default lock_ttl would be 30 s.
    assert (rerun["t"] - killed_at) / 1e9 < 3 + 2 + 1 + 3


@pytest.mark.chaos
def test_with_two_of_three_masters_down_nothing_runs_until_they_return(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    worker = spawn_worker("a")
    quick = proj_env.client_app().tasks[QUICK]
    proj_env.masters[1].kill()
    proj_env.masters[2].kill()

    job = quick.delay("o")  # published without dedupe (warned), see test_dedupe
    wait_for(
        lambda: worker.log.count("lock service unavailable for quick:o") >= 3,
        timeout=15,
        message="three outage reschedules",
    )
    wait_for(lambda: job.state == "RETRY", timeout=5, message="RETRY stored")
    assert _entered(proj_env, job.id) == []  # never run unguarded

    proj_env.masters[1].start()
    proj_env.masters[2].start()
    assert job.get(timeout=20) == "o"
    assert len(_entered(proj_env, job.id)) == 1

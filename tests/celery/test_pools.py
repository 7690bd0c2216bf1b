"""The pool matrix: the same scenarios on every Celery pool, each a real `celery worker -P
<pool>` subprocess (docs/configuration.rst, "Pools", is the table these tests back).

Per pool: runs of one key never overlap and jobs of another key run beside them; a body
longer than its lock TTL keeps its lock by renewal; the body's own ``time.sleep`` keeps its
length (eventlet cut it short once); contention reschedules (pools running two jobs at once);
a lost lock with ``on_lock_lost="log"`` reads as not held and is signalled; a revoked run
and the next run of its key never overlap. ``on_lock_lost="interrupt"`` per pool is in
test_worker_kills.py; enqueue dedupe happens in the publisher, whatever the pool.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from celery_redlock.testing import wait_for

from .redlock_proj.project import SLEEPER, WATCHER
from .redlock_testkit import ProjEnv

pytestmark = [pytest.mark.timeout(150), pytest.mark.slow]

POOLS = ["prefork", "threads", "solo", "gevent", "eventlet"]


def _spans(env: ProjEnv, task_ids: set[str]) -> dict[str, tuple[int, int]]:
    events = [e for e in env.events() if e["task_id"] in task_ids]
    enters = {e["task_id"]: e["t"] for e in events if e["event"] == "enter"}
    exits = {e["task_id"]: e["t"] for e in events if e["event"] == "exit"}
    return {tid: (enters[tid], exits[tid]) for tid in enters if tid in exits}


def _assert_disjoint(spans: list[tuple[int, int]]) -> None:
    for (_, first_exit), (second_enter, _) in itertools.pairwise(sorted(spans)):
        assert second_enter >= first_exit, "two runs of one key overlapped"


def _delete_lock(env: ProjEnv, key: str) -> None:
    for server in env.masters:
        with server.client() as conn:
            conn.delete(f"redlock:{{{key}}}", f"redlock:{{{key}}}:meta")


@pytest.mark.parametrize("pool", POOLS)
def test_every_pool_keeps_runs_apart_renews_and_reports_a_loss(
    proj_env: ProjEnv, spawn_worker: Any, pool: str
) -> None:
    spawn_worker(f"pool-{pool}", pool=pool)
    app = proj_env.client_app()
    sleeper, watcher = app.tasks[SLEEPER], app.tasks[WATCHER]

    # Four jobs of key k and two of key j, published at once; each body (1.5 s of 0.25 s
    # sleeps) outlives its 1 s lock TTL.
    jobs = {
        "k": [sleeper.delay("k") for _ in range(4)],
        "j": [sleeper.delay("j") for _ in range(2)],
    }
    for results in jobs.values():
        for result in results:
            took = result.get(timeout=60)
            assert len(took) == 6
            assert min(took) >= 0.24, f"time.sleep(0.25) returned early under {pool}: {took}"
    for results in jobs.values():
        spans = _spans(proj_env, {r.id for r in results})
        assert len(spans) == len(results)
        _assert_disjoint(list(spans.values()))
    k_spans = _spans(proj_env, {r.id for r in jobs["k"]})
    j_spans = _spans(proj_env, {r.id for r in jobs["j"]})
    contended = [s for s in proj_env.signals("lock_contended") if s["key"] == "sleeper:k"]
    if pool != "solo":  # solo runs one job at a time: the others wait in the queue
        assert contended, "no contention reschedule with four jobs of one key"
        first_k, last_k = min(v[0] for v in k_spans.values()), max(v[1] for v in k_spans.values())
        assert any(first_k < enter < last_k for enter, _ in j_spans.values()), (
            "jobs of another key did not run beside key k"
        )

    # A lost lock with on_lock_lost="log": the lease reads as not held, lock_lost is sent.
    watched = watcher.delay("w")
    wait_for(
        lambda: any(e["task_id"] == watched.id for e in proj_env.events()),
        timeout=20,
        message="the watcher started",
    )
    _delete_lock(proj_env, "watcher:w")
    assert watched.get(timeout=20) is False
    lost = [s for s in proj_env.signals("lock_lost") if s["task_id"] == watched.id]
    assert len(lost) == 1
    assert lost[0]["policy"] == "log"

    # A revoked run and the next run of its key never overlap (pools that cannot
    # terminate a run let it end; its lock is released when it does).
    revoked = watcher.delay("r", 3)
    wait_for(
        lambda: any(e["task_id"] == revoked.id for e in proj_env.events()),
        timeout=20,
        message="the run to revoke started",
    )
    app.control.revoke(revoked.id, terminate=True)
    after = watcher.delay("r", 0.5)
    assert after.get(timeout=40) is True
    spans = _spans(proj_env, {revoked.id, after.id})
    assert after.id in spans
    if revoked.id in spans:
        _assert_disjoint(list(spans.values()))
    else:  # terminated: the next run started after the revoke, and no exit was recorded
        assert spans[after.id][0] > min(
            e["t"] for e in proj_env.events() if e["task_id"] == revoked.id
        )

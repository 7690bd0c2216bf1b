"""What a hostile review of the worker run path found, each with a real `celery worker`.

- A job revoked while another job held its key (it was queued, or waiting in contention
  reschedules) kept its dedupe marker: every identical publish for the next hour returned
  the revoked job, whose body never ran.
- A prefork run with a hard time limit stopped renewing at the limit, while the main
  process kills it only when its timer fires: with the main process late (a stall, CPU
  starvation), the body outlived its lock and another worker's run of the key overlapped.
- A worker started with a custom node name (``-n a@myservice``) never freed the lock of a
  run killed with its pool process: the main process compared the node name's host part
  with the machine's host name.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from celery_redlock.lock.scripts import CLAIMED_BY
from celery_redlock.testing import wait_for

from .redlock_proj.project import LIMITED, LOOP, LOOPQ
from .redlock_testkit import ProjEnv

pytestmark = [pytest.mark.timeout(90), pytest.mark.slow]


def _entered(env: ProjEnv, task_id: str) -> bool:
    return any(e["task_id"] == task_id and e["event"] == "enter" for e in env.events())


def _locked(env: ProjEnv, key: str) -> bool:
    found = 0
    for server in env.masters:
        with server.client() as conn:
            found += bool(conn.exists(f"redlock:{{{key}}}"))
    return found >= 2


def _markers(env: ProjEnv) -> list[bytes]:
    found: list[bytes] = []
    for server in env.masters:
        with server.client() as conn:
            found.extend(
                n  # not the markers' writer ids: they stay a claim call's time
                for n in conn.scan_iter(match="redlock:*dedupe*")
                if not n.decode().endswith(CLAIMED_BY)
            )
    return found


def test_a_job_revoked_while_another_holds_its_key_leaves_no_marker(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    spawn_worker("a", "-P", "threads")
    app = proj_env.client_app()
    loopq = app.tasks[LOOPQ]
    holder = loopq.delay("k", 30)
    wait_for(lambda: _entered(proj_env, holder.id), timeout=20, message="the holder started")
    waiting = loopq.delay("k", 30)  # a new job (the holder's marker went when it started)
    assert waiting.id != holder.id
    wait_for(
        lambda: any(s["task_id"] == waiting.id for s in proj_env.signals("lock_contended")),
        timeout=20,
        message="the second job met the lock",
    )
    app.control.revoke(waiting.id)
    # The holder still runs when the worker discards the revoked job: its marker goes.
    wait_for(lambda: not _markers(proj_env), timeout=15, message="the revoked job's marker gone")
    assert not holder.ready()
    proj_env.stop_loop("k")
    assert holder.get(timeout=30) == "k"
    again = loopq.delay("k", 30)
    assert again.id != waiting.id, "a new publish returned the revoked job"
    assert again.get(timeout=30) == "k"


def test_a_worker_with_a_custom_node_name_frees_a_killed_runs_lock(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    worker = spawn_worker("a", "-n", "custom@not-this-machine")
    app = proj_env.client_app()
    job = app.tasks[LOOP].delay("n", 60)
    wait_for(lambda: _entered(proj_env, job.id), timeout=20, message="the job started")
    [enter] = [e for e in proj_env.events() if e["task_id"] == job.id]
    assert enter["host"] == "custom@not-this-machine"
    os.kill(enter["pid"], signal.SIGKILL)
    # Default lock_ttl is 30 s: only the main process's release frees it this soon (the
    # pool notices a dead child within a few seconds).
    wait_for(lambda: not _locked(proj_env, "loop:n"), timeout=15, message="lock freed")
    # Logged once the release returned: the masters can show the lock free first.
    wait_for(lambda: "released loop:n" in worker.log, timeout=5, message="release logged")


def test_a_hard_time_limit_never_lets_the_body_outlive_its_lock(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    """lock_ttl 1 s, time_limit 3 s; the worker's main process (which kills the run at the
    limit) is stopped for 1.5 s around the limit, while its pool child runs on. Another
    worker's run of the key must not start before the first body stopped."""
    slow_main = spawn_worker("a", "-c", "1")
    other_queue = f"{proj_env.queue}-b"  # so that the stopped worker cannot prefetch it
    spawn_worker("b", "-c", "1", "-Q", other_queue)
    app = proj_env.client_app()
    limited = app.tasks[LIMITED]
    first = limited.apply_async(("tl", 10), time_limit=3)
    wait_for(lambda: _entered(proj_env, first.id), timeout=20, message="the first run started")
    entered = time.monotonic()
    second = limited.apply_async(("tl", 0.3), queue=other_queue)
    time.sleep(max(0.0, entered + 2.5 - time.monotonic()))  # just before the limit
    os.kill(slow_main.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.5)
    finally:
        os.kill(slow_main.proc.pid, signal.SIGCONT)
    assert second.get(timeout=40) == "tl"
    events = proj_env.events()
    last_alive = max(e["t"] for e in events if e["task_id"] == first.id and e["event"] == "alive")
    [second_enter] = [e["t"] for e in events if e["task_id"] == second.id and e["event"] == "enter"]
    assert second_enter > last_alive, (
        f"the second run started {(last_alive - second_enter) / 1e6:.0f} ms before the "
        "time-limited body stopped"
    )

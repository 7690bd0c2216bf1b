"""Real `celery worker` processes (prefork pool, 2 children) where fork, signals and kills
matter: time limits, revoke with terminate, a lost lock interrupting a body, a worker killed
mid-task, masters going away.

Each worker is ``python -m celery -A redlock_proj.celery_app worker -P prefork -c 2`` in its
own process group, on a harness Redis broker and on RabbitMQ (every test runs on both, with
a task queue of its own); the tasks live in ``redlock_proj/project.py`` and record
``enter``/``exit`` events (with ``time.monotonic_ns()``, the node name and pid) in a Redis
list, and the workers record celery-redlock's signals in another. Every process group is
SIGTERMed, then SIGKILLed, after the test.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

from celery_redlock import LockLostInterrupt
from celery_redlock.testing import process_running, wait_for

from .redlock_proj.project import CRASHY, LOOP, QUICK, QUICK_CAPPED, QUICK_RAISE, QUICK_SKIP, SWEEP
from .redlock_testkit import BROKERS, ProjEnv

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.slow,
    pytest.mark.parametrize("proj_env", BROKERS, indirect=True),
]


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
    return _events_of(env, task_id, "enter")


def _events_of(env: ProjEnv, task_id: str, event: str) -> list[dict[str, Any]]:
    return [e for e in env.events() if e["task_id"] == task_id and e["event"] == event]


def _wait_for_log(worker: Any, text: str) -> None:
    wait_for(lambda: text in worker.log, timeout=5, message=f"{text!r} in the worker log")


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
    # The limit runs from the pool's start of the job, a few ms before the body's first
    # line records its entry (CI: 0.992 s between the two entries).
    assert 0.9 <= waited < 5
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
    # The main process releases it once the killed pool process has exited (renewal went
    # on until the kill).
    wait_for(
        lambda: any(
            "loop:hard" in line and "after TimeLimitExceeded" in line
            for line in worker.log.splitlines()
        ),
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
    # The line is logged once the release returned: the masters can show it free first.
    _wait_for_log(worker, "released loop:rv-kill after revoke with terminate")
    # The OOM killer takes the pool child: the main process sees a WorkerLostError, after
    # up to Celery's worker_lost_wait (10 s) spent waiting for a result the child may have
    # sent before it died.
    run_and_end("oom", lambda _, child: os.kill(child, signal.SIGKILL), "FAILURE", within=13)
    _wait_for_log(worker, "released loop:oom after WorkerLostError")
    assert not any(e["event"] == "exit" for e in proj_env.events())


def test_interrupt_stops_a_body_whose_lock_was_lost_and_the_pool_child_runs_on(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    # One pool child, so that the next job provably runs in the child that was interrupted.
    worker = spawn_worker("a", "-c", "1")
    app = proj_env.client_app()
    lock, meta = _lock_names("sweep:s")

    renew_every = 3 / 3  # sweep's lock_ttl is 3 s; its body would run for 30 s
    job = app.tasks[SWEEP].delay("s", 30)
    [enter] = wait_for(lambda: _entered(proj_env, job.id), timeout=15, message="job started")
    wait_for(lambda: all(_on_masters(proj_env, meta)), timeout=5, message="lock and metadata")
    assert all(_on_masters(proj_env, lock))
    owner = _meta(proj_env, "sweep:s")
    assert owner["task_id"] == job.id
    child = int(owner["pid"])
    assert enter["pid"] == child

    # An operator (or an expiry) takes the lock away on every master.
    for server in proj_env.masters:
        with server.client() as conn:
            conn.delete(lock, meta)
    lost_at = time.monotonic_ns()

    # Noticed at the next renewal, long before the body's 30 s are up.
    with pytest.raises(LockLostInterrupt):
        job.get(timeout=renew_every + 5)
    [interrupted] = _events_of(proj_env, job.id, "interrupted")
    assert interrupted["pid"] == child
    assert (interrupted["t"] - lost_at) / 1e9 < renew_every + 2
    assert _events_of(proj_env, job.id, "exit") == []
    assert job.state == "FAILURE"
    assert isinstance(job.result, LockLostInterrupt)

    [lost] = wait_for(
        lambda: [s for s in proj_env.signals("lock_lost") if s["task_id"] == job.id],
        timeout=5,
        message="lock_lost recorded",
    )
    assert lost["key"] == "sweep:s"
    assert lost["policy"] == "interrupt"
    assert lost["pid"] == child
    assert lost["t"] <= interrupted["t"]
    # Nothing renewed or re-created the lock after the loss.
    assert not any(_on_masters(proj_env, lock))
    assert not any(_on_masters(proj_env, meta))

    # The worker did not lose its child: the same process takes the next job and runs it.
    assert process_running(child)
    quick = app.tasks[QUICK].delay("after")
    assert quick.get(timeout=15) == "after"
    [quick_enter] = _entered(proj_env, quick.id)
    assert quick_enter["pid"] == child
    assert len(_events_of(proj_env, quick.id, "exit")) == 1
    wait_for(
        lambda: not any(_on_masters(proj_env, _lock_names("quick:after")[0])),
        timeout=5,
        message="quick job's lock released",
    )
    log = worker.log
    assert "WorkerLostError" not in log
    assert "lock sweep:s lost while running" in log


@pytest.mark.chaos
def test_a_killed_worker_lock_frees_within_lock_ttl_and_another_worker_runs_the_job(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    if proj_env.kind == "redis":
        # With the Redis broker an unacknowledged (acks_late) message comes back only after
        # the transport's visibility timeout, swept by a live worker: both made short here,
        # so the surviving worker gets the very message the killed one was running (not a
        # new publish).
        conf: dict[str, Any] | None = {
            "broker_transport_options": {
                "visibility_timeout": 2,
                "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1,
                "unacked_mutex_expire": 2,
            }
        }
        redelivery = 2 + 1  # visibility timeout, then the sweep
    else:
        # RabbitMQ requeues a dead consumer's unacknowledged message the moment its
        # connection drops: the survivor gets it while the dead worker's lock still holds.
        conf, redelivery = None, 0
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
    # Within lock_ttl (3 s), plus the broker's redelivery, plus slack for a loaded machine;
    # the default lock_ttl would be 30 s.
    assert (rerun["t"] - killed_at) / 1e9 < 3 + redelivery + 3
    # The dead run's lock names the same task id: the redelivery is the same job, so it
    # waits for that lock without counting (or signalling) contention.
    assert [s for s in proj_env.signals("lock_contended") if s["task_id"] == job.id] == []
    if proj_env.kind == "rabbitmq":
        # Redelivered at once, the job met the dead worker's lock and was rescheduled
        # (not run, not dropped) until the lock expired.
        assert "held by an earlier run of this same job" in survivor.log


@pytest.mark.chaos
def test_with_two_of_three_masters_down_nothing_runs_until_they_return(
    proj_env: ProjEnv, spawn_worker: Any
) -> None:
    # Whatever a task does on contention (retry, skip, raise, retry at most once), an outage
    # of the lock service reschedules it with the outage backoff and does not count it as
    # contention: it is neither skipped (IGNORED), nor failed, nor given up.
    worker = spawn_worker("a")
    app = proj_env.client_app()
    down = [proj_env.masters[1], proj_env.masters[2]]
    for server in down:
        server.kill()

    keys = {QUICK: "quick", QUICK_SKIP: "skip", QUICK_RAISE: "raise", QUICK_CAPPED: "capped"}
    jobs = {}  # published without dedupe (warned), see test_dedupe
    for task_name, prefix in keys.items():
        for name in ("o1", "o2"):
            jobs[f"{prefix}:{name}"] = (app.tasks[task_name].delay(name), name)
    ids = {job.id: key for key, (job, _) in jobs.items()}

    def outages() -> dict[str, list[dict[str, Any]]]:
        sent: dict[str, list[dict[str, Any]]] = {task_id: [] for task_id in ids}
        for signal_sent in proj_env.signals("lock_unavailable"):
            sent.setdefault(signal_sent["task_id"], []).append(signal_sent)
        return sent

    # Three outage reschedules each: more than quick_capped's max_contention_retries=1.
    wait_for(
        lambda: all(len(sent) >= 3 for sent in outages().values()),
        timeout=30,
        message="three outage reschedules of every job",
    )
    wait_for(
        lambda: all(job.state == "RETRY" for job, _ in jobs.values()),
        timeout=5,
        message="RETRY stored for every job",
    )
    assert not any(e["event"] == "enter" for e in proj_env.events())  # never run unguarded
    assert proj_env.signals("lock_contended") == []
    dead_ports = {str(server.port) for server in down}
    for task_id, sent in outages().items():
        assert {s["key"] for s in sent} == {ids[task_id]}
        for signal_sent in sent:
            assert 0 <= signal_sent["countdown"] <= 0.6  # redlock_outage_backoff=(0.3, 0.6)
            named = {port for port in dead_ports for m in signal_sent["errors"] if port in m}
            assert named == dead_ports, signal_sent["errors"]
    log = worker.log
    for key in jobs:
        assert f"lock service unavailable for {key}" in log
    assert "is held elsewhere" not in log

    for server in down:
        server.start()
    for key, (job, name) in jobs.items():
        assert job.get(timeout=30) == name, key
    entered = [e["task_id"] for e in proj_env.events() if e["event"] == "enter"]
    assert sorted(entered) == sorted(ids)  # each body ran, and once
    assert {job.state for job, _ in jobs.values()} == {"SUCCESS"}
    assert proj_env.signals("lock_contended") == []

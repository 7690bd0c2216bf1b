"""Beat never double-fires (DESIGN.md, semantics 8), with real beats, workers and masters.

Every test runs ``celery beat`` / ``celery worker`` subprocesses of ``proj.app`` (see
``proj/app.py``) against three harness masters and a harness broker. Task bodies append
one JSON line per run to a file, carrying the ``redlock_occurrence`` header and which beat
sent the message when; the assertions read those lines: an occurrence id twice is a
double fire, a gap in an interval entry's indexes a missed occurrence.

Timing slack: the machine may be loaded (two cores, other test suites), so bounds on
failover times carry a fixed slack on top of what the design promises, and waits poll
against deadlines.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import math
import os
import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery import signals as celery_signals
from celery.beat import Service

import celery_redlock
from celery_redlock import Redlock
from celery_redlock import signals as redlock_signals
from celery_redlock.beat import anchor_key, is_duplicate_occurrence, occurrence_key
from celery_redlock.keys import redis_key
from celery_redlock.testing import Masters, RedisServer, wait_for

from .proj.cluster import Cluster, interval_counts, occurrence_problems

#: Lease TTL of the beats in most tests; the standby polls every min(1, ttl/10) seconds.
TTL = 3.0
POLL = min(1.0, TTL / 10)
#: The new leader sends when its scheduler next wakes for a due entry: up to one interval.
INTERVAL = 1.0
#: What a loaded two-core machine adds (process scheduling, Python start-up of nothing:
#: beats are running already).
SLACK = 2.0

INTERVALS = ("every-a", "every-b")
#: Two interval entries at 1 s: 30 s of running gives 60 interval occurrences.
SCHEDULE: dict[str, float | str] = {"every-a": INTERVAL, "every-b": INTERVAL}

LEADER_LINE = r"leader election on \[.*127\.0\.0\.1.*\] \(quorum 2\): LEADER"
STANDBY_LINE = r"leader election on \[.*127\.0\.0\.1.*\] \(quorum 2\): standby"


def now() -> float:
    return time.time()  # noqa: TID251 - compared with the wall times other processes record


def observe(seconds: float) -> None:
    """Let time pass on purpose: the assertion is about what does *not* happen meanwhile."""
    time.sleep(seconds)


def at_least(
    cluster: Cluster, per_entry: int, *, sent_after: float = 0.0, by: str | None = None
) -> Callable[[list[dict[str, Any]]], bool]:
    def enough(runs: list[dict[str, Any]]) -> bool:
        chosen = [
            r
            for r in runs
            if (r.get("sent_at") or 0) > sent_after and (by is None or r.get("sender") == by)
        ]
        counts = interval_counts(
            chosen, [n for n, v in cluster.schedule.items() if not isinstance(v, str)]
        )
        return bool(counts) and min(counts.values()) >= per_entry

    return enough


def assert_once_each(runs: list[dict[str, Any]], entries: tuple[str, ...] = INTERVALS) -> None:
    problems = occurrence_problems(runs, entries)
    assert not problems, "\n".join(problems)


def start_pair(cluster: Cluster, *names: str) -> list[Any]:
    """Start beats one after the other: the first leads, the others stand by."""
    procs = []
    for i, name in enumerate(names):
        proc = cluster.beat(name)
        proc.wait_log(LEADER_LINE if i == 0 else STANDBY_LINE, timeout=60)
        procs.append(proc)
    return procs


def slot_lateness(
    cluster: Cluster, runs: list[dict[str, Any]], name: str
) -> dict[str, tuple[float, dict[str, Any]]]:
    """Occurrence id -> (seconds its message was sent after its slot, the run)."""
    key = redis_key("redlock", anchor_key("beatproj", name), f"anchor:{INTERVAL:g}")
    with cluster.masters_servers[0].client() as conn:  # type: ignore[attr-defined]
        anchor = float(conn.get(key))
    out = {}
    for run in runs:
        if run["kind"] == name:
            index = int(run["occurrence"].rpartition("#")[2])
            out[run["occurrence"]] = (run["sent_at"] - (anchor + index * INTERVAL), run)
    return out


def minute_id(name: str, minute: float) -> str:
    return f"{name}@{dt.datetime.fromtimestamp(minute, dt.timezone.utc):%Y-%m-%dT%H:%MZ}"


# --------------------------------------------------------------------------------------------
# Several beats, no faults
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_beats_fire_every_occurrence_once(cluster_factory: Callable[..., Cluster]) -> None:
    """Two beats, two 1 s interval entries and an every-minute crontab entry.

    Runs until each interval entry ran 30 times (60 interval occurrences in all: two
    entries in parallel keep the test at ~30 s instead of 60) and a crontab occurrence ran;
    then every occurrence ran exactly once, indexes contiguous, all sent by the leader.
    """
    cluster = cluster_factory(lease_ttl=TTL, schedule={**SCHEDULE, "minutely": "*"})
    cluster.worker()
    started = now()
    beat_a, _ = start_pair(cluster, "beat-a", "beat-b")

    def done(runs: list[dict[str, Any]]) -> bool:
        counts = interval_counts(runs, INTERVALS)
        return min(counts.values()) >= 30 and any(r["kind"] == "minutely" for r in runs)

    cluster.wait_runs(done, timeout=150, what="60 interval occurrences and a crontab one")
    for proc in cluster.procs[1:]:
        proc.kill()
    ended = now()
    runs = cluster.drain()

    assert_once_each(runs)
    assert sum(interval_counts(runs, INTERVALS).values()) >= 60
    assert {r["sender"] for r in runs} == {"beat-a"}, "only the leader sends"
    # Every minute boundary the beats lived through fired once (the first one may come
    # before the schedule is loaded, the last may be cut off by the kill).
    minutely = sorted(r["occurrence"] for r in runs if r["kind"] == "minutely")
    first = math.ceil((started + 5) / 60) * 60
    expected = [minute_id("minutely", m) for m in range(first, int(ended) - 5, 60)]
    assert set(expected) <= set(minutely), (expected, minutely)
    assert beat_a.log_times("Sending due task")
    assert not cluster.procs[2].log_times("Sending due task"), "the standby sent something"


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(240)
def test_three_beats_leader_sigkill_failover(cluster_factory: Callable[..., Cluster]) -> None:
    """Three beats; the leader is SIGKILLed after 10 occurrences per entry.

    A standby takes over within lease TTL + poll (its beat_status record), sends within
    that plus one interval (its scheduler's next wake-up) plus slack, and over the 60+
    interval occurrences of the run none is lost or doubled across the failover.
    """
    cluster = cluster_factory(lease_ttl=TTL, schedule=SCHEDULE)
    cluster.worker()
    start_pair(cluster, "beat-a", "beat-b", "beat-c")
    cluster.wait_runs(at_least(cluster, 10), timeout=60, what="10 runs per entry")

    leader = cluster.leader()
    assert leader == "beat-a"
    killed = next(p for p in cluster.procs if p.name == leader)
    killed_at = killed.kill()
    runs = cluster.wait_runs(
        at_least(cluster, 30), timeout=90, what="30 runs per entry, across the failover"
    )
    for proc in cluster.procs[1:]:
        proc.kill()
    runs = cluster.drain()

    assert_once_each(runs)
    assert sum(interval_counts(runs, INTERVALS).values()) >= 60
    took_over = [
        r for r in cluster.records("beat_status") if r["status"] == "leader" and r["t"] > killed_at
    ]
    assert took_over, "no standby took over"
    assert len({r["name"] for r in took_over}) == 1, f"leadership flapped: {took_over}"
    new_leader = took_over[0]["name"]
    takeover = took_over[0]["t"] - killed_at
    first_send = (
        min(r["sent_at"] for r in runs if r["sender"] == new_leader and r["sent_at"] > killed_at)
        - killed_at
    )
    print(f"\nfailover: leadership after {takeover:.2f} s, first send after {first_send:.2f} s")  # noqa: T201 - the measured figure, shown with -s
    assert takeover <= TTL + POLL + SLACK, f"takeover took {takeover:.2f} s"
    assert first_send <= TTL + POLL + INTERVAL + SLACK, f"first send after {first_send:.2f} s"
    assert not [r for r in runs if r["sender"] == leader and r["sent_at"] > killed_at]

    # The schedule is the anchor's, not each beat's: no occurrence is sent before its slot
    # (anchor + index x interval), and once the new leader has settled (its first send
    # after the takeover may be late by its own phase), it sends right after each slot.
    for name in INTERVALS:
        lateness = slot_lateness(cluster, runs, name)
        early = {o: round(late, 3) for o, (late, _) in lateness.items() if late < -0.05}
        assert not early, f"sent before their slot: {early}"
        settled = sorted(
            late
            for late, r in lateness.values()
            if r["sender"] == new_leader and r["sent_at"] > killed_at + first_send + 2
        )
        assert settled, f"{name}: nothing sent by the settled new leader"
        # Settled sends come a few ms after their slot; a beat on its own phase would be
        # off by its start-up offset (anywhere in [0, 1) s) and drift ~10 ms per tick.
        assert settled[len(settled) // 2] < 0.15, f"{name}: off the anchor by {settled}"


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(240)
def test_crontab_occurrence_due_during_a_takeover_is_sent_once(
    cluster_factory: Callable[..., Cluster],
) -> None:
    """The leader is SIGKILLed about 1 s before a minute boundary of an every-minute crontab.

    That occurrence falls due while the old leader is dead and the standby still waits for
    its lease to run out (lease TTL 3 s), so the standby's scheduler passes it by. After
    the takeover the new leader must send it (late, once), not skip to the next minute.
    """
    cluster = cluster_factory(lease_ttl=TTL, schedule={"every-a": INTERVAL, "minutely": "*"})
    cluster.worker()
    start_pair(cluster, "beat-a", "beat-b")
    cluster.wait_runs(at_least(cluster, 3), timeout=60, what="the leader sending")
    # Kill at :58.8-:59.3 of a minute (at most a minute from now), by polling the wall clock.
    wait_for(lambda: 58.8 <= now() % 60 < 59.3, timeout=65, interval=0.02)
    assert cluster.procs[1].name == "beat-a"
    killed_at = cluster.procs[1].kill()
    boundary = math.ceil(killed_at / 60) * 60
    wanted = minute_id("minutely", boundary)
    cluster.wait_runs(
        lambda runs: any(r["occurrence"] == wanted for r in runs),
        timeout=30,
        what=f"{wanted}, due {boundary - killed_at:.1f} s after the leader's kill",
    )
    cluster.procs[2].kill()
    runs = cluster.drain()

    assert_once_each(runs, ("every-a",))
    [sent] = [r for r in runs if r["occurrence"] == wanted]
    assert sent["sender"] == "beat-b"
    took_over = [
        r for r in cluster.records("beat_status") if r["status"] == "leader" and r["t"] > killed_at
    ]
    assert took_over, "no standby took over"
    assert took_over[0]["t"] > boundary, (
        "the standby led before the boundary: this run did not test a passed occurrence"
    )
    assert cluster.procs[2].log_times("sending .*minutely.* late")


# --------------------------------------------------------------------------------------------
# A paused leader
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(180)
def test_paused_leader_sends_nothing_after_resume(cluster_factory: Callable[..., Cluster]) -> None:
    """SIGSTOP the leader past its lease TTL, then SIGCONT: it goes standby and sends nothing."""
    ttl = 2.0
    cluster = cluster_factory(lease_ttl=ttl, schedule={"every-a": INTERVAL})
    cluster.worker()
    beat_a, _ = start_pair(cluster, "beat-a", "beat-b")
    runs = cluster.wait_runs(at_least(cluster, 3), timeout=60, what="3 runs")
    # Pause right after a send, so the pause does not cut one between claim and publish.
    seen = len(runs)
    cluster.wait_runs(lambda r: len(r) > seen, timeout=10, what="a fresh run")
    paused_at = beat_a.pause()
    cluster.wait_runs(
        at_least(cluster, 2, sent_after=paused_at, by="beat-b"),
        timeout=ttl + POLL + INTERVAL + SLACK + 10,
        what="beat-b sending while beat-a is paused",
    )
    wait_for(lambda: now() > paused_at + ttl + 2, timeout=30)  # paused well past the TTL
    log_offset = beat_a.log_size()
    resumed_at = beat_a.resume()
    beat_a.wait_log(r"beat: leader -> standby", since=log_offset, timeout=10)
    cluster.wait_runs(
        at_least(cluster, 4, sent_after=resumed_at, by="beat-b"),
        timeout=30,
        what="4 more sends by beat-b after beat-a resumed",
    )
    for proc in cluster.procs[1:]:
        proc.kill()
    runs = cluster.drain()

    assert_once_each(runs, ("every-a",))
    late = [r for r in runs if r["sender"] == "beat-a" and r["sent_at"] > resumed_at]
    assert not late, f"the resumed beat sent {late}"
    assert not re.search("Sending due task", beat_a.log(log_offset)), beat_a.log(log_offset)


# --------------------------------------------------------------------------------------------
# Masters down
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(180)
def test_masters_minority_down_keeps_going_majority_down_stops(
    cluster_factory: Callable[..., Cluster], master_factory: Callable[..., RedisServer]
) -> None:
    """Kill 1 of 3 masters: beat keeps sending. Kill a second: nothing is sent. Restart
    both (AOF: they come back with their claims): beat sends again, nothing twice."""
    ttl = 2.0
    servers = Masters(master_factory(persistence="aof") for _ in range(3))
    cluster = cluster_factory(lease_ttl=ttl, masters=servers, schedule={"every-a": INTERVAL})
    cluster.worker()
    start_pair(cluster, "beat-a", "beat-b")
    cluster.wait_runs(at_least(cluster, 3), timeout=60, what="3 runs")

    servers[0].kill()
    minority_at = now()
    cluster.wait_runs(
        at_least(cluster, 4, sent_after=minority_at),
        timeout=4 + TTL + SLACK + 10,
        what="4 sends with one master down",
    )

    servers[1].kill()
    majority_at = now()
    observe(ttl + 3)  # longer than the leader lease: nobody may lead or send now
    restarted_at = now()
    servers[0].start()
    servers[1].start()
    cluster.wait_runs(
        at_least(cluster, 3, sent_after=restarted_at),
        timeout=30,
        what="3 sends after the masters came back",
    )
    for proc in cluster.procs[1:]:
        proc.kill()
    runs = cluster.drain()

    problems = occurrence_problems(runs, ())  # no doubles; gaps are the outage
    assert not problems, "\n".join(problems)
    # A claim that got its quorum just before the kill may still be published (slack).
    while_down = [r for r in runs if majority_at + 1.0 < r["sent_at"] < restarted_at]
    assert not while_down, f"sent without a quorum: {while_down}"
    resumed = min(r["sent_at"] for r in runs if r["sent_at"] > restarted_at) - restarted_at
    print(f"\nfirst send {resumed:.2f} s after the masters came back")  # noqa: T201 - shown with -s


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(120)
def test_short_majority_pause_loses_no_occurrence(cluster_factory: Callable[..., Cluster]) -> None:
    """Two of three masters paused for 1.5 s (claims time out, shorter than the lease):
    the occurrences whose claims failed are sent late, none is lost or doubled."""
    cluster = cluster_factory(lease_ttl=TTL, schedule=SCHEDULE)
    cluster.worker()
    start_pair(cluster, "beat-a", "beat-b")
    cluster.wait_runs(at_least(cluster, 4), timeout=60, what="4 runs per entry")
    masters = cluster.masters_servers  # type: ignore[attr-defined]
    paused_at = now()
    for server in masters[:2]:
        server.pause()
    observe(1.5)
    for server in masters[:2]:
        server.resume()
    cluster.wait_runs(
        at_least(cluster, 4, sent_after=paused_at + 1.5), timeout=30, what="4 runs after"
    )
    for proc in cluster.procs[1:]:
        proc.kill()
    runs = cluster.drain()
    assert_once_each(runs)
    logs = "".join(p.log() for p in cluster.procs[1:])
    assert "not sending" in logs, "no claim failed: the pause tested nothing"


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


@pytest.fixture
def publisher(broker: RedisServer) -> Iterator[Celery]:
    """An app that only publishes to (and reads results from) the tests' broker."""
    app = Celery("publisher", broker=broker.url, backend=broker.url, set_as_current=False)
    yield app
    app.close()


def _send(app: Celery, name: str, kind: str, occurrence: str | None = None, **kwargs: Any) -> str:
    task_id = str(uuid.uuid4())
    headers = {"redlock_occurrence": occurrence} if occurrence else {}
    app.send_task(name, kwargs={"kind": kind, **kwargs}, task_id=task_id, headers=headers)
    return task_id


def _idle_broker(cluster: Cluster) -> bool:
    with cluster.broker() as conn:
        return not conn.llen("celery") and not conn.hlen("unacked")


@pytest.mark.timeout(120)
def test_worker_drops_a_second_message_of_an_occurrence(
    cluster_factory: Callable[..., Cluster], publisher: Celery
) -> None:
    """Same occurrence header, two task ids: the body runs once; the duplicate is acked
    (nothing left in the queue or unacked) and not rescheduled. A plain task sent by name
    and a SingletonTask alike."""
    cluster = cluster_factory()
    worker = cluster.worker()
    worker.wait_log(r"ready\.", timeout=60)
    for name, kind in (("proj.app.tick", "plain"), ("proj.app.single", "singleton")):
        occurrence = f"manual-{kind}#1"
        first = _send(publisher, name, kind, occurrence)
        cluster.wait_runs(lambda r, k=kind: any(x["kind"] == k for x in r), 30, f"{kind} run")
        second = _send(publisher, name, kind, occurrence)
        worker.wait_log(
            rf"\[{second}\]: beat occurrence {re.escape(occurrence)} already ran; dropped"
        )
    wait_for(lambda: _idle_broker(cluster), timeout=10, message="broker queue not empty")
    observe(2.0)  # a rescheduled duplicate would run within this
    runs = cluster.runs()
    assert sorted(r["kind"] for r in runs) == ["plain", "singleton"], runs
    assert _idle_broker(cluster)
    assert publisher.AsyncResult(first).state == "SUCCESS"


@pytest.mark.timeout(120)
def test_beat_occurrence_of_a_held_singleton_is_skipped(
    cluster_factory: Callable[..., Cluster], publisher: Celery
) -> None:
    """A beat occurrence of a SingletonTask whose previous run holds the key is skipped:
    state FAILURE (LockContended, skip_result's default), never rescheduled, never run."""
    cluster = cluster_factory()
    worker = cluster.worker(concurrency=2)
    worker.wait_log(r"ready\.", timeout=60)
    _send(publisher, "proj.app.hold", "holder", seconds=3.0)
    cluster.wait_runs(lambda r: any(x["kind"] == "holder" for x in r), 30, "holder running")
    beat_id = _send(publisher, "proj.app.hold", "beat", "hold#1")
    wait_for(
        lambda: publisher.AsyncResult(beat_id).state == "FAILURE",
        timeout=30,
        message="the beat occurrence was not skipped",
    )
    worker.wait_log(rf"\[{beat_id}\]: .*held.* is held elsewhere; skipped")
    wait_for(lambda: _idle_broker(cluster), timeout=15, message="broker queue not empty")
    observe(2.0)
    assert [r["kind"] for r in cluster.runs()] == ["holder"]
    assert "rescheduled" not in worker.log()


@pytest.mark.timeout(120)
def test_retry_of_a_beat_occurrence_is_not_dropped(
    cluster_factory: Callable[..., Cluster], publisher: Celery
) -> None:
    """The task's own retry() keeps its task id and headers: it is the same job, not a
    duplicate occurrence, so it runs."""
    cluster = cluster_factory()
    worker = cluster.worker()
    worker.wait_log(r"ready\.", timeout=60)
    task_id = _send(publisher, "proj.app.flaky", "flaky", "flaky#1")
    runs = cluster.wait_runs(lambda r: len(r) >= 2, 30, "the retry running")
    assert [(r["task_id"], r["retries"]) for r in runs] == [(task_id, 0), (task_id, 1)]
    wait_for(lambda: publisher.AsyncResult(task_id).state == "SUCCESS", timeout=10)


# --------------------------------------------------------------------------------------------
# celery worker -B, and django-celery-beat
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(180)
def test_embedded_beat_and_separate_beat(cluster_factory: Callable[..., Cluster]) -> None:
    """``celery worker -B`` leads, a separate ``celery beat`` stands by; the embedded beat
    process is SIGKILLed and the separate one takes over: still once per occurrence."""
    cluster = cluster_factory(lease_ttl=TTL, schedule=SCHEDULE)
    worker = cluster.worker("worker-b", "-B")
    line = worker.wait_log(LEADER_LINE, timeout=60)
    embedded_pid = int(re.match(r"\[\S+ \w+/[^/]+/(\d+)\]", line).group(1))  # type: ignore[union-attr]
    assert embedded_pid != worker.pid, "the embedded beat runs in its own process"
    separate = cluster.beat("beat-x")
    separate.wait_log(STANDBY_LINE, timeout=60)
    cluster.wait_runs(at_least(cluster, 8, by="worker-b"), timeout=60, what="8 runs per entry")

    killed_at = now()
    os.kill(embedded_pid, signal.SIGKILL)
    cluster.wait_runs(
        at_least(cluster, 8, sent_after=killed_at, by="beat-x"),
        timeout=60,
        what="8 runs per entry sent by the separate beat",
    )
    separate.kill()
    runs = cluster.drain()
    assert_once_each(runs)
    assert {r["sender"] for r in runs} == {"worker-b", "beat-x"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_django_database_scheduler_two_beats(
    cluster_factory: Callable[..., Cluster], tmp_path: Path
) -> None:
    """django-celery-beat's DatabaseScheduler (sqlite), two beats, two 1 s IntervalSchedule
    PeriodicTasks: every occurrence once, contiguous, across a leader kill."""
    cluster = cluster_factory(lease_ttl=TTL, django_db=tmp_path / "beat.sqlite3")
    cluster.schedule = {"db-a": INTERVAL, "db-b": INTERVAL}  # what at_least() counts
    cluster.setup_django_db("db-a=1", "db-b=1")
    cluster.worker()
    beat_a, _ = start_pair(cluster, "beat-a", "beat-b")
    cluster.wait_runs(at_least(cluster, 15), timeout=90, what="15 runs per entry")
    killed_at = beat_a.kill()
    cluster.wait_runs(
        at_least(cluster, 15, sent_after=killed_at, by="beat-b"),
        timeout=90,
        what="15 runs per entry by the standby",
    )
    cluster.procs[2].kill()
    runs = cluster.drain()
    assert_once_each(runs, ("db-a", "db-b"))


# --------------------------------------------------------------------------------------------
# In-process: start-up log and the beat_status signal
# --------------------------------------------------------------------------------------------


def _beat_app(masters: Masters, lease_ttl: float = 2, **schedule: float) -> Celery:
    """An in-memory-broker app for a beat in this process; ``schedule``: entry -> seconds."""
    app = Celery("inproc-beat", broker="memory://", set_as_current=False)
    app.conf.update(
        redlock_redis_urls=masters.urls,
        redlock_beat_lease_ttl=lease_ttl,
        beat_schedule={
            name: {"task": "x.y", "schedule": every} for name, every in schedule.items()
        },
    )
    celery_redlock.install(app)
    return app


@contextlib.contextmanager
def _leading_beat(app: Celery, tmp_path: Path) -> Iterator[tuple[Service, list[tuple[str, str]]]]:
    """A beat service of ``app`` in this process, leading, and the (occurrence, task id)
    of every message it publishes (a coalesced late send: each occurrence it stands for,
    oldest first); stopped and closed on exit."""
    published: list[tuple[str, str]] = []

    def on_publish(headers: dict[str, Any] | None = None, **_: Any) -> None:
        if headers and headers.get("redlock_occurrence"):
            covers = reversed(headers.get("redlock_catch_up_of") or [])
            published.extend((covered, headers["id"]) for covered in covers)
            published.append((headers["redlock_occurrence"], headers["id"]))

    celery_signals.before_task_publish.connect(on_publish, weak=False)
    service = Service(app, schedule_filename=str(tmp_path / "schedule"))
    try:
        celery_signals.beat_init.send(sender=service)
        assert service._redlock_leader.leading
        yield service, published
    finally:
        celery_signals.before_task_publish.disconnect(on_publish)
        leader = getattr(service, "_redlock_leader", None)
        if leader is not None:
            leader.stop()
        service.scheduler.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("worker_took_it", [False, True], ids=["never-published", "ran"])
def test_takeover_resends_the_old_leaders_last_claim_only_if_no_worker_took_it(
    masters: Masters, tmp_path: Path, worker_took_it: bool
) -> None:
    """A leader killed between its claim of an occurrence and its publish leaves a claim
    and no message. The new leader's catch-up sends that occurrence again, unless a worker
    already took it (its run claim exists). It writes no run claim of its own before
    publishing (a kill there would lose the occurrence): the worker's run claim decides
    which copy runs."""
    app = _beat_app(masters, lease_ttl=3, e=1.0)
    # What the dead leader left: an anchor 10.5 s ago, "sent" claims up to #last (the
    # last one never published), run claims by workers for all but #last.
    rl = Redlock(masters.urls)
    anchor = now() - 10.5
    ns = "inproc-beat"
    rl.claim(anchor_key(ns, "e"), "anchor:1", f"{anchor:.6f}", 3600)
    last = math.floor(now() - anchor)  # the latest one due: nothing after it was missed
    for index in range(last + 1):
        rl.claim(occurrence_key(ns, f"e#{index}"), "sent", "dead-leader", 3600)
        if index < last or worker_took_it:
            rl.claim(occurrence_key(ns, f"e#{index}"), "run", f"task-{index}", 3600)

    try:
        with _leading_beat(app, tmp_path) as (service, published):
            # It leads from the start: its first term's catch-up finds dead-leader's claim.
            deadline = time.monotonic() + 20
            while not published and time.monotonic() < deadline:
                interval = service.scheduler.tick()
                time.sleep(min(max(interval, 0.01), 0.2))
    finally:
        rl.close()
    assert published, "nothing was sent"
    sent = [occurrence for occurrence, _ in published]
    current = sent[-1]
    assert current.startswith("e#")
    first = last + 1 if worker_took_it else last
    assert sent == [f"e#{i}" for i in range(first, int(current[2:]) + 1)]
    if not worker_took_it:
        (task_id,) = [t for o, t in published if o == f"e#{last}"]
        key = redis_key("redlock", occurrence_key(ns, f"e#{last}"), "run")
        with masters[0].client() as conn:
            assert conn.get(key) is None, "the beat claimed the run before publishing"
        # Whichever copy a worker gets first runs; the other is dropped.
        assert not is_duplicate_occurrence(app, f"e#{last}", task_id, 3600)
        assert is_duplicate_occurrence(app, f"e#{last}", "dead-leaders-copy", 3600)


@pytest.mark.timeout(60)
def test_beat_init_logs_mode_and_masters_and_sends_beat_status(
    masters: Masters, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    statuses: list[tuple[Any, str, str]] = []

    def on_status(sender: Any = None, status: str = "", previous: str = "", **_: Any) -> None:
        statuses.append((sender, status, previous))

    redlock_signals.beat_status.connect(on_status, weak=False)
    first = Service(_beat_app(masters), schedule_filename=str(tmp_path / "first"))
    second = Service(_beat_app(masters), schedule_filename=str(tmp_path / "second"))
    try:
        with caplog.at_level(logging.INFO, logger="celery_redlock.beat"):
            celery_signals.beat_init.send(sender=first)
            celery_signals.beat_init.send(sender=second)
        leader, standby = first._redlock_leader, second._redlock_leader
        lines = [r.getMessage() for r in caplog.records if "leader election" in r.getMessage()]
        assert len(lines) == 2
        for line in lines:
            for url in masters.urls:
                assert url.rsplit("/", 1)[0] in line
            assert "(quorum 2)" in line
        assert lines[0].endswith(": LEADER")
        assert lines[1].endswith(": standby")
        assert leader.leading
        assert not standby.leading
        assert statuses == [(leader, "leader", "standby")]

        leader.stop()  # releases the lease: the standby leads at its next poll
        wait_for(lambda: standby.leading, timeout=10, message="the standby did not take over")
        assert statuses[-1] == (standby, "leader", "standby")
    finally:
        redlock_signals.beat_status.disconnect(on_status)
        for service in (first, second):
            leader = getattr(service, "_redlock_leader", None)
            if leader is not None:
                leader.stop()
            service.scheduler.close()


@pytest.mark.timeout(60)
def test_an_occurrence_the_leader_cannot_claim_is_logged_and_signalled(
    masters: Masters, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing is dropped silently: a due occurrence a leading beat cannot claim (a
    majority of masters stopped) is not sent, with a warning and ``beat_not_sent``."""
    # A long lease: the leader keeps leading (its renewal is 10 s away) while the
    # masters are stopped, as in the moment before a leader notices an outage.
    app = _beat_app(masters, lease_ttl=30, e=1.0)
    not_sent: list[dict[str, Any]] = []

    def on_not_sent(sender: Any = None, **kwargs: Any) -> None:
        not_sent.append({"sender": sender, **kwargs})

    redlock_signals.beat_not_sent.connect(on_not_sent, weak=False)
    try:
        with _leading_beat(app, tmp_path) as (service, published):
            for server in masters[:2]:
                server.pause()
            entry = service.scheduler.schedule["e"]
            with caplog.at_level(logging.WARNING, logger="celery_redlock.beat"):
                assert service.scheduler.apply_entry(entry) is None
            leader = service._redlock_leader
    finally:
        for server in masters[:2]:
            server.resume()
        redlock_signals.beat_not_sent.disconnect(on_not_sent)
    assert published == []
    assert [(n["sender"], n["entry"], n["occurrence"]) for n in not_sent] == [(leader, "e", None)]
    assert "cannot claim it" in not_sent[0]["reason"]
    assert any("not sending e" in r.getMessage() for r in caplog.records)

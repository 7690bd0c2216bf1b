"""celery-redlock, end to end: a Django + Celery project under fire.

Run it with ``scripts/demo.sh`` (or ``python example_project/demo.py``). It starts, on free
loopback ports (never your own Redis):

* 3 redis-server masters for the Redlock, and 1 redis-server as broker and result backend;
* the example project (``exampleproj``, app ``accounts``) on a fresh sqlite database;
* 2 ``celery worker`` processes (prefork, 2 children each) and 2 ``celery beat``.

Then it plays six scenarios, reading what really ran from the ``TaskRun`` rows that the
task bodies write:

(a) the same sync job published 5 times at once: one job id, one run;
(b) two different jobs for one account: the second is rescheduled and runs after the first;
(c) a worker SIGKILLed mid-task: its lock frees within the TTL, the other worker runs the job;
(d) two beats: each 1 s occurrence fires at most once; kill the leading beat, the other
    takes over and sends the missed ones as one late send (never a burst);
(e) a Redis master killed: everything keeps working on 2 of 3;
(f) fencing: successive payments get increasing fences; a paused holder's write is refused.

It prints a summary table and exits non-zero if any scenario failed. Every process it
started is stopped on the way out, on Ctrl-C and SIGTERM too.
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from demokit import (
    HERE,
    Clock,
    Interrupted,
    Stack,
    ignore_signals,
    pause,
    raise_on_signals,
    table,
    wait,
)

from celery_redlock.keys import redis_key

HOST = socket.gethostname()
PREFIX = "redlock"  # CELERY_REDLOCK_KEY_PREFIX's default
#: How long to keep watching for a duplicate run after the expected one finished: longer
#: than the longest contention reschedule (CELERY_REDLOCK_CONTENTION_BACKOFF caps at 2 s).
SETTLE = 2.5

clock = Clock()
say = clock.say


@dataclass
class Outcome:
    """One scenario's line in the summary."""

    key: str
    title: str
    expected: str
    observed: str = "did not run"
    passed: bool = False
    figures: list[str] = field(default_factory=list)


class Demo:
    """The running system and the scenarios played on it."""

    def __init__(self, stack: Stack, beat_window: float) -> None:
        self.stack = stack
        self.beat_window = beat_window
        from accounts import tasks
        from accounts.models import Account, TaskRun
        from django.conf import settings

        self.tasks = tasks
        self.Account = Account
        self.TaskRun = TaskRun
        # The figures the scenarios are judged against, from the project itself.
        self.sync_ttl: float = tasks.sync_account.lock_ttl
        self.payment_ttl: float = tasks.apply_payment.lock_ttl
        self.visibility_timeout: float = settings.CELERY_BROKER_TRANSPORT_OPTIONS[
            "visibility_timeout"
        ]
        self.beat_lease_ttl: float = settings.CELERY_REDLOCK_BEAT_LEASE_TTL

    # -- looking at the system -------------------------------------------------------------

    def runs(self, **filters: Any) -> list[Any]:
        return list(self.TaskRun.objects.filter(**filters).order_by("started"))

    def wait_run(self, timeout: float, what: str, **filters: Any) -> Any:
        found = wait(lambda: self.runs(**filters), timeout, what)
        return found[0]

    def master_values(self, command: Callable[[redis.Redis], Any]) -> list[Any]:
        """``command(client)`` on every master that answers (dead ones are left out)."""
        values = []
        for server in self.stack.masters:
            if not server.alive:
                continue
            try:
                with server.client(socket_timeout=0.5, socket_connect_timeout=0.5) as conn:
                    values.append(command(conn))
            except redis.RedisError:
                continue
        return values

    def quorum_value(self, command: Callable[[redis.Redis], Any]) -> Any:
        """The value ``command`` returns on a majority of the 3 masters, or None."""
        counts = collections.Counter(self.master_values(command))
        value, seen = counts.most_common(1)[0] if counts else (None, 0)
        return value if seen >= 2 else None

    def lock_owner_pid(self, key: str) -> str | None:
        meta = redis_key(PREFIX, key, "meta")
        value = self.quorum_value(lambda c: c.hget(meta, "pid"))
        return value.decode() if isinstance(value, bytes) else None

    def beat_leader(self) -> int | None:
        """The pid of the beat holding the leader lease (its identity is host:pid[:...])."""
        meta = redis_key(PREFIX, "beat:leader:exampleproj", "meta")
        value = self.quorum_value(lambda c: c.hget(meta, "beat"))
        if not isinstance(value, bytes):
            return None
        parts = value.decode().split(":")
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None

    def worker_of(self, nodename: str) -> str:
        process = self.stack.by_nodename(nodename)
        return process.name if process else nodename

    # -- (a) ----------------------------------------------------------------------------------

    def duplicates(self, out: Outcome) -> None:
        sync_account = self.tasks.sync_account
        since = time.time()  # noqa: TID251 - compared with TaskRun.started (wall clock)
        began = time.monotonic()
        results = [sync_account.apply_async((1,), {"seconds": 1.0}, countdown=2) for _ in range(5)]
        ids = {r.id for r in results}
        say(
            f"published sync_account(1) 5 times in {time.monotonic() - began:.3f}s "
            f"(countdown=2): job ids {sorted(i[:8] for i in ids)}"
        )
        # apply_payment shares sync_account's lock key (account:1), never its dedupe marker.
        payments = [self.tasks.apply_payment.apply_async((1, 100), countdown=2) for _ in range(2)]
        payment_ids = {r.id for r in payments}
        say(
            f"published apply_payment(1, 100) twice, same lock key account:1: job ids "
            f"{sorted(i[:8] for i in payment_ids)} (its own job, not the sync's)"
        )
        run = self.wait_run(15, "the sync job to finish", task_id=results[0].id, finished__gt=0)
        say(f"it ran on {self.worker_of(run.worker)} (pid {run.pid}) and finished")
        self.wait_run(15, "the payment to finish", task_id=payments[0].id, finished__gt=0)
        pause(SETTLE)  # watching for a second run that must not come
        runs = self.runs(task="sync_account", account_id=1, started__gte=since)
        paid = self.runs(task="apply_payment", account_id=1, started__gte=since)
        out.observed = (
            f"{len(results)} publishes -> {len(ids)} id, {len(runs)} run; "
            f"payment {len(payment_ids)} id, {len(paid)} run"
        )
        out.passed = (
            len(ids) == 1
            and len(runs) == 1
            and len(payment_ids) == 1
            and not payment_ids & ids
            and len(paid) == 1
        )

    # -- (b) ----------------------------------------------------------------------------------

    def contention(self, out: Outcome) -> None:
        tasks = self.tasks
        sync = tasks.sync_account.apply_async((2,), {"seconds": 2.0})
        report = tasks.build_report.delay("2024-06-01")
        sync_run = self.wait_run(10, "sync_account(2) to start", task_id=sync.id)
        self.wait_run(10, "build_report to start", task_id=report.id)
        published = time.time()  # noqa: TID251 - compared with TaskRun times
        payment = tasks.apply_payment.delay(2, 500)
        second_report = tasks.build_report.delay("2024-06-01")
        say(
            "sync_account(2) runs (2 s); published apply_payment(2, 500), same lock "
            "account:2, and a second build_report for the same day"
        )
        states: list[str] = []

        def payment_done() -> Any:
            state = payment.state
            if not states or states[-1] != state:
                states.append(state)
            return self.runs(task_id=payment.id, finished__gt=0)

        pay_run = wait(payment_done, 20, "the payment to run")[0]
        sync_run = self.runs(task_id=sync.id)[0]
        wait(lambda: second_report.state == "FAILURE", 10, "the second report to be skipped")
        skipped = not self.runs(task_id=second_report.id)
        gap = pay_run.started - sync_run.finished
        say(f"apply_payment's states: {' -> '.join(states)}")
        print(f"           {_span(sync_run, published)}   (s after the payment was published)")
        print(f"           {_span(pay_run, published)}  -> {gap:.2f}s after the sync ended")
        say(f"second build_report: state {second_report.state}, body ran: {not skipped}")
        out.observed = (
            f"2nd ran {gap:.2f}s after 1st ended{' (RETRY seen)' if 'RETRY' in states else ''}; "
            f"dup report {'skipped' if skipped else 'ran'}"
        )
        out.passed = (
            published < sync_run.finished and gap >= 0 and pay_run.outcome == "ok" and skipped
        )

    # -- (c) ----------------------------------------------------------------------------------

    def crash(self, out: Outcome) -> None:
        job = self.tasks.sync_account.apply_async((3,), {"seconds": 3.0})
        first = self.wait_run(10, "sync_account(3) to start", task_id=job.id)
        victim = self.stack.by_nodename(first.worker)
        if victim is None:
            raise RuntimeError(f"no worker process named {first.worker}")
        pause(0.5)  # mid-task
        killed_at = time.time()  # noqa: TID251 - compared with TaskRun times
        killed = time.monotonic()
        victim.kill()
        say(
            f"sync_account(3) (acks_late, lock_ttl={self.sync_ttl}) was running on "
            f"{victim.name} child pid {first.pid}: SIGKILLed {victim.name}'s whole process group"
        )
        dead_pid = str(first.pid)
        wait(
            lambda: self.lock_owner_pid("account:3") != dead_pid,
            self.sync_ttl + 10,
            "the dead holder's lock to expire",
        )
        freed = time.monotonic() - killed
        say(f"nobody renews the dead run's lock: it expired {freed:.1f}s after the kill")
        rerun = self.wait_run(
            self.visibility_timeout + 20,
            "the job to run again",
            task_id=job.id,
            started__gt=killed_at,
            finished__gt=0,
        )
        recovery = rerun.started - killed_at
        say(
            f"the unacknowledged message came back after the visibility timeout "
            f"({self.visibility_timeout} s): the job ran again on {self.worker_of(rerun.worker)}, "
            f"{recovery:.1f}s after the kill, and finished"
        )
        first = self.runs(pk=first.pk)[0]
        runs = self.runs(task_id=job.id)
        out.observed = (
            f"lock freed at {freed:.1f}s, re-run on {self.worker_of(rerun.worker)} "
            f"at {recovery:.1f}s"
        )
        out.figures.append(
            f"crash recovery (SIGKILL -> job runs again): {recovery:.1f} s "
            f"(lock expired after {freed:.1f} s of lock_ttl {self.sync_ttl} s; "
            f"broker visibility timeout {self.visibility_timeout} s)"
        )
        out.passed = (
            first.finished is None
            and rerun.worker != first.worker
            and rerun.outcome == "ok"
            and freed <= self.sync_ttl + 1
            and len(runs) == 2
        )

    # -- (d) ----------------------------------------------------------------------------------

    def beat(self, out: Outcome) -> None:
        beats = {p.pid: p for p in self.stack.celery if p.name.startswith("beat") and p.alive}
        leader = self.beat_leader()
        leading = beats.get(leader or 0)
        if leading is None:
            raise RuntimeError(f"the leader {leader!r} is none of the beats {sorted(beats)}")
        standby = next(p for p in beats.values() if p is not leading)
        start = time.time()  # noqa: TID251 - compared with TaskRun times
        say(
            f"{leading.name} leads, {standby.name} stands by; counting heartbeat-report runs "
            f"for {self.beat_window:.0f}s, killing {leading.name} on the way"
        )
        # Kill the leader between two occurrences (just after one ran), ~1/3 into the window.
        pause(start + self.beat_window / 3 - time.time())  # noqa: TID251
        last = self.runs(task="heartbeat_report")[-1].started
        wait(
            lambda: self.runs(task="heartbeat_report", started__gt=last),
            10,
            "the next heartbeat-report",
            interval=0.02,
        )
        pause(0.3)
        killed = time.monotonic()
        leading.kill()
        say(f"SIGKILLed the leading beat {leading.name} (pid {leading.pid})")
        wait(
            lambda: self.beat_leader() == standby.pid,
            self.beat_lease_ttl + 10,
            "the standby beat to lead",
        )
        failover = time.monotonic() - killed
        say(f"{standby.name} leads {failover:.1f}s after the kill")
        end = start + self.beat_window
        pause(end - time.time())  # noqa: TID251
        pause(SETTLE)  # occurrences missed during the failover are sent late: let them in
        window = self.runs(task="heartbeat_report", started__gte=start, started__lte=end)
        indices = sorted({_index(r.occurrence) for r in window})
        span = range(indices[0], indices[-1] + 1) if indices else range(0)
        every = collections.Counter(
            _index(r.occurrence) for r in self.runs(task="heartbeat_report")
        )
        duplicates = sum(every[i] - 1 for i in span if every[i] > 1)
        # Occurrences missed during the failover go out as one late send standing for them
        # (redlock_beat_catch_up = "one", as Celery beat coalesces an overdue entry).
        covered = {i for r in self.runs(task="heartbeat_report") for i in _covers(r.occurrence)}
        coalesced = [i for i in span if every[i] == 0 and i in covered]
        missed = [i for i in span if i not in covered]
        say(
            f"occurrences #{span.start}..#{span.stop - 1}: {len(span)} due, "
            f"{sum(min(every[i], 1) for i in span)} ran, {duplicates} ran twice, "
            f"{len(coalesced)} coalesced into a late send, {len(missed)} missed"
        )
        out.observed = (
            f"{len(span)} occurrences: {duplicates} twice, {len(coalesced)} coalesced, "
            f"{len(missed)} missed; "
            f"failover {failover:.1f}s"
        )
        out.figures.append(
            f"beat failover (SIGKILL leader -> standby leads): {failover:.1f} s "
            f"(beat lease ttl {self.beat_lease_ttl} s)"
        )
        out.passed = (
            len(span) >= self.beat_window - 3
            and duplicates == 0
            and not missed
            and failover <= self.beat_lease_ttl + 2
        )

    # -- (e) ----------------------------------------------------------------------------------

    def master_down(self, out: Outcome) -> None:
        victim = self.stack.masters[2]
        victim.kill()
        since = time.time()  # noqa: TID251 - compared with TaskRun times
        say(f"SIGKILLed redis master 3 ({victim.url}); 2 of 3 remain, the quorum is 2")
        results = [
            self.tasks.sync_account.apply_async((4,), {"seconds": 0.5}, countdown=2)
            for _ in range(3)
        ]
        ids = {r.id for r in results}
        run = self.wait_run(15, "the sync job to finish", task_id=results[0].id, finished__gt=0)
        pause(SETTLE)
        runs = self.runs(task="sync_account", account_id=4, started__gte=since)
        beats = self.runs(task="heartbeat_report", started__gte=since)
        every = collections.Counter(r.occurrence for r in beats)
        twice = sum(1 for n in every.values() if n > 1)
        say(
            f"3 publishes of sync_account(4) -> {len(ids)} id, {len(runs)} run "
            f"(on {self.worker_of(run.worker)}); beat kept firing: {len(every)} occurrences "
            f"in {time.time() - since:.1f}s, {twice} twice"  # noqa: TID251
        )
        out.observed = (
            f"{len(results)} publishes -> {len(ids)} id, {len(runs)} run; "
            f"beat {len(every)} fired, {twice} twice"
        )
        out.passed = len(ids) == 1 and len(runs) == 1 and len(every) >= 2 and twice == 0

    # -- (f) ----------------------------------------------------------------------------------

    def fencing(self, out: Outcome) -> None:
        from celery_redlock import StaleFence
        from celery_redlock.contrib.django.fencing import fenced_update

        apply_payment, account_id = self.tasks.apply_payment, 5
        fences = []
        for amount in (100, 200, 300):
            result = apply_payment.delay(account_id, amount)
            run = self.wait_run(15, "a payment", task_id=result.id, finished__gt=0)
            fences.append(run.fence)
        say(f"3 payments in a row wrote with fences {fences}")

        paused = apply_payment.delay(account_id, 1000, work_seconds=2.0)
        a = self.wait_run(10, "the slow payment to start", task_id=paused.id)
        os.kill(a.pid, signal.SIGSTOP)
        say(
            f"payment A (1000, fence {a.fence}) is working: SIGSTOPped its process "
            f"{a.pid} (a GC pause, a swapped-out VM ...)"
        )
        try:
            b_result = apply_payment.delay(account_id, 10)
            b = self.wait_run(
                self.payment_ttl + 15, "payment B", task_id=b_result.id, finished__gt=0
            )
            say(
                f"A's lock expired (lock_ttl={self.payment_ttl}, not renewed while paused): "
                f"payment B (10) took it and wrote with fence {b.fence}"
            )
        finally:
            os.kill(a.pid, signal.SIGCONT)
        a = self.wait_run(15, "payment A to end", task_id=paused.id, finished__gt=0)
        verdict = "was refused" if a.outcome.startswith("refused") else f"?! {a.outcome}"
        say(f"resumed A: its write {verdict} (StaleFence: {a.fence} is not newer than {b.fence})")
        try:
            fenced_update(self.Account, account_id, fences[0], balance=0)
            direct = "accepted (wrong!)"
        except StaleFence as exc:
            direct = f"refused (fence {exc.fence} < current {exc.current})"
        say(f"a write straight from here with the first payment's fence: {direct}")
        account = self.Account.objects.get(pk=account_id)
        sequence = [*fences, a.fence, b.fence]
        rising = all(x < y for x, y in itertools.pairwise(sequence))
        say(f"balance {account.balance} (600 + 10; A's 1000 never landed), fence {account.fence}")
        out.observed = (
            f"{len(sequence)} fences {'rising' if rising else 'NOT rising'}; paused holder "
            f"{'refused' if a.outcome.startswith('refused') else 'NOT refused'}; "
            f"balance {account.balance}"
        )
        out.figures.append(f"fences of successive apply_payment runs: {sequence}")
        out.figures.append(
            f"stale write refused: paused holder's fence {a.fence} < newer holder's {b.fence}"
        )
        out.passed = (
            rising
            and a.fence < b.fence
            and a.outcome.startswith("refused")
            and direct.startswith("refused")
            and account.balance == 610
            and account.fence == b.fence
        )


def _span(run: Any, origin: float) -> str:
    """A run's start and end, in seconds since ``origin``."""
    return f"{run.task:<13} ran {run.started - origin:+.2f}..{run.finished - origin:+.2f}s"


def _index(occurrence: str) -> int:
    """``heartbeat-report#123`` (or ``heartbeat-report#123 x3``) -> 123."""
    return int(occurrence.split()[0].rpartition("#")[2])


def _covers(occurrence: str) -> range:
    """The occurrences a run stands for: itself, and for a coalesced late send
    (``heartbeat-report#123 x3``) the missed ones before it (121..123)."""
    index = _index(occurrence)
    _, _, count = occurrence.partition(" x")
    return range(index - (int(count) if count.isdigit() else 1) + 1, index + 1)


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    expected: str
    method: str
    why: str


SCENARIOS = [
    Scenario(
        "a",
        "duplicate publishes",
        "1 id, 1 run",
        "duplicates",
        "A user clicks 'Sync' five times. SingletonTask's enqueue dedupe: while the job is "
        "queued, publishing it again returns the queued job's AsyncResult. A payment on the "
        "same account (same lock key, another task) is its own job, deduplicated apart.",
    ),
    Scenario(
        "b",
        "contention on one account",
        "2nd rescheduled, runs after 1st",
        "contention",
        "sync_account and apply_payment share the lock key account:{account_id}. The lock is "
        "taken when a body starts: a job that finds it taken is rescheduled with random "
        "backoff (build_report, on_contention='skip', is dropped instead).",
    ),
    Scenario(
        "c",
        "worker SIGKILLed mid-task",
        "lock frees <= ttl, re-run elsewhere",
        "crash",
        "The OOM killer takes a whole worker. Nobody releases the lock, but nobody renews it "
        "either: it expires within lock_ttl. sync_account is acks_late, so the broker still "
        "has its message and gives it to the other worker after the visibility timeout.",
    ),
    Scenario(
        "d",
        "two beats, leader killed",
        "no occurrence twice or lost, standby leads",
        "beat",
        "Two `celery beat` run the same 1 s schedule. One leads (a renewed lease), and each "
        "occurrence is claimed once on the quorum. Kill the leader: the standby takes the "
        "lease when it expires and sends what was missed meanwhile as one late send standing "
        "for all of them (redlock_beat_catch_up='one'), as Celery beat does with an overdue "
        "entry: never twice, never a burst.",
    ),
    Scenario(
        "e",
        "a Redis master killed",
        "all keeps working on 2 of 3",
        "master_down",
        "Redlock needs a majority: with 3 masters, any 2 will do.",
    ),
    Scenario(
        "f",
        "fenced writes (2 of 3 up)",
        "fences rise, stale write refused",
        "fencing",
        "A lock cannot stop a holder that froze past its lease and wakes up later. Each "
        "holder gets a larger fencing token (lease.fence), and the database refuses a write "
        "whose token is not newer than the row's (fenced_update).",
    ),
]


def start_system(stack: Stack, run_dir: Path) -> None:
    say("starting 3 Redis masters and a Redis broker (free loopback ports) ...")
    stack.start_redis()
    assert stack.broker is not None
    for i, server in enumerate(stack.masters, 1):
        print(f"           redis master {i}  pid {server.pid}  {server.url}")
    print(f"           redis broker    pid {stack.broker.pid}  {stack.broker.url}")
    broker = f"redis://127.0.0.1:{stack.broker.port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CELERY_", "DJANGO_"))}
    env.update(
        DJANGO_SETTINGS_MODULE="exampleproj.settings",
        CELERY_BROKER_URL=f"{broker}/0",
        CELERY_RESULT_BACKEND=f"{broker}/1",
        CELERY_REDLOCK_REDIS_URLS=",".join(stack.masters.urls),
        EXAMPLEPROJ_DB=str(run_dir / "db.sqlite3"),
        PYTHONPATH=os.pathsep.join([str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])]),
        PYTHONUNBUFFERED="1",
    )
    stack.env = env
    os.environ.update({k: v for k, v in env.items() if k != "PYTHONPATH"})

    import django
    from django.core.management import call_command
    from django.db import connection

    django.setup()
    call_command("migrate", verbosity=0)
    with connection.cursor() as cursor:  # readers never wait for the workers' writes
        cursor.execute("PRAGMA journal_mode=WAL")
    from accounts.models import Account

    for i in range(1, 6):
        Account.objects.create(pk=i, name=f"account {i}")
    say(f"migrated the sqlite database {run_dir / 'db.sqlite3'}; starting Celery ...")

    workers = [
        stack.start_celery(
            f"worker-{n}",
            "worker",
            "-P",
            "prefork",
            "-c",
            "2",
            "-n",
            f"worker-{n}@{HOST}",
            "-l",
            "info",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            nodename=f"worker-{n}@{HOST}",
        )
        for n in ("a", "b")
    ]
    beats = [
        stack.start_celery(f"beat-{n}", "beat", "-l", "info", "-s", str(run_dir / f"beat-{n}"))
        for n in ("a", "b")
    ]
    for process in stack.celery:
        print(f"           {process.name:<14}  pid {process.pid}  log {process.log_path}")
    for worker in workers:
        worker.wait_log(" ready.")
    for beat in beats:
        beat.wait_log("leader election")
    say("2 workers and 2 beats are up (celery pids are their process-group ids)")


def run(args: argparse.Namespace, run_dir: Path) -> list[Outcome]:
    stack = Stack(run_dir)
    outcomes = [Outcome(s.key, s.title, s.expected) for s in SCENARIOS]
    interrupted: Interrupted | None = None
    raise_on_signals()
    try:
        start_system(stack, run_dir)
        demo = Demo(stack, args.beat_window)
        for outcome, scenario in zip(outcomes, SCENARIOS, strict=True):
            key = scenario.key
            print(f"\n({key}) {scenario.title}")
            print(textwrap.fill(scenario.why, 92, initial_indent="    ", subsequent_indent="    "))
            began = time.monotonic()
            try:
                getattr(demo, scenario.method)(outcome)
            except Exception as exc:  # noqa: BLE001 - a failed scenario, reported, then on
                outcome.observed = f"error: {type(exc).__name__}: {exc}"
                outcome.passed = False
            say(
                f"({key}) {'PASS' if outcome.passed else 'FAIL'} "
                f"in {time.monotonic() - began:.1f}s: {outcome.observed}"
            )
    except Interrupted as exc:
        # A fresh exception without the traceback: the interrupted scenario's frames (and
        # the AsyncResults in them, which unsubscribe from the result backend when they
        # are collected) go now, while the broker still runs, not after it is gone.
        interrupted = Interrupted(exc.signum)
    finally:
        ignore_signals()
        gc.collect()
        say("stopping every process started ...")
        stack.stop()
        say("all stopped")
    if interrupted is not None:
        raise interrupted
    return outcomes


def summary(outcomes: list[Outcome]) -> None:
    rows = [
        [f"({o.key}) {o.title}", o.expected, o.observed, "PASS" if o.passed else "FAIL"]
        for o in outcomes
    ]
    print("\nSummary")
    print(table(["scenario", "expected", "observed", "result"], rows))
    figures = [figure for o in outcomes for figure in o.figures]
    if figures:
        print("\nFigures")
        for figure in figures:
            print(f"  {figure}")
    passed = sum(o.passed for o in outcomes)
    print(f"\n{passed} of {len(outcomes)} scenarios passed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, help="logs and database here (kept)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary run dir")
    parser.add_argument(
        "--beat-window", type=float, default=15.0, help="seconds of beat counting in (d)"
    )
    args = parser.parse_args(argv)
    if args.run_dir is not None:
        run_dir = args.run_dir.resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
    else:
        run_dir = Path(tempfile.mkdtemp(prefix="redlock-demo-"))
    logging.basicConfig(
        filename=run_dir / "demo.log",
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    print(__doc__.split("\n\n")[0] if __doc__ else "")
    print(f"run dir (logs, database): {run_dir}\n")
    keep = args.keep or args.run_dir is not None
    try:
        outcomes = run(args, run_dir)
    except Interrupted as exc:
        print(f"\ninterrupted by {signal.Signals(exc.signum).name}; every process is stopped")
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        return 128 + exc.signum
    summary(outcomes)
    ok = all(o.passed for o in outcomes)
    if ok and not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    elif not ok:
        print(f"logs kept in {run_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

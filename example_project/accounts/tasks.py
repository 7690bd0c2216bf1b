"""The example's tasks. Each body records its run in ``TaskRun`` so the demo can see
exactly what ran where, when, and with which fencing token."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from celery import shared_task
from django.db.models import F
from django.utils import timezone

from celery_redlock import SingletonTask, StaleFence
from celery_redlock.contrib.django.fencing import fenced_update

from .models import Account, TaskRun


def _occurrence(request: Any) -> str:
    """The beat occurrence this run is (``heartbeat-report#12``); a late send standing for
    missed ones too (``redlock_beat_catch_up = "one"``) says how many:
    ``heartbeat-report#12 x3``."""
    occurrence = getattr(request, "redlock_occurrence", None) or ""
    stands_for = getattr(request, "redlock_catch_up", None)
    if occurrence and isinstance(stands_for, int) and stands_for > 1:
        return f"{occurrence} x{stands_for}"
    return str(occurrence)


@contextlib.contextmanager
def recorded(
    task: Any, account_id: int | None = None, fence: int | None = None
) -> Iterator[TaskRun]:
    """Record this run of ``task``'s body: a row at the start, its end time at the end."""
    request = task.request
    run = TaskRun.objects.create(
        task=task.name.rpartition(".")[2],
        task_id=request.id or "",
        account_id=account_id,
        worker=request.hostname or "",
        pid=os.getpid(),
        started=time.time(),  # noqa: TID251 - compared across processes by the demo
        fence=fence,
        occurrence=_occurrence(request),
    )
    try:
        yield run
    except StaleFence as exc:
        run.outcome = f"refused: {exc}"
        raise
    else:
        run.outcome = run.outcome or "ok"
    finally:
        run.finished = time.time()  # noqa: TID251 - see above
        run.save(update_fields=["finished", "outcome"])


# One sync per account at a time. acks_late: the message is acknowledged only when the body
# returns, so if the worker dies mid-run the broker hands the job to another worker; the
# lock, no longer renewed by anybody, frees itself within lock_ttl seconds.
@shared_task(
    bind=True, base=SingletonTask, lock_key="account:{account_id}", lock_ttl=5, acks_late=True
)
def sync_account(self: Any, account_id: int, seconds: float = 2.0) -> None:
    """Pull the account from the bank (here: wait ``seconds``)."""
    with recorded(self, account_id):
        time.sleep(seconds)
        Account.objects.filter(pk=account_id).update(synced_at=timezone.now())


# A second report for the same day while one runs is pointless: skip it (state FAILURE
# with LockContended, redlock_skip_result's default: its .get() raises at once).
@shared_task(bind=True, base=SingletonTask, on_contention="skip")
def build_report(self: Any, day: str) -> None:
    """Build the daily report for ``day`` (here: wait 2 s)."""
    with recorded(self):
        time.sleep(2.0)


# Shares the account's lock with sync_account: the two never run at once on one account.
# They never share a dedupe marker (identity is the task name plus the key), so a payment
# published while a sync of its account is queued is its own job. With dedupe on (the
# default, "queued"), a payment published again while it waits (a double click, a retried
# web request) is one payment; the key is the account, so a caller that means a second,
# different payment while one is queued publishes it with redlock={"dedupe": None}.
# lock_ttl=3: a holder that stalls (GC pause, swapped out, SIGSTOP) loses the lock after
# 3 s, and the fence makes sure its late write cannot land after the next holder's.
@shared_task(bind=True, base=SingletonTask, lock_key="account:{account_id}", lock_ttl=3)
def apply_payment(self: Any, account_id: int, amount: int, work_seconds: float = 0.2) -> int:
    """Add ``amount`` cents to the balance; the write carries this run's fencing token."""
    fence: int = self.lease.fence
    with recorded(self, account_id, fence=fence):
        time.sleep(work_seconds)  # talk to the payment provider
        fenced_update(Account, account_id, fence, balance=F("balance") + amount)
    return fence


@shared_task(bind=True)
def heartbeat_report(self: Any) -> None:
    """Sent by beat every second (settings.CELERY_BEAT_SCHEDULE)."""
    with recorded(self):
        pass

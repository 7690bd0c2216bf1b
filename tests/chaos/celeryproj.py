"""The Celery app of the chaos suite: ``celery -A tests.chaos.celeryproj worker|beat``.

Environment (set by :mod:`tests.chaos.test_celery_chaos`):

``CHAOS_HISTORY``   the history file (every process appends to it)
``CHAOS_NAME``      this process's name in the history (``w0``, ``beat-1`` ...)
``CHAOS_BROKER``    broker URL (a harness redis-server)
``CHAOS_MASTERS``   comma-separated Redlock master URLs
``CHAOS_RESOURCE``  the protected resource's redis-server
``CHAOS_VISIBILITY`` broker visibility timeout in seconds
``CHAOS_MUTEX_EXPIRE`` kombu's ``unacked_mutex_expire`` in seconds (default 5, not 300)
``CHAOS_LOCK_TTL``  ``redlock_ttl``; ``CHAOS_BEAT_TTL``: ``redlock_beat_lease_ttl``
``CHAOS_BEAT_LEADER`` ``"0"`` turns beat leadership off (negative control)
``CHAOS_SCHEDULE``  JSON: entry name -> interval seconds, each calling ``chaos.tick``
``CHAOS_PUBLISH_DELAY`` seconds a beat waits between claiming an occurrence and publishing
                    it (widens the window in which a kill leaves a claim and no message)

The app's Redlock is the instrumented one (:mod:`tests.chaos.instrument`), so every round
to the masters, renewal and loss inside the worker is in the history too.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

from celery import Celery
from celery import signals as celery_signals

import celery_redlock
import celery_redlock.client
from celery_redlock import SingletonTask
from celery_redlock import signals as redlock_signals
from celery_redlock.exceptions import RedlockError

from .history import MSG_HEADER, History, ns
from .instrument import InstrumentedRedlock, lease_id
from .resource import FencedStore, UnfencedCounter

NAME = os.environ.get("CHAOS_NAME", "celery")
H = History(os.environ["CHAOS_HISTORY"], NAME)
SENT_AT = "chaos_sent_at"
WORK_TASKS = ("chaos.work", "chaos.plain_work")
#: Seconds kombu's restore mutex outlives a worker killed while holding it.
UNACKED_MUTEX_EXPIRE = float(os.environ.get("CHAOS_MUTEX_EXPIRE", "5"))
PUBLISH_DELAY = float(os.environ.get("CHAOS_PUBLISH_DELAY", "0"))


class _RecordedRedlock(InstrumentedRedlock):
    def __init__(self, masters: Any, **kwargs: Any) -> None:
        super().__init__(masters, history=H, **kwargs)

    def claim(self, key: str, suffix: str, value: str, ttl: float, **kwargs: Any) -> Any:
        # Beat occurrence claims (sent by a beat, run by a worker) in the history, so a
        # report can tell "claimed, never published" from "published, never run".
        holder, fresh = super().claim(key, suffix, value, ttl, **kwargs)
        if key.startswith("beat:") and suffix in ("sent", "run"):
            H.write("claim", key=key, suffix=suffix, value=value, holder=holder, fresh=fresh)
        return holder, fresh


# The app's client is built by celery_redlock.client.redlock_for: make it the recorded one.
celery_redlock.client.Redlock = _RecordedRedlock  # type: ignore[misc]

app = Celery("chaosproj")
app.conf.update(
    broker_url=os.environ["CHAOS_BROKER"],
    broker_transport_options={
        "visibility_timeout": float(os.environ.get("CHAOS_VISIBILITY", "3600")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # A restore sweep holds kombu's "unacked_mutex" (a Redis lock) for milliseconds;
        # a worker SIGKILLed inside one leaves it until it expires (300 s by default), and
        # no worker restores anything meanwhile: the killed worker's jobs stay unacked
        # far past any settle wait. Seconds are enough for a sweep.
        "unacked_mutex_expire": UNACKED_MUTEX_EXPIRE,
    },
    broker_connection_retry_on_startup=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    redlock_redis_urls=os.environ["CHAOS_MASTERS"].split(","),
    redlock_ttl=float(os.environ.get("CHAOS_LOCK_TTL", "2")),
    redlock_node_timeout=0.1,
    redlock_contention_backoff=(0.2, 1.0),
    redlock_outage_backoff=(0.2, 1.0),
    redlock_beat_lease_ttl=float(os.environ.get("CHAOS_BEAT_TTL", "3")),
    redlock_beat_leader=os.environ.get("CHAOS_BEAT_LEADER", "1") != "0",
    beat_schedule={
        name: {
            "task": "chaos.tick",
            "schedule": float(every),
            "kwargs": {"entry": name, "every": every},
        }
        for name, every in json.loads(os.environ.get("CHAOS_SCHEDULE", "{}")).items()
    },
    timezone="UTC",
    worker_log_format="[%(created).3f %(levelname)s/%(processName)s/%(process)d] %(message)s",
)
celery_redlock.install(app)

_store: FencedStore | None = None
_counter: UnfencedCounter | None = None


def _resource() -> tuple[FencedStore, UnfencedCounter]:
    global _store, _counter
    if _store is None or _counter is None:
        url = os.environ["CHAOS_RESOURCE"]
        _store = FencedStore(url, enforce=True, writer=NAME)
        _counter = UnfencedCounter(url)
    return _store, _counter


@celery_signals.worker_process_init.connect(dispatch_uid="chaos.reset_resource", weak=False)
def _reset_resource(**_: Any) -> None:
    global _store, _counter
    _store = _counter = None


@redlock_signals.lock_acquired.connect(dispatch_uid="chaos.acquired", weak=False)
def _acquired(sender: Any = None, key: str = "", lease: Any = None, **_: Any) -> None:
    H.write(
        "acq_ok",
        key=key,
        lease=lease_id(lease),
        start_ns=ns(lease.acquired_at),
        deadline_ns=ns(lease.deadline),
        votes=InstrumentedRedlock.last_codes(),
    )


@redlock_signals.beat_status.connect(dispatch_uid="chaos.beat_status", weak=False)
def _beat_status(sender: Any = None, status: str = "", previous: str = "", **_: Any) -> None:
    H.write("beat_status", status=status, previous=previous)


@celery_signals.before_task_publish.connect(dispatch_uid="chaos.stamp", weak=False)
def _stamp(
    sender: Any = None, body: Any = None, headers: dict[str, Any] | None = None, **_: Any
) -> None:
    if headers is None:
        return
    headers.setdefault(SENT_AT, time.time())  # noqa: TID251 - compared across processes
    headers.setdefault("chaos_sender", NAME)
    if headers.get("redlock_occurrence"):
        if PUBLISH_DELAY:
            # The occurrence is claimed; a SIGKILL now leaves the claim and no message.
            H.write("beat_publish_wait", occurrence=headers["redlock_occurrence"])
            time.sleep(PUBLISH_DELAY)
        H.write(
            "beat_publish",
            occurrence=headers["redlock_occurrence"],
            task_id=headers.get("id"),
            covers=headers.get("redlock_catch_up_of"),
        )
    if sender in WORK_TASKS:
        # Every message of a work item gets its own id (a republish copies the request's
        # headers: overwritten here), so the checker can tell a message the broker lost
        # (published, never received by any worker) from a job the library dropped.
        msg = headers[MSG_HEADER] = uuid.uuid4().hex[:12]
        args = body[0] if isinstance(body, list | tuple) and body else None
        item = args[0] if isinstance(args, list | tuple) and args else None
        H.write("publish", item=item, task_id=headers.get("id"), msg=msg)


@celery_signals.task_received.connect(dispatch_uid="chaos.received", weak=False)
def _received(request: Any = None, **_: Any) -> None:
    # Sent by the worker's main process once kombu has recorded the message as unacked
    # (delivered): from here on a SIGKILL leaves it for the broker to deliver again.
    if request is None or request.name not in WORK_TASKS:
        return
    headers = getattr(getattr(request, "message", None), "headers", None) or {}
    H.write("received", task_id=request.id, msg=headers.get(MSG_HEADER))


def _body(task: Any, item: str, key: str, seconds: float, lease: Any) -> None:
    key = f"job:{key}"
    task_id = task.request.id
    if lease is None:
        # Unguarded (negative control): the body believes it is alone, forever.
        lid = "plain-" + uuid.uuid4().hex[:6]
        now = time.monotonic_ns()
        H.write("acq_ok", key=key, lease=lid, start_ns=now, deadline_ns=None, votes="")
        fence = 0
    else:
        lid = lease_id(lease)
        try:
            fence = lease.fence
        except RedlockError as exc:
            H.write("fence_fail", key=key, lease=lid, error=str(exc)[:100])
            raise
    H.write(
        "task_start",
        item=item,
        task_id=task_id,
        key=key,
        lease=lid,
        acquired_ns=ns(lease.acquired_at) if lease is not None else time.monotonic_ns(),
    )
    store, counter = _resource()
    # Only an item's first run is long (longer than the visibility timeout): the broker
    # hands it out again while it runs. Later runs (the redelivered copy, retries) are
    # short, so the redelivery storm ends; with every run long it never would, lock or not.
    runs = int(counter.client.incr(f"runs:{item}"))
    if runs > 1:
        seconds = min(seconds, 0.3)
    H.write("cs_enter", key=key, lease=lid, fence=fence)
    accepted, value, _ = store.read(key, fence, lid)
    if not accepted:
        H.write("cs_abort", key=key, lease=lid, reason="stale read refused")
        raise task.retry(countdown=0.5)
    seen = counter.read(key)
    H.write("work", key=key, lease=lid, ms=round(seconds * 1000))
    time.sleep(seconds)
    if lease is not None and not lease.held:
        # Lost the lock while working (an outage): nothing written; run it again later.
        H.write("cs_abort", key=key, lease=lid, reason=lease.lost_reason or "validity ran out")
        raise task.retry(countdown=0.5)
    old = counter.client.set(f"ctr:{{{key}}}", seen + 1, get=True)
    H.write("ctr_write", key=key, lease=lid, based_on=seen, overwrote=int(old or 0), value=seen + 1)
    ok, _ = store.write(key, fence, lid, value + 1, value)
    H.write("write", key=key, lease=lid, fence=fence, value=value + 1, accepted=ok)
    if not ok:
        H.write("cs_abort", key=key, lease=lid, reason="stale write refused")
        raise task.retry(countdown=0.5)
    H.write("cs_exit", key=key, lease=lid)
    H.write("done", item=item, task_id=task_id)


@app.task(
    bind=True,
    base=SingletonTask,
    name="chaos.work",
    lock_key="job:{key}",
    dedupe=None,
    max_retries=None,
)
def work(self: Any, item: str, key: str, seconds: float) -> None:
    _body(self, item, key, seconds, self.lease)


@app.task(bind=True, name="chaos.plain_work", max_retries=None)
def plain_work(self: Any, item: str, key: str, seconds: float) -> None:
    _body(self, item, key, seconds, None)


@app.task(bind=True, name="chaos.tick")
def tick(self: Any, entry: str, every: float) -> None:
    request = self.request
    occurrence = request.get("redlock_occurrence")
    if not occurrence:
        # Leadership off (negative control): no occurrence header; number the send by
        # the publisher's clock instead.
        sent = float(request.get(SENT_AT) or time.time())  # noqa: TID251 - wall clock
        occurrence = f"{entry}~{round(sent / every)}"
    H.write(
        "beat_run",
        entry=entry,
        occurrence=occurrence,
        task_id=request.id,
        sender=request.get("chaos_sender"),
        # a coalesced late send stands for this many occurrences (redlock_beat_catch_up)
        catch_up=request.get("redlock_catch_up"),
        # ... and which others (as the worker left the header after the run claims)
        covers=request.get("redlock_catch_up_of"),
    )

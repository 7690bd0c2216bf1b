"""The Celery app that ``celery -A proj.app beat|worker`` loads (``tests/beat`` on the path).

Environment (set by :mod:`proj.cluster`):

``BEAT_TEST_BROKER``      broker URL (a harness redis-server); results go to the same server
``BEAT_TEST_MASTERS``     comma-separated Redlock master URLs
``BEAT_TEST_OUTPUT``      file every task body appends one JSON line to
``BEAT_TEST_LEASE_TTL``   ``redlock_beat_lease_ttl`` in seconds (default 3)
``BEAT_TEST_SCHEDULE``    JSON object: entry name -> seconds (an interval entry) or a crontab
                          minute field such as ``"*"`` (a crontab entry); every entry calls
                          ``proj.app.tick(kind=<entry name>)``
``BEAT_TEST_NAME``        this process's name in the tests (``beat-a``, ``worker`` ...)
``BEAT_TEST_CLOCK_OFFSET`` seconds this process's wall clock is off (``time.time`` and
                          ``app.now``), to simulate clock skew between beat hosts
``BEAT_TEST_CATCH_UP``    ``redlock_beat_catch_up`` (default: the library's)
``BEAT_TEST_APP_NAME``    the app's ``main`` name (default ``beatproj``)
``BEAT_TEST_OPT_OUT``     comma-separated entry names sent with ``redlock_beat: False``
``BEAT_TEST_DJANGO_DB``   when set: a sqlite file; Django is set up with django_celery_beat
                          (run beat with ``-S django_celery_beat.schedulers:DatabaseScheduler``)

A record (one line, written with a single ``os.write`` on an ``O_APPEND`` descriptor, so
lines from concurrent processes never interleave) is ``{"kind", "occurrence", "task_id",
"t", "sender", "sent_at", "pid", "catch_up", "covers"}``: ``occurrence`` is the
``redlock_occurrence`` header, ``catch_up`` the ``redlock_catch_up`` header (how many
occurrences a coalesced late send stands for; None for one), ``covers`` the
``redlock_catch_up_of`` header (which others, as the worker left it),
``sender``/``sent_at`` are stamped into the message by the publishing process (so the
tests know which beat sent it, and when, by the wall clock all processes share). Beat
leadership changes are recorded too, as ``{"kind": "beat_status", "status", "previous",
"name", "t"}``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from typing import Any

from celery import Celery
from celery import signals as celery_signals
from celery.schedules import crontab

import celery_redlock
from celery_redlock import SingletonTask
from celery_redlock import signals as redlock_signals

NAME = os.environ.get("BEAT_TEST_NAME", "unnamed")
OUTPUT = os.environ["BEAT_TEST_OUTPUT"]
SENDER_HEADER = "beat_test_sender"
SENT_AT_HEADER = "beat_test_sent_at"

if os.environ.get("BEAT_TEST_DJANGO_DB"):
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.django_settings")
    import django

    django.setup()


CLOCK_OFFSET = float(os.environ.get("BEAT_TEST_CLOCK_OFFSET", "0") or 0)
OPT_OUT = {n for n in os.environ.get("BEAT_TEST_OPT_OUT", "").split(",") if n}
if CLOCK_OFFSET:
    _real_time = time.time  # noqa: TID251 - a skewed wall clock on purpose

    def _skewed_time() -> float:
        return _real_time() + CLOCK_OFFSET

    time.time = _skewed_time  # noqa: TID251 - a skewed wall clock on purpose


def _schedule(spec: str) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    for name, when in json.loads(spec or "{}").items():
        schedule = crontab(minute=when) if isinstance(when, str) else float(when)
        entries[name] = {"task": "proj.app.tick", "schedule": schedule, "kwargs": {"kind": name}}
        if name in OPT_OUT:
            entries[name]["options"] = {"redlock_beat": False}
    return entries


app = Celery(os.environ.get("BEAT_TEST_APP_NAME") or "beatproj")
if CLOCK_OFFSET:
    _real_now = app.now

    def _skewed_now() -> dt.datetime:
        return _real_now() + dt.timedelta(seconds=CLOCK_OFFSET)

    app.now = _skewed_now  # type: ignore[method-assign]
app.conf.update(
    broker_url=os.environ["BEAT_TEST_BROKER"],
    result_backend=(
        os.environ["BEAT_TEST_BROKER"]
        if os.environ["BEAT_TEST_BROKER"].startswith("redis")
        else None
    ),
    redlock_beat_lease_ttl=float(os.environ.get("BEAT_TEST_LEASE_TTL", "3")),
    beat_schedule=_schedule(os.environ.get("BEAT_TEST_SCHEDULE", "")),
    **(
        {"redlock_beat_catch_up": os.environ["BEAT_TEST_CATCH_UP"]}
        if os.environ.get("BEAT_TEST_CATCH_UP")
        else {}
    ),
    timezone="UTC",
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    # Epoch seconds in every log line, so tests can line logs up with their own clock.
    worker_log_format="[%(created).3f %(levelname)s/%(processName)s/%(process)d] %(message)s",
    worker_task_log_format=(
        "[%(created).3f %(levelname)s/%(processName)s/%(process)d] "
        "%(task_name)s[%(task_id)s]: %(message)s"
    ),
)
if os.environ["BEAT_TEST_MASTERS"]:  # empty: not set (the broker decides)
    app.conf.redlock_redis_urls = os.environ["BEAT_TEST_MASTERS"].split(",")
celery_redlock.install(app)


def _true_time() -> float:
    """The machine's wall clock, whatever BEAT_TEST_CLOCK_OFFSET says (records compare)."""
    return time.time() - CLOCK_OFFSET  # noqa: TID251 - compared across processes


def record(kind: str, **fields: Any) -> None:
    """Append one JSON line to the output file (open per write: survives fork and fd sweeps)."""
    line = json.dumps({"kind": kind, "t": _true_time(), "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(OUTPUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _run_record(task: Any, kind: str, **fields: Any) -> None:
    request = task.request
    record(
        kind,
        occurrence=request.get("redlock_occurrence"),
        task_id=request.id,
        sender=request.get(SENDER_HEADER),
        sent_at=request.get(SENT_AT_HEADER),
        retries=request.retries,
        catch_up=request.get("redlock_catch_up"),
        covers=request.get("redlock_catch_up_of"),
        **fields,
    )


@celery_signals.before_task_publish.connect(dispatch_uid="beatproj.stamp", weak=False)
def _stamp(headers: dict[str, Any] | None = None, **_: Any) -> None:
    if headers is not None:
        headers.setdefault(SENDER_HEADER, NAME)
        headers.setdefault(SENT_AT_HEADER, _true_time())


@redlock_signals.beat_status.connect(dispatch_uid="beatproj.status", weak=False)
def _status(sender: Any = None, status: str = "", previous: str = "", **_: Any) -> None:
    record("beat_status", status=status, previous=previous, name=NAME)


def _no_leader(sender: Any = None, down_for: float = 0.0, **_: Any) -> None:
    record("beat_no_leader", name=NAME, down_for=down_for)


# getattr: the tests also run against releases without the signal (to show they fail there)
if getattr(redlock_signals, "beat_no_leader", None) is not None:
    redlock_signals.beat_no_leader.connect(
        _no_leader, dispatch_uid="beatproj.no_leader", weak=False
    )


@app.task(bind=True, name="proj.app.tick")
def tick(self: Any, kind: str) -> None:
    """What every beat entry runs: one record."""
    _run_record(self, kind)


@app.task(
    bind=True, name="proj.app.single", base=SingletonTask, lock_key="single:{kind}", dedupe=None
)
def single(self: Any, kind: str) -> None:
    """A SingletonTask (no enqueue dedupe, so a second publish reaches the worker)."""
    _run_record(self, kind)


@app.task(
    bind=True,
    name="proj.app.hold",
    base=SingletonTask,
    lock_key="held",
    dedupe=None,
    lock_ttl=5,
)
def hold(self: Any, kind: str, seconds: float = 0.0) -> None:
    """Holds the key ``held`` for ``seconds`` after recording."""
    _run_record(self, kind)
    time.sleep(seconds)


@app.task(bind=True, name="proj.app.flaky")
def flaky(self: Any, kind: str) -> None:
    """Records, then retries once (its own ``retry()``, same task id and headers)."""
    _run_record(self, kind)
    if self.request.retries == 0:
        raise self.retry(countdown=0.2, max_retries=1)

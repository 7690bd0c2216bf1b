"""What a hostile review of the publish side found, each reproduced with a real worker.

- ``Task.replace()`` published its replacement through dedupe: an identical queued job
  swallowed it, and the caller's id never got a result (a hang).
- A serializer chosen for one publish was dropped by its contention reschedules, so the
  rescheduled job's key changed (``batch:(1, 2)`` became ``batch:[1, 2]``) and it ran
  beside the job it was waiting for.
- ``dedupe="active"`` and ``retry(args=...)`` left the old arguments' marker naming the
  job: the next publish of the old arguments returned a job that never ran them.
- An ``eta`` given as an ISO string (or naive) was not counted in the marker's TTL: the
  marker expired while the job still waited, and a duplicate ran.
- Arguments a serializer encodes but cannot decode (msgpack, int dict keys) claimed a
  marker for a job no worker can run: identical publishes returned it for an hour.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Any

import pytest
from celery import Task
from celery.signals import after_task_publish

from celery_redlock import SingletonTask
from celery_redlock.client import redlock_for
from celery_redlock.lock.scripts import CLAIMED_BY
from celery_redlock.testing import wait_for

from .redlock_testkit import CeleryEnv, Span, assert_no_overlap, run_worker

pytestmark = pytest.mark.timeout(60)


def _marker_ttls(env: CeleryEnv) -> list[float]:
    ttls = []
    for server in env.masters:
        with server.client() as conn:
            ttls.extend(
                conn.pttl(n) / 1000
                for n in conn.scan_iter(match="redlock:*dedupe*")
                if not n.decode().endswith(CLAIMED_BY)  # its writer's id (a claim call's time)
            )
    return ttls


def test_a_replacement_is_published_even_when_an_identical_job_is_queued(
    env: CeleryEnv, make_app: Any
) -> None:
    app = make_app()

    @app.task(base=SingletonTask, lock_key="b:{x}")
    def b(x: int) -> str:
        return f"b{x}"

    @app.task(bind=True)
    def a(self: Task, x: int) -> Any:
        raise self.replace(b.s(x))

    queued = b.apply_async((1,), countdown=3)  # still queued (its marker set) when a runs
    caller = a.delay(1)
    with run_worker(app):
        assert caller.get(timeout=15) == "b1"
        assert queued.get(timeout=15) == "b1"


def test_a_rescheduled_job_keeps_the_serializer_its_publish_chose(
    env: CeleryEnv, make_app: Any
) -> None:
    app = make_app(accept_content=["json", "pickle"], result_accept_content=["json", "pickle"])
    spans: list[Span] = []
    mutex = threading.Lock()
    first_in = threading.Event()

    @app.task(bind=True, base=SingletonTask, lock_key="batch:{ids}", dedupe=None)
    def batch(self: Task, ids: Any, hold: float) -> str:
        start = time.monotonic_ns()
        first_in.set()
        time.sleep(hold)
        with mutex:
            spans.append(Span(self.request.id, start, time.monotonic_ns()))
        return "done"

    with run_worker(app, concurrency=2):
        first = batch.apply_async(((1, 2), 1.5), serializer="pickle")
        assert first_in.wait(15)
        second = batch.apply_async(((1, 2), 0.1), serializer="pickle")
        assert first.get(timeout=20) == "done"
        assert second.get(timeout=20) == "done"
    assert len(spans) == 2
    assert_no_overlap(spans)


def test_an_active_marker_follows_a_retry_with_other_arguments(
    env: CeleryEnv, make_app: Any
) -> None:
    app = make_app()
    ran: list[str] = []

    @app.task(bind=True, base=SingletonTask, lock_key="act:{x}", dedupe="active")
    def act(self: Task, x: str) -> str:
        ran.append(x)
        if x == "A":
            raise self.retry(args=("B",), countdown=0.1)
        return x

    with run_worker(app):
        job = act.delay("A")
        assert job.get(timeout=15) == "B"
        again = act.delay("A")
        assert again.id != job.id, "a publish of A returned the job that ran B"
        wait_for(lambda: ran.count("A") == 2, timeout=15, message="the second A ran")
        again.get(timeout=15)


@pytest.mark.parametrize(
    "eta",
    ["iso string", "naive datetime"],
)
def test_the_marker_outlives_an_eta_given_as_a_string_or_naive(
    env: CeleryEnv, make_app: Any, eta: str
) -> None:
    # The worker reads a naive eta in the app's timezone: 60 s from now in UTC terms is
    # hours away in Los Angeles' (UTC-8 or -7).
    app = make_app(redlock_dedupe_ttl=2, timezone="America/Los_Angeles")

    @app.task(base=SingletonTask, lock_key="later:{n}")
    def later(n: int) -> int:
        return n

    when = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=60)
    value: Any = when.isoformat() if eta == "iso string" else when.replace(tzinfo=None)
    first = later.apply_async((1,), eta=value)
    ttls = _marker_ttls(env)
    assert len(ttls) == 3
    least = 55 if eta == "iso string" else 6 * 3600
    assert min(ttls) > least, ttls  # dedupe_ttl (2 s) + the wait, not 2 s alone
    assert later.apply_async((1,), eta=value).id == first.id


def test_arguments_no_worker_can_decode_claim_no_marker(
    env: CeleryEnv, make_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("msgpack", reason="msgpack comes with the [test] extra")
    app = make_app(task_serializer="msgpack", accept_content=["msgpack", "json"])

    @app.task(base=SingletonTask, lock_key="odd:{n}")
    def odd(n: int, table: Any) -> int:
        return n

    with caplog.at_level(logging.WARNING, logger="celery_redlock.task"):
        first = odd.apply_async((1, {1: "a"}))
    assert _marker_ttls(env) == []
    assert "published without dedupe" in caplog.text
    assert odd.apply_async((1, {1: "a"})).id != first.id


@pytest.mark.parametrize("masters", [4], indirect=True)
def test_racing_publishes_of_one_job_id_publish_it_once(env: CeleryEnv, make_app: Any) -> None:
    # Found by a hostile review: two callers publishing one job id at once each created
    # its marker on 2 of 4 masters; both read "already there" and neither published it.
    # Each caller's claim is replayed here, the other's markers written ahead of it.
    app = make_app()

    @app.task(base=SingletonTask, lock_key="r:{x}")
    def job(x: int) -> int:
        return x

    published: list[str] = []

    def note(headers: Any = None, **_: Any) -> None:
        published.append(headers["id"])

    after_task_publish.connect(note, weak=False)
    try:
        client = redlock_for(app)
        key = job._publish_key(job.redlock_options(), (1,), {}, {})
        name = client._claim_name(key, job.dedupe_suffix())
        for mine in ({0, 1}, {2, 3}):
            for i, server in enumerate(env.masters):
                with server.client() as conn:
                    conn.delete(name)
                    if i not in mine:
                        conn.set(name, "job-x", px=60_000)  # the other caller came first
            assert job.apply_async((1,), task_id="job-x").id == "job-x"
    finally:
        after_task_publish.disconnect(note)
    assert published == ["job-x"]  # once: neither lost nor twice

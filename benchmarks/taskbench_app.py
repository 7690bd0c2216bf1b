"""The Celery app the task benchmark's worker runs (configured from environment variables).

BENCH_BROKER: broker URL (Redis or RabbitMQ); BENCH_QUEUE: the queue (default
``celery``); BENCH_MASTERS: comma-separated Redlock masters; BENCH_COUNTER: Redis URL
where every body counts itself (``INCR bench:done``); a body that sleeps (a duplicate
storm's) also records when it ran (``RPUSH bench:runs:<i>``), and one asked to stamp (the
latency section's) first pushes the time it started (``RPUSH bench:started``).

``raw rounds`` is the plain task with SingletonTask's three rounds sent around it by
:class:`~benchmarks.raw_rounds.RawRounds` (no library code): the publisher claims the
dedupe marker, then publishes; the pool process acquires before the body and sends the
release after it. The floor of a job in the same worker, under the same load.
"""

from __future__ import annotations

import os
import time
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Celery
from celery_once import QueueOnce
from celery_singleton import Singleton

from benchmarks.raw_rounds import (
    RawRounds,
    acquire_payload,
    claim_payload,
    lock_name,
    release_payload,
)
from celery_redlock import SingletonTask

app = Celery("taskbench", broker=os.environ["BENCH_BROKER"])
app.conf.update(
    redlock_redis_urls=os.environ["BENCH_MASTERS"].split(","),
    task_ignore_result=True,
    task_default_queue=os.environ.get("BENCH_QUEUE", "celery"),
    worker_prefetch_multiplier=8,
    # celery-singleton keeps its locks in this Redis; celery-once in the one below.
    singleton_backend_url=os.environ["BENCH_COUNTER"],
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": os.environ["BENCH_COUNTER"], "default_timeout": 300},
    },
)
_counter = redis.Redis.from_url(os.environ["BENCH_COUNTER"])


def _done(pause: float, i: int, stamp: bool) -> None:
    if stamp:
        # time.monotonic() is one clock for every process on Linux (CLOCK_MONOTONIC).
        _counter.rpush("bench:started", repr(time.monotonic()))
    if pause:
        # A storm body: record when it ran, per argument (one storm each), so the benchmark
        # counts this storm's bodies and checks that none overlapped.
        started = time.time()  # noqa: TID251 - compared across the worker's processes
        time.sleep(pause)
        _counter.rpush(f"bench:runs:{i}", f"{started:.6f} {time.time():.6f}")  # noqa: TID251
    _counter.incr("bench:done")


@app.task(name="bench.plain")
def plain(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


@app.task(name="bench.redlock", base=SingletonTask, lock_ttl=30)
def redlocked(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


@app.task(name="bench.redlock_active", base=SingletonTask, lock_ttl=30, dedupe="active")
def redlocked_active(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


@app.task(
    name="bench.redlock_skip", base=SingletonTask, lock_ttl=30, on_contention="skip", dedupe=None
)
def redlocked_skip(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


@app.task(name="bench.singleton", base=Singleton, lock_expiry=300)
def singleton(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


@app.task(name="bench.once", base=QueueOnce, once={"graceful": True})
def once(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    _done(pause, i, stamp)


_raw: dict[int, RawRounds] = {}  # per process: a pool process opens its own after the fork


def _rounds() -> RawRounds:
    pid = os.getpid()
    rounds = _raw.get(pid)
    if rounds is None:
        addresses = [urlsplit(url) for url in os.environ["BENCH_MASTERS"].split(",")]
        rounds = _raw[pid] = RawRounds((a.hostname or "", a.port or 6379) for a in addresses)
    return rounds


def _raw_names(i: int) -> tuple[str, str, str]:
    """The lock, its dedupe marker and the job's id, from the argument: the same in the
    publisher and the pool process, without reading the request."""
    lock = lock_name("bench.raw", i)
    return lock, f"{lock}:dedupe:bench.raw", f"{i:036d}"


@app.task(name="bench.raw")
def raw(i: int, pause: float = 0.0, stamp: bool = False) -> None:
    rounds = _rounds()
    lock, marker, task_id = _raw_names(i)
    token = f"{i:032x}"
    rounds.round(acquire_payload(lock, marker, token, task_id))
    try:
        _done(pause, i, stamp)
    finally:
        rounds.round(release_payload(lock, token), wait=False)


class RawPublisher:
    """Publishes :func:`raw` as SingletonTask publishes: the dedupe claim first."""

    name = "bench.raw"

    def apply_async(self, args: tuple[int, ...]) -> Any:
        _, marker, task_id = _raw_names(args[0])
        _rounds().round(claim_payload(marker, task_id))
        return raw.apply_async(args, task_id=task_id)


TASKS: dict[str, Any] = {
    "plain task": plain,
    "raw rounds": RawPublisher(),
    "SingletonTask": redlocked,
    "celery-singleton": singleton,
    "celery-once": once,
}

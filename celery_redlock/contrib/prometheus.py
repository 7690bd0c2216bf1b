"""Prometheus metrics for celery-redlock (``pip install "celery-redlock[prometheus]"``).

In the Celery module, after the app is made::

    from celery_redlock.contrib import prometheus

    prometheus.install(app, port=9808)

Every worker (and beat) process then serves ``http://<host>:9808/metrics``. Under the
prefork pool the task bodies run in child processes: set ``PROMETHEUS_MULTIPROC_DIR`` to an
empty directory in the worker's environment (prometheus-client's multiprocess mode), so the
main process serves what every child counted; without it, a prefork worker logs a WARNING at
start and serves only its main process's metrics. Give each worker on a host its own port.

The metrics (all prefixed ``celery_redlock_``; ``task`` is the task's name, never its key,
which would make a series per argument):

=========================================  =========  =========================================
``acquire_total{task,outcome}``            counter    outcome: acquired, contended, unavailable
``acquire_wait_seconds{task}``             histogram  time an acquire round took
``hold_seconds{task}``                     histogram  acquire to release
``rescheduled_seconds{task}``              histogram  first reschedule to acquire (0 if none)
``contention_reschedules_total{task}``     counter    reschedules because the key was held
``contention_delay_seconds_total{task}``   counter    their backoff delays, summed
``contended_total{task,action}``           counter    contention by action (retry, skip, ...)
``lock_lost_total{task}``                  counter    locks lost while the body ran
``duplicates_dropped_total{task,stage}``   counter    publish dedupes and worker-side drops
``renewal_margin_seconds``                 histogram  validity left when a renewal was sent
``renewal_round_seconds``                  histogram  how long renewal rounds took
``master_up{master}``                      gauge      1 while the master answers (0 if any
                                                      live process sees it down)
``beat_leader``                            gauge      1 in the beat process that leads
=========================================  =========  =========================================

prometheus-client is used rather than a hand-written exposition format: it implements the
text format, the multiprocess aggregation and the HTTP server that scrapers expect.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from celery import signals as celery_signals

try:
    from prometheus_client import (
        REGISTRY,
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        multiprocess,
        start_http_server,
    )
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "celery_redlock.contrib.prometheus needs prometheus-client: "
        'pip install "celery-redlock[prometheus]"'
    ) from exc

from .. import signals
from ..exceptions import ImproperlyConfigured
from ..redact import guard

__all__ = ["install"]

logger = guard(logging.getLogger("celery_redlock.prometheus"))  # see celery_redlock.redact

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Waits and holds: from a 1 ms acquire to a day-long job.
_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600, 3600, 86400)
#: Renewal margins and rounds: seconds to milliseconds.
_RENEWAL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

ACQUIRE = Counter(
    "celery_redlock_acquire", "Acquire outcomes before a task body", ["task", "outcome"]
)
ACQUIRE_WAIT = Histogram(
    "celery_redlock_acquire_wait_seconds",
    "Time an acquire round took",
    ["task"],
    buckets=_DURATION_BUCKETS,
)
HOLD = Histogram(
    "celery_redlock_hold_seconds",
    "Time from acquire to release",
    ["task"],
    buckets=_DURATION_BUCKETS,
)
RESCHEDULED_FOR = Histogram(
    "celery_redlock_rescheduled_seconds",
    "From a job's first reschedule (contention, outage, its own earlier run) to its acquire",
    ["task"],
    buckets=_DURATION_BUCKETS,
)
RESCHEDULES = Counter(
    "celery_redlock_contention_reschedules", "Reschedules because the key was held", ["task"]
)
RESCHEDULE_DELAY = Counter(
    "celery_redlock_contention_delay_seconds",
    "Backoff delay of contention reschedules, summed",
    ["task"],
)
CONTENDED = Counter(
    "celery_redlock_contended", "Contention by the action taken", ["task", "action"]
)
LOST = Counter("celery_redlock_lock_lost", "Locks lost while the task body ran", ["task"])
DUPLICATES = Counter(
    "celery_redlock_duplicates_dropped", "Duplicate jobs dropped", ["task", "stage"]
)
RENEWAL_MARGIN = Histogram(
    "celery_redlock_renewal_margin_seconds",
    "Validity a lease had left when its renewal was sent",
    buckets=_RENEWAL_BUCKETS,
)
RENEWAL_ROUND = Histogram(
    "celery_redlock_renewal_round_seconds",
    "Time renewal rounds took",
    buckets=_RENEWAL_BUCKETS,
)
MASTER_UP = Gauge(
    "celery_redlock_master_up",
    "1 while the master answers this process (0 if any live process sees it down)",
    ["master"],
    multiprocess_mode="livemin",
)
BEAT_LEADER = Gauge(
    "celery_redlock_beat_leader",
    "1 in the beat process that leads",
    multiprocess_mode="livemax",
)


def _task_name(sender: Any) -> str:
    name = getattr(sender, "name", None)
    return name if isinstance(name, str) else "unknown"


def _on_acquired(
    sender: Any = None, waited: float = 0.0, rescheduled_for: float = 0.0, **_: Any
) -> None:
    task = _task_name(sender)
    ACQUIRE.labels(task, "acquired").inc()
    ACQUIRE_WAIT.labels(task).observe(max(0.0, float(waited)))
    RESCHEDULED_FOR.labels(task).observe(max(0.0, float(rescheduled_for)))


def _on_contended(
    sender: Any = None, action: str = "", countdown: float | None = None, **_: Any
) -> None:
    task = _task_name(sender)
    ACQUIRE.labels(task, "contended").inc()
    CONTENDED.labels(task, action or "unknown").inc()
    if action == "retry":
        RESCHEDULES.labels(task).inc()
        if countdown:
            RESCHEDULE_DELAY.labels(task).inc(max(0.0, float(countdown)))


def _on_unavailable(sender: Any = None, **_: Any) -> None:
    ACQUIRE.labels(_task_name(sender), "unavailable").inc()


def _on_released(sender: Any = None, held_for: float | None = None, **_: Any) -> None:
    if held_for is not None:
        HOLD.labels(_task_name(sender)).observe(max(0.0, float(held_for)))


def _on_lost(sender: Any = None, **_: Any) -> None:
    LOST.labels(_task_name(sender)).inc()


def _on_duplicate(sender: Any = None, stage: str = "", **_: Any) -> None:
    DUPLICATES.labels(_task_name(sender), stage or "unknown").inc()


def _on_renewed(took: float = 0.0, margin: float = 0.0, **_: Any) -> None:
    RENEWAL_ROUND.observe(max(0.0, float(took)))
    RENEWAL_MARGIN.observe(max(0.0, float(margin)))


def _on_master_state(master: str = "", up: bool = True, **_: Any) -> None:
    MASTER_UP.labels(master).set(1 if up else 0)


def _on_beat_status(status: str = "", **_: Any) -> None:
    BEAT_LEADER.set(1 if status == "leader" else 0)


_RECEIVERS = (
    (signals.lock_acquired, _on_acquired),
    (signals.lock_contended, _on_contended),
    (signals.lock_unavailable, _on_unavailable),
    (signals.lock_released, _on_released),
    (signals.lock_lost, _on_lost),
    (signals.duplicate_dropped, _on_duplicate),
    (signals.lock_renewed, _on_renewed),
    (signals.master_state, _on_master_state),
    (signals.beat_status, _on_beat_status),
)

_served: dict[int, Any] = {}
_serve_lock = threading.Lock()


def _registry() -> Any:
    """What the HTTP server exposes: every process's files in multiprocess mode."""
    if os.environ.get(MULTIPROC_ENV):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        return registry
    return REGISTRY


def _serve(port: int, addr: str) -> None:
    with _serve_lock:
        if port in _served:
            return
        try:
            _served[port] = start_http_server(port, addr=addr, registry=_registry())
        except OSError as exc:
            logger.error(
                "metrics: cannot serve on %s:%d (%s); give each process on a host its own port",
                addr,
                port,
                exc,
            )
            return
    logger.info("celery-redlock metrics on http://%s:%d/metrics", addr, port)


def _masters_up(app: Any) -> None:
    """Every configured master starts as up (transitions are all the core reports)."""
    from ..client import redlock_for

    try:
        for master in redlock_for(app).masters:
            MASTER_UP.labels(master.name).set(1)
    except Exception:  # bad settings are reported by the worker's own start-up check
        logger.debug("metrics: could not list the masters", exc_info=True)


def install(app: Any, port: int | None = None, addr: str = "0.0.0.0") -> None:
    """Count celery-redlock's signals as Prometheus metrics; serve them on ``port``.

    :param port: where the worker's (and beat's) main process serves ``/metrics``; None
        serves nothing (the metrics are still in prometheus-client's default registry, for
        an application that already exposes one).
    :param addr: the address to listen on.
    :raises ImproperlyConfigured: for a port outside 1-65535.
    """
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
    ):
        raise ImproperlyConfigured(f"port must be an int in [1, 65535] or None; got {port!r}")
    from ..wiring import install as install_redlock

    install_redlock(app)
    for signal, receiver in _RECEIVERS:
        signal.connect(receiver, dispatch_uid=f"celery_redlock.prometheus.{receiver.__name__}")

    def on_worker_init(sender: Any = None, **_: Any) -> None:
        pool = getattr(getattr(sender, "pool_cls", None), "__module__", "") or ""
        if "prefork" in pool and not os.environ.get(MULTIPROC_ENV):
            logger.warning(
                "metrics: the prefork pool's children count in their own processes; set %s "
                "to an empty directory in the worker's environment, or /metrics shows only "
                "the main process",
                MULTIPROC_ENV,
            )
        _masters_up(app)
        if port is not None:
            _serve(port, addr)

    def on_process_init(**_: Any) -> None:
        _masters_up(app)

    def on_process_shutdown(**_: Any) -> None:
        if os.environ.get(MULTIPROC_ENV):
            multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]

    def on_beat_init(**_: Any) -> None:
        BEAT_LEADER.set(0)
        if port is not None:
            _serve(port, addr)

    uid = f"celery_redlock.prometheus.{id(app)}"
    celery_signals.worker_init.connect(on_worker_init, dispatch_uid=f"{uid}.worker", weak=False)
    celery_signals.worker_process_init.connect(
        on_process_init, dispatch_uid=f"{uid}.process", weak=False
    )
    celery_signals.worker_process_shutdown.connect(
        on_process_shutdown, dispatch_uid=f"{uid}.shutdown", weak=False
    )
    celery_signals.beat_init.connect(on_beat_init, dispatch_uid=f"{uid}.beat", weak=False)

"""``install(app)``: connect celery-redlock to a Celery app, once.

It connects our handlers to Celery's signals (each with a ``dispatch_uid``, so
connecting twice is a no-op) and adds a worker bootstep that validates every
setting and every SingletonTask's options when the worker starts, so bad
configuration stops the worker at start, never at the first task.
"""

from __future__ import annotations

import logging
import threading
import weakref
from types import SimpleNamespace
from typing import Any

from celery import bootsteps
from celery import signals as celery_signals

from .exceptions import ImproperlyConfigured
from .settings import get_settings

__all__ = ["install", "validate_app"]

logger = logging.getLogger("celery_redlock.wiring")

_installed: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()


def install(app: Any) -> None:
    """Connect celery-redlock to ``app`` (idempotent; binding a SingletonTask calls it)."""
    with _lock:
        if app in _installed:
            return
        _installed.add(app)
    from .beat import DropDuplicateOccurrences

    app.steps["worker"].add(RedlockWorkerStep)
    app.steps["consumer"].add(DropDuplicateOccurrences)
    celery_signals.task_revoked.connect(
        _on_task_revoked, dispatch_uid="celery_redlock.revoked", weak=False
    )
    celery_signals.task_failure.connect(
        _on_task_failure, dispatch_uid="celery_redlock.failure", weak=False
    )
    celery_signals.worker_process_init.connect(
        _on_process_init, dispatch_uid="celery_redlock.process_init", weak=False
    )
    celery_signals.worker_process_shutdown.connect(
        _on_process_shutdown, dispatch_uid="celery_redlock.process_shutdown", weak=False
    )
    celery_signals.worker_shutdown.connect(
        _on_process_shutdown, dispatch_uid="celery_redlock.worker_shutdown", weak=False
    )
    celery_signals.beat_init.connect(
        _on_beat_init, dispatch_uid="celery_redlock.beat_init", weak=False
    )


def validate_app(app: Any) -> None:
    """Validate the app's settings and every registered SingletonTask's options.

    :raises ImproperlyConfigured: naming each bad setting or option.
    """
    from .task import SingletonTask

    settings = get_settings(app)  # validates every setting, misspelled names included
    for task in list(app.tasks.values()):
        if isinstance(task, SingletonTask):
            task.redlock_options()
    logger.info(
        "celery-redlock: %d master(s), quorum %d, prefix %r",
        len(settings.redis_urls),
        len(settings.redis_urls) // 2 + 1,
        settings.key_prefix,
    )


class RedlockWorkerStep(bootsteps.Step):  # type: ignore[misc]  # celery ships no type hints
    """Worker bootstep: validates configuration when the worker starts."""

    name = "celery_redlock.validate"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        validate_app(worker.app)
        super().__init__(worker, **kwargs)


def _singleton(sender: Any) -> Any:
    from .task import SingletonTask

    return sender if isinstance(sender, SingletonTask) else None


def _release_killed(task: Any, request: Any, why: str) -> None:
    """Free the lock of a task whose process died without cleanup (main process side)."""
    from .client import redlock_for
    from .task import DEDUPE_SUFFIX

    task_id = getattr(request, "id", None)
    if not task_id:
        return
    try:
        key = task.redlock_options().lock_key(
            getattr(request, "args", None) or (), getattr(request, "kwargs", None) or {}
        )
        redlock = redlock_for(task.app)
        if redlock.release_owned_by(key, "task_id", task_id):
            logger.info("%s[%s]: released %s after %s", task.name, task_id, key, why)
        redlock.unclaim(key, DEDUPE_SUFFIX, task_id)
    except Exception:
        logger.warning("%s[%s]: could not release after %s", task.name, task_id, why, exc_info=True)


def _on_process_init(**_: Any) -> None:
    """In a prefork pool process: Celery kills a run here at its hard time limit."""
    from . import task

    task._time_limits_enforced = True


def _on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    task = _singleton(sender)
    if task is not None and request is not None:
        _release_killed(task, request, "revoke" + (" with terminate" if terminated else ""))


def _on_task_failure(
    sender: Any = None, exception: Any = None, task_id: Any = None, **kw: Any
) -> None:
    from billiard.exceptions import WorkerLostError
    from celery.exceptions import TimeLimitExceeded

    task = _singleton(sender)
    if task is None or not isinstance(exception, WorkerLostError | TimeLimitExceeded):
        return
    # Sent by the main process when the pool child died or hit its hard limit.
    request = SimpleNamespace(id=task_id, args=kw.get("args"), kwargs=kw.get("kwargs"))
    _release_killed(task, request, type(exception).__name__)


def _on_process_shutdown(**_: Any) -> None:
    from .lock.heartbeat import _engine

    if _engine is not None:
        _engine.release_all()


def _on_beat_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None or app not in _installed:
        return
    from .beat import on_beat_init

    try:
        validate_app(app)
        sender._redlock_leader = on_beat_init(sender)
    except ImproperlyConfigured as exc:
        logger.critical("celery-redlock: %s", exc)
        # Signal.send swallows Exception subclasses; SystemExit stops beat at start.
        raise SystemExit(f"celery-redlock: {exc}") from exc

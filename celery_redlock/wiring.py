"""``install(app)``: connect celery-redlock to a Celery app, once.

It connects our handlers to Celery's signals (each with a ``dispatch_uid``, so
connecting twice is a no-op) and adds a worker bootstep that validates every
setting and every SingletonTask's options when the worker starts, so bad
configuration stops the worker at start, never at the first task.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from types import SimpleNamespace
from typing import Any

from celery import bootsteps
from celery import signals as celery_signals

from .exceptions import ImproperlyConfigured
from .redact import guard
from .settings import get_settings

__all__ = ["install", "validate_app"]

logger = guard(logging.getLogger("celery_redlock.wiring"))  # see celery_redlock.redact

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
    celery_signals.worker_process_shutdown.connect(
        _on_process_shutdown, dispatch_uid="celery_redlock.process_shutdown", weak=False
    )
    celery_signals.worker_shutdown.connect(
        _on_process_shutdown, dispatch_uid="celery_redlock.worker_shutdown", weak=False
    )
    celery_signals.beat_init.connect(
        _on_beat_init, dispatch_uid="celery_redlock.beat_init", weak=False
    )
    _forward_core_events()


def _forward_master_state(**arguments: Any) -> None:
    from . import signals

    signals.master_state.send(sender=None, **arguments)


def _forward_lock_renewed(**arguments: Any) -> None:
    from . import signals

    if signals.lock_renewed.receivers:
        signals.lock_renewed.send(sender=None, **arguments)


def _forward_core_events() -> None:
    """Re-send the lock core's events (it imports no Celery) as our Celery signals."""
    from .lock import events

    events.subscribe("master_state", _forward_master_state)
    events.subscribe("lock_renewed", _forward_lock_renewed)


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


#: This worker's node name (``-n``), which its pool's runs write into their locks'
#: metadata; set when the worker starts (see :func:`_same_worker`).
_worker_nodename: str | None = None


class RedlockWorkerStep(bootsteps.Step):  # type: ignore[misc]  # celery ships no type hints
    """Worker bootstep: validates configuration when the worker starts, and wraps its
    ``revoke`` control commands so a revoked waiting job's dedupe marker goes at once
    (see :mod:`celery_redlock.revoke`)."""

    name = "celery_redlock.validate"

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        global _worker_nodename
        validate_app(worker.app)
        _worker_nodename = getattr(worker, "hostname", None)
        from .softlimit import set_worker_limits

        # Before the pool forks: its processes hold a soft limit back for half the time to
        # the hard one (see celery_redlock.softlimit), which these options may set.
        set_worker_limits(
            getattr(worker, "time_limit", None), getattr(worker, "soft_time_limit", None)
        )
        from .revoke import wrap_revoke_commands

        wrap_revoke_commands()
        from celery.apps.worker import Worker

        # `celery worker` (not an in-process test worker, which is no apps.worker.Worker),
        # and any worker whose pool runs tasks in child processes: each child would keep
        # its own lock table (an in-process test worker with pool="prefork" included).
        settings = get_settings(worker.app)
        if settings.backend == "memory":
            from .memory import refuse_in_shared_process

            if isinstance(worker, Worker):
                refuse_in_shared_process(settings.backend_force, "a celery worker")
            elif _forks_children(worker):
                refuse_in_shared_process(
                    settings.backend_force,
                    "a worker with a prefork pool (each child process keeps its own locks)",
                )
        super().__init__(worker, **kwargs)


def _forks_children(worker: Any) -> bool:
    """Whether ``worker``'s pool runs tasks in child processes (prefork)."""
    pool = getattr(worker, "pool_cls", None)
    where = pool if isinstance(pool, str) else getattr(pool, "__module__", "")
    return "prefork" in str(where) or "processes" in str(where)


def _singleton(sender: Any) -> Any:
    from .task import SingletonTask

    return sender if isinstance(sender, SingletonTask) else None


#: Seconds between two looks of the main process at a revoked run's pool process.
ENDED_POLL = 0.05
#: Seconds between two reads of whether a revoked run still holds its lock.
HELD_POLL = 1.0
_HAS_PROC = os.path.exists("/proc/self/stat")


def _release_killed(task: Any, request: Any, why: str) -> None:
    """Free the lock of a run that cannot release it itself, once that run has ended.

    Main process side, for a run revoked with terminate or lost with its pool process.
    The lock is read once (its token, and the task id, host and pid its holder wrote);
    only a lock held by this task id on this machine is touched. Once that pid has
    exited it is released by its token, so a later holder (a redelivery of the same
    task id included) is never freed. While the process lives (a soft kill such as
    SIGUSR1, whose body may run its cleanup; a threads or solo pool, which cannot kill a
    run) its run releases the lock itself when its body ends, and nothing is done here.
    """
    from .client import redlock_for

    task_id = getattr(request, "id", None)
    if not task_id:
        return
    try:
        key = task.redlock_options().lock_key(
            getattr(request, "args", None) or (), getattr(request, "kwargs", None) or {}
        )
        found = redlock_for(task.app).holder(key, ("task_id", "host", "pid"))
    except Exception:
        logger.warning("%s[%s]: could not release after %s", task.name, task_id, why, exc_info=True)
        return
    if found is None:
        logger.info("%s[%s]: %s was already free after %s", task.name, task_id, key, why)
        task._drop_dedupe_marker(key, None, task_id, why)
        return
    token, meta = found
    if meta["task_id"] != task_id:
        # Another job holds the key (this one was revoked while queued or waiting on
        # contention): its lock is not ours to free, but this job's own marker is.
        task._drop_dedupe_marker(key, None, task_id, why)
        return
    if not _same_worker(meta["host"], request) or not meta["pid"].isdigit():
        return  # a run of this job on another worker (a redelivery elsewhere)
    pid = int(meta["pid"])
    if not _process_alive(pid):
        _release_token(task, key, token, task_id, why)
        return
    threading.Thread(
        target=_release_after_exit,
        args=(task, key, token, task_id, pid, why),
        name=f"redlock-release-{task_id}",
        daemon=True,
    ).start()


def _same_worker(host: str, request: Any) -> bool:
    """Whether a lock whose metadata names ``host`` was taken by this worker's pool.

    The run writes its worker's node name (``-n name@host``, whatever the host part says);
    the main process compares it with its own, so a custom node name (``-n a@myservice``)
    is recognised. Without a node name, the machine's host name is compared.
    """
    node = getattr(request, "hostname", None)
    if node:
        return bool(host == node)
    return host.rpartition("@")[2] == socket.gethostname()


def _release_after_exit(task: Any, key: str, token: str, task_id: str, pid: int, why: str) -> None:
    """Wait (on its own thread) until ``pid`` exited, then release; stop watching when
    the lock no longer holds ``token`` (the run ended and released it)."""
    from .client import redlock_for

    next_read = time.monotonic() + HELD_POLL
    while _process_alive(pid):
        time.sleep(ENDED_POLL)
        if time.monotonic() >= next_read:
            next_read = time.monotonic() + HELD_POLL
            try:
                found = redlock_for(task.app).holder(key, ("task_id",))
            except Exception:  # noqa: BLE001 - look again at the next read
                continue
            if found is None or found[0] != token:
                logger.info(
                    "%s[%s]: %s was released by its run, or expired, after %s",
                    task.name,
                    task_id,
                    key,
                    why,
                )
                return
    _release_token(task, key, token, task_id, why)


def _release_token(task: Any, key: str, token: str, task_id: str, why: str) -> None:
    from .client import redlock_for

    try:
        if redlock_for(task.app).release_token(key, token):
            logger.info("%s[%s]: released %s after %s", task.name, task_id, key, why)
        else:
            # Expired meanwhile (a hard time limit caps the lock at the limit) or taken
            # over: nothing of this run is left to free.
            logger.info("%s[%s]: %s was already free after %s", task.name, task_id, key, why)
    except Exception:
        logger.warning("%s[%s]: could not release after %s", task.name, task_id, why, exc_info=True)
    task._drop_dedupe_marker(key, None, task_id, why)


def _process_alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie (exited, not yet reaped by the pool) has ended:
    Linux says so in ``/proc/<pid>/stat``; elsewhere it counts as running until reaped."""
    if _HAS_PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                return stat.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
        except FileNotFoundError:
            return False
        except (OSError, IndexError):
            pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
    request = SimpleNamespace(
        id=task_id, args=kw.get("args"), kwargs=kw.get("kwargs"), hostname=_worker_nodename
    )
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
        settings = get_settings(app)
        if settings.backend == "memory":
            from .memory import refuse_in_shared_process

            refuse_in_shared_process(settings.backend_force, "beat")
        sender._redlock_leader = on_beat_init(sender)
    except ImproperlyConfigured as exc:
        logger.critical("celery-redlock: %s", exc)
        # Signal.send swallows Exception subclasses; SystemExit stops beat at start.
        raise SystemExit(f"celery-redlock: {exc}") from exc

"""One :class:`~celery_redlock.lock.Redlock` per Celery app, built from its settings."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .lock import Redlock
from .settings import RedlockSettings, get_settings

__all__ = ["redlock_for", "reset_clients"]

_clients: weakref.WeakKeyDictionary[Any, tuple[RedlockSettings, Redlock]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def redlock_for(app: Any) -> Redlock:
    """The app's Redlock client (created on first use; safe across fork).

    A new client is built when the app's settings object changes (tests reset it).
    With ``redlock_backend = "memory"`` it is a :class:`~celery_redlock.memory.MemoryRedlock`
    (in-process, for unit tests).
    """
    settings = get_settings(app)
    entry = _clients.get(app)
    if entry is not None and entry[0] is settings:
        return entry[1]
    with _lock:
        entry = _clients.get(app)
        if entry is None or entry[0] is not settings:
            client: Redlock
            if settings.backend == "memory":
                from .memory import MemoryRedlock

                client = MemoryRedlock(key_prefix=settings.key_prefix)
            else:
                client = Redlock(
                    list(settings.redis_urls),
                    key_prefix=settings.key_prefix,
                    node_timeout=settings.node_timeout,
                    clock_drift_factor=settings.clock_drift_factor,
                )
            if entry is not None:
                entry[1].close()
            entry = (settings, client)
            _clients[app] = entry
    return entry[1]


def reset_clients() -> None:
    """Close and forget every app's client (tests)."""
    with _lock:
        for _, client in list(_clients.values()):
            client.close()
        _clients.clear()

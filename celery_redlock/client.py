"""One :class:`~celery_redlock.lock.Redlock` per Celery app, built from its settings."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from .lock import Redlock
from .settings import RedlockSettings, get_settings

__all__ = ["redlock_for", "reset_clients"]

_clients: weakref.WeakKeyDictionary[Any, tuple[RedlockSettings, Redlock]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()
_NO_LAST: tuple[Callable[[], Any], Callable[[], Any]] = (lambda: None, lambda: None)
#: the last settings and client handed out, held weakly: settings objects are one per app
#: (and conf), so the same settings object means the same app's client, found without a
#: WeakKeyDictionary lookup (which makes a weak reference per call)
_last: tuple[Callable[[], Any], Callable[[], Any]] = _NO_LAST


def redlock_for(app: Any) -> Redlock:
    """The app's Redlock client (created on first use; safe across fork).

    A new client is built when the app's settings object changes (tests reset it).
    With ``redlock_backend = "memory"`` it is a :class:`~celery_redlock.memory.MemoryRedlock`
    (in-process, for unit tests).
    """
    return _client(app, get_settings(app))


def client_for(app: Any, settings: RedlockSettings) -> Redlock:
    """:func:`redlock_for` for a caller that has just looked ``app``'s settings up
    (``get_settings(app)``): one settings lookup per call, not two, when the client of
    those settings is the last one handed out (the usual case)."""
    found = _last_client(settings)
    if found is not None:
        return found
    # The lookup of record, with the app's settings of now: a reset since the caller
    # looked must not bring back (and install) a client of the settings it replaced.
    return redlock_for(app)


def _last_client(settings: RedlockSettings) -> Redlock | None:
    """The last client handed out, if it is the one of ``settings`` and still alive."""
    last_settings, last_client = _last
    if last_settings() is settings:
        found: Redlock | None = last_client()
        return found
    return None


def _client(app: Any, settings: RedlockSettings) -> Redlock:
    global _last
    found = _last_client(settings)
    if found is not None:
        return found  # the usual case: one app, asked on every publish and run
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
        _last = (weakref.ref(settings), weakref.ref(entry[1]))
    return entry[1]


def reset_clients() -> None:
    """Close and forget every app's client (tests)."""
    global _last
    with _lock:
        _last = _NO_LAST
        for _, client in list(_clients.values()):
            client.close()
        _clients.clear()

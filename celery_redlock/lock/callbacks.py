"""Runs the ``on_lost`` callbacks of lost leases, on a thread of their own.

A slow or failing callback must never delay renewal of the other leases, so the lease
that is lost (:meth:`Lease._lose`) hands its callbacks here instead of running them.
Its own module so that the lease and the renewal engine both use it without importing
each other: the lease is the one writer of its state, the engine only asks it to change.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..redact import guard

if TYPE_CHECKING:
    from .lease import Lease

__all__ = ["LostCallback", "dispatch_lost"]

logger = guard(logging.getLogger("celery_redlock.heartbeat"))  # see celery_redlock.redact

LostCallback = Callable[["Lease"], Any]


class _Dispatcher:
    """Runs lost-lease callbacks on their own thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Lease, list[LostCallback]]] = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name="redlock-lost-callbacks", daemon=True
        )
        self._thread.start()

    def put(self, lease: Lease, callbacks: list[LostCallback]) -> None:
        self._queue.put((lease, callbacks))

    def _run(self) -> None:
        while True:
            lease, callbacks = self._queue.get()
            for callback in callbacks:
                try:
                    callback(lease)
                except Exception:
                    logger.exception("on_lost callback %r failed for %r", callback, lease.key)


_dispatcher: _Dispatcher | None = None
_lock = threading.Lock()


def dispatch_lost(lease: Lease, callbacks: list[LostCallback]) -> None:
    """Run ``callbacks(lease)`` on the dispatcher thread (started on first use)."""
    global _dispatcher
    if not callbacks:
        return
    if _dispatcher is None:
        with _lock:
            if _dispatcher is None:
                _dispatcher = _Dispatcher()
    _dispatcher.put(lease, callbacks)


def _after_fork_in_child() -> None:
    global _dispatcher, _lock
    _dispatcher = None
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

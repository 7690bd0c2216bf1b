"""What the lock core tells observers: masters going down and up, renewals and their lag.

The core imports no Celery, so it cannot send Celery signals itself; the Celery layer
(``celery_redlock.wiring``) subscribes here and re-sends each event as a signal of
:mod:`celery_redlock.signals`, which is what users and the Prometheus exporter connect to.
Standalone users may subscribe directly.

Events and their keyword arguments:

``master_state``
    ``master`` (its name, without credentials), ``up`` (bool), ``error`` (why it went
    down; ``""`` when up). Sent on transitions only, never per operation.
``lock_renewed``
    ``key``, ``lease``, ``took`` (seconds the renewal round took), ``margin`` (seconds of
    validity the lease had left when the round was sent: the lag an SRE alerts on, as it
    nears 0 a slow master or a starved process is about to cost the lock).

An observer runs on the thread that saw the event (a caller's round, or the renewal
engine): it must be quick and must not take a lock. Its exceptions are logged, never
raised into the lock's work. With no observer, an event costs one dictionary lookup.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..redact import guard
from . import interrupts

__all__ = ["EVENTS", "emit", "listening", "subscribe", "unsubscribe"]

logger = guard(logging.getLogger("celery_redlock.lock"))  # see celery_redlock.redact

EVENTS = ("master_state", "lock_renewed")

Observer = Callable[..., None]

_observers: dict[str, tuple[Observer, ...]] = {}
_lock = threading.Lock()


def _known(event: str) -> str:
    if event not in EVENTS:
        raise ValueError(f"event must be one of {', '.join(EVENTS)}; got {event!r}")
    return event


def subscribe(event: str, observer: Observer) -> None:
    """Call ``observer(**arguments)`` on each ``event`` (subscribing twice is a no-op)."""
    with _lock:
        current = _observers.get(_known(event), ())
        if observer not in current:
            _observers[event] = (*current, observer)


def unsubscribe(event: str, observer: Observer) -> None:
    """Stop calling ``observer`` on ``event`` (no error when it was not subscribed)."""
    with _lock:
        current = _observers.get(_known(event), ())
        _observers[event] = tuple(o for o in current if o != observer)


def listening(event: str) -> bool:
    """Whether anyone observes ``event`` (to skip computing its arguments otherwise)."""
    return bool(_observers.get(event))


def emit(event: str, **arguments: Any) -> None:
    """Call every observer of ``event``; an observer's exception is logged, not raised."""
    for observer in _observers.get(event, ()):
        try:
            observer(**arguments)
        except interrupts.ASYNC:
            raise  # a signal's (a soft time limit) landing in an observer: the caller's
        except Exception:
            logger.exception("an observer of %s failed", event)

"""A revoked job's dedupe marker goes when its worker receives the revoke.

Celery sends ``task_revoked`` when it discards a revoked message, not when the revoke
arrives: a job the worker keeps in its timer (an ``eta``, a ``countdown``, a contention
reschedule) is discarded when its time comes, a job reserved behind busy pool processes
when one is free. Until then its dedupe marker (``"queued"`` or ``"active"``) made every
identical publish return the revoked job, which never runs::

    t0  worker holds J (waiting for its countdown); marker -> J
    t1  revoke(J) acknowledged by the worker
    t2  identical publish P -> returns J's id, nothing published
    t3  J's countdown ends: discarded as revoked, marker cleared; P never ran

So the worker's ``revoke`` and ``revoke_by_stamped_headers`` remote control commands are
wrapped (:func:`wrap_revoke_commands`): Celery's own handler runs first, unchanged
(``terminate``, ``signal``, its reply), then the marker of each revoked job this worker
holds and has not handed to its pool yet is removed, only where it still names that job.
This is done before the worker replies, so ``revoke(..., reply=True)`` returns after it.

A job handed to the pool keeps its marker: without ``terminate`` it runs anyway (Celery
cannot stop it), and a run that is killed frees its lock and marker through
``task_revoked``. A message no worker holds yet, still in the broker, keeps its marker
until a worker consumes and discards it (see the docs, "Enqueue dedupe").
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

from celery.utils.functional import maybe_list
from celery.worker import control
from celery.worker import state as worker_state
from celery.worker.request import Request

from .identity import OPTIONS_HEADER
from .redact import guard

__all__ = ["wrap_revoke_commands"]

logger = guard(logging.getLogger("celery_redlock.revoke"))  # see celery_redlock.redact

#: Set on our wrappers, so a command is wrapped once per process.
_WRAPPED = "_celery_redlock_unmarks"


def wrap_revoke_commands() -> None:
    """Wrap the worker's ``revoke`` and ``revoke_by_stamped_headers`` control commands
    (Celery's registry of remote control commands, ``celery.worker.control.Panel``) once
    per process. Commands another library replaced are wrapped too: theirs runs first."""
    for name, unmark in (
        ("revoke", _unmark_by_id),
        ("revoke_by_stamped_headers", _unmark_by_stamp),
    ):
        handler = control.Panel.data.get(name)
        if handler is None or getattr(handler, _WRAPPED, False):
            continue
        control.Panel.data[name] = _wrapped(handler, unmark)


def _wrapped(
    handler: Callable[..., Any], unmark: Callable[[Any, dict[str, Any]], None]
) -> Callable[..., Any]:
    @functools.wraps(handler)
    def command(state: Any, **arguments: Any) -> Any:
        reply = handler(state, **arguments)
        try:
            unmark(state, arguments)
        except Exception:  # never let a marker break Celery's revoke or its reply
            logger.warning(
                "celery-redlock: dedupe markers of revoked jobs not cleared", exc_info=True
            )
        return reply

    setattr(command, _WRAPPED, True)
    return command


def _unmark_by_id(state: Any, arguments: dict[str, Any]) -> None:
    ids = set(maybe_list(arguments.get("task_id")) or ())
    _unmark(r for r in _held(state) if r.id in ids)


def _unmark_by_stamp(state: Any, _arguments: dict[str, Any]) -> None:
    # The stamps revoked so far, these included, as Celery's handler stored them; a job
    # revoked by an earlier command lost its marker then: unclaim finds nothing.
    _unmark(r for r in _held(state) if _revoked_by_stamp(r))


def _held(state: Any) -> list[Any]:
    """Every request this worker holds and has not started, each once.

    Where Celery keeps them (as its ``scheduled`` and ``reserved`` inspect commands read
    them): the timer's entries (an eta or countdown), ``reserved_requests`` (waiting for a
    pool process), and the ``requests`` map. That map is keyed by task id: a contention
    reschedule of job J, received while J's run is still ending, is dropped from it when
    that run ends, so it alone would miss the job.
    """
    timer = getattr(getattr(state, "consumer", None), "timer", None)
    entries = _copy(getattr(getattr(timer, "schedule", None), "queue", None) or ())
    found: dict[int, Any] = {}
    for entry in entries:
        args = getattr(getattr(entry, "entry", None), "args", None) or ()
        if args and isinstance(args[0], Request):
            found[id(args[0])] = args[0]
    for held in (
        worker_state.reserved_requests,
        getattr(worker_state, "scheduled_requests", ()),  # Celery >= 5.6
        worker_state.requests.values(),
    ):
        for request in _copy(held):
            found[id(request)] = request
    return [r for r in found.values() if _not_started(r)]


def _copy(items: Iterable[Any]) -> list[Any]:
    """A list of ``items``, a set another thread may change (the timer's, the pool's)."""
    for _ in range(3):
        try:
            return list(items)
        except RuntimeError:  # changed size during iteration: look again
            continue
    return []


def _not_started(request: Any) -> bool:
    """Not running, and not handed to the pool (which runs it, revoked or not: a
    ``terminate`` kills it when it starts, and ``task_revoked`` frees it then)."""
    if request in worker_state.active_requests:
        return False
    # Celery's Request keeps the pool's handle of the job there once handed over.
    return getattr(request, "_apply_result", None) is None


def _revoked_by_stamp(request: Any) -> bool:
    """Whether one of ``request``'s stamps is revoked (Celery's ``Request.revoked`` test,
    without its side effects: it discards the job)."""
    stamps = getattr(request, "stamps", None) or {}
    for header, value in stamps.items():
        revoked = worker_state.revoked_stamps.get(header)
        if revoked is None or value is None:
            continue
        revoked = maybe_list(revoked)
        if any(v in revoked for v in (value if isinstance(value, list | tuple) else [value])):
            return True
    return False


def _unmark(requests: Iterable[Any]) -> None:
    from .task import SingletonTask

    for request in requests:
        task = getattr(request, "task", None)
        if not isinstance(task, SingletonTask):
            continue
        try:
            opts = task._options_with((request.request_dict or {}).get(OPTIONS_HEADER))
            key = opts.lock_key(request.args or (), request.kwargs or {})
        except Exception:  # its key cannot be built: neither could its marker's
            logger.warning(
                "%s[%s]: no dedupe key after revoke", task.name, request.id, exc_info=True
            )
            continue
        if task._drop_dedupe_marker(key, opts, request.id, "revoke"):
            logger.debug(
                "%s[%s]: dedupe marker of %s dropped on revoke", task.name, request.id, key
            )

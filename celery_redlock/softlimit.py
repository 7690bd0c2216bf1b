"""A soft time limit held back, for a bounded time, while SingletonTask publishes.

In a prefork pool's process, Celery's soft time limit is billiard's ``SIGUSR1`` handler
raising ``SoftTimeLimitExceeded`` wherever the job is (``revoke(terminate=True,
signal="SIGUSR1")`` sends the same). Landing right after a message went out, it reads as
a publish that failed: a caller that undoes a failed publish (drops the job's dedupe
marker) would leave a queued job that identical publishes no longer find, and a second
job would be published beside it. Whether the message went out cannot be told once the
exception has landed, so :func:`held_back` keeps it from landing there: while the call
runs, the handler is swapped for one that notes the signal, and the caller delivers it
once it knows the outcome.

A publish that does not return is not waited for without end: a broker that stops
answering would otherwise keep the soft limit from the job until its hard limit kills the
process, with the body's soft-limit handling never run. The hold lasts half the time
between the running task's soft and hard limits (:func:`hold_for`: the other half is left
to the body); :data:`HOLD_FOR` when no hard limit is known; nothing when only the hard
limit is (how much of it is left when the signal comes cannot be told), nor when the
running job cannot be found (its limits unknown); then the call is
interrupted by the soft limit, as it would have been without the hold (its outcome is
then unknown, as before). Its wake-up is the signal itself, sent again to the main
thread, so a system call blocked there returns (``EINTR``) and the handler runs. A soft
limit delivered into the call and swallowed there (a signal receiver's ``except
Exception``) is delivered again by the caller once the call returns.

Nothing here runs outside that case: in another pool, in a thread, or in a process
without billiard's handler (a web process, whose ``SIGUSR1`` may be its own), the call
just runs.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # (signal.signal, minus its Python frame)
import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .lock import interrupts
from .redact import guard

__all__ = ["HOLD_FOR", "held_back", "hold_for", "running_hold", "running_job", "set_worker_limits"]

logger = guard(logging.getLogger("celery_redlock.task"))

T = TypeVar("T")

#: Seconds a soft limit that came during a held call waits for the call to return before
#: it interrupts it, when the running task has no hard limit (see :func:`hold_for`). A
#: publish to a broker that answers takes milliseconds.
HOLD_FOR = 5.0

_SIGNAL: int | None = getattr(signal, "SIGUSR1", None)

#: The worker's own limits, (hard, soft) (``celery worker --time-limit --soft-time-limit``),
#: which its pool applies to jobs that carry none, and the task neither: set as the worker
#: starts, in its main process, before the pool forks (see :func:`set_worker_limits`).
_worker_limits: tuple[float | None, float | None] = (None, None)


def set_worker_limits(hard: float | None, soft: float | None) -> None:
    """Note the starting worker's own time limits (from its bootstep)."""
    global _worker_limits
    _worker_limits = (hard, soft)


class _Held:
    """The signal's stand-in handler while a call runs, and what it noted."""

    __slots__ = (
        "delivered",
        "done",
        "frame",
        "handler",
        "held",
        "hold_for",
        "mutex",
        "since",
        "timer",
    )

    def __init__(self, handler: Callable[[int, Any], Any], hold_for: float) -> None:
        self.handler = handler
        self.hold_for = hold_for
        self.mutex = threading.Lock()
        self.done = self.held = self.delivered = False
        self.frame: Any = None
        self.since = 0.0
        self.timer: threading.Timer | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.delivered:
            return
        if not self.held:
            # Noted, for the caller to deliver (also when it comes as the call returns).
            self.held, self.frame, self.since = True, frame, time.monotonic()
            if self.done:
                return
            try:
                timer = threading.Timer(self.hold_for, self._again)
                timer.daemon = True
                timer.start()
            except Exception:  # noqa: BLE001 - no thread for the wake-up: not held at all
                self.delivered = True
                self.handler(signum, frame)
                return
            self.timer = timer
            return
        if not self.done and time.monotonic() - self.since >= self.hold_for:
            # Still running long after the signal came: a stalled publish. Interrupted, as
            # it would have been without the hold.
            self.delivered = True
            self.handler(signum, frame)

    def _again(self) -> None:
        # On the timer's thread: the signal once more, to the main thread, so that a system
        # call blocked there returns and the stand-in runs (and delivers it).
        with self.mutex:
            if not self.done and _SIGNAL is not None:
                signal.pthread_kill(threading.main_thread().ident or 0, _SIGNAL)

    def finish(self) -> None:
        # Called once ``done`` is set (from then on the stand-in only notes, so no signal
        # run in here can raise). The lock waits for a wake-up being sent (see _again), so
        # that none is sent after the caller has put the real handler back.
        with self.mutex:
            pass
        if self.timer is not None:
            self.timer.cancel()


def running_job() -> tuple[Any, Any] | None:
    """The task of the job this worker process was given, and that job's request; None
    when it cannot be found. Not a task run inside it with ``apply()`` (eager, whose
    request Celery's ``current_worker_task`` also counts: the same task as the job's
    included) nor one called directly. Its limits are the ones the pool enforces."""
    from celery._state import _task_stack  # (Celery's own current_worker_task reads it)

    for task in reversed(getattr(_task_stack, "stack", None) or ()):
        for request in reversed(getattr(task.request_stack, "stack", None) or ()):
            if not request.called_directly and not request.is_eager:
                return task, request
    return None


def hold_for(task: Any, request: Any = None) -> float:
    """How long a soft limit may be held while ``task`` (the one running in this process,
    with its job's ``request``, by default ``task.request``: see :func:`running_job`)
    publishes.

    - Soft and hard limits both known: half the time between them, the other half left to
      the body's soft-limit handling.
    - A hard limit and no soft limit (the signal is then a revoke's, at a moment nothing
      tells): 0, not held, so that it never comes later than it would have.
    - No hard limit (nothing will kill the process): :data:`HOLD_FOR`.
    - No running job found (``task`` None: a body running in a greenlet of its own, whose
      stack of tasks is its own): 0, as its limits are not known.

    Its limits are those of the running job (the message's ``timelimit``), else the
    task's (which default to the app's), else the worker's own, in the order Celery's
    worker applies them.
    """
    if task is None:
        return 0.0
    if request is None:
        request = task.request
    hard, soft = getattr(request, "timelimit", None) or (None, None)
    conf = task.app.conf
    hard = hard or task.time_limit or _worker_limits[0] or conf.task_time_limit
    soft = soft or task.soft_time_limit or _worker_limits[1] or conf.task_soft_time_limit
    if not hard:
        return HOLD_FOR
    if not soft:
        return 0.0
    return max(0.0, (float(hard) - float(soft)) / 2)


def running_hold() -> float:
    """:func:`hold_for` the job this worker process runs (:func:`running_job`)."""
    found = running_job()
    return hold_for(None) if found is None else hold_for(*found)


def held_back(
    call: Callable[[], T],
    ends: tuple[type[BaseException], ...] = (),
    hold: float | Callable[[], float] = HOLD_FOR,
) -> tuple[T, Callable[[], None] | None]:
    """``call()`` with a soft time limit held back until it returns or raises, for at
    most ``hold`` seconds after it came (a number, or a function giving one: asked only
    when billiard's handler is there).

    Returns the call's result and, when the soft limit came meanwhile, the call that
    delivers it (the handler it was meant for), for the caller to make once it knows the
    outcome; also when it was delivered into the call (past the hold) and the call
    returned all the same (something in it swallowed it). When ``call`` raises, a soft
    limit held meanwhile is delivered at once, from its exception, unless the exception is
    one of ``ends`` (one that ends the job's delivery, as ``Retry``: then it is logged) or
    is the soft limit delivered into the call (or wraps it).
    """
    sig = _SIGNAL
    handler = signal.getsignal(sig) if sig is not None else None
    if (
        sig is None
        or not callable(handler)
        or getattr(handler, "__module__", None) != "billiard.pool"
        or threading.current_thread() is not threading.main_thread()
    ):
        return call(), None
    seconds = hold() if callable(hold) else hold
    if seconds <= 0:
        return call(), None  # not held: it would come later than the time left allows
    held = _Held(handler, seconds)
    # The swap and the swap back are the C function itself (signal.signal is a Python
    # function: an exception raised into this thread from another, LockLostInterrupt,
    # can land as it starts) and sit inside the try, so the real handler is always put
    # back.
    try:
        try:
            _signal.signal(sig, held)
            result = call()
        finally:
            # Set before anything that could run a signal's handler (a function's first
            # instruction may): from here the stand-in only notes, and never raises.
            held.done = True
            try:
                held.finish()
            finally:
                _signal.signal(sig, handler)  # (a signal still pending runs the stand-in)
    except BaseException as exc:
        if held.held and not (held.delivered and interrupts.wrapped(exc) is not None):
            if not isinstance(exc, ends):
                handler(sig, held.frame)  # the soft limit goes on, from the call's failure
            logger.info("soft time limit reached as the job was republished; it ends with that")
        raise
    if not held.held:
        return result, None
    frame = held.frame
    return result, lambda: handler(sig, frame)

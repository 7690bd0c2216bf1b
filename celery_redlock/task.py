"""SingletonTask: a renewed Redlock per task key around every run, plus enqueue dedupe.

Timeline of one run (worker side)::

    message arrives --> acquire key (1 round; also clears the "queued" dedupe
                        marker and writes owner metadata, same round)
        contended  --> retry: republish same id after full-jitter backoff
                       skip: store FAILURE(LockContended) or IGNORED (skip_result),
                       drop; raise: fail with LockContended. A canvas member waits
                       (retry) instead of being skipped; a redelivery whose own
                       earlier run (dead worker) holds the key waits for it.
        no quorum  --> republish after outage backoff (never runs unguarded)
        acquired   --> heartbeat renews every renew_every while the body runs
                   --> body returns / raises / retries / hits its soft limit
                   --> release (1 round; compare-and-delete, owner checked)

The publish side claims a dedupe marker (value: the job's task id) before the
message goes out, so a duplicate publish returns the job already queued.
"""

from __future__ import annotations

import contextvars
import ctypes
import datetime as dt
import importlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from celery import Task, states
from celery.app.task import Context
from celery.exceptions import Ignore, Retry
from celery.utils import uuid

from . import signals
from .client import client_for, redlock_for
from .exceptions import AlreadyQueued, LockContended, LockLost, QuorumUnavailable, RedlockError
from .identity import (
    DEDUPE_SUFFIX,
    OPTIONS_HEADER,
    UndecodableArguments,
    decode_call_options,
    dedupe_suffix,
    encode_call_options,
    message_serializer,
    wire_arguments,
)
from .keys import STORAGE_FORMAT, compile_lock_key, redis_key
from .lock import Lease, interrupts
from .lock.redlock import HolderState
from .lock.summary import log_limited
from .redact import guard, printable
from .settings import (
    UNSET,
    RedlockSettings,
    TaskOptions,
    get_settings,
    validate_call_options,
    validate_task_options,
    with_call_options,
)
from .softlimit import held_back, running_hold

__all__ = ["DEDUPE_SUFFIX", "OPTIONS_HEADER", "LockLostInterrupt", "SingletonTask"]

logger = guard(logging.getLogger("celery_redlock.task"))  # see celery_redlock.redact

#: Message header: how many times contention has rescheduled this job so far.
CONTENTION_HEADER = "redlock_contention"
#: Message header: ``"<unix time>;<retries>"`` of this job's first reschedule by
#: celery-redlock (contention, an outage, its own earlier run) since its last ``retry()``.
WAITING_HEADER = "redlock_waiting_since"
#: Message header: how many times an outage has rescheduled this job so far.
OUTAGE_HEADER = "redlock_outage"
#: Message header: the serializer a publish chose, when not the task's own (kept by
#: reschedules and retries).
SERIALIZER_HEADER = "redlock_serializer"
#: Message header set by beat (celery_redlock.beat.OCCURRENCE_HEADER).
OCCURRENCE_HEADER = "redlock_occurrence"
#: Message header: how many times this job waited for its own earlier run's lock (a
#: redelivery after its worker died mid-run; not contention).
OWN_RUN_HEADER = "redlock_own_run"
#: The counters of one wait for the lock: a ``retry()`` starts a new wait, so its message
#: carries none of them (Celery's retry copies the running job's headers).
_WAIT_COUNTERS = frozenset({CONTENTION_HEADER, OUTAGE_HEADER, OWN_RUN_HEADER})

#: Set while this library (or Celery's retry on our behalf) republishes a job that
#: already owns its dedupe marker: such publishes must never be deduplicated.
_republishing: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "redlock_republishing", default=False
)
_RetryHook = Callable[
    [Sequence[Any], Mapping[str, Any], dict[str, Any]], "list[tuple[str, TaskOptions]]"
]

#: Set by ``retry()``: frees the running job's lock right before its retry is published,
#: and only then (Celery may instead raise MaxRetriesExceededError, the body going on).
#: Called with the retry's arguments and publish options; returns the dedupe markers
#: (key, options) that now stand for the retry, dropped if its publish fails.
_before_republish: contextvars.ContextVar[_RetryHook | None] = contextvars.ContextVar(
    "redlock_before_republish", default=None
)


class LockLostInterrupt(LockLost):
    """Raised inside a running task whose lock was lost (``on_lock_lost="interrupt"``)."""

    def __init__(
        self,
        message: str = "the task's lock was lost while it ran; interrupted",
        *args: Any,
    ) -> None:
        super().__init__(message, *args)


class _Interrupter:
    """Raises :class:`LockLostInterrupt` in the task's thread, only while the body runs.

    In a thread (prefork, solo and threads pools) it is raised asynchronously with
    ``PyThreadState_SetAsyncExc``. Under gevent or eventlet monkey-patching (their pools)
    ``threading.get_ident()`` names a greenlet, not a thread: the task's greenlet is
    thrown into from its hub instead, at its next blocking call, unless its body ended
    before the hub got there.
    """

    def __init__(self) -> None:
        self._thread_id = threading.get_ident()
        self._greenlet = _green_current()
        self._mutex = threading.Lock()
        self._active = True
        self._ended = False

    def stop(self) -> None:
        with self._mutex:
            self._active = False
            self._ended = True

    def interrupt(self) -> bool:
        with self._mutex:
            if not self._active:
                return False
            self._active = False
            if self._greenlet is not None:
                _green_call_soon(self._greenlet[0], self._throw_green)
                return True
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self._thread_id), ctypes.py_object(LockLostInterrupt)
            )
            return True

    def _throw_green(self) -> None:
        # On the hub, before the task's greenlet runs again; one thread (the hub's), so
        # the flag cannot change under us, and the body may have ended since interrupt().
        if not self._ended and self._greenlet is not None:
            self._greenlet[1].throw(LockLostInterrupt)


def _green_current() -> tuple[str, Any] | None:
    """``("gevent"|"eventlet", the current greenlet)`` when that library monkey-patched
    ``threading`` (so our callbacks run on greenlets of the same hub); else None."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        return "gevent", importlib.import_module("gevent").getcurrent()
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        return "eventlet", importlib.import_module("eventlet.greenthread").getcurrent()
    return None


def _green_call_soon(kind: str, callback: Callable[[], None]) -> None:
    """Run ``callback`` on the hub of gevent or eventlet at its next turn (non-blocking)."""
    if kind == "gevent":
        importlib.import_module("gevent").get_hub().loop.run_callback(callback)
    else:
        importlib.import_module("eventlet.hubs").get_hub().schedule_call_global(0, callback)


#: Keys the worker's main process remembers as just dispatched (see drop_held_duplicate).
RECENT_KEYS_MAX = 10_000


def drop_held_duplicate(
    task: Any, message: Any, headers: Mapping[str, Any], recent: dict[str, float]
) -> bool:
    """Before a job goes to the pool: drop it if it would only be skipped there.

    Runs in the worker's main process. True (the caller acks the message) when
    ``task`` is a :class:`SingletonTask` with ``on_contention="skip"`` and the job's
    key is locked on a quorum right now: the job ends as its run would have ended it
    (its ``skip_result`` stored, ``lock_contended`` sent with action ``"skip"``, its dedupe
    marker cleared, a log line), without the trip through the pool and Celery's
    handling of ``Ignore``, which costs milliseconds per job in a storm of duplicates.

    Only a key dispatched within the last ``lock_ttl`` is read (a burst of duplicates);
    other jobs of such a task pay for building their key (a few µs), jobs of other
    tasks an ``isinstance`` check and their task's cached options. Any doubt (a body
    that does not decode, a key that cannot be built, masters unavailable, an ``eta``)
    lets the job through, and its run decides.
    """
    if not isinstance(task, SingletonTask) or headers.get("eta"):
        return False
    try:
        opts = task._options_with(headers.get(OPTIONS_HEADER))
        if opts.on_contention != "skip":
            return False
        args, kwargs, embed = message.decode()
        if _canvas_member(
            (embed or {}).get("callbacks"),
            (embed or {}).get("errbacks"),
            (embed or {}).get("chain"),
            (embed or {}).get("chord"),
            headers.get("group"),
        ):
            return False  # a canvas member waits instead of being skipped: its run decides
        key = opts.lock_key(args, kwargs)
    except Exception:  # noqa: BLE001 - the run reports it properly
        return False
    now = time.monotonic()
    last = recent.get(key)
    if last is None or now - last > opts.lock_ttl:
        if len(recent) >= RECENT_KEYS_MAX:
            recent.clear()
        recent[key] = now
        return False
    task_id = headers.get("id") or ""
    try:
        holder = redlock_for(task.app).holder_state(key, "task_id", task_id)
    except Exception:  # noqa: BLE001 - masters unavailable: the run decides
        return False
    recent[key] = now
    if holder != "other":
        # Free (the run takes it), or held by an earlier run of this very job (a
        # redelivery: its run waits for that lock).
        return False
    signals.lock_contended.send(
        sender=task, key=key, task_id=task_id, action="skip", countdown=None, attempt=0
    )
    request = Context(
        id=task_id,
        task=task.name,
        args=args,
        kwargs=kwargs,
        ignore_result=headers.get("ignore_result", False),
    )
    task._end_skipped(request, key, opts, "before dispatch")
    return True


def _canvas_member(callbacks: Any, errbacks: Any, chain: Any, chord: Any, group: Any) -> bool:
    """True for a job a canvas waits for: it links callbacks or errbacks, is a chain's
    step (``chain`` is a list, empty for the last step, None outside chains), or is a
    member of a chord's header or of a group."""
    return bool(callbacks or errbacks or chord or group) or chain is not None


def _holder(app: Any, key: str, task_id: str) -> HolderState:
    """Who holds the lock on ``key``, against job ``task_id`` (:meth:`Redlock.holder_state`
    by task id): ``"matches"`` for an earlier run of this job itself (a message redelivered
    after its worker died mid-run, ``acks_late``); ``"free"`` when no other holder has it
    (freed since the caller saw it held); ``"other"`` for anyone else, and when unsure (the
    masters cannot say)."""
    if not task_id:
        return "other"
    try:
        return redlock_for(app).holder_state(key, "task_id", task_id)
    except interrupts.ASYNC:
        raise  # the job's time is up: not an answer about the key (see _on_contended)
    except Exception:
        logger.warning("could not read the owner of %s", key, exc_info=True)
        return "other"


def _header(request: Any, name: str) -> Any:
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


def _rescheduled_since(request: Any) -> float | None:
    """When celery-redlock first rescheduled this job (since its last ``retry()``), as
    unix time; None when it never did. Wall clock: the reschedules may run on other hosts."""
    raw = _header(request, WAITING_HEADER)
    if not isinstance(raw, str):
        return None
    since, _, retries = raw.partition(";")
    try:
        if int(retries) != int(request.retries or 0):
            return None  # written before a retry(): that wait is over
        return float(since)
    except ValueError:
        return None


def _delay_of(options: Mapping[str, Any], tz: dt.tzinfo | None = None) -> float:
    """How long a publish waits before it can run (``countdown`` or ``eta``), in seconds.

    ``eta`` may be a datetime or an ISO 8601 string, as Celery accepts both. A naive one is
    read by the worker in the app's timezone (``tz``); here the later of the readings as
    UTC and in ``tz`` is taken: the marker then outlives the wait (it is cleared when the
    job starts anyway), never expires before it.
    """
    countdown = options.get("countdown")
    if countdown:
        try:
            return max(0.0, float(countdown))
        except (TypeError, ValueError):
            return 0.0  # Celery refuses it when publishing
    eta = options.get("eta")
    if isinstance(eta, str):
        try:
            eta = dt.datetime.fromisoformat(eta)
        except ValueError:
            return 0.0  # Celery refuses it when publishing
    if not isinstance(eta, dt.datetime):
        return 0.0
    if eta.tzinfo is None:
        eta = max(eta.replace(tzinfo=dt.timezone.utc), eta.replace(tzinfo=tz or dt.timezone.utc))
    return max(0.0, (eta - dt.datetime.now(dt.timezone.utc)).total_seconds())


class SingletonTask(Task):  # type: ignore[misc]  # celery ships no type hints
    """A task whose runs never overlap per lock key, and whose duplicates coalesce.

    Options (class attributes, so ``@app.task(base=SingletonTask, **options)``
    sets them; anything not set comes from ``app.conf.redlock_*``): ``lock_key``,
    ``unique_on``, ``lock_ttl``, ``on_contention``, ``contention_backoff``,
    ``max_contention_retries``, ``dedupe``, ``raise_on_duplicate``, ``on_lock_lost``,
    ``skip_result``. See the docs' configuration page for each. One publish may override
    ``dedupe``, ``lock_ttl``, ``on_contention`` and ``raise_on_duplicate``:
    ``apply_async(..., redlock={"on_contention": "skip"})``.
    """

    lock_key: ClassVar[Any] = UNSET
    unique_on: ClassVar[Any] = UNSET
    lock_ttl: ClassVar[Any] = UNSET
    on_contention: ClassVar[Any] = UNSET
    contention_backoff: ClassVar[Any] = UNSET
    max_contention_retries: ClassVar[Any] = UNSET
    dedupe: ClassVar[Any] = UNSET
    raise_on_duplicate: ClassVar[Any] = UNSET
    on_lock_lost: ClassVar[Any] = UNSET
    skip_result: ClassVar[Any] = UNSET

    _redlock_resolved: ClassVar[tuple[Any, TaskOptions] | None] = None

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Install the signal handlers and check ``lock_key`` when the task registers."""
        from .wiring import install

        install(app)
        raw_run = cls.__dict__.get("run")
        if raw_run is None or not getattr(cls, "name", None):
            return
        # A bad template (an unknown argument name) fails here, at registration.
        lock_key = None if cls.lock_key is UNSET else cls.lock_key
        unique_on = None if cls.unique_on is UNSET else cls.unique_on
        from .settings import run_function

        compile_lock_key(lock_key, run_function(cls), cls.name, unique_on=unique_on)

    # -- options ---------------------------------------------------------------

    def redlock_options(self) -> TaskOptions:
        """This task's lock options, resolved against ``app.conf`` (cached)."""
        return self._resolved_here()[1]

    def _resolved(self) -> tuple[RedlockSettings, TaskOptions]:
        """The app's settings and this task's options resolved against them: what
        :meth:`redlock_options` returns, with one settings lookup for both (cached)."""
        if (
            type(self).redlock_options is not SingletonTask.redlock_options
            or "redlock_options" in self.__dict__
        ):
            # A subclass, or the task itself (a test's mock.patch.object), decides its
            # options: every path asks it, as it always did.
            return get_settings(self.app), self.redlock_options()
        return self._resolved_here()

    def _resolved_here(self) -> tuple[RedlockSettings, TaskOptions]:
        settings = get_settings(self.app)
        resolved = type(self).__dict__.get("_redlock_resolved")
        if resolved is not None and resolved[0] is settings:
            return settings, resolved[1]
        options = validate_task_options(self, settings)
        type(self)._redlock_resolved = (settings, options)
        return settings, options

    @property
    def lease(self) -> Lease | None:
        """The lease held by the current run (None outside a run)."""
        return getattr(self.request, "redlock_lease", None)

    # -- publish side: enqueue dedupe ---------------------------------------------

    def apply_async(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """Publish the job, unless an identical one is already queued (see ``dedupe``).

        ``redlock={...}`` overrides ``dedupe``, ``lock_ttl``, ``on_contention`` and
        ``raise_on_duplicate`` for this job (checked as the task options are, unknown
        keys refused with :class:`~celery_redlock.ImproperlyConfigured`); they travel
        with the message, so the run, its contention reschedules and its retries keep
        them. With ``raise_on_duplicate`` a duplicate raises
        :class:`~celery_redlock.AlreadyQueued` instead of returning the queued job.
        """
        overrides = self._take_call_options(options)
        self._note_serializer(options)

        def publish(task_id: str | None) -> Any:
            return super(SingletonTask, self).apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )

        if _republishing.get():
            release = _before_republish.get()
            standing = release(args or (), kwargs or {}, options) if release is not None else []
            # (Only retry() and _republish get here, and they hold the soft limit back
            # around this call: see celery_redlock.softlimit.)
            sent: list[Any] = []
            try:
                sent.append(publish(task_id))
            except BaseException:
                if sent:
                    raise  # interrupted once it was out: the markers stand for it
                # The retry was not published, and the job ends here (Celery rejects it):
                # a marker standing for it would make identical publishes return a job
                # that never runs, until the marker's TTL.
                for key, opts in standing:
                    self._drop_dedupe_marker(key, opts, task_id, "a failed retry publish")
                raise
            return sent[0]
        if (
            link
            or link_error
            or options.get("chord")
            or options.get("group_id")
            # A chain's later steps carry ``chain`` (empty for the last one, whose id the
            # caller's AsyncResult already names) and link callbacks carry ``parent_id``:
            # both are canvas members, published by the worker on the canvas's behalf.
            or "chain" in options
            or options.get("parent_id")
            # Task.replace() publishes the replacement under the replaced job's id: the
            # caller waits on that id, so it must be published, never coalesced.
            or options.get("replaced_task_nesting")
            # A beat occurrence: the beat's claims and the workers' run claims send and
            # run it once. A marker would fold a late send (standing for several
            # occurrences) into a queued job that stands for one, and a beat killed
            # between its marker and its publish would leave a marker for a job that
            # does not exist, returned for every later occurrence until its TTL.
            or OCCURRENCE_HEADER in (options.get("headers") or {})
            or self.app.conf.task_always_eager
        ):
            return publish(task_id)
        settings, opts = self._resolved()
        opts = with_call_options(opts, overrides, settings)
        if opts.dedupe is None:
            return publish(task_id)
        unlike = self._unlike_its_duplicates(options)
        if unlike:
            # A queued job stands for its duplicates only if it runs, and stores its
            # result, as they would: one that may expire unrun, or whose result is kept
            # (or not) unlike the task's, neither takes identical publishes nor joins
            # another's marker (a caller's .get() would wait for ever, or its job never
            # run).
            logger.debug("%s: published without dedupe: %s", self.name, unlike)
            return publish(task_id)
        if task_id is not None and task_id == getattr(self.request, "id", None):
            return publish(task_id)  # a republish of the running job itself
        try:
            key = self._publish_key(opts, args or (), kwargs or {}, options)
        except UndecodableArguments as exc:
            # A marker would stand for a job no worker can run: identical publishes would
            # return it until the marker's TTL. Publish it without one, loudly.
            logger.warning("%s: published without dedupe: %s", self.name, exc)
            return publish(task_id)
        marker = self.dedupe_suffix()
        task_id = task_id or uuid()
        redlock = client_for(self.app, settings)
        try:
            holder, fresh = redlock.claim(
                key,
                marker,
                task_id,
                settings.dedupe_ttl + _delay_of(options, self.app.timezone),
                guard_for=0,
            )
        except (QuorumUnavailable, LockContended) as exc:
            logger.warning("dedupe of %s skipped, publishing %s anyway: %s", key, task_id, exc)
            return publish(task_id)
        if holder != task_id or not fresh:
            logger.info(
                "%s: duplicate of queued job %s not published (key %s)", self.name, holder, key
            )
            signals.duplicate_dropped.send(
                sender=self, key=key, task_id=task_id, stage="publish", existing_id=holder
            )
            if opts.raise_on_duplicate and holder != task_id:
                raise AlreadyQueued(
                    f"{self.name}: an identical job {holder} is already queued (key {key!r})",
                    key,
                    redlock.master_names,
                    {},
                    holder,
                )
            return self.AsyncResult(holder)
        published: list[Any] = []
        try:
            _, deliver = held_back(lambda: published.append(publish(task_id)), hold=running_hold)
        except BaseException:
            if published:
                raise  # interrupted once it was out: the marker stands for the queued job
            try:
                redlock.unclaim(key, marker, task_id)
            except Exception:
                logger.warning("could not clear dedupe marker of %s", key, exc_info=True)
            raise
        if deliver is not None:
            deliver()  # the caller's soft time limit, now that its job is queued and marked
        return published[0]

    def _unlike_its_duplicates(self, options: Mapping[str, Any]) -> str | None:
        """Why a publish with these options cannot stand for (or be folded into) an
        identical one, or None: an ``expires`` (its own or the task's, which Celery adds
        after this point), or an ``ignore_result`` other than the task's."""
        if options.get("expires", self.expires) is not None:
            return "it expires"
        ignore = options.get("ignore_result")
        if ignore is not None and bool(ignore) != bool(
            self.ignore_result
            if self.ignore_result is not None
            else self.app.conf.task_ignore_result
        ):
            return "its ignore_result differs from the task's"
        return None

    def _request_unlike(self, request: Any) -> str | None:
        """:meth:`_unlike_its_duplicates` for a running job, from its message."""
        return self._unlike_its_duplicates(
            {
                "expires": getattr(request, "expires", None),
                "ignore_result": getattr(request, "ignore_result", None),
            }
        )

    def dedupe_suffix(self) -> str:
        """The suffix of this task's dedupe markers, ``dedupe:<task name>``.

        Markers are per task: tasks sharing a ``lock_key`` share the lock, not a marker.
        """
        return dedupe_suffix(self.name)

    def clear_lock(self, *args: Any, **kwargs: Any) -> list[str]:
        """Force-delete the lock (and its metadata) that a call with these arguments takes.

        For an operator or a test, like celery-singleton's ``clear_locks``: no ownership
        check, a run holding the lock finds it lost at its next renewal (``lock_lost``).
        The fence counter is kept, so tokens keep increasing. Returns the Redis key names
        deleted (on at least one master); unreachable masters are logged.

        :raises QuorumUnavailable: no master answered.
        """
        key = self._publish_key(self.redlock_options(), args, kwargs, {})
        redlock = redlock_for(self.app)
        prefix = redlock.key_prefix
        return redlock.force_delete([redis_key(prefix, key), redis_key(prefix, key, "meta")])

    def clear_dedupe(self, *args: Any, **kwargs: Any) -> list[str]:
        """Force-delete this task's dedupe marker for these arguments (its queued job stays
        queued; the next identical publish is published). Returns what was deleted, as
        :meth:`clear_lock` does."""
        key = self._publish_key(self.redlock_options(), args, kwargs, {})
        redlock = redlock_for(self.app)
        return redlock.force_delete([redis_key(redlock.key_prefix, key, self.dedupe_suffix())])

    def _publish_key(
        self,
        opts: TaskOptions,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        options: Mapping[str, Any],
    ) -> str:
        """The lock key of a publish, built from the arguments as the worker will see them."""
        wire_args, wire_kwargs = wire_arguments(args, kwargs, message_serializer(self, options))
        return opts.lock_key(wire_args, wire_kwargs)

    def _note_serializer(self, options: dict[str, Any]) -> None:
        """A serializer chosen for this publish travels in a header, so the job's contention
        reschedules and retries (which Celery rebuilds from the request, without it) use
        it too: under another serializer its arguments, so its key, could change."""
        serializer = options.get("serializer")
        if not serializer or serializer == (self.serializer or self.app.conf.task_serializer):
            return
        headers = dict(options.get("headers") or {})
        headers[SERIALIZER_HEADER] = serializer
        options["headers"] = headers

    def _take_call_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """Pop ``redlock=`` from a publish's options, check it, put it in the headers."""
        raw = options.pop("redlock", None)
        if raw is None:
            return {}
        overrides = validate_call_options(raw, self.name, get_settings(self.app))
        headers = dict(options.get("headers") or {})
        headers[OPTIONS_HEADER] = encode_call_options(overrides)
        options["headers"] = headers
        return overrides

    def _options_with(self, header: object) -> TaskOptions:
        """This task's options with the per-call overrides a message header carries."""
        return self._settings_and_options(header)[1]

    def _settings_and_options(self, header: object) -> tuple[RedlockSettings, TaskOptions]:
        """The app's settings, and :meth:`_options_with` ``header``."""
        settings, opts = self._resolved()
        if header is None:
            return settings, opts
        try:
            overrides = validate_call_options(decode_call_options(header), self.name, settings)
        except ValueError as exc:
            logger.warning(
                "%s: %s header ignored, the task's options apply: %s",
                self.name,
                OPTIONS_HEADER,
                exc,
            )
            return settings, opts
        return settings, with_call_options(opts, overrides, settings)

    # -- worker side: the run-time lock ---------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)
        settings, opts = self._settings_and_options(_header(request, OPTIONS_HEADER))
        key = opts.lock_key(args, kwargs)
        task_id = request.id or ""
        redlock = client_for(self.app, settings)
        started = time.monotonic()
        meta = {
            "task_id": task_id,
            "task": self.name,
            "host": request.hostname or socket.gethostname(),
            "pid": str(os.getpid()),
            "acquired_at": f"{time.time():.3f}",  # noqa: TID251 - shown to operators
            "format": STORAGE_FORMAT,
        }
        for again in (True, False):  # again: once more at once if the key was freed
            try:
                lease = redlock.acquire(
                    key,
                    opts.lock_ttl,
                    auto_renew=True,
                    # Left to the lease when not configured: its default (a third of the
                    # TTL) follows the TTL if the body extends the lease to another one.
                    renew_every=opts.renew_every if opts.renew_every_set else None,
                    meta=meta,
                    clear_companion=(
                        (self.dedupe_suffix(), task_id) if opts.dedupe == "queued" else None
                    ),
                )
                break
            except LockContended as exc:
                self._on_contended(request, key, opts, exc, args, kwargs, again)
            except QuorumUnavailable as exc:
                # After a contended first try, whose failure deleted the "queued" marker
                # where it was granted: this one may have deleted it on other masters.
                self._on_unavailable(request, key, opts, exc, args, kwargs, not again)
                raise  # pragma: no cover
            except interrupts.ASYNC:
                # The job fails here, before its body (the acquire undid what it took):
                # no marker may name it, or identical publishes would return it.
                self._drop_dedupe_marker(key, opts, task_id, "its soft time limit")
                raise
        else:  # pragma: no cover - the second _on_contended raises
            raise AssertionError("acquire neither succeeded nor raised")
        try:
            if opts.dedupe == "active":
                lease.clear_on_release = (self.dedupe_suffix(), task_id)
            request.redlock_lease = lease
        except BaseException:
            # A soft time limit (or a revoke's signal) landing here, before the release
            # below is armed: nobody else would release this lease, and the renewal
            # engine would keep it for as long as this process lives.
            lease.release(wait=False)
            raise
        # From here every exit releases: an exception before the body (a soft time limit
        # landing here) would otherwise leave a lease that the heartbeat renews for ever.
        try:
            request.redlock_key = key
            interrupter = _Interrupter() if opts.on_lock_lost == "interrupt" else None
            request.redlock_interrupter = interrupter
            lease.on_lost(
                lambda lost: self._on_lost(lost, key, task_id, opts, interrupter), reports_loss=True
            )
            if signals.lock_acquired.receivers:  # its arguments cost: only for a receiver
                since = _rescheduled_since(request)
                signals.lock_acquired.send(
                    sender=self,
                    key=key,
                    lease=lease,
                    task_id=task_id,
                    waited=time.monotonic() - started,
                    rescheduled_for=0.0 if since is None else max(0.0, time.time() - since),  # noqa: TID251 - across hosts
                )
            return self.run(*args, **kwargs)
        except LockLostInterrupt as exc:
            if exc.key is not None:
                raise
            # The one _Interrupter raised asynchronously carries no context: say which
            # lock was lost and why, as every other RedlockError does.
            raise LockLostInterrupt(
                f"the lock on {key!r} was lost while the task ran "
                f"({lease.lost_reason or 'lost'}); interrupted",
                key,
                redlock.master_names,
            ) from None
        except QuorumUnavailable as exc:
            if exc.key != key or lease.fence_committed:
                raise
            # The body could not get its fencing token (too few masters answered the
            # fence round): it cannot write safely, so the job waits for the lock
            # service as it does when the outage comes before its run.
            self._release(request)
            self._on_unavailable(request, key, opts, exc, args, kwargs)
            raise  # pragma: no cover - _on_unavailable always raises
        finally:
            # The body is done: nothing needs ordering after the release, so it is
            # sent without waiting (the next round on these connections reads the
            # replies). retry() releases with a wait: its message must not race it.
            self._release(request, wait=False)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's retry; the lock is released right before the retry is published.

        So the retry never contends with this run, and when Celery publishes nothing
        (``MaxRetriesExceededError``, or ``exc`` re-raised) the run keeps its lock until
        it ends, and an ``"active"`` marker is cleared then. An eager retry runs inside
        this call, so its lock is released first.
        """
        request = self.request

        def release_for_retry(
            args: Sequence[Any], kwargs: Mapping[str, Any], options: dict[str, Any]
        ) -> list[tuple[str, TaskOptions]]:
            headers = options.get("headers")
            if isinstance(headers, Mapping) and not _WAIT_COUNTERS.isdisjoint(headers):
                # A new wait: contention before this retry must not count toward
                # max_contention_retries after it, nor lengthen its backoff.
                options["headers"] = {k: v for k, v in headers.items() if k not in _WAIT_COUNTERS}
            lease = getattr(request, "redlock_lease", None)
            if lease is None:
                return []
            lease.clear_on_release = None  # the job stays queued: an "active" marker too
            run_key = lease.key
            self._release(request)
            opts = self._options_with(_header(request, OPTIONS_HEADER))
            if request.is_eager or opts.dedupe is None:
                return []
            if self._unlike_its_duplicates(options):
                # The retry may expire unrun, or keeps its result unlike the task: it
                # stands for no duplicate (see apply_async), so no marker names it.
                if opts.dedupe == "active":
                    self._drop_dedupe_marker(run_key, opts, request.id)
                return []
            if opts.dedupe == "queued":
                # Its "queued" marker went when the run started; the job waits in the
                # queue again, so identical publishes coalesce into it again.
                key = self._claim_marker(opts, args, kwargs, request.id, options)
                return [] if key is None else [(key, opts)]
            key = self._publish_key(opts, args, kwargs, options)
            if key != run_key:
                # "active", retried with other arguments: the job is now the one of the
                # new key. Its marker moves, or the old key's would stand for a job that
                # will never run it (every identical publish returned it until the TTL).
                self._drop_dedupe_marker(run_key, opts, request.id)
                claimed = self._claim_marker(opts, args, kwargs, request.id, options)
                return [] if claimed is None else [(claimed, opts)]
            return [(run_key, opts)]  # "active", same key: its marker stays for the retry

        if request.is_eager:
            release_for_retry((), {}, {})
        serializer = _header(request, SERIALIZER_HEADER)
        if serializer and not kwargs.get("serializer"):
            kwargs["serializer"] = serializer
        token = _republishing.set(True)
        hook = _before_republish.set(release_for_retry)
        try:
            # The soft limit is held back through the release, the marker's claim and the
            # publish: a retry that went out keeps its marker, and its Retry ends this
            # delivery (the soft limit, with nothing left to stop, is logged).
            result, deliver = held_back(
                lambda: super(SingletonTask, self).retry(*args, **kwargs),
                # An eager retry's Retry ends nothing: apply() runs the task again, and
                # the job around it goes on.
                ends=() if request.is_eager else (Retry,),
                hold=running_hold,
            )
        finally:
            _before_republish.reset(hook)
            _republishing.reset(token)
        if deliver is not None:
            deliver()  # retry(throw=False): the body goes on, and so does its soft limit
        return result

    # -- helpers --------------------------------------------------------------------------

    def _release(self, request: Any, *, wait: bool = True) -> None:
        """Release the run's lease; ``wait=False`` sends it without awaiting replies."""
        lease: Lease | None = getattr(request, "redlock_lease", None)
        if lease is None:
            return
        interrupter = getattr(request, "redlock_interrupter", None)
        if interrupter is not None:
            interrupter.stop()
        confirmed: bool | None = None
        # The lease is forgotten only once released: an exception (a signal's) between
        # the two would otherwise leave it held, renewed, and known to nobody.
        try:
            if wait:
                confirmed = lease.release()
            else:
                lease.release(wait=False)
        except BaseException:
            # Cut short (a soft time limit landing here): sent once more, unawaited, or
            # the lock would stand for its TTL held by nobody.
            lease.release(wait=False)
            request.redlock_lease = None
            raise
        request.redlock_lease = None
        if signals.lock_released.receivers:
            signals.lock_released.send(
                sender=self,
                key=lease.key,
                lease=lease,
                task_id=request.id,
                held_for=time.monotonic() - lease.acquired_at,
                confirmed=confirmed,
            )

    def _on_lost(
        self,
        lease: Lease,
        key: str,
        task_id: str,
        opts: TaskOptions,
        interrupter: _Interrupter | None,
    ) -> None:
        logger.warning(
            "%s[%s]: lock %s lost while running (%s); policy %s",
            self.name,
            task_id,
            key,
            lease.lost_reason,
            opts.on_lock_lost,
        )
        signals.lock_lost.send(
            sender=self,
            key=key,
            lease=lease,
            task_id=task_id,
            reason=lease.lost_reason,
            policy=opts.on_lock_lost,
        )
        if interrupter is not None:
            interrupter.interrupt()

    def _republish(
        self,
        request: Any,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        countdown: float,
        header: dict[str, int],
        marker: tuple[str, TaskOptions] | None = None,
    ) -> None:
        """Publish the job again, ``countdown`` seconds from now, with ``header`` added.

        When the publish fails the job ends here (the error is its result): its dedupe
        marker (``marker``: its key and options) is dropped, or identical publishes
        would return a job that never runs until the marker's TTL.
        """
        headers = dict(getattr(request, "headers", None) or {})
        headers.update(header)
        if _rescheduled_since(request) is None:
            headers[WAITING_HEADER] = f"{time.time():.3f};{request.retries or 0}"  # noqa: TID251 - compared across hosts
        serializer = _header(request, SERIALIZER_HEADER)
        options = {"serializer": serializer} if serializer else {}
        sent: list[Any] = []
        token = _republishing.set(True)
        try:
            signature = self.signature_from_request(
                request, args, kwargs, countdown=countdown, retries=request.retries, headers=headers
            )
            _, deliver = held_back(
                lambda: sent.append(signature.apply_async(**options)), hold=running_hold
            )
        except BaseException:
            # Not when the message went out and an exception (a soft time limit's) landed
            # after: the marker stands for the queued reschedule.
            if marker is not None and not sent:
                self._drop_dedupe_marker(marker[0], marker[1], request.id, "a failed reschedule")
            raise
        finally:
            _republishing.reset(token)
        if deliver is not None:
            # This delivery ends with the reschedule, which waits with a time limit of
            # its own: the soft limit has nothing left to stop.
            logger.info(
                "%s[%s]: soft time limit reached as it was rescheduled", self.name, request.id
            )

    def _on_contended(
        self,
        request: Any,
        key: str,
        opts: TaskOptions,
        exc: LockContended,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        again: bool = False,
    ) -> None:
        """Decide what a run whose acquire met ``exc`` does; it always raises, but for
        returning (only with ``again``) when nobody holds the key any more: the run then
        tries once more at once, as a run coming a moment later would."""
        if not request.is_eager:
            try:
                holder = _holder(self.app, key, request.id or "")
            except interrupts.ASYNC:
                # Its time ran out while the holder was read: it fails as any job does
                # at its soft time limit, not as a skipped or contended one (before,
                # the read's failure read as "another holder": with "skip" the job was
                # reported skipped). A job that ends leaves no marker naming it.
                self._drop_dedupe_marker(key, opts, request.id, "its soft time limit")
                raise
            if holder == "matches":
                self._wait_for_own_run(request, key, opts, exc, args, kwargs)
            if holder == "free" and again:
                logger.debug(
                    "%s[%s]: %s was freed since its acquire failed; trying once more",
                    self.name,
                    request.id,
                    key,
                )
                return
        attempt = int(_header(request, CONTENTION_HEADER) or 0)
        policy: str = opts.on_contention
        if _header(request, OCCURRENCE_HEADER):
            # A beat occurrence whose previous run still holds the key: rescheduling
            # it would fire it twice, late. It is skipped.
            policy = "skip"
        if policy == "skip" and self._in_canvas(request):
            # A skipped chord member, chain step or group member would leave its canvas
            # waiting for a result that never comes: it waits for the key instead.
            policy = "retry"
        if request.is_eager:
            policy = "raise"
        if policy == "retry" and (
            opts.max_contention_retries is not None and attempt >= opts.max_contention_retries
        ):
            policy = "give_up"
        countdown = opts.contention_backoff.delay(attempt) if policy == "retry" else None
        signals.lock_contended.send(
            sender=self,
            key=key,
            task_id=request.id,
            action=policy,
            countdown=countdown,
            attempt=attempt,
        )
        if policy == "retry":
            assert countdown is not None
            log_limited(  # a storm of reschedules is one state: no line per job
                logger,
                logging.INFO,
                f"{self.name} contention",
                "%s[%s]: %s is held elsewhere; rescheduled in %.2fs (contention %d)",
                self.name,
                request.id,
                key,
                countdown,
                attempt + 1,
            )
            self._keep_queued_marker(request, key, opts, countdown)
            self._republish(
                request, args, kwargs, countdown, {CONTENTION_HEADER: attempt + 1}, (key, opts)
            )
            raise Retry(f"lock {printable(key)} contended", exc=exc, when=countdown)
        if policy == "skip":
            self._end_skipped(request, key, opts, "")
            raise Ignore()
        # This job ends here: a dedupe marker naming it would make later publishes
        # return a job that never runs (until the marker expires).
        self._drop_dedupe_marker(key, opts, request.id)
        if policy == "give_up":
            raise LockContended(
                f"{key!r} still held after {attempt} contention reschedules "
                f"(max_contention_retries={opts.max_contention_retries})",
                exc.key,
                exc.masters,
                exc.errors,
            ) from exc
        raise exc

    @staticmethod
    def _in_canvas(request: Any) -> bool:
        return _canvas_member(
            getattr(request, "callbacks", None),
            getattr(request, "errbacks", None),
            getattr(request, "chain", None),
            getattr(request, "chord", None),
            getattr(request, "group", None),
        )

    def _wait_for_own_run(
        self,
        request: Any,
        key: str,
        opts: TaskOptions,
        exc: LockContended,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
    ) -> None:
        """Reschedule a job whose own earlier run holds its key (that run's worker died).

        Whatever ``on_contention`` says: it is the same job, not a duplicate, so it is
        neither skipped nor failed nor counted as contention. Its lock expires within
        ``lock_ttl`` (nobody renews it), and then this job runs.
        """
        attempt = int(_header(request, OWN_RUN_HEADER) or 0)
        countdown = min(opts.contention_backoff.delay(attempt), opts.lock_ttl)
        log = logger.warning if attempt == 0 else logger.debug  # one line per job, not per wait
        log(
            "%s[%s]: %s is still held by an earlier run of this same job (its worker died?);"
            " waits for that lock to expire, rescheduled in %.2fs",
            self.name,
            request.id,
            key,
            countdown,
        )
        self._keep_queued_marker(request, key, opts, countdown)
        self._republish(
            request, args, kwargs, countdown, {OWN_RUN_HEADER: attempt + 1}, (key, opts)
        )
        raise Retry(
            f"lock {printable(key)} held by an earlier run of this job", exc=exc, when=countdown
        )

    def _on_unavailable(
        self,
        request: Any,
        key: str,
        opts: TaskOptions,
        exc: QuorumUnavailable,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        keep_marker: bool = False,
    ) -> None:
        """Reschedule a run that could not reach a quorum. Its marker is left as it is
        (the masters it needs are the ones not answering) unless ``keep_marker``: two
        failed tries may each have deleted it on a different minority."""
        if request.is_eager:
            raise exc
        attempt = int(_header(request, OUTAGE_HEADER) or 0)
        countdown = get_settings(self.app).outage_backoff.delay(attempt)
        log_limited(  # every job meets the outage: one line per period, not per job
            logger,
            logging.WARNING,
            f"{self.name} outage",
            "%s[%s]: lock service unavailable for %s (%s); rescheduled in %.2fs, not run",
            self.name,
            request.id,
            key,
            exc,
            countdown,
        )
        signals.lock_unavailable.send(
            sender=self, key=key, task_id=request.id, countdown=countdown, errors=exc.errors
        )
        if keep_marker:
            self._keep_queued_marker(request, key, opts, countdown)
        self._republish(request, args, kwargs, countdown, {OUTAGE_HEADER: attempt + 1}, (key, opts))
        raise Retry(f"lock service unavailable for {printable(key)}", exc=exc, when=countdown)

    def _end_skipped(self, request: Any, key: str, opts: TaskOptions, when: str) -> None:
        """End a job skipped on contention: its dedupe marker, a log line, its result.

        The caller sends ``lock_contended`` and, in a run, raises ``Ignore``.
        """
        self._drop_dedupe_marker(key, opts, request.id)
        logger.info(
            "%s[%s]: %s is held elsewhere; skipped%s",
            self.name,
            request.id,
            key,
            f" {when}" if when else "",
        )
        self._store_skipped(request, key, opts)

    def _keep_queued_marker(
        self, request: Any, key: str, opts: TaskOptions, countdown: float
    ) -> None:
        """Best effort: a ``"queued"`` job rescheduled to wait for its key stays the queued
        job of that key, so identical publishes keep coalescing into it.

        Its failed acquire deleted the marker on every master that granted the lock (a
        minority): left so, the marker might no longer hold a quorum, and an identical
        publish would become a second job. Claiming it again restores it where it went
        (a master that still has it, naming this job, counts as the claim's).
        """
        if opts.dedupe != "queued" or not request.id or self._in_canvas(request):
            return  # a canvas member never had a marker: identical publishes stay apart
        if self._request_unlike(request):
            return  # it took no marker when published (see apply_async): nor now
        try:
            ttl = get_settings(self.app).dedupe_ttl + countdown
            holder, _ = redlock_for(self.app).claim(
                key, self.dedupe_suffix(), request.id, ttl, guard_for=0
            )
        except interrupts.ASYNC:
            # Its soft time limit: the job fails here rather than waiting (it is not
            # rescheduled), so no marker may name it.
            self._drop_dedupe_marker(key, opts, request.id, "its soft time limit")
            raise
        except Exception as exc:  # noqa: BLE001 - best effort: the job is rescheduled anyway
            logger.warning(
                "%s[%s]: dedupe marker of %s not restored for its reschedule: %s",
                self.name,
                request.id,
                key,
                exc,
            )
            return
        if holder != request.id:
            logger.info(
                "%s[%s]: rescheduled beside job %s, queued for %s",
                self.name,
                request.id,
                holder,
                key,
            )

    def _claim_marker(
        self,
        opts: TaskOptions,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        task_id: str | None,
        options: Mapping[str, Any],
    ) -> str | None:
        """Best effort: make ``task_id`` the queued job of its key again (a retry waits).

        Returns the key whose marker now names ``task_id``, None when none does (the
        claim failed, or another job holds the marker)."""
        if not task_id:
            return None
        try:
            key = self._publish_key(opts, args, kwargs, options)
            ttl = get_settings(self.app).dedupe_ttl + _delay_of(options, self.app.timezone)
            holder, _ = redlock_for(self.app).claim(
                key, self.dedupe_suffix(), task_id, ttl, guard_for=0
            )
        except interrupts.ASYNC:
            raise  # its soft time limit, past the hold (see retry()): the retry is not sent
        except Exception as exc:  # noqa: BLE001 - best effort: the retry is published anyway
            logger.warning("%s[%s]: no dedupe marker for its retry: %s", self.name, task_id, exc)
            return None
        if holder != task_id:
            logger.info("%s[%s]: retry queued beside job %s (%s)", self.name, task_id, holder, key)
            return None
        return key

    def _drop_dedupe_marker(
        self, key: str, opts: TaskOptions | None, task_id: str | None, why: str = ""
    ) -> bool:
        """Best effort: remove the dedupe marker of ``key`` if it names ``task_id``.

        ``opts=None`` when the job's options are not known (the main process after a
        kill: a per-call ``dedupe`` travels in a header it may not have): the marker is
        removed whatever ``dedupe`` says. A failure (too few masters answered, so the
        marker may stand) is logged, never raised; returns False then.
        """
        if (opts is not None and opts.dedupe is None) or not task_id:
            return True
        try:
            redlock_for(self.app).unclaim(key, self.dedupe_suffix(), task_id)
        except interrupts.ASYNC:
            # Cut short by the job's soft time limit, which comes once: removed once more,
            # then the job fails with it (a marker left would name a job that ended).
            self._drop_dedupe_marker(key, opts, task_id, why)
            raise
        except Exception as exc:
            logger.warning(
                "%s[%s]: could not clear dedupe marker of %s%s; identical publishes may"
                " return this job until the marker expires (redlock_dedupe_ttl): %s",
                self.name,
                task_id,
                key,
                f" after {why}" if why else "",
                exc,
                exc_info=not isinstance(exc, RedlockError),
            )
            return False
        return True

    def _store_skipped(self, request: Any, key: str, opts: TaskOptions) -> None:
        """Store what ``skip_result`` says: FAILURE with :class:`LockContended` (a ready
        state: ``.get()`` raises at once), or IGNORED (``.get()`` waits for its timeout)."""
        if self.ignore_result or getattr(request, "ignore_result", False):
            return
        result: Any
        if opts.skip_result == "ignored":
            state, result = states.IGNORED, {"reason": "lock contended", "key": key}
        else:
            state = states.FAILURE
            result = LockContended(
                f"{key!r} was held by another run; this job was skipped (on_contention='skip')",
                key,
                redlock_for(self.app).master_names,
            )
        try:
            self.backend.store_result(request.id, result, state, request=request)
        except NotImplementedError:
            pass  # no result backend configured
        except interrupts.ASYNC:
            raise  # its soft time limit: the job fails with it, and that result is stored
        except Exception:
            logger.warning("could not store %s for %s", state, request.id, exc_info=True)

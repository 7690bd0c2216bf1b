"""``held_back``: the soft time limit's signal held back while SingletonTask publishes.

In the main thread with billiard's ``SIGUSR1`` handler installed (as in a prefork pool's
process), with real signals sent to this process. No Redis is needed.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from billiard.pool import soft_timeout_sighandler
from celery.exceptions import Retry, SoftTimeLimitExceeded

from celery_redlock.softlimit import HOLD_FOR, held_back, hold_for

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def billiards_handler() -> Iterator[None]:
    previous = signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _signal_self() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)


def test_a_signal_during_the_publish_is_held_until_the_caller_delivers_it(
    billiards_handler: None,
) -> None:
    steps: list[str] = []

    def publish() -> str:
        _signal_self()
        steps.append("published")  # reached: the signal did not land in the publish
        return "sent"

    result, deliver = held_back(publish)
    assert (result, steps) == ("sent", ["published"])
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler
    assert deliver is not None
    with pytest.raises(SoftTimeLimitExceeded):
        deliver()


def test_no_signal_nothing_to_deliver(billiards_handler: None) -> None:
    assert held_back(lambda: 7) == (7, None)
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler


def test_a_publish_that_fails_delivers_a_held_signal_from_its_exception(
    billiards_handler: None,
) -> None:
    def publish() -> None:
        _signal_self()
        raise ConnectionError("broker gone")

    with pytest.raises(SoftTimeLimitExceeded) as caught:
        held_back(publish)
    assert isinstance(caught.value.__context__, ConnectionError)
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler


def test_a_publish_that_fails_without_a_signal_raises_its_own_exception(
    billiards_handler: None,
) -> None:
    def publish() -> None:
        raise ConnectionError("broker gone")

    with pytest.raises(ConnectionError):
        held_back(publish)
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler


def test_nested_publishes_hold_it_once_and_deliver_it_once(billiards_handler: None) -> None:
    """A reschedule publishes through apply_async, which holds it again: the inner call
    sees the outer's handler, not billiard's, and leaves it alone."""
    inner: list[Any] = []

    def outer() -> None:
        inner.append(held_back(_signal_self))

    _, deliver = held_back(outer)
    assert inner == [(None, None)]
    assert deliver is not None
    with pytest.raises(SoftTimeLimitExceeded):
        deliver()


def test_other_handlers_and_threads_are_left_alone() -> None:
    """Without billiard's handler (a web process: gunicorn's, or none), or off the main
    thread, the publish runs as it is: nothing is swapped."""
    seen: list[Any] = []

    def note(signum: int, frame: Any) -> None:
        seen.append(signum)

    previous = signal.signal(signal.SIGUSR1, note)
    try:
        assert held_back(lambda: signal.getsignal(signal.SIGUSR1)) == (note, None)
        with_billiard = signal.signal(signal.SIGUSR1, soft_timeout_sighandler)
        assert with_billiard is note
        found: list[Any] = []
        thread = threading.Thread(target=lambda: found.append(held_back(lambda: 1)))
        thread.start()
        thread.join(10)
        assert found == [(1, None)]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_call_that_stalls_is_interrupted_once_the_hold_is_over(billiards_handler: None) -> None:
    """A publish to a broker that stopped answering: held for ever, the soft limit would
    reach the job only as its hard limit's kill. Past ``HOLD_FOR`` it interrupts the
    call, as it would have without the hold, and is not delivered again."""
    left, right = socket.socketpair()
    try:
        right.settimeout(20)  # nothing is ever sent: a stalled reply

        def publish() -> bytes:
            _signal_self()
            return right.recv(1)

        with pytest.raises(SoftTimeLimitExceeded) as caught:
            held_back(publish, hold=0.1)
    finally:
        left.close()
        right.close()
    # Raised into the stalled call, not delivered once the call gave up (held until then,
    # a broker that never answers would have kept it until the hard limit's kill).
    assert not isinstance(caught.value.__context__, TimeoutError)
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler


def test_an_exception_that_ends_the_delivery_takes_the_held_signal_with_it(
    billiards_handler: None,
) -> None:
    """``retry()``'s ``Retry``: the retry went out and this delivery ends with it; the
    soft limit has nothing left to stop."""

    def retry() -> None:
        _signal_self()
        raise Retry("retried")

    with pytest.raises(Retry):
        held_back(retry, ends=(Retry,))
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler


def test_a_soft_limit_in_the_serializers_round_trip_is_not_the_arguments_failure() -> None:
    """kombu re-raises whatever a serializer raised as its ``EncodeError``: the dedupe
    key's round trip took a soft limit landing there for arguments that do not serialize,
    and built the key from them as given (the job ran past its soft limit)."""
    from kombu.serialization import register, unregister

    from celery_redlock.identity import wire_arguments

    def dumps(value: Any) -> str:
        raise SoftTimeLimitExceeded()

    register("soft-limit-test", dumps, lambda data: data, "application/x-soft-limit-test")
    try:
        with pytest.raises(SoftTimeLimitExceeded):
            wire_arguments((1, object()), {}, "soft-limit-test")
    finally:
        unregister("soft-limit-test")


def test_a_call_slower_than_usual_but_within_the_hold_is_not_interrupted(
    billiards_handler: None,
) -> None:
    """Third review: a fixed 0.25 s hold interrupted a retry's publish through a broker
    slow for 0.7 s (Celery then rejected the job: no retry went out), and a body's publish
    whose reply came late (its marker was dropped though the job was queued: an identical
    publish became a second job), with the hard limit seconds away."""
    left, right = socket.socketpair()
    try:
        right.settimeout(5)
        threading.Timer(0.4, left.sendall, (b"+",)).start()  # the reply, late

        def publish() -> bytes:
            _signal_self()
            return right.recv(1)

        result, deliver = held_back(publish, hold=hold_for(_Running(soft=1, hard=10)))
    finally:
        left.close()
        right.close()
    assert result == b"+"
    assert deliver is not None
    with pytest.raises(SoftTimeLimitExceeded):
        deliver()


def test_a_soft_limit_delivered_into_the_call_and_swallowed_there_is_delivered_again(
    billiards_handler: None,
) -> None:
    """Third review: delivered into a stalled publish, the soft limit landed in a signal
    receiver (``after_task_publish``), whose ``except Exception`` in Celery's dispatch
    logged and swallowed it; the publish returned and the body ran on to its hard limit's
    kill."""
    left, right = socket.socketpair()
    swallowed: list[BaseException] = []
    try:
        right.settimeout(20)

        def publish() -> str:
            _signal_self()
            try:
                right.recv(1)
            except Exception as exc:  # noqa: BLE001 - as Celery's Signal.send does
                swallowed.append(exc)
            return "sent"

        result, deliver = held_back(publish, hold=0.1)
    finally:
        left.close()
        right.close()
    assert [type(exc) for exc in swallowed] == [SoftTimeLimitExceeded]
    assert result == "sent"
    assert deliver is not None
    with pytest.raises(SoftTimeLimitExceeded):
        deliver()


def test_the_handler_is_restored_when_the_wake_up_comes_as_the_call_returns(
    billiards_handler: None,
) -> None:
    """Third review: the hold's wake-up, handled at the first instruction of the cleanup
    after the call returned (the call ended in C code holding the GIL through the timer's
    moment), raised out of it before billiard's handler was put back: the spent stand-in
    stayed, and every later soft limit of that process was ignored."""
    started = time.perf_counter()
    sum(range(1_000_000))
    per_million = max(time.perf_counter() - started, 1e-6)
    n = int(1_000_000 * 0.4 / per_million)  # about 0.4 s of C work holding the GIL

    def publish() -> int:
        _signal_self()
        return sum(range(n))

    try:
        _, deliver = held_back(publish, hold=0.05)
    except SoftTimeLimitExceeded:
        deliver = None  # delivered into the call: fine, as long as the handler is back
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler
    if deliver is not None:
        with pytest.raises(SoftTimeLimitExceeded):
            deliver()


class _Running:
    """A running task's time limits, as :func:`hold_for` reads them."""

    def __init__(
        self,
        soft: float | None = None,
        hard: float | None = None,
        message: tuple[float | None, float | None] | None = None,
        conf: tuple[float | None, float | None] = (None, None),
    ) -> None:
        self.soft_time_limit, self.time_limit = soft, hard
        self.request = type("Request", (), {"timelimit": message})()
        conf_hard, conf_soft = conf
        self.app = type(
            "App",
            (),
            {
                "conf": type(
                    "Conf", (), {"task_time_limit": conf_hard, "task_soft_time_limit": conf_soft}
                )()
            },
        )()


@pytest.mark.parametrize(
    ("running", "expected"),
    [
        (None, 0.0),  # no running job found: its limits are not known
        (_Running(soft=1, hard=10), 4.5),
        (_Running(soft=1), HOLD_FOR),  # no hard limit: nothing kills the process
        (_Running(hard=10), 0.0),  # a revoke's signal: how much of the limit is left is unknown
        (_Running(soft=1, hard=10, message=(4, 2)), 1.0),  # the message's own limits
        (_Running(message=(None, 3), conf=(9, None)), 3.0),
        (_Running(conf=(30, 10)), 10.0),
        (_Running(soft=5, hard=5), 0.0),
    ],
)
def test_the_hold_is_half_the_time_between_the_soft_and_hard_limits(
    running: Any, expected: float
) -> None:
    assert hold_for(running) == expected


def test_billiards_handler_is_put_back_when_another_threads_exception_lands_at_the_swap(
    billiards_handler: None,
) -> None:
    """Fourth review: ``on_lock_lost="interrupt"`` raises LockLostInterrupt into the task's
    thread from the renewal thread (``PyThreadState_SetAsyncExc``). Landing right after the
    swap to the stand-in, before the ``try`` that swaps back (or at the first instruction of
    ``signal.signal``, a Python function, as it swapped back), it left the stand-in in place:
    every later soft limit of that process was only noted, and ignored."""
    import _signal  # type: ignore[import-not-found]
    import ctypes
    import sys

    from celery_redlock.softlimit import _Held

    class RaisedFromAnotherThread(Exception):
        pass

    injected: list[bool] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if (
            event == "c_return"
            and arg is _signal.signal
            and not injected
            and isinstance(signal.getsignal(signal.SIGUSR1), _Held)
        ):
            injected.append(True)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(threading.get_ident()), ctypes.py_object(RaisedFromAnotherThread)
            )

    sys.setprofile(profile)
    try:
        with pytest.raises(RaisedFromAnotherThread):
            held_back(lambda: 1)
    finally:
        sys.setprofile(None)
    assert injected == [True]
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler


def test_the_workers_own_limits_count_when_neither_the_message_nor_the_task_sets_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fourth review: ``celery worker --soft-time-limit=1 --time-limit=3`` reaches only the
    pool; the hold, seeing no limits, lasted 5 s, and the hard limit killed the process
    at 3 s where the soft limit used to reach the body."""
    from celery_redlock import softlimit

    monkeypatch.setattr(softlimit, "_worker_limits", (None, None))
    softlimit.set_worker_limits(3, 1)
    assert hold_for(_Running()) == 1.0
    assert hold_for(_Running(soft=2, hard=10)) == 4.0  # the task's own come first
    assert hold_for(_Running(message=(5, 4))) == 0.5  # and the message's before them


def test_with_only_a_hard_limit_nothing_is_held(billiards_handler: None) -> None:
    """Fifth review: ``revoke(terminate=True, signal="SIGUSR1")`` on a task with a hard limit
    and no soft one: the 5 s hold outlasted the time left, and the hard limit killed the
    process where the body used to get the soft limit and clean up."""

    def publish() -> None:
        _signal_self()

    with pytest.raises(SoftTimeLimitExceeded):
        held_back(publish, hold=hold_for(_Running(hard=3)))
    assert signal.getsignal(signal.SIGUSR1) is soft_timeout_sighandler

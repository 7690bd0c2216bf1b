"""``held_back``: the soft time limit's signal held back while SingletonTask publishes.

In the main thread with billiard's ``SIGUSR1`` handler installed (as in a prefork pool's
process), with real signals sent to this process. No Redis is needed.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from billiard.pool import soft_timeout_sighandler
from celery.exceptions import Retry, SoftTimeLimitExceeded

from celery_redlock.softlimit import HOLD_FOR, held_back

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
        right.settimeout(20 * HOLD_FOR + 5)  # nothing is ever sent: a stalled reply

        def publish() -> bytes:
            _signal_self()
            return right.recv(1)

        with pytest.raises(SoftTimeLimitExceeded) as caught:
            held_back(publish)
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
